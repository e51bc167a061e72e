//! Long crash soak over a real update (run by bench/crash-soak.sh):
//! VABC_SOAK_OLD, VABC_SOAK_NEW, VABC_SOAK_COW name the images and the COW,
//! VABC_SOAK_POINTS how many crash points (spread evenly over the merge's
//! writes and syncs, each tried as process stop, power loss and torn writes).

mod common;

use std::path::PathBuf;

use common::*;
use merge::MergeOptions;

#[test]
#[ignore]
fn crash_soak() {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("set {k}"));
    let old = std::fs::read(var("VABC_SOAK_OLD")).unwrap();
    let new = std::fs::read(var("VABC_SOAK_NEW")).unwrap();
    let cow_path = PathBuf::from(var("VABC_SOAK_COW"));
    let points: u64 = var("VABC_SOAK_POINTS").parse().unwrap();
    let cow_bytes = std::fs::read(&cow_path).unwrap();
    let opts = MergeOptions {
        window_ops: 64,
        commit_ops: 64,
        ..Default::default()
    };
    let (events, _) = dry_run(&cow_path, &old, opts);
    let dir = tempfile::tempdir().unwrap();
    let sc = Scenario {
        cow_bytes: &cow_bytes,
        old: &old,
        new: &new,
        opts,
    };
    let per_mode = points.div_ceil(3).max(1);
    let step = (events / per_mode).max(1);
    let mut done = 0;
    let mut k = 0;
    while k < events && done < points {
        for how in [Crash::Stop, Crash::PowerLoss, Crash::Torn(k + 1)] {
            let resume = if done % 2 == 0 {
                Engine::Uring
            } else {
                Engine::Sync
            };
            crash_and_resume(&sc, k, how, resume, dir.path());
            done += 1;
            if done % 100 == 0 {
                eprintln!("crash-soak: {done} points...");
            }
        }
        k += step;
    }
    println!(
        "crash-soak: {done} crash points over {events} I/O events, all resumed to the new image"
    );
}
