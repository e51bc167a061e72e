//! Fuzz lz4diff (LZ4DIFF_BSDIFF and LZ4DIFF_PUFFDIFF patches: header, source
//! decompression, inner patch, recompression and block fixes) with arbitrary old data
//! and patches. The same body runs over the corpus in the normal test run
//! (crates/payload/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    payload::fuzzing::exercise_lz4diff(data);
});
