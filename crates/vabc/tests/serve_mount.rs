//! `vabc serve --mount` / `--fuse` on real corpus pairs: the mounted tree equals the tree
//! of new.img mounted directly, the served ext4 device passes `e2fsck -fn`, the FUSE file
//! equals new.img byte for byte (also under 8 concurrent reader processes), and after
//! SIGTERM nothing is left mounted or attached.

mod serve_common;

use std::path::Path;
use std::process::Command;

use serve_common::*;

fn mount_case(pair: &str, kind: &str, version: u16, codec: &str) {
    let old = corpus_image(pair, "old", kind);
    let new = corpus_image(pair, "new", kind);
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let cow = t.join("update.cow");
    let size = make_cow(&old, &new, &cow, version, codec);
    let (fuse_dir, target) = (t.join("fuse"), t.join("target"));
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&target).unwrap();
    let size_arg = size.to_string();
    {
        let server = Server::start(&[
            os("--base"),
            old.as_os_str(),
            os("--cow"),
            cow.as_os_str(),
            os("--size"),
            os(&size_arg),
            os("--fuse"),
            fuse_dir.as_os_str(),
            os("--mount"),
            target.as_os_str(),
        ]);
        let reference = RefMount::new(&new, kind, &t.join("ref"));
        let (same, out) = run(Command::new("diff")
            .args(["-r", "--no-dereference"])
            .arg(&reference.dir)
            .arg(&target));
        assert!(
            same,
            "{pair}/{kind}: served tree differs from new.img:\n{out}"
        );
        // Sanity: the tree is not empty and really comes from the served mount.
        assert!(
            target.join("build.prop").exists(),
            "{pair}/{kind}: no build.prop in served tree"
        );
        let mounts = mounts_under(t);
        assert!(mounts.iter().any(|m| m.ends_with("/target")), "{mounts:?}");
        if kind == "ext4" {
            let lo = server
                .loop_device()
                .expect("ext4 is served through a loop device");
            let dio = std::fs::read_to_string(format!(
                "/sys/block/{}/loop/dio",
                lo.trim_start_matches("/dev/")
            ))
            .unwrap();
            assert_eq!(dio.trim(), "1", "loop device not in direct-I/O mode");
            let (clean, out) = run(Command::new("e2fsck").args(["-fn"]).arg(&lo));
            assert!(clean, "{pair}: e2fsck -fn on served {lo} not clean:\n{out}");
        } else {
            assert!(
                server.loop_device().is_none(),
                "EROFS must not use a loop device: {:?}",
                server.stdout
            );
            let b = loops_backed_by(&t.to_string_lossy());
            assert!(b.is_empty(), "EROFS mount attached a loop device: {b:?}");
        }
        drop(reference);
        let status = server.stop();
        assert!(
            status.success(),
            "{pair}/{kind}: serve exited with {status}"
        );
    }
    assert_nothing_left(t);
}

#[test]
fn tiny_ext4_mount_matches_new_image() {
    mount_case("tiny", "ext4", 3, "lz4");
}

#[test]
fn tiny_erofs_mount_matches_new_image() {
    mount_case("tiny", "erofs", 2, "gz");
}

#[test]
fn small_ext4_mount_matches_new_image() {
    mount_case("small", "ext4", 2, "zstd");
}

#[test]
fn small_erofs_mount_matches_new_image() {
    mount_case("small", "erofs", 3, "zstd");
}

/// The FUSE file alone: byte-exact, e2fsck-clean, and correct under 8 concurrent reader
/// processes of random ranges.
#[test]
fn fuse_file_is_byte_exact_under_concurrent_readers() {
    let old = corpus_image("small", "old", "ext4");
    let new = corpus_image("small", "new", "ext4");
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let cow = t.join("update.cow");
    let size = make_cow(&old, &new, &cow, 3, "lz4");
    let fuse_dir = t.join("fuse");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    {
        let server = Server::start(&[
            os("--base"),
            old.as_os_str(),
            os("--cow"),
            cow.as_os_str(),
            os("--fuse"),
            fuse_dir.as_os_str(),
        ]);
        let disk = fuse_dir.join("disk.img");
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), size);
        let (same, out) = run(Command::new("cmp").arg(&disk).arg(&new));
        assert!(same, "served image differs: {out}");
        let (clean, out) = run(Command::new("e2fsck").arg("-fn").arg(&disk));
        assert!(clean, "e2fsck -fn on the FUSE file: {out}");
        assert!(
            std::fs::OpenOptions::new().write(true).open(&disk).is_err(),
            "FUSE file opened for writing"
        );

        // 8 processes, each checking 40 random (offset, length) ranges with cmp.
        let mut rng = fastrand::Rng::with_seed(0x2545_f491_4f6c_dd1d);
        let mut next = move || rng.u64(..);
        let procs: Vec<_> = (0..8)
            .map(|_| {
                let mut script = String::from("set -e\n");
                for _ in 0..40 {
                    let off = next() % size;
                    let len = (next() % (3 << 20)).min(size - off).max(1);
                    script.push_str(&format!(
                        "cmp -i {off}:{off} -n {len} '{}' '{}'\n",
                        disk.display(),
                        new.display()
                    ));
                }
                Command::new("sh").arg("-c").arg(script).spawn().unwrap()
            })
            .collect();
        for mut p in procs {
            assert!(
                p.wait().unwrap().success(),
                "a concurrent reader saw different bytes"
            );
        }
        assert!(server.stop().success());
    }
    assert_nothing_left(t);
}

/// Without --fuse the stack uses a private directory, which is removed again.
#[test]
fn default_fuse_dir_is_cleaned_up() {
    let old = corpus_image("tiny", "old", "ext4");
    let new = corpus_image("tiny", "new", "ext4");
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let cow = t.join("update.cow");
    make_cow(&old, &new, &cow, 3, "zstd");
    let target = t.join("target");
    std::fs::create_dir_all(&target).unwrap();
    let server = Server::start(&[
        os("--base"),
        old.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--mount"),
        target.as_os_str(),
        os("--fstype"),
        os("ext4"),
    ]);
    let pid = server.pid();
    let private = std::env::temp_dir().join(format!("vabc-serve-{pid}-0"));
    assert!(
        private.join("disk.img").exists(),
        "FUSE file not in {}",
        private.display()
    );
    assert!(target.join("build.prop").exists());
    assert!(server.stop().success());
    assert!(!private.exists(), "{} left behind", private.display());
    assert_nothing_left(t);
    assert_nothing_left(Path::new(&private));
}
