//! The asynchronous queue threads against the expected images: many concurrent
//! `O_DIRECT` readers of random ranges through the mounted file, byte for byte, with the
//! counters proving the reads went through read plans on the queue rings; and an engine
//! with a merge hook, which must not be planned and still serve the same bytes; and the
//! synchronous design, still selectable. The queue threads poll their rings by default;
//! the vectors are served alternately with and without polling.
//!
//! Needs root and a kernel with CONFIG_FUSE_IO_URING; switches
//! /sys/module/fuse/parameters/enable_uring on (it only lets FUSE servers that ask for
//! io_uring use it).

use std::collections::HashMap;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use engine::{AlignedBuf, BlockDevice, CowEngine, CowEngineOptions};

use super::UringOptions;
use crate::fuse::{FuseExport, FuseOptions};

const BS: usize = 4096;

fn shared() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared")
}

fn mount(dev: Arc<dyn BlockDevice>, dir: &Path) -> FuseExport {
    mount_with(dev, dir, &UringOptions::default())
}

fn mount_with(dev: Arc<dyn BlockDevice>, dir: &Path, opts: &UringOptions) -> FuseExport {
    std::fs::write(super::ENABLE_PARAM, "Y").unwrap_or_else(|e| {
        panic!(
            "write {} (needs root and CONFIG_FUSE_IO_URING): {e}",
            super::ENABLE_PARAM
        )
    });
    let opts = FuseOptions {
        uring: Some(opts.clone()),
        ..FuseOptions::default()
    };
    FuseExport::mount(dev, dir, &opts).unwrap()
}

/// `threads` readers, each doing `reads` `O_DIRECT` reads of 1 to 7 blocks at random
/// block offsets (all shorter than the planning limit) plus one 1 MiB read, compared
/// with `want`. Returns the number of short reads issued.
fn random_direct_reads(file: &Path, want: &Arc<Vec<u8>>, threads: u64, reads: u64) -> u64 {
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (file, want) = (file.to_path_buf(), want.clone());
            std::thread::spawn(move || {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&file)
                    .unwrap();
                let mut buf = AlignedBuf::new(1 << 20);
                let blocks = (want.len() / BS) as u64;
                // Deterministic, different per thread.
                let mut rng = fastrand::Rng::with_seed(t);
                for i in 0..=reads {
                    let x = rng.u64(..);
                    let (off, n) = if i == reads {
                        (0, (1usize << 20).min(want.len()))
                    } else {
                        let b = (x >> 8) % blocks;
                        let n = (1 + x % 7).min(blocks - b) as usize * BS;
                        (b as usize * BS, n)
                    };
                    let out = buf.slice_mut(n);
                    f.read_exact_at(out, off as u64).unwrap();
                    assert!(
                        out[..] == want[off..off + n],
                        "thread {t}: {n} bytes at {off} differ"
                    );
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    threads * reads
}

#[test]
fn aosp_vectors_under_concurrent_direct_reads_are_planned() {
    let v = shared().join("aosp-cow-vectors");
    let want = Arc::new(std::fs::read(v.join("expected.img")).unwrap());
    let mut cows: Vec<_> = std::fs::read_dir(&v)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cow"))
        .filter(|p| !p.to_string_lossy().contains("badseq"))
        .collect();
    cows.sort();
    assert!(cows.len() >= 10, "{cows:?}");
    let tmp = tempfile::tempdir().unwrap();
    for (i, cow) in cows.into_iter().enumerate() {
        let opts = CowEngineOptions {
            size: Some(want.len() as u64),
            ..Default::default()
        };
        let engine = CowEngine::open(&v.join("base.img"), &cow, &opts).unwrap();
        // Every other vector without polling: both ways of waiting for completions.
        let uopts = UringOptions {
            poll: if i % 2 == 0 {
                std::time::Duration::ZERO
            } else {
                super::DEFAULT_POLL
            },
            ..UringOptions::default()
        };
        let export = mount_with(Arc::new(engine), tmp.path(), &uopts);
        let issued = random_direct_reads(export.file_path(), &want, 8, 60);
        let s = export.stats();
        export.unmount().unwrap();
        assert!(
            s.planned >= issued,
            "{}: {} of {issued} short reads planned ({s:?})",
            cow.display(),
            s.planned
        );
    }
}

/// A COW for `old` -> `new` that uses every op kind the planner distinguishes: COPY
/// (blocks found elsewhere in `old`), ZERO, XOR with page-aligned and with byte-offset
/// sources, and multi-block REPLACE units.
fn make_cow(old: &[u8], new: &[u8], cow: &Path) {
    let mut by_content: HashMap<&[u8], u64> = HashMap::new();
    for (i, b) in old.chunks_exact(BS).enumerate() {
        by_content.entry(b).or_insert(i as u64);
    }
    let old_blocks = (old.len() / BS) as u64;
    let mut w = cow::CowWriter::create(
        cow,
        cow::WriterOptions {
            op_count_max: (new.len() / BS) as u64 + 16,
            ..Default::default()
        },
    )
    .unwrap();
    let mut replace: Option<(u64, usize)> = None;
    let flush = |w: &mut cow::CowWriter, r: &mut Option<(u64, usize)>| {
        if let Some((start, n)) = r.take() {
            let at = start as usize * BS;
            w.add_raw_blocks(start, &new[at..at + n * BS]).unwrap();
        }
    };
    for (i, nb) in new.chunks_exact(BS).enumerate() {
        let i = i as u64;
        if old.get(i as usize * BS..(i as usize + 1) * BS) == Some(nb) {
            flush(&mut w, &mut replace);
            continue;
        }
        if nb.iter().all(|&b| b == 0) {
            flush(&mut w, &mut replace);
            w.add_zero_blocks(i, 1).unwrap();
        } else if let Some(&src) = by_content.get(nb) {
            flush(&mut w, &mut replace);
            w.add_copy(i, src, 1).unwrap();
        } else if i % 3 != 2 && i + 1 < old_blocks {
            flush(&mut w, &mut replace);
            let offset: u16 = if i.is_multiple_of(3) { 100 } else { 0 };
            let s = i as usize * BS + usize::from(offset);
            let xored: Vec<u8> = nb.iter().zip(&old[s..s + BS]).map(|(a, b)| a ^ b).collect();
            w.add_xor_blocks(i, &xored, i, offset).unwrap();
        } else {
            match &mut replace {
                Some((start, n)) if *start + *n as u64 == i => *n += 1,
                _ => {
                    flush(&mut w, &mut replace);
                    replace = Some((i, 1));
                }
            }
        }
    }
    flush(&mut w, &mut replace);
    w.finalize().unwrap();
}

fn tiny_pair() -> (PathBuf, PathBuf) {
    let dir = std::env::var_os("VABC_CORPUS")
        .map_or_else(|| std::env::temp_dir().join("corpus"), PathBuf::from);
    let (old, new) = (dir.join("tiny/old.ext4.img"), dir.join("tiny/new.ext4.img"));
    if !new.exists() {
        let status = std::process::Command::new("bash")
            .arg(shared().join("corpus/make-corpus.sh"))
            .args(["-p", "tiny", "-o"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(status.success(), "make-corpus.sh -p tiny failed");
    }
    (old, new)
}

#[test]
fn corpus_pair_under_concurrent_direct_reads_is_planned() {
    let (old, new) = tiny_pair();
    let tmp = tempfile::tempdir().unwrap();
    let cow = tmp.path().join("tiny.cow");
    let old_data = std::fs::read(&old).unwrap();
    let want = Arc::new(std::fs::read(&new).unwrap());
    make_cow(&old_data, &want, &cow);
    let dir = tmp.path().join("fuse");
    std::fs::create_dir(&dir).unwrap();
    for direct_io in [true, false] {
        let opts = CowEngineOptions {
            size: Some(want.len() as u64),
            direct_io,
            // Small, so REPLACE units are planned again after eviction.
            cache_bytes: 1 << 20,
            ..Default::default()
        };
        let engine = CowEngine::open(&old, &cow, &opts).unwrap();
        let export = mount(Arc::new(engine), &dir);
        let issued = random_direct_reads(export.file_path(), &want, 8, 400);
        // The whole file once more, 1 MiB at a time: the workers and the readahead.
        let got = std::fs::read(export.file_path()).unwrap();
        assert!(
            got == *want,
            "direct_io={direct_io}: whole-file read differs"
        );
        let s = export.stats();
        export.unmount().unwrap();
        assert!(
            s.planned >= issued,
            "direct_io={direct_io}: {} of {issued} short reads planned ({s:?})",
            s.planned
        );
    }
}

#[test]
fn engines_with_a_merge_hook_are_served_without_plans() {
    struct Hook;
    struct Guard;
    impl engine::MergeGuard for Guard {
        fn redirect(&self, _: usize, _: &cow::Op) -> engine::MergeRedirect {
            engine::MergeRedirect::Cow
        }
    }
    impl engine::MergeHook for Hook {
        fn begin_read(&self) -> Box<dyn engine::MergeGuard + '_> {
            Box::new(Guard)
        }
    }
    let v = shared().join("aosp-cow-vectors");
    let want = Arc::new(std::fs::read(v.join("expected.img")).unwrap());
    let opts = CowEngineOptions {
        size: Some(want.len() as u64),
        ..Default::default()
    };
    let mut engine =
        CowEngine::open(&v.join("base.img"), &v.join("v3_lz4_65536.cow"), &opts).unwrap();
    engine.set_merge_hook(Arc::new(Hook));
    let tmp = tempfile::tempdir().unwrap();
    let export = mount(Arc::new(engine), tmp.path());
    random_direct_reads(export.file_path(), &want, 8, 40);
    let s = export.stats();
    export.unmount().unwrap();
    assert_eq!(s.planned, 0, "{s:?}");
    assert!(s.via_ring >= 8 * 40, "{s:?}");
}

#[test]
fn synchronous_threads_still_serve_the_same_bytes() {
    let v = shared().join("aosp-cow-vectors");
    let want = Arc::new(std::fs::read(v.join("expected.img")).unwrap());
    let opts = CowEngineOptions {
        size: Some(want.len() as u64),
        ..Default::default()
    };
    let engine = CowEngine::open(&v.join("base.img"), &v.join("v2_gz_4096.cow"), &opts).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let export = mount_with(Arc::new(engine), tmp.path(), &UringOptions::synchronous(4));
    assert_eq!(
        export.queues().1,
        4usize.div_ceil(export.queues().0) * export.queues().0
    );
    let issued = random_direct_reads(export.file_path(), &want, 8, 40);
    let s = export.stats();
    export.unmount().unwrap();
    assert_eq!(s.planned, 0, "{s:?}");
    assert!(s.via_ring >= issued, "{s:?}");
}
