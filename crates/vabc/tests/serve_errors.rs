//! Bad input to `vabc serve`: a clear error naming the culprit, a non-zero exit, and
//! nothing left mounted or attached.

mod serve_common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use serve_common::*;

struct Setup {
    _tmp: tempfile::TempDir,
    t: PathBuf,
    old: PathBuf,
    new: PathBuf,
    cow: PathBuf,
    size: u64,
}

impl Setup {
    /// `--base OLD --cow COW` followed by `rest`.
    fn args<'a>(&'a self, rest: &[&'a OsStr]) -> Vec<&'a OsStr> {
        let mut v = vec![
            os("--base"),
            self.old.as_os_str(),
            os("--cow"),
            self.cow.as_os_str(),
        ];
        v.extend_from_slice(rest);
        v
    }
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().to_path_buf();
    let old = corpus_image("tiny", "old", "ext4");
    let new = corpus_image("tiny", "new", "ext4");
    let cow = t.join("update.cow");
    let size = make_cow(&old, &new, &cow, 3, "lz4");
    std::fs::create_dir_all(t.join("target")).unwrap();
    std::fs::create_dir_all(t.join("fuse")).unwrap();
    Setup {
        _tmp: tmp,
        t,
        old,
        new,
        cow,
        size,
    }
}

/// Runs `vabc serve ARGS` to completion; it must fail. Returns stderr.
fn serve_fails(args: &[&OsStr]) -> String {
    let out = Command::new(vabc())
        .arg("serve")
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "vabc serve {args:?} succeeded; stderr: {stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("ready"),
        "reported ready before failing"
    );
    stderr
}

#[test]
fn truncated_cow_is_refused() {
    let s = setup();
    let cut = s.t.join("cut.cow");
    let data = std::fs::read(&s.cow).unwrap();
    std::fs::write(&cut, &data[..data.len() / 3]).unwrap();
    let err = serve_fails(&[
        os("--base"),
        s.old.as_os_str(),
        os("--cow"),
        cut.as_os_str(),
        os("--mount"),
        s.t.join("target").as_os_str(),
        os("--fuse"),
        s.t.join("fuse").as_os_str(),
    ]);
    assert!(err.contains("cut.cow"), "{err}");
    assert_nothing_left(&s.t);
}

#[test]
fn unreadable_or_missing_inputs_are_named() {
    let s = setup();
    let missing = s.t.join("missing.img");
    let err = serve_fails(&[
        os("--base"),
        missing.as_os_str(),
        os("--cow"),
        s.cow.as_os_str(),
        os("--fuse"),
        s.t.join("fuse").as_os_str(),
    ]);
    assert!(err.contains("missing.img"), "{err}");
    // The OS's reason once, not once per layer of the error.
    let enoent = std::io::Error::from_raw_os_error(2).to_string();
    assert_eq!(err.matches(&enoent).count(), 1, "{err}");
    let not_cow = &s.new;
    let err = serve_fails(&[
        os("--base"),
        s.old.as_os_str(),
        os("--cow"),
        not_cow.as_os_str(),
        os("--fuse"),
        s.t.join("fuse").as_os_str(),
    ]);
    assert!(err.contains("new.ext4.img"), "{err}");
    assert_nothing_left(&s.t);
}

#[test]
fn base_of_the_wrong_size_is_refused() {
    let s = setup();
    let short = s.t.join("short-base.img");
    let f = std::fs::File::create(&short).unwrap();
    std::io::copy(&mut std::fs::File::open(&s.old).unwrap(), &mut &f).unwrap();
    f.set_len(s.size / 2).unwrap();
    drop(f);
    let size = s.size.to_string();
    let err = serve_fails(&[
        os("--base"),
        short.as_os_str(),
        os("--cow"),
        s.cow.as_os_str(),
        os("--size"),
        os(&size),
        os("--mount"),
        s.t.join("target").as_os_str(),
        os("--fuse"),
        s.t.join("fuse").as_os_str(),
    ]);
    assert!(
        err.contains("short-base.img") && err.contains("base"),
        "{err}"
    );
    // A size smaller than the COW covers is refused as well.
    let err = serve_fails(&s.args(&[
        os("--size"),
        os("4096"),
        os("--fuse"),
        s.t.join("fuse").as_os_str(),
    ]));
    assert!(err.contains("smaller than"), "{err}");
    assert_nothing_left(&s.t);
}

#[test]
fn nonexistent_mount_point_is_refused() {
    let s = setup();
    let nowhere = s.t.join("does-not-exist");
    let err = serve_fails(&s.args(&[os("--mount"), nowhere.as_os_str()]));
    assert!(err.contains("does-not-exist"), "{err}");
    assert!(!nowhere.exists());
    let err = serve_fails(&s.args(&[os("--fuse"), nowhere.as_os_str()]));
    assert!(err.contains("does-not-exist"), "{err}");
    assert_nothing_left(&s.t);
}

#[test]
fn second_serve_on_a_busy_mount_point_is_refused() {
    let s = setup();
    let target = s.t.join("target");
    let fuse2 = s.t.join("fuse2");
    std::fs::create_dir_all(&fuse2).unwrap();
    let first = Server::start(&s.args(&[
        os("--fuse"),
        s.t.join("fuse").as_os_str(),
        os("--mount"),
        target.as_os_str(),
    ]));
    let before = mounts_under(&s.t);
    // Same mount target.
    let err = serve_fails(&s.args(&[
        os("--fuse"),
        fuse2.as_os_str(),
        os("--mount"),
        target.as_os_str(),
    ]));
    assert!(
        err.contains("already a mount point") && err.contains("target"),
        "{err}"
    );
    // Same FUSE directory.
    let err = serve_fails(&s.args(&[os("--fuse"), s.t.join("fuse").as_os_str()]));
    assert!(err.contains("already a mount point"), "{err}");
    assert_eq!(
        mounts_under(&s.t),
        before,
        "a refused serve changed the mounts"
    );
    // The first server is unharmed.
    let (same, out) = run(Command::new("cmp")
        .arg(s.t.join("fuse/disk.img"))
        .arg(&s.new));
    assert!(same, "{out}");
    assert!(first.stop().success());
    assert_nothing_left(&s.t);
}

#[test]
fn bad_nbd_address_and_busy_socket_are_refused() {
    let s = setup();
    let err = serve_fails(&s.args(&[os("--nbd"), os("udp:1")]));
    assert!(err.contains("udp:1"), "{err}");
    let sock = s.t.join("nbd.sock");
    let addr = format!("unix:{}", sock.display());
    let first = Server::start(&s.args(&[os("--nbd"), os(&addr)]));
    let err = serve_fails(&s.args(&[os("--nbd"), os(&addr)]));
    assert!(err.contains("nbd.sock"), "{err}");
    assert!(first.stop().success());
    assert!(!Path::new(&sock).exists());
}
