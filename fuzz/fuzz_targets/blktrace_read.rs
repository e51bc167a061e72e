//! Fuzz the blktrace file parser and btt's analysis with arbitrary bytes. The same
//! body runs over the corpus in the normal test run
//! (crates/blocktrace/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    blocktrace::fuzzing::exercise_blktrace(data);
});
