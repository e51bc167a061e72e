//! Large requests take the batched path (sorted, merged source reads through io_uring or
//! the I/O pool, COW payloads fetched in runs). A synthetic update shaped like a real one
//! (single-block COPYs with shuffled sources, XORs at unaligned byte offsets, multi-block
//! REPLACE units, ZERO, an unaligned base tail) must read back byte for byte, at any
//! alignment, with and without O_DIRECT, in far fewer reads than blocks.

use std::path::Path;
use std::sync::atomic::Ordering;

use cow::{CowWriter, WriterOptions};
use engine::{AlignedBuf, BlockDevice, CowEngine, CowEngineOptions, EngineError};

const BS: usize = 4096;
const BLOCKS: usize = 2048;
const TAIL: usize = 1000;

/// Writes base.img and update.cow into `dir`; returns the expected new image.
fn make_update(dir: &Path) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(0x1234_5678_9abc_def1);
    let mut base = vec![0u8; BLOCKS * BS + TAIL];
    rng.fill(&mut base);
    std::fs::write(dir.join("base.img"), &base).unwrap();
    let mut new = base.clone();
    let opts = WriterOptions {
        max_blocks: Some(BLOCKS as u64),
        ..Default::default()
    };
    let mut w = CowWriter::create(dir.join("update.cow"), opts).unwrap();
    // Blocks 0..1536: sources are blocks 256..1792 shuffled inside windows of 64 blocks
    // (files moved and rewritten), every third one an XOR at an odd byte offset.
    let mut sources: Vec<usize> = (256..1792).collect();
    for chunk in sources.chunks_mut(64) {
        for i in (1..chunk.len()).rev() {
            let j = (rng.u64(..) % (i as u64 + 1)) as usize;
            chunk.swap(i, j);
        }
    }
    for (b, &src) in sources.iter().enumerate() {
        let dst = b * BS..(b + 1) * BS;
        if b % 3 == 1 {
            let off = (b * 13) % BS;
            let s = src * BS + off;
            rng.fill(&mut new[dst.clone()]);
            let xored: Vec<u8> = new[dst]
                .iter()
                .zip(&base[s..s + BS])
                .map(|(n, o)| n ^ o)
                .collect();
            w.add_xor_blocks(b as u64, &xored, src as u64, off as u16)
                .unwrap();
        } else {
            new.copy_within(src * BS..(src + 1) * BS, dst.start);
            w.add_copy(b as u64, src as u64, 1).unwrap();
        }
    }
    // 1536..1700 REPLACE (64 KiB units, last one partial), 1700..1750 ZERO, rest unchanged.
    let r = 1536 * BS..1700 * BS;
    for (i, chunk) in new[r.clone()].chunks_mut(BS).enumerate() {
        // Compressible halves so both stored forms (compressed and raw) occur.
        if i % 2 == 0 {
            chunk.fill(i as u8);
        } else {
            rng.fill(chunk);
        }
    }
    w.add_raw_blocks(1536, &new[r]).unwrap();
    new[1700 * BS..1750 * BS].fill(0);
    w.add_zero_blocks(1700, 50).unwrap();
    // XORs near the end whose sources reach into the unaligned tail: the merged run of a
    // request there ends at the end of the file, not at a block boundary.
    for (b, off) in [
        (2030usize, 500usize),
        (2032, 700),
        (2034, 900),
        (2036, 1000),
    ] {
        let s = (BLOCKS - 1) * BS + off;
        let dst = b * BS..(b + 1) * BS;
        rng.fill(&mut new[dst.clone()]);
        let xored: Vec<u8> = new[dst]
            .iter()
            .zip(&base[s..s + BS])
            .map(|(n, o)| n ^ o)
            .collect();
        w.add_xor_blocks(b as u64, &xored, BLOCKS as u64 - 1, off as u16)
            .unwrap();
    }
    w.finalize().unwrap();
    new
}

fn open(dir: &Path, direct: bool) -> CowEngine {
    CowEngine::open(
        &dir.join("base.img"),
        &dir.join("update.cow"),
        &CowEngineOptions {
            direct_io: direct,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn large_reads_match_at_any_alignment() {
    let dir = tempfile::tempdir().unwrap();
    let want = make_update(dir.path());
    for direct in [true, false] {
        let e = open(dir.path(), direct);
        assert_eq!(e.size(), want.len() as u64);
        // Sequential 1 MiB requests into page-aligned memory, like the FUSE workers.
        let mut buf = AlignedBuf::new(1 << 20);
        let mut off = 0usize;
        while off < want.len() {
            let n = (1usize << 20).min(want.len() - off);
            let out = buf.slice_mut(n);
            e.read_at(out, off as u64).unwrap();
            assert!(
                out == &want[off..off + n],
                "direct={direct}: 1 MiB at {off}"
            );
            off += n;
        }
        // The end of the image, from aligned and unaligned starts.
        for start in [2030 * BS, 2029 * BS + 5] {
            let n = want.len() - start;
            let out = buf.slice_mut(n);
            e.read_at(out, start as u64).unwrap();
            assert!(out == &want[start..], "direct={direct}: tail from {start}");
        }
        // Unaligned offsets, lengths and memory.
        let mut rng = fastrand::Rng::with_seed(77);
        let mut v = vec![0u8; (1 << 20) + 1];
        for _ in 0..60 {
            let off = (rng.u64(..) % want.len() as u64) as usize;
            let len = ((rng.u64(..) % (600 << 10)) as usize + 1).min(want.len() - off);
            let out = &mut v[1..1 + len];
            e.read_at(out, off as u64).unwrap();
            assert!(
                out == &want[off..off + len],
                "direct={direct}: {len} bytes at {off}"
            );
        }
    }
}

#[test]
fn shuffled_sources_are_read_in_few_runs() {
    let dir = tempfile::tempdir().unwrap();
    let want = make_update(dir.path());
    let e = open(dir.path(), true);
    let mut buf = AlignedBuf::new(1 << 20);
    let out = buf.slice_mut(1 << 20);
    e.read_at(out, 0).unwrap();
    assert!(out == &want[..1 << 20]);
    // 256 blocks from 4 windows of 64 shuffled source blocks: a few runs, not 256 reads.
    let reads = e.stats().base_reads.load(Ordering::Relaxed);
    assert!(reads <= 4, "{reads} base reads for one 1 MiB request");
}

#[test]
fn a_failing_batched_read_names_the_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    make_update(dir.path());
    let e = open(dir.path(), true);
    // The base shrinks under the open engine: the batched read hits end of file.
    let base = dir.path().join("base.img");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&base)
        .unwrap()
        .set_len(300 * BS as u64)
        .unwrap();
    let mut buf = AlignedBuf::new(1 << 20);
    let err = e.read_at(buf.slice_mut(1 << 20), 0).unwrap_err();
    match &err {
        EngineError::Io(vabc_io::Error {
            path,
            offset: Some(offset),
            ..
        }) => {
            assert_eq!(path, &base);
            // The sources of blocks 0..256 are base blocks 256..512.
            assert!((256 * BS as u64..300 * BS as u64).contains(offset), "{err}");
            assert!(err.to_string().contains(&offset.to_string()), "{err}");
        }
        other => panic!("unexpected error {other}"),
    }
    assert!(err.to_string().contains("base.img"), "{err}");
}
