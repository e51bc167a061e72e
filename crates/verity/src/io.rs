//! Positioned I/O used by the builder and the verifiers.
//!
//! Positioned reads need only `&self`, so one source can be read from many
//! threads without a lock; that is what lets the block verifier be `Sync`.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// A random-access byte source.
pub trait ReadAt: Sync {
    /// Fills `buf` from `offset`, failing with `UnexpectedEof` when the source is shorter.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// The underlying file, when there is one: bulk hashing maps it instead
    /// of copying it through `read`.
    fn as_file(&self) -> Option<&File> {
        None
    }
}

/// A random-access byte sink.
pub trait WriteAt {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
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

/// Grows the vector (zero-filling any gap) as needed.
impl WriteAt for Vec<u8> {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::OutOfMemory)?;
        let end = start + buf.len();
        if self.len() < end {
            self.resize(end, 0);
        }
        self[start..end].copy_from_slice(buf);
        Ok(())
    }
}
