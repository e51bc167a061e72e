//! Property tests: random op mixes written by our writer read back to the
//! image a plain reference model computes; resuming at a label equals a
//! writer that stopped there; unsafe merge orders are caught.

use std::fs::File;
use std::path::Path;

use cow::{Codec, Compression, CowReader, CowWriter, Op, OpKind, SnapshotView, WriterOptions};
use proptest::prelude::*;

const BS: usize = 4096;

#[derive(Clone, Debug)]
enum Step {
    Copy {
        dst: u64,
        src: u64,
        n: u64,
    },
    Xor {
        dst: u64,
        src_block: u64,
        offset: u16,
        n: u64,
        seed: u8,
    },
    Zero {
        dst: u64,
        n: u64,
    },
    Replace {
        dst: u64,
        n: u64,
        seed: u8,
        random: bool,
    },
    Label(u64),
}

fn block_content(seed: u8, random: bool, n: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(u64::from(seed));
    (0..n as usize * BS)
        .map(|i| {
            if random {
                rng.u8(..)
            } else {
                (((i / 61) as u32 * u32::from(seed)) % 7) as u8
            }
        })
        .collect()
}

fn base_image(blocks: u64) -> Vec<u8> {
    block_content(77, true, blocks)
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            if (i / BS).is_multiple_of(3) {
                (i / 97) as u8
            } else {
                b
            }
        })
        .collect()
}

/// Turn abstract choices into steps touching each destination block once.
fn plan(blocks: u64, raw: Vec<(u8, u64, u64, u8, u16)>) -> Vec<Step> {
    let mut used = vec![false; blocks as usize];
    let mut steps = Vec::new();
    let mut label = 0;
    for (kind, a, b, seed, off) in raw {
        let dst = a % blocks;
        let n = (b % 5 + 1).min(blocks - dst);
        if (dst..dst + n).any(|x| used[x as usize]) {
            continue;
        }
        let step = match kind % 5 {
            0 => {
                let src = (a.wrapping_mul(7) + b) % (blocks - n + 1);
                Step::Copy { dst, src, n }
            }
            1 => {
                // Leave room for the second block an unaligned XOR reads.
                let src_block = (a / 3 + b) % (blocks - n);
                Step::Xor {
                    dst,
                    src_block,
                    offset: off % BS as u16,
                    n,
                    seed,
                }
            }
            2 => Step::Zero { dst, n },
            3 => Step::Replace {
                dst,
                n,
                seed,
                random: seed % 3 == 0,
            },
            _ => {
                label += 1 + b % 3;
                steps.push(Step::Label(label));
                continue;
            }
        };
        for x in dst..dst + n {
            used[x as usize] = true;
        }
        steps.push(step);
    }
    steps
}

/// The new image as the snapshot view defines it: every op reads the base.
fn model(base: &[u8], steps: &[Step]) -> Vec<u8> {
    let mut img = base.to_vec();
    for s in steps {
        match *s {
            Step::Copy { dst, src, n } => {
                let (d, s) = (dst as usize * BS, src as usize * BS);
                img[d..d + n as usize * BS].copy_from_slice(&base[s..s + n as usize * BS]);
            }
            Step::Xor { dst, n, seed, .. } => {
                let d = dst as usize * BS;
                img[d..d + n as usize * BS].copy_from_slice(&block_content(seed, false, n));
            }
            Step::Zero { dst, n } => {
                let d = dst as usize * BS;
                img[d..d + n as usize * BS].fill(0);
            }
            Step::Replace {
                dst,
                n,
                seed,
                random,
            } => {
                let d = dst as usize * BS;
                img[d..d + n as usize * BS].copy_from_slice(&block_content(seed, random, n));
            }
            Step::Label(_) => {}
        }
    }
    img
}

fn apply_steps(w: &mut CowWriter, base: &[u8], steps: &[Step]) {
    for s in steps {
        match *s {
            Step::Copy { dst, src, n } => w.add_copy(dst, src, n).unwrap(),
            Step::Xor {
                dst,
                src_block,
                offset,
                n,
                seed,
            } => {
                let new = block_content(seed, false, n);
                let s0 = src_block as usize * BS + offset as usize;
                let xored: Vec<u8> = new.iter().zip(&base[s0..]).map(|(a, b)| a ^ b).collect();
                w.add_xor_blocks(dst, &xored, src_block, offset).unwrap();
            }
            Step::Zero { dst, n } => w.add_zero_blocks(dst, n).unwrap(),
            Step::Replace {
                dst,
                n,
                seed,
                random,
            } => w
                .add_raw_blocks(dst, &block_content(seed, random, n))
                .unwrap(),
            Step::Label(l) => w.add_label(l).unwrap(),
        }
    }
}

fn opts(
    version: u16,
    codec: Codec,
    factor_exp: u32,
    cluster: u32,
    threads: usize,
) -> WriterOptions {
    let level = match codec {
        Codec::Brotli => Some(4), // quality 11 is too slow for hundreds of cases
        _ => None,
    };
    WriterOptions {
        version,
        compression: Compression { codec, level },
        // XOR payloads at another level are still plain zstd frames.
        xor_level: (codec == Codec::Zstd && factor_exp % 2 == 1).then_some(1),
        compression_factor: 4096 << factor_exp,
        cluster_ops: cluster,
        op_count_max: 4096,
        // None, AOSP's 2 MiB, or a small area: readers must find the ops
        // behind any of them.
        scratch_size: match (version, cluster % 3) {
            (3, _) | (_, 0) => cow::format::SCRATCH_SIZE,
            (_, 1) => 64 << 10,
            _ => 0,
        },
        threads,
        max_blocks: None,
    }
}

fn snapshot(cow: &Path, base_path: &Path, blocks: u64) -> Vec<u8> {
    let r = CowReader::open(cow).unwrap();
    let base = File::open(base_path).unwrap();
    let view = SnapshotView::new(&r, &base, base_path, Some(blocks * BS as u64)).unwrap();
    let mut img = vec![0u8; view.size() as usize];
    view.read_blocks(0, &mut img).unwrap();
    img
}

fn codec_strategy() -> impl Strategy<Value = Codec> {
    prop_oneof![
        Just(Codec::None),
        Just(Codec::Gz),
        Just(Codec::Brotli),
        Just(Codec::Lz4),
        Just(Codec::Zstd)
    ]
}

fn raw_steps() -> impl Strategy<Value = Vec<(u8, u64, u64, u8, u16)>> {
    prop::collection::vec(
        (
            any::<u8>(),
            0u64..1 << 32,
            0u64..1 << 32,
            any::<u8>(),
            any::<u16>(),
        ),
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn write_read_round_trip(
        raw in raw_steps(),
        version in 2u16..=3,
        codec in codec_strategy(),
        factor_exp in 0u32..=6,
        cluster in prop_oneof![Just(0u32), Just(2), Just(3), Just(16), Just(1024)],
        threads in 1usize..=3,
        blocks in 16u64..96,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let base = base_image(blocks);
        let base_path = dir.path().join("base.img");
        std::fs::write(&base_path, &base).unwrap();
        let steps = plan(blocks, raw);
        let cow_path = dir.path().join("x.cow");
        let mut w = CowWriter::create(&cow_path, opts(version, codec, factor_exp, cluster, threads)).unwrap();
        apply_steps(&mut w, &base, &steps);
        let info = w.finalize().unwrap();
        prop_assert_eq!(info.cow_size, std::fs::metadata(&cow_path).unwrap().len());
        let img = snapshot(&cow_path, &base_path, blocks);
        prop_assert!(img == model(&base, &steps), "snapshot differs from the model");
        // Labels come back in order with their positions.
        let r = CowReader::open(&cow_path).unwrap();
        let labels: Vec<u64> = r.labels().iter().map(|l| l.label).collect();
        let mut expected: Vec<u64> = steps.iter().filter_map(|s| match s { Step::Label(l) => Some(*l), _ => None }).collect();
        if version == 3 {
            let keep = expected.len().saturating_sub(4);
            expected.drain(..keep);
        }
        prop_assert_eq!(labels, expected);
    }

    /// Output bytes do not depend on the number of compression threads.
    #[test]
    fn thread_count_does_not_change_bytes(
        raw in raw_steps(),
        version in 2u16..=3,
        codec in prop_oneof![Just(Codec::Lz4), Just(Codec::Zstd), Just(Codec::Gz)],
        factor_exp in 0u32..=4,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let base = base_image(64);
        let steps = plan(64, raw);
        let mut files = Vec::new();
        for threads in [1, 2, 4] {
            let p = dir.path().join(format!("t{threads}.cow"));
            let mut w = CowWriter::create(&p, opts(version, codec, factor_exp, 16, threads)).unwrap();
            apply_steps(&mut w, &base, &steps);
            w.finalize().unwrap();
            files.push(std::fs::read(&p).unwrap());
        }
        prop_assert!(files[0] == files[1] && files[1] == files[2]);
    }

    /// Re-opening a writer at label L and writing more equals a writer that
    /// stopped at L and went on with the same ops, byte for byte.
    #[test]
    fn resume_at_label_equals_fresh_writer(
        head in raw_steps(),
        lost in raw_steps(),
        tail in raw_steps(),
        version in 2u16..=3,
        codec in prop_oneof![Just(Codec::None), Just(Codec::Lz4), Just(Codec::Zstd)],
        cluster in prop_oneof![Just(0u32), Just(3), Just(16)],
        finalize_lost in any::<bool>(),
    ) {
        let blocks = 200;
        let dir = tempfile::tempdir().unwrap();
        let base = base_image(blocks);
        let base_path = dir.path().join("base.img");
        std::fs::write(&base_path, &base).unwrap();
        // Three disjoint block ranges so every part can be written after any other.
        let shift = |steps: Vec<Step>, by: u64| -> Vec<Step> {
            steps.into_iter().map(|s| match s {
                Step::Copy { dst, src, n } => Step::Copy { dst: dst + by, src, n },
                Step::Xor { dst, src_block, offset, n, seed } => Step::Xor { dst: dst + by, src_block, offset, n, seed },
                Step::Zero { dst, n } => Step::Zero { dst: dst + by, n },
                Step::Replace { dst, n, seed, random } => Step::Replace { dst: dst + by, n, seed, random },
                Step::Label(l) => Step::Label(l),
            }).collect()
        };
        let strip = |steps: Vec<Step>| steps.into_iter().filter(|s| !matches!(s, Step::Label(_))).collect::<Vec<_>>();
        let head = shift(strip(plan(60, head)), 0);
        let lost = shift(plan(60, lost), 60);
        let tail = shift(strip(plan(60, tail)), 120);
        let l = 1000u64;
        let o = opts(version, codec, 2, cluster, 2);

        let resumed = dir.path().join("resumed.cow");
        let mut w = CowWriter::create(&resumed, o.clone()).unwrap();
        apply_steps(&mut w, &base, &head);
        w.add_label(l).unwrap();
        // Labels after L must be larger (monotonic), as update_engine's are.
        let lost: Vec<Step> = lost.into_iter().map(|s| match s { Step::Label(x) => Step::Label(l + x), s => s }).collect();
        apply_steps(&mut w, &base, &lost);
        if finalize_lost { w.finalize().unwrap(); } else { drop(w); }
        // v3 keeps only the 4 newest resume points: L is gone after 4 more.
        let later_labels = lost.iter().filter(|s| matches!(s, Step::Label(_))).count();
        if version == 3 && later_labels >= 4 {
            let gone = matches!(
                CowWriter::resume(&resumed, o.clone(), l),
                Err(cow::CowError::LabelNotFound { .. })
            );
            prop_assert!(gone);
            return Ok(());
        }
        let mut w = CowWriter::resume(&resumed, o.clone(), l).unwrap();
        apply_steps(&mut w, &base, &tail);
        w.finalize().unwrap();

        let fresh = dir.path().join("fresh.cow");
        let mut w = CowWriter::create(&fresh, o).unwrap();
        apply_steps(&mut w, &base, &head);
        w.add_label(l).unwrap();
        apply_steps(&mut w, &base, &tail);
        w.finalize().unwrap();

        let (a, b) = (std::fs::read(&resumed).unwrap(), std::fs::read(&fresh).unwrap());
        prop_assert_eq!(a.len(), b.len());
        prop_assert!(a == b, "first difference at {:?}", a.iter().zip(&b).position(|(x, y)| x != y));
        let mut all = head.clone();
        all.extend(tail);
        prop_assert!(snapshot(&resumed, &base_path, blocks) == model(&base, &all));
    }

    /// The validator accepts an order exactly when no op reads a block an
    /// earlier op wrote (checked here by brute force), and an accepted order
    /// merged op by op in place gives the snapshot image.
    #[test]
    fn merge_order_validation_matches_brute_force(
        copies in prop::collection::vec((0u64..24, 0u64..24, any::<bool>(), 0u16..4096), 1..24),
        perm_seed in any::<u64>(),
        version in 2u16..=3,
    ) {
        let blocks = 32u64;
        let dir = tempfile::tempdir().unwrap();
        let base = base_image(blocks);
        let base_path = dir.path().join("base.img");
        std::fs::write(&base_path, &base).unwrap();
        // Distinct destinations; COPY or XOR sources anywhere.
        let mut seen = std::collections::HashSet::new();
        let ops: Vec<(u64, u64, bool, u16)> = copies.into_iter().filter(|c| seen.insert(c.0)).collect();
        let mut seq: Vec<u32> = ops.iter().map(|o| o.0 as u32).collect();
        // A deterministic shuffle of the sequence.
        fastrand::Rng::with_seed(perm_seed).shuffle(&mut seq);
        let path = dir.path().join("m.cow");
        let mut w = CowWriter::create(&path, opts(version, Codec::Lz4, 0, 16, 1)).unwrap();
        w.add_sequence(&seq).unwrap();
        for &(dst, src, is_xor, off) in &ops {
            if is_xor {
                let s = src as usize * BS + off as usize;
                let xored: Vec<u8> = base[s..s + BS].iter().map(|b| b ^ 0x5a).collect();
                w.add_xor_blocks(dst, &xored, src, off).unwrap();
            } else {
                w.add_copy(dst, src, 1).unwrap();
            }
        }
        w.finalize().unwrap();
        let r = CowReader::open(&path).unwrap();
        let order: Vec<Op> = r.merge_order().unwrap().iter().map(|&i| r.ops()[i]).collect();
        // Brute force: does any op read a block written earlier in the order?
        let unsafe_order = order.iter().enumerate().any(|(i, op)| {
            op.source_blocks().any(|sb| order[..i].iter().any(|p| p.new_block == sb))
        });
        prop_assert_eq!(r.verify_merge().is_err(), unsafe_order);
        if !unsafe_order {
            let mut img = base.clone();
            for op in &order {
                let d = op.new_block as usize * BS;
                let mut data = vec![0u8; BS];
                match op.kind {
                    OpKind::Copy => { let s = op.source as usize * BS; data.copy_from_slice(&img[s..s + BS]); }
                    OpKind::Xor => {
                        r.read_payload(op, &mut data).unwrap();
                        let s = op.source as usize;
                        for (a, b) in data.iter_mut().zip(&img[s..s + BS]) { *a ^= b; }
                    }
                    _ => unreachable!(),
                }
                img[d..d + BS].copy_from_slice(&data);
            }
            prop_assert!(img == snapshot(&path, &base_path, blocks));
        }
    }
}
