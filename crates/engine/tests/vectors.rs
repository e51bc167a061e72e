//! The engine against AOSP-written COW vectors: every read, at any alignment, from any
//! number of threads, must equal `expected.img` byte for byte.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use engine::{
    BlockDevice, BlockVerifier, CowEngine, CowEngineOptions, EngineError, FileDevice, MergeGuard,
    MergeHook, MergeRedirect,
};

fn vectors() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/aosp-cow-vectors")
}

const COWS: &[&str] = &[
    "v2_none_4096.cow",
    "v2_gz_4096.cow",
    "v2_lz4_4096.cow",
    "v2_zstd_4096.cow",
    "v2_brotli_4096.cow",
    "v3_none_4096.cow",
    "v3_gz_4096.cow",
    "v3_brotli_4096.cow",
    "v3_zstd_16384.cow",
    "v3_lz4_65536.cow",
    "v3_lz4_262144.cow",
    "v3_lz4_4096_badseq.cow",
];

fn expected() -> Vec<u8> {
    std::fs::read(vectors().join("expected.img")).unwrap()
}

fn open(cow: &str, opts: &CowEngineOptions) -> CowEngine {
    CowEngine::open(&vectors().join("base.img"), &vectors().join(cow), opts).unwrap()
}

#[test]
fn whole_image_matches_expected_for_every_vector() {
    let want = expected();
    for direct in [true, false] {
        for cow in COWS {
            let e = open(
                cow,
                &CowEngineOptions {
                    direct_io: direct,
                    ..Default::default()
                },
            );
            assert_eq!(e.size(), want.len() as u64, "{cow}");
            let mut buf = engine::AlignedBuf::new(want.len());
            let out = buf.slice_mut(want.len());
            e.read_at(out, 0).unwrap();
            assert!(
                out == &want[..],
                "{cow} direct={direct}: whole-image read differs"
            );
        }
    }
}

/// Every decode-pool design gives the same bytes, and the hand-offs to it are timed.
#[test]
fn every_decode_pool_design_reads_the_expected_image() {
    let want = expected();
    for design in [
        engine::PoolDesign::Shared,
        engine::PoolDesign::PerCpu,
        engine::PoolDesign::PerCpuFifo,
    ] {
        for cow in ["v3_lz4_65536.cow", "v3_zstd_16384.cow", "v2_gz_4096.cow"] {
            let e = open(
                cow,
                &CowEngineOptions {
                    decode_pool: design,
                    cache_bytes: 0,
                    ..Default::default()
                },
            );
            e.stats().queue_delays.sample();
            let mut buf = vec![0u8; want.len()];
            // Whole-image and 1 MiB reads: several units per request, so the pool works.
            e.read_at(&mut buf, 0).unwrap();
            assert!(buf == want, "{cow} {design:?}: whole-image read differs");
            for off in (0..want.len()).step_by(1 << 20) {
                let len = (want.len() - off).min(1 << 20);
                e.read_at(&mut buf[..len], off as u64).unwrap();
                assert!(
                    buf[..len] == want[off..off + len],
                    "{cow} {design:?}: read at {off}"
                );
            }
            let samples = e.stats().queue_delays.take_samples();
            assert_eq!(
                samples.len() as u64,
                e.stats().queue_delays.histogram.snapshot().count,
                "{cow} {design:?}"
            );
        }
    }
}

#[test]
fn unaligned_random_reads_match() {
    let want = expected();
    for cow in COWS {
        let e = open(cow, &CowEngineOptions::default());
        let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..400 {
            let off = rng.u64(..) % want.len() as u64;
            let max = (want.len() as u64 - off).min(300_000);
            let len = (rng.u64(..) % max + 1) as usize;
            e.read_at(&mut buf[..len], off).unwrap();
            assert!(
                buf[..len] == want[off as usize..off as usize + len],
                "{cow}: read of {len} bytes at {off} differs"
            );
        }
        // Every single byte boundary around the interesting ops (XOR straddling blocks,
        // the multi-block run, ZERO).
        for block in [10u64, 20, 100, 101, 115, 116, 117, 118, 200, 203, 300, 301] {
            for (off, len) in [(0, 1), (1, 4095), (4095, 2), (4000, 8192), (17, 100)] {
                let o = block * 4096 + off;
                e.read_at(&mut buf[..len], o).unwrap();
                assert!(
                    buf[..len] == want[o as usize..o as usize + len],
                    "{cow}: {len} bytes at {o}"
                );
            }
        }
    }
}

#[test]
fn agrees_with_the_cow_crate_snapshot_view() {
    for cow in COWS {
        let reader = cow::CowReader::open(vectors().join(cow)).unwrap();
        let base_path = vectors().join("base.img");
        let base = std::fs::File::open(&base_path).unwrap();
        let view = cow::SnapshotView::new(&reader, &base, &base_path, None).unwrap();
        let mut a = vec![0u8; view.size() as usize];
        view.read_blocks(0, &mut a).unwrap();
        let e = open(cow, &CowEngineOptions::default());
        let mut b = vec![0u8; a.len()];
        e.read_at(&mut b, 0).unwrap();
        assert!(a == b, "{cow}");
    }
}

#[test]
fn aosp_fixture_with_unaligned_xor_and_merged_ops() {
    // AOSP's own v2 fixture: COPY, REPLACE, XOR at byte 24*4096+10, ZERO run.
    let cow = vectors().join("aosp-testdata/cow_v2");
    let base_path = vectors().join("base.img");
    let reader = cow::CowReader::open(&cow).unwrap();
    let base = std::fs::File::open(&base_path).unwrap();
    let view = cow::SnapshotView::new(&reader, &base, &base_path, None).unwrap();
    let mut want = vec![0u8; view.size() as usize];
    view.read_blocks(0, &mut want).unwrap();
    let e = CowEngine::open(&base_path, &cow, &CowEngineOptions::default()).unwrap();
    let mut got = vec![0u8; want.len()];
    e.read_at(&mut got, 0).unwrap();
    assert!(got == want);
    let mut one = [0u8; 3];
    e.read_at(&mut one, 50 * 4096 + 4094).unwrap();
    assert_eq!(one, want[50 * 4096 + 4094..50 * 4096 + 4097]);
}

#[test]
fn concurrent_readers_match() {
    let want = Arc::new(expected());
    let e = Arc::new(open("v3_lz4_65536.cow", &CowEngineOptions::default()));
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (e, want) = (e.clone(), want.clone());
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t * 7919 + 1);
                let mut buf = vec![0u8; 128 << 10];
                for _ in 0..500 {
                    let off = rng.u64(..) % want.len() as u64;
                    let len =
                        ((rng.u64(..) % (128 << 10)) as usize + 1).min(want.len() - off as usize);
                    e.read_at(&mut buf[..len], off).unwrap();
                    assert!(buf[..len] == want[off as usize..off as usize + len]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn partial_unit_reads_decode_once_then_hit_the_cache() {
    let e = open("v3_lz4_65536.cow", &CowEngineOptions::default());
    let mut buf = [0u8; 4096];
    e.read_at(&mut buf, 101 * 4096).unwrap();
    e.read_at(&mut buf, 102 * 4096).unwrap();
    e.read_at(&mut buf, 103 * 4096).unwrap();
    assert_eq!(e.stats().unit_decodes.load(Ordering::Relaxed), 1);
    assert_eq!(e.stats().cache_hits.load(Ordering::Relaxed), 2);

    let no_cache = open(
        "v3_lz4_65536.cow",
        &CowEngineOptions {
            cache_bytes: 0,
            ..Default::default()
        },
    );
    no_cache.read_at(&mut buf, 101 * 4096).unwrap();
    no_cache.read_at(&mut buf, 102 * 4096).unwrap();
    assert_eq!(no_cache.stats().unit_decodes.load(Ordering::Relaxed), 2);
}

#[test]
fn multi_unit_reads_use_the_decode_pool_and_coalesce_base_reads() {
    let e = open("v3_lz4_4096_badseq.cow", &CowEngineOptions::default());
    let mut buf = vec![0u8; 30 * 4096];
    // Blocks 95..125: unchanged 95..99, 19 single-block REPLACE units, unchanged after.
    e.read_at(&mut buf, 95 * 4096).unwrap();
    assert_eq!(e.stats().parallel_requests.load(Ordering::Relaxed), 1);
    assert_eq!(e.stats().base_reads.load(Ordering::Relaxed), 2);
    // 400 unchanged blocks are one pread.
    let mut big = vec![0u8; 400 * 4096];
    e.read_at(&mut big, 400 * 4096).unwrap();
    assert_eq!(e.stats().base_reads.load(Ordering::Relaxed), 3);
}

#[test]
fn reads_outside_the_device_are_rejected() {
    let e = open("v3_none_4096.cow", &CowEngineOptions::default());
    let mut buf = [0u8; 2];
    let err = e.read_at(&mut buf, e.size() - 1).unwrap_err();
    assert!(matches!(err, EngineError::OutOfRange { .. }), "{err}");
    assert_eq!(err.errno(), libc::EINVAL);
}

#[test]
fn explicit_size_extends_with_zeros_only_when_ops_cover_it() {
    let base_path = vectors().join("base.img");
    let cow = vectors().join("v3_none_4096.cow");
    // Smaller than the ops need: refused.
    let err = CowEngine::open(
        &base_path,
        &cow,
        &CowEngineOptions {
            size: Some(100 * 4096),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("smaller than"), "{err}");
    // Larger than base + ops: blocks in neither means the wrong base.
    let err = CowEngine::open(
        &base_path,
        &cow,
        &CowEngineOptions {
            size: Some(2048 * 4096),
            ..Default::default()
        },
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("base.img") && msg.contains("block 1024"),
        "{msg}"
    );
}

#[test]
fn truncated_base_is_refused_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short.img");
    let base = std::fs::read(vectors().join("base.img")).unwrap();
    std::fs::write(&short, &base[..20 * 4096]).unwrap();
    let err = CowEngine::open(
        &short,
        &vectors().join("v2_lz4_4096.cow"),
        &CowEngineOptions::default(),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("short.img") && msg.contains("wrong base"),
        "{msg}"
    );
}

#[test]
fn truncated_cow_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cut = dir.path().join("cut.cow");
    let data = std::fs::read(vectors().join("v3_lz4_65536.cow")).unwrap();
    std::fs::write(&cut, &data[..data.len() / 2]).unwrap();
    let err = CowEngine::open(
        &vectors().join("base.img"),
        &cut,
        &CowEngineOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("cut.cow"), "{err}");
}

struct AllMerged;
impl MergeHook for AllMerged {
    fn begin_read(&self) -> Box<dyn MergeGuard + '_> {
        Box::new(AllMerged)
    }
}

impl MergeGuard for AllMerged {
    fn redirect(&self, _i: usize, _op: &cow::Op) -> MergeRedirect {
        MergeRedirect::BaseAtNewBlock
    }
}

#[test]
fn merge_hook_redirects_merged_copy_and_xor_blocks_to_the_base() {
    let base = std::fs::read(vectors().join("base.img")).unwrap();
    let want = expected();
    let mut e = open("v2_lz4_4096.cow", &CowEngineOptions::default());
    e.set_merge_hook(Arc::new(AllMerged));
    let mut buf = vec![0u8; 4096];
    for block in [10usize, 11, 12, 20, 200, 203] {
        e.read_at(&mut buf, block as u64 * 4096).unwrap();
        assert!(
            buf[..] == base[block * 4096..(block + 1) * 4096],
            "block {block}"
        );
    }
    // REPLACE/ZERO are served from the COW whatever the merge state.
    e.read_at(&mut buf, 100 * 4096).unwrap();
    assert!(buf[..] == want[100 * 4096..101 * 4096]);
}

struct Counting(AtomicU64, Option<u64>);
impl BlockVerifier for Counting {
    fn verify(&self, block: u64, data: &[u8]) -> Result<(), String> {
        assert_eq!(data.len(), 4096);
        self.0.fetch_add(1, Ordering::Relaxed);
        if Some(block) == self.1 {
            Err("hash mismatch".into())
        } else {
            Ok(())
        }
    }
}

#[test]
fn verifier_sees_every_whole_block_and_can_fail_reads() {
    let mut e = open("v3_zstd_16384.cow", &CowEngineOptions::default());
    let v = Arc::new(Counting(AtomicU64::new(0), Some(7)));
    e.set_verifier(v.clone());
    let mut buf = vec![0u8; 3 * 4096];
    e.read_at(&mut buf, 100).unwrap(); // touches blocks 0..=3
    assert_eq!(v.0.load(Ordering::Relaxed), 4);
    let err = e.read_at(&mut buf[..10], 7 * 4096 + 5).unwrap_err();
    assert!(matches!(err, EngineError::Verify { block: 7, .. }), "{err}");
    assert_eq!(err.errno(), libc::EIO);
}

#[test]
fn file_device_reads_and_refuses_writes() {
    let want = std::fs::read(vectors().join("base.img")).unwrap();
    for direct in [true, false] {
        let d = FileDevice::open(&vectors().join("base.img"), direct).unwrap();
        assert_eq!(d.size(), want.len() as u64);
        let mut buf = engine::AlignedBuf::new(8192);
        d.read_at(buf.slice_mut(8192), 4096).unwrap();
        assert!(buf.as_slice() == &want[4096..12288]);
        let mut odd = [0u8; 7];
        d.read_at(&mut odd, 12345).unwrap();
        assert_eq!(odd, want[12345..12352]);
        assert_eq!(d.write_at(&odd, 0).unwrap_err().errno(), libc::EPERM);
    }
    let err = FileDevice::open(Path::new("/nonexistent/base.img"), true).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/base.img"));
}

/// Large requests are verified on the decode pool: every block exactly once,
/// and one bad block anywhere fails the whole read.
#[test]
fn verifier_on_large_unaligned_requests() {
    let mut e = open("v3_lz4_65536.cow", &CowEngineOptions::default());
    let v = Arc::new(Counting(AtomicU64::new(0), None));
    e.set_verifier(v.clone());
    let mut buf = vec![0u8; 1 << 20];
    e.read_at(&mut buf, 4096).unwrap();
    assert_eq!(v.0.load(Ordering::Relaxed), 256);
    let want = std::fs::read(vectors().join("expected.img")).unwrap();
    assert!(buf[..] == want[4096..4096 + (1 << 20)]);
    // Unaligned at both ends: blocks 1..=256, the first and last only partly.
    e.read_at(&mut buf[..(1 << 20) - 100], 4096 + 50).unwrap();
    assert_eq!(v.0.load(Ordering::Relaxed), 256 + 256);
    let mut e = open("v3_lz4_65536.cow", &CowEngineOptions::default());
    e.set_verifier(Arc::new(Counting(AtomicU64::new(0), Some(200))));
    let err = e.read_at(&mut buf, 4096).unwrap_err();
    assert!(
        matches!(err, EngineError::Verify { block: 200, .. }),
        "{err}"
    );
}
