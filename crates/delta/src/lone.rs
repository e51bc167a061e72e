//! XORs whose sources are short lone reads of OLD, stored as REPLACE on
//! request.
//!
//! Reading the new image in order (serving it before the merge, or the
//! merge's windows of consecutive ops) reads OLD at the blocks its
//! neighbours come from: an unchanged block at its own offset, a COPY at
//! its source, an XOR at the one or two blocks under its byte offset. Most
//! of these reads fall into long runs. An XOR whose source is an isolated
//! match somewhere else in OLD makes a request of its own, 4-8 KiB, and
//! such requests are most of a cold sequential read's requests: on the
//! `system` ext4 pair (lz4 COW), of 3 064 OLD runs per pass over the image
//! 1 630 were two blocks long, 1 604 of them the source of a single XOR at
//! a byte offset. The disk serves that mix at ~0.6 of its rate for whole
//! 1 MiB reads. Without any XOR (`vabc diff --no-xor`) the same daemon
//! reads at 0.85 of it, but the COW is 2.2× as large. Storing as REPLACE
//! only the XORs whose sources make short runs that nothing else reads
//! removes most of those requests for a fraction of that size.
//!
//! Measured on that pair (`bench/results/serve.md`), with
//! `min_run` 64: 4 553 of 60 888 XORs become REPLACE in the lz4 COW
//! (+6.4%; 3 396 in the zstd:19 COW, +3.9%, which takes it from 1.287 to
//! 1.337 times xdelta3 -9's patch, over the create target of 1.3: hence
//! off by default). The merge issues 11 900 requests instead of 27 700
//! and takes 0.57-0.81 s instead of 0.90-1.05 s. Cold sequential serving
//! gains less (0.64-0.67 of loop-on-raw at QD1 against 0.51-0.63 in the
//! same runs) until the COW's data is also stored by block
//! (`CowOptions::block_order`): then 0.59-0.81 at both queue depths,
//! against 0.42-0.63 for the default COW. 16 and 128 lie on either side
//! (lz4 +4.9% and +7.5%); 256 (+10.5%) serves no faster than 64. Above
//! about twice [`NEIGHBOURHOOD_BLOCKS`] no run can be seen whole, so whole
//! XOR runs go too: 1024 converts 37 570 XORs (+82%).

use crate::ops::{BlockOp, PlannedOp, source_blocks};

/// NEW blocks on either side of an XOR whose OLD reads count as its
/// neighbours: 1 MiB each way, the size of a sequential read request and
/// half the serving engine's readahead chunk.
pub const NEIGHBOURHOOD_BLOCKS: u64 = 256;

/// OLD reads at most this many blocks apart are one run: the serving
/// engine reads through holes of up to 32 KiB rather than split a request.
pub const READ_THROUGH_BLOCKS: u64 = 8;

/// The OLD blocks that reading NEW block `dst` touches, given its op: an
/// op's sources ([`source_blocks`]), or for an unchanged block (`None`)
/// the block itself.
fn old_reads(dst: u64, op: Option<BlockOp>) -> impl Iterator<Item = u64> {
    let unchanged = op.is_none().then_some(dst);
    unchanged
        .into_iter()
        .chain(op.into_iter().flat_map(|o| source_blocks(&o)))
}

/// Turn into REPLACE every XOR whose OLD source lies in a short run that
/// only XORs read: the OLD blocks read for the NEW blocks within
/// [`NEIGHBOURHOOD_BLOCKS`] of it, joined into runs across holes of up to
/// [`READ_THROUGH_BLOCKS`], give its source a run that spans fewer than
/// `min_run` blocks and holds no COPY source or unchanged block
/// (`min_run` = 0: none). Returns how many. `ops` must be sorted by `dst`,
/// one per block, all below `new_blocks`; blocks without an op are
/// unchanged. The decisions are all taken on the plan as given, so they do
/// not depend on the order they are made in.
pub fn replace_lone_xors(ops: &mut [PlannedOp], new_blocks: u64, min_run: u64) -> u64 {
    if min_run == 0 || new_blocks == 0 {
        return 0;
    }
    debug_assert!(ops.windows(2).all(|w| w[0].dst < w[1].dst));
    // A run that reaches past this distance from the source spans at least
    // `min_run` blocks, so reads farther away cannot change the verdict.
    let reach = min_run.saturating_add(READ_THROUGH_BLOCKS + 1);
    let mut lone = Vec::new();
    // (OLD block, read by an XOR): the reads near one XOR's source.
    let mut near: Vec<(u64, bool)> = Vec::new();
    for (i, o) in ops.iter().enumerate() {
        if !matches!(o.op, BlockOp::Xor { .. }) {
            continue;
        }
        let mut src = source_blocks(&o.op);
        let Some(s0) = src.next() else { continue };
        let s1 = src.next().unwrap_or(s0);
        let near_range = s0.saturating_sub(reach)..=s1.saturating_add(reach);
        let lo = o.dst.saturating_sub(NEIGHBOURHOOD_BLOCKS);
        let hi = o
            .dst
            .saturating_add(NEIGHBOURHOOD_BLOCKS)
            .min(new_blocks - 1);
        near.clear();
        let mut k = ops.partition_point(|x| x.dst < lo);
        for n in lo..=hi {
            let op = (k < ops.len() && ops[k].dst == n).then(|| ops[k].op);
            k += usize::from(op.is_some());
            let xor = matches!(op, Some(BlockOp::Xor { .. }));
            near.extend(
                old_reads(n, op)
                    .filter(|b| near_range.contains(b))
                    .map(|b| (b, xor)),
            );
        }
        near.sort_unstable();
        // The run through s0: extend down, then up, across short holes.
        let at = near.partition_point(|&(b, _)| b < s0);
        let (mut start, mut end, mut only_xor) = (s0, s1, true);
        for &(b, xor) in near[..at].iter().rev() {
            if b + READ_THROUGH_BLOCKS + 1 < start {
                break;
            }
            start = start.min(b);
            only_xor &= xor;
        }
        for &(b, xor) in &near[at..] {
            if b > end.saturating_add(READ_THROUGH_BLOCKS + 1) {
                break;
            }
            end = end.max(b);
            only_xor &= xor;
        }
        if only_xor && end - start + 1 < min_run {
            lone.push(i);
        }
    }
    for &i in &lone {
        ops[i].op = BlockOp::Replace;
    }
    lone.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u64 = crate::BLOCK_SIZE as u64;

    fn op(dst: u64, op: BlockOp) -> PlannedOp {
        PlannedOp { dst, op }
    }
    fn xor(dst: u64, src_offset: u64) -> PlannedOp {
        op(dst, BlockOp::Xor { src_offset })
    }
    fn copy(dst: u64, src_block: u64) -> PlannedOp {
        op(dst, BlockOp::Copy { src_block })
    }

    fn xors(ops: &[PlannedOp]) -> Vec<u64> {
        ops.iter()
            .filter(|o| matches!(o.op, BlockOp::Xor { .. }))
            .map(|o| o.dst)
            .collect()
    }

    #[test]
    fn min_run_zero_changes_nothing() {
        let mut ops = vec![xor(10, 90_000 * BS + 5), copy(11, 7)];
        let before = ops.clone();
        assert_eq!(replace_lone_xors(&mut ops, 1000, 0), 0);
        assert_eq!(ops, before);
    }

    #[test]
    fn which_xors_are_lone() {
        // NEW has 4000 blocks; blocks without an op are unchanged.
        let mut ops = vec![
            // COPYs from 5000-5003; an XOR reading 5012-5013 joins their
            // run across a hole of 8 blocks: a run a COPY reads, kept.
            copy(100, 5000),
            copy(101, 5001),
            copy(102, 5002),
            copy(103, 5003),
            xor(104, 5012 * BS + 100),
            // Source 70 000, nothing read anywhere near it: a 1-block run.
            xor(105, 70_000 * BS),
            // Sources next to each other, 300 NEW blocks apart: each is
            // outside the other's neighbourhood, so each is a 1-block run.
            xor(400, 80_000 * BS),
            xor(700, 80_001 * BS),
            // Three XORs 100 blocks apart in NEW whose sources make one
            // run of 90 000-90 010 (11 blocks, holes of 4): lone below 12.
            xor(900, 90_000 * BS),
            xor(1000, 90_005 * BS),
            xor(1100, 90_009 * BS + 1),
            // Source block 1300 is next to unchanged NEW block 1301, which
            // reads OLD 1301 at its own offset: kept.
            xor(1299, 1300 * BS),
            copy(1300, 60_000),
            // Source 1758: the unchanged blocks near it (1761 on) lie more
            // than 256 NEW blocks away, and 1744 more than 8 below: a
            // 1-block run.
            xor(1500, 1758 * BS),
        ];
        for d in 1745..=1760 {
            ops.push(op(d, BlockOp::Replace));
        }
        ops.sort_by_key(|o| o.dst);
        let mut at3 = ops.clone();
        assert_eq!(replace_lone_xors(&mut at3, 4000, 3), 4);
        assert_eq!(xors(&at3), vec![104, 900, 1000, 1100, 1299]);
        let mut at11 = ops.clone();
        assert_eq!(replace_lone_xors(&mut at11, 4000, 11), 4);
        let mut at12 = ops.clone();
        assert_eq!(replace_lone_xors(&mut at12, 4000, 12), 7);
        assert_eq!(xors(&at12), vec![104, 1299]);
        // A hole of 9 blocks splits the run: 104's source is then alone.
        let mut far = ops.clone();
        far[4] = xor(104, 5013 * BS);
        assert_eq!(far[4].dst, 104);
        assert_eq!(replace_lone_xors(&mut far, 4000, 3), 5);
    }

    #[test]
    fn any_min_run_is_safe() {
        // `--min-xor-run` takes any number: the largest converts every XOR
        // that no COPY or unchanged block joins, without overflowing.
        let mut ops = vec![copy(3, 100), xor(4, 101 * BS + 9), xor(9, 7_000 * BS)];
        assert_eq!(replace_lone_xors(&mut ops, 20, u64::MAX), 1);
        assert_eq!(xors(&ops), vec![4]);
    }

    #[test]
    fn unchanged_blocks_past_the_end_of_new_do_not_count() {
        // NEW has 50 blocks; the source 60 is in OLD only.
        let mut ops = vec![xor(40, 60 * BS)];
        assert_eq!(replace_lone_xors(&mut ops, 50, 4), 1);
        let mut ops = vec![xor(40, 48 * BS)];
        assert_eq!(replace_lone_xors(&mut ops, 50, 4), 0);
    }
}
