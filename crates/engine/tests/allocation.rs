//! `BlockDevice::allocation`: which runs of the new image read as zeros with nothing
//! stored (ZERO ops, holes of the base where no op writes) and which are data, as NBD
//! block status reports them. Every zero run must really read as zeros, and any
//! sub-range must get the same map, clipped.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use cow::{CowWriter, WriterOptions};
use engine::{Allocation, BlockDevice, CowEngine, CowEngineOptions, FileDevice};

const BS: u64 = 4096;
const BLOCKS: u64 = 64;

/// A sparse base (blocks 8..40 a hole) and a COW with ZERO ops at 2..4, a COPY into the
/// hole at 10 and a REPLACE at 50..52.
fn make(dir: &Path) {
    let base = std::fs::File::create(dir.join("base.img")).unwrap();
    base.set_len(BLOCKS * BS).unwrap();
    let block = |b: u64| vec![(b as u8) | 1; BS as usize];
    for b in (0..8).chain(40..BLOCKS) {
        base.write_all_at(&block(b), b * BS).unwrap();
    }
    base.sync_all().unwrap();
    let opts = WriterOptions {
        max_blocks: Some(BLOCKS),
        ..Default::default()
    };
    let mut w = CowWriter::create(dir.join("update.cow"), opts).unwrap();
    w.add_zero_blocks(2, 2).unwrap();
    w.add_copy(10, 45, 1).unwrap();
    w.add_raw_blocks(50, &[7u8; 2 * BS as usize]).unwrap();
    w.finalize().unwrap();
}

fn runs(v: &[(u64, bool)]) -> Vec<Allocation> {
    v.iter()
        .map(|&(blocks, zero)| Allocation {
            len: blocks * BS,
            zero,
        })
        .collect()
}

/// `full` clipped to `[offset, offset + len)`.
fn clip(full: &[Allocation], offset: u64, len: u64) -> Vec<Allocation> {
    let mut out = Vec::new();
    let mut at = 0;
    for r in full {
        let (s, e) = (at.max(offset), (at + r.len).min(offset + len));
        if s < e {
            engine::push_allocation(&mut out, e - s, r.zero);
        }
        at += r.len;
    }
    out
}

#[test]
fn zero_ops_and_base_holes_are_zero_and_the_rest_is_data() {
    let tmp = tempfile::tempdir().unwrap();
    make(tmp.path());
    let eng = CowEngine::open(
        &tmp.path().join("base.img"),
        &tmp.path().join("update.cow"),
        &CowEngineOptions::default(),
    )
    .unwrap();
    let size = eng.size();
    assert_eq!(size, BLOCKS * BS);
    let full = eng.allocation(0, size).unwrap();
    assert_eq!(
        full,
        runs(&[
            (2, false),
            (2, true),
            (4, false),
            (2, true),
            (1, false),
            (29, true),
            (24, false)
        ])
    );
    // Zero runs read as zeros.
    let mut at = 0;
    for r in &full {
        if r.zero {
            let mut buf = vec![0xa5u8; r.len as usize];
            eng.read_at(&mut buf, at).unwrap();
            assert!(buf.iter().all(|&b| b == 0), "run at {at}");
        }
        at += r.len;
    }
    // Any sub-range, aligned or not, gets the same map.
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    for _ in 0..500 {
        let x = rng.u64(..);
        let offset = x % size;
        let len = (x >> 20) % (size - offset) + 1;
        assert_eq!(
            eng.allocation(offset, len).unwrap(),
            clip(&full, offset, len),
            "{offset} + {len}"
        );
    }
    assert!(eng.allocation(size - 1, 2).is_err(), "past the end");
    assert_eq!(eng.allocation(size, 0).unwrap(), vec![]);

    // The base alone: its hole.
    let base = FileDevice::open(&tmp.path().join("base.img"), false).unwrap();
    assert_eq!(
        base.allocation(0, size).unwrap(),
        runs(&[(8, false), (32, true), (24, false)])
    );
}

struct AcceptAll;
impl engine::BlockVerifier for AcceptAll {
    fn verify(&self, _block: u64, _data: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn a_verified_device_reports_only_data() {
    let tmp = tempfile::tempdir().unwrap();
    make(tmp.path());
    let mut eng = CowEngine::open(
        &tmp.path().join("base.img"),
        &tmp.path().join("update.cow"),
        &CowEngineOptions::default(),
    )
    .unwrap();
    eng.set_verifier(Arc::new(AcceptAll));
    // A client skipping a zero run would skip its check.
    assert_eq!(
        eng.allocation(0, BLOCKS * BS).unwrap(),
        runs(&[(BLOCKS, false)])
    );
}
