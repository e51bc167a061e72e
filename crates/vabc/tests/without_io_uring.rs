//! With io_uring disabled for the process (`kernel.io_uring_disabled`, as a
//! container's seccomp filter also does): `vabc serve` and `vabc merge` fall back to
//! /dev/fuse and the sync engine by default and say why, and refuse when io_uring is
//! asked for by name. In a test binary of its own: the switch is system-wide, and
//! tests running beside it would lose io_uring too.

mod serve_common;

use std::process::Command;
use std::sync::Mutex;

use serve_common::*;

/// One test at a time has io_uring disabled.
static LOCK: Mutex<()> = Mutex::new(());

/// Sets `/proc/sys/kernel/io_uring_disabled` and puts the old value back when dropped.
struct IoUringDisabled {
    old: String,
    _lock: std::sync::MutexGuard<'static, ()>,
}

impl IoUringDisabled {
    const PATH: &str = "/proc/sys/kernel/io_uring_disabled";

    fn new() -> IoUringDisabled {
        let lock = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let old = std::fs::read_to_string(Self::PATH).unwrap();
        std::fs::write(Self::PATH, "2").unwrap();
        IoUringDisabled {
            old: old.trim().to_string(),
            _lock: lock,
        }
    }
}

impl Drop for IoUringDisabled {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, &self.old);
    }
}

#[test]
fn serve_answers_through_dev_fuse() {
    let x = VectorExport::new("v3_lz4_65536.cow");
    let log = x.tmp.path().join("serve.log");
    let mut args = x.args();
    args.push(os("--fuse-transport"));
    set_fuse_uring_param(true);
    let _off = IoUringDisabled::new();
    let refused = Command::new(vabc())
        .arg("serve")
        .args(&args)
        .arg("uring")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{err}");
    assert!(err.contains("cannot create an io_uring instance"), "{err}");
    assert_nothing_left(x.tmp.path());
    args.push(os("auto"));
    let server = Server::start_logged(&args, &log);
    server.assert_said("through /dev/fuse");
    assert!(
        std::fs::read(x.dir.join("disk.img")).unwrap() == std::fs::read(&x.expected).unwrap(),
        "served image differs from expected.img"
    );
    let status = server.stop();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{text}");
    assert!(
        text.contains("cannot create an io_uring instance"),
        "{text}"
    );
    assert_nothing_left(x.tmp.path());
}

#[test]
fn merge_runs_on_the_sync_engine() {
    let v = vectors();
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.img");
    let cow = tmp.path().join("update.cow");
    std::fs::copy(v.join("base.img"), &base).unwrap();
    std::fs::copy(v.join("v3_lz4_65536.cow"), &cow).unwrap();
    let (b, c) = (base.to_str().unwrap(), cow.to_str().unwrap());
    let _off = IoUringDisabled::new();
    let (b0, c0) = (sha256_file(&base), sha256_file(&cow));
    let o = run_vabc(&[
        "merge",
        "--without-manifest",
        "--base",
        b,
        "--cow",
        c,
        "--engine",
        "uring",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("cannot set up io_uring"), "{err}");
    assert_eq!((sha256_file(&base), sha256_file(&cow)), (b0, c0));
    let o = run_vabc(&[
        "merge",
        "--without-manifest",
        "--base",
        b,
        "--cow",
        c,
        "--json",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("merging with the sync engine"), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["engine"], "sync");
    assert_eq!(report["complete"], true);
    assert!(
        std::fs::read(&base).unwrap() == std::fs::read(v.join("expected.img")).unwrap(),
        "merged base differs from expected.img"
    );
}
