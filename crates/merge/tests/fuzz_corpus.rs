//! Replays the fuzz corpora through the merge fuzz target's body in the
//! normal test run (fuzz/corpus/merge_resume, and the COW reader's corpus:
//! any COW is a merge input), and regenerates the merge seeds: updates with
//! a small scratch area, fresh and stopped at points all over a merge.

mod common;
#[path = "../../../fuzz/replay.rs"]
mod replay;

use common::*;
use cow::{Codec, CowReader};
use merge::{Merge, MergeOptions};

/// (name, COW bytes): two updates (v3 lz4, v2 gz) with a 64 KiB scratch
/// area (14-op windows), fresh and as left by a merge stopped at several
/// writes or syncs (some with a published scratch window).
fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    for (version, codec) in [(3u16, Codec::Lz4), (2, Codec::Gz)] {
        let p = dir.path().join(format!("v{version}.cow"));
        // 64 KiB: 14-op windows, and inputs of ~70 KiB instead of 2 MiB.
        let (old, _new) = make_update_with(&p, 64, version, codec, 64 << 10);
        let cow = std::fs::read(&p).unwrap();
        out.push((format!("v{version}_{codec}_fresh"), cow.clone()));
        let (events, _) = dry_run(&p, &old, MergeOptions::default());
        let r = CowReader::open(&p).unwrap();
        for k in [2, 5, events / 3, events / 2, events - 2] {
            let m =
                Merge::new(&r, old.len() as u64, "base".into(), MergeOptions::default()).unwrap();
            let mut sim = SimDisk::new(old.clone(), cow.clone(), Some(k));
            assert!(
                m.run(&mut sim, &|_, _| {}).is_err(),
                "no crash at event {k}"
            );
            let (_, c) = sim.after_crash(Crash::Stop);
            if !out.iter().any(|(_, d)| *d == c) {
                out.push((format!("v{version}_{codec}_stop{k}"), c));
            }
        }
    }
    out
}

/// Regenerate the seed corpus: `cargo test -p vabc-merge --test fuzz_corpus -- --ignored`.
#[test]
#[ignore]
fn generate_seed_corpus() {
    replay::write_seeds("merge_resume", seeds());
}

#[test]
fn seeds_merge_to_the_snapshot() {
    let seeds = seeds();
    assert!(seeds.len() >= 8, "only {} distinct seeds", seeds.len());
    let checked = seeds
        .iter()
        .filter(|(_, d)| merge::fuzzing::exercise_merge(d) == merge::fuzzing::Checked::Snapshot)
        .count();
    // The fresh ones at least are checked against the snapshot.
    assert!(
        checked >= 2,
        "only {checked} seeds checked against the snapshot"
    );
}

#[test]
fn replay_fuzz_corpus() {
    let mut n = 0;
    let mut checked = 0;
    for target in ["merge_resume", "cow_reader"] {
        for data in replay::inputs(target) {
            if merge::fuzzing::exercise_merge(&data) == merge::fuzzing::Checked::Snapshot {
                checked += 1;
            }
            n += 1;
        }
    }
    assert!(n >= 100, "fuzz corpora have only {n} inputs");
    assert!(checked >= 2, "only {checked} inputs merged and checked");
}
