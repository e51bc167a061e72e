//! In-place merge: AOSP vectors, both engines, refusal of unsafe input,
//! crash injection at every write and sync, and reads during a merge.

mod common;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::*;
use cow::{Codec, CowReader, CowWriter, WriterOptions};
use merge::fuzzing::LateWrites;
use merge::view::MergingView;
use merge::{Dev, Merge, MergeIo, MergeOptions, MergeStatus, UringIo};

fn vectors() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/aosp-cow-vectors")
}

/// Merge `cow` into `base` (files) to completion.
fn merge_files(base: &Path, cow: &Path, e: Engine, opts: MergeOptions) -> merge::MergeReport {
    let r = CowReader::open(cow).unwrap();
    let size = std::fs::metadata(base).unwrap().len();
    let m = Merge::new(&r, size, base.to_path_buf(), opts).unwrap();
    let mut io = engine(e, base, cow);
    m.run(io.as_mut(), &|_, _| {}).unwrap()
}

#[test]
fn vectors_merge_to_expected_with_both_engines() {
    let expected = std::fs::read(vectors().join("expected.img")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    for e in std::fs::read_dir(vectors()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "cow") || p.to_str().unwrap().contains("badseq") {
            continue;
        }
        for engine_kind in [Engine::Sync, Engine::Uring, Engine::UringDirect] {
            let base = dir.path().join("base.img");
            let cow = dir.path().join("u.cow");
            std::fs::copy(vectors().join("base.img"), &base).unwrap();
            std::fs::copy(&p, &cow).unwrap();
            let rep = merge_files(&base, &cow, engine_kind, MergeOptions::default());
            assert!(rep.complete(), "{}", p.display());
            assert!(
                std::fs::read(&base).unwrap() == expected,
                "{} {engine_kind:?}",
                p.display()
            );
            // The header records completion; a second run is a no-op.
            let r = CowReader::open(&cow).unwrap();
            assert_eq!(r.header().num_merge_ops, rep.total_ops);
            let again = merge_files(&base, &cow, engine_kind, MergeOptions::default());
            assert!(again.complete());
            assert_eq!((again.io.writes, again.io.fsyncs), (0, 0));
            n += 1;
        }
    }
    assert_eq!(n, 33);
}

#[test]
fn unsafe_order_and_wrong_base_are_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let cow = dir.path().join("bad.cow");
    std::fs::copy(vectors().join("v3_lz4_4096_badseq.cow"), &cow).unwrap();
    let r = CowReader::open(&cow).unwrap();
    let e = Merge::new(
        &r,
        4 << 20,
        PathBuf::from("base.img"),
        MergeOptions::default(),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("merge order is unsafe"), "{e}");
    let good = dir.path().join("good.cow");
    std::fs::copy(vectors().join("v3_lz4_65536.cow"), &good).unwrap();
    let r = CowReader::open(&good).unwrap();
    let e = Merge::new(
        &r,
        1 << 20,
        PathBuf::from("small.img"),
        MergeOptions::default(),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("wrong base image"), "{e}");
}

#[test]
fn engines_give_identical_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut results = Vec::new();
    for e in [Engine::Sync, Engine::Uring, Engine::UringDirect] {
        let cow = dir.path().join(format!("{e:?}.cow"));
        let base = dir.path().join(format!("{e:?}.img"));
        let (old, new) = make_update(&cow, 512, 3, Codec::Lz4);
        std::fs::write(&base, &old).unwrap();
        let opts = MergeOptions {
            window_ops: 13,
            commit_ops: 9,
            ..Default::default()
        };
        let rep = merge_files(&base, &cow, e, opts);
        assert!(rep.complete());
        let img = std::fs::read(&base).unwrap();
        assert!(img == new, "{e:?}");
        results.push((img, std::fs::read(&cow).unwrap(), rep.io));
    }
    for r in &results[1..] {
        assert!(results[0].0 == r.0);
        assert!(
            results[0].1 == r.1,
            "COW (header + scratch) differs between engines"
        );
    }
    // The io_uring engine batches: far fewer syscalls and fsyncs.
    let (s, u) = (results[0].2, results[1].2);
    assert!(u.syscalls * 4 < s.syscalls, "sync {s:?} uring {u:?}");
    assert!(u.fsyncs * 4 < s.fsyncs, "sync {s:?} uring {u:?}");
}

/// Direct windows (the default) and AOSP's copy-every-window protocol end
/// at the same image; only the scratch writes and syncs differ.
#[test]
fn direct_windows_match_always_scratch() {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    for direct in [true, false] {
        let cow = dir.path().join(format!("{direct}.cow"));
        let base = dir.path().join(format!("{direct}.img"));
        let (old, new) = make_update(&cow, 512, 3, Codec::Zstd);
        std::fs::write(&base, &old).unwrap();
        let opts = MergeOptions {
            window_ops: 16,
            direct_windows: direct,
            direct_min_ops: 8,
            direct_max_ops: 40,
            ..Default::default()
        };
        let rep = merge_files(&base, &cow, Engine::UringDirect, opts);
        assert!(rep.complete());
        assert!(
            std::fs::read(&base).unwrap() == new,
            "direct windows {direct}"
        );
        out.push(rep);
    }
    let (d, s) = (out[0], out[1]);
    assert!(d.direct_windows > 0 && s.direct_windows == 0, "{d:?} {s:?}");
    // The XOR region (64 ops, no overlap) is one 40-op and one 24-op window.
    assert!(d.windows < s.windows, "{d:?} {s:?}");
    assert!(d.io.fsyncs < s.io.fsyncs && d.io.bytes_written < s.io.bytes_written);
}

/// On a filesystem that supports O_DIRECT (the build directory's), the
/// direct path is really taken, and the merge is exact through it: sources
/// and destinations page-aligned, the COW written in whole pages.
#[test]
fn direct_io_merge_is_exact() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let cow = dir.path().join("u.cow");
    let base = dir.path().join("b.img");
    let (old, new) = make_update(&cow, 700, 3, Codec::Zstd);
    std::fs::write(&base, &old).unwrap();
    let io = UringIo::new(rw(&base), rw(&cow), 16)
        .unwrap()
        .with_direct()
        .unwrap();
    // SAFETY: an all-zero statfs is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let c = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid path and a valid out pointer.
    assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
    if st.f_type != libc::TMPFS_MAGIC {
        assert_eq!(io.direct(), (true, true));
    }
    let mut io: Box<dyn MergeIo> = Box::new(io);
    let r = CowReader::open(&cow).unwrap();
    let opts = MergeOptions {
        window_ops: 37,
        commit_ops: 11,
        ..Default::default()
    };
    let m = Merge::new(&r, old.len() as u64, base.clone(), opts).unwrap();
    let rep = m.run(io.as_mut(), &|_, _| {}).unwrap();
    assert!(rep.complete());
    drop(io);
    assert!(std::fs::read(&base).unwrap() == new);
    let r = CowReader::open(&cow).unwrap();
    assert_eq!(r.header().num_merge_ops, rep.total_ops);
}

/// Merge through a simulated disk that dies at event `k`, then check the
/// snapshot view on what survived and resume to the end; once with
/// REPLACE/ZERO blocks written early with the ordered windows (a few per
/// window, so that the REPLACE phase still writes), once without.
#[test]
fn crash_at_every_write_and_sync_then_resume() {
    let with = crash_everywhere(8);
    assert!(with.early_blocks > 0, "{with:?}");
    let without = crash_everywhere(0);
    assert_eq!(without.early_blocks, 0);
}

fn crash_everywhere(early_blocks: usize) -> merge::MergeReport {
    let dir = tempfile::tempdir().unwrap();
    let cow_path = dir.path().join("u.cow");
    let (old, new) = make_update(&cow_path, 256, 2, Codec::Zstd);
    let cow_bytes = std::fs::read(&cow_path).unwrap();
    // Small windows and commits: many windows, many crash points per phase.
    let opts = MergeOptions {
        window_ops: 7,
        commit_ops: 5,
        direct_max_ops: 7,
        early_blocks,
        ..Default::default()
    };
    let (rep, sim) = fault_free(&cow_path, &old, opts);
    // Both kinds of window: the shifted chains overlap inside every window,
    // the XOR region never does.
    assert!(
        rep.direct_windows > 0 && rep.direct_windows < rep.windows,
        "{rep:?}"
    );
    assert!(
        sim.after_crash(Crash::PowerLoss).0 == new,
        "fault-free simulated merge"
    );
    let events = sim.events();
    let trace = sim.trace.clone();

    // Which phase each event belongs to, to show every phase is hit.
    // The COW is written in whole pages from offset 0: a scratch save spans
    // the scratch area, the state byte and the commit rewrite the header
    // page; the state byte is the one that directly follows a scratch save.
    // Base writes of a window without a scratch save are a direct window's.
    let mut phases = std::collections::BTreeMap::new();
    let mut commits = 0u64;
    let mut last = "";
    let mut saved = false;
    for &(is_sync, dev, off, len) in &trace {
        let phase = match (is_sync, dev, off) {
            (true, Dev::Cow, _) => "cow sync",
            (true, Dev::Base, _) => "base sync",
            (false, Dev::Cow, 0) if len > 4096 => {
                saved = true;
                "scratch save"
            }
            (false, Dev::Cow, 0) if last == "scratch save" => "state byte",
            (false, Dev::Cow, 0) => {
                commits += 1;
                saved = false;
                "header commit"
            }
            (false, Dev::Cow, o) => panic!("COW write at {o}, not a page of the header/scratch"),
            (false, Dev::Base, _) if commits < rep.windows && saved => "destination write",
            (false, Dev::Base, _) if commits < rep.windows => "direct window write",
            (false, Dev::Base, _) => "REPLACE/ZERO write",
        };
        if !is_sync {
            last = phase;
        }
        *phases.entry(phase).or_insert(0u64) += 1;
    }
    for p in [
        "scratch save",
        "state byte",
        "destination write",
        "direct window write",
        "header commit",
        "REPLACE/ZERO write",
        "base sync",
        "cow sync",
    ] {
        assert!(
            phases.get(p).copied().unwrap_or(0) > 0,
            "phase {p} never hit: {phases:?}"
        );
    }

    let sc = Scenario {
        cow_bytes: &cow_bytes,
        old: &old,
        new: &new,
        opts,
        resume_opts: None,
    };
    let mut points = 0;
    for k in 0..events {
        for how in [Crash::Stop, Crash::PowerLoss, Crash::Torn(k * 7919 + 1)] {
            let resume = if k % 2 == 0 {
                Engine::Uring
            } else {
                Engine::Sync
            };
            crash_and_resume(&sc, k, how, resume, dir.path());
            points += 1;
        }
    }
    eprintln!(
        "early blocks {early_blocks}: {points} crash points over {events} events: {phases:?}"
    );
    assert!(points >= 200, "only {points} crash points");
    rep
}

/// The rule that keeps early REPLACE writes safe: a REPLACE block read by an
/// op of a direct window must not be written with that window (a crash in
/// it re-reads the window's sources). Here one direct window XORs blocks
/// 8..16 from blocks 16..24 (at a byte offset), which REPLACE then
/// rewrites, right next to the window's destinations; with a scratch copy
/// the same blocks may go early. A crash at every event of both merges,
/// resumed, must end at the new image.
#[test]
fn early_writes_wait_for_their_readers() {
    let dir = tempfile::tempdir().unwrap();
    let cow_path = dir.path().join("u.cow");
    let old = noise(7, 32 * BS);
    let mut new = old.clone();
    let off = 100;
    let mut xored = Vec::new();
    for b in 8..16 {
        let src = (b + 8) * BS + off;
        let mut blk = old[src..src + BS].to_vec();
        blk[b * 5] ^= 0x3c;
        xored.extend(blk.iter().zip(&old[src..]).map(|(a, o)| a ^ o));
        new[b * BS..(b + 1) * BS].copy_from_slice(&blk);
    }
    let replaced = noise(8, 8 * BS);
    new[16 * BS..24 * BS].copy_from_slice(&replaced);
    let mut w = CowWriter::create(
        &cow_path,
        WriterOptions {
            version: 3,
            compression: cow::Compression {
                codec: Codec::Lz4,
                level: None,
            },
            op_count_max: 64,
            ..Default::default()
        },
    )
    .unwrap();
    w.add_xor_blocks(8, &xored, 16, off as u16).unwrap();
    w.add_raw_blocks(16, &replaced).unwrap();
    w.finalize().unwrap();
    let cow_bytes = std::fs::read(&cow_path).unwrap();
    for direct in [true, false] {
        let opts = MergeOptions {
            direct_windows: direct,
            direct_min_ops: 1,
            ..Default::default()
        };
        let (rep, sim) = fault_free(&cow_path, &old, opts);
        assert!(sim.after_crash(Crash::PowerLoss).0 == new);
        assert_eq!(rep.direct_windows, u64::from(direct), "{rep:?}");
        // Block 16's reader is in the window: only a scratch window lets
        // the REPLACE blocks go with it.
        assert_eq!(rep.early_blocks, if direct { 0 } else { 8 }, "{rep:?}");
        let sc = Scenario {
            cow_bytes: &cow_bytes,
            old: &old,
            new: &new,
            opts,
            resume_opts: None,
        };
        for k in 0..sim.events() {
            for how in [Crash::Stop, Crash::PowerLoss, Crash::Torn(k + 1)] {
                crash_and_resume(&sc, k, how, Engine::Uring, dir.path());
            }
        }
    }
}

/// A merge interrupted inside a direct window resumes under AOSP's rules:
/// a merger that copies every window through the scratch area, with other
/// window boundaries, reads the sources again (state 1) and ends at the new
/// image, as snapuserd would; one interrupted while replaying a published
/// window longer than its own windows replays it whole.
#[test]
fn direct_window_crash_resumes_with_aosp_windows() {
    let dir = tempfile::tempdir().unwrap();
    let cow_path = dir.path().join("u.cow");
    let (old, new) = make_update(&cow_path, 256, 3, Codec::Lz4);
    let cow_bytes = std::fs::read(&cow_path).unwrap();
    let opts = MergeOptions {
        window_ops: 7,
        commit_ops: 5,
        direct_max_ops: 9,
        ..Default::default()
    };
    // snapuserd writes every REPLACE/ZERO block in its REPLACE phase.
    let aosp = MergeOptions {
        window_ops: 5,
        commit_ops: 3,
        direct_windows: false,
        early_blocks: 0,
        ..Default::default()
    };
    let (events, trace) = dry_run(&cow_path, &old, opts);
    let sc = Scenario {
        cow_bytes: &cow_bytes,
        old: &old,
        new: &new,
        opts,
        resume_opts: Some(aosp),
    };
    // Every event of the merge, as power loss and as a stop.
    let mut points = 0;
    for k in 0..events {
        for how in [Crash::Stop, Crash::PowerLoss] {
            crash_and_resume(&sc, k, how, Engine::Uring, dir.path());
            points += 1;
        }
    }
    let base_writes = trace.iter().filter(|t| !t.0 && t.1 == Dev::Base).count();
    assert!(points >= 100 && base_writes > 0, "{points} points");
}

/// A second crash while resuming from the first is survived too.
#[test]
fn crash_during_resume() {
    let dir = tempfile::tempdir().unwrap();
    let cow_path = dir.path().join("u.cow");
    let (old, new) = make_update(&cow_path, 128, 3, Codec::Lz4);
    let cow_bytes = std::fs::read(&cow_path).unwrap();
    let opts = MergeOptions {
        window_ops: 5,
        commit_ops: 3,
        ..Default::default()
    };
    for (k1, k2) in [(3u64, 2u64), (10, 5), (17, 1), (25, 8), (40, 3)] {
        let r = CowReader::open(&cow_path).unwrap();
        let m = Merge::new(&r, old.len() as u64, PathBuf::from("base"), opts).unwrap();
        let mut sim = SimDisk::new(old.clone(), cow_bytes.clone(), Some(k1));
        let _ = m.run(&mut sim, &|_, _| {});
        let (b1, c1) = sim.after_crash(Crash::PowerLoss);
        let mut sim = SimDisk::new(b1, c1, Some(k2));
        let _ = m.run(&mut sim, &|_, _| {});
        let (b2, c2) = sim.after_crash(Crash::Torn(k1 + k2));
        let mut sim = SimDisk::new(b2, c2, None);
        assert!(m.run(&mut sim, &|_, _| {}).unwrap().complete());
        assert!(
            sim.after_crash(Crash::PowerLoss).0 == new,
            "crashes at {k1} then {k2}"
        );
    }
}

/// Several threads read random blocks while the merge runs in the same
/// process: every read returns the new image's bytes.
#[test]
fn concurrent_reads_during_merge() {
    let dir = tempfile::tempdir().unwrap();
    let cow_path = dir.path().join("u.cow");
    let base_path = dir.path().join("b.img");
    let (old, new) = make_update(&cow_path, 1024, 3, Codec::Zstd);
    std::fs::write(&base_path, &old).unwrap();
    let r = CowReader::open(&cow_path).unwrap();
    let opts = MergeOptions {
        window_ops: 3,
        commit_ops: 2,
        ..Default::default()
    };
    let status = Arc::new(MergeStatus::new());
    let m = Merge::new(&r, old.len() as u64, base_path.clone(), opts)
        .unwrap()
        .with_status(status.clone());
    let mut io = UringIo::new(rw(&base_path), rw(&cow_path), 64).unwrap();
    m.load_status(&mut io, &status).unwrap();
    let done = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    let base = File::open(&base_path).unwrap();
    let view = MergingView::new(&r, &base, &base_path, status.clone()).unwrap();
    let blocks = (new.len() / BS) as u64;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (view, new, done, reads) = (&view, &new, &done, &reads);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                let mut blk = vec![0u8; BS];
                while !done.load(Ordering::Acquire) {
                    let x = rng.u64(..);
                    // Mostly blocks with ordered ops (the interesting ones).
                    let b = if x.is_multiple_of(4) {
                        x % blocks
                    } else {
                        blocks / 8 + x % (blocks * 5 / 8)
                    };
                    view.read_block(b, &mut blk).unwrap();
                    assert!(
                        blk == new[b as usize * BS..][..BS],
                        "block {b} wrong during merge"
                    );
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let rep = m.run(&mut io, &|_, _| {}).unwrap();
        assert!(rep.complete());
        done.store(true, Ordering::Release);
    });
    assert!(reads.load(Ordering::Relaxed) > 100, "readers barely ran");
    assert!(std::fs::read(&base_path).unwrap() == new);
}

/// The serving engine with the merge hook: random unaligned reads from
/// several threads while the merge runs always return the new image.
#[test]
fn engine_reads_during_merge() {
    use engine::{BlockDevice, CowEngine, CowEngineOptions};
    let dir = tempfile::tempdir().unwrap();
    let cow_path = dir.path().join("u.cow");
    let base_path = dir.path().join("b.img");
    let (old, new) = make_update(&cow_path, 1024, 2, Codec::Lz4);
    std::fs::write(&base_path, &old).unwrap();
    let r = CowReader::open(&cow_path).unwrap();
    let opts = MergeOptions {
        window_ops: 4,
        commit_ops: 3,
        ..Default::default()
    };
    let status = Arc::new(MergeStatus::new());
    let m = Merge::new(&r, old.len() as u64, base_path.clone(), opts)
        .unwrap()
        .with_status(status.clone());
    let mut io = UringIo::new(rw(&base_path), rw(&cow_path), 64).unwrap();
    m.load_status(&mut io, &status).unwrap();
    let mut eng = CowEngine::open(&base_path, &cow_path, &CowEngineOptions::default()).unwrap();
    eng.set_merge_hook(Arc::new(
        merge::serving::StatusHook::new(&r, status.clone()).unwrap(),
    ));
    let done = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    let size = new.len() as u64;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (eng, new, done, reads) = (&eng, &new, &done, &reads);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                let mut buf = vec![0u8; 64 * 1024];
                while !done.load(Ordering::Acquire) {
                    let x = rng.u64(..);
                    let off = x % (size - 1);
                    let len = ((x >> 20) % (buf.len() as u64)).min(size - off).max(1) as usize;
                    eng.read_at(&mut buf[..len], off).unwrap();
                    assert!(
                        buf[..len] == new[off as usize..off as usize + len],
                        "read {off}+{len} wrong during merge"
                    );
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let rep = m.run(&mut io, &|_, _| {}).unwrap();
        assert!(rep.complete());
        done.store(true, Ordering::Release);
    });
    assert!(reads.load(Ordering::Relaxed) > 50, "readers barely ran");
    assert!(std::fs::read(&base_path).unwrap() == new);
}

/// The engine's background writes: they run alongside background reads of
/// other blocks (waited for separately, in either order), more entries than
/// the queue holds, and a sync covers writes not waited for yet.
#[test]
fn uring_background_writes_alongside_reads() {
    let dir = tempfile::tempdir().unwrap();
    let (base_path, cow_path) = (dir.path().join("base"), dir.path().join("cow"));
    let blocks = 64usize;
    let old: Vec<u8> = (0..blocks * 4096).map(|i| (i / 4096) as u8).collect();
    std::fs::write(&base_path, &old).unwrap();
    std::fs::write(&cow_path, [0u8; 4096]).unwrap();
    for direct in [false, true] {
        std::fs::write(&base_path, &old).unwrap();
        let io = UringIo::new(rw(&base_path), rw(&cow_path), 4).unwrap();
        let mut io = if direct {
            io.with_direct().unwrap()
        } else {
            io
        };
        let mut arena = engine::AlignedBuf::new(64 * 4096);
        let (wbuf, rbuf) = arena.split_at_mut(32 * 4096);
        wbuf.fill(0xee);
        // Writes to even blocks 0..32 (16 entries, queue depth 4), reads
        // of blocks 32..64 in 8 runs of 4.
        let writes: Vec<(u64, *const u8, usize)> = (0..16)
            .map(|i| ((2 * i * 4096) as u64, wbuf[i * 4096..].as_ptr(), 4096))
            .collect();
        let reads: Vec<(u64, *mut u8, usize)> = (0..8)
            .map(|i| {
                (
                    ((32 + 4 * i) * 4096) as u64,
                    rbuf[i * 4 * 4096..].as_mut_ptr(),
                    4 * 4096,
                )
            })
            .collect();
        // SAFETY: `arena` outlives both waits below and nothing touches it
        // meanwhile.
        unsafe {
            io.start_writes(Dev::Base, &writes).unwrap();
            io.start_reads(Dev::Base, &reads).unwrap();
        }
        if direct {
            io.wait_reads().unwrap();
            io.wait_writes().unwrap();
        } else {
            io.wait_reads().unwrap();
            // No wait_writes: the sync must cover them.
            io.sync(Dev::Base).unwrap();
        }
        assert_eq!(&rbuf[..], &old[32 * 4096..], "direct {direct}");
        let got = std::fs::read(&base_path).unwrap();
        for b in 0..blocks {
            let want = if b < 32 && b % 2 == 0 { 0xee } else { b as u8 };
            assert!(
                got[b * 4096..(b + 1) * 4096].iter().all(|&x| x == want),
                "block {b}, direct {direct}"
            );
        }
        let st = io.stats();
        assert_eq!((st.writes, st.reads), (16, 8), "direct {direct}");
    }
}

/// The merge starts the next windows' source reads while a window's
/// destination writes are still in flight, which the merge order makes
/// safe: no op reads a block an earlier op writes, early REPLACE/ZERO
/// blocks included. Here writes land only when waited for or synced, reads
/// at once (the latest and earliest an engine may let them), with windows
/// of every kind (direct, scratch, with early blocks) and each update
/// shape: the result is still the new image, through the same writes and
/// syncs as on a disk that writes at once.
#[test]
fn writes_landing_late_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (version, codec)) in [(2, Codec::Zstd), (3, Codec::Lz4)].into_iter().enumerate() {
        let cow_path = dir.path().join(format!("u{i}.cow"));
        let (old, new) = make_update(&cow_path, 256, version, codec);
        let cow_bytes = std::fs::read(&cow_path).unwrap();
        for opts in [
            MergeOptions::default(),
            MergeOptions {
                window_ops: 7,
                commit_ops: 5,
                direct_max_ops: 9,
                early_blocks: 8,
                ..Default::default()
            },
        ] {
            let (eager, sim) = fault_free(&cow_path, &old, opts);
            if opts.window_ops == 7 {
                assert!(
                    eager.windows > eager.direct_windows
                        && eager.direct_windows > 0
                        && eager.early_blocks > 0,
                    "{eager:?}"
                );
            }
            let r = CowReader::open(&cow_path).unwrap();
            let m = Merge::new(&r, old.len() as u64, PathBuf::from("base"), opts).unwrap();
            let mut lazy = LateWrites::new(SimDisk::new(old.clone(), cow_bytes.clone(), None));
            let rep = m.run(&mut lazy, &|_, _| {}).unwrap();
            assert_eq!(lazy.in_flight(), 0);
            assert!(rep.complete(), "{rep:?}");
            assert!(
                lazy.inner.after_crash(Crash::PowerLoss).0 == new,
                "{opts:?}"
            );
            assert_eq!(lazy.inner.trace.len(), sim.trace.len(), "{opts:?}");
        }
    }
}
