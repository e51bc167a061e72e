//! Op selection: one decision per 4 KiB block of NEW.
//!
//! NEW is streamed in fixed chunks of [`SCAN_CHUNK_BLOCKS`] blocks, planned in
//! parallel and concatenated in order. Everything a decision looks at — the
//! block, the OLD index, OLD regions read on demand, and a "continuation"
//! hint carried from the previous block *of the same chunk* — is independent
//! of scheduling, so the plan is identical for any thread count.
//!
//! Per block, first match wins:
//! 1. same bytes as the OLD block at the same offset: no op;
//! 2. all zero: ZERO;
//! 3. identical to an OLD block (hash index, bytes compared): COPY, preferring
//!    the block that continues the previous match;
//! 4. XOR candidates — the region continuing the previous match, the OLD
//!    offsets voted for by the block's anchors (top [`MAX_VOTED`]), and the
//!    same-offset block — that share at least 1 KiB of equal bytes are
//!    scored by the estimated size of their XOR payload (the [`Estimator`]);
//!    the smallest becomes an XOR when it is at most `xor_max_percent`% of
//!    the estimated size of the block itself;
//! 5. otherwise REPLACE.

use rayon::prelude::*;

use crate::error::{DeltaError, Result};
use crate::image::BlockImage;
use crate::index::{GEAR_WINDOW, OldIndex, SCAN_CHUNK_BLOCKS, anchors, block_hash, is_zero};
use crate::lone::replace_lone_xors;
use crate::order::{MergeOrder, order_merge, replace_far_xors};
use crate::{BLOCK_SIZE, Progress};

/// Default number of voted anchor offsets evaluated per block.
pub const MAX_VOTED: usize = 8;
/// COPY candidates with an equal hash whose bytes are compared.
const MAX_COPY_PROBES: usize = 8;
/// A candidate region sharing fewer equal bytes than this is not
/// compressed for comparison: its XOR cannot beat REPLACE by a clear margin.
const MIN_EQUAL_BYTES: usize = 1024;

pub use crate::ops::{BlockOp, PlannedOp};

/// Tuning of op selection.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Consider XOR ops (`--no-xor` turns them off: COPY/ZERO/REPLACE only).
    pub xor: bool,
    /// Worker threads; 0 = one per CPU. Does not change the result.
    pub threads: usize,
    /// Anchor density 2^-bits (0 disables anchors; XOR then only tries the
    /// same offset and the continuation of the previous match).
    pub anchor_bits: u32,
    /// An XOR is chosen when est(xor) ≤ this percentage of est(block).
    pub xor_max_percent: u32,
    /// Anchor-voted OLD offsets evaluated per block.
    pub voted_candidates: usize,
    /// How XOR and REPLACE sizes are estimated for that comparison.
    pub estimator: Estimator,
    /// An XOR reading a block that another COPY/XOR op rewrites more than
    /// this many blocks from its own destination is stored as a REPLACE
    /// instead; 0 (the default) keeps every XOR. A trade of COW size for
    /// merge speed, see [`crate::order::replace_far_xors`]: on the `system`
    /// ext4 pair 4096 makes the COW 2.9% larger (zstd:19; lz4 4.9%) and its
    /// merge issue 41% fewer requests and run ~10% faster.
    pub far_xor_blocks: u64,
    /// XORs whose OLD sources make a run shorter than this many blocks
    /// that nothing but XORs read are stored as REPLACE; 0 (the default)
    /// keeps every XOR. A trade of COW size for fewer small reads of OLD
    /// when serving and merging, see [`crate::lone`].
    pub min_xor_run: u64,
}

/// Codec used to estimate the stored size of one block, as XOR payload
/// and as REPLACE data, when choosing between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Estimator {
    Lz4,
    /// zstd at this level: entropy coding sees that an XOR payload of
    /// scattered small differences (recompiled code) is cheap, which lz4
    /// cannot.
    Zstd(i32),
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            xor: true,
            threads: 0,
            anchor_bits: 6,
            xor_max_percent: ZSTD_XOR_MAX_PERCENT,
            voted_candidates: MAX_VOTED,
            estimator: Estimator::Zstd(1),
            far_xor_blocks: 0,
            min_xor_run: 0,
        }
    }
}

/// XOR/REPLACE threshold with zstd estimates. A REPLACE block is stored in
/// a multi-block unit that compresses better than the block alone, an XOR
/// payload on its own, so an XOR must win clearly: on the `system` ext4
/// pair (zstd:19 COW) 70 / 78 / 85 / 92% gave 44.70 / 44.63 / 44.68 /
/// 44.84 MB.
pub const ZSTD_XOR_MAX_PERCENT: u32 = 78;
/// XOR/REPLACE threshold with lz4 estimates (lz4 COWs): on `tiny` ext4,
/// 50 / 70 / 85 / 95% gave 3.85 / 3.74 / 3.70 / 3.69 MB.
pub const LZ4_XOR_MAX_PERCENT: u32 = 85;

impl PlanOptions {
    /// The defaults for a COW written with `codec`: its estimator and the
    /// XOR/REPLACE threshold measured for it.
    pub fn for_codec(codec: cow::Codec) -> PlanOptions {
        let estimator = Estimator::for_codec(codec);
        PlanOptions {
            estimator,
            xor_max_percent: match estimator {
                Estimator::Lz4 => LZ4_XOR_MAX_PERCENT,
                Estimator::Zstd(_) => ZSTD_XOR_MAX_PERCENT,
            },
            ..PlanOptions::default()
        }
    }
}

/// Blocks per kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub unchanged: u64,
    pub zero: u64,
    pub copy: u64,
    pub xor: u64,
    pub replace: u64,
    /// COPY/XOR ops turned into REPLACE to break merge-order cycles
    /// (included in `replace`).
    pub cycle_breaks: u64,
    /// XORs turned into REPLACE because their source is rewritten far away
    /// (included in `replace`; see [`PlanOptions::far_xor_blocks`]).
    pub far_xors: u64,
    /// XORs turned into REPLACE because their source is a lone read of OLD
    /// (included in `replace`; see [`PlanOptions::min_xor_run`]).
    pub lone_xors: u64,
}

/// A complete plan: ops for every block that changes, and the merge order.
#[derive(Clone, Debug)]
pub struct Plan {
    pub old_size: u64,
    pub new_size: u64,
    /// Ascending by `dst`, at most one per block; unchanged blocks have none.
    pub ops: Vec<PlannedOp>,
    /// Destinations of the COPY/XOR ops in a merge order that is safe op by
    /// op; REPLACE and ZERO follow it. Always `order::order_merge(ops)`'s, so that
    /// whoever has the ops can compute it.
    pub sequence: Vec<u64>,
    pub census: Census,
    /// Heap bytes of the OLD index while planning.
    pub index_bytes: usize,
    /// REPLACE blocks that had a COPY or XOR source before it was given up (to break a
    /// merge-order cycle, or as a far or lone XOR): (block, OLD byte offset), ascending
    /// by block. A COW does not need them; the update bundle compresses such a block
    /// against its old source.
    pub hints: Vec<(u64, u64)>,
}

impl Plan {
    pub fn new_blocks(&self) -> u64 {
        self.new_size / BLOCK_SIZE as u64
    }
}

/// Run `f` on a pool of `threads` workers (0 = rayon's default).
pub(crate) fn with_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> Result<T> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| DeltaError::Threads {
            threads,
            msg: e.to_string(),
        })?;
    Ok(pool.install(f))
}

/// Plan the update from `old` to `new`.
pub fn plan(
    old: &dyn BlockImage,
    new: &dyn BlockImage,
    opts: &PlanOptions,
    progress: &dyn Progress,
) -> Result<Plan> {
    with_pool(opts.threads, || plan_in_pool(old, new, opts, progress))?
}

fn plan_in_pool(
    old: &dyn BlockImage,
    new: &dyn BlockImage,
    opts: &PlanOptions,
    progress: &dyn Progress,
) -> Result<Plan> {
    let anchor_bits = if opts.xor {
        opts.anchor_bits.min(32)
    } else {
        0
    };
    let index = OldIndex::build(old, anchor_bits, progress)?;
    let n_new = new.size() / BLOCK_SIZE as u64;
    let chunks = n_new.div_ceil(SCAN_CHUNK_BLOCKS);
    progress.start("planning", n_new);
    let parts: Vec<Vec<PlannedOp>> = (0..chunks)
        .into_par_iter()
        .map(|c| {
            let r = ChunkPlanner {
                old,
                new,
                index: &index,
                opts,
            }
            .run(c);
            progress.advance(SCAN_CHUNK_BLOCKS.min(n_new - c * SCAN_CHUNK_BLOCKS));
            r
        })
        .collect::<Result<_>>()?;
    progress.finish();
    let mut ops: Vec<PlannedOp> = parts.into_iter().flatten().collect();
    // Where each block was found in OLD before some sources are given up below.
    let found: Vec<(u64, u64)> = ops
        .iter()
        .filter_map(|o| match o.op {
            BlockOp::Copy { src_block } => Some((o.dst, src_block * BLOCK_SIZE as u64)),
            BlockOp::Xor { src_offset } => Some((o.dst, src_offset)),
            BlockOp::Zero | BlockOp::Replace => None,
        })
        .collect();
    let lone_xors = replace_lone_xors(&mut ops, n_new, opts.min_xor_run);
    let far_xors = replace_far_xors(&mut ops, opts.far_xor_blocks);
    let MergeOrder {
        mut sequence,
        converted,
    } = order_merge(&mut ops);
    if converted > 0 {
        // The order of the final (acyclic) ops, not the one found while breaking the
        // cycles: the sequence is then a function of `ops` alone, which the device
        // recomputes instead of receiving it (the update bundle's plan).
        let again = order_merge(&mut ops);
        debug_assert_eq!(again.converted, 0, "cycles left after breaking them");
        sequence = again.sequence;
    }
    let mut census = Census {
        cycle_breaks: converted,
        far_xors,
        lone_xors,
        ..Census::default()
    };
    for o in &ops {
        match o.op {
            BlockOp::Copy { .. } => census.copy += 1,
            BlockOp::Xor { .. } => census.xor += 1,
            BlockOp::Zero => census.zero += 1,
            BlockOp::Replace => census.replace += 1,
        }
    }
    census.unchanged = n_new - ops.len() as u64;
    let hints = ops
        .iter()
        .filter(|o| o.op == BlockOp::Replace)
        .filter_map(|o| {
            let i = found.binary_search_by_key(&o.dst, |f| f.0).ok()?;
            Some(found[i])
        })
        .collect();
    Ok(Plan {
        old_size: old.size(),
        new_size: new.size(),
        ops,
        sequence,
        census,
        index_bytes: index.memory_bytes(),
        hints,
    })
}

struct ChunkPlanner<'a> {
    old: &'a dyn BlockImage,
    new: &'a dyn BlockImage,
    index: &'a OldIndex,
    opts: &'a PlanOptions,
}

/// Scratch buffers of one chunk.
struct Scratch {
    region: Vec<u8>,
    xor: Vec<u8>,
    lz4: Vec<u8>,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    votes: Vec<(u64, u32)>,
    offsets: Vec<u64>,
}

impl Estimator {
    /// The estimator for a COW written with `codec`: lz4 itself for lz4;
    /// for the entropy-coding codecs (gz, zstd, brotli) zstd level 1, a
    /// fast stand-in that, unlike lz4, sees how cheap a sparse XOR payload
    /// is. On the `system` ext4 pair the zstd estimator makes the zstd COW
    /// 0.2% smaller; with an lz4 COW it would make it up to 0.25% larger.
    pub fn for_codec(codec: cow::Codec) -> Estimator {
        match codec {
            cow::Codec::Lz4 => Estimator::Lz4,
            _ => Estimator::Zstd(1),
        }
    }
}

impl Scratch {
    /// Estimated stored size of `data` (one block).
    fn estimate(&mut self, est: Estimator, data: &[u8]) -> usize {
        match est {
            Estimator::Lz4 => lz4_len(data, &mut self.lz4),
            Estimator::Zstd(level) => {
                if self.zstd.is_none() {
                    self.zstd = zstd::bulk::Compressor::new(level).ok();
                }
                // `lz4` is sized for the worst case of a 4 KiB block, which
                // also bounds zstd's output; a failure means "incompressible".
                self.zstd
                    .as_mut()
                    .and_then(|c| c.compress_to_buffer(data, &mut self.lz4[..]).ok())
                    .unwrap_or(data.len())
                    .min(data.len())
            }
        }
    }
}

impl ChunkPlanner<'_> {
    fn run(&self, chunk: u64) -> Result<Vec<PlannedOp>> {
        let bs = BLOCK_SIZE as u64;
        let n_new = self.new.size() / bs;
        let n_old = self.old.size() / bs;
        let first = chunk * SCAN_CHUNK_BLOCKS;
        let n = SCAN_CHUNK_BLOCKS.min(n_new - first) as usize;
        // NEW with up to 64 bytes before the chunk, so anchors near the
        // chunk start see the same window as in a continuous scan.
        let pre = if first == 0 { 0 } else { GEAR_WINDOW };
        let mut newbuf = vec![0u8; pre + n * BLOCK_SIZE];
        self.new.read_at(&mut newbuf, first * bs - pre as u64)?;
        let same_n = n_old.saturating_sub(first).min(n as u64) as usize;
        let mut oldbuf = vec![0u8; same_n * BLOCK_SIZE];
        if same_n > 0 {
            self.old.read_at(&mut oldbuf, first * bs)?;
        }
        let mut scratch = Scratch {
            region: vec![0u8; BLOCK_SIZE],
            xor: vec![0u8; BLOCK_SIZE],
            lz4: vec![0u8; lz4_bound()],
            zstd: None,
            votes: Vec::new(),
            offsets: Vec::new(),
        };
        let mut out = Vec::new();
        // OLD byte offset minus NEW byte offset of the last match, so the
        // next block tries the region that continues it.
        let mut delta: Option<i128> = None;
        for k in 0..n {
            let dst = first + k as u64;
            let blk = &newbuf[pre + k * BLOCK_SIZE..pre + (k + 1) * BLOCK_SIZE];
            if k < same_n && blk == &oldbuf[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE] {
                delta = Some(0);
                continue;
            }
            if is_zero(blk) {
                out.push(PlannedOp {
                    dst,
                    op: BlockOp::Zero,
                });
                continue;
            }
            if let Some(src) = self.find_copy(dst, blk, delta, &mut scratch.region)? {
                delta = Some(i128::from(src) * i128::from(bs) - i128::from(dst * bs));
                out.push(PlannedOp {
                    dst,
                    op: BlockOp::Copy { src_block: src },
                });
                continue;
            }
            if self.opts.xor {
                let window = &newbuf[(pre + k * BLOCK_SIZE).saturating_sub(GEAR_WINDOW)
                    ..pre + (k + 1) * BLOCK_SIZE];
                if let Some(src_offset) = self.find_xor(dst, blk, window, delta, &mut scratch)? {
                    delta = Some(i128::from(src_offset) - i128::from(dst * bs));
                    out.push(PlannedOp {
                        dst,
                        op: BlockOp::Xor { src_offset },
                    });
                    continue;
                }
            }
            out.push(PlannedOp {
                dst,
                op: BlockOp::Replace,
            });
        }
        Ok(out)
    }

    fn find_copy(
        &self,
        dst: u64,
        blk: &[u8],
        delta: Option<i128>,
        buf: &mut [u8],
    ) -> Result<Option<u64>> {
        let bs = BLOCK_SIZE as i128;
        let hash = block_hash(blk);
        let preferred = delta
            .filter(|d| d % bs == 0)
            .map(|d| i128::from(dst) + d / bs)
            .and_then(|b| u64::try_from(b).ok());
        let mut probes = 0;
        if let Some(p) = preferred
            && self.index.blocks_with_hash(hash).any(|b| b == p)
        {
            probes += 1;
            self.old.read_at(buf, p * BLOCK_SIZE as u64)?;
            if buf == blk {
                return Ok(Some(p));
            }
        }
        for b in self.index.blocks_with_hash(hash) {
            if Some(b) == preferred {
                continue;
            }
            if probes >= MAX_COPY_PROBES {
                break;
            }
            probes += 1;
            self.old.read_at(buf, b * BLOCK_SIZE as u64)?;
            if buf == blk {
                return Ok(Some(b));
            }
        }
        Ok(None)
    }

    /// `window` is the block preceded by up to [`GEAR_WINDOW`] bytes of NEW.
    fn find_xor(
        &self,
        dst: u64,
        blk: &[u8],
        window: &[u8],
        delta: Option<i128>,
        s: &mut Scratch,
    ) -> Result<Option<u64>> {
        let bs = BLOCK_SIZE as u64;
        let old_size = self.old.size();
        if old_size < bs {
            return Ok(None);
        }
        let max_src = old_size - bs;
        let here = dst * bs;
        let mut cands: Vec<u64> = Vec::with_capacity(2 + self.opts.voted_candidates);
        let push = |c: i128, cands: &mut Vec<u64>| {
            if let Ok(c) = u64::try_from(c)
                && c <= max_src
                && !cands.contains(&c)
            {
                cands.push(c);
            }
        };
        if let Some(d) = delta {
            push(i128::from(here) + d, &mut cands);
        }
        if self.index.anchor_bits() > 0 {
            s.votes.clear();
            s.offsets.clear();
            let warm = window.len() - BLOCK_SIZE;
            let index = self.index;
            let offsets = &mut s.offsets;
            anchors(window, warm, self.index.anchor_bits(), |h, i| {
                let rel = (i - warm) as u64; // anchor position inside the block
                offsets.extend(
                    index
                        .anchor_positions(h)
                        .filter_map(|p| p.checked_sub(rel).filter(|&c| c <= max_src)),
                );
            });
            // Count votes per offset by sorting: a block may see thousands.
            s.offsets.sort_unstable();
            for &c in &s.offsets {
                match s.votes.last_mut() {
                    Some(v) if v.0 == c => v.1 += 1,
                    _ => s.votes.push((c, 1)),
                }
            }
            // Most votes first; ties by offset so the result is stable.
            s.votes
                .sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            for &(c, _) in s.votes.iter().take(self.opts.voted_candidates) {
                push(i128::from(c), &mut cands);
            }
        }
        if here <= max_src {
            push(i128::from(here), &mut cands);
        }
        // Each candidate sharing enough bytes is scored by the estimated
        // size of its XOR payload: the most equal bytes is not always the
        // most compressible difference.
        let est = self.opts.estimator;
        let mut best: Option<(usize, u64)> = None;
        for &c in &cands {
            self.old.read_at(&mut s.region, c)?;
            let equal = blk.iter().zip(&s.region).filter(|(a, b)| a == b).count();
            if equal < MIN_EQUAL_BYTES {
                continue;
            }
            for ((x, a), b) in s.xor.iter_mut().zip(blk).zip(&s.region) {
                *x = a ^ b;
            }
            let xor = std::mem::take(&mut s.xor);
            let len = s.estimate(est, &xor);
            s.xor = xor;
            if best.is_none_or(|(l, _)| len < l) {
                best = Some((len, c));
            }
        }
        let Some((xor_len, src)) = best else {
            return Ok(None);
        };
        let rep_len = s.estimate(est, blk);
        let xor_ok =
            (xor_len as u64) * 100 <= (rep_len as u64) * u64::from(self.opts.xor_max_percent);
        Ok(xor_ok.then_some(src))
    }
}

/// Room for any block's lz4 encoding (liblz4's bound for one block).
fn lz4_bound() -> usize {
    lz4::block::compress_bound(BLOCK_SIZE).unwrap_or(2 * BLOCK_SIZE)
}

/// The size of `data` compressed the way the COW writer compresses lz4 payloads.
fn lz4_len(data: &[u8], out: &mut [u8]) -> usize {
    // The output buffer holds liblz4's bound, so this cannot fail; if it ever did,
    // "incompressible" is the safe answer.
    let mode = Some(lz4::block::CompressionMode::DEFAULT);
    lz4::block::compress_to_buffer(data, mode, false, out).unwrap_or(data.len())
}
