//! Replays the fuzz corpus of the manifest target (fuzz/corpus/manifest_parse) through
//! the target's body in the normal test run, and regenerates its seeds.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use std::path::Path;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let id = |seed: u8, size: u64| {
        let data: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(seed)).collect();
        manifest::ImageId::compute(&data, Path::new("x"), size).unwrap()
    };
    let good = manifest::Manifest {
        schema_version: manifest::SCHEMA_VERSION,
        base: id(3, 9000),
        new: id(5, (4 << 20) + 4096),
        cow_ops: 2,
        merged_op_hashes: Some("00000000000000010123456789abcdef".into()),
    };
    let text = good.to_json();
    let mut out = vec![
        ("good".to_string(), text.clone().into_bytes()),
        (
            "no_op_hashes".into(),
            manifest::Manifest {
                merged_op_hashes: None,
                ..good.clone()
            }
            .to_json()
            .into_bytes(),
        ),
        (
            "newer".into(),
            text.replace("\"schema_version\": 1", "\"schema_version\": 2")
                .into_bytes(),
        ),
        (
            "short_regions".into(),
            text.replacen("\"regions\": [", "\"regions\": [\"00\",", 1)
                .into_bytes(),
        ),
        (
            "odd_hashes".into(),
            text.replace("0123456789abcdef", "0123456789abcdeg")
                .into_bytes(),
        ),
        (
            "truncated".into(),
            text.as_bytes()[..text.len() / 2].to_vec(),
        ),
        ("empty".into(), Vec::new()),
    ];
    out.push((
        "huge_ops".into(),
        text.replace("\"cow_ops\": 2", "\"cow_ops\": 18446744073709551615")
            .into_bytes(),
    ));
    out
}

#[test]
fn corpus_replays_without_panics() {
    let inputs = replay::inputs("manifest_parse");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        manifest::fuzzing::exercise_parse(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/manifest_parse/seed_*"]
fn generate_seed_corpus() {
    replay::write_seeds("manifest_parse", seeds());
}

#[test]
fn seeds_behave() {
    for (name, data) in seeds() {
        manifest::fuzzing::exercise_parse(&data);
        let text = String::from_utf8(data).unwrap();
        let ok = manifest::Manifest::parse(&text, Path::new("seed")).is_ok();
        assert_eq!(
            ok,
            matches!(name.as_str(), "good" | "no_op_hashes"),
            "{name}"
        );
    }
}
