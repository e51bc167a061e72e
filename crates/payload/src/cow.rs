//! An incremental payload as the COW a Virtual A/B Compression device writes for it,
//! following update_engine's VABC writer:
//!
//! - blocks in a `COW_COPY` merge operation become COPY ops, blocks in a `COW_XOR`
//!   one XOR ops (new ⊕ old at the operation's byte offset), in the merge
//!   operations' order, which is the COW's merge sequence;
//! - ZERO and DISCARD blocks become ZERO ops;
//! - every other block the payload writes becomes REPLACE, from the patched data
//!   (the new image, already checked against the signed hash);
//! - a SOURCE_COPY of a block onto itself is no op at all.
//!
//! The result is a [`delta::Plan`], which `delta`'s writer turns into the COW with
//! the payload's version, compression and unit (labels every 64 MiB for resuming,
//! the order checked op by op before anything is written). A merge operation is a
//! claim about the data: a COPY whose blocks differ is refused rather than trusted.

use delta::{BlockImage, BlockOp, Census, Plan, PlannedOp};

use crate::error::{Error, Result};
use crate::format::Payload;
use crate::proto::{CowMergeType, OpType, PartitionUpdate};

/// The COW parameters the payload asks the device for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct CowParams {
    /// The COW format version (update_engine's default: 2).
    pub version: u16,
    /// The compression as update_engine names it ("lz4", "gz", "none", "zstd,3", ...;
    /// empty: the device's default, gz).
    pub compression: String,
    /// Bytes compressed as one unit (default 4096).
    pub compression_factor: u32,
}

/// What `p`'s dynamic partition metadata asks for.
pub fn cow_params(p: &Payload) -> CowParams {
    let d = p
        .manifest
        .dynamic_partition_metadata
        .clone()
        .unwrap_or_default();
    let compression = match d.vabc_compression_param.as_deref() {
        None | Some("") => "gz".to_string(),
        Some(c) => c.to_string(),
    };
    CowParams {
        version: d.cow_version.map_or(2, |v| v as u16),
        compression,
        compression_factor: d
            .compression_factor
            .map_or(4096, |f| u32::try_from(f).unwrap_or(u32::MAX)),
    }
}

const BS: u64 = 4096;

/// The plan of partition `part`'s COW, from `old` to `new` (the partition extracted
/// from the payload).
pub fn plan(
    p: &Payload,
    part: &PartitionUpdate,
    old: &dyn BlockImage,
    new: &dyn BlockImage,
) -> Result<Plan> {
    let name = part.partition_name.as_str();
    if u64::from(p.block_size()) != BS {
        return Err(Error::partition(
            name,
            format!("block size {}: a COW has 4096-byte blocks", p.block_size()),
        ));
    }
    let (old_blocks, new_blocks) = (old.size() / BS, new.size() / BS);
    let nb = usize::try_from(new_blocks).map_err(|_| Error::partition(name, "too many blocks"))?;
    // What each block becomes; None: no op (the base's block stays).
    let mut ops: Vec<Option<BlockOp>> = vec![Some(BlockOp::Replace); nb];
    for op in &part.operations {
        let t = OpType::try_from(op.r#type).ok();
        let mut src = blocks_of(&op.src_extents);
        for d in blocks_of(&op.dst_extents) {
            let s = src.next();
            let Some(slot) = usize::try_from(d).ok().and_then(|d| ops.get_mut(d)) else {
                continue;
            };
            *slot = match t {
                Some(OpType::Zero | OpType::Discard) => Some(BlockOp::Zero),
                Some(OpType::SourceCopy) if s == Some(d) => None,
                _ => Some(BlockOp::Replace),
            };
        }
    }
    let (mut oldb, mut newb) = (vec![0u8; BS as usize], vec![0u8; BS as usize]);
    let mut sequence = Vec::new();
    for (index, d, op) in claimed_blocks(name, &part.merge_operations, old_blocks, new_blocks)? {
        let di = d as usize;
        if let BlockOp::Copy { src_block: s } = op {
            let bad =
                |what: String| Error::partition(name, format!("merge operation {index}: {what}"));
            old.read_at(&mut oldb, s * BS)
                .map_err(|e| bad(e.to_string()))?;
            new.read_at(&mut newb, d * BS)
                .map_err(|e| bad(e.to_string()))?;
            if oldb != newb {
                return Err(bad(format!(
                    "it copies old block {s} to block {d}, but the new block differs"
                )));
            }
            if s == d {
                ops[di] = None;
                continue;
            }
        }
        ops[di] = Some(op);
        sequence.push(d);
    }
    // A block with no op must be the base's.
    for (d, op) in ops.iter_mut().enumerate() {
        if op.is_none() {
            let at = d as u64 * BS;
            if at + BS > old.size() {
                *op = Some(BlockOp::Replace);
                continue;
            }
            old.read_at(&mut oldb, at)
                .map_err(|e| Error::partition(name, e.to_string()))?;
            new.read_at(&mut newb, at)
                .map_err(|e| Error::partition(name, e.to_string()))?;
            if oldb != newb {
                *op = Some(BlockOp::Replace);
            }
        }
    }
    let mut census = Census::default();
    let planned: Vec<PlannedOp> = ops
        .iter()
        .enumerate()
        .filter_map(|(d, op)| {
            let op = (*op)?;
            match op {
                BlockOp::Copy { .. } => census.copy += 1,
                BlockOp::Xor { .. } => census.xor += 1,
                BlockOp::Zero => census.zero += 1,
                BlockOp::Replace => census.replace += 1,
            }
            Some(PlannedOp { dst: d as u64, op })
        })
        .collect();
    census.unchanged = new_blocks - planned.len() as u64;
    Ok(Plan {
        old_size: old.size(),
        new_size: new.size(),
        ops: planned,
        sequence,
        census,
        index_bytes: 0,
        hints: Vec::new(),
    })
}

/// The blocks that `merge_operations` make COPY and XOR ops of, in merge order, each
/// with the index of its merge operation: each
/// operation's blocks in turn, a forward shift over itself from its end. Checked: a
/// type and source offset update_engine writes, every block inside the partitions
/// (`old_blocks`, `new_blocks`), none claimed twice.
pub fn claimed_blocks(
    name: &str,
    merge_operations: &[crate::proto::CowMergeOperation],
    old_blocks: u64,
    new_blocks: u64,
) -> Result<Vec<(usize, u64, BlockOp)>> {
    let mut claimed = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (index, m) in merge_operations.iter().enumerate() {
        let bad = |what: String| Error::partition(name, format!("merge operation {index}: {what}"));
        let t = CowMergeType::try_from(m.r#type.unwrap_or(0))
            .map_err(|_| bad(format!("unknown type {}", m.r#type.unwrap_or(0))))?;
        if t == CowMergeType::CowReplace {
            continue;
        }
        let (Some(src), Some(dst)) = (&m.src_extent, &m.dst_extent) else {
            return Err(bad("it has no source or destination".into()));
        };
        let offset = u64::from(m.src_offset.unwrap_or(0));
        if offset >= BS || (t == CowMergeType::CowCopy && offset != 0) {
            return Err(bad(format!("source offset {offset} is not allowed")));
        }
        let extra = u64::from(offset != 0);
        let in_new = dst
            .start()
            .checked_add(dst.len())
            .is_some_and(|e| e <= new_blocks);
        let in_old = src
            .start()
            .checked_add(dst.len().saturating_add(extra))
            .is_some_and(|e| e <= old_blocks);
        if dst.is_empty() || !in_new || !in_old {
            return Err(bad(format!(
                "blocks {}+{} from {}+{} are outside the partitions",
                dst.start(),
                dst.len(),
                src.start(),
                dst.len()
            )));
        }
        let pairs = (0..dst.len()).map(|i| (dst.start() + i, src.start() + i));
        let ordered: Box<dyn Iterator<Item = (u64, u64)>> = if src.start() < dst.start() {
            Box::new(pairs.rev())
        } else {
            Box::new(pairs)
        };
        for (d, s) in ordered {
            if !claimed.insert(d) {
                return Err(bad(format!(
                    "block {d} is in an earlier merge operation too"
                )));
            }
            out.push((
                index,
                d,
                match t {
                    CowMergeType::CowCopy => BlockOp::Copy { src_block: s },
                    _ => BlockOp::Xor {
                        src_offset: s * BS + offset,
                    },
                },
            ));
        }
    }
    Ok(out)
}

/// The blocks of `extents`, in order.
fn blocks_of(extents: &[crate::proto::Extent]) -> impl Iterator<Item = u64> + '_ {
    extents
        .iter()
        .flat_map(|e| (0..e.len()).map(move |i| e.start().saturating_add(i)))
}
