//! Fuzz the dm-log-writes log reader and the crash states made from what it read. The
//! same body runs over the corpus in the normal test run
//! (crates/writelog/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    writelog::fuzzing::exercise_log(data);
});
