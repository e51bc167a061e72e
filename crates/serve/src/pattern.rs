//! A test device whose every byte is known: the fuzz targets' and the frontends'
//! tests' device. Not part of the stable API.

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
