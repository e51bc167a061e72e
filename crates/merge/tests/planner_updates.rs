//! Updates made by the planner (`delta`) from random edits of a random old
//! image: moved regions (whole blocks and byte shifts, both directions),
//! rewritten and zeroed runs, small in-place edits. Each merges exactly,
//! with and without early REPLACE/ZERO writes, and a crash at a random
//! event (stop, power loss or torn writes) followed by a resume ends at the
//! new image, the snapshot view of what survived being the new image too.
//! Seeds are fixed, so a failure names the case that reproduces it.

mod common;

use std::path::Path;

use common::*;
use cow::{Codec, Compression};
use delta::write::{CowOptions, write_cow};
use delta::{MemImage, NoProgress, PlanOptions};
use merge::MergeOptions;

const BLOCKS: usize = 96;

/// An old image and a new one made from it by a few random edits.
fn make_pair(seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let old = noise(seed ^ 0x5eed, BLOCKS * BS);
    let mut new = old.clone();
    for _ in 0..rng.usize(1..7) {
        let len = rng.usize(1..24) * BS;
        let at = rng.usize(..BLOCKS * BS - len);
        match rng.u8(..5) {
            // A region moved by whole blocks or by a byte shift, up or down.
            0 | 1 => {
                let by = if rng.bool() {
                    rng.usize(1..6) * BS
                } else {
                    rng.usize(1..3 * BS)
                };
                let to = if rng.bool() {
                    (at + by).min(BLOCKS * BS - len)
                } else {
                    at.saturating_sub(by)
                };
                let src = new[at..at + len].to_vec();
                new[to..to + len].copy_from_slice(&src);
            }
            2 => rng.fill(&mut new[at..at + len]),
            3 => new[at..at + len].fill(0),
            // Small edits in place: XOR against the block itself.
            _ => {
                for i in (at..at + len).step_by(997) {
                    new[i] = new[i].wrapping_add(1);
                }
            }
        }
    }
    (old, new)
}

/// Writes the update (with its ops in block order and the merge order as
/// sequence data when `block_order`); returns how many XORs
/// `far_xor_blocks` turned into REPLACEs.
fn write_update(
    old: &[u8],
    new: &[u8],
    path: &Path,
    far_xor_blocks: u64,
    block_order: bool,
) -> u64 {
    let (o, n) = (
        MemImage::new("old", old.to_vec()),
        MemImage::new("new", new.to_vec()),
    );
    let opts = PlanOptions {
        threads: 1,
        far_xor_blocks,
        ..PlanOptions::default()
    };
    let plan = delta::plan(&o, &n, &opts, &NoProgress).expect("plan");
    let cow = CowOptions {
        version: 3,
        compression: Compression {
            codec: Codec::Lz4,
            level: None,
        },
        compression_factor: 16384,
        threads: 1,
        block_order,
    };
    write_cow(&plan, &o, &n, path, &cow, &NoProgress).expect("write COW");
    plan.census.far_xors
}

#[test]
fn planner_updates_merge_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let cow_path = dir.path().join("u.cow");
    let mut early_total = 0;
    let mut crashes = 0;
    let mut far_xors = 0;
    for seed in 0..100u64 {
        let (old, new) = make_pair(seed);
        // Every third update without the XORs that read blocks rewritten
        // more than 2 blocks away (`vabc diff --far-xor-blocks`).
        // Every other one with its ops in block order (`vabc diff
        // --block-order`), which the merge reads through the sequence data.
        let far = if seed % 3 == 2 { 2 } else { 0 };
        far_xors += write_update(&old, &new, &cow_path, far, seed % 2 == 1);
        let cow_bytes = std::fs::read(&cow_path).unwrap();
        for early_blocks in [1024, 0] {
            // Small windows: many of them, both kinds, in a small update.
            let opts = MergeOptions {
                window_ops: 7,
                commit_ops: 5,
                direct_max_ops: 9,
                early_blocks,
                ..Default::default()
            };
            let (rep, sim) = fault_free(&cow_path, &old, opts);
            assert!(
                sim.after_crash(Crash::PowerLoss).0 == new,
                "seed {seed}, early {early_blocks}: wrong image"
            );
            early_total += rep.early_blocks;
            let events = sim.events();
            if events == 0 {
                continue;
            }
            let mut rng = fastrand::Rng::with_seed(seed * 31 + early_blocks as u64);
            let k = rng.u64(..events);
            let how = match rng.u8(..3) {
                0 => Crash::Stop,
                1 => Crash::PowerLoss,
                _ => Crash::Torn(rng.u64(..)),
            };
            let sc = Scenario {
                cow_bytes: &cow_bytes,
                old: &old,
                new: &new,
                opts,
                // Every other case is finished by a merger that writes
                // nothing early and copies every window, as snapuserd.
                resume_opts: (seed % 2 == 1).then_some(MergeOptions {
                    window_ops: 5,
                    commit_ops: 3,
                    direct_windows: false,
                    early_blocks: 0,
                    ..Default::default()
                }),
            };
            crash_and_resume(&sc, k, how, Engine::Uring, dir.path());
            crashes += 1;
        }
    }
    eprintln!("{crashes} crash points; {early_total} blocks written early; {far_xors} far XORs");
    assert!(early_total > 0 && crashes >= 150, "{early_total} {crashes}");
    assert!(far_xors > 0, "no update had a far XOR to replace");
}
