//! Fuzz the NBD server with arbitrary client byte streams: option haggling
//! and transmission requests. The same body runs over the corpus in the
//! normal test run (crates/serve/tests/nbd_fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    serve::fuzzing::exercise_nbd(data);
});
