//! Replays the fuzz corpus of the bundle reader (fuzz/corpus/bundle_read) through the
//! target's body in the normal test run, and regenerates its seeds: a small signed
//! bundle made through the library, and damaged copies of it.

#[path = "../../../fuzz/replay.rs"]
mod replay;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = bundle::fuzzing::image_pair(1, 48);
    let (good, _) = bundle::fuzzing::sample(dir.path(), old, new, None).unwrap();
    let mut out = vec![("good".to_string(), good.clone())];
    for (name, at) in [
        ("magic", 0),
        ("version", 8),
        ("manifest_len", 17),
        ("payload", good.len() - 40),
    ] {
        let mut b = good.clone();
        b[at] ^= 0x41;
        out.push((name.to_string(), b));
    }
    out.push(("truncated".into(), good[..good.len() * 2 / 3].to_vec()));
    out
}

#[test]
fn corpus_replays_without_panics() {
    let inputs = replay::inputs("bundle_read");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        bundle::fuzzing::exercise_read(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/bundle_read/seed_*"]
fn generate_seed_corpus() {
    replay::write_seeds("bundle_read", seeds());
}

#[test]
fn seeds_behave() {
    for (name, data) in seeds() {
        bundle::fuzzing::exercise_read(&data);
        let r = bundle::BundleReader::open(
            &data[..],
            std::path::Path::new("seed"),
            bundle::format::Trust::Unchecked,
        );
        match name.as_str() {
            "good" => assert!(r.is_ok()),
            "magic" | "version" | "manifest_len" => assert!(r.is_err(), "{name}"),
            _ => {}
        }
    }
}
