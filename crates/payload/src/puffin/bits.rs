//! Deflate's bit order (least significant bit first) read and written the way puffin
//! does, so that a stream puffin rewrites is rewritten here to the same bits.

/// Reads bits from a byte slice, least significant first.
pub(crate) struct BitReader<'a> {
    data: &'a [u8],
    /// Bits consumed.
    pos: u64,
}

impl<'a> BitReader<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        BitReader { data, pos: 0 }
    }

    /// Bits not yet consumed.
    pub(crate) fn available(&self) -> u64 {
        (self.data.len() as u64 * 8).saturating_sub(self.pos)
    }

    /// Bits consumed from the start.
    pub(crate) fn bit_offset(&self) -> u64 {
        self.pos
    }

    /// Bytes touched: a partly consumed byte counts.
    pub(crate) fn bytes_touched(&self) -> u64 {
        self.pos.div_ceil(8)
    }

    /// The next `n` (at most 32) bits without consuming them; bits past the end read
    /// as zeros.
    pub(crate) fn peek(&self, n: u32) -> u32 {
        debug_assert!(n <= 32);
        let byte = (self.pos / 8) as usize;
        let mut w = [0u8; 8];
        let have = self.data.len().saturating_sub(byte).min(5);
        if have > 0 {
            w[..have].copy_from_slice(&self.data[byte..byte + have]);
        }
        let v = u64::from_le_bytes(w) >> (self.pos % 8);
        (v & ((1u64 << n) - 1)) as u32
    }

    pub(crate) fn consume(&mut self, n: u32) {
        self.pos += u64::from(n);
    }

    /// The next `n` bits, consumed; `None` when fewer remain.
    pub(crate) fn read(&mut self, n: u32) -> Option<u32> {
        if self.available() < u64::from(n) {
            return None;
        }
        let v = self.peek(n);
        self.consume(n);
        Some(v)
    }

    /// Bits up to the next byte boundary.
    pub(crate) fn to_boundary(&self) -> u32 {
        ((8 - self.pos % 8) % 8) as u32
    }

    /// `n` whole bytes from a byte boundary, consumed.
    pub(crate) fn read_bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        debug_assert!(self.pos.is_multiple_of(8));
        let at = (self.pos / 8) as usize;
        let s = self.data.get(at..at.checked_add(n)?)?;
        self.pos += n as u64 * 8;
        Some(s)
    }
}

/// Writes bits least significant first into at most `cap` bytes, with puffin's
/// writer's exact behaviour: a value wider than the count it is written with leaves
/// its high bits in the byte being filled (puffin writes a byte's worth at a time),
/// so even a malformed puff stream becomes the same bytes here as there.
pub(crate) struct BitWriter {
    out: Vec<u8>,
    cap: usize,
    holder: u32,
    holder_bits: u32,
}

/// The output would pass its bound.
#[derive(Debug)]
pub(crate) struct Full;

impl BitWriter {
    pub(crate) fn new(cap: usize) -> Self {
        BitWriter {
            out: Vec::with_capacity(cap.min(64 << 20)),
            cap,
            holder: 0,
            holder_bits: 0,
        }
    }

    fn room_bits(&self) -> u64 {
        ((self.cap - self.out.len()) as u64 * 8).saturating_sub(u64::from(self.holder_bits))
    }

    pub(crate) fn write(&mut self, nbits: u32, bits: u32) -> Result<(), Full> {
        if self.room_bits() < u64::from(nbits) || nbits > 32 {
            return Err(Full);
        }
        let (mut n, mut bits) = (nbits, bits);
        while n > 0 {
            while self.holder_bits >= 8 {
                self.out.push(self.holder as u8);
                self.holder >>= 8;
                self.holder_bits -= 8;
            }
            while self.holder_bits < 24 && n > 0 {
                self.holder |= (bits & 0xff) << self.holder_bits;
                let m = n.min(8);
                self.holder_bits += m;
                bits = bits.checked_shr(m).unwrap_or(0);
                n -= m;
            }
        }
        Ok(())
    }

    /// Fills the byte being written with the low bits of `bits`.
    pub(crate) fn write_boundary(&mut self, bits: u32) -> Result<(), Full> {
        self.write((8 - (self.holder_bits & 7)) & 7, bits)
    }

    /// Whole bytes, from a byte boundary.
    pub(crate) fn write_bytes(&mut self, bytes: &[u8]) -> Result<(), Full> {
        if self.room_bits() < bytes.len() as u64 * 8 || !self.holder_bits.is_multiple_of(8) {
            return Err(Full);
        }
        self.flush()?;
        self.out.extend_from_slice(bytes);
        Ok(())
    }

    /// Pads the last byte with zeros and writes out what is held.
    pub(crate) fn flush(&mut self) -> Result<(), Full> {
        self.write_boundary(0)?;
        while self.holder_bits > 0 {
            self.out.push(self.holder as u8);
            self.holder >>= 8;
            self.holder_bits -= 8;
        }
        Ok(())
    }

    /// The bytes written (after [`flush`](Self::flush)).
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.out
    }

    pub(crate) fn len(&self) -> usize {
        self.out.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_written_read_back_in_order() {
        let mut w = BitWriter::new(16);
        let fields = [(3, 5), (5, 17), (1, 1), (16, 0xbeef), (7, 99), (2, 2)];
        for (n, v) in fields {
            w.write(n, v).unwrap();
        }
        w.flush().unwrap();
        let b = w.into_bytes();
        let mut r = BitReader::new(&b);
        for (n, v) in fields {
            assert_eq!(r.read(n), Some(v));
        }
        assert!(r.available() < 8);
    }

    #[test]
    fn the_bound_holds() {
        let mut w = BitWriter::new(1);
        w.write(8, 1).unwrap();
        assert!(w.write(1, 1).is_err());
        let mut r = BitReader::new(&[0xff]);
        assert_eq!(r.read(9), None);
        assert_eq!(r.read(8), Some(0xff));
    }
}
