//! Merge ordering of COPY/XOR ops, safe for an in-place merge op by op.
//!
//! The rule (AOSP `VerifyMergeOps`, spec §2.8): walking the merge order, an
//! op's source blocks — COPY: `src_block`; XOR: `src_offset / 4096`, plus the
//! next block when the offset is not 4 KiB-aligned — must not be the
//! destination of any earlier op; REPLACE and ZERO come after every ordered
//! op. So op A (reading block b) must merge before op B (writing b): an edge
//! A → B. The order is Kahn's topological sort with the free ops taken in
//! sweeps of ascending destination: the next op is the free one with the
//! lowest destination above the last op's, wrapping around to the lowest
//! when none is left above. Taking the globally lowest free op (AOSP's
//! generator) interleaves every block chain in the image, so each 510-op
//! merge window writes ~100 scattered runs and some op in it overwrites
//! another's source, which forces the merge's scratch copy for every
//! window. A sweep instead keeps moved regions together, and it passes
//! over (up to `HOLD_SCAN` ops) an op whose lower neighbour still waits,
//! so that runs are taken whole rather than block by block as they free
//! up. On the `system` ext4 pair (119 352 ordered ops): the lowest-first
//! order gave windows with 23 635 destination runs, none of them free of
//! overlap; the plain sweep 15 800 runs, with ~87 000 ops in overlap-free
//! windows, which the merge writes without the scratch copy (see the
//! `merge` crate); holding back runs, 10 300 runs (and 9 500 source runs
//! instead of 14 800), the same ops overlap-free. A cycle is broken by turning one of its ops into a
//! REPLACE, which merges last and so constrains nothing: the op chosen
//! has the most remaining edges (XOR preferred, as its REPLACE costs least
//! extra, then the lowest destination), found by walking predecessors
//! from the lowest pending op until a node repeats.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use crate::ops::{BlockOp, PlannedOp};

const NONE: u32 = u32::MAX;

/// How many free ops the sweep looks at for one that does not start a run
/// in its middle (bounds the ordering's cost at this many steps per op).
const HOLD_SCAN: usize = 256;

pub use crate::ops::source_blocks;

/// Turn into REPLACE every XOR that reads a block which another COPY/XOR op
/// rewrites more than `far` blocks away from the XOR's own destination
/// (`far` = 0: none). Returns how many. `ops` must be sorted by `dst`.
///
/// Why: XOR sources are chosen by similarity anywhere in the old image, and
/// each such read is an edge of the merge order (the reader must merge
/// before the block's writer). A few thousand long edges tie every region
/// of the image to every other, so the sweep cannot take a region whole:
/// on the `system` ext4 pair the merge windows wrote 11 000 destination runs
/// for destinations that form 15 runs over the image, with chains of
/// readers 1 331 ops deep. Cutting the XORs with sources rewritten more than
/// 4096 blocks away (2 159 of 58 000) costs their payloads' growth into
/// whole compressed blocks (+2.9% of the zstd:19 COW) and takes 41% off
/// the merge's I/O requests. Short edges (files shifted by a few blocks)
/// stay: the sweep and the scratch windows handle them. Off by default, as
/// size is what `vabc diff` optimises for.
pub fn replace_far_xors(ops: &mut [PlannedOp], far: u64) -> u64 {
    if far == 0 {
        return 0;
    }
    debug_assert!(ops.windows(2).all(|w| w[0].dst < w[1].dst));
    let rewritten: Vec<u64> = ops
        .iter()
        .filter(|o| matches!(o.op, BlockOp::Copy { .. } | BlockOp::Xor { .. }))
        .map(|o| o.dst)
        .collect();
    let mut n = 0;
    for o in ops.iter_mut() {
        if matches!(o.op, BlockOp::Xor { .. })
            && source_blocks(&o.op)
                .any(|b| b.abs_diff(o.dst) > far && rewritten.binary_search(&b).is_ok())
        {
            o.op = BlockOp::Replace;
            n += 1;
        }
    }
    n
}

/// Result of [`order_merge`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MergeOrder {
    /// Destination blocks of the ordered (COPY/XOR) ops, in merge order.
    pub sequence: Vec<u64>,
    /// Ordered ops turned into REPLACE to break dependency cycles.
    pub converted: u64,
}

/// Compute the merge sequence for `ops` (sorted by `dst`, one op per
/// block), turning cycle-breaking ops into [`BlockOp::Replace`] in place.
pub fn order_merge(ops: &mut [PlannedOp]) -> MergeOrder {
    debug_assert!(ops.windows(2).all(|w| w[0].dst < w[1].dst));
    // Nodes are the ordered ops, numbered in ascending dst order.
    let ord: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o.op, BlockOp::Copy { .. } | BlockOp::Xor { .. }))
        .map(|(i, _)| i)
        .collect();
    let n = ord.len();
    let dst = |node: usize| ops[ord[node]].dst;
    let Graph {
        succ,
        mut indeg,
        pred_start,
        pred,
    } = Graph::build(ops, &ord);

    #[derive(Clone, Copy, PartialEq, Eq)]
    enum State {
        Pending,
        Done,
        Removed,
    }
    let mut state = vec![State::Pending; n];
    // Free nodes (node order is destination order) and the last one taken.
    let mut free: BTreeSet<u32> = (0..n)
        .filter(|&i| indeg[i] == 0)
        .map(|i| i as u32)
        .collect();
    let mut last: Option<u32> = None;
    let mut sequence = Vec::with_capacity(n);
    let mut converted = 0u64;
    let mut done = 0usize;
    let mut scan = 0usize; // every node below `scan` is no longer pending
    let mut stamp = vec![0u32; n];
    let mut walk_id = 0u32;
    let mut path: Vec<u32> = Vec::new();

    let release = |a: usize, indeg: &mut [u32], free: &mut BTreeSet<u32>, state: &[State]| {
        for &b in succ[a].iter().filter(|&&b| b != NONE) {
            let b = b as usize;
            if state[b] == State::Pending {
                indeg[b] -= 1;
                if indeg[b] == 0 {
                    free.insert(b as u32);
                }
            }
        }
    };

    while done < n {
        // The sweep passes over an op whose lower neighbour (the op writing
        // the block below) is still waiting for a predecessor: taking it
        // now would start that run of destinations in its middle, and the
        // rest would land in a later window as a separate write (and read).
        let start = last.map_or(0, |l| l + 1);
        let held = |a: u32| {
            let a = a as usize;
            a > 0 && dst(a - 1) + 1 == dst(a) && state[a - 1] == State::Pending && indeg[a - 1] > 0
        };
        let next = free
            .range(start..)
            .chain(free.range(..start))
            .take(HOLD_SCAN)
            .find(|&&a| !held(a))
            .or_else(|| free.range(start..).next().or_else(|| free.first()));
        if let Some(&a) = next {
            free.remove(&a);
            last = Some(a);
            let a = a as usize;
            state[a] = State::Done;
            done += 1;
            sequence.push(dst(a));
            release(a, &mut indeg, &mut free, &state);
            continue;
        }
        // Stalled: every pending node has a pending predecessor, so walking
        // predecessors from any pending node must close a cycle.
        while state[scan] != State::Pending {
            scan += 1;
        }
        walk_id += 1;
        path.clear();
        let mut v = scan;
        let cycle_start = loop {
            stamp[v] = walk_id;
            path.push(v as u32);
            let lo = pred_start[v] as usize;
            let hi = pred_start[v + 1] as usize;
            let u = pred[lo..hi]
                .iter()
                .map(|&u| u as usize)
                .find(|&u| state[u] == State::Pending && u != v);
            let Some(u) = u else {
                // Unreachable while indeg is kept exact; stop the walk
                // rather than loop.
                break path.len() - 1;
            };
            if stamp[u] == walk_id {
                break path.iter().position(|&p| p as usize == u).unwrap_or(0);
            }
            v = u;
        };
        let victim = path[cycle_start..]
            .iter()
            .map(|&c| c as usize)
            .max_by_key(|&c| {
                let degree = indeg[c] as usize
                    + succ[c]
                        .iter()
                        .filter(|&&b| b != NONE && state[b as usize] == State::Pending)
                        .count();
                let is_xor = matches!(ops[ord[c]].op, BlockOp::Xor { .. });
                (degree, is_xor, Reverse(c))
            })
            .unwrap_or(scan);
        state[victim] = State::Removed;
        done += 1;
        converted += 1;
        release(victim, &mut indeg, &mut free, &state);
    }
    for (node, s) in state.iter().enumerate() {
        if *s == State::Removed {
            ops[ord[node]].op = BlockOp::Replace;
        }
    }
    MergeOrder {
        sequence,
        converted,
    }
}

/// The dependency graph of the ordered ops (nodes numbered in ascending dst order):
/// who must merge after whom, and the reverse, in compressed rows.
struct Graph {
    /// succ[a]: nodes that must merge after a (they overwrite a's sources).
    succ: Vec<[u32; 2]>,
    /// Pending predecessors of each node.
    indeg: Vec<u32>,
    /// pred[pred_start[b]..pred_start[b + 1]]: nodes that read b's destination.
    pred_start: Vec<u32>,
    pred: Vec<u32>,
}

impl Graph {
    fn build(ops: &[PlannedOp], ord: &[usize]) -> Graph {
        let n = ord.len();
        let node_of = |block: u64| -> Option<usize> {
            let k = ord.partition_point(|&i| ops[i].dst < block);
            (k < n && ops[ord[k]].dst == block).then_some(k)
        };
        // succ[a]: nodes that must merge after a (they overwrite a's sources).
        let mut succ = vec![[NONE; 2]; n];
        let mut indeg = vec![0u32; n];
        for (a, s) in succ.iter_mut().enumerate() {
            for (k, blk) in source_blocks(&ops[ord[a]].op).enumerate() {
                if let Some(b) = node_of(blk).filter(|&b| b != a) {
                    s[k] = b as u32;
                    indeg[b] += 1;
                }
            }
        }
        // pred[b]: nodes that read b's destination (CSR layout).
        let mut pred_start = vec![0u32; n + 1];
        for s in &succ {
            for &b in s.iter().filter(|&&b| b != NONE) {
                pred_start[b as usize + 1] += 1;
            }
        }
        for i in 0..n {
            pred_start[i + 1] += pred_start[i];
        }
        let mut fill = pred_start.clone();
        let mut pred = vec![0u32; pred_start[n] as usize];
        for (a, s) in succ.iter().enumerate() {
            for &b in s.iter().filter(|&&b| b != NONE) {
                pred[fill[b as usize] as usize] = a as u32;
                fill[b as usize] += 1;
            }
        }
        Graph {
            succ,
            indeg,
            pred_start,
            pred,
        }
    }
}

/// Check `sequence` against `ops` with AOSP's op-by-op rule: every
/// COPY/XOR op appears exactly once, and none reads a block written by an
/// op earlier in the order. REPLACE/ZERO ops are implicitly after them.
pub fn verify_order(ops: &[PlannedOp], sequence: &[u64]) -> Result<(), String> {
    let find = |block: u64| ops.binary_search_by_key(&block, |o| o.dst).ok();
    let ordered = ops
        .iter()
        .filter(|o| matches!(o.op, BlockOp::Copy { .. } | BlockOp::Xor { .. }))
        .count();
    if ordered != sequence.len() {
        return Err(format!(
            "{} ordered ops but {} sequence entries",
            ordered,
            sequence.len()
        ));
    }
    let mut written = vec![false; ops.len()];
    for (pos, &block) in sequence.iter().enumerate() {
        let i = find(block).ok_or_else(|| format!("position {pos}: block {block} has no op"))?;
        if !matches!(ops[i].op, BlockOp::Copy { .. } | BlockOp::Xor { .. }) {
            return Err(format!(
                "position {pos}: block {block} is not a COPY/XOR op"
            ));
        }
        if written[i] {
            return Err(format!("position {pos}: block {block} appears twice"));
        }
        for s in source_blocks(&ops[i].op) {
            if s != block && find(s).is_some_and(|j| written[j]) {
                return Err(format!(
                    "position {pos}: op for block {block} reads block {s}, already overwritten"
                ));
            }
        }
        written[i] = true;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(dst: u64, src: u64) -> PlannedOp {
        PlannedOp {
            dst,
            op: BlockOp::Copy { src_block: src },
        }
    }

    #[test]
    fn shift_up_is_ordered_descending() {
        // new[i] = old[i-1] for i in 1..=4: each op must run before the op
        // that overwrites its source, so from the top down.
        let mut ops: Vec<_> = (1..=4).map(|i| copy(i, i - 1)).collect();
        let r = order_merge(&mut ops);
        assert_eq!(r.sequence, vec![4, 3, 2, 1]);
        assert_eq!(r.converted, 0);
        verify_order(&ops, &r.sequence).unwrap();
    }

    #[test]
    fn shift_down_is_ordered_ascending() {
        let mut ops: Vec<_> = (0..4).map(|i| copy(i, i + 1)).collect();
        let r = order_merge(&mut ops);
        assert_eq!(r.sequence, vec![0, 1, 2, 3]);
        verify_order(&ops, &r.sequence).unwrap();
    }

    #[test]
    fn swap_breaks_one_op_per_cycle() {
        // Blocks 0..3 and 10..13 swapped: three 2-cycles.
        let mut ops = Vec::new();
        for i in 0..3 {
            ops.push(copy(i, 10 + i));
        }
        for i in 0..3 {
            ops.push(copy(10 + i, i));
        }
        let r = order_merge(&mut ops);
        assert_eq!(r.converted, 3);
        assert_eq!(r.sequence.len(), 3);
        verify_order(&ops, &r.sequence).unwrap();
    }

    #[test]
    fn rotation_cycle_converts_one() {
        // 0 <- 1 <- 2 <- 3 <- 0: one cycle of four.
        let mut ops: Vec<_> = (0..4).map(|i| copy(i, (i + 1) % 4)).collect();
        let r = order_merge(&mut ops);
        assert_eq!(r.converted, 1);
        verify_order(&ops, &r.sequence).unwrap();
    }

    #[test]
    fn unaligned_xor_reads_two_blocks() {
        // XOR for block 5 reads blocks 6 and 7; COPY 7 <- 9 must wait.
        let mut ops = vec![
            PlannedOp {
                dst: 5,
                op: BlockOp::Xor {
                    src_offset: 6 * 4096 + 100,
                },
            },
            copy(7, 9),
        ];
        let r = order_merge(&mut ops);
        assert_eq!(r.sequence, vec![5, 7]);
        assert!(verify_order(&ops, &[7, 5]).is_err());
    }

    fn xor(dst: u64, src_offset: u64) -> PlannedOp {
        PlannedOp {
            dst,
            op: BlockOp::Xor { src_offset },
        }
    }

    #[test]
    fn far_xors_become_replace() {
        let bs = 4096;
        let mut ops = vec![
            xor(10, 5000 * bs),     // reads block 5000, rewritten below: far
            xor(20, 30 * bs + 7),   // reads 30 and 31, rewritten: near
            xor(40, 9000 * bs),     // reads 9000, which nothing rewrites
            xor(50, 4090 * bs + 1), // reads 4090 and 4091; 4091 rewritten, 4041 away
            xor(60, 4100 * bs),     // exactly `far` blocks away: kept
            copy(5000, 7000),       // COPYs are never converted
            copy(4091, 1),
            copy(4100, 2),
            copy(30, 3),
        ];
        ops.sort_by_key(|o| o.dst);
        let before = ops.clone();
        assert_eq!(replace_far_xors(&mut ops, 0), 0);
        assert_eq!(ops, before, "far = 0 changes nothing");
        assert_eq!(replace_far_xors(&mut ops, 4040), 2);
        let kind = |d: u64| ops.iter().find(|o| o.dst == d).unwrap().op;
        assert_eq!(kind(10), BlockOp::Replace);
        assert_eq!(kind(50), BlockOp::Replace);
        for d in [20, 40, 60] {
            assert!(matches!(kind(d), BlockOp::Xor { .. }), "block {d}");
        }
        // The rest still orders and verifies (REPLACEs constrain nothing).
        let r = order_merge(&mut ops);
        verify_order(&ops, &r.sequence).unwrap();
        assert_eq!(r.sequence.len(), 7);
    }
}
