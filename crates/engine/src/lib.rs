//! Transport-free block engine for serving a Virtual A/B snapshot.
//!
//! A [`BlockDevice`] answers reads at any byte offset and length. It is `&self`,
//! `Send + Sync` and re-entrant, so any number of transport threads (FUSE workers, NBD
//! connections, and later one thread per ublk queue) call it at once without a lock
//! around the device. Calls block on `pread` and decompression; an async or queue-based
//! frontend (ublk with one io_uring per queue) runs them on its queue threads or a
//! blocking pool and completes the request with the result, which is why the interface is
//! a plain "fill this buffer" call and not tied to any executor.
//!
//! ```text
//!   fuse / nbd / (ublk) frontends           serve crate
//!              │  read_at(buf, offset)
//!   ┌──────────▼───────────┐
//!   │ BlockDevice (trait)  │                 this crate
//!   ├──────────┬───────────┤
//!   │FileDevice│ CowEngine │── index (sorted extents, built at open)
//!   └──────────┴─────┬─────┘── decode pool (per-CPU workers) + unit cache
//!            base image (pread, O_DIRECT) + COW (cow::CowReader)
//! ```

mod cache;
mod cow_engine;
mod error;
mod io;
mod pool;
mod readahead;
mod uring;

use std::path::Path;
use std::sync::Arc;

pub use cow_engine::{
    BlockVerifier, CowEngine, CowEngineOptions, EngineStats, MergeGuard, MergeHook, MergeRedirect,
    PlannedRead, ReadInto, ReadPlan, ReadPlanner,
};
pub use error::{EngineError, Result};
pub use io::{AlignedBuf, DIRECT_ALIGN, HUGE_PAGE, ImageFile};
pub use pool::{PoolDesign, QueueDelays};
pub use readahead::{Readahead, ReadaheadOptions, ReadaheadStats};
pub use uring::{enter as io_uring_enter, usable as io_uring_usable};

/// Block size of the COW format and the engine's preferred I/O granularity.
pub const BLOCK_SIZE: usize = 4096;

/// A byte-addressed, concurrently readable block device.
pub trait BlockDevice: Send + Sync {
    /// Size of the device in bytes.
    fn size(&self) -> u64;

    /// Preferred I/O size; reads of any alignment are accepted.
    fn block_size(&self) -> u32 {
        BLOCK_SIZE as u32
    }

    /// Fills `buf` with the bytes at `[offset, offset + buf.len())`, which must lie inside
    /// the device. Buffers aligned to [`DIRECT_ALIGN`] let aligned base reads skip a copy.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;

    /// Writes are refused by the snapshot devices; the hook exists for a writable
    /// backend and for transports that must answer write requests.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        Err(EngineError::ReadOnly {
            offset,
            len: buf.len() as u64,
        })
    }

    /// Makes completed writes durable. Read-only devices have nothing to flush.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn is_read_only(&self) -> bool {
        true
    }

    /// The device's read planner, for frontends that issue the file reads themselves
    /// (see [`ReadPlanner`]); `None` when every read must go through `read_at`.
    fn planner(&self) -> Option<&dyn ReadPlanner> {
        None
    }

    /// Whether reads are checked (a dm-verity verifier) in a step that can run apart
    /// from the read: [`Self::read_unchecked`], then [`Self::check`]. A reader ahead of
    /// the requests ([`Readahead`]) then keeps the disk busy while other threads hash.
    fn separate_check(&self) -> bool {
        false
    }

    /// Reads as [`Self::read_at`] does but without the check; the bytes must pass
    /// [`Self::check`] before they are used.
    fn read_unchecked(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.read_at(buf, offset)
    }

    /// Checks bytes that [`Self::read_unchecked`] returned for `offset`, on this thread.
    fn check(&self, _data: &[u8], _offset: u64) -> Result<()> {
        Ok(())
    }

    /// `[offset, offset + len)` as runs that read as zeros with nothing stored for them
    /// and runs of data, in order, covering the range; for clients that skip zeros (NBD
    /// block status). "Data" is never wrong, so the default is one run of it.
    fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Allocation>> {
        check_range_u64(offset, len, self.size())?;
        Ok(vec![Allocation { len, zero: false }])
    }
}

/// A run of [`BlockDevice::allocation`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub len: u64,
    /// Every byte reads as zero, and nothing is stored for them.
    pub zero: bool,
}

/// Appends a run to `runs`, extending the last one when it is of the same kind.
pub fn push_allocation(runs: &mut Vec<Allocation>, len: u64, zero: bool) {
    match runs.last_mut() {
        _ if len == 0 => {}
        Some(last) if last.zero == zero => last.len += len,
        _ => runs.push(Allocation { len, zero }),
    }
}

impl<T: BlockDevice + ?Sized> BlockDevice for Arc<T> {
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn block_size(&self) -> u32 {
        (**self).block_size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        (**self).read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        (**self).write_at(buf, offset)
    }
    fn flush(&self) -> Result<()> {
        (**self).flush()
    }
    fn is_read_only(&self) -> bool {
        (**self).is_read_only()
    }
    fn planner(&self) -> Option<&dyn ReadPlanner> {
        (**self).planner()
    }
    fn separate_check(&self) -> bool {
        (**self).separate_check()
    }
    fn read_unchecked(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        (**self).read_unchecked(buf, offset)
    }
    fn check(&self, data: &[u8], offset: u64) -> Result<()> {
        (**self).check(data, offset)
    }
    fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Allocation>> {
        (**self).allocation(offset, len)
    }
}

/// Checks that `[offset, offset + len)` lies inside a device of `size` bytes.
pub fn check_range(offset: u64, len: usize, size: u64) -> Result<()> {
    check_range_u64(offset, len as u64, size)
}

/// [`check_range`] for a length that need not fit in memory.
pub fn check_range_u64(offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(EngineError::OutOfRange { offset, len, size }),
    }
}

/// A plain image file served read-only: the baseline for tests and benchmarks.
#[derive(Debug)]
pub struct FileDevice {
    file: ImageFile,
}

impl FileDevice {
    /// Opens `path` (a regular file or block device); see [`ImageFile::open`] for `direct`.
    pub fn open(path: &Path, direct: bool) -> Result<FileDevice> {
        Ok(FileDevice {
            file: ImageFile::open(path, direct)?,
        })
    }
}

impl BlockDevice for FileDevice {
    fn size(&self) -> u64 {
        self.file.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(offset, buf.len(), self.size())?;
        self.file.read_exact_at(buf, offset)
    }

    fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Allocation>> {
        check_range_u64(offset, len, self.size())?;
        let mut runs = Vec::new();
        self.file.push_allocation(offset, offset + len, &mut runs);
        Ok(runs)
    }
}
