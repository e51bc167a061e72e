//! `vabc bundle`: a signed bundle round-trips into the COWs `vabc diff` writes (which
//! serve and merge to the new images) and into the new images; a changed byte, another
//! key, a wrong base, a truncated bundle or an unknown version is refused before
//! anything is written; an install killed at any point resumes to the exact COWs.

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serve_common::{corpus_image, run_vabc, sha256_file, vabc, vectors};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok<A: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[A]) -> std::process::Output {
    let o = Command::new(vabc()).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "vabc {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// An Ed25519 key pair made the documented way.
fn keys(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(format!("{name}.pem"));
    let public = dir.join(format!("{name}.pub.pem"));
    let run = |args: &[&str]| {
        let st = Command::new("openssl").args(args).status().unwrap();
        assert!(st.success(), "openssl {args:?}");
    };
    run(&["genpkey", "-algorithm", "ed25519", "-out", s(&key)]);
    run(&["pkey", "-in", s(&key), "-pubout", "-out", s(&public)]);
    (key, public)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The tiny corpus pair as two partitions (ext4 and EROFS images of the same files).
fn tiny_parts() -> [(&'static str, PathBuf, PathBuf); 2] {
    [
        (
            "system",
            corpus_image("tiny", "old", "ext4"),
            corpus_image("tiny", "new", "ext4"),
        ),
        (
            "vendor",
            corpus_image("tiny", "old", "erofs"),
            corpus_image("tiny", "new", "erofs"),
        ),
    ]
}

/// A temporary folder with a key pair and a bundle of [`tiny_parts`] signed with it:
/// (folder, public key, parts, bundle).
fn signed_tiny_bundle() -> (
    tempfile::TempDir,
    PathBuf,
    [(&'static str, PathBuf, PathBuf); 2],
    PathBuf,
) {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keys(d.path(), "k");
    let parts = tiny_parts();
    let bundle = d.path().join("u.vabc");
    create(&parts, &bundle, Some(&key));
    (d, public, parts, bundle)
}

/// Every file of `want` is in `got` with the same bytes, and nothing else is.
fn assert_same_files(got: &Path, want: &Path) {
    assert_eq!(entries(got), entries(want));
    for f in entries(want) {
        assert_eq!(
            std::fs::read(got.join(&f)).unwrap(),
            std::fs::read(want.join(&f)).unwrap(),
            "{f}"
        );
    }
}

fn create(parts: &[(&str, PathBuf, PathBuf)], out: &Path, key: Option<&Path>) {
    create_with(parts, out, key, &[]);
}

fn create_with(parts: &[(&str, PathBuf, PathBuf)], out: &Path, key: Option<&Path>, extra: &[&str]) {
    let specs: Vec<String> = parts
        .iter()
        .map(|(n, o, w)| format!("{n}={},{}", o.display(), w.display()))
        .collect();
    let mut args = vec!["bundle", "create", "-o", s(out)];
    for p in &specs {
        args.extend(["-p", p]);
    }
    match key {
        Some(k) => args.extend(["--key", s(k)]),
        None => args.push("--unsigned"),
    }
    args.extend(extra);
    ok(&args);
}

fn base_args(parts: &[(&str, PathBuf, PathBuf)]) -> Vec<String> {
    parts
        .iter()
        .flat_map(|(n, o, _)| ["-b".to_string(), format!("{n}={}", o.display())])
        .collect()
}

/// `bundle install FROM -o OUT --key PUBLIC -b NAME=OLD...` for the parts' old images.
fn install_args(
    from: &str,
    out: &Path,
    public: &Path,
    parts: &[(&str, PathBuf, PathBuf)],
) -> Vec<String> {
    let mut a: Vec<String> = ["bundle", "install", from, "-o", s(out), "--key", s(public)]
        .map(String::from)
        .into();
    a.extend(base_args(parts));
    a
}

#[test]
fn a_bundle_installs_to_the_cows_diff_writes_and_applies_to_the_new_images() {
    let (d, public, parts, bundle) = signed_tiny_bundle();

    let v: serde_json::Value =
        serde_json::from_slice(&ok(&["bundle", "info", s(&bundle), "--json"]).stdout).unwrap();
    assert_eq!(v["signed"], true);
    assert_eq!(v["manifest"]["partitions"].as_array().unwrap().len(), 2);
    let v: serde_json::Value = serde_json::from_slice(
        &ok(&[
            "bundle",
            "verify",
            s(&bundle),
            "--key",
            s(&public),
            "--json",
        ])
        .stdout,
    )
    .unwrap();
    assert_eq!(v["signature"], "verified");

    // Smaller than the COWs it makes: no scratch area, one stream per frame.
    let bundle_size = std::fs::metadata(&bundle).unwrap().len();
    let out = d.path().join("cows");
    std::fs::create_dir(&out).unwrap();
    let args = install_args(s(&bundle), &out, &public, &parts);
    ok(&args);
    let mut cow_total = 0;
    for (name, old, new) in &parts {
        // The same COW and manifest as `vabc diff` with the bundle's device options.
        let reference = d.path().join(format!("{name}.ref.cow"));
        ok(&[
            "diff",
            s(old),
            s(new),
            "-o",
            s(&reference),
            "--compression",
            "lz4",
            "--compression-factor",
            "64k",
        ]);
        let cow = out.join(format!("{name}.cow"));
        assert_eq!(
            std::fs::read(&cow).unwrap(),
            std::fs::read(&reference).unwrap(),
            "{name}"
        );
        assert_eq!(
            std::fs::read(out.join(format!("{name}.cow.manifest"))).unwrap(),
            std::fs::read(d.path().join(format!("{name}.ref.cow.manifest"))).unwrap(),
            "{name}: manifest"
        );
        cow_total += std::fs::metadata(&cow).unwrap().len();
        // The installed COW merges into (a copy of) the base to the new image.
        let merged = d.path().join(format!("{name}.merged.img"));
        std::fs::copy(old, &merged).unwrap();
        ok(&["merge", "--base", s(&merged), "--cow", s(&cow)]);
        // The partition keeps its size; the image is its first bytes (the EROFS
        // pair's new image is smaller).
        let new_len = std::fs::metadata(new).unwrap().len();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&merged)
            .unwrap();
        f.set_len(new_len).unwrap();
        assert_eq!(sha256_file(&merged), sha256_file(new), "{name}: merged");
    }
    assert!(
        bundle_size * 4 < cow_total,
        "{bundle_size} vs COWs {cow_total}"
    );

    // apply: the new images, from stdin.
    let imgs = d.path().join("imgs");
    std::fs::create_dir(&imgs).unwrap();
    let mut cmd = Command::new(vabc());
    cmd.args([
        "bundle",
        "apply",
        "-",
        "-o",
        s(&imgs),
        "--key",
        s(&public),
        "--json",
    ])
    .args(base_args(&parts))
    .stdin(std::fs::File::open(&bundle).unwrap());
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["schema_version"], 1);
    for (name, _, new) in &parts {
        let img = imgs.join(format!("{name}.img"));
        assert_eq!(sha256_file(&img), sha256_file(new), "{name}");
        assert_eq!(
            std::fs::metadata(&img).unwrap().len(),
            std::fs::metadata(new).unwrap().len()
        );
    }
    assert_eq!(entries(&imgs), ["system.img", "vendor.img"]);
}

/// A small bundle of AOSP's vector images (4 MiB), for the checks that need many runs.
fn small_bundle(dir: &Path, key: Option<&Path>) -> PathBuf {
    let b = dir.join(format!("v{}.vabc", key.is_some()));
    create(
        &[(
            "system",
            vectors().join("base.img"),
            vectors().join("expected.img"),
        )],
        &b,
        key,
    );
    b
}

fn install_code(
    bundle: &Path,
    base: &Path,
    out: &Path,
    key: Option<&Path>,
) -> (Option<i32>, String) {
    let b = format!("system={}", base.display());
    let mut args = vec!["bundle", "install", s(bundle), "-b", &b, "-o", s(out)];
    match key {
        Some(k) => args.extend(["--key", s(k)]),
        None => args.push("--allow-unsigned"),
    }
    let o = run_vabc(&args);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn a_changed_byte_or_another_key_is_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keys(d.path(), "k");
    let (_, other) = keys(d.path(), "other");
    let bundle = small_bundle(d.path(), Some(&key));
    let base = vectors().join("base.img");
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let good = std::fs::read(&bundle).unwrap();

    let (c, e) = install_code(&bundle, &base, &out, Some(&other));
    assert_eq!(c, Some(1), "{e}");
    assert!(e.contains("does not verify"), "{e}");
    assert!(entries(&out).is_empty());

    // One flipped byte anywhere: the header, the manifest, the signature, the payload
    // (its start, middle and last byte), and a few random places.
    let mut at = vec![0, 9, 17, 40, 200, good.len() / 2, good.len() - 1];
    let mut rng = fastrand::Rng::with_seed(7);
    at.extend((0..6).map(|_| rng.usize(..good.len())));
    let bad = d.path().join("bad.vabc");
    for i in at {
        let mut b = good.clone();
        b[i] ^= 0x20;
        std::fs::write(&bad, &b).unwrap();
        let (c, e) = install_code(&bad, &base, &out, Some(&public));
        assert_ne!(c, Some(0), "byte {i} flipped: installed");
        assert!(
            entries(&out).is_empty(),
            "byte {i} flipped: {:?}",
            entries(&out)
        );
        let o = run_vabc(&["bundle", "verify", s(&bad), "--key", s(&public)]);
        assert!(!o.status.success(), "byte {i} flipped: verified");
        let _ = e;
    }

    // Unsigned: only with --allow-unsigned.
    let unsigned = small_bundle(d.path(), None);
    let (c, e) = install_code(&unsigned, &base, &out, Some(&public));
    assert_eq!(c, Some(1), "{e}");
    assert!(e.contains("not signed"), "{e}");
    assert!(entries(&out).is_empty());
    let (c, e) = install_code(&unsigned, &base, &out, None);
    assert_eq!(c, Some(0), "{e}");
    assert_eq!(entries(&out), ["system.cow", "system.cow.manifest"]);
}

#[test]
fn wrong_base_truncation_and_unknown_versions_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keys(d.path(), "k");
    let bundle = small_bundle(d.path(), Some(&key));
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();

    // The new image is not the base: exit 3, the first wrong region named.
    let (c, e) = install_code(
        &bundle,
        &vectors().join("expected.img"),
        &out,
        Some(&public),
    );
    assert_eq!(c, Some(3), "{e}");
    assert!(
        e.contains("region") && e.contains("nothing was written"),
        "{e}"
    );
    assert!(entries(&out).is_empty());

    let good = std::fs::read(&bundle).unwrap();
    let bad = d.path().join("bad.vabc");
    for cut in [10, 100, good.len() - 1000, good.len() - 1] {
        std::fs::write(&bad, &good[..cut]).unwrap();
        let (c, e) = install_code(&bad, &vectors().join("base.img"), &out, Some(&public));
        assert_eq!(c, Some(1), "cut at {cut}: {e}");
        assert!(
            e.contains("truncated") || e.contains("ends early"),
            "cut at {cut}: {e}"
        );
        assert!(entries(&out).is_empty());
    }
    // Bytes after the last payload: no signature covers them.
    let mut long = good.clone();
    long.extend_from_slice(b"unsigned tail");
    std::fs::write(&bad, &long).unwrap();
    let (c, e) = install_code(&bad, &vectors().join("base.img"), &out, Some(&public));
    assert_eq!(c, Some(1), "{e}");
    assert!(e.contains("13 bytes after the last payload"), "{e}");
    assert!(entries(&out).is_empty());
    let mut b = good.clone();
    b[8] = 4;
    std::fs::write(&bad, &b).unwrap();
    let o = run_vabc(&["bundle", "info", s(&bad)]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1));
    assert!(e.contains("bundle format version 4"), "{e}");
}

#[test]
fn an_install_killed_at_any_point_resumes_to_the_exact_cows() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keys(d.path(), "k");
    let parts = tiny_parts();
    let bundle = d.path().join("u.vabc");
    create_with(&parts, &bundle, Some(&key), &["--verity"]);
    let want = d.path().join("want");
    std::fs::create_dir(&want).unwrap();
    let install = |out: &Path| {
        let mut c = Command::new(vabc());
        c.args(install_args(s(&bundle), out, &public, &parts))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    };
    assert!(install(&want).status().unwrap().success());
    let mut rng = fastrand::Rng::with_seed(11);
    for round in 0..6 {
        let out = d.path().join(format!("out{round}"));
        std::fs::create_dir(&out).unwrap();
        let mut child = install(&out).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(rng.u64(0..400)));
        let _ = child.kill();
        let _ = child.wait();
        // Whatever is there is either complete or a temporary file to be redone.
        let o = install(&out).output().unwrap();
        assert!(o.status.success(), "round {round}");
        assert_eq!(
            entries(&out),
            [
                "system.cow",
                "system.cow.manifest",
                "system.verity",
                "vendor.cow",
                "vendor.cow.manifest",
                "vendor.verity"
            ],
            "round {round}: leftovers"
        );
        for name in ["system", "vendor"] {
            let files = ["cow", "cow.manifest", "verity"].map(|x| format!("{name}.{x}"));
            for f in files {
                assert_eq!(
                    std::fs::read(out.join(&f)).unwrap(),
                    std::fs::read(want.join(&f)).unwrap(),
                    "round {round}: {f}"
                );
            }
        }
    }
}

#[test]
fn a_verity_bundle_installs_the_tree_veritysetup_makes_and_checks_its_root() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keys(d.path(), "k");
    let parts = &tiny_parts()[..1];
    let bundle = d.path().join("u.vabc");
    let salt = "5a".repeat(32);
    create_with(
        parts,
        &bundle,
        Some(&key),
        &["--verity", "--verity-salt", &salt],
    );
    let info = ok(&["bundle", "info", "--json", s(&bundle)]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let v = &info["manifest"]["partitions"][0]["verity"];
    assert_eq!(v["salt"], salt.as_str());
    assert_eq!(v["hash_algorithm"], "sha256");
    let (root, uuid) = (
        v["root_hash"].as_str().unwrap(),
        v["uuid"].as_str().unwrap(),
    );

    // The tree `vabc verity format` (veritysetup's bytes) makes of the new image with
    // the same salt and UUID, and the same root hash.
    let want = d.path().join("want.verity");
    let f = ok(&[
        "verity",
        "format",
        "--json",
        "--salt",
        &salt,
        "--uuid",
        uuid,
        s(&parts[0].2),
        s(&want),
    ]);
    let f: serde_json::Value = serde_json::from_slice(&f.stdout).unwrap();
    assert_eq!(f["root_hash"], root);
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let (c, e) = install_code(&bundle, &parts[0].1, &out, Some(&public));
    assert_eq!(c, Some(0), "{e}");
    let tree = out.join("system.verity");
    assert_eq!(std::fs::read(&tree).unwrap(), std::fs::read(&want).unwrap());

    // A hash file of another update left under the name is made anew on resume.
    let other = d.path().join("other.verity");
    ok(&["verity", "format", s(&parts[0].2), s(&other)]);
    std::fs::copy(&other, &tree).unwrap();
    let (c, e) = install_code(&bundle, &parts[0].1, &out, Some(&public));
    assert_eq!(c, Some(0), "{e}");
    assert_eq!(std::fs::read(&tree).unwrap(), std::fs::read(&want).unwrap());

    // A tree with the right superblock but an altered hash block is not reused on
    // resume: it is checked against the signed root hash, and made anew.
    let mut bytes = std::fs::read(&want).unwrap();
    let last = bytes.len() - 4096;
    bytes[last + 7] ^= 0xff;
    std::fs::write(&tree, &bytes).unwrap();
    let (c, e) = install_code(&bundle, &parts[0].1, &out, Some(&public));
    assert_eq!(c, Some(0), "{e}");
    assert_eq!(std::fs::read(&tree).unwrap(), std::fs::read(&want).unwrap());

    // The served image verifies against the signed root hash.
    ok(&["verity", "verify", s(&parts[0].2), s(&tree), root]);

    // apply leaves the tree beside the image.
    let imgs = d.path().join("imgs");
    std::fs::create_dir(&imgs).unwrap();
    let b = format!("system={}", parts[0].1.display());
    let a = ok(&[
        "bundle",
        "apply",
        s(&bundle),
        "-b",
        &b,
        "-o",
        s(&imgs),
        "--key",
        s(&public),
        "--json",
    ]);
    let a: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    assert_eq!(a["partitions"][0]["root_hash"], root);
    assert_eq!(entries(&imgs), ["system.img", "system.verity"]);
    assert_eq!(
        std::fs::read(imgs.join("system.verity")).unwrap(),
        std::fs::read(&want).unwrap()
    );
}

/// What a test server sent: (range start, bytes sent) per response.
type Served = std::sync::Arc<std::sync::Mutex<Vec<(u64, usize)>>>;

/// A one-file HTTP/1.1 server on 127.0.0.1 that honours `Range: bytes=N-`; each of the
/// first `cuts` responses stops after `cut_after` body bytes (a dropped connection).
/// Returns the URL and the (range start, bytes sent) of every response.
fn http_server(data: Vec<u8>, cuts: usize, cut_after: usize) -> (String, Served) {
    http_server_with(data, cuts, cut_after, Server::default())
}

/// How [`http_server_with`] differs from [`http_server`].
#[derive(Default, Clone, Copy)]
struct Server {
    /// A cut response keeps its connection open and sends nothing more (a download
    /// that hangs until the installer is killed).
    stall: bool,
    /// Every request gets the whole file with status 200 (`python3 -m http.server`).
    ignore_ranges: bool,
}

fn http_server_with(data: Vec<u8>, cuts: usize, cut_after: usize, how: Server) -> (String, Served) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/u.vabc", listener.local_addr().unwrap());
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let served = log.clone();
    std::thread::spawn(move || {
        for (i, conn) in listener.incoming().enumerate() {
            let Ok(mut conn) = conn else { continue };
            let mut start = 0u64;
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(r) = lower.strip_prefix("range: bytes=")
                    && !how.ignore_ranges
                {
                    start = r.trim().trim_end_matches('-').parse().unwrap();
                }
            }
            let body = &data[start as usize..];
            let head = if start > 0 {
                format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {start}-{}/{}\r\n",
                    data.len() - 1,
                    data.len()
                )
            } else {
                "HTTP/1.1 200 OK\r\n".to_string()
            };
            let head = format!(
                "{head}Content-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let n = if i < cuts {
                cut_after.min(body.len())
            } else {
                body.len()
            };
            // Logged before it is sent: a client may act on the bytes (and the test
            // on the client) before the write returns.
            served.lock().unwrap().push((start, n));
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&body[..n]);
            if how.stall && i < cuts {
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_secs(300));
                    drop(conn);
                });
            }
        }
    });
    (url, log)
}

#[test]
fn a_download_cut_mid_way_resumes_where_it_stopped() {
    let (d, public, parts, bundle) = signed_tiny_bundle();
    let data = std::fs::read(&bundle).unwrap();
    let len = data.len();
    let (url, served) = http_server(data, 3, len / 5);
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let install = |from: &str, to: &Path| {
        let args = install_args(from, to, &public, &parts);
        ok(&args)
    };
    install(&url, &out);
    let log = served.lock().unwrap().clone();
    // Four responses, each from where the one before stopped: no byte twice.
    assert_eq!(log.len(), 4, "{log:?}");
    let mut at = 0;
    for &(start, n) in &log {
        assert_eq!(start as usize, at, "{log:?}");
        at += n;
    }
    assert_eq!(at, len);
    let want = d.path().join("want");
    std::fs::create_dir(&want).unwrap();
    install(s(&bundle), &want);
    for f in [
        "system.cow",
        "vendor.cow",
        "system.cow.manifest",
        "vendor.cow.manifest",
    ] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(want.join(f)).unwrap(),
            "{f}"
        );
    }

    // Resumed after the first partition: its payload is not fetched again; the
    // download asks for the second's range (the last payload, ending the file).
    std::fs::remove_file(out.join("vendor.cow")).unwrap();
    let before = log.len();
    let o = install(&url, &out);
    assert!(String::from_utf8_lossy(&o.stdout).contains("already installed"));
    let info = ok(&["bundle", "info", "--json", s(&bundle)]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let vendor_len = info["manifest"]["partitions"][1]["payload"]["length"]
        .as_u64()
        .unwrap() as usize;
    let log = served.lock().unwrap().clone();
    let starts: Vec<u64> = log[before..].iter().map(|&(start, _)| start).collect();
    assert_eq!(starts, [0, (len - vendor_len) as u64], "{log:?}");
    assert_eq!(
        std::fs::read(out.join("vendor.cow")).unwrap(),
        std::fs::read(want.join("vendor.cow")).unwrap()
    );
}

#[test]
fn a_download_killed_mid_partition_resumes_from_the_bytes_it_saved() {
    let (d, public, parts, bundle) = signed_tiny_bundle();
    let data = std::fs::read(&bundle).unwrap();
    let info = ok(&["bundle", "info", "--json", s(&bundle)]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let payload_start = data.len() as u64 - info["payload_bytes"].as_u64().unwrap();
    let system = &info["manifest"]["partitions"][0]["payload"];
    let (system_at, system_len) = (
        payload_start + system["offset"].as_u64().unwrap(),
        system["length"].as_u64().unwrap(),
    );
    // Past the reader's 256 KiB buffer, so that the resumed run must ask for a range.
    let saved = 300_000u64;
    assert!(saved < system_len, "system payload of {system_len} bytes");
    let stall = Server {
        stall: true,
        ..Server::default()
    };
    let (url, served) = http_server_with(data.clone(), 1, (system_at + saved) as usize, stall);
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let install = |from: &str, to: &Path| {
        let mut c = Command::new(vabc());
        c.args(install_args(from, to, &public, &parts))
            .arg("--json");
        c
    };
    // The first run hangs where the server stops sending; it is killed once all it
    // received is saved.
    let mut child = install(&url, &out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let spool_len = || {
        entries(&out)
            .iter()
            .find(|f| f.starts_with(".system.payload.") && f.ends_with(".part"))
            .map(|f| std::fs::metadata(out.join(f)).unwrap().len())
    };
    let t = std::time::Instant::now();
    while spool_len() != Some(saved) {
        assert!(
            t.elapsed().as_secs() < 120,
            "saved {:?} of {saved}",
            spool_len()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.join("system.cow").exists());

    let before = served.lock().unwrap().len();
    let o = install(&url, &out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["partitions"][0]["resumed_bytes"], saved);
    assert_eq!(report["partitions"][1]["resumed_bytes"], 0);
    // The header again, then the range after the saved bytes: nothing between.
    let log = served.lock().unwrap().clone();
    let starts: Vec<u64> = log[before..].iter().map(|&(start, _)| start).collect();
    assert_eq!(starts, [0, system_at + saved], "{log:?}");
    // No saved download is left, and the COWs are the ones a file install writes.
    let want = d.path().join("want");
    std::fs::create_dir(&want).unwrap();
    ok(&install_args(s(&bundle), &want, &public, &parts));
    assert_same_files(&out, &want);

    // Saved bytes that are wrong fail to decode or to hash to the signed sha256, and
    // are dropped: that run fails with nothing kept, the next downloads afresh.
    std::fs::remove_file(out.join("system.cow")).unwrap();
    let spool = out.join(format!(
        ".system.payload.{}.part",
        &system["sha256"].as_str().unwrap()[..16]
    ));
    let mut bad = data[system_at as usize..(system_at + saved) as usize].to_vec();
    bad[100_000] ^= 1;
    std::fs::write(&spool, &bad).unwrap();
    let o = install(&url, &out).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&url) && err.contains("nothing kept"), "{err}");
    assert!(!spool.exists() && !out.join("system.cow").exists());
    let o = install(&url, &out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read(out.join("system.cow")).unwrap(),
        std::fs::read(want.join("system.cow")).unwrap()
    );
}

#[test]
fn a_server_that_ignores_ranges_still_serves_a_resumed_install() {
    let (d, public, parts, bundle) = signed_tiny_bundle();
    let whole = Server {
        ignore_ranges: true,
        ..Server::default()
    };
    let (url, served) = http_server_with(std::fs::read(&bundle).unwrap(), 0, 0, whole);
    let install = |from: &str, to: &Path| {
        let args = install_args(from, to, &public, &parts);
        ok(&args)
    };
    let want = d.path().join("want");
    std::fs::create_dir(&want).unwrap();
    install(s(&bundle), &want);
    // The first partition is done: passing over its payload asks for a range, and the
    // answer is the whole file again, whose first bytes are dropped.
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();
    for f in ["system.cow", "system.cow.manifest"] {
        std::fs::copy(want.join(f), out.join(f)).unwrap();
    }
    let o = install(&url, &out);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("ignores range requests"),
        "{o:?}"
    );
    assert!(served.lock().unwrap().len() >= 2);
    assert_same_files(&out, &want);
}

#[test]
fn a_second_install_into_the_same_folder_is_refused() {
    use std::os::fd::AsRawFd;
    let (d, public, parts, bundle) = signed_tiny_bundle();
    let out = d.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // Another install holds the folder.
    let held = std::fs::File::open(&out).unwrap();
    // SAFETY: flock on a descriptor `held` owns, open across the call.
    let r = unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(r, 0);
    let args = install_args(s(&bundle), &out, &public, &parts);
    let o = Command::new(vabc()).args(&args).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("another install"), "{err}");
    assert!(entries(&out).is_empty());
    drop(held);
    ok(&args);
}

#[test]
fn too_little_space_is_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let (key, public) = keys(d.path(), "k");
    let bundle = small_bundle(d.path(), Some(&key));
    // A file system smaller than the COW (about 2.1 MiB, most of it scratch area).
    let out = d.path().join("small-fs");
    std::fs::create_dir(&out).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "vabc-test", s(&out)])
        .status()
        .unwrap();
    assert!(st.success(), "mount a 1 MiB tmpfs (the tests run as root)");
    let (c, e) = install_code(&bundle, &vectors().join("base.img"), &out, Some(&public));
    let listed = entries(&out);
    let _ = Command::new("umount").arg(&out).status();
    assert_eq!(c, Some(1), "{e}");
    assert!(
        e.contains("free") && e.contains("nothing was written"),
        "{e}"
    );
    assert!(listed.is_empty(), "{listed:?}");
}
