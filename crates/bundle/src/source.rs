//! Where a bundle's bytes come from. Installs read a bundle front to back; a
//! partition finished by an earlier, interrupted install needs none of its payload,
//! so a source can pass over bytes: a file seeks, a download asks for the next range
//! (a resumed install over HTTP fetches only what it still needs), anything else
//! reads and discards.

use std::io::{self, BufRead, Read, Seek};

/// A bundle's byte stream that can pass over bytes it is not asked for.
pub trait Source: Read + Send {
    /// Moves `n` bytes forward without returning them.
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let got = io::copy(&mut (&mut *self).take(n), &mut io::sink())?;
        if got < n {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the stream ended {} bytes early", n - got),
            ));
        }
        Ok(())
    }
}

impl Source for io::Stdin {}

impl Source for std::fs::File {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let n = i64::try_from(n).map_err(io::Error::other)?;
        self.seek_relative(n)
    }
}

impl Source for crate::http::RangeReader {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        self.jump(n)
    }
}

impl<S: Source> Source for io::BufReader<S> {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let buffered = self.buffer().len();
        if n <= buffered as u64 {
            self.consume(n as usize);
            return Ok(());
        }
        self.consume(buffered);
        self.get_mut().skip(n - buffered as u64)
    }
}

impl<S: Source + ?Sized> Source for Box<S> {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        (**self).skip(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skips_inside_and_past_the_buffer_land_on_the_same_byte_as_reads() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, &data).unwrap();
        f.rewind().unwrap();
        let mut r = io::BufReader::with_capacity(1000, f);
        let mut at = 0usize;
        let mut b = [0u8; 10];
        // Within the buffer, across its end, far past it.
        for skip in [5u64, 900, 1500, 4000] {
            r.read_exact(&mut b).unwrap();
            assert_eq!(b[..], data[at..at + 10]);
            at += 10;
            r.skip(skip).unwrap();
            at += skip as usize;
        }
        r.read_exact(&mut b).unwrap();
        assert_eq!(b[..], data[at..at + 10]);
        // Stdin's way: read and discard, and an early end is an error.
        struct Plain<'a>(&'a [u8]);
        impl Read for Plain<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.0.read(buf)
            }
        }
        impl Source for Plain<'_> {}
        let mut p = Plain(&data[..100]);
        p.skip(60).unwrap();
        assert_eq!(p.skip(60).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
