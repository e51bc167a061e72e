//! Property tests of the planner on synthetic OLD/NEW pairs: shifted
//! regions (both directions, any byte count), swapped and rotated regions
//! (dependency cycles), partial overwrites, zero runs, and size changes.
//! For each pair: the merge order passes the op-by-op check, an in-place
//! merge simulated one op at a time reproduces NEW exactly, and the plan is
//! the same with 1 and 3 worker threads.

use delta::order::verify_order;
use delta::sim::merge_in_place;
use delta::{BLOCK_SIZE, BlockOp, Estimator, MemImage, NoProgress, Plan, PlanOptions};
use proptest::prelude::*;

const BS: usize = BLOCK_SIZE;

/// Deterministic filler: half random bytes, half repetitive text, so that
/// both REPLACE and XOR have something to compress.
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = Vec::with_capacity(len);
    let words: [&[u8]; 6] = [
        b"system ",
        b"vendor ",
        b"lib64/",
        b"libc.so ",
        b"0x7f454c46 ",
        b"\n",
    ];
    while out.len() < len {
        let x = rng.u64(..);
        if (x >> 60) < 8 {
            out.extend_from_slice(&x.to_le_bytes());
        } else {
            out.extend_from_slice(words[(x % 6) as usize]);
        }
    }
    out.truncate(len);
    out
}

#[derive(Clone, Debug)]
enum Edit {
    /// Insert `len` new bytes at `at` (what follows moves up).
    Insert { at: usize, len: usize, seed: u64 },
    /// Delete `len` bytes at `at` (what follows moves down).
    Delete { at: usize, len: usize },
    /// Swap two block-aligned ranges of `blocks` blocks.
    Swap { a: usize, b: usize, blocks: usize },
    /// Rotate a block range by `by` blocks (a cycle of COPYs).
    Rotate { at: usize, blocks: usize, by: usize },
    /// Overwrite a few bytes.
    Poke { at: usize, len: usize, seed: u64 },
    /// Zero a run of blocks.
    Zero { at: usize, blocks: usize },
    /// Move a block range elsewhere by copying over other content.
    CopyBlocks {
        from: usize,
        to: usize,
        blocks: usize,
    },
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1usize..9000, any::<u64>()).prop_map(|(at, len, seed)| Edit::Insert {
            at,
            len,
            seed
        }),
        (any::<usize>(), 1usize..9000).prop_map(|(at, len)| Edit::Delete { at, len }),
        (any::<usize>(), any::<usize>(), 1usize..6).prop_map(|(a, b, blocks)| Edit::Swap {
            a,
            b,
            blocks
        }),
        (any::<usize>(), 2usize..12, 1usize..11).prop_map(|(at, blocks, by)| Edit::Rotate {
            at,
            blocks,
            by
        }),
        (any::<usize>(), 1usize..300, any::<u64>()).prop_map(|(at, len, seed)| Edit::Poke {
            at,
            len,
            seed
        }),
        (any::<usize>(), 1usize..5).prop_map(|(at, blocks)| Edit::Zero { at, blocks }),
        (any::<usize>(), any::<usize>(), 1usize..8)
            .prop_map(|(from, to, blocks)| Edit::CopyBlocks { from, to, blocks }),
    ]
}

fn apply(data: &mut Vec<u8>, e: &Edit) {
    let len = data.len();
    let nb = len / BS;
    match *e {
        Edit::Insert { at, len: n, seed } => {
            let at = at % (len + 1);
            let ins = content(seed, n);
            data.splice(at..at, ins);
        }
        Edit::Delete { at, len: n } => {
            if len > 0 {
                let at = at % len;
                let end = (at + n).min(len);
                data.drain(at..end);
            }
        }
        Edit::Swap { a, b, blocks } => {
            if nb >= 2 * blocks {
                let a = a % (nb - 2 * blocks + 1);
                let b = a + blocks + b % (nb - a - 2 * blocks + 1);
                let (x, y) = data.split_at_mut(b * BS);
                x[a * BS..(a + blocks) * BS].swap_with_slice(&mut y[..blocks * BS]);
            }
        }
        Edit::Rotate { at, blocks, by } => {
            if nb >= blocks {
                let at = at % (nb - blocks + 1);
                data[at * BS..(at + blocks) * BS].rotate_left((by % blocks) * BS);
            }
        }
        Edit::Poke { at, len: n, seed } => {
            if len > 0 {
                let at = at % len;
                let end = (at + n).min(len);
                let c = content(seed, end - at);
                data[at..end].copy_from_slice(&c);
            }
        }
        Edit::Zero { at, blocks } => {
            if nb >= blocks {
                let at = at % (nb - blocks + 1);
                data[at * BS..(at + blocks) * BS].fill(0);
            }
        }
        Edit::CopyBlocks { from, to, blocks } => {
            if nb >= blocks {
                let from = from % (nb - blocks + 1);
                let to = to % (nb - blocks + 1);
                data.copy_within(from * BS..(from + blocks) * BS, to * BS);
            }
        }
    }
}

fn make_pair(
    seed: u64,
    blocks: usize,
    edits: &[Edit],
    new_blocks_delta: i64,
) -> (Vec<u8>, Vec<u8>) {
    let mut old = content(seed, blocks * BS);
    // A zero run in OLD, as filesystems have.
    if blocks > 8 {
        old[3 * BS..5 * BS].fill(0);
    }
    let mut new = old.clone();
    for e in edits {
        apply(&mut new, e);
    }
    let target = (blocks as i64 + new_blocks_delta).max(0) as usize * BS;
    new.resize(target, 0);
    (old, new)
}

fn plan_with(old: &[u8], new: &[u8], threads: usize, xor: bool) -> Plan {
    plan_est(old, new, threads, xor, PlanOptions::default().estimator)
}

fn plan_est(old: &[u8], new: &[u8], threads: usize, xor: bool, estimator: Estimator) -> Plan {
    let o = MemImage::new("old", old.to_vec());
    let n = MemImage::new("new", new.to_vec());
    let opts = PlanOptions {
        threads,
        xor,
        estimator,
        ..PlanOptions::default()
    };
    delta::plan(&o, &n, &opts, &NoProgress).unwrap()
}

fn check(old: &[u8], new: &[u8], plan: &Plan) {
    verify_order(&plan.ops, &plan.sequence).unwrap();
    // The sequence follows from the final ops alone: an update bundle does not carry
    // it, the device computes it again.
    let mut ops = plan.ops.clone();
    let again = delta::order::order_merge(&mut ops);
    assert_eq!(again.converted, 0, "the final ops still have a cycle");
    assert_eq!(
        again.sequence, plan.sequence,
        "the sequence is not the ops' own"
    );
    let merged = merge_in_place(old, new, plan);
    assert!(merged == new, "in-place merge does not reproduce NEW");
    // No op for a block that did not change; every op's block is in NEW.
    for op in &plan.ops {
        let d = op.dst as usize * BS;
        assert!(d + BS <= new.len());
        if d + BS <= old.len() {
            assert_ne!(
                &old[d..d + BS],
                &new[d..d + BS],
                "op for unchanged block {}",
                op.dst
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    #[test]
    fn round_trip_in_place(
        seed in any::<u64>(),
        blocks in 1usize..80,
        edits in proptest::collection::vec(edit(), 0..6),
        grow in -6i64..6,
        xor in any::<bool>(),
        lz4_estimates in any::<bool>(),
    ) {
        let (old, new) = make_pair(seed, blocks, &edits, grow);
        let est = if lz4_estimates { Estimator::Lz4 } else { Estimator::Zstd(1) };
        let plan = plan_est(&old, &new, 2, xor, est);
        check(&old, &new, &plan);
        if !xor {
            let no_xor = plan.ops.iter().all(|o| !matches!(o.op, BlockOp::Xor { .. }));
            prop_assert!(no_xor);
        }
    }

    /// Lone XORs stored as REPLACE: the plan still merges in place to NEW,
    /// and it differs from the plan without them only by XORs stored as
    /// REPLACE, give or take the ops that break merge cycles (fewer XORs
    /// mean fewer edges, so the cycles can be broken elsewhere).
    #[test]
    fn lone_xors_round_trip(
        seed in any::<u64>(),
        blocks in 1usize..80,
        edits in proptest::collection::vec(edit(), 0..6),
        grow in -6i64..6,
        min_run in 1u64..20,
    ) {
        let (old, new) = make_pair(seed, blocks, &edits, grow);
        let o = MemImage::new("old", old.clone());
        let n = MemImage::new("new", new.clone());
        let base = delta::plan(&o, &n, &PlanOptions::default(), &NoProgress).unwrap();
        let opts = PlanOptions { min_xor_run: min_run, ..PlanOptions::default() };
        let lone = delta::plan(&o, &n, &opts, &NoProgress).unwrap();
        check(&old, &new, &lone);
        prop_assert_eq!(base.ops.len(), lone.ops.len());
        let mut xor_to_replace = 0;
        for (a, b) in base.ops.iter().zip(&lone.ops) {
            prop_assert_eq!(a.dst, b.dst);
            if a.op != b.op {
                let toward = b.op == BlockOp::Replace;
                prop_assert!(toward || a.op == BlockOp::Replace, "{:?} -> {:?}", a, b);
                xor_to_replace += u64::from(toward && matches!(a.op, BlockOp::Xor { .. }));
            }
        }
        let c = &lone.census;
        prop_assert!(xor_to_replace + base.census.cycle_breaks >= c.lone_xors);
        prop_assert!(xor_to_replace <= c.lone_xors + c.cycle_breaks);
        prop_assert!(c.xor <= base.census.xor);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Large enough for several planning chunks, so threads really split it.
    #[test]
    fn same_plan_for_any_thread_count(
        seed in any::<u64>(),
        edits in proptest::collection::vec(edit(), 1..8),
    ) {
        let (old, new) = make_pair(seed, 700, &edits, 3);
        let one = plan_with(&old, &new, 1, true);
        let three = plan_with(&old, &new, 3, true);
        prop_assert_eq!(&one.ops, &three.ops);
        prop_assert_eq!(&one.sequence, &three.sequence);
        check(&old, &new, &one);
    }
}

#[test]
fn byte_shift_both_directions_becomes_xor() {
    for shift in [1usize, 100, 2049, 4095, 5000] {
        let old = content(7, 64 * BS);
        // NEW = OLD with `shift` bytes inserted near the start (content moves
        // up), and the reverse pair (content moves down).
        let mut up = old.clone();
        up.splice(10..10, content(99, shift));
        up.truncate(old.len());
        for (o, n) in [(&old, &up), (&up, &old)] {
            let plan = plan_with(o, n, 2, true);
            check(o, n, &plan);
            let xor = plan.census.xor;
            assert!(
                xor >= 55,
                "shift {shift}: only {xor} XOR blocks: {:?}",
                plan.census
            );
        }
    }
}

#[test]
fn swapped_halves_need_cycle_breaks() {
    let old = content(3, 40 * BS);
    let mut new = old[20 * BS..].to_vec();
    new.extend_from_slice(&old[..20 * BS]);
    let plan = plan_with(&old, &new, 2, true);
    check(&old, &new, &plan);
    assert_eq!(plan.census.copy + plan.census.replace, 40);
    assert_eq!(plan.census.cycle_breaks, 20, "{:?}", plan.census);
}

#[test]
fn empty_and_identical_pairs() {
    let old = content(5, 10 * BS);
    let plan = plan_with(&old, &old, 2, true);
    assert!(plan.ops.is_empty() && plan.sequence.is_empty());
    assert_eq!(plan.census.unchanged, 10);
    let plan = plan_with(&[], &[], 2, true);
    assert!(plan.ops.is_empty());
    // Everything from nothing, and nothing from everything.
    let plan = plan_with(&[], &old, 2, true);
    check(&[], &old, &plan);
    assert_eq!(plan.census.replace, 10);
    let plan = plan_with(&old, &[], 2, true);
    assert!(plan.ops.is_empty());
}

/// Recompiled code: functions move by arbitrary byte offsets and every
/// relocated address inside them changes, so no 64-byte run survives
/// intact, only the short runs between changed bytes. Each 4-block piece of
/// NEW comes from a different, unaligned place in OLD with every 24th byte
/// changed; the continuation of the previous match cannot find a piece's
/// first block, only the short anchors can.
#[test]
fn recompiled_code_becomes_xor() {
    let old = content(11, 64 * BS);
    let piece = 4 * BS;
    let mut new = Vec::with_capacity(old.len());
    for i in 0..16usize {
        let from = ((i * 7) % 15) * piece + (i * 397) % 3000;
        let mut p = old[from..from + piece].to_vec();
        for b in p.iter_mut().skip(i % 24).step_by(24) {
            *b ^= 0x5a;
        }
        new.extend_from_slice(&p);
    }
    let plan = plan_with(&old, &new, 2, true);
    check(&old, &new, &plan);
    // Every block finds its source; the pieces' moves form dependency
    // cycles, broken by turning a few XORs into REPLACEs.
    let c = plan.census;
    assert_eq!(c.replace, c.cycle_breaks, "{c:?}");
    assert!(c.xor >= 48, "{c:?}");
}
