//! Interop with AOSP: COW files written by Android's own libsnapshot_cow
//! (shared/aosp-cow-vectors, read in place) must read back to the expected
//! snapshot image byte for byte.

use std::fs::File;
use std::path::PathBuf;

use cow::{Codec, CowReader, OpKind, SnapshotView};
use sha2::{Digest, Sha256};

fn vectors() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/aosp-cow-vectors")
}

const EXPECTED_SHA: &str = "ff702c6cea81c675807b7ea9f450f96de01a30ecc8545b7c1d57dee750d98c2f";

fn cow_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(vectors())
        .expect("shared/aosp-cow-vectors must exist beside the project")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cow"))
        .collect();
    v.sort();
    assert!(
        v.len() >= 12,
        "expected the 12 AOSP vectors, found {}",
        v.len()
    );
    v
}

fn snapshot(cow: &CowReader) -> Vec<u8> {
    let base_path = vectors().join("base.img");
    let base = File::open(&base_path).unwrap();
    let view = SnapshotView::new(cow, &base, &base_path, None).unwrap();
    let mut out = vec![0u8; view.size() as usize];
    view.read_blocks(0, &mut out).unwrap();
    out
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_vector_reproduces_expected_image() {
    for path in cow_files() {
        let cow = CowReader::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let img = snapshot(&cow);
        assert_eq!(img.len(), 4 << 20, "{}", path.display());
        assert_eq!(
            hex(&Sha256::digest(&img)),
            EXPECTED_SHA,
            "{}",
            path.display()
        );
    }
}

#[test]
fn reading_in_odd_ranges_matches_whole_read() {
    let expected = std::fs::read(vectors().join("expected.img")).unwrap();
    for path in cow_files() {
        let cow = CowReader::open(&path).unwrap();
        let base_path = vectors().join("base.img");
        let base = File::open(&base_path).unwrap();
        let view = SnapshotView::new(&cow, &base, &base_path, None).unwrap();
        // Ranges that start and end inside multi-block REPLACE units.
        for (start, n) in [
            (101u64, 3usize),
            (115, 2),
            (117, 3),
            (199, 6),
            (0, 1),
            (1023, 1),
        ] {
            let mut buf = vec![0u8; n * 4096];
            view.read_blocks(start, &mut buf).unwrap();
            let s = start as usize * 4096;
            assert_eq!(
                buf,
                &expected[s..s + buf.len()],
                "{} at {start}",
                path.display()
            );
        }
    }
}

#[test]
fn op_counts_and_headers() {
    for path in cow_files() {
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let cow = CowReader::open(&path).unwrap();
        let h = cow.header();
        let count = |k: OpKind| cow.ops().iter().filter(|o| o.kind == k).count();
        assert_eq!(count(OpKind::Copy), 4, "{name}");
        assert_eq!(count(OpKind::Xor), 4, "{name}");
        assert_eq!(count(OpKind::Zero), 2, "{name}");
        let blocks: u32 = cow
            .ops()
            .iter()
            .filter(|o| o.kind == OpKind::Replace)
            .map(|o| o.blocks)
            .sum();
        assert_eq!(blocks, 19, "{name}");
        let seq = if name.contains("badseq") {
            vec![12, 11, 10, 20, 200, 201, 202, 203]
        } else {
            vec![10, 11, 12, 20, 200, 201, 202, 203]
        };
        assert_eq!(cow.sequence(), seq.as_slice(), "{name}");
        let codec = match name.split('_').nth(1).unwrap() {
            "none" => Codec::None,
            "gz" => Codec::Gz,
            "lz4" => Codec::Lz4,
            "zstd" => Codec::Zstd,
            "brotli" => Codec::Brotli,
            other => panic!("{other}"),
        };
        assert_eq!(cow.codec(), codec, "{name}");
        if name.starts_with("v3") {
            assert_eq!(h.major_version, 3);
            assert_eq!(h.header_size, 78);
            assert_eq!(h.op_count_max, 256);
            // AOSP stores 6 (never clamped); only the 4 newest points exist.
            assert_eq!(h.resume_point_count, 6);
            let labels: Vec<u64> = cow.labels().iter().map(|l| l.label).collect();
            assert_eq!(labels, vec![3, 4, 5, 6], "{name}");
            let factor: u32 = name
                .trim_end_matches(".cow")
                .rsplit('_')
                .next()
                .unwrap()
                .parse()
                .unwrap_or(4096);
            let expected_ops = match factor {
                4096 => 29,
                16384 => 16,
                _ => 13,
            };
            assert_eq!(cow.ops().len(), expected_ops, "{name}");
            assert_eq!(h.op_count as usize, expected_ops, "{name}");
        } else {
            assert_eq!(h.major_version, 2);
            assert_eq!(h.cluster_ops, 16);
            let f = cow.footer().expect("v2 footer");
            assert_eq!(f.num_ops, 38, "{name}");
            assert_eq!(f.ops_size, 760, "{name}");
            let labels: Vec<u64> = cow.labels().iter().map(|l| l.label).collect();
            assert_eq!(labels, vec![1, 2, 3, 4, 5, 6], "{name}");
        }
    }
}

#[test]
fn merge_order_valid_except_badseq() {
    for path in cow_files() {
        let cow = CowReader::open(&path).unwrap();
        let r = cow.verify_merge();
        if path.to_str().unwrap().contains("badseq") {
            let e = r.expect_err("badseq must be rejected").to_string();
            assert!(e.contains("merge order is unsafe"), "{e}");
        } else {
            r.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
}

/// The merge order must be AOSP's: the sequence, then the rest ascending.
#[test]
fn merge_order_derivation() {
    let cow = CowReader::open(vectors().join("v2_lz4_4096.cow")).unwrap();
    let order = cow.merge_order().unwrap();
    let blocks: Vec<u64> = order.iter().map(|&i| cow.ops()[i].new_block).collect();
    let mut expected = vec![10, 11, 12, 20, 200, 201, 202, 203];
    expected.extend(100..119);
    expected.extend([300, 301]);
    assert_eq!(blocks, expected);
}

/// An op-by-op in-place merge in merge order onto a copy of base gives the
/// expected image for every valid vector, and corrupts blocks 10-11 for the
/// bad sequence (which is why the validator must reject it).
#[test]
fn simulated_in_place_merge() {
    let base = std::fs::read(vectors().join("base.img")).unwrap();
    let expected = std::fs::read(vectors().join("expected.img")).unwrap();
    for path in cow_files() {
        let cow = CowReader::open(&path).unwrap();
        let mut img = base.clone();
        for i in cow.merge_order().unwrap() {
            let op = cow.ops()[i];
            let dst = op.new_block as usize * 4096;
            let mut data = vec![0u8; op.unit_size()];
            match op.kind {
                OpKind::Zero => {}
                OpKind::Copy => {
                    let s = op.source as usize * 4096;
                    data.copy_from_slice(&img[s..s + 4096]);
                }
                OpKind::Xor => {
                    cow.read_payload(&op, &mut data).unwrap();
                    let s = op.source as usize;
                    for (d, b) in data.iter_mut().zip(&img[s..s + 4096]) {
                        *d ^= b;
                    }
                }
                OpKind::Replace => cow.read_payload(&op, &mut data).unwrap(),
            }
            img[dst..dst + data.len()].copy_from_slice(&data);
        }
        if path.to_str().unwrap().contains("badseq") {
            assert_ne!(img, expected);
            assert_ne!(img[10 * 4096..12 * 4096], expected[10 * 4096..12 * 4096]);
        } else {
            assert!(img == expected, "{}", path.display());
        }
    }
}

/// AOSP's own backward-compatibility fixture `cow_v2`.
#[test]
fn aosp_testdata_cow_v2() {
    let cow = CowReader::open(vectors().join("aosp-testdata/cow_v2")).unwrap();
    let h = cow.header();
    assert_eq!((h.major_version, h.cluster_ops, h.num_merge_ops), (2, 5, 1));
    let ops: Vec<(OpKind, u64)> = cow.ops().iter().map(|o| (o.kind, o.new_block)).collect();
    let mut expected = vec![(OpKind::Copy, 0), (OpKind::Replace, 2), (OpKind::Xor, 50)];
    expected.extend((5..15).map(|b| (OpKind::Zero, b)));
    assert_eq!(ops, expected);
    assert_eq!(cow.ops()[0].source, 5);
    assert_eq!(cow.ops()[1].data_offset, 0x20008A);
    assert_eq!(cow.ops()[2].source, 98314);
    let labels: Vec<(u64, u64)> = cow
        .labels()
        .iter()
        .map(|l| (l.label, l.ops_before))
        .collect();
    assert_eq!(labels, vec![(1, 2), (2, 13)]);
    let f = cow.footer().unwrap();
    assert_eq!((f.offset, f.num_ops, f.ops_size), (0x20218E, 18, 360));
    assert_eq!(cow.file_size(), 0x2021E2);
    // Every payload decodes.
    for op in cow.ops().iter().filter(|o| o.data_length > 0) {
        let mut buf = vec![0u8; op.unit_size()];
        cow.read_payload(op, &mut buf).unwrap();
    }
}

/// Opening at a label keeps only what precedes it.
#[test]
fn open_at_label() {
    let v2 = CowReader::open_at_label(vectors().join("v2_zstd_4096.cow"), 1).unwrap();
    assert_eq!(v2.ops().len(), 8);
    assert!(v2.ops().iter().all(|o| o.kind.is_ordered()));
    let v3 = CowReader::open_at_label(vectors().join("v3_lz4_65536.cow"), 5).unwrap();
    assert_eq!(v3.ops().len(), 11); // 8 ordered + 16+2+1 REPLACE units
    assert!(CowReader::open_at_label(vectors().join("v3_lz4_65536.cow"), 1).is_err());
    let v2_6 = CowReader::open_at_label(vectors().join("v2_none_4096.cow"), 6).unwrap();
    assert_eq!(v2_6.ops().len(), 29);
}

/// Our lz4 encoder is liblz4's LZ4_compress_default, as AOSP's writer: re-encoding
/// each compressed lz4 payload of AOSP's vectors gives the stored bytes exactly.
#[test]
fn lz4_payloads_are_the_bytes_aosp_stores() {
    use std::os::unix::fs::FileExt;
    let mut compared = 0;
    for path in cow_files() {
        let cow = CowReader::open(&path).unwrap();
        if cow.codec() != Codec::Lz4 {
            continue;
        }
        let file = File::open(&path).unwrap();
        let mut enc = cow::codec::Encoder::new(cow::Compression::new(Codec::Lz4), 1 << 20);
        for op in cow.ops().iter().filter(|o| o.kind == OpKind::Replace) {
            let unit = op.unit_size();
            if op.data_length as usize >= unit {
                continue; // stored raw
            }
            let mut stored = vec![0u8; op.data_length as usize];
            file.read_exact_at(&mut stored, op.data_offset).unwrap();
            let mut data = vec![0u8; unit];
            cow.read_payload(op, &mut data).unwrap();
            assert!(
                enc.compress(&data).unwrap() == stored,
                "{}: REPLACE for block {} encodes differently",
                path.display(),
                op.new_block
            );
            compared += 1;
        }
    }
    assert!(
        compared > 0,
        "no compressed lz4 REPLACE payload in the vectors"
    );
}
