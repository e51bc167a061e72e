//! Fuzz the update bundle reader with arbitrary bytes: header, manifest, payload plans
//! and data frames, replayed against a zero base. The same body runs over the corpus in
//! the normal test run (crates/bundle/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    bundle::fuzzing::exercise_read(data);
});
