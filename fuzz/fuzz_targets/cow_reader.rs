//! Fuzz the COW parser, payload decoders, merge-order validator and
//! snapshot view with arbitrary files. The same body runs over the corpus in
//! the normal test run (crates/cow/tests/bad_input.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cow::fuzzing::exercise_reader(data);
});
