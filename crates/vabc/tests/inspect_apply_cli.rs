//! `vabc inspect` and `vabc apply` end to end, on AOSP's vectors read in
//! place.

mod serve_common;

use serve_common::{run_vabc, sha256_file, vectors};
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const EXPECTED_SHA: &str = "ff702c6cea81c675807b7ea9f450f96de01a30ecc8545b7c1d57dee750d98c2f";

fn cows() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(vectors())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cow"))
        .collect();
    v.sort();
    v
}

#[test]
fn apply_reproduces_expected_for_every_vector() {
    let dir = tempfile::tempdir().unwrap();
    let base = vectors().join("base.img");
    for cow in cows() {
        let out = dir.path().join("new.img");
        let o = run_vabc(&["apply", "--base", s(&base), "--cow", s(&cow), "-o", s(&out)]);
        assert!(
            o.status.success(),
            "{}: {}",
            cow.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(sha256_file(&out), EXPECTED_SHA, "{}", cow.display());
    }
    // Only the output is left behind: no temporary files.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("new.img")]);
}

#[test]
fn verify_merge_rejects_badseq_only() {
    for cow in cows() {
        let o = run_vabc(&["inspect", s(&cow), "--verify-merge"]);
        let out = String::from_utf8_lossy(&o.stdout);
        if s(&cow).contains("badseq") {
            assert!(!o.status.success());
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                err.contains("merge order is unsafe") && err.contains("block 12"),
                "{err}"
            );
            assert!(out.contains("inconsistent"));
        } else {
            assert!(o.status.success(), "{}", cow.display());
            assert!(out.contains("Merge sequence is consistent."));
        }
    }
}

#[test]
fn inspect_json_lists_ops_in_merge_order() {
    let cow = vectors().join("v3_lz4_65536.cow");
    let o = run_vabc(&["inspect", s(&cow), "--ops", "--order", "merge", "--json"]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["version"], "3.0");
    assert_eq!(v["compression"], "lz4");
    assert_eq!(v["compression_factor"], 65536);
    assert_eq!(v["op_counts"]["REPLACE"], 3);
    assert_eq!(v["blocks_by_type"]["REPLACE"], 19);
    assert_eq!(v["order"], "merge");
    let ops = v["ops"].as_array().unwrap();
    let blocks: Vec<u64> = ops
        .iter()
        .map(|o| o["new_block"].as_u64().unwrap())
        .collect();
    assert_eq!(
        blocks,
        vec![10, 11, 12, 20, 200, 201, 202, 203, 100, 116, 118, 300, 301]
    );
    assert_eq!(ops[0]["type"], "COPY");
    assert_eq!(ops[0]["source"], 11);
    assert_eq!(ops[4]["type"], "XOR");
    assert_eq!(ops[4]["source"], 40 * 4096 + 100);
    assert!(ops[4]["data_length"].as_u64().unwrap() > 0);
    let labels: Vec<u64> = v["labels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["label"].as_u64().unwrap())
        .collect();
    assert_eq!(labels, vec![3, 4, 5, 6]);
    // Stream order differs from merge order only by where REPLACE/ZERO sit.
    let o = run_vabc(&["inspect", s(&cow), "--ops", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["order"], "stream");
    assert_eq!(v["ops"].as_array().unwrap().len(), 13);
}

#[test]
fn apply_at_label() {
    let dir = tempfile::tempdir().unwrap();
    let base = vectors().join("base.img");
    let out = dir.path().join("l1.img");
    let o = run_vabc(&[
        "apply",
        "--base",
        s(&base),
        "--cow",
        s(&vectors().join("v2_lz4_4096.cow")),
        "-o",
        s(&out),
        "--label",
        "1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let img = std::fs::read(&out).unwrap();
    let expected = std::fs::read(vectors().join("expected.img")).unwrap();
    let basei = std::fs::read(&base).unwrap();
    let blk = |v: &[u8], b: usize| v[b * 4096..(b + 1) * 4096].to_vec();
    // Ordered ops (before label 1) applied; REPLACE/ZERO (after) not.
    for b in [10, 11, 12, 20, 200, 203] {
        assert_eq!(blk(&img, b), blk(&expected, b), "block {b}");
    }
    for b in [100, 118, 300] {
        assert_eq!(blk(&img, b), blk(&basei, b), "block {b}");
    }
    let o = run_vabc(&[
        "apply",
        "--base",
        s(&base),
        "--cow",
        s(&vectors().join("v2_lz4_4096.cow")),
        "-o",
        s(&out),
        "--label",
        "77",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("label 77 not found"));
}

#[test]
fn bad_input_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let base = vectors().join("base.img");
    let good = std::fs::read(vectors().join("v2_zstd_4096.cow")).unwrap();
    let out = dir.path().join("new.img");
    let check_fails = |cow: &Path, base: &Path, needle: &str| {
        let o = run_vabc(&["apply", "--base", s(base), "--cow", s(cow), "-o", s(&out)]);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success(), "should fail: {needle}");
        assert!(err.contains(needle), "expected {needle:?} in: {err}");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "in.cow" && n != "small.img")
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    };
    // Truncated COW: names the file and the offset.
    let cow = dir.path().join("in.cow");
    std::fs::write(&cow, &good[..good.len() - 100]).unwrap();
    check_fails(&cow, &base, "in.cow: offset");
    // Corrupt payload: fails while writing, the partial output is removed.
    let r = cow::CowReader::open(vectors().join("v2_zstd_4096.cow")).unwrap();
    let op = *r
        .ops()
        .iter()
        .find(|o| o.kind == cow::OpKind::Replace && o.data_length < 4096)
        .unwrap();
    let mut bad = good.clone();
    for b in &mut bad[op.data_offset as usize..][..op.data_length as usize] {
        *b ^= 0xa5;
    }
    std::fs::write(&cow, &bad).unwrap();
    check_fails(&cow, &base, "cannot decode zstd payload");
    // Base too small for the COW's sources.
    std::fs::write(&cow, &good).unwrap();
    let small = dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 8 * 4096]).unwrap();
    check_fails(&cow, &small, "wrong base image");
    // Missing base.
    check_fails(&cow, &dir.path().join("nope.img"), "nope.img");
    // Output over an input is refused.
    let o = run_vabc(&[
        "apply",
        "--base",
        s(&small),
        "--cow",
        s(&cow),
        "-o",
        s(&small),
    ]);
    assert!(!o.status.success());
}
