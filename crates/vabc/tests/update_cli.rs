//! `vabc update` on this machine's kernel, served through FUSE + loop (ublk and
//! dm-verity are the VM tier's): an update installed into a store boots from base +
//! COW, merges once marked good while it is served, and leaves the store clean; a
//! new system never marked good is rolled back after its allowed boots with the base
//! untouched; bad input (another base, a truncated bundle, a full store, a missing or
//! newer state file, a rollback after the merge began) changes nothing; an install
//! killed at random points resumes, booting the old system meanwhile.

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serve_common::{corpus_image, run_vabc, sha256_file, sigterm, vabc};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(args: &[&str]) -> std::process::Output {
    let o = run_vabc(args);
    assert!(
        o.status.success(),
        "vabc {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn json(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap()
}

/// A device: a base image (a copy of the tiny ext4 pair's old image), a store, a run
/// folder, and a signed --verity bundle of the update to the new image.
struct Device {
    dir: tempfile::TempDir,
    base: PathBuf,
    store: PathBuf,
    run: PathBuf,
    bundle: PathBuf,
    public: PathBuf,
    old_sha: String,
    new_sha: String,
}

impl Device {
    fn new() -> Device {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let (old, new) = (
            corpus_image("tiny", "old", "ext4"),
            corpus_image("tiny", "new", "ext4"),
        );
        let base = d.join("base.img");
        std::fs::copy(&old, &base).unwrap();
        let key = d.join("k.pem");
        let public = d.join("k.pub.pem");
        for args in [
            &["genpkey", "-algorithm", "ed25519", "-out", s(&key)][..],
            &["pkey", "-in", s(&key), "-pubout", "-out", s(&public)][..],
        ] {
            assert!(
                Command::new("openssl")
                    .args(args)
                    .status()
                    .unwrap()
                    .success()
            );
        }
        let bundle = d.join("u.vabc");
        let p = format!("system={},{}", old.display(), new.display());
        ok(&[
            "bundle",
            "create",
            "-p",
            &p,
            "-o",
            s(&bundle),
            "--key",
            s(&key),
            "--verity",
        ]);
        let store = d.join("store");
        ok(&["update", "init", "--store", s(&store)]);
        Device {
            base,
            store,
            run: d.join("run"),
            bundle,
            public,
            old_sha: sha256_file(&old),
            new_sha: sha256_file(&new),
            dir,
        }
    }

    fn base_arg(&self) -> String {
        format!("system={}", self.base.display())
    }

    fn install_args(&self, bundle: &Path) -> Vec<String> {
        [
            "update",
            "install",
            "--store",
            s(&self.store),
            s(bundle),
            "-b",
            &self.base_arg(),
            "--key",
            s(&self.public),
            "--max-boot-attempts",
            "2",
        ]
        .map(String::from)
        .to_vec()
    }

    fn install(&self) {
        let args = self.install_args(&self.bundle);
        ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }

    fn state(&self) -> serde_json::Value {
        json(&ok(&[
            "update",
            "status",
            "--store",
            s(&self.store),
            "--json",
        ]))
    }

    /// `boot` as the initramfs runs it; returns its JSON report.
    fn boot(&self) -> serde_json::Value {
        json(&ok(&[
            "update",
            "boot",
            "--store",
            s(&self.store),
            "-b",
            &self.base_arg(),
            "--frontend",
            "fuse",
            "--run-dir",
            s(&self.run),
            "--json",
        ]))
    }

    /// The power goes: the daemon is stopped (SIGTERM takes its loop device and FUSE
    /// mount down, which a real power cut does by itself).
    fn power_off(&self) {
        let ready = self.run.join("system.ready");
        let Ok(text) = std::fs::read_to_string(&ready) else {
            return;
        };
        let pid = json_text(&text)["pid"].as_u64().unwrap() as u32;
        sigterm(pid);
        let t = Instant::now();
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "daemon {pid} did not stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `b` (a boot's report) mounted the base, which holds `sha`, with no update left
    /// in the store.
    fn assert_booted_base(&self, b: &serde_json::Value, sha: &str) {
        assert_eq!(b["state"], "none", "{b}");
        assert_eq!(b["partitions"][0]["served"], false, "{b}");
        assert_eq!(device_of(b), self.base);
        assert_eq!(self.store_files(), ["state"]);
        assert_eq!(sha256_file(&self.base), sha);
    }

    fn store_files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.store)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.power_off();
        let _ = &self.dir;
    }
}

fn json_text(t: &str) -> serde_json::Value {
    serde_json::from_str(t).unwrap()
}

fn device_of(boot: &serde_json::Value) -> PathBuf {
    PathBuf::from(boot["partitions"][0]["device"].as_str().unwrap())
}

#[test]
fn an_update_boots_from_its_cow_merges_once_marked_good_and_leaves_a_clean_store() {
    let d = Device::new();
    d.install();
    assert_eq!(d.state()["state"], "installed");
    assert_eq!(
        d.store_files(),
        [
            "state",
            "system.cow",
            "system.cow.manifest",
            "system.verity"
        ]
    );

    // Not before this boot runs the update.
    let o = run_vabc(&[
        "update",
        "mark-good",
        "--store",
        s(&d.store),
        "--run-dir",
        s(&d.run),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not run the update"));
    assert_eq!(d.state()["state"], "installed");

    let b = d.boot();
    assert_eq!(b["state"], "installed");
    assert_eq!(b["boot_attempts"], 1);
    assert_eq!(b["partitions"][0]["served"], true);
    assert_eq!(b["partitions"][0]["verity"], "userspace");
    let dev = device_of(&b);
    assert_eq!(
        sha256_file(&dev),
        d.new_sha,
        "the served device is the new image"
    );
    assert_eq!(
        sha256_file(&d.base),
        d.old_sha,
        "nothing merged before mark-good"
    );

    // Rollback is allowed now; mark-good instead, and the daemon merges while serving.
    ok(&[
        "update",
        "mark-good",
        "--store",
        s(&d.store),
        "--run-dir",
        s(&d.run),
    ]);
    let t = Instant::now();
    while d.state()["state"] != "merged" {
        assert!(t.elapsed() < Duration::from_secs(120), "{}", d.state());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(sha256_file(&d.base), d.new_sha, "merged in place");
    assert_eq!(
        sha256_file(&dev),
        d.new_sha,
        "still served right after the merge"
    );
    let o = run_vabc(&["update", "rollback", "--store", s(&d.store)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to roll back to"));

    // The next boot mounts the base and removes the COW.
    d.power_off();
    d.assert_booted_base(&d.boot(), &d.new_sha);
}

#[test]
fn a_new_system_never_marked_good_is_rolled_back_after_its_boots() {
    let d = Device::new();
    d.install();
    for attempt in 1..=2 {
        let b = d.boot();
        assert_eq!(b["boot_attempts"], attempt);
        assert_eq!(sha256_file(&device_of(&b)), d.new_sha);
        // Its health check fails: no mark-good, the device reboots.
        d.power_off();
    }
    let b = d.boot();
    assert!(b["note"].as_str().unwrap().contains("rolled back"), "{b}");
    d.assert_booted_base(&b, &d.old_sha);
}

#[test]
fn bad_input_changes_nothing_on_the_device() {
    let d = Device::new();
    let code = |args: &[String]| {
        let o = run_vabc(&args.iter().map(String::as_str).collect::<Vec<_>>());
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let unchanged = |what: &str| {
        assert_eq!(d.state()["state"], "none", "{what}");
        assert_eq!(d.store_files(), ["state"], "{what}");
        assert_eq!(sha256_file(&d.base), d.old_sha, "{what}");
    };

    // An update for another base: exit 3, the region named.
    let other = d.dir.path().join("other.img");
    std::fs::copy(corpus_image("tiny", "new", "ext4"), &other).unwrap();
    let mut args = d.install_args(&d.bundle);
    args[6] = format!("system={}", other.display());
    let (c, e) = code(&args);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("region"), "{e}");
    unchanged("another base");

    // A truncated bundle, from a file and from a stream (stdin).
    let good = std::fs::read(&d.bundle).unwrap();
    let cut = d.dir.path().join("cut.vabc");
    std::fs::write(&cut, &good[..good.len() * 2 / 3]).unwrap();
    let (c, e) = code(&d.install_args(&cut));
    assert_eq!(c, Some(1), "{e}");
    assert!(e.contains("truncated"), "{e}");
    unchanged("a truncated bundle file");
    let mut args = d.install_args(Path::new("-"));
    args.insert(0, String::new());
    let mut child = Command::new(vabc())
        .args(&args[1..])
        .stdin(std::fs::File::open(&cut).unwrap())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(!child.wait().unwrap().success());
    unchanged("a truncated bundle stream");

    // A store without the space for the COW (a 1 MiB tmpfs).
    let small = d.dir.path().join("small");
    std::fs::create_dir(&small).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "vabc-test", s(&small)])
        .status()
        .unwrap();
    assert!(st.success(), "mount a 1 MiB tmpfs (the tests run as root)");
    let small_store = small.join("store");
    ok(&["update", "init", "--store", s(&small_store)]);
    let mut args = d.install_args(&d.bundle);
    args[3] = s(&small_store).to_string();
    let (c, e) = code(&args);
    let _ = Command::new("umount").arg(&small).status();
    assert_eq!(c, Some(1), "{e}");
    assert!(e.contains("bytes free"), "{e}");

    // A missing state file, and one from a newer vabc: every command refuses.
    let state = d.store.join("state");
    std::fs::remove_file(&state).unwrap();
    let (c, e) = code(&d.install_args(&d.bundle));
    assert_eq!(c, Some(1));
    assert!(e.contains("no state file"), "{e}");
    assert!(!state.exists() && d.store_files().is_empty());
    std::fs::write(&state, "{\"schema_version\": 9, \"state\": \"none\"}\n").unwrap();
    for sub in ["status", "mark-good", "rollback", "boot"] {
        let (c, e) = code(&["update", sub, "--store", s(&d.store)].map(String::from));
        assert_eq!(c, Some(1), "{sub}: {e}");
        assert!(e.contains("newer than this vabc"), "{sub}: {e}");
    }
    assert_eq!(
        std::fs::read_to_string(&state).unwrap(),
        "{\"schema_version\": 9, \"state\": \"none\"}\n"
    );
}

#[test]
fn a_damaged_cow_in_the_store_boots_the_base_until_it_is_rolled_back() {
    let d = Device::new();
    d.install();
    let cow = d.store.join("system.cow");
    let len = std::fs::metadata(&cow).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&cow)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let boot = || {
        run_vabc(&[
            "update",
            "boot",
            "--store",
            s(&d.store),
            "--frontend",
            "fuse",
            "--run-dir",
            s(&d.run),
            "--json",
        ])
    };
    // Each boot says why it cannot serve the update, serves nothing (the initramfs
    // hook then boots the base), and counts the attempt.
    for attempt in 1..=2 {
        let o = boot();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{e}");
        assert!(e.contains("system.cow"), "{e}");
        assert!(!d.run.join("system.ready").exists());
        assert_eq!(d.state()["boot_attempts"], attempt);
        assert_eq!(sha256_file(&d.base), d.old_sha);
    }
    let o = boot();
    assert!(o.status.success());
    d.assert_booted_base(&json(&o), &d.old_sha);
}

#[test]
fn an_install_killed_at_random_points_boots_the_old_system_and_resumes() {
    let d = Device::new();
    let args = d.install_args(&d.bundle);
    let mut rng = fastrand::Rng::with_seed(5);
    for round in 0..5 {
        let mut child = Command::new(vabc())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(rng.u64(0..500)));
        let _ = child.kill();
        let _ = child.wait();
        let st = d.state()["state"].as_str().unwrap().to_string();
        if st == "installed" {
            // It finished before the kill: start over.
            ok(&["update", "rollback", "--store", s(&d.store)]);
            continue;
        }
        if round % 2 == 1 && st == "installing" {
            // Rolled back instead: nothing the interrupted install wrote is left.
            ok(&["update", "rollback", "--store", s(&d.store)]);
            assert_eq!(d.store_files(), ["state"], "round {round}");
            continue;
        }
        // The power goes now: the boot runs the old system.
        let b = d.boot();
        assert!(
            ["none", "installing"].contains(&b["state"].as_str().unwrap()),
            "{round}: {b}"
        );
        assert_eq!(b["partitions"][0]["served"], false);
        assert_eq!(device_of(&b), d.base);
        assert_eq!(sha256_file(&d.base), d.old_sha);
        // The old system runs the install again: it completes.
        ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(d.state()["state"], "installed", "round {round}");
        let b = d.boot();
        assert_eq!(sha256_file(&device_of(&b)), d.new_sha, "round {round}");
        d.power_off();
        ok(&["update", "rollback", "--store", s(&d.store)]);
        assert_eq!(d.store_files(), ["state"]);
    }
}

/// A loop device over a file, with its file system mounted read-only: the running
/// old system's root. Detached on drop.
struct Mounted {
    dev: String,
    dir: PathBuf,
}

impl Mounted {
    fn new(img: &Path, dir: &Path) -> Mounted {
        let out = Command::new("losetup")
            .args(["-f", "--show", "-r", s(img)])
            .output()
            .unwrap();
        assert!(out.status.success(), "losetup (the tests run as root)");
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
        std::fs::create_dir_all(dir).unwrap();
        let st = Command::new("mount")
            .args(["-o", "ro", &dev, s(dir)])
            .status()
            .unwrap();
        assert!(st.success(), "mount {dev}");
        Mounted {
            dev,
            dir: dir.to_path_buf(),
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

/// An ext4 image of one 2 MiB file whose bytes depend on `seed`, made as
/// `mkfs.ext4 -d` makes it (block groups left for the kernel to initialise).
fn ext4_image(dir: &Path, name: &str, seed: u8) -> PathBuf {
    let tree = dir.join(format!("{name}.d"));
    std::fs::create_dir_all(&tree).unwrap();
    let data: Vec<u8> = (0..2u32 << 20)
        .map(|i| (i / 4096) as u8 ^ seed.wrapping_mul((i % 7) as u8))
        .collect();
    std::fs::write(tree.join("file"), data).unwrap();
    let img = dir.join(format!("{name}.img"));
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "4096", "-d", s(&tree), s(&img), "16M"])
        .status()
        .unwrap();
    assert!(st.success(), "mkfs.ext4");
    img
}

#[test]
fn an_install_reads_a_mounted_ext4_base_as_the_disk_holds_it() {
    let d = Device::new();
    let dir = d.dir.path();
    let (old, new) = (ext4_image(dir, "old", 1), ext4_image(dir, "new", 2));
    let bundle = dir.join("ext4.vabc");
    let p = format!("system={},{}", old.display(), new.display());
    ok(&["bundle", "create", "-p", &p, "-o", s(&bundle), "--unsigned"]);
    let m = Mounted::new(&old, &dir.join("root"));
    // The precondition: a mounted ext4 fills its lazily initialised bitmaps in the
    // device's page cache, so read through it the base is not the one on the disk.
    let cached = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(std::fs::read(&m.dev).unwrap()))
    };
    assert_ne!(
        cached,
        sha256_file(&old),
        "the page cache holds the mounted ext4's view"
    );
    let out = dir.join("out");
    std::fs::create_dir(&out).unwrap();
    let b = format!("system={}", m.dev);
    ok(&[
        "bundle",
        "install",
        s(&bundle),
        "-b",
        &b,
        "-o",
        s(&out),
        "--allow-unsigned",
    ]);
    drop(m);
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        2,
        "the COW and its manifest"
    );
}
