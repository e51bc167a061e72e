//! Fuzz the FUSE request handler of the io_uring transport (the default) with
//! arbitrary request streams, as over /dev/fuse and as over the ring. The same body
//! runs over the corpus in the normal test run (crates/serve/tests/fuse_fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    serve::fuzzing::exercise_fuse(data);
});
