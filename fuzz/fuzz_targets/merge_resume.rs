//! Fuzz the merge with arbitrary COW files, including whatever merge
//! progress, state byte and scratch area their headers claim: a resume must
//! never panic or write past either file, and a merge from the start must
//! end at the snapshot the COW describes. The same body runs over the corpus
//! in the normal test run (crates/merge/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    merge::fuzzing::exercise_merge(data);
});
