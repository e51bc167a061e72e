//! Replays the fuzz corpus of the state-file target (fuzz/corpus/update_state) through
//! the target's body in the normal test run, and regenerates its seeds.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use std::path::Path;

use update::{PartitionState, State, Update, VerityRef};

fn seeds() -> Vec<(String, Vec<u8>)> {
    let u = Update {
        id: "ab".repeat(32),
        max_boot_attempts: 3,
        partitions: vec![PartitionState {
            name: "system".into(),
            base: "/dev/vda".into(),
            cow: "system.cow".into(),
            verity: Some(VerityRef {
                file: "system.verity".into(),
                root_hash: "cd".repeat(32),
            }),
            new_size: 8 << 20,
            new_sha256: "ef".repeat(32),
        }],
    };
    let installed = String::from_utf8(update::encode_state(&State::Installed {
        update: u.clone(),
        boot_attempts: 1,
    }))
    .unwrap();
    vec![
        ("none".into(), update::encode_state(&State::None)),
        ("installed".into(), installed.clone().into_bytes()),
        (
            "merging".into(),
            update::encode_state(&State::Merging { update: u }),
        ),
        (
            "newer".into(),
            installed
                .replace("\"schema_version\": 1", "\"schema_version\": 7")
                .into_bytes(),
        ),
        (
            "unknown_state".into(),
            installed
                .replace("\"installed\"", "\"sideways\"")
                .into_bytes(),
        ),
        (
            "negative_attempts".into(),
            installed
                .replace("\"boot_attempts\": 1", "\"boot_attempts\": -1")
                .into_bytes(),
        ),
        (
            "truncated".into(),
            installed.as_bytes()[..installed.len() / 2].to_vec(),
        ),
        ("empty".into(), Vec::new()),
    ]
}

#[test]
fn corpus_replays_without_panics() {
    let inputs = replay::inputs("update_state");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        update::fuzzing::exercise_parse(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/update_state/seed_*"]
fn generate_seed_corpus() {
    replay::write_seeds("update_state", seeds());
}

#[test]
fn seeds_behave() {
    for (name, data) in seeds() {
        update::fuzzing::exercise_parse(&data);
        let ok = update::parse_state(&data, Path::new("seed")).is_ok();
        assert_eq!(
            ok,
            matches!(name.as_str(), "none" | "installed" | "merging"),
            "{name}"
        );
    }
}
