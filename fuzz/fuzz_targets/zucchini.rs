//! Fuzz the zucchini patch reader and its raw elements' application with arbitrary
//! old data and (uncompressed) patches. The same body runs over the corpus in the
//! normal test run (crates/payload/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    payload::fuzzing::exercise_zucchini(data);
});
