//! Replays the fuzz corpus of the payload reader (fuzz/corpus/payload_read) through the
//! target's body in the normal test run, and regenerates its seeds: the sample full
//! payload, an incremental one, and damaged copies.

#[path = "../../../fuzz/replay.rs"]
mod replay;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let (full, _) = payload::fuzzing::sample_full(None);
    let (inc, _, _) = payload::fuzzing::sample_incremental(dir.path(), None);
    let mut out = vec![
        ("full".to_string(), full.clone()),
        ("incremental".into(), inc.clone()),
    ];
    for (name, at) in [
        ("magic", 0),
        ("version", 11),
        ("manifest_len", 19),
        ("manifest", 40),
    ] {
        let mut b = full.clone();
        b[at] ^= 0x41;
        out.push((name.to_string(), b));
    }
    out.push(("truncated".into(), inc[..inc.len() * 2 / 3].to_vec()));
    out
}

#[test]
fn corpus_replays_without_panics() {
    let inputs = replay::inputs("payload_read");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        payload::fuzzing::exercise_read(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/payload_read/seed_*"]
fn generate_seed_corpus() {
    replay::write_seeds("payload_read", seeds());
}

#[test]
fn seeds_behave() {
    for (name, data) in seeds() {
        payload::fuzzing::exercise_read(&data);
        let r = payload::fuzzing::open(&data);
        match name.as_str() {
            "full" | "incremental" | "truncated" => assert!(r.is_ok(), "{name}"),
            "magic" | "version" | "manifest_len" => assert!(r.is_err(), "{name}"),
            _ => {}
        }
    }
}
