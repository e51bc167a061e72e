//! Merge order: how AOSP derives it from a COW (`CowReader::PrepMergeOps`),
//! and the op-by-op safety check (`VerifyMergeOps`), §2.8 of the spec.
//!
//! `num_merge_ops` in the header is an index into this order, so the
//! derivation must match AOSP's exactly for a merge started by one
//! implementation to be resumed by the other.

use crate::error::MergeOrderError;
use crate::format::Op;

/// Derive the merge order: indices into `ops` (stream order).
///
/// 1. With sequence data (v2 or v3): the sequence, then every other op
///    sorted ascending by new block.
/// 2. v1/v2 without sequence: COPY/XOR in stream order, then REPLACE/ZERO
///    sorted ascending.
/// 3. v3 without sequence: stream order.
///
/// Blocks resolve to the *first* op with that new block, like snapuserd.
pub fn merge_order(
    major_version: u16,
    ops: &[Op],
    sequence: &[u32],
) -> Result<Vec<usize>, MergeOrderError> {
    if !sequence.is_empty() {
        // (new block, first op with it), sorted by block: a lookup table
        // that costs one sort, where a hash map costs a hash per lookup
        // (this runs before every merge and every served boot).
        let first = first_by_block(ops.iter().enumerate().map(|(i, o)| (o.new_block, i)));
        let find = |b: u64| first.binary_search_by_key(&b, |e| e.0).ok();
        let mut order = Vec::with_capacity(ops.len());
        let mut in_seq = vec![false; first.len()];
        for (index, &b) in sequence.iter().enumerate() {
            let b = u64::from(b);
            let k = find(b).ok_or(MergeOrderError::MissingSequenceOp {
                index,
                new_block: b,
            })?;
            order.push(first[k].1);
            in_seq[k] = true;
        }
        // Every op's block is in `first`, so the lookups cannot miss.
        let mut rest: Vec<(u64, usize)> = ops
            .iter()
            .filter_map(|o| find(o.new_block).map(|k| (o.new_block, k)))
            .filter(|&(_, k)| !in_seq[k])
            .collect();
        rest.sort_unstable();
        order.extend(rest.iter().map(|&(_, k)| first[k].1));
        return Ok(order);
    }
    if major_version >= 3 {
        return Ok((0..ops.len()).collect());
    }
    let mut order: Vec<usize> = (0..ops.len())
        .filter(|&i| ops[i].kind.is_ordered())
        .collect();
    let mut rest: Vec<usize> = (0..ops.len())
        .filter(|&i| !ops[i].kind.is_ordered())
        .collect();
    rest.sort_by_key(|&i| ops[i].new_block);
    order.extend(rest);
    Ok(order)
}

/// Check that merging `ops` one at a time, in this order, into the very
/// device they read from is safe: no op reads a block an earlier op wrote,
/// and every COPY/XOR comes before any REPLACE/ZERO.
pub fn verify_order<'a>(ops: impl IntoIterator<Item = &'a Op>) -> Result<(), MergeOrderError> {
    let ops: Vec<&Op> = ops.into_iter().collect();
    // The position of the first op writing each block, sorted by block. An
    // op at position p reading block b is unsafe exactly when that first
    // write comes before p, which is what a running set of written blocks
    // would report, for one sort instead of a hash per block.
    let written = first_by_block(
        ops.iter()
            .enumerate()
            .flat_map(|(p, op)| (op.new_block..op.end_block()).map(move |b| (b, p))),
    );
    let mut replace_at: Option<usize> = None;
    for (position, &op) in ops.iter().enumerate() {
        if op.kind.is_ordered() {
            if let Some(replace_at) = replace_at {
                return Err(MergeOrderError::OrderedAfterReplace {
                    position,
                    kind: op.kind,
                    new_block: op.new_block,
                    replace_at,
                });
            }
        } else if replace_at.is_none() {
            replace_at = Some(position);
        }
        for source_block in op.source_blocks() {
            let first = written
                .binary_search_by_key(&source_block, |e| e.0)
                .ok()
                .map(|k| written[k].1);
            if let Some(overwritten_at) = first.filter(|&q| q < position) {
                return Err(MergeOrderError::SourceOverwritten {
                    position,
                    kind: op.kind,
                    new_block: op.new_block,
                    source_block,
                    overwritten_at,
                });
            }
        }
    }
    Ok(())
}

/// The `(block, index)` pairs sorted by block, keeping the smallest index
/// of each block.
fn first_by_block(pairs: impl Iterator<Item = (u64, usize)>) -> Vec<(u64, usize)> {
    let mut v: Vec<(u64, usize)> = pairs.collect();
    v.sort_unstable();
    v.dedup_by_key(|e| e.0);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::OpKind;

    fn copy(new_block: u64, source: u64) -> Op {
        Op {
            kind: OpKind::Copy,
            new_block,
            source,
            blocks: 1,
            data_offset: 0,
            data_length: 0,
        }
    }

    fn xor(new_block: u64, source: u64) -> Op {
        Op {
            kind: OpKind::Xor,
            ..copy(new_block, source)
        }
    }

    fn zero(new_block: u64) -> Op {
        Op {
            kind: OpKind::Zero,
            ..copy(new_block, 0)
        }
    }

    #[test]
    fn overlapping_copy_ascending_is_safe_descending_is_not() {
        // 10,11,12 <- 11,12,13: each op reads a block not yet written.
        let asc = [copy(10, 11), copy(11, 12), copy(12, 13)];
        assert!(verify_order(asc.iter()).is_ok());
        let desc = [copy(12, 13), copy(11, 12), copy(10, 11)];
        let e = verify_order(desc.iter()).unwrap_err();
        assert!(matches!(
            e,
            MergeOrderError::SourceOverwritten {
                position: 1,
                source_block: 12,
                ..
            }
        ));
    }

    #[test]
    fn unaligned_xor_reads_two_blocks() {
        // XOR at 40*4096+100 reads blocks 40 and 41; 41 was written first.
        let ops = [copy(41, 7), xor(200, 40 * 4096 + 100)];
        assert!(verify_order(ops.iter()).is_err());
        let aligned = [copy(41, 7), xor(200, 40 * 4096)];
        assert!(verify_order(aligned.iter()).is_ok());
    }

    #[test]
    fn copy_after_zero_is_rejected() {
        let ops = [zero(5), copy(6, 1)];
        assert!(matches!(
            verify_order(ops.iter()),
            Err(MergeOrderError::OrderedAfterReplace { .. })
        ));
    }

    #[test]
    fn order_with_sequence_then_sorted_rest() {
        let ops = [zero(9), copy(3, 4), zero(1), copy(4, 5)];
        let order = merge_order(2, &ops, &[3, 4]).unwrap();
        assert_eq!(order, vec![1, 3, 2, 0]);
        assert!(matches!(
            merge_order(3, &ops, &[3, 77]),
            Err(MergeOrderError::MissingSequenceOp { new_block: 77, .. })
        ));
    }

    #[test]
    fn order_without_sequence() {
        let ops = [zero(9), copy(3, 4), zero(1), copy(4, 5)];
        assert_eq!(merge_order(3, &ops, &[]).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(merge_order(2, &ops, &[]).unwrap(), vec![1, 3, 2, 0]);
    }
}
