//! The ops a plan is made of: what each NEW block becomes, and the blocks it reads
//! during the merge. Planning (`plan`), ordering (`order`) and the lone-XOR pass
//! (`lone`) all work on them; this module depends on none of those.

use crate::BLOCK_SIZE;

/// What a NEW block becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockOp {
    /// Copy of OLD block `src_block`.
    Copy { src_block: u64 },
    /// Stored as NEW ⊕ OLD[src_offset .. src_offset + 4096].
    Xor { src_offset: u64 },
    /// All zeros.
    Zero,
    /// Stored (compressed) data.
    Replace,
}

/// The op for one NEW block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedOp {
    pub dst: u64,
    pub op: BlockOp,
}

/// The blocks an op reads during the merge (0, 1 or 2 of them).
pub fn source_blocks(op: &BlockOp) -> impl Iterator<Item = u64> + use<> {
    let (a, b) = match *op {
        BlockOp::Copy { src_block } => (Some(src_block), None),
        BlockOp::Xor { src_offset } => {
            let first = src_offset / BLOCK_SIZE as u64;
            let second = (src_offset % BLOCK_SIZE as u64 != 0).then_some(first + 1);
            (Some(first), second)
        }
        BlockOp::Zero | BlockOp::Replace => (None, None),
    };
    a.into_iter().chain(b)
}
