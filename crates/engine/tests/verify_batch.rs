//! How `CowEngine` hands blocks to a verifier that checks runs: every block of a
//! read exactly once, with the bytes the read returns, in runs of an even number of
//! blocks (so paired hashing keeps its pairs), and a failure names the first bad block.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use engine::{BlockDevice, BlockVerifier, CowEngine, CowEngineOptions, EngineError};

fn vectors() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/aosp-cow-vectors")
}

/// Checks every block against the expected image and records each call.
struct Recording {
    want: Vec<u8>,
    bad: Vec<u64>,
    /// (first block, bytes, whether it came through `verify_blocks`)
    calls: Mutex<Vec<(u64, usize, bool)>>,
}

impl Recording {
    fn new(size: usize, bad: &[u64]) -> Arc<Self> {
        let mut want = std::fs::read(vectors().join("expected.img")).unwrap();
        want.truncate(size);
        Arc::new(Recording {
            want,
            bad: bad.to_vec(),
            calls: Mutex::new(Vec::new()),
        })
    }

    fn check(&self, first: u64, data: &[u8]) -> Result<(), (u64, String)> {
        for (i, d) in data.chunks(4096).enumerate() {
            let block = first + i as u64;
            let at = block as usize * 4096;
            assert!(d == &self.want[at..(at + 4096).min(self.want.len())]);
            if self.bad.contains(&block) {
                return Err((block, "hash mismatch".into()));
            }
        }
        Ok(())
    }

    fn take(&self) -> Vec<(u64, usize, bool)> {
        let mut calls = std::mem::take(&mut *self.calls.lock().unwrap());
        calls.sort_unstable();
        calls
    }
}

impl BlockVerifier for Recording {
    fn verify(&self, block: u64, data: &[u8]) -> Result<(), String> {
        self.calls.lock().unwrap().push((block, data.len(), false));
        self.check(block, data).map_err(|(_, m)| m)
    }

    fn verify_blocks(&self, first_block: u64, data: &[u8]) -> Result<(), (u64, String)> {
        self.calls
            .lock()
            .unwrap()
            .push((first_block, data.len(), true));
        self.check(first_block, data)
    }
}

fn engine(size: u64, v: Arc<Recording>) -> CowEngine {
    let opts = CowEngineOptions {
        size: Some(size),
        ..CowEngineOptions::default()
    };
    let mut e = CowEngine::open(
        &vectors().join("base.img"),
        &vectors().join("v3_lz4_65536.cow"),
        &opts,
    )
    .unwrap();
    e.set_verifier(v);
    e
}

/// The calls cover blocks `first..end` once each, in order, and every batched run
/// but the last is a whole, even number of blocks.
fn assert_covers(calls: &[(u64, usize, bool)], first: u64, end: u64) {
    let mut next = first;
    for (i, &(b, len, batched)) in calls.iter().enumerate() {
        assert_eq!(b, next, "{calls:?}");
        next += (len as u64).div_ceil(4096);
        if batched && i + 1 < calls.len() && calls[i + 1].2 {
            assert_eq!(len % 8192, 0, "{calls:?}");
        }
    }
    assert_eq!(next, end, "{calls:?}");
}

#[test]
fn large_reads_are_verified_in_even_runs() {
    let size = 4 << 20;
    let v = Recording::new(size, &[]);
    let e = engine(size as u64, v.clone());
    let mut buf = vec![0u8; 1 << 20];
    e.read_at(&mut buf, 4096).unwrap();
    assert!(buf[..] == v.want[4096..4096 + (1 << 20)]);
    let calls = v.take();
    assert!(calls.iter().all(|c| c.2), "{calls:?}");
    if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        assert!(calls.len() > 1, "1 MiB is split across the pool: {calls:?}");
    }
    assert_covers(&calls, 1, 257);

    // Unaligned at both ends: the partial blocks alone, the rest batched.
    e.read_at(&mut buf[..(1 << 20) - 100], 4096 + 50).unwrap();
    let calls = v.take();
    assert_covers(&calls, 1, 257);
    assert_eq!(calls[0], (1, 4096, false));
    assert_eq!(*calls.last().unwrap(), (256, 4096, false));

    // Small reads go to the verifier as one run.
    e.read_at(&mut buf[..5 * 4096], 7 * 4096).unwrap();
    assert_eq!(v.take(), [(7, 5 * 4096, true)]);
    e.read_at(&mut buf[..10], 9 * 4096 + 3).unwrap();
    assert_eq!(v.take(), [(9, 4096, false)]);
}

#[test]
fn the_short_last_block_is_checked_in_place() {
    let size = (4 << 20) - 1000;
    let v = Recording::new(size, &[]);
    let e = engine(size as u64, v.clone());
    let mut buf = vec![0u8; 1 << 20];
    let at = size as u64 - buf.len() as u64;
    // Aligned start to the device's end: one batch including the short block, no re-read.
    let n = (size % 4096) + (1 << 19);
    e.read_at(&mut buf[..n], size as u64 - n as u64).unwrap();
    let calls = v.take();
    assert!(calls.iter().all(|c| c.2), "{calls:?}");
    assert_covers(&calls, 895, 1024);
    assert_eq!(calls.last().unwrap().1 % 4096, 4096 - 1000);
    // Unaligned start: the first block alone, the short last one in the batch.
    e.read_at(&mut buf, at).unwrap();
    assert!(buf[..] == v.want[at as usize..]);
    let calls = v.take();
    assert_eq!(calls[0], (at / 4096, 4096, false));
    assert_covers(&calls, at / 4096, 1024);
    // Inside the short block only.
    e.read_at(&mut buf[..10], size as u64 - 20).unwrap();
    assert_eq!(v.take(), [(1023, 4096 - 1000, false)]);
}

#[test]
fn a_failed_run_names_the_first_bad_block() {
    let size = 4 << 20;
    // Bad blocks in different runs of a 1 MiB read: the lower one is reported.
    let v = Recording::new(size, &[201, 77]);
    let e = engine(size as u64, v.clone());
    let mut buf = vec![0u8; 1 << 20];
    let err = e.read_at(&mut buf, 0).unwrap_err();
    assert!(
        matches!(err, EngineError::Verify { block: 77, .. }),
        "{err}"
    );
    assert_eq!(err.errno(), libc::EIO);
    let err = e.read_at(&mut buf[..16 * 4096], 190 * 4096).unwrap_err();
    assert!(
        matches!(err, EngineError::Verify { block: 201, .. }),
        "{err}"
    );
    let err = e.read_at(&mut buf[..1], 77 * 4096 + 4095).unwrap_err();
    assert!(
        matches!(err, EngineError::Verify { block: 77, .. }),
        "{err}"
    );
    e.read_at(&mut buf[..4096], 78 * 4096).unwrap();
}

#[test]
fn a_separate_check_sees_the_same_blocks_on_the_calling_thread() {
    let size = 4 << 20;
    let v = Recording::new(size, &[700]);
    let e = engine(size as u64, v.clone());
    assert!(e.separate_check());
    // The unchecked read returns the image's bytes without calling the verifier.
    let mut buf = vec![0u8; 2 << 20];
    e.read_unchecked(&mut buf, 0).unwrap();
    assert!(buf[..] == v.want[..2 << 20]);
    assert_eq!(v.take(), []);
    // The check: one run on this thread (no pool split), the short last block included.
    e.check(&buf, 0).unwrap();
    assert_eq!(v.take(), [(0, 2 << 20, true)]);
    e.read_unchecked(&mut buf, 2 << 20).unwrap();
    let err = e.check(&buf, 2 << 20).unwrap_err();
    assert!(
        matches!(err, EngineError::Verify { block: 700, .. }),
        "{err}"
    );
    assert!(e.check(&buf, (size - 4096) as u64).is_err(), "out of range");
    // Without a verifier there is nothing to separate.
    let plain = CowEngine::open(
        &vectors().join("base.img"),
        &vectors().join("v3_lz4_65536.cow"),
        &CowEngineOptions::default(),
    )
    .unwrap();
    assert!(!plain.separate_check());
}

#[test]
fn read_ahead_chunks_are_checked_before_they_are_served() {
    use engine::{Readahead, ReadaheadOptions};
    let size = 4 << 20;
    let v = Recording::new(size, &[700]);
    let ra_stats = std::sync::Arc::new(engine::ReadaheadStats::default());
    let ra = Readahead::new(
        engine(size as u64, v.clone()),
        ReadaheadOptions {
            depth: 1 << 20,
            chunk: 128 << 10,
            threads: 2,
            check_threads: 2,
            stats: ra_stats.clone(),
        },
    )
    .unwrap();
    // A sequential stream of 64 KiB requests: every block is checked (some by the
    // checker threads, some by requests that outran them), the bad one fails its
    // request only.
    let mut buf = vec![0u8; 64 << 10];
    let mut failed = Vec::new();
    for off in (0..size as u64).step_by(buf.len()) {
        match ra.read_at(&mut buf, off) {
            Ok(()) => assert!(buf[..] == v.want[off as usize..off as usize + buf.len()]),
            Err(e) => {
                assert!(matches!(e, EngineError::Verify { block: 700, .. }), "{e}");
                failed.push(off);
            }
        }
    }
    assert_eq!(failed, [700 * 4096 / (64 << 10) * (64 << 10)]);
    let calls = v.take();
    let chunk_checks = calls.iter().filter(|c| c.1 == 128 << 10).count();
    assert!(chunk_checks > 10, "{chunk_checks} chunks checked whole");
    // The counters agree: the bad block's chunk failed its check, the request over it
    // read the device itself.
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let st = &ra_stats;
    assert_eq!(n(&st.failed_chunks), 1);
    assert!(n(&st.chunks) + 1 >= chunk_checks as u64, "{st:?}");
    assert!(n(&st.hits) > 20 && n(&st.misses) >= 1, "{st:?}");
    // Every request of the stream (64 KiB, large enough to count) is one or the other.
    assert_eq!(n(&st.hits) + n(&st.misses), 64, "{st:?}");
    let mut checked = vec![0u32; size / 4096];
    for (first, len, _) in calls {
        for b in first..first + (len as u64).div_ceil(4096) {
            checked[b as usize] += 1;
        }
    }
    assert!(checked.iter().all(|&n| n >= 1), "every block checked");
    assert!(
        checked.iter().filter(|&&n| n == 1).count() > size / 4096 / 2,
        "most blocks checked once, from the chunks"
    );
}
