//! The wire formats vabc writes, pinned: the COW (v3 and v2), its manifest sidecar
//! and a signed bundle made from the `tiny` corpus pair (reproducible byte for byte)
//! with a fixed key and build time must hash to these values. A refactor changes
//! none of them; a deliberate format change updates them here, visibly.

mod serve_common;

use std::path::Path;

use serve_common::{corpus_image, run_vabc, sha256_file};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(args: &[&str]) {
    let o = run_vabc(args);
    assert!(
        o.status.success(),
        "vabc {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn cows_and_manifests_are_the_pinned_bytes() {
    let d = tempfile::tempdir().unwrap();
    let (old, new) = (
        corpus_image("tiny", "old", "ext4"),
        corpus_image("tiny", "new", "ext4"),
    );
    let v3 = d.path().join("v3.cow");
    ok(&["diff", s(&old), s(&new), "-o", s(&v3)]);
    let v2 = d.path().join("v2.cow");
    ok(&[
        "diff",
        "--format",
        "v2",
        "--compression",
        "lz4",
        s(&old),
        s(&new),
        "-o",
        s(&v2),
    ]);
    let pinned = [
        (
            &v3,
            "2d57cdb5bd68211dd967f1edc5f3179b549e5803c099b16038283554957c3a68",
            "153db90b4b2b7e3d4442ec57c8aee6cf2878a3fe37749b26f90988ac90cb03df",
        ),
        (
            &v2,
            "7a759265700a8b5115eed7940beccc1a17c5fb994a2c7e6d7b750713564d5e3f",
            "816a966fad4a53bde3093c6cbf6607b4b0b8cdbc397d30a099c8f5d76b630b76",
        ),
    ];
    for (cow, cow_sha, manifest_sha) in pinned {
        assert_eq!(sha256_file(cow), cow_sha, "{}", cow.display());
        let m = manifest::Manifest::path_for(cow);
        assert_eq!(sha256_file(&m), manifest_sha, "{}", m.display());
    }
}

#[test]
fn a_signed_bundle_is_the_pinned_bytes() {
    let d = tempfile::tempdir().unwrap();
    let (old, new) = (
        corpus_image("tiny", "old", "ext4"),
        corpus_image("tiny", "new", "ext4"),
    );
    let key = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-key.pem");
    let bundle = d.path().join("u.vabc");
    let p = format!("system={},{}", old.display(), new.display());
    let o = std::process::Command::new(serve_common::vabc())
        .args([
            "bundle",
            "create",
            "-p",
            &p,
            "--key",
            s(&key),
            "-o",
            s(&bundle),
        ])
        .env("SOURCE_DATE_EPOCH", "1700000000")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        sha256_file(&bundle),
        "a8f6fa8cc1812639d89cc0cc0ae8a95059d359b52f71ef437889cac0ee9e9bc2"
    );
}
