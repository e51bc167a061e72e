//! Helpers shared by the integration tests: the vector directory and its data.

#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;

pub fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/verity-vectors")
}

pub fn gunzip(path: &std::path::Path) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(f)
        .read_to_end(&mut out)
        .unwrap_or_else(|e| panic!("gunzip {}: {e}", path.display()));
    out
}

/// One of the stored data inputs, by its tag in the vector file names.
pub fn data_for_tag(tag: &str) -> Vec<u8> {
    let d = vectors_dir().join("data");
    match tag {
        "1blk" => gunzip(&d.join("data_1blk.bin.gz")),
        "128blk" => gunzip(&d.join("data_128blk.bin.gz")),
        "129blk" => gunzip(&d.join("data_129blk.bin.gz")),
        "1000blk+1234" => gunzip(&d.join("data_1000blk_plus1234.bin.gz")),
        "1000blk+1234-zeropad" => {
            let mut v = gunzip(&d.join("data_1000blk_plus1234.bin.gz"));
            v.resize(4_100_096, 0);
            v
        }
        "1MiB-bs512" | "1MiB-d4096-h512" => gunzip(&d.join("data_1MiB.bin.gz")),
        _ => panic!("unknown input tag {tag}"),
    }
}

/// The generator formula from the vectors' manifest, for data of any size.
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 7 + i / 4096) % 251) as u8).collect()
}

pub const SALT32: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
pub const UUID: &str = "01234567-89ab-4cde-8f01-23456789abcd";

pub fn salt256() -> Vec<u8> {
    (0..=255u8).rev().collect()
}
