//! A [`delta::Plan`] as bytes: each op as its distance from the op before it (blocks
//! skipped, source relative to destination) in `postcard`'s varints, then zstd. Runs
//! of neighbouring ops become runs of equal small numbers, which zstd folds away: on
//! the `system` pair the plan of ~146 000 ops takes 42 KB.
//!
//! The merge sequence is not carried: it is a function of the ops
//! ([`delta::order::order_merge`]), which the reader runs again. It took 25-45% of
//! each corpus pair's plan (27 KB on `system`), and a device that computes its merge
//! order itself need not trust one it was sent.

use std::io::Read;

use delta::{BlockOp, Census, Plan, PlannedOp};
use serde::{Deserialize, Serialize};

/// What the varints encode.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
struct WirePlan {
    old_size: u64,
    new_size: u64,
    ops: Vec<WireOp>,
    /// [`Plan::hints`]: each block minus the one before it, and its old byte offset
    /// minus the block's own.
    hints: Vec<(u64, i64)>,
}

/// `gap`: blocks between the previous op's destination and this one's, minus one.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
enum WireOp {
    /// `src`: source block minus destination block.
    Copy {
        gap: u64,
        src: i64,
    },
    /// `src`: source byte offset minus the destination's byte offset.
    Xor {
        gap: u64,
        src: i64,
    },
    Zero {
        gap: u64,
    },
    Replace {
        gap: u64,
    },
}

const BS: u64 = delta::BLOCK_SIZE as u64;

/// Encodes `plan` (its ops, hints and sizes; the merge sequence and the census are
/// recomputed on decoding).
pub fn encode(plan: &Plan, level: i32) -> std::io::Result<Vec<u8>> {
    let mut next = 0u64;
    let ops = plan
        .ops
        .iter()
        .map(|p| {
            let gap = p.dst - next;
            next = p.dst + 1;
            let rel = |src: u64, dst: u64| src as i64 - dst as i64;
            match p.op {
                BlockOp::Copy { src_block } => WireOp::Copy {
                    gap,
                    src: rel(src_block, p.dst),
                },
                BlockOp::Xor { src_offset } => WireOp::Xor {
                    gap,
                    src: rel(src_offset, p.dst * BS),
                },
                BlockOp::Zero => WireOp::Zero { gap },
                BlockOp::Replace => WireOp::Replace { gap },
            }
        })
        .collect();
    let mut prev = 0u64;
    let hints = plan
        .hints
        .iter()
        .map(|&(b, src)| {
            let d = b - prev;
            prev = b;
            (d, src as i64 - (b * BS) as i64)
        })
        .collect();
    let wire = WirePlan {
        old_size: plan.old_size,
        new_size: plan.new_size,
        ops,
        hints,
    };
    let raw = postcard::to_stdvec(&wire).map_err(std::io::Error::other)?;
    zstd::bulk::compress(&raw, level)
}

/// Decodes a plan for images of at most `new_size` bytes (from the signed manifest:
/// bounds what a damaged plan can make us allocate). The error says what is wrong.
pub fn decode(bytes: &[u8], new_size: u64) -> Result<Plan, String> {
    let blocks = new_size / BS;
    // Per op at most ~30 bytes of varints, per sequence entry ~10.
    let cap = usize::try_from(blocks.saturating_mul(40).saturating_add(1 << 16))
        .map_err(|_| "image too large".to_string())?;
    // Streamed, so that memory grows with the plan's real size, not with what a damaged
    // (or unsigned) manifest claims.
    let mut raw = Vec::new();
    zstd::stream::read::Decoder::new(bytes)
        .and_then(|d| std::io::Read::take(d, cap as u64 + 1).read_to_end(&mut raw))
        .map_err(|e| format!("plan: zstd: {e}"))?;
    if raw.len() > cap {
        return Err(format!("plan: decodes to more than {cap} bytes"));
    }
    let wire: WirePlan = postcard::from_bytes(&raw).map_err(|e| format!("plan: {e}"))?;
    if wire.new_size != new_size {
        return Err(format!(
            "plan is for a {}-byte image, the manifest says {new_size}",
            wire.new_size
        ));
    }
    let bad = |what: &str| Err(format!("plan: {what}"));
    let mut census = Census::default();
    let mut ops = Vec::with_capacity(wire.ops.len());
    let mut next = 0u64;
    for w in &wire.ops {
        let (gap, op) = match *w {
            WireOp::Copy { gap, src } => (gap, Some(src)),
            WireOp::Xor { gap, src } => (gap, Some(src)),
            WireOp::Zero { gap } | WireOp::Replace { gap } => (gap, None),
        };
        let dst = match next.checked_add(gap) {
            Some(d) if d < blocks => d,
            _ => return bad("an op lies past the end of the image"),
        };
        next = dst + 1;
        let abs = |base: u64, rel: i64| base.checked_add_signed(rel);
        let op = match (w, op) {
            (WireOp::Copy { .. }, Some(src)) => match abs(dst, src) {
                Some(src_block) => {
                    census.copy += 1;
                    BlockOp::Copy { src_block }
                }
                None => return bad("a COPY source lies before the image"),
            },
            (WireOp::Xor { .. }, Some(src)) => match abs(dst * BS, src) {
                Some(src_offset) => {
                    census.xor += 1;
                    BlockOp::Xor { src_offset }
                }
                None => return bad("an XOR source lies before the image"),
            },
            (WireOp::Zero { .. }, _) => {
                census.zero += 1;
                BlockOp::Zero
            }
            _ => {
                census.replace += 1;
                BlockOp::Replace
            }
        };
        ops.push(PlannedOp { dst, op });
    }
    census.unchanged = blocks - ops.len() as u64;
    // A planner's ops never depend on each other in a cycle (it breaks them before it
    // orders them); ops that do were not made by one.
    let order = delta::order::order_merge(&mut ops);
    if order.converted > 0 {
        return bad("COPY and XOR ops that overwrite each other's sources in a cycle");
    }
    let sequence = order.sequence;
    let mut hints = Vec::with_capacity(wire.hints.len());
    let mut b = 0u64;
    for (i, &(d, rel)) in wire.hints.iter().enumerate() {
        b = b
            .checked_add(d)
            .filter(|&b| b < blocks && (i == 0 || d > 0))
            .ok_or_else(|| {
                "plan: a source hint lies outside the image or out of order".to_string()
            })?;
        let src = (b * BS)
            .checked_add_signed(rel)
            .ok_or_else(|| "plan: a source hint lies before the image".to_string())?;
        hints.push((b, src));
    }
    Ok(Plan {
        old_size: wire.old_size,
        new_size: wire.new_size,
        ops,
        sequence,
        census,
        index_bytes: 0,
        hints,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan of `ops` (block, op) between images of `old` and `new` blocks.
    fn plan(old: u64, new: u64, ops: &[(u64, BlockOp)], hints: Vec<(u64, u64)>) -> Plan {
        Plan {
            old_size: old * BS,
            new_size: new * BS,
            ops: ops.iter().map(|&(dst, op)| PlannedOp { dst, op }).collect(),
            sequence: vec![],
            census: Census::default(),
            index_bytes: 0,
            hints,
        }
    }

    #[test]
    fn round_trip() {
        let ops = [
            (0, BlockOp::Copy { src_block: 7 }),
            (1, BlockOp::Xor { src_offset: 3 }),
            (5, BlockOp::Zero),
            (9, BlockOp::Replace),
        ];
        let plan = plan(16, 10, &ops, vec![(9, 12345)]);
        let back = decode(&encode(&plan, 3).unwrap(), 10 * BS).unwrap();
        assert_eq!(back.ops, plan.ops);
        // Computed again: block 1's XOR reads block 0, so it merges before 0 does.
        assert_eq!(back.sequence, vec![1, 0]);
        assert_eq!(back.hints, plan.hints);
        assert_eq!(
            (back.old_size, back.new_size),
            (plan.old_size, plan.new_size)
        );
        assert_eq!(back.census.unchanged, 6);
        // Another size, and bytes that are no plan, are refused.
        assert!(decode(&encode(&plan, 3).unwrap(), 11 * BS).is_err());
        assert!(decode(b"not zstd", 10 * BS).is_err());
    }

    #[test]
    fn ops_past_the_end_are_refused() {
        let p = plan(4, 4, &[(3, BlockOp::Replace)], vec![]);
        let bytes = encode(&p, 3).unwrap();
        assert!(decode(&bytes, 4 * BS).is_ok());
        let short = Plan {
            new_size: 3 * BS,
            ..p
        };
        let bytes = encode(&short, 3).unwrap();
        assert!(decode(&bytes, 3 * BS).unwrap_err().contains("past the end"));
    }

    #[test]
    fn ops_in_a_cycle_are_refused() {
        // Blocks 0 and 1 each read the other's old content: no planner makes that.
        let ops = [
            (0, BlockOp::Copy { src_block: 1 }),
            (1, BlockOp::Copy { src_block: 0 }),
        ];
        let e = decode(&encode(&plan(2, 2, &ops, vec![]), 3).unwrap(), 2 * BS).unwrap_err();
        assert!(e.contains("cycle"), "{e}");
    }
}
