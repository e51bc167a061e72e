//! Fuzz the Android OTA payload reader with arbitrary bytes: header, manifest (protobuf),
//! operations applied against an old image of zeros (every decompressor and bspatch).
//! The same body runs over the corpus in the normal test run
//! (crates/payload/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    payload::fuzzing::exercise_read(data);
});
