//! `vabc serve --fuse DIR --fuse-uring` (FUSE-over-io_uring): the exported file equals
//! the expected image byte for byte for every AOSP vector and a corpus pair, also under
//! 8 concurrent random readers and through the `--mount` stack; the daemon's stop
//! message proves the requests were answered through the rings; with the kernel switch
//! off it fails with a message saying how to turn it on; nothing is left mounted.
//!
//! Needs root and a kernel with CONFIG_FUSE_IO_URING; the tests switch
//! /sys/module/fuse/parameters/enable_uring on (it only lets FUSE servers that ask for
//! io_uring use it; other daemons are unaffected).

mod serve_common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

use serve_common::*;

/// Held while a server starts: one test switches the parameter off for a moment.
static PARAM_LOCK: Mutex<()> = Mutex::new(());

fn start(
    base: &Path,
    cow: &Path,
    size: Option<&str>,
    extra: &[&std::ffi::OsStr],
    log: &Path,
) -> Server {
    let _guard = PARAM_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    set_fuse_uring_param(true);
    let mut args = vec![os("--base"), base.as_os_str(), os("--cow"), cow.as_os_str()];
    if let Some(s) = size {
        args.extend([os("--size"), os(s)]);
    }
    args.push(os("--fuse-uring"));
    args.extend_from_slice(extra);
    Server::start_logged(&args, log)
}

/// Stops the server and returns (requests via the rings, via /dev/fuse) from its log.
fn stop_and_count(server: Server, log: &Path) -> (u64, u64) {
    let status = server.stop();
    let text = std::fs::read_to_string(log).unwrap();
    assert!(status.success(), "serve exited with {status}: {text}");
    let line = text
        .lines()
        .find(|l| l.contains("requests answered via the rings"))
        .unwrap_or_else(|| panic!("no io_uring stats in the log: {text}"));
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.trim_end_matches(',').parse().ok())
        .collect();
    assert_eq!(nums.len(), 2, "{line}");
    (nums[0], nums[1])
}

fn assert_same_file(served: &Path, expected: &Path) {
    let got = std::fs::read(served).unwrap();
    let want = std::fs::read(expected).unwrap();
    assert_eq!(got.len(), want.len(), "{} size", served.display());
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        panic!(
            "{} differs from {} at byte {i}",
            served.display(),
            expected.display()
        );
    }
}

#[test]
fn serves_every_aosp_vector_through_the_rings() {
    let v = vectors();
    let base = v.join("base.img");
    let expected = v.join("expected.img");
    let size = std::fs::metadata(&expected).unwrap().len().to_string();
    let mut cows: Vec<_> = std::fs::read_dir(&v)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cow"))
        .filter(|p| !p.to_string_lossy().contains("badseq"))
        .collect();
    cows.sort();
    assert!(cows.len() >= 10, "{cows:?}");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fuse");
    std::fs::create_dir(&dir).unwrap();
    for cow in cows {
        let log = tmp.path().join("serve.log");
        let server = start(
            &base,
            &cow,
            Some(&size),
            &[os("--fuse"), dir.as_os_str()],
            &log,
        );
        server.assert_said("over FUSE io_uring");
        assert_same_file(&dir.join("disk.img"), &expected);
        let (ring, _dev) = stop_and_count(server, &log);
        // At least the reads of the whole file (size / 1 MiB) plus LOOKUP/OPEN.
        assert!(
            ring >= 3,
            "{}: only {ring} requests via the rings",
            cow.display()
        );
        assert_nothing_left(tmp.path());
    }
}

#[test]
fn corpus_pair_under_concurrent_random_reads() {
    let old = corpus_image("tiny", "old", "ext4");
    let new = corpus_image("tiny", "new", "ext4");
    let tmp = tempfile::tempdir().unwrap();
    let cow = tmp.path().join("update.cow");
    let size = make_cow(&old, &new, &cow, 3, "lz4").to_string();
    let dir = tmp.path().join("fuse");
    std::fs::create_dir(&dir).unwrap();
    let log = tmp.path().join("serve.log");
    let server = start(
        &old,
        &cow,
        Some(&size),
        &[os("--fuse"), dir.as_os_str()],
        &log,
    );
    let file = dir.join("disk.img");
    assert_same_file(&file, &new);

    let want = std::sync::Arc::new(std::fs::read(&new).unwrap());
    const READS: u64 = 200;
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (file, want) = (file.clone(), want.clone());
            std::thread::spawn(move || {
                let f = std::fs::File::open(&file).unwrap();
                // Deterministic, different per thread.
                let mut rng = fastrand::Rng::with_seed(t);
                let len = want.len() as u64;
                for _ in 0..READS {
                    let x = rng.u64(..);
                    let n = 1 + x % (256 << 10);
                    let off = (x >> 20) % len;
                    let n = n.min(len - off) as usize;
                    let mut buf = vec![0u8; n];
                    f.read_exact_at(&mut buf, off).unwrap();
                    assert!(
                        buf == want[off as usize..off as usize + n],
                        "thread {t}: {n} bytes at {off} differ"
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let (ring, _dev) = stop_and_count(server, &log);
    let whole = want.len() as u64 / (1 << 20);
    assert!(
        ring >= 8 * READS + whole,
        "{ring} requests via the rings, expected at least {}",
        8 * READS + whole
    );
    assert_nothing_left(tmp.path());
}

#[test]
fn mount_stack_over_the_rings() {
    let old = corpus_image("tiny", "old", "ext4");
    let new = corpus_image("tiny", "new", "ext4");
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let cow = t.join("update.cow");
    let size = make_cow(&old, &new, &cow, 2, "zstd").to_string();
    let target = t.join("target");
    std::fs::create_dir(&target).unwrap();
    let log = t.join("serve.log");
    let server = start(
        &old,
        &cow,
        Some(&size),
        &[os("--mount"), target.as_os_str()],
        &log,
    );
    {
        let reference = RefMount::new(&new, "ext4", &t.join("ref"));
        let (same, out) = run(Command::new("diff")
            .args(["-r", "--no-dereference"])
            .arg(&reference.dir)
            .arg(&target));
        assert!(same, "served tree differs from new.img:\n{out}");
        assert!(target.join("build.prop").exists());
    }
    let (ring, _dev) = stop_and_count(server, &log);
    assert!(ring > 10, "only {ring} requests via the rings");
    assert_nothing_left(t);
}

#[test]
fn switched_off_kernel_gives_a_clear_error() {
    let v = vectors();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fuse");
    std::fs::create_dir(&dir).unwrap();
    let out = {
        let _guard = PARAM_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        set_fuse_uring_param(false);
        let out = Command::new(vabc())
            .arg("serve")
            .arg("--base")
            .arg(v.join("base.img"))
            .arg("--cow")
            .arg(v.join("v3_lz4_65536.cow"))
            .arg("--fuse")
            .arg(&dir)
            .arg("--fuse-uring")
            .output()
            .unwrap();
        set_fuse_uring_param(true);
        out
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("echo Y > /sys/module/fuse/parameters/enable_uring"),
        "{err}"
    );
    assert_nothing_left(tmp.path());
    // Without a frontend to put it on, the flag is refused.
    let out = run_vabc(&[
        "serve",
        "--base",
        &v.join("base.img").to_string_lossy(),
        "--cow",
        &v.join("v3_lz4_65536.cow").to_string_lossy(),
        "--nbd",
        "unix:/nonexistent/x.sock",
        "--fuse-uring",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--fuse-uring) needs --fuse DIR or --mount"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--fuse-transport auto` (the default) serves over the rings when the switch is on, and
/// through /dev/fuse, with a note saying how to switch them on, when it is off; both
/// give the expected image. Asking for both transports at once is refused.
#[test]
fn auto_transport_follows_the_kernel_switch() {
    let x = VectorExport::new("v3_lz4_65536.cow");
    let (tmp, dir, expected) = (&x.tmp, &x.dir, &x.expected);
    for on in [true, false] {
        let log = tmp.path().join(format!("serve-{on}.log"));
        let server = {
            let _guard = PARAM_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            set_fuse_uring_param(on);
            let mut args = x.args();
            args.extend([os("--fuse-transport"), os("auto")]);
            let server = Server::start_logged(&args, &log);
            set_fuse_uring_param(true);
            server
        };
        let via = if on {
            "over FUSE io_uring"
        } else {
            "through /dev/fuse"
        };
        server.assert_said(via);
        assert_same_file(&dir.join("disk.img"), expected);
        if on {
            let (ring, _dev) = stop_and_count(server, &log);
            assert!(ring >= 3, "only {ring} requests via the rings");
        } else {
            let status = server.stop();
            let text = std::fs::read_to_string(&log).unwrap();
            assert!(status.success(), "serve exited with {status}: {text}");
            assert!(
                text.contains("switched off") && text.contains("echo Y >"),
                "no note on the switch: {text}"
            );
            assert!(!text.contains("via the rings"), "{text}");
        }
        assert_nothing_left(tmp.path());
    }
    let out = Command::new(vabc())
        .arg("serve")
        .args(x.args())
        .args(["--fuse-uring", "--fuse-transport", "classic"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot be used with"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_nothing_left(tmp.path());
}

/// SEEK_DATA / SEEK_HOLE on the exported file, through the rings and through /dev/fuse:
/// the ZERO ops and the base's hole are holes, the end of the file is one, and reads
/// still give new.img.
#[test]
fn seek_data_and_hole_follow_the_allocation_map() {
    use std::os::fd::AsRawFd;
    const MIB: i64 = 1 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let (old, new, cow) = sparse_pair(tmp.path());
    let dir = tmp.path().join("mnt");
    std::fs::create_dir(&dir).unwrap();
    for transport in ["uring", "classic"] {
        let log = tmp.path().join(format!("serve-{transport}.log"));
        let server = {
            let _guard = PARAM_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            set_fuse_uring_param(true);
            Server::start_logged(
                &[
                    os("--base"),
                    old.as_os_str(),
                    os("--cow"),
                    cow.as_os_str(),
                    os("--fuse"),
                    dir.as_os_str(),
                    os("--fuse-transport"),
                    os(transport),
                ],
                &log,
            )
        };
        let f = std::fs::File::open(dir.join("disk.img")).unwrap();
        let seek = |off: i64, whence: i32| -> Result<i64, i32> {
            // SAFETY: lseek on a descriptor `f` owns; no pointers.
            let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
            if r < 0 {
                Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
            } else {
                Ok(r)
            }
        };
        let (data, hole) = (libc::SEEK_DATA, libc::SEEK_HOLE);
        for (off, whence, want) in [
            (0, hole, Ok(MIB)),
            (0, data, Ok(0)),
            (MIB, data, Ok(2 * MIB)),
            (MIB + 12345, hole, Ok(MIB + 12345)),
            (2 * MIB, hole, Ok(3 * MIB)),
            (3 * MIB, data, Ok(5 * MIB)),
            (5 * MIB, hole, Ok(8 * MIB)),
            (8 * MIB - 1, data, Ok(8 * MIB - 1)),
            (8 * MIB, data, Err(libc::ENXIO)),
            (8 * MIB, hole, Err(libc::ENXIO)),
        ] {
            assert_eq!(
                seek(off, whence),
                want,
                "{transport}: seek {whence} from {off}"
            );
        }
        drop(f);
        assert_same_file(&dir.join("disk.img"), &new);
        let status = server.stop();
        assert!(
            status.success(),
            "{}",
            std::fs::read_to_string(&log).unwrap()
        );
        assert_nothing_left(tmp.path());
    }
}
