//! Fuzz the update manifest parser with arbitrary bytes as manifest text. The same
//! body runs over the corpus in the normal test run
//! (crates/manifest/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    manifest::fuzzing::exercise_parse(data);
});
