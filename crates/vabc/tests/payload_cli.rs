//! `vabc payload`: Android's OTA payloads from a file, an OTA zip and a URL, signed
//! with an RSA key as update_engine signs them: `info` describes them (JSON checked
//! against its schema), `verify` checks both signatures, `extract` writes exactly the
//! new images (full and incremental). Another key, a changed byte, an operation we
//! do not apply or a wrong old image stops it with the right status and leaves the
//! output folder empty.

mod serve_common;

use std::path::{Path, PathBuf};

use payload::fuzzing;
use serve_common::run_vabc;

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

/// Fails with exit status `code`; its stderr.
fn fails(args: &[&str], code: i32) -> String {
    let o = run_vabc(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(code), "vabc {args:?}: {err}");
    err
}

fn json(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap()
}

struct Fixture {
    dir: tempfile::TempDir,
    public: PathBuf,
    other: PathBuf,
    full: PathBuf,
    images: Vec<(String, Vec<u8>)>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let (private, public) = fuzzing::openssl_key(dir.path(), "release");
    let (_, other) = fuzzing::openssl_key(dir.path(), "other");
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&private, h);
    let (bytes, images) = fuzzing::sample_full(Some(&sign));
    let full = dir.path().join("payload.bin");
    std::fs::write(&full, bytes).unwrap();
    Fixture {
        dir,
        public,
        other,
        full,
        images,
    }
}

fn out_dir(f: &Fixture, name: &str) -> PathBuf {
    let d = f.dir.path().join(name);
    std::fs::create_dir(&d).unwrap();
    d
}

fn listing(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn info_describes_partitions_operations_and_signatures() {
    let f = fixture();
    let v = json(&ok(&["payload", "info", "--json", s(&f.full)]));
    assert_eq!(v["kind"], "full");
    assert_eq!(v["major_version"], 2);
    assert_eq!(v["partitions"][0]["name"], "system");
    assert_eq!(v["partitions"][0]["operations_by_type"]["REPLACE_XZ"], 1);
    assert_eq!(v["partitions"][1]["new_size"], f.images[1].1.len());
    assert!(v["metadata_signature_bytes"].as_u64().unwrap() > 256);
    let text = String::from_utf8(ok(&["payload", "info", s(&f.full)]).stdout).unwrap();
    assert!(
        text.contains("system: - -> 163840 bytes, 6 operations"),
        "{text}"
    );
}

#[test]
fn verify_takes_the_signing_key_and_refuses_another() {
    let f = fixture();
    let v = json(&ok(&[
        "payload",
        "verify",
        "--json",
        "--key",
        s(&f.public),
        s(&f.full),
    ]));
    assert_eq!(v["payload_signature"], "verified");
    let err = fails(&["payload", "verify", "--key", s(&f.other), s(&f.full)], 3);
    assert!(err.contains("metadata signature does not verify"), "{err}");
    // Either of two keys.
    ok(&[
        "payload",
        "verify",
        "--key",
        s(&f.other),
        "--key",
        s(&f.public),
        s(&f.full),
    ]);
}

#[test]
fn extract_writes_exactly_the_new_images() {
    let f = fixture();
    let out = out_dir(&f, "out");
    let v = json(&ok(&[
        "payload",
        "extract",
        "--json",
        "--key",
        s(&f.public),
        "-o",
        s(&out),
        s(&f.full),
    ]));
    assert_eq!(v["signature"], "metadata signature verified");
    for (name, want) in &f.images {
        assert!(
            std::fs::read(out.join(format!("{name}.img"))).unwrap() == *want,
            "{name}"
        );
    }
    assert_eq!(listing(&out), ["system.img", "vendor.img"]);
}

#[test]
fn extract_reads_an_ota_zip_at_a_url_fetching_only_the_asked_partition() {
    let f = fixture();
    let zip = f.dir.path().join("ota.zip");
    fuzzing::ota_zip(&f.full, &zip);
    let (url, _) = fuzzing::range_server(std::fs::read(&zip).unwrap(), "ota.zip");
    let out = out_dir(&f, "out");
    let v = json(&ok(&[
        "payload",
        "extract",
        "--json",
        "--key",
        s(&f.public),
        "-p",
        "vendor",
        "-o",
        s(&out),
        &url,
    ]));
    assert_eq!(listing(&out), ["vendor.img"]);
    assert!(std::fs::read(out.join("vendor.img")).unwrap() == f.images[1].1);
    let fetched = v["fetched_bytes"].as_u64().unwrap();
    let system_data = f.images[0].1.len() as u64 / 4;
    assert!(
        fetched < std::fs::metadata(&zip).unwrap().len() - system_data,
        "{fetched}"
    );
    // The zip as a file, too.
    let out2 = out_dir(&f, "out2");
    ok(&[
        "payload",
        "extract",
        "--key",
        s(&f.public),
        "-o",
        s(&out2),
        s(&zip),
    ]);
    assert_eq!(listing(&out2), ["system.img", "vendor.img"]);
}

#[test]
fn an_incremental_payload_is_applied_to_the_old_images() {
    let f = fixture();
    let sign_key = f.dir.path().join("release.pem");
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&sign_key, h);
    let (bytes, old, new) = fuzzing::sample_incremental(f.dir.path(), Some(&sign));
    let inc = f.dir.path().join("inc.bin");
    std::fs::write(&inc, bytes).unwrap();
    let old_dir = out_dir(&f, "old");
    std::fs::write(old_dir.join("system.img"), &old).unwrap();
    let out = out_dir(&f, "out");
    // Without the old images: the option to give is named.
    let err = fails(
        &[
            "payload",
            "extract",
            "--key",
            s(&f.public),
            "-o",
            s(&out),
            s(&inc),
        ],
        1,
    );
    assert!(err.contains("--old DIR"), "{err}");
    ok(&[
        "payload",
        "extract",
        "--key",
        s(&f.public),
        "--old",
        s(&old_dir),
        "-o",
        s(&out),
        s(&inc),
    ]);
    assert!(std::fs::read(out.join("system.img")).unwrap() == new);
    // Another old image: refused, naming the operation, and nothing written.
    let mut wrong = old.clone();
    wrong[100] ^= 1;
    std::fs::write(old_dir.join("system.img"), &wrong).unwrap();
    let out2 = out_dir(&f, "out2");
    let err = fails(
        &[
            "payload",
            "extract",
            "--key",
            s(&f.public),
            "--old",
            s(&old_dir),
            "-o",
            s(&out2),
            s(&inc),
        ],
        3,
    );
    assert!(
        err.contains("partition system, operation 1 (SOURCE_BSDIFF)"),
        "{err}"
    );
    assert!(listing(&out2).is_empty(), "{:?}", listing(&out2));
}

#[test]
fn a_changed_byte_another_key_or_an_unsupported_operation_leaves_nothing() {
    let f = fixture();
    let bytes = std::fs::read(&f.full).unwrap();
    let p = fuzzing::open(&bytes).unwrap();
    let mut bad = bytes.clone();
    bad[p.header.data_offset() as usize + 20000] ^= 4;
    let bad_path = f.dir.path().join("bad.bin");
    std::fs::write(&bad_path, &bad).unwrap();
    let out = out_dir(&f, "out");
    let err = fails(
        &[
            "payload",
            "extract",
            "--key",
            s(&f.public),
            "-o",
            s(&out),
            s(&bad_path),
        ],
        3,
    );
    assert!(
        err.contains("partition system, operation 1 (REPLACE_BZ)") && err.contains("SHA-256"),
        "{err}"
    );
    let err = fails(
        &[
            "payload",
            "extract",
            "--key",
            s(&f.other),
            "-o",
            s(&out),
            s(&f.full),
        ],
        3,
    );
    assert!(err.contains("does not verify"), "{err}");
    // No key at all is a usage error naming both ways.
    let err = fails(&["payload", "extract", "-o", s(&out), s(&f.full)], 2);
    assert!(
        err.contains("--key") && err.contains("--no-verify"),
        "{err}"
    );
    let err = fails(
        &[
            "payload",
            "extract",
            "--key",
            s(&f.public),
            "-p",
            "boot",
            "-o",
            s(&out),
            s(&f.full),
        ],
        1,
    );
    assert!(
        err.contains("no such partition (it has system, vendor)"),
        "{err}"
    );
    // An operation vabc does not apply yet, or a patch that does not apply: named,
    // and nothing is written.
    let img = fuzzing::image(9, 4);
    for (t, want) in [
        (
            payload::proto::OpType::Bsdiff,
            "partition product, operation 1: BSDIFF is not supported",
        ),
        (
            payload::proto::OpType::Puffdiff,
            "partition product, operation 1 (PUFFDIFF): its puffin patch does not apply: 4 \
             bytes: shorter than a puffin header",
        ),
    ] {
        let mut b = fuzzing::Builder::new(8);
        let part = b.partition("product", Some(img.clone()), &img);
        let e = payload::proto::Extent::new;
        b.op(
            part,
            payload::proto::OpType::Replace,
            &[],
            &[e(0, 2)],
            Some(&img[..8192]),
        );
        b.op(part, t, &[e(2, 2)], &[e(2, 2)], Some(b"PUF1"));
        let bad = f.dir.path().join("bad.bin");
        std::fs::write(&bad, b.finish(None)).unwrap();
        let old_dir = out_dir(&f, &format!("old-{}", t.name()));
        std::fs::write(old_dir.join("product.img"), &img).unwrap();
        let err = fails(
            &[
                "payload",
                "extract",
                "--no-verify",
                "--old",
                s(&old_dir),
                "-o",
                s(&out),
                s(&bad),
            ],
            1,
        );
        assert!(err.contains(want), "{err}");
        assert!(listing(&out).is_empty(), "{:?}", listing(&out));
    }
}

#[test]
fn an_incremental_payload_becomes_cows_that_apply_and_merge_to_the_new_image() {
    let f = fixture();
    let sign_key = f.dir.path().join("release.pem");
    let sign = |h: &[u8; 32]| fuzzing::openssl_sign(&sign_key, h);
    let (bytes, old, new) = fuzzing::sample_incremental(f.dir.path(), Some(&sign));
    let inc = f.dir.path().join("inc.bin");
    std::fs::write(&inc, bytes).unwrap();
    let old_dir = out_dir(&f, "old");
    let base = old_dir.join("system.img");
    std::fs::write(&base, &old).unwrap();
    let out = out_dir(&f, "cows");
    let v = json(&ok(&[
        "payload",
        "cow",
        "--json",
        "--key",
        s(&f.public),
        "--old",
        s(&old_dir),
        "-o",
        s(&out),
        s(&inc),
    ]));
    // The payload's own parameters, its merge operations as COPY and XOR.
    assert_eq!(v["cow"]["version"], 3);
    assert_eq!(v["cow"]["compression"], "lz4");
    assert_eq!(v["cow"]["compression_factor"], 65536);
    let blocks = &v["partitions"][0]["blocks"];
    assert_eq!(
        (
            blocks["copy"].as_u64(),
            blocks["xor"].as_u64(),
            blocks["replace"].as_u64()
        ),
        (Some(8), Some(20), Some(12)),
        "{blocks}"
    );
    assert_eq!(listing(&out), ["system.cow", "system.cow.manifest"]);
    let cow = out.join("system.cow");
    let i = json(&ok(&["inspect", "--json", s(&cow)]));
    assert_eq!(
        (i["version"].as_str(), i["compression"].as_str()),
        (Some("3.0"), Some("lz4")),
        "{i}"
    );
    // The manifest's checks hold: apply makes the new image, and a merge in place too.
    let applied = f.dir.path().join("applied.img");
    ok(&[
        "apply",
        "--base",
        s(&base),
        "--cow",
        s(&cow),
        "-o",
        s(&applied),
    ]);
    assert!(std::fs::read(&applied).unwrap() == new, "apply");
    ok(&["merge", "--base", s(&base), "--cow", s(&cow)]);
    assert!(std::fs::read(&base).unwrap() == new, "merge");
    // A full payload has no base to make a COW against.
    let err = fails(
        &[
            "payload",
            "cow",
            "--key",
            s(&f.public),
            "--old",
            s(&old_dir),
            "-o",
            s(&out),
            s(&f.full),
        ],
        1,
    );
    assert!(err.contains("extract it instead"), "{err}");
}

#[test]
fn update_engines_delta_payload_becomes_a_cow_that_serves_and_merges_its_target() {
    use serve_common::{Server, os};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fuzzing::update_engine_samples(d);
    let (old_dir, out) = (d.join("old"), d.join("out"));
    std::fs::create_dir_all(&old_dir).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    let base = old_dir.join("kernel.img");
    std::fs::copy(d.join("images/disk_ext2_4k_empty.img"), &base).unwrap();
    let want = std::fs::read(d.join("images/disk_ext2_4k.img")).unwrap();
    let delta = d.join("delta_payload.bin");
    let v = json(&ok(&[
        "payload",
        "cow",
        "--json",
        "--no-verify",
        "-p",
        "kernel",
        "--old",
        s(&old_dir),
        "-o",
        s(&out),
        s(&delta),
    ]));
    // No VABC metadata in this payload: update_engine's defaults.
    assert_eq!(
        (
            v["cow"]["version"].as_u64(),
            v["cow"]["compression"].as_str()
        ),
        (Some(2), Some("gz")),
        "{v}"
    );
    let cow = out.join("kernel.cow");
    ok(&["inspect", "--verify-merge", s(&cow)]);
    // Served (FUSE, the manifest's base check), it reads as the target image.
    let fuse = d.join("fuse");
    std::fs::create_dir_all(&fuse).unwrap();
    {
        let _server = Server::start(&[
            os("--base"),
            os(&base),
            os("--cow"),
            os(&cow),
            os("--fuse"),
            os(&fuse),
        ]);
        assert!(
            std::fs::read(fuse.join("disk.img")).unwrap() == want,
            "served"
        );
    }
    ok(&["merge", "--base", s(&base), "--cow", s(&cow)]);
    assert!(std::fs::read(&base).unwrap() == want, "merged");
}
