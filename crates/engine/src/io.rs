//! The base image and the COW file as the engine reads them (`vabc_io::Image`), with
//! its errors.
//!
//! With FUSE `direct_io` and a loop device in direct-I/O mode above us, the daemon's own
//! page cache of the base image is the last duplicate copy of the data
//! (docs/05-serving.md). Opening the base `O_DIRECT` removes it; the rare unaligned
//! reads (XOR sources at a byte offset, partial head/tail blocks) go through a bounce
//! buffer.

use std::os::fd::RawFd;
use std::path::Path;

pub use vabc_io::{AlignedBuf, DIRECT_ALIGN, HUGE_PAGE};
use vabc_io::{Direct, Image, ReadAt};

use crate::error::{EngineError, Result};

/// A read-only image file or block device read with `pread` (or io_uring).
#[derive(Debug)]
pub struct ImageFile {
    img: Image,
}

impl ImageFile {
    /// Opens `path` read-only. With `direct`, reads bypass the page cache; if the
    /// file system refuses `O_DIRECT` (tmpfs), they go through it.
    pub fn open(path: &Path, direct: bool) -> Result<ImageFile> {
        let mode = if direct {
            Direct::Always
        } else {
            Direct::Never
        };
        Ok(ImageFile {
            img: Image::open(path, mode)?,
        })
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        self.img.path()
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.img.size()
    }

    /// Appends `[pos, end)` of the file (inside it) to `runs`: holes as zeros, the rest
    /// as data (see [`crate::BlockDevice::allocation`]).
    pub fn push_allocation(&self, mut pos: u64, end: u64, runs: &mut Vec<crate::Allocation>) {
        while pos < end {
            let data = self.img.next_data(pos, end).unwrap_or(end);
            crate::push_allocation(runs, data - pos, true);
            let data_end = self.img.data_end(data, end);
            crate::push_allocation(runs, data_end - data, false);
            pos = data_end.max(data);
        }
    }

    /// Whether aligned reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.img.is_direct()
    }

    /// See [`Image::fd_for_parts`].
    pub(crate) fn fd_for_parts(&self, parts: &[&mut [u8]], offset: u64) -> Option<RawFd> {
        self.img.fd_for_parts(parts, offset)
    }

    /// Fills `buf` from `offset`. The range must lie inside the file.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.img
            .read_exact_at(buf, offset)
            .map_err(|e| EngineError::Io(vabc_io::Error::new("read", self.path(), e).at(offset)))
    }
}
