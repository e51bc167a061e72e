//! Turning a [`Plan`] into a COW file through the `cow` crate's writer.
//!
//! Order of work: check the merge order with the format crate's validator
//! (nothing is written for an unsafe plan); write into a temporary file in
//! the output's directory — label 0, the ops with a label every
//! [`LABEL_EVERY_BLOCKS`] blocks, the end-of-install label, finalize; reopen
//! it with the reader and check that the ops and the merge order read back
//! as planned; sync, rename over the output, sync the directory. Any error
//! leaves no output behind (the temporary file is removed on drop).
//!
//! Where the merge order lives: a v3 COW gets its ops **in merge order**
//! (COPY/XOR as sequenced, then REPLACE/ZERO ascending) and no sequence
//! data, since a v3 reader merges a COW without sequence data in stream
//! order (spec §2.8 rule 3, what AOSP's `create_snapshot` writes): 4 bytes
//! less per ordered op (0.48 MB on the `system` pair). A v2 reader would
//! sort the REPLACE/ZERO ops but otherwise does the same, yet v2 COWs keep
//! the sequence data and ascending ops that update_engine writes.
//!
//! [`CowOptions::block_order`] writes a v3 COW the v2 way instead: ops
//! (and so their payloads) ascending by block, the merge order as
//! sequence data. Merge order scatters a region's XOR payloads over the
//! COW, wherever the sweep took each run: on the `system` ext4 pair (lz4)
//! reading the image in order before the merge read the COW's data in
//! 2 101 pieces per pass over its 237 changed 2 MiB chunks, where block
//! order reads one per chunk. The sequence costs 0.50 MB there (+0.7% of
//! the lz4 COW, +1.1% of the zstd:19 one), and the merge, which reads the
//! data window by window in merge order, took 5-34% longer (run medians);
//! so it is an option, worth it with [`crate::lone`] for images read cold
//! before the merge.

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use cow::{Codec, Compression, CowReader, CowWriter, Op, OpKind, WriterOptions};

use crate::error::{DeltaError, Result};
use crate::image::BlockImage;
use crate::plan::{BlockOp, Plan, PlannedOp};
use crate::{BLOCK_SIZE, Progress};

/// A resume label (update_engine's checkpoint) every this many blocks
/// written (64 MiB): each costs a header rewrite and an fsync.
pub const LABEL_EVERY_BLOCKS: u64 = 16384;
/// update_engine's `kEndOfInstallLabel`.
pub const END_OF_INSTALL_LABEL: u64 = 1 << 48;
/// Blocks handed to the writer per REPLACE/XOR call: bounds the buffer
/// (4 MiB) and is a multiple of every compression factor, so runs split
/// into the largest units the factor allows.
const RUN_BLOCKS: u64 = 1024;

/// COW format options.
#[derive(Clone, Debug)]
pub struct CowOptions {
    /// 2 or 3.
    pub version: u16,
    pub compression: Compression,
    /// Largest REPLACE unit in bytes, 4 KiB..256 KiB (v3).
    pub compression_factor: u32,
    /// Compression threads (0 = one per CPU). Output does not depend on it.
    pub threads: usize,
    /// v3: ops ascending by block with the merge order as sequence data
    /// (4 bytes more per COPY/XOR op), instead of ops in merge order. v2
    /// COWs are always written this way.
    pub block_order: bool,
}

/// Payload bytes stored per op kind, and the file size.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WriteReport {
    pub cow_size: u64,
    pub ops: u64,
    pub replace_ops: u64,
    pub replace_bytes: u64,
    pub xor_bytes: u64,
    pub seconds: f64,
}

fn kind_of(op: &BlockOp) -> OpKind {
    match op {
        BlockOp::Copy { .. } => OpKind::Copy,
        BlockOp::Xor { .. } => OpKind::Xor,
        BlockOp::Zero => OpKind::Zero,
        BlockOp::Replace => OpKind::Replace,
    }
}

fn source_of(op: &BlockOp) -> u64 {
    match *op {
        BlockOp::Copy { src_block } => src_block,
        BlockOp::Xor { src_offset } => src_offset,
        BlockOp::Zero | BlockOp::Replace => 0,
    }
}

/// The plan's ops in the order the device will merge them: the sequence,
/// then REPLACE/ZERO ascending, as the reader derives it.
fn in_merge_order(plan: &Plan) -> impl Iterator<Item = &PlannedOp> {
    let find = |b: u64| plan.ops.binary_search_by_key(&b, |o| o.dst).ok();
    plan.sequence
        .iter()
        .filter_map(move |&b| find(b).map(|i| &plan.ops[i]))
        .chain(
            plan.ops
                .iter()
                .filter(|p| matches!(p.op, BlockOp::Replace | BlockOp::Zero)),
        )
}

/// The plan's ops in merge order (see `in_merge_order`), as format ops.
pub fn merge_ops(plan: &Plan) -> Vec<Op> {
    in_merge_order(plan)
        .map(|p| Op {
            kind: kind_of(&p.op),
            new_block: p.dst,
            source: source_of(&p.op),
            blocks: 1,
            data_offset: 0,
            data_length: 0,
        })
        .collect()
}

/// Highest zstd level worth spending on XOR payloads. They are compressed
/// 4 KiB at a time, where zstd's slowest strategies (levels 16-22) gain
/// little: on the `system` ext4 pair, XOR payloads at level 15 instead of
/// 19 add 0.15% to the COW (44 123 179 against 44 058 240 bytes) and take
/// 30% off the whole diff's CPU time (141 s instead of 202 s).
pub const XOR_MAX_ZSTD_LEVEL: i32 = 15;

/// The level for XOR payloads: zstd's capped at [`XOR_MAX_ZSTD_LEVEL`],
/// other codecs' unchanged.
fn xor_level(c: Compression) -> Option<i32> {
    (c.codec == Codec::Zstd && c.level() > XOR_MAX_ZSTD_LEVEL).then_some(XOR_MAX_ZSTD_LEVEL)
}

/// Number of REPLACE ops the writer makes of a run of `blocks` blocks:
/// greedy power-of-two units of at most `factor_blocks` (spec §2.6).
fn units(mut blocks: u64, factor_blocks: u64) -> u64 {
    let mut n = 0;
    while blocks > 0 {
        let mut u = factor_blocks;
        while u > blocks {
            u /= 2;
        }
        blocks -= u;
        n += 1;
    }
    n
}

/// Maximal runs of consecutive ops that one writer call can take.
fn runs(ops: &[PlannedOp]) -> impl Iterator<Item = &[PlannedOp]> {
    let mut rest = ops;
    std::iter::from_fn(move || {
        let first = rest.first()?;
        let mut n = 1;
        while n < rest.len() && (n as u64) < RUN_BLOCKS {
            let prev = &rest[n - 1];
            let cur = &rest[n];
            let joins = cur.dst == prev.dst + 1
                && match (prev.op, cur.op) {
                    (BlockOp::Copy { src_block: a }, BlockOp::Copy { src_block: b }) => b == a + 1,
                    (BlockOp::Xor { src_offset: a }, BlockOp::Xor { src_offset: b }) => {
                        b == a + BLOCK_SIZE as u64
                    }
                    (BlockOp::Zero, BlockOp::Zero) | (BlockOp::Replace, BlockOp::Replace) => true,
                    _ => false,
                };
            if !joins {
                break;
            }
            n += 1;
        }
        let _ = first;
        let (run, tail) = rest.split_at(n);
        rest = tail;
        Some(run)
    })
}

/// Write `plan` as a COW at `out`.
pub fn write_cow(
    plan: &Plan,
    old: &dyn BlockImage,
    new: &dyn BlockImage,
    out: &Path,
    opts: &CowOptions,
    progress: &dyn Progress,
) -> Result<WriteReport> {
    let t0 = Instant::now();
    let ordered = merge_ops(plan);
    cow::merge::verify_order(ordered.iter()).map_err(|e| DeltaError::UnsafeOrder(e.to_string()))?;

    let factor_blocks =
        u64::from(opts.compression_factor.max(BLOCK_SIZE as u32)) / BLOCK_SIZE as u64;
    let factor_blocks = if opts.version >= 3 { factor_blocks } else { 1 };
    let mut op_count = 0u64;
    for run in runs(&plan.ops) {
        op_count += match run[0].op {
            BlockOp::Replace => units(run.len() as u64, factor_blocks),
            _ => run.len() as u64,
        };
    }

    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = progress.make_temp(&dir, &name).map_err(|source| {
        DeltaError::Io(vabc_io::Error::new(
            "create a temporary file in",
            &dir,
            source,
        ))
    })?;
    let tmp_path = tmp.path().to_path_buf();

    let wopts = WriterOptions {
        version: opts.version,
        compression: opts.compression,
        xor_level: xor_level(opts.compression),
        compression_factor: opts.compression_factor,
        op_count_max: op_count.max(1),
        threads: opts.threads,
        max_blocks: Some(plan.new_blocks()),
        ..WriterOptions::default()
    };
    let mut w = CowWriter::create(&tmp_path, wopts)?;
    let merge_ordered = opts.version >= 3 && !opts.block_order;
    // The ops in the order they are written.
    let stream: Cow<'_, [PlannedOp]> = if merge_ordered {
        Cow::Owned(in_merge_order(plan).copied().collect())
    } else {
        let seq: Vec<u32> = plan
            .sequence
            .iter()
            .map(|&b| u32::try_from(b))
            .collect::<Result<_, _>>()
            .map_err(|_| DeltaError::TooLarge {
                path: new.name().to_path_buf(),
                blocks: plan.new_blocks(),
            })?;
        if !seq.is_empty() {
            w.add_sequence(&seq)?;
        }
        Cow::Borrowed(&plan.ops)
    };
    w.add_label(0)?;

    progress.start("writing", plan.ops.len() as u64);
    let bs = BLOCK_SIZE as u64;
    let mut data = Vec::new();
    let mut src = Vec::new();
    // Labels count the blocks written so far: increasing in either order.
    let mut written = 0u64;
    let mut next_label = LABEL_EVERY_BLOCKS;
    for run in runs(&stream) {
        let dst = run[0].dst;
        if written >= next_label {
            w.add_label(written)?;
            next_label = (written / LABEL_EVERY_BLOCKS + 1) * LABEL_EVERY_BLOCKS;
        }
        let n = run.len() as u64;
        written += n;
        match run[0].op {
            BlockOp::Copy { src_block } => w.add_copy(dst, src_block, n)?,
            BlockOp::Zero => w.add_zero_blocks(dst, n)?,
            BlockOp::Replace => {
                data.resize(run.len() * BLOCK_SIZE, 0);
                new.read_at(&mut data, dst * bs)?;
                w.add_raw_blocks(dst, &data)?;
            }
            BlockOp::Xor { src_offset } => {
                data.resize(run.len() * BLOCK_SIZE, 0);
                src.resize(run.len() * BLOCK_SIZE, 0);
                new.read_at(&mut data, dst * bs)?;
                old.read_at(&mut src, src_offset)?;
                for (d, s) in data.iter_mut().zip(&src) {
                    *d ^= s;
                }
                // The offset is below 4096 by construction.
                w.add_xor_blocks(dst, &data, src_offset / bs, (src_offset % bs) as u16)?;
            }
        }
        progress.advance(n);
    }
    w.add_label(END_OF_INSTALL_LABEL)?;
    w.finalize()?;
    progress.finish();

    let report = verify_written(&tmp_path, plan, &ordered)?;
    let file = tmp.persist(out).map_err(|e| {
        DeltaError::Io(vabc_io::Error::new(
            "rename the finished COW to",
            out,
            e.error,
        ))
    })?;
    file.sync_all()
        .map_err(|source| DeltaError::Io(vabc_io::Error::new("sync", out, source)))?;
    if let Ok(d) = File::open(&dir) {
        // Makes the rename durable; a directory that cannot be opened for
        // reading is not worth failing a finished COW for.
        let _ = d.sync_all();
    }
    Ok(WriteReport {
        seconds: t0.elapsed().as_secs_f64(),
        ..report
    })
}

/// Reopen the COW and check it holds exactly the planned ops in the planned
/// merge order.
fn verify_written(path: &Path, plan: &Plan, ordered: &[Op]) -> Result<WriteReport> {
    let r = CowReader::open(path)?;
    r.verify_merge()?;
    let fail = |msg: String| DeltaError::Verify {
        path: path.to_path_buf(),
        msg,
    };
    let mut report = WriteReport {
        cow_size: r.file_size(),
        ops: r.ops().len() as u64,
        ..WriteReport::default()
    };
    let mut covered = 0u64;
    for op in r.ops() {
        covered += u64::from(op.blocks);
        match op.kind {
            OpKind::Replace => {
                report.replace_ops += 1;
                report.replace_bytes += u64::from(op.data_length);
            }
            OpKind::Xor => report.xor_bytes += u64::from(op.data_length),
            OpKind::Copy | OpKind::Zero => {}
        }
    }
    if covered != plan.ops.len() as u64 {
        return Err(fail(format!(
            "ops cover {covered} blocks, the plan has {}",
            plan.ops.len()
        )));
    }
    let order = r.merge_order()?;
    let ops = r.ops();
    let seq_len = plan.sequence.len();
    if order.len() < seq_len {
        return Err(fail(format!(
            "merge order has {} ops, the plan orders {seq_len}",
            order.len()
        )));
    }
    for (pos, (&i, want)) in order.iter().zip(&ordered[..seq_len]).enumerate() {
        let got = &ops[i];
        if (got.kind, got.new_block, got.source) != (want.kind, want.new_block, want.source) {
            return Err(fail(format!(
                "merge position {pos}: read {got:?}, planned {want:?}"
            )));
        }
    }
    for &i in &order[seq_len..] {
        let got = &ops[i];
        for b in got.new_block..got.end_block() {
            let planned = plan
                .ops
                .binary_search_by_key(&b, |o| o.dst)
                .ok()
                .map(|k| kind_of(&plan.ops[k].op));
            if planned != Some(got.kind) {
                return Err(fail(format!(
                    "block {b}: read a {} op, planned {planned:?}",
                    got.kind
                )));
            }
        }
    }
    Ok(report)
}
