//! Fuzz the AVB footer / vbmeta / hashtree descriptor parser and the
//! veritysetup superblock parser, and verify whatever tree they describe.
//! The same body runs over the corpus in the normal test run
//! (crates/verity/tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    verity::fuzzing::exercise_image(data);
});
