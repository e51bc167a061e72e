//! An in-memory model of the device-side merge, for tests: apply a plan to a
//! copy of OLD one op at a time, in merge order, reading every COPY/XOR
//! source from the image being overwritten (as snapuserd does when the
//! source and target partitions share blocks). The result equals NEW only
//! if the merge order is safe op by op.

use crate::BLOCK_SIZE;
use crate::plan::{BlockOp, Plan};

/// Byte the model uses for blocks beyond OLD's end before they are written,
/// so a plan that relies on them being zero is caught.
const UNWRITTEN: u8 = 0xA5;

/// Merge `plan` in place over `old`. `new` supplies what the COW would store
/// (REPLACE data, and XOR payloads as NEW ⊕ OLD).
pub fn merge_in_place(old: &[u8], new: &[u8], plan: &Plan) -> Vec<u8> {
    let bs = BLOCK_SIZE;
    let mut base = old.to_vec();
    if base.len() < new.len() {
        base.resize(new.len(), UNWRITTEN);
    }
    let find = |dst: u64| {
        plan.ops
            .binary_search_by_key(&dst, |o| o.dst)
            .map(|i| plan.ops[i])
            .ok()
    };
    let mut block = vec![0u8; bs];
    for &dst in &plan.sequence {
        let Some(op) = find(dst) else {
            panic!("sequence names block {dst} without an op");
        };
        let d = dst as usize * bs;
        match op.op {
            BlockOp::Copy { src_block } => {
                let s = src_block as usize * bs;
                block.copy_from_slice(&base[s..s + bs]);
            }
            BlockOp::Xor { src_offset } => {
                let s = src_offset as usize;
                for (i, b) in block.iter_mut().enumerate() {
                    let payload = new[d + i] ^ old[s + i];
                    *b = base[s + i] ^ payload;
                }
            }
            other => panic!("{other:?} op for block {dst} in the sequence"),
        }
        base[d..d + bs].copy_from_slice(&block);
    }
    for op in &plan.ops {
        let d = op.dst as usize * bs;
        match op.op {
            BlockOp::Replace => base[d..d + bs].copy_from_slice(&new[d..d + bs]),
            BlockOp::Zero => base[d..d + bs].fill(0),
            BlockOp::Copy { .. } | BlockOp::Xor { .. } => {}
        }
    }
    base.truncate(new.len());
    base
}
