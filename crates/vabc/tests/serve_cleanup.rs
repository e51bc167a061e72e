//! A `vabc serve` killed with SIGKILL cannot tear down: its ext4 mount, loop device and
//! FUSE mount stay. `vabc cleanup` removes them all from the record the daemon left.

mod serve_common;

use serve_common::{
    Server, assert_nothing_left, corpus_image, make_cow, mounts_under, os, run_vabc,
};

#[test]
fn cleanup_removes_what_a_killed_mount_stack_left() {
    let dir = tempfile::tempdir().unwrap();
    let old = corpus_image("tiny", "old", "ext4");
    let new = corpus_image("tiny", "new", "ext4");
    let cow = dir.path().join("u.cow");
    make_cow(&old, &new, &cow, 3, "lz4");
    let base = dir.path().join("base.img");
    std::fs::copy(&old, &base).unwrap();
    let (target, fuse) = (dir.path().join("mnt"), dir.path().join("fuse"));
    std::fs::create_dir_all(&target).unwrap();
    std::fs::create_dir_all(&fuse).unwrap();
    let server = Server::start(&[
        os("--base"),
        os(&base),
        os("--cow"),
        os(&cow),
        os("--mount"),
        os(&target),
        os("--fuse"),
        os(&fuse),
    ]);
    let pid = server.pid();
    let record = std::path::Path::new("/run/vabc").join(format!("serve-{pid}.json"));
    assert!(record.exists(), "no record at {}", record.display());
    server.kill();
    assert!(
        !mounts_under(dir.path()).is_empty(),
        "SIGKILL left nothing behind: this test tests nothing"
    );
    let o = run_vabc(&["cleanup", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ours: Vec<&serde_json::Value> = v["removed"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["pid"] == pid)
        .collect();
    let kinds: Vec<&str> = ours.iter().map(|r| r["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["mount", "loop", "fuse", "record"], "{v}");
    assert!(ours.iter().all(|r| r["error"].is_null()), "{v}");
    assert_nothing_left(dir.path());
    assert!(!record.exists());
    // Nothing left to do the second time.
    let o = run_vabc(&["cleanup"]);
    assert!(o.status.success());
}
