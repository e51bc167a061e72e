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

/// The `small` ext4 pair's update made by `vabc diff DIFF_ARGS` in `t`: (new.img, a
/// copy of old.img to merge into, the COW).
fn small_pair_update(
    t: &std::path::Path,
    diff_args: &[&str],
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
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
    (new, base, cow)
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
    let (new, base, cow) = small_pair_update(t, diff_args);
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

/// The FUSE file served over io_uring (the default transport where the kernel allows
/// it) while the base is merged underneath: four readers of random ranges see only the
/// new image's bytes, and so does a whole read after the merge.
#[test]
fn fuse_rings_serve_the_new_image_during_merge() {
    fuse_serves_new_image_during_merge(false);
}

/// The same with every block checked against a dm-verity tree of the new image, and a
/// sequential reader besides (read ahead, hashed by the checker threads): no block
/// fails its check while the base changes underneath.
#[test]
fn verified_fuse_serves_the_new_image_during_merge() {
    fuse_serves_new_image_during_merge(true);
}

fn fuse_serves_new_image_during_merge(verified: bool) {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (new, base, cow) = small_pair_update(t, &["--compression", "lz4"]);
    let size = std::fs::metadata(&new).unwrap().len();
    let dir = t.join("fuse");
    std::fs::create_dir(&dir).unwrap();
    set_fuse_uring_param(true);
    let size_arg = size.to_string();
    let mut args = vec![
        os("--base"),
        base.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--size"),
        os(&size_arg),
        os("--fuse"),
        dir.as_os_str(),
        os("--fuse-transport"),
        os("uring"),
        os("--merge"),
    ];
    let hash = t.join("new.verity");
    let root;
    if verified {
        root = verity_format(&new, &hash)["root_hash"]
            .as_str()
            .unwrap()
            .to_string();
        args.extend([
            os("--verity-hash"),
            hash.as_os_str(),
            os("--root-hash"),
            os(&root),
        ]);
    }
    let server = Server::start_logged(&args, &t.join("serve.log"));
    server.assert_said("over FUSE io_uring");
    if verified {
        server.assert_said("verifying every block");
    }
    let want = std::sync::Arc::new(std::fs::read(&new).unwrap());
    assert_eq!(want.len() as u64, size);
    let disk = dir.join("disk.img");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Readers 0-3 read random ranges; reader 4 (verified only) streams 1 MiB requests
    // from start to end, over and over.
    let readers: Vec<_> = (0..4u64 + u64::from(verified))
        .map(|r| {
            let (want, done, disk) = (want.clone(), done.clone(), disk.clone());
            std::thread::spawn(move || {
                let f = std::fs::File::open(&disk).unwrap();
                let mut rng = fastrand::Rng::with_seed(r.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                let mut reads = 0u64;
                let mut pos = 0u64;
                // At least 200 reads each, and on until the merge is over.
                while reads < 200 || !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let (off, len) = if r == 4 {
                        let len = (1u64 << 20).min(size - pos);
                        let at = pos;
                        pos = if at + len >= size { 0 } else { at + len };
                        (at, len)
                    } else {
                        let x = rng.u64(..);
                        let len = [BS as u64, 3 * BS as u64 + 100, 256 << 10][(x % 3) as usize];
                        ((x >> 8) % (size - len), len)
                    };
                    let mut buf = vec![0u8; len as usize];
                    f.read_exact_at(&mut buf, off)
                        .unwrap_or_else(|e| panic!("reader {r}: {len} bytes at {off}: {e}"));
                    assert!(
                        buf[..] == want[off as usize..][..len as usize],
                        "reader {r}: wrong bytes at {off}+{len}"
                    );
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (merged_ops, total) = merged(&cow);
        if merged_ops == total {
            break;
        }
        assert!(Instant::now() < deadline, "merge not finished");
        std::thread::sleep(Duration::from_millis(20));
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() >= 200);
    }
    assert!(
        std::fs::read(&disk).unwrap() == *want,
        "served image after merge"
    );
    assert!(server.stop().success());
    // Not one read failed (each failure is logged with its offset), and the merge ran
    // to its end in this server.
    let log = std::fs::read_to_string(t.join("serve.log")).unwrap();
    assert!(!log.contains(" read of "), "{log}");
    assert!(log.contains("merge complete"), "{log}");
    assert!(
        std::fs::read(&base).unwrap() == *want,
        "base is not the new image after the merge"
    );
    assert_nothing_left(t);
}
