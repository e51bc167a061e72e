//! Fuzz bspatch (BSDIFF40 and AOSP's BSDF2, with every stream codec) with arbitrary
//! old data and patches. The same body runs over the corpus in the normal test run
//! (crates/payload/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    payload::fuzzing::exercise_bspatch(data);
});
