//! `vabc merge` end to end on AOSP's vectors and a corpus pair.

mod serve_common;

use serve_common::{run_vabc, sha256_file, vectors};
use std::process::Command;

const EXPECTED_SHA: &str = "ff702c6cea81c675807b7ea9f450f96de01a30ecc8545b7c1d57dee750d98c2f";

#[test]
fn merge_vectors_with_both_engines_pause_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.img");
    let cow = dir.path().join("u.cow");
    for name in [
        "v2_gz_4096.cow",
        "v3_lz4_65536.cow",
        "v3_zstd_16384.cow",
        "v2_brotli_4096.cow",
    ] {
        for engine in ["uring", "sync"] {
            std::fs::copy(vectors().join("base.img"), &base).unwrap();
            std::fs::copy(vectors().join(name), &cow).unwrap();
            let b = base.to_str().unwrap();
            let c = cow.to_str().unwrap();
            // Pause after one commit (the first window), then resume.
            let o = run_vabc(&[
                "merge",
                "--without-manifest",
                "--base",
                b,
                "--cow",
                c,
                "--engine",
                engine,
                "--window-ops",
                "3",
                "--max-commits",
                "1",
            ]);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert!(String::from_utf8_lossy(&o.stdout).contains("paused after 3"));
            assert_ne!(sha256_file(&base), EXPECTED_SHA);
            let o = run_vabc(&[
                "merge",
                "--without-manifest",
                "--base",
                b,
                "--cow",
                c,
                "--engine",
                engine,
                "--json",
            ]);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["started_at"], 3);
            assert_eq!(v["complete"], true);
            assert_eq!(sha256_file(&base), EXPECTED_SHA, "{name} {engine}");
            let o = run_vabc(&["merge", "--without-manifest", "--base", b, "--cow", c]);
            assert!(o.status.success());
            assert!(String::from_utf8_lossy(&o.stdout).contains("already complete"));
            assert_eq!(sha256_file(&base), EXPECTED_SHA);
        }
    }
}

#[test]
fn badseq_is_refused_and_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.img");
    let cow = dir.path().join("bad.cow");
    std::fs::copy(vectors().join("base.img"), &base).unwrap();
    std::fs::copy(vectors().join("v3_lz4_4096_badseq.cow"), &cow).unwrap();
    let (b0, c0) = (sha256_file(&base), sha256_file(&cow));
    for engine in ["uring", "sync"] {
        let o = run_vabc(&[
            "merge",
            "--without-manifest",
            "--base",
            base.to_str().unwrap(),
            "--cow",
            cow.to_str().unwrap(),
            "--engine",
            engine,
        ]);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("merge order is unsafe"), "{err}");
        assert_eq!(sha256_file(&base), b0);
        assert_eq!(sha256_file(&cow), c0);
    }
    // `serve --merge` refuses it before serving, saying why.
    let sock = dir.path().join("nbd.sock");
    let o = run_vabc(&[
        "serve",
        "--base",
        base.to_str().unwrap(),
        "--cow",
        cow.to_str().unwrap(),
        "--nbd",
        &format!("unix:{}", sock.display()),
        "--merge",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot merge") && err.contains("merge order is unsafe"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&o.stdout).contains("ready"));
    assert_eq!(sha256_file(&base), b0);
    assert_eq!(sha256_file(&cow), c0);
    // A base that is too small is refused too, untouched.
    let small = dir.path().join("small.img");
    std::fs::write(&small, vec![7u8; 64 * 4096]).unwrap();
    std::fs::copy(vectors().join("v2_lz4_4096.cow"), &cow).unwrap();
    let o = run_vabc(&[
        "merge",
        "--without-manifest",
        "--base",
        small.to_str().unwrap(),
        "--cow",
        cow.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("wrong base image") || e.contains("past the end of the base"),
        "{e}"
    );
    assert_eq!(std::fs::read(&small).unwrap(), vec![7u8; 64 * 4096]);
}

/// A real update: the tiny corpus pair (ext4), made by `vabc diff`, merged
/// into a copy of old.img with each engine, gives exactly new.img.
#[test]
fn merge_tiny_corpus_pair_with_both_engines() {
    let old = serve_common::corpus_image("tiny", "old", "ext4");
    let new = serve_common::corpus_image("tiny", "new", "ext4");
    let dir = tempfile::tempdir().unwrap();
    let cow = dir.path().join("tiny.cow");
    let o = Command::new(env!("CARGO_BIN_EXE_vabc"))
        .arg("diff")
        .arg(&old)
        .arg(&new)
        .arg("-o")
        .arg(&cow)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = sha256_file(&new);
    for engine in ["uring", "sync"] {
        let base = dir.path().join("base.img");
        let c = dir.path().join("m.cow");
        std::fs::copy(&old, &base).unwrap();
        std::fs::copy(&cow, &c).unwrap();
        let o = run_vabc(&[
            "merge",
            "--without-manifest",
            "--base",
            base.to_str().unwrap(),
            "--cow",
            c.to_str().unwrap(),
            "--engine",
            engine,
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["complete"], true);
        assert_eq!(sha256_file(&base), want, "{engine}");
    }
}

/// A COW without a manifest is not merged unless asked; asked, every op is decoded
/// before the first write: AOSP's own v2 fixture, whose record says one op is merged
/// already (so no proof of the result runs), with one REPLACE payload cut to 4095
/// bytes, leaves the base as it was.
#[test]
fn a_cow_without_a_manifest_is_merged_only_when_asked_and_decoded_first() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.img");
    let cow = dir.path().join("u.cow");
    std::fs::copy(vectors().join("base.img"), &base).unwrap();
    let mut c = std::fs::read(vectors().join("aosp-testdata/cow_v2")).unwrap();
    // The REPLACE record of block 2: type 2, no compression, 4096 bytes.
    let at = (0..c.len() - 20)
        .find(|&i| {
            c[i] == 2 && c[i + 2..i + 4] == [0, 0x10] && c[i + 4..i + 12] == 2u64.to_le_bytes()
        })
        .unwrap();
    c[at + 2..at + 4].copy_from_slice(&4095u16.to_le_bytes());
    std::fs::write(&cow, &c).unwrap();
    let before = sha256_file(&base);
    let (b, cw) = (base.to_str().unwrap(), cow.to_str().unwrap());
    let o = run_vabc(&["merge", "--base", b, "--cow", cw]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("no manifest") && e.contains("vabc manifest"),
        "{e}"
    );
    let o = run_vabc(&["merge", "--without-manifest", "--base", b, "--cow", cw]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("does not decode") && e.contains("nothing was written"),
        "{e}"
    );
    assert_eq!(
        sha256_file(&base),
        before,
        "the base was written before the COW was decoded"
    );
}

/// An op whose block number reaches 16 TiB out (block 2^32-1) in a COW without a
/// manifest: refused at once, by the size of what is there, not after hours of
/// reading up to it.
#[test]
fn an_op_far_past_the_base_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.img");
    let cow = dir.path().join("far.cow");
    std::fs::copy(vectors().join("base.img"), &base).unwrap();
    let mut c = std::fs::read(vectors().join("v2_none_4096.cow")).unwrap();
    // The first ZERO record (type 3, no data) after the scratch area.
    let start = 38 + (2 << 20);
    let at = (start..c.len() - 20)
        .find(|&i| {
            let block = u64::from_le_bytes(c[i + 4..i + 12].try_into().unwrap());
            c[i] == 3 && c[i + 1..i + 4] == [0, 0, 0] && block < 1024 && c[i + 12..i + 20] == [0; 8]
        })
        .unwrap();
    c[at + 4..at + 12].copy_from_slice(&(u64::from(u32::MAX)).to_le_bytes());
    std::fs::write(&cow, &c).unwrap();
    let before = sha256_file(&base);
    let (b, cw) = (base.to_str().unwrap(), cow.to_str().unwrap());
    for args in [
        &["merge", "--without-manifest", "--base", b, "--cow", cw][..],
        &["inspect", cw, "--check", "--base", b][..],
    ] {
        let t = std::time::Instant::now();
        let o = run_vabc(args);
        let e = String::from_utf8_lossy(&o.stderr);
        // merge's error (1); inspect --check reports a failed check (3).
        assert!(matches!(o.status.code(), Some(1 | 3)), "{args:?}: {e}");
        assert!(e.contains("past the end of the base"), "{args:?}: {e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "{args:?}");
    }
    assert_eq!(sha256_file(&base), before);
}
