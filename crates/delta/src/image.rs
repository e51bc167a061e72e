//! Input images: regular files, block devices, or bytes in memory.
//!
//! The planner never holds a whole image: it reads 4 KiB-aligned chunks of
//! NEW and single candidate regions of OLD with positioned reads, so several
//! threads share one file descriptor without seeking.

use std::path::{Path, PathBuf};

use crate::BLOCK_SIZE;
use crate::error::{DeltaError, Result};

/// A read-only image addressed by byte offset, whose reads fail with a [`DeltaError`]
/// naming the image and the range (and, for the bundle's streaming replayer, what it
/// found instead). Any `dyn BlockImage` is also a plain [`vabc_io::ReadAt`] (for
/// hashing it with `manifest`).
pub trait BlockImage: Sync {
    /// Logical size in bytes (a multiple of 4096 for images the planner
    /// accepts).
    fn size(&self) -> u64;
    /// Fill `buf` from `offset`. Reading past `size()` is an error.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Name used in error messages.
    fn name(&self) -> &Path;
}

impl vabc_io::ReadAt for dyn BlockImage + '_ {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        BlockImage::read_exact_at(self, buf, offset).map_err(std::io::Error::other)
    }
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

impl BlockImage for ImageFile {
    fn size(&self) -> u64 {
        self.logical
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let err = |source| DeltaError::Read {
            path: self.path.clone(),
            offset,
            len: buf.len(),
            source,
        };
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.logical)
            .ok_or_else(|| {
                err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "read past the end of the image",
                ))
            })?;
        let present = end.min(self.physical).saturating_sub(offset) as usize;
        let (head, pad) = buf.split_at_mut(present);
        if !head.is_empty() {
            vabc_io::ReadAt::read_exact_at(&self.disk, head, offset).map_err(|source| {
                DeltaError::Read {
                    path: self.path.clone(),
                    offset,
                    len: present,
                    source,
                }
            })?;
        }
        pad.fill(0);
        Ok(())
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

impl BlockImage for MemImage {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let start = usize::try_from(offset).ok();
        match start
            .and_then(|s| s.checked_add(buf.len()).map(|e| (s, e)))
            .filter(|&(_, e)| e <= self.data.len())
        {
            Some((s, e)) => {
                buf.copy_from_slice(&self.data[s..e]);
                Ok(())
            }
            None => Err(DeltaError::Read {
                path: self.name.clone(),
                offset,
                len: buf.len(),
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "read past the end of the image",
                ),
            }),
        }
    }

    fn name(&self) -> &Path {
        &self.name
    }
}
