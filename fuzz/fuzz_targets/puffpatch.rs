//! Fuzz puffpatch (puffin's PUF1 patches: header, extents, puffing the source,
//! bspatch, huffing the result) with arbitrary old data and patches. The same body
//! runs over the corpus in the normal test run (crates/payload/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    payload::fuzzing::exercise_puffpatch(data);
});
