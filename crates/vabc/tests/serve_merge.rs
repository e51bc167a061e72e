//! `vabc serve --merge`: the image served over NBD stays the new image
//! while the base is merged in place underneath, and the base ends as the
//! new image.

mod serve_common;

use std::process::Command;
use std::time::{Duration, Instant};

use serve_common::*;

fn merged(cow: &std::path::Path) -> (u64, u64) {
    let o = Command::new(vabc())
        .args(["inspect", "--json"])
        .arg(cow)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (
        v["header"]["num_merge_ops"].as_u64().unwrap(),
        v["ops_total"].as_u64().unwrap(),
    )
}

#[test]
fn served_image_is_right_during_and_after_merge() {
    served_right_through_merge(&[]);
}

/// A COW whose ops are stored by block, the merge order in its sequence
/// data, and with more REPLACE ops (`--min-xor-run`): the served view must
/// follow the merge order, not the stream order.
#[test]
fn block_order_cow_is_right_during_and_after_merge() {
    served_right_through_merge(&["--block-order", "--min-xor-run", "16"]);
}

fn served_right_through_merge(diff_args: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let old = corpus_image("small", "old", "ext4");
    let new = corpus_image("small", "new", "ext4");
    let base = t.join("base.img");
    let cow = t.join("update.cow");
    std::fs::copy(&old, &base).unwrap();
    let o = Command::new(vabc())
        .arg("diff")
        .arg(&old)
        .arg(&new)
        .arg("-o")
        .arg(&cow)
        .args(diff_args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "diff: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let sock = t.join("nbd.sock");
    let addr = format!("unix:{}", sock.display());
    let server = Server::start(&[
        os("--base"),
        base.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--nbd"),
        os(&addr),
        os("--merge"),
    ]);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let compare = || {
        let (ok, out) = run(Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&new)
            .arg(&uri));
        assert!(
            ok && out.contains("Images are identical"),
            "qemu-img compare during merge: {out}"
        );
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut compares = 0;
    loop {
        let (done, total) = merged(&cow);
        compare();
        compares += 1;
        if done == total {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "merge not finished: {done}/{total}"
        );
    }
    compare();
    assert!(server.stop().success());
    assert!(compares >= 1);
    assert!(
        std::fs::read(&base).unwrap() == std::fs::read(&new).unwrap(),
        "base is not the new image after the merge"
    );
    // Serving again after the merge (base is new, COW fully merged) still
    // gives the new image.
    let server = Server::start(&[
        os("--base"),
        base.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--nbd"),
        os(&addr),
    ]);
    compare();
    assert!(server.stop().success());
}
