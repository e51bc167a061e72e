//! Input images: regular files, block devices, or bytes in memory.
//!
//! The planner never holds a whole image: it reads 4 KiB-aligned chunks of
//! NEW and single candidate regions of OLD with positioned reads, so several
//! threads share one file descriptor without seeking.

use std::path::{Path, PathBuf};

use crate::BLOCK_SIZE;
use vabc_io::ReadAt;

use crate::error::{DeltaError, Result};

/// A read-only image addressed by byte offset: a [`ReadAt`] (reading past `size()` is
/// an error) with a size and a name. [`BlockImage::read_at`] is the read the planner
/// and the writer use: its errors are [`DeltaError`]s naming the image and the range,
/// or the one an implementation failed with ([`fail`]: the bundle's streaming
/// replayer says what it found instead).
pub trait BlockImage: ReadAt {
    /// Logical size in bytes (a multiple of 4096 for images the planner
    /// accepts).
    fn size(&self) -> u64;
    /// Name used in error messages.
    fn name(&self) -> &Path;
    /// Fill `buf` from `offset`, with the error a [`DeltaError`].
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read_exact_at(buf, offset)
            .map_err(|e| read_error(e, self.name(), offset, buf.len()))
    }
}

/// A [`DeltaError`] as the `io::Error` of a [`ReadAt`] read; [`BlockImage::read_at`]
/// gives it back as it was.
pub fn fail(e: DeltaError) -> std::io::Error {
    std::io::Error::other(e)
}

fn read_error(e: std::io::Error, path: &Path, offset: u64, len: usize) -> DeltaError {
    if !e.get_ref().is_some_and(|inner| inner.is::<DeltaError>()) {
        return DeltaError::Read {
            path: path.to_path_buf(),
            offset,
            len,
            source: e,
        };
    }
    match e.into_inner().map(|inner| inner.downcast::<DeltaError>()) {
        Some(Ok(d)) => *d,
        // Checked above: the error carries a DeltaError.
        _ => DeltaError::Verify {
            path: path.to_path_buf(),
            msg: format!("a read of {len} bytes at offset {offset} failed"),
        },
    }
}

fn past_end() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "read past the end of the image",
    )
}

/// An image file or block device.
///
/// With padding enabled, a size that is not a multiple of 4096 is rounded up
/// and the missing tail reads as zeros; the COW then describes the padded
/// image.
#[derive(Debug)]
pub struct ImageFile {
    /// A block device is read with `O_DIRECT`: a mounted file system's view of it in
    /// the page cache is not what the disk holds (`vabc_io::direct`).
    disk: vabc_io::Disk,
    path: PathBuf,
    /// Bytes actually present in the file or device.
    physical: u64,
    /// `physical` rounded up to 4 KiB when padding, else equal to it.
    logical: u64,
}

impl ImageFile {
    /// Open `path` (regular file or block device). Without `pad`, a size that
    /// is not a multiple of 4096 is rejected.
    pub fn open(path: &Path, pad: bool) -> Result<ImageFile> {
        let disk = vabc_io::Disk::open(path)
            .map_err(|source| DeltaError::Io(vabc_io::Error::new("open", path, source)))?;
        let physical = vabc_io::size_of(disk.file()).map_err(|source| {
            DeltaError::Io(vabc_io::Error::new("determine the size of", path, source))
        })?;
        let tail = physical % BLOCK_SIZE as u64;
        let logical = if tail == 0 {
            physical
        } else if pad {
            physical + (BLOCK_SIZE as u64 - tail)
        } else {
            return Err(DeltaError::UnalignedSize {
                path: path.to_path_buf(),
                size: physical,
                tail,
            });
        };
        let blocks = logical / BLOCK_SIZE as u64;
        if blocks > u64::from(u32::MAX) + 1 {
            return Err(DeltaError::TooLarge {
                path: path.to_path_buf(),
                blocks,
            });
        }
        Ok(ImageFile {
            disk,
            path: path.to_path_buf(),
            physical,
            logical,
        })
    }

    /// Bytes present in the file before any padding.
    pub fn physical_size(&self) -> u64 {
        self.physical
    }
}

impl ReadAt for ImageFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.logical)
            .ok_or_else(past_end)?;
        let present = end.min(self.physical).saturating_sub(offset) as usize;
        let (head, pad) = buf.split_at_mut(present);
        if !head.is_empty() {
            self.disk.read_exact_at(head, offset)?;
        }
        pad.fill(0);
        Ok(())
    }
}

impl BlockImage for ImageFile {
    fn size(&self) -> u64 {
        self.logical
    }

    fn name(&self) -> &Path {
        &self.path
    }
}

/// An image held in memory, for tests and small tools.
#[derive(Debug, Clone)]
pub struct MemImage {
    data: Vec<u8>,
    name: PathBuf,
}

impl MemImage {
    pub fn new(name: &str, data: Vec<u8>) -> MemImage {
        MemImage {
            data,
            name: PathBuf::from(name),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

impl ReadAt for MemImage {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.data.read_exact_at(buf, offset).map_err(|_| past_end())
    }
}

impl BlockImage for MemImage {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }

    fn name(&self) -> &Path {
        &self.name
    }
}
