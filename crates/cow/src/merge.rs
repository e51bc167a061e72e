//! Merge order: how AOSP derives it from a COW (`CowReader::PrepMergeOps`),
//! and the op-by-op safety check (`VerifyMergeOps`), §2.8 of the spec.
//!
//! `num_merge_ops` in the header is an index into this order, so the
//! derivation must match AOSP's exactly for a merge started by one
//! implementation to be resumed by the other.

use std::collections::{HashMap, HashSet};

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
        let mut first: HashMap<u64, usize> = HashMap::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            first.entry(op.new_block).or_insert(i);
        }
        let mut order = Vec::with_capacity(ops.len());
        let mut in_seq = HashSet::with_capacity(sequence.len());
        for (index, &b) in sequence.iter().enumerate() {
            let b = u64::from(b);
            let &i = first.get(&b).ok_or(MergeOrderError::MissingSequenceOp {
                index,
                new_block: b,
            })?;
            order.push(i);
            in_seq.insert(b);
        }
        let mut rest: Vec<u64> = ops
            .iter()
            .map(|o| o.new_block)
            .filter(|b| !in_seq.contains(b))
            .collect();
        rest.sort_unstable();
        // Every block in `rest` came from an op, so the lookup cannot miss.
        order.extend(rest.iter().filter_map(|b| first.get(b).copied()));
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
    let mut written: HashMap<u64, usize> = HashMap::new();
    let mut replace_at: Option<usize> = None;
    for (position, op) in ops.into_iter().enumerate() {
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
            if let Some(&overwritten_at) = written.get(&source_block) {
                return Err(MergeOrderError::SourceOverwritten {
                    position,
                    kind: op.kind,
                    new_block: op.new_block,
                    source_block,
                    overwritten_at,
                });
            }
        }
        for b in op.new_block..op.end_block() {
            written.entry(b).or_insert(position);
        }
    }
    Ok(())
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
