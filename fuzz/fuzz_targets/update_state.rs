//! Fuzz the device's update state file parser with arbitrary bytes. The same body
//! runs over the corpus in the normal test run (crates/update/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    update::fuzzing::exercise_parse(data);
});
