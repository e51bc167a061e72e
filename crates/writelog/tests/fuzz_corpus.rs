//! Replays the fuzz corpus of the log reader (fuzz/corpus/writelog_read) through the
//! target's body in the normal test run, and regenerates its seeds.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use writelog::fuzzing::{Builder, sample_log};

fn seeds() -> Vec<(String, Vec<u8>)> {
    let good = sample_log();
    let mut bad_magic = good.clone();
    bad_magic[0] ^= 1;
    let mut huge_count = good.clone();
    huge_count[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut far_write = Builder::new(4096).write(0, &[7; 4096], 0).build();
    // Sector 2^61: its byte offset overflows.
    far_write[4096..4104].copy_from_slice(&(1u64 << 61).to_le_bytes());
    vec![
        ("sample".into(), good.clone()),
        (
            "sectors_4k".into(),
            Builder::new(4096).write(1, &[9; 8192], 0).flush().build(),
        ),
        ("bad_magic".into(), bad_magic),
        ("huge_count".into(), huge_count),
        ("truncated".into(), good[..good.len() - 100].to_vec()),
        ("far_write".into(), far_write),
        ("empty".into(), Vec::new()),
    ]
}

#[test]
fn corpus_replays_without_panics() {
    let inputs = replay::inputs("writelog_read");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        writelog::fuzzing::exercise_log(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/writelog_read/seed_*"]
fn generate_seed_corpus() {
    replay::write_seeds("writelog_read", seeds());
}

#[test]
fn seeds_behave() {
    for (name, data) in seeds() {
        writelog::fuzzing::exercise_log(&data);
        let ok = writelog::Log::read(&data[..], data.len() as u64, "seed".as_ref()).is_ok();
        assert_eq!(
            ok,
            matches!(name.as_str(), "sample" | "sectors_4k"),
            "{name}"
        );
    }
}
