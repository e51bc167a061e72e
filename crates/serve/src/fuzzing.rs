//! The body of the NBD fuzz target, shared with the test that replays the
//! fuzz corpus in the normal test run. Not part of the stable API.

use engine::BlockDevice;

/// A device of `.0` bytes whose byte at `offset` is `offset % 251` (a prime,
/// so no power-of-two misplacement reads back the same bytes).
pub struct Pattern(pub u64);

impl BlockDevice for Pattern {
    fn size(&self) -> u64 {
        self.0
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> engine::Result<()> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = ((offset + i as u64) % 251) as u8;
        }
        Ok(())
    }
}

/// Feed `data` to the NBD server as everything one client sends, then hang
/// up. The server must never panic, hang or stall a later connection, and
/// whatever the client sent, it greets first. Returns what the server sent.
pub fn exercise_nbd(data: &[u8]) -> Vec<u8> {
    let out = crate::nbd::exercise_connection(data);
    let hello = crate::nbd::greeting();
    assert_eq!(
        out.get(..hello.len()),
        Some(&hello[..]),
        "the server did not greet first"
    );
    out
}
