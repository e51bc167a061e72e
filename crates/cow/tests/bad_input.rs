//! Bad input: truncated, corrupt and impossible COW files give errors that
//! name the file and the offset, never a panic. Also replays the fuzz corpus
//! (fuzz/corpus/cow_reader) through the fuzz target's body.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use std::path::Path;

use cow::{Codec, Compression, CowReader, CowWriter, WriterOptions};

/// Small COWs (no scratch area) covering every layout and codec: the seed
/// corpus of the fuzz target.
fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    let cases: &[(u16, Codec, u32, u32)] = &[
        (2, Codec::None, 4, 4096),
        (2, Codec::Gz, 3, 4096),
        (2, Codec::Lz4, 0, 4096),
        (2, Codec::Zstd, 16, 4096),
        (2, Codec::Brotli, 5, 4096),
        (3, Codec::None, 0, 4096),
        (3, Codec::Lz4, 0, 16384),
        (3, Codec::Zstd, 0, 65536),
        (3, Codec::Gz, 0, 8192),
        (3, Codec::Brotli, 0, 4096),
        // v3 with sequence data (`vabc diff --block-order`): ops by block.
        (3, Codec::Lz4, 1, 16384),
    ];
    for &(version, codec, cluster, factor) in cases {
        // A v3 "cluster" of 1 stands for "with sequence data": v3 has no clusters.
        let (name, cluster, sequence) = if version >= 3 && cluster != 0 {
            (format!("v{version}_{codec}_seq_f{factor}.cow"), 0, true)
        } else {
            (
                format!("v{version}_{codec}_c{cluster}_f{factor}.cow"),
                cluster,
                cluster != 0,
            )
        };
        let p = dir.path().join(&name);
        let mut w = CowWriter::create(
            &p,
            WriterOptions {
                version,
                compression: Compression { codec, level: None },
                xor_level: None,
                compression_factor: factor,
                cluster_ops: cluster,
                op_count_max: 32,
                scratch_size: 0,
                threads: 1,
                max_blocks: None,
            },
        )
        .unwrap();
        if sequence {
            w.add_sequence(&[3, 2, 9]).unwrap();
        }
        w.add_copy(3, 4, 1).unwrap();
        w.add_copy(2, 3, 1).unwrap();
        let x: Vec<u8> = (0..4096).map(|i| (i % 7) as u8).collect();
        w.add_xor_blocks(9, &x, 1, 10).unwrap();
        w.add_label(1).unwrap();
        let data: Vec<u8> = (0..5 * 4096).map(|i| ((i / 100) % 256) as u8).collect();
        w.add_raw_blocks(20, &data).unwrap();
        w.add_label(2).unwrap();
        w.add_zero_blocks(30, 2).unwrap();
        w.finalize().unwrap();
        out.push((name, std::fs::read(&p).unwrap()));
    }
    out
}

/// Regenerate the seed corpus: `cargo test -p vabc-cow --test bad_input -- --ignored`.
#[test]
#[ignore]
fn generate_seed_corpus() {
    replay::write_seeds("cow_reader", seeds());
}

#[test]
fn replay_fuzz_corpus() {
    let inputs = replay::inputs("cow_reader");
    for data in &inputs {
        cow::fuzzing::exercise_reader(data);
    }
    let n = inputs.len();
    assert!(n >= 10, "fuzz corpus has only {n} inputs");
}

fn open_bytes(data: &[u8]) -> Result<CowReader, String> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.cow");
    std::fs::write(&p, data).unwrap();
    CowReader::open(&p).map_err(|e| e.to_string())
}

fn assert_names_file_and_offset(msg: &str) {
    assert!(
        msg.contains("bad.cow"),
        "error does not name the file: {msg}"
    );
    assert!(
        msg.contains("offset"),
        "error does not name an offset: {msg}"
    );
}

/// Every truncation of every seed is either a clean error naming the file
/// and offset, or (for a cut inside trailing data) still a valid file.
#[test]
fn every_truncation_is_a_clean_error() {
    for (name, data) in seeds() {
        for len in (0..data.len()).step_by(7).chain([data.len() - 1]) {
            match open_bytes(&data[..len]) {
                Err(msg) => assert_names_file_and_offset(&msg),
                Ok(r) => {
                    // A v3 file cut inside its payload must fail when read.
                    for op in r.ops() {
                        assert!(
                            op.data_offset + u64::from(op.data_length) <= len as u64,
                            "{name}@{len}"
                        );
                    }
                }
            }
            cow::fuzzing::exercise_reader(&data[..len]);
        }
    }
}

#[test]
fn bad_magic_and_versions() {
    let (_, good) = seeds().remove(0);
    let mut d = good.clone();
    d[0] = b'X';
    let e = open_bytes(&d).unwrap_err();
    assert!(e.contains("bad magic"), "{e}");
    assert_names_file_and_offset(&e);
    let mut d = good.clone();
    d[8] = 9; // major version
    assert!(open_bytes(&d).unwrap_err().contains("major version 9"));
    let mut d = good.clone();
    d[18..22].copy_from_slice(&512u32.to_le_bytes());
    assert!(open_bytes(&d).unwrap_err().contains("block size 512"));
    let mut d = good.clone();
    d[22..26].copy_from_slice(&1u32.to_le_bytes());
    assert!(open_bytes(&d).unwrap_err().contains("cluster_ops 1"));
}

#[test]
fn impossible_v3_sizes() {
    let seeds = seeds();
    let (_, v3) = seeds
        .iter()
        .find(|(n, _)| n.starts_with("v3_none"))
        .unwrap();
    // op_count_max so large the op array would overflow.
    let mut d = v3.clone();
    d[62..70].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = open_bytes(&d).unwrap_err();
    assert_names_file_and_offset(&e);
    // op_count larger than the file can hold.
    let mut d = v3.clone();
    d[54..62].copy_from_slice(&(1u64 << 40).to_le_bytes());
    d[62..70].copy_from_slice(&(1u64 << 41).to_le_bytes());
    let e = open_bytes(&d).unwrap_err();
    assert_names_file_and_offset(&e);
    // A sequence count beyond the file.
    let mut d = v3.clone();
    d[38..46].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert_names_file_and_offset(&open_bytes(&d).unwrap_err());
    // Bad max_compression_size.
    let mut d = v3.clone();
    d[74..78].copy_from_slice(&5000u32.to_le_bytes());
    assert!(open_bytes(&d).unwrap_err().contains("max_compression_size"));
}

#[test]
fn corrupt_payload_is_a_decode_error() {
    for (name, data) in seeds() {
        if name.contains("none") {
            continue;
        }
        let r = open_bytes(&data).unwrap();
        let op = *r
            .ops()
            .iter()
            .find(|o| o.kind == cow::OpKind::Replace && o.data_length < o.unit_size() as u32)
            .unwrap_or_else(|| panic!("{name}"));
        let mut d = data.clone();
        let at = op.data_offset as usize;
        for b in &mut d[at..at + op.data_length as usize] {
            *b = !*b;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.cow");
        std::fs::write(&p, &d).unwrap();
        let r = CowReader::open(&p).unwrap();
        let mut buf = vec![0u8; op.unit_size()];
        let e = r.read_payload(&op, &mut buf).unwrap_err().to_string();
        assert_names_file_and_offset(&e);
        assert!(e.contains("cannot decode"), "{name}: {e}");
    }
}

#[test]
fn out_of_range_ops_and_offsets() {
    let seeds = seeds();
    // v2: a REPLACE whose absolute data offset lies past EOF.
    let (_, v2) = seeds
        .iter()
        .find(|(n, _)| n.starts_with("v2_none_c4"))
        .unwrap();
    let r = open_bytes(v2).unwrap();
    let rep = r
        .ops()
        .iter()
        .find(|o| o.kind == cow::OpKind::Replace)
        .unwrap();
    // Find its record: the 20-byte record whose source equals the data offset.
    let needle = rep.data_offset.to_le_bytes();
    let pos = v2.windows(8).position(|w| w == needle).unwrap();
    let mut d = v2.clone();
    d[pos..pos + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let e = open_bytes(&d).unwrap_err();
    assert!(e.contains("past the end"), "{e}");
    assert_names_file_and_offset(&e);
    // A new block beyond 32 bits.
    let mut d = v2.clone();
    d[pos - 8..pos].copy_from_slice(&(1u64 << 33).to_le_bytes());
    let e = open_bytes(&d).unwrap_err();
    assert!(e.contains("32 bits"), "{e}");
    // v3: reserved bits set.
    let (_, v3) = seeds
        .iter()
        .find(|(n, _)| n.starts_with("v3_none"))
        .unwrap();
    let r = open_bytes(v3).unwrap();
    let op_start = r.data_start() as usize - 32 * 16;
    let mut d = v3.clone();
    d[op_start + 14] |= 0x01; // bit 48 of source_info
    assert!(open_bytes(&d).unwrap_err().contains("reserved"));
    // v3: unknown op type.
    let mut d = v3.clone();
    d[op_start + 15] = 0xf0;
    assert!(open_bytes(&d).unwrap_err().contains("op type 15"));
}

#[test]
fn writer_rejects_misuse() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.cow");
    let opts = WriterOptions {
        op_count_max: 4,
        ..Default::default()
    };
    let mut w = CowWriter::create(&p, opts.clone()).unwrap();
    w.add_zero_blocks(1, 2).unwrap();
    assert!(
        w.add_copy(1, 5, 1)
            .unwrap_err()
            .to_string()
            .contains("already has an op")
    );
    assert!(w.add_sequence(&[1]).is_err());
    assert!(w.add_raw_blocks(9, &[0u8; 100]).is_err());
    assert!(w.add_xor_blocks(9, &[0u8; 4096], 1, 4096).is_err());
    w.add_zero_blocks(3, 2).unwrap();
    assert!(
        w.add_zero_blocks(7, 1)
            .unwrap_err()
            .to_string()
            .contains("op_count_max")
    );
    // v3 without any op_count_max.
    let e = CowWriter::create(&p, WriterOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("op_count_max"), "{e}");
    // v2 unclustered cannot carry sequence data.
    let mut w = CowWriter::create(
        &p,
        WriterOptions {
            version: 2,
            cluster_ops: 0,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(w.add_sequence(&[1]).is_err());
    let bad_factor = WriterOptions {
        compression_factor: 12288,
        op_count_max: 4,
        ..Default::default()
    };
    assert!(CowWriter::create(&p, bad_factor).is_err());
    let _ = Path::new("unused");
}
