//! One positional-read trait for every crate (images, devices, views, bytes in memory).
//!
//! Reads need only `&self`, so one source is read from many threads without a lock and
//! without seeking.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// A random-access byte source.
pub trait ReadAt: Sync {
    /// Fills `buf` from `offset`, failing with `UnexpectedEof` when the source ends first.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// The underlying file, when there is one: bulk hashing maps it instead of copying
    /// it through `read`.
    fn as_file(&self) -> Option<&File> {
        None
    }
}

/// A random-access byte sink.
pub trait WriteAt {
    /// Writes all of `buf` at `offset`.
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
}

/// A closure as a [`ReadAt`]: `ReadFn(|buf, offset| ...)`, for sources made on the
/// spot (a view of a device, a test's pattern).
#[derive(Debug, Clone, Copy)]
pub struct ReadFn<F>(pub F);

impl<F: Fn(&mut [u8], u64) -> io::Result<()> + Sync> ReadAt for ReadFn<F> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (self.0)(buf, offset)
    }
}

impl ReadAt for File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
    fn as_file(&self) -> Option<&File> {
        Some(self)
    }
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl ReadAt for Vec<u8> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.as_slice().read_exact_at(buf, offset)
    }
}

impl<T: ReadAt + ?Sized> ReadAt for &T {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
    fn as_file(&self) -> Option<&File> {
        (**self).as_file()
    }
}

impl<T: ReadAt + ?Sized + Send> ReadAt for std::sync::Arc<T> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
    fn as_file(&self) -> Option<&File> {
        (**self).as_file()
    }
}

impl<T: ReadAt + ?Sized> ReadAt for Box<T> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
    fn as_file(&self) -> Option<&File> {
        (**self).as_file()
    }
}

impl WriteAt for File {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }
}

impl WriteAt for &File {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(*self, buf, offset)
    }
}

impl WriteAt for Vec<u8> {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        let end = start
            .checked_add(buf.len())
            .ok_or(io::ErrorKind::InvalidInput)?;
        if self.len() < end {
            self.resize(end, 0);
        }
        self[start..end].copy_from_slice(buf);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_in_memory_read_like_a_file_and_end_where_it_would() {
        let data: Vec<u8> = (0..100u8).collect();
        let mut b = [0u8; 10];
        data.read_exact_at(&mut b, 90).unwrap();
        assert_eq!(b[0], 90);
        let e = data.read_exact_at(&mut b, 91).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let f = ReadFn(|buf: &mut [u8], off: u64| {
            buf.fill(off as u8);
            Ok(())
        });
        f.read_exact_at(&mut b, 7).unwrap();
        assert_eq!(b, [7; 10]);
        let mut sink = Vec::new();
        sink.write_all_at(b"ab", 3).unwrap();
        assert_eq!(sink, b"\0\0\0ab");
    }
}
