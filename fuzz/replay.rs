//! Shared by the tests that replay the fuzz corpora (`fuzz/corpus/TARGET`) in the normal
//! test run and regenerate their seeds. Each test includes it with
//! `#[path = "../../../fuzz/replay.rs"] mod replay;`, so no crate depends on another
//! for it.

#![allow(dead_code)]

use std::path::PathBuf;

/// The corpus directory of fuzz target `target`.
pub fn dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

/// Writes each seed as `seed_NAME` into `target`'s corpus.
pub fn write_seeds<N: std::fmt::Display>(
    target: &str,
    seeds: impl IntoIterator<Item = (N, Vec<u8>)>,
) {
    let dir = dir(target);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, data) in seeds {
        std::fs::write(dir.join(format!("seed_{name}")), data).unwrap();
    }
}

/// Every input of `target`'s corpus.
pub fn inputs(target: &str) -> Vec<Vec<u8>> {
    std::fs::read_dir(dir(target))
        .expect("fuzz corpus directory")
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect()
}
