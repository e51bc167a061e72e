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

/// The stderr of a run that must have failed with exit status 1 (an error).
fn failed(o: &std::process::Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{e}");
    e
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
        // Each device gets its own copy of one key and bundle, made once per run
        // (a bundle takes seconds to make, and no test needs its own).
        let shared = shared_bundle();
        let (public, bundle) = (d.join("k.pub.pem"), d.join("u.vabc"));
        for name in ["k.pem", "k.pub.pem", "u.vabc"] {
            std::fs::copy(shared.join(name), d.join(name)).unwrap();
        }
        let store = d.join("store");
        // Every step with --json: run_vabc checks each report against its schema.
        ok(&["update", "init", "--store", s(&store), "--json"]);
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

    /// Another signed --verity bundle of the same update, made with `extra` options
    /// (and the environment `env`).
    fn bundle_with(&self, name: &str, extra: &[&str], env: &[(&str, &str)]) -> PathBuf {
        let out = self.dir.path().join(name);
        create_bundle(&out, &self.dir.path().join("k.pem"), extra, env);
        out
    }

    /// Replaces the installed COW (and its manifest) with one of the tiny pair's old
    /// image to `evil`, as someone who can write the data partition would.
    fn swap_cow(&self) {
        let evil = self.dir.path().join("evil.img");
        let mut img = std::fs::read(corpus_image("tiny", "new", "ext4")).unwrap();
        img[1 << 20..(1 << 20) + 11].copy_from_slice(b"not signed!");
        std::fs::write(&evil, &img).unwrap();
        let old = corpus_image("tiny", "old", "ext4");
        ok(&[
            "diff",
            s(&old),
            s(&evil),
            "-o",
            s(&self.store.join("system.cow")),
        ]);
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
            "--json",
        ]
        .map(String::from)
        .to_vec()
    }

    /// `install` of `bundle` is refused as made for another partition (exit 3), and
    /// nothing is kept.
    fn assert_not_this_partition(&self, bundle: &Path) {
        let args = self.install_args(bundle);
        let o = run_vabc(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(3), "{e}");
        assert!(
            e.contains("not the partition the bundle was made for"),
            "{e}"
        );
        assert_eq!(self.store_files(), ["state", "state.copy"]);
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
        let o = self.boot_output(&["--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        json(&o)
    }

    /// `boot` as the initramfs runs it, with `extra` options; whatever it did.
    fn boot_output(&self, extra: &[&str]) -> std::process::Output {
        let base = self.base_arg();
        let mut args = vec!["update", "boot", "--store", s(&self.store), "-b", &base];
        args.extend(["--frontend", "fuse", "--run-dir", s(&self.run)]);
        args.extend(["--key", s(&self.public)]);
        args.extend(extra);
        run_vabc(&args)
    }

    /// `boot` with the key `key` and no base of its own configuration (`-b`).
    fn boot_unpinned(&self, key: &Path) -> std::process::Output {
        run_vabc(&[
            "update",
            "boot",
            "--store",
            s(&self.store),
            "--frontend",
            "fuse",
            "--run-dir",
            s(&self.run),
            "--key",
            s(key),
            "--json",
        ])
    }

    /// `mark-good` as the new system runs it, with `extra` options.
    fn mark_good_with(&self, extra: &[&str]) -> std::process::Output {
        let mut args = vec!["update", "mark-good", "--store", s(&self.store)];
        args.extend(["--run-dir", s(&self.run), "--key", s(&self.public)]);
        args.extend(extra);
        run_vabc(&args)
    }

    /// `mark-good` as the new system runs it.
    fn mark_good(&self) -> std::process::Output {
        self.mark_good_with(&["--json"])
    }

    /// `mark-good`, then the daemon's merge to its end, followed as the merge unit
    /// follows it (`wait-merge`): the base is the new image.
    fn mark_good_and_wait_merged(&self) {
        let o = self.mark_good();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = self.wait_merge();
        assert!(out.contains("merged (state merged)"), "{out}");
        assert_eq!(self.state()["state"], "merged");
        assert_eq!(sha256_file(&self.base), self.new_sha, "merged in place");
    }

    /// `wait-merge` (it must end, and succeed) under a service manager's notify
    /// socket, as `vabc-merge.service` runs it: it says READY=1, and its last STATUS=
    /// is its last line. Returns its output.
    fn wait_merge(&self) -> String {
        let sock_path = self.dir.path().join("notify.sock");
        let _ = std::fs::remove_file(&sock_path);
        let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
        sock.set_nonblocking(true).unwrap();
        let o = Command::new(vabc())
            .args(["update", "wait-merge", "--store", s(&self.store)])
            .args(["--stall-timeout", "120"])
            .env("NOTIFY_SOCKET", &sock_path)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        let mut said = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = sock.recv(&mut buf) {
            said.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        assert!(
            said.iter().any(|m| m.lines().any(|l| l == "READY=1")),
            "{said:?}"
        );
        let last_line = out.lines().last().unwrap_or_default();
        let last_status = said.last().and_then(|m| m.strip_prefix("STATUS="));
        assert_eq!(
            last_status.map(|s| s.trim_end()),
            last_line.split_once(": ").map(|(_, m)| m),
            "{said:?}"
        );
        out
    }

    /// `mark-good --if-pending`, as the unit after boot-complete.target runs it every
    /// boot; its output.
    fn mark_good_if_pending(&self) -> String {
        let o = self.mark_good_with(&["--if-pending"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
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
        // The version a merge leaves as the floor of the next install stays.
        let files = self.store_files();
        assert!(
            files == ["state", "state.copy"] || files == ["state", "state.copy", "version"],
            "{files:?}"
        );
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

/// An Ed25519 key pair in `dir`: NAME.pem and NAME.pub.pem.
/// A folder holding a key pair (`k.pem`, `k.pub.pem`) and the signed --verity
/// bundle of the tiny ext4 pair it signed (`u.vabc`), made by the first test that
/// asks, in a folder of this run's own.
fn shared_bundle() -> &'static Path {
    static SHARED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    SHARED.get_or_init(|| {
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        // Folders of earlier runs (their process gone) go.
        for e in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("update_cli-")
                && !Path::new("/proc").join(pid).exists()
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let d = tmp.join(format!("update_cli-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let (key, _) = keypair(&d, "k");
        create_bundle(&d.join("u.vabc"), &key, &[], &[]);
        d
    })
}

/// A signed --verity bundle of the tiny ext4 pair at `out`, made with `key`, the
/// options `extra` and the environment `env`.
fn create_bundle(out: &Path, key: &Path, extra: &[&str], env: &[(&str, &str)]) {
    let p = format!(
        "system={},{}",
        corpus_image("tiny", "old", "ext4").display(),
        corpus_image("tiny", "new", "ext4").display()
    );
    let mut args = vec![
        "bundle",
        "create",
        "-p",
        &p,
        "-o",
        s(out),
        "--key",
        s(key),
        "--verity",
    ];
    args.extend_from_slice(extra);
    let o = Command::new(vabc())
        .args(&args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn keypair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(format!("{name}.pem"));
    let public = dir.join(format!("{name}.pub.pem"));
    for args in [
        &["genpkey", "-algorithm", "ed25519", "-out", s(&key)][..],
        &["pkey", "-in", s(&key), "-pubout", "-out", s(&public)][..],
    ] {
        let st = Command::new("openssl").args(args).status().unwrap();
        assert!(st.success());
    }
    (key, public)
}

/// Makes `text` the store's state as someone who can write the data partition
/// would: the state file and its copy, without the check (which such a writer
/// computes as easily; it finds damage, not attacks).
fn plant_state(store: &Path, text: &str) {
    let mut v = json_text(text);
    v.as_object_mut().unwrap().remove("check");
    let planted = serde_json::to_string_pretty(&v).unwrap();
    for f in ["state", "state.copy"] {
        std::fs::write(store.join(f), &planted).unwrap();
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
            "state.copy",
            "system.cow",
            "system.cow.manifest",
            "system.verity",
            "update.head"
        ]
    );

    // Not before this boot runs the update; with no boot record where it looked, the
    // message names the folder it looked in and the option that points elsewhere.
    let o = d.mark_good();
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("does not run the update")
            && e.contains("another --run-dir than")
            && e.contains(s(&d.run)),
        "{e}"
    );
    assert_eq!(d.state()["state"], "installed");
    // The boot-assessment units run every boot: on one that runs the base they
    // succeed and change nothing.
    let out = d.mark_good_if_pending();
    assert!(
        out.contains("nothing to mark good: this boot runs the base"),
        "{out}"
    );
    let out = d.wait_merge();
    assert!(
        out.contains("no merge under way (state installed)"),
        "{out}"
    );
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
    d.mark_good_and_wait_merged();
    assert_eq!(
        sha256_file(&dev),
        d.new_sha,
        "still served right after the merge"
    );
    let o = run_vabc(&["update", "rollback", "--store", s(&d.store)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to roll back to"));

    // Nothing to mark once merged.
    let out = d.mark_good_if_pending();
    assert!(
        out.contains("nothing to mark good: the update's state is merged"),
        "{out}"
    );

    // The next boot mounts the base and removes the COW; the version merged stays,
    // the floor of the next install.
    d.power_off();
    d.assert_booted_base(&d.boot(), &d.new_sha);
    assert_eq!(d.store_files(), ["state", "state.copy", "version"]);
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
        assert_eq!(d.store_files(), ["state", "state.copy"], "{what}");
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

    // A missing state file (and its copy), and one from a newer vabc: every command
    // refuses.
    let state = d.store.join("state");
    std::fs::remove_file(&state).unwrap();
    std::fs::remove_file(d.store.join("state.copy")).unwrap();
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
    let boot = || d.boot_unpinned(&d.public);
    // Each boot says why it cannot serve the update, serves nothing but the base
    // (the old system), and counts the attempt.
    for attempt in 1..=2 {
        let o = boot();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{e}");
        assert!(e.contains("system.cow"), "{e}");
        let b = json(&o);
        assert_eq!(b["partitions"][0]["served"], false, "{b}");
        assert_eq!(device_of(&b), d.base);
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
            ok(&["update", "rollback", "--store", s(&d.store), "--json"]);
            continue;
        }
        if round % 2 == 1 && st == "installing" {
            // Rolled back instead: nothing the interrupted install wrote is left.
            ok(&["update", "rollback", "--store", s(&d.store)]);
            assert_eq!(d.store_files(), ["state", "state.copy"], "round {round}");
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
        assert_eq!(d.store_files(), ["state", "state.copy"]);
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

#[test]
fn a_cow_swapped_after_install_is_not_booted_and_the_update_rolls_back() {
    let d = Device::new();
    d.install();
    d.swap_cow();
    for attempt in 1..=2 {
        let b = d.boot();
        assert_eq!(b["partitions"][0]["served"], false, "{b}");
        assert_eq!(device_of(&b), d.base);
        let note = b["note"].as_str().unwrap();
        assert!(note.contains("altered after it was installed"), "{note}");
        assert_eq!(b["boot_attempts"], attempt);
    }
    let b = d.boot();
    assert!(b["note"].as_str().unwrap().contains("rolled back"), "{b}");
    d.assert_booted_base(&b, &d.old_sha);
}

#[test]
fn a_cow_swapped_after_mark_good_is_not_merged_and_the_base_is_unchanged() {
    let d = Device::new();
    d.install();
    let b = d.boot();
    assert_eq!(sha256_file(&device_of(&b)), d.new_sha);
    // The power goes before the daemon has merged anything; the COW is swapped.
    d.power_off();
    let o = d.mark_good();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    d.power_off();
    assert_eq!(sha256_file(&d.base), d.old_sha);
    d.swap_cow();
    // The next boot must merge, cannot prove the COW: it mounts nothing (exit 4),
    // writes nothing.
    let o = d.boot_output(&[]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{e}");
    assert!(
        e.contains("no root to mount") && e.contains("altered"),
        "{e}"
    );
    assert!(o.stdout.is_empty());
    assert_eq!(sha256_file(&d.base), d.old_sha, "nothing merged");
    assert_eq!(d.state()["state"], "merging");
    // No daemon merges: the merge unit's follower says so instead of waiting forever.
    let o = run_vabc(&[
        "update",
        "wait-merge",
        "--store",
        s(&d.store),
        "--stall-timeout",
        "1",
    ]);
    let e = failed(&o);
    assert!(
        e.contains("has not moved for 1 s") && e.contains("next boot resumes it"),
        "{e}"
    );
}

#[test]
fn another_key_or_a_stored_head_not_the_states_is_not_booted() {
    let d = Device::new();
    d.install();
    // A key the update was not signed with.
    let (_, other_pub) = keypair(d.dir.path(), "other");
    let boot_with = |key: &Path| json(&d.boot_unpinned(key));
    let b = boot_with(&other_pub);
    assert_eq!(b["partitions"][0]["served"], false, "{b}");
    assert!(b["note"].as_str().unwrap().contains("signature"), "{b}");
    // No key at all (an empty keyring) is no way around it either.
    let empty = d.dir.path().join("keys");
    std::fs::create_dir(&empty).unwrap();
    let o = run_vabc(&[
        "update",
        "mark-good",
        "--store",
        s(&d.store),
        "--run-dir",
        s(&d.run),
        "--keyring",
        s(&empty),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no trusted public key"));
    // A stored head swapped for another signed bundle's: not the update the state names.
    let again = d.bundle_with("again.vabc", &[], &[]);
    let bytes = std::fs::read(&again).unwrap();
    let head_len = 32
        + u32::from_le_bytes(bytes[16..20].try_into().unwrap()) as usize
        + u32::from_le_bytes(bytes[20..24].try_into().unwrap()) as usize;
    std::fs::write(d.store.join("update.head"), &bytes[..head_len]).unwrap();
    let b = d.boot();
    assert_eq!(b["partitions"][0]["served"], false, "{b}");
    assert!(
        b["note"]
            .as_str()
            .unwrap()
            .contains("the state names update"),
        "{b}"
    );
    // Bytes after the signed head are refused too.
    let mut long = std::fs::read(&d.bundle).unwrap();
    long.truncate(head_len);
    long.extend_from_slice(b"tail");
    std::fs::write(d.store.join("update.head"), &long).unwrap();
    assert_eq!(d.boot()["partitions"][0]["served"], false);
    assert_eq!(sha256_file(&d.base), d.old_sha);
}

#[test]
fn a_state_file_cannot_steer_file_operations() {
    let d = Device::new();
    d.install();
    let victim = d.dir.path().join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    std::fs::write(d.dir.path().join("victim.manifest"), b"keep").unwrap();
    let state_path = d.store.join("state");
    let good = std::fs::read_to_string(&state_path).unwrap();
    for (field, evil) in [
        ("\"system.cow\"", "\"../victim\"".to_string()),
        (
            "\"system.cow\"",
            format!("{:?}", victim.display().to_string()),
        ),
        ("\"system.verity\"", "\"../victim\"".to_string()),
    ] {
        plant_state(&d.store, &good.replacen(field, &evil, 1));
        for sub in ["rollback", "status", "boot"] {
            let o = run_vabc(&["update", sub, "--store", s(&d.store)]);
            let e = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{sub}: {e}");
            assert!(
                e.contains("damaged") && e.contains("update.partitions[0]"),
                "{sub}: {e}"
            );
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }
    plant_state(&d.store, &good);
    // A planted link where the state's temporary file goes is not written through.
    std::os::unix::fs::symlink(&victim, d.store.join(".state.tmp")).unwrap();
    ok(&["update", "rollback", "--store", s(&d.store)]);
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    assert_eq!(d.store_files(), ["state", "state.copy"]);
    // A store folder others may write is refused before anything is read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&d.store, std::fs::Permissions::from_mode(0o757)).unwrap();
    let o = run_vabc(&["update", "status", "--store", s(&d.store)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("chmod go-w"));
}

#[test]
fn an_update_that_does_not_go_forward_is_refused() {
    let d = Device::new();
    let install = |bundle: &Path, extra: &[&str]| {
        let mut args = d.install_args(bundle);
        args.extend(extra.iter().map(|s| s.to_string()));
        let o = run_vabc(&args.iter().map(String::as_str).collect::<Vec<_>>());
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let v = |n: &str, extra: &[&str]| {
        let mut a = vec!["--release-version", n];
        a.extend_from_slice(extra);
        d.bundle_with(&format!("v{n}.vabc"), &a, &[])
    };
    // The device runs version 10 (the store's record of its last merge).
    std::fs::write(d.store.join("version"), "10\n").unwrap();
    for (bundle, extra, code, says) in [
        (v("9", &[]), &[][..], Some(3), "--allow-downgrade"),
        (v("10", &[]), &[], Some(3), "installed already"),
        (
            v("8", &["--no-downgrade"]),
            &["--allow-downgrade"],
            Some(3),
            "forbids",
        ),
    ] {
        let (c, e) = install(&bundle, extra);
        assert_eq!(c, code, "{e}");
        assert!(e.contains(says) && e.contains("version 10"), "{e}");
        assert_eq!(d.state()["state"], "none");
    }
    // The running image's own version file counts too.
    let vf = d.dir.path().join("image-version");
    std::fs::write(&vf, "20\n").unwrap();
    let (c, e) = install(&v("15", &[]), &["--version-file", s(&vf)]);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("version 20"), "{e}");
    // An expired bundle (built at second 1000, valid a day).
    let old = d.bundle_with(
        "old.vabc",
        &["--expires", "+1d"],
        &[("SOURCE_DATE_EPOCH", "1000")],
    );
    let (c, e) = install(&old, &[]);
    assert_eq!(c, Some(3), "{e}");
    assert!(e.contains("expired"), "{e}");
    // A downgrade asked for, and a newer version, install.
    let (c, e) = install(&v("9", &[]), &["--allow-downgrade"]);
    assert_eq!(c, Some(0), "{e}");
    ok(&["update", "rollback", "--store", s(&d.store)]);
    let v11 = v("11", &[]);
    let (c, e) = install(&v11, &[]);
    assert_eq!(c, Some(0), "{e}");
    // A resumed install with another base is refused, naming the one it began with.
    let state_path = d.store.join("state");
    let st = std::fs::read_to_string(&state_path).unwrap();
    plant_state(&d.store, &st.replace("\"installed\"", "\"installing\""));
    let copy = d.dir.path().join("copy.img");
    std::fs::copy(&d.base, &copy).unwrap();
    let mut args = d.install_args(&v11);
    args[6] = format!("system={}", copy.display());
    let o = run_vabc(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let e = failed(&o);
    assert!(
        e.contains("begun with other bases") && e.contains(s(&d.base)),
        "{e}"
    );
}

#[test]
fn a_partition_of_more_than_sixteen_regions_boots_and_merges_its_update() {
    // A bundle names a base by at most 16 regions: 8 MiB ones for these 72 MiB, where
    // the device's own manifests use 4 MiB. The daemon serves from the signed ones.
    let mut d = Device::new();
    let dir = d.dir.path().to_path_buf();
    let (old, new) = (dir.join("big-old.img"), dir.join("big-new.img"));
    let mut rng = fastrand::Rng::with_seed(72);
    let mut img = vec![0u8; 72 << 20];
    img[..4 << 20].fill_with(|| rng.u8(..));
    std::fs::write(&old, &img).unwrap();
    img[40 << 20..41 << 20].fill_with(|| rng.u8(..));
    std::fs::write(&new, &img).unwrap();
    std::fs::copy(&old, &d.base).unwrap();
    (d.old_sha, d.new_sha) = (sha256_file(&old), sha256_file(&new));
    let bundle = dir.join("big.vabc");
    let p = format!("system={},{}", old.display(), new.display());
    let key = dir.join("k.pem");
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
    let args = d.install_args(&bundle);
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let b = d.boot();
    assert_eq!(b["partitions"][0]["served"], true, "{b}");
    assert_eq!(sha256_file(&device_of(&b)), d.new_sha);
    d.mark_good_and_wait_merged();
}

#[test]
fn a_base_of_another_size_is_not_the_partition() {
    let d = Device::new();
    // The partition holds the old image and 4 KiB more.
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&d.base)
        .unwrap();
    f.set_len(f.metadata().unwrap().len() + 4096).unwrap();
    d.assert_not_this_partition(&d.bundle);
    // A bundle made from a shorter (or empty) OLD is refused where it is made.
    let empty = d.dir.path().join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let p = format!(
        "system={},{}",
        empty.display(),
        corpus_image("tiny", "new", "ext4").display()
    );
    let o = run_vabc(&[
        "bundle",
        "create",
        "-p",
        &p,
        "-o",
        s(&d.dir.path().join("e.vabc")),
        "--unsigned",
    ]);
    let e = failed(&o);
    assert!(
        e.contains("OLD is empty") && e.contains("--full system=NEW"),
        "{e}"
    );
}

#[test]
fn a_full_image_installs_over_any_base_of_its_partitions_size() {
    let d = Device::new();
    // Whatever the partition holds: a full image reads none of it.
    let size = std::fs::metadata(&d.base).unwrap().len();
    let junk: Vec<u8> = (0..size).map(|i| ((i * 2654435761) >> 13) as u8).collect();
    std::fs::write(&d.base, &junk).unwrap();
    let full = d.dir.path().join("full.vabc");
    let new = corpus_image("tiny", "new", "ext4");
    let key = d.dir.path().join("k.pem");
    let make = |extra: &[&str]| {
        let mut args = vec![
            "bundle".to_string(),
            "create".into(),
            "--full".into(),
            format!("system={}", new.display()),
            "-o".into(),
            s(&full).into(),
            "--key".into(),
            s(&key).into(),
            "--verity".into(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        run_vabc(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    // The partition is NEW's size unless said otherwise; a size below it is refused.
    let o = make(&["--partition-size", "system=4096"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("at least NEW's"));
    let o = make(&["--partition-size", &format!("system={}", size + 4096)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let info = json(&ok(&["bundle", "info", s(&full), "--json"]));
    let p = &info["manifest"]["partitions"][0];
    assert_eq!(p["full"], true, "{info}");
    assert_eq!(p["image"]["base"]["size"], 0, "{info}");
    assert_eq!(p["plan"]["copy"], 0, "{info}");
    assert_eq!(p["plan"]["xor"], 0, "{info}");
    // Stated for a larger partition than this one: refused, nothing kept.
    d.assert_not_this_partition(&full);
    let args = d.install_args(&full);
    // For this partition's size: installs, boots the new image, merges it in place.
    let o = make(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let b = d.boot();
    assert_eq!(b["partitions"][0]["served"], true, "{b}");
    assert_eq!(sha256_file(&device_of(&b)), d.new_sha);
    d.mark_good_and_wait_merged();
}

#[test]
fn a_bundle_without_verity_is_no_device_update() {
    let d = Device::new();
    let key = d.dir.path().join("k.pem");
    let plain = d.dir.path().join("plain.vabc");
    let p = format!(
        "system={},{}",
        corpus_image("tiny", "old", "ext4").display(),
        corpus_image("tiny", "new", "ext4").display()
    );
    ok(&[
        "bundle",
        "create",
        "-p",
        &p,
        "-o",
        s(&plain),
        "--key",
        s(&key),
    ]);
    let args = d.install_args(&plain);
    let o = run_vabc(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{e}");
    assert!(e.contains("--verity"), "{e}");
    assert_eq!(d.store_files(), ["state", "state.copy"]);
}

#[test]
fn the_boot_hook_never_mounts_a_half_merged_base() {
    let d = Device::new();
    d.install();
    let hook = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/initramfs/vabc-boot.sh");
    // The data partition, mounted already (a bind mount of the test's folder).
    let mnt = d.dir.path();
    assert!(
        Command::new("mount")
            .args(["--bind", s(mnt), s(mnt)])
            .status()
            .unwrap()
            .success()
    );
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _bound = Unmount(mnt);
    // ublk is not on this machine: the update cannot be served through it.
    let hook_run = |store_dev: &str, store_mnt: &Path| {
        Command::new("sh")
            .arg(&hook)
            .args([store_dev, s(store_mnt), "store", &d.base_arg()])
            .args([
                "--frontend",
                "ublk",
                "--run-dir",
                s(&d.run),
                "--key",
                s(&d.public),
            ])
            .env("VABC", vabc())
            .output()
            .unwrap()
    };
    // Installed: the base is untouched, so it boots, the attempt counted.
    let o = hook_run("/dev/null", mnt);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{e}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), s(&d.base));
    assert!(e.contains("cannot be served"), "{e}");
    assert_eq!(d.state()["boot_attempts"], 1);
    // Marked good in a boot that served it; the power goes before the daemon merges.
    d.boot();
    d.power_off();
    assert!(d.mark_good().status.success());
    assert_eq!(d.state()["state"], "merging");
    let o = hook_run("/dev/null", mnt);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{e}");
    assert!(o.stdout.is_empty(), "{e}");
    assert!(e.contains("may be half merged"), "{e}");
    // The state file gone: its copy says merging, so still no base.
    std::fs::remove_file(d.store.join("state")).unwrap();
    let o = hook_run("/dev/null", mnt);
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.stdout.is_empty());
    // A store partition that cannot be mounted says nothing of the state: no base.
    let elsewhere = d.dir.path().join("not-mounted");
    let o = hook_run("/dev/vabc-no-such-device", &elsewhere);
    assert_eq!(o.status.code(), Some(4));
    assert!(o.stdout.is_empty());
    assert_eq!(sha256_file(&d.base), d.old_sha);
}

#[test]
fn a_relative_base_is_stored_as_the_absolute_path_it_names() {
    let d = Device::new();
    // `-b system=base.img` from the folder that holds it; boot runs from anywhere.
    let o = Command::new(vabc())
        .current_dir(d.dir.path())
        .args(["update", "install", "--store", s(&d.store), s(&d.bundle)])
        .args(["-b", "system=base.img", "--key", s(&d.public)])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let state = json_text(&std::fs::read_to_string(d.store.join("state")).unwrap());
    assert_eq!(
        state["update"]["partitions"][0]["base"],
        s(&std::fs::canonicalize(&d.base).unwrap()),
        "{state}"
    );
    let b = d.boot();
    assert_eq!(sha256_file(&device_of(&b)), d.new_sha);
}

/// A data partition that can fill up: a 24 MiB ext4 file system (no blocks reserved
/// for root, so that root fills it too) on a loop device, mounted; the store in it.
/// Unmounted and detached on drop (declare it before the [`Device`] that uses it, so
/// that the daemon stops first).
struct DataPartition {
    dir: tempfile::TempDir,
    dev: String,
}

impl DataPartition {
    fn new() -> DataPartition {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("data.img");
        let st = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-b", "4096", s(&img), "24M"])
            .status()
            .unwrap();
        assert!(st.success(), "mkfs.ext4");
        let out = Command::new("losetup")
            .args(["-f", "--show", s(&img)])
            .output()
            .unwrap();
        assert!(out.status.success(), "losetup (the tests run as root)");
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let st = Command::new("mount")
            .args([&dev, s(&mnt)])
            .status()
            .unwrap();
        assert!(st.success(), "mount {dev}");
        DataPartition { dir, dev }
    }

    fn mnt(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }

    /// A device whose store is on this partition.
    fn device(&self) -> Device {
        let mut d = Device::new();
        d.store = self.mnt().join("store");
        ok(&["update", "init", "--store", s(&d.store)]);
        d
    }

    /// Something else on the device fills the partition (its logs, say): written
    /// until the file system says it is full.
    fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.mnt().join("filler")).unwrap();
        for chunk in [1 << 20, 4096] {
            let buf = vec![0x5au8; chunk];
            while f.write_all(&buf).and_then(|()| f.sync_data()).is_ok() {}
        }
    }

    fn free(&self) {
        std::fs::remove_file(self.mnt().join("filler")).unwrap();
    }
}

impl Drop for DataPartition {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.mnt()).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

impl Device {
    /// The update's merge progress as `status` reports it: done or not.
    fn merge_done(&self) -> bool {
        self.state()["partitions"][0]["merge"]["done"] == true
    }

    /// Waits (up to 60 s) for `what` of the device to hold.
    fn wait_for(&self, what: &str, cond: impl Fn(&Device) -> bool) {
        let t = Instant::now();
        while !cond(self) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{what}: not in 60 s; status {}; the daemon's log: {}",
                self.state(),
                std::fs::read_to_string(self.run.join("system.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Names in the store that vabc gives temporary files: none may be left.
    fn assert_no_temporary_files(&self, what: &str) {
        let files = self.store_files();
        assert!(
            files.iter().all(|f| !f.starts_with('.')),
            "{what}: {files:?}"
        );
    }

    /// The serving daemon's pid, from its ready report.
    fn daemon_pid(&self) -> u32 {
        let text = std::fs::read_to_string(self.run.join("system.ready")).unwrap();
        json_text(&text)["pid"].as_u64().unwrap() as u32
    }
}

/// A milliseconds count drawn from `0..=max`: a random moment of something that lasts
/// `max`.
fn moment(rng: &mut fastrand::Rng, max: Duration) -> Duration {
    Duration::from_millis(rng.u64(0..=max.as_millis() as u64))
}

/// Damages `file` as a flash error or a file system repaired after a crash might:
/// bytes flipped, the file cut short, a range zeroed, or the file gone. Says which.
fn damage(file: &Path, rng: &mut fastrand::Rng) -> String {
    let mut b = std::fs::read(file).unwrap();
    let what = match rng.u8(0..4) {
        0 => {
            let n = rng.usize(1..4);
            for _ in 0..n {
                let at = rng.usize(..b.len());
                b[at] ^= 1 << rng.u8(0..8);
            }
            format!("{n} bytes flipped")
        }
        1 => {
            b.truncate(rng.usize(..b.len() - 1));
            format!("cut to {} bytes", b.len())
        }
        2 => {
            let at = rng.usize(..b.len());
            let end = (at + rng.usize(1..64)).min(b.len());
            b[at..end].fill(0);
            format!("bytes {at}..{end} zeroed")
        }
        _ => {
            std::fs::remove_file(file).unwrap();
            return "removed".into();
        }
    };
    std::fs::write(file, b).unwrap();
    what
}

#[test]
fn a_damaged_state_file_boots_what_its_copy_says() {
    let d = Device::new();
    let mut rng = fastrand::Rng::with_seed(21);
    let state_file = d.store.join("state");
    d.install();
    // Installed: two boots, each counting its attempt from a damaged state file; the
    // second marks it good.
    for attempt in 1..=2 {
        let what = damage(&state_file, &mut rng);
        let b = d.boot();
        assert_eq!(b["state"], "installed", "{what}: {b}");
        assert_eq!(b["boot_attempts"], attempt, "{what}");
        assert_eq!(sha256_file(&device_of(&b)), d.new_sha, "{what}");
        // The count is saved: the state file is whole again.
        assert_eq!(
            std::fs::read(&state_file).unwrap(),
            std::fs::read(d.store.join("state.copy")).unwrap()
        );
        if attempt == 2 {
            // The power goes before the daemon has seen it.
            d.power_off();
            assert!(d.mark_good().status.success());
        }
        d.power_off();
    }
    // Merging: the boot serves it and the merge resumes.
    let what = damage(&state_file, &mut rng);
    let b = d.boot();
    assert_eq!(b["state"], "merging", "{what}: {b}");
    assert_eq!(sha256_file(&device_of(&b)), d.new_sha, "{what}");
    d.wait_for("the merge", |d| d.state()["state"] == "merged");
    d.power_off();
    assert_eq!(sha256_file(&d.base), d.new_sha);
    // Merged: the boot cleans up; none: the boot runs the base.
    for _ in 0..2 {
        let what = damage(&state_file, &mut rng);
        let b = d.boot();
        assert!(state_file.exists(), "{what}: repaired");
        d.assert_booted_base(&b, &d.new_sha);
    }
    // Both damaged: nothing can be known, so nothing boots, and nothing changes.
    let copy = d.store.join("state.copy");
    std::fs::write(
        &state_file,
        b"{\"schema_version\": 1, \"state\": \"sideways\"}",
    )
    .unwrap();
    std::fs::write(&copy, b"{\"schema_ver").unwrap();
    let files = d.store_files();
    let o = d.boot_output(&[]);
    let e = failed(&o);
    assert!(e.contains("damaged") && e.contains("sideways"), "{e}");
    assert!(o.stdout.is_empty());
    assert_eq!(d.store_files(), files);
    assert_eq!(sha256_file(&d.base), d.new_sha);
}

#[test]
fn a_data_partition_that_fills_up_during_an_install_boots_the_old_system_and_the_install_resumes() {
    let part = DataPartition::new();
    let d = part.device();
    let args = d.install_args(&d.bundle);
    // How long an install takes here: the moments are drawn from it.
    let t = Instant::now();
    d.install();
    let took = t.elapsed();
    ok(&["update", "rollback", "--store", s(&d.store)]);
    let mut rng = fastrand::Rng::with_seed(31);
    let (mut landed, mut tries) = (0, 0);
    while landed < 5 {
        tries += 1;
        assert!(
            tries <= 40,
            "only {landed} of 40 fills landed during an install"
        );
        let child = Command::new(vabc())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(moment(&mut rng, took));
        part.fill();
        let o = child.wait_with_output().unwrap();
        if o.status.success() {
            // It finished first: start over.
            part.free();
            ok(&["update", "rollback", "--store", s(&d.store)]);
            continue;
        }
        landed += 1;
        let e = failed(&o);
        assert!(
            e.contains("No space left") || e.contains("bytes free"),
            "{e}"
        );
        d.assert_no_temporary_files(&e);
        let st = d.state()["state"].as_str().unwrap().to_string();
        assert!(["none", "installing"].contains(&st.as_str()), "{st}: {e}");
        // The next boot, the partition still full: the old system.
        let b = d.boot();
        assert_eq!(b["partitions"][0]["served"], false, "{b}");
        assert_eq!(device_of(&b), d.base);
        assert_eq!(sha256_file(&d.base), d.old_sha);
        // The old system frees space and installs again: it completes.
        part.free();
        d.install();
        let b = d.boot();
        assert_eq!(sha256_file(&device_of(&b)), d.new_sha, "{e}");
        d.power_off();
        ok(&["update", "rollback", "--store", s(&d.store)]);
    }
}

#[test]
fn a_data_partition_that_fills_up_during_the_merge_never_stops_the_device() {
    let mut rng = fastrand::Rng::with_seed(41);
    let mut took = Duration::ZERO;
    for round in 0..6 {
        let part = DataPartition::new();
        let d = part.device();
        d.install();
        let b = d.boot();
        let dev = device_of(&b);
        if round == 0 {
            // A full partition at mark-good: refused, nothing changed; then the
            // merge's length, which the moments of the next rounds are drawn from.
            part.fill();
            let e = failed(&d.mark_good());
            assert!(e.contains("No space left"), "{e}");
            assert_eq!(d.state()["state"], "installed");
            part.free();
            let t = Instant::now();
            assert!(d.mark_good().status.success());
            d.wait_for("the merge", |d| d.state()["state"] == "merged");
            took = t.elapsed();
            continue;
        }
        assert!(d.mark_good().status.success());
        std::thread::sleep(moment(&mut rng, took));
        part.fill();
        d.wait_for("the merge", Device::merge_done);
        assert_eq!(
            sha256_file(&dev),
            d.new_sha,
            "round {round}: served while full"
        );
        if round % 2 == 1 {
            // Space freed while the new system runs: the daemon records the merge.
            part.free();
            d.wait_for("the record of the merge", |d| {
                d.state()["state"] == "merged"
            });
            d.power_off();
        } else {
            // The power goes while the partition is full; the next boot too finds it
            // full, serves (the merge complete, its record failing) or cleans up
            // (the record made before the fill): it runs version 2 either way.
            d.power_off();
            let b = d.boot();
            assert_eq!(sha256_file(&device_of(&b)), d.new_sha, "round {round}: {b}");
            d.power_off();
            part.free();
        }
        assert_eq!(sha256_file(&d.base), d.new_sha, "round {round}");
        // The next boot (space free) ends the update.
        let b = d.boot();
        if b["state"] == "merging" {
            d.wait_for("the record of the merge", |d| {
                d.state()["state"] == "merged"
            });
            d.power_off();
            d.boot();
        }
        assert_eq!(d.state()["state"], "none", "round {round}");
        assert_eq!(sha256_file(&d.base), d.new_sha, "round {round}");
        d.assert_no_temporary_files("after the merge");
    }
}

#[test]
fn an_install_while_the_merge_runs_is_refused_and_the_merge_ends() {
    let d = Device::new();
    let other = d.bundle_with("v3.vabc", &["--release-version", "3"], &[]);
    let mut rng = fastrand::Rng::with_seed(51);
    d.install();
    let dev = device_of(&d.boot());
    assert!(d.mark_good().status.success());
    // The daemon starts the merge within a second of mark-good: five installs over
    // that second and the merge.
    let mut merging = 0;
    for _ in 0..5 {
        std::thread::sleep(moment(&mut rng, Duration::from_millis(300)));
        let st = d.state()["state"].as_str().unwrap().to_string();
        merging += usize::from(st == "merging");
        for bundle in [&d.bundle, &other] {
            let args = d.install_args(bundle);
            let o = run_vabc(&args.iter().map(String::as_str).collect::<Vec<_>>());
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success(), "{st}: {e}");
            assert!(e.contains("merg"), "{st}: {e}");
        }
    }
    assert!(merging >= 1, "no install was tried while merging");
    d.wait_for("the merge", |d| d.state()["state"] == "merged");
    assert_eq!(sha256_file(&dev), d.new_sha);
    assert_eq!(sha256_file(&d.base), d.new_sha);
    d.power_off();
    d.assert_booted_base(&d.boot(), &d.new_sha);
}

/// Reads `dev` whole, over and over, until `stop`, through one descriptor (as a
/// mounted file system holds its device: reopening the path could reach another
/// device that took the number of a loop device released meanwhile). Every 64 KiB
/// read must be the new image's bytes there or fail; returns (reads that succeeded,
/// reads that failed).
fn read_until(dev: &Path, new: &[u8], stop: &std::sync::atomic::AtomicBool) -> (usize, usize) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(dev).unwrap();
    let (mut good, mut failed) = (0, 0);
    let mut buf = vec![0u8; 64 << 10];
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let mut at = 0;
        while at < new.len() && !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let n = buf.len().min(new.len() - at);
            match f.read_exact_at(&mut buf[..n], at as u64) {
                Ok(()) => {
                    if buf[..n] != new[at..at + n] {
                        let first = (0..n).find(|&i| buf[i] != new[at + i]).unwrap_or(0);
                        panic!(
                            "wrong data at offset {} (read of {n} at {at}, {} bytes differ)",
                            at + first,
                            (0..n).filter(|&i| buf[i] != new[at + i]).count()
                        );
                    }
                    good += 1;
                }
                Err(_) => failed += 1,
            }
            at += n;
        }
    }
    (good, failed)
}

#[test]
fn a_serving_daemon_killed_gives_io_errors_never_wrong_data_and_the_next_boot_recovers() {
    let new = std::fs::read(corpus_image("tiny", "new", "ext4")).unwrap();
    let mut rng = fastrand::Rng::with_seed(61);
    for round in 0..5 {
        let d = Device::new();
        d.install();
        let dev = device_of(&d.boot());
        // Killed while the new system runs unmarked (rounds 0, 2, 4) or merging.
        if round % 2 == 1 {
            assert!(d.mark_good().status.success());
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (good, bad) = std::thread::scope(|sc| {
            let reader = sc.spawn(|| read_until(&dev, &new, &stop));
            std::thread::sleep(
                Duration::from_millis(100) + moment(&mut rng, Duration::from_millis(1500)),
            );
            let pid = d.daemon_pid();
            // SAFETY: kill(2) of the daemon's pid, read from its ready report.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
            let t = Instant::now();
            while Path::new(&format!("/proc/{pid}")).exists() {
                assert!(t.elapsed() < Duration::from_secs(10), "{pid} not gone");
                std::thread::sleep(Duration::from_millis(10));
            }
            std::thread::sleep(Duration::from_millis(200));
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            reader.join().unwrap()
        });
        assert!(good > 0, "round {round}: nothing was read before the kill");
        // I/O errors after the kill are allowed; wrong data never (read_until).
        // The next boot: the kernel's state of this one is gone (what `vabc cleanup`
        // removes here), the store as the kill left it.
        let o = Command::new(vabc())
            .args(["cleanup", "--json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let b = d.boot();
        assert_eq!(sha256_file(&device_of(&b)), d.new_sha, "round {round}: {b}");
        if round % 2 == 1 {
            // Resumed, or complete before the kill (and then cleaned up by this boot).
            d.wait_for("the merge", |d| d.state()["state"] != "merging");
        } else {
            assert_eq!(b["state"], "installed");
            assert_eq!(sha256_file(&d.base), d.old_sha, "round {round}");
            assert!(d.mark_good().status.success());
            d.wait_for("the merge", |d| d.state()["state"] == "merged");
        }
        d.power_off();
        d.assert_booted_base(&d.boot(), &d.new_sha);
        assert!(bad > 0 || good > 0);
    }
}
