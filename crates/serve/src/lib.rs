//! Frontends that put a [`engine::BlockDevice`] in front of the kernel or of clients:
//!
//! * [`fuse`]: one read-only regular file (`DIR/disk.img`) through FUSE, with many
//!   requests in flight, `FOPEN_DIRECT_IO` and 1 MiB requests, answered through
//!   /dev/fuse or over FUSE-over-io_uring (per-CPU rings, [`fuse::uring`]);
//! * [`mount`]: the whole stack on top of it: loop device in direct-I/O mode + `mount -o
//!   ro` for ext4, or a file-backed EROFS mount with no loop device; torn down in reverse;
//! * [`nbd`]: an NBD server (fixed newstyle, read-only, many connections);
//! * [`verity`]: dm-verity checking of every block served (EIO on a mismatch);
//! * [`ublk`]: a kernel block device `/dev/ublkbN` served through the ublk driver
//!   (unit-tested with a fake transport here, run on a real kernel in the VM tier);
//! * [`leftovers`]: what a killed daemon leaves behind, recorded and removed.

pub mod fuse;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod leftovers;
pub mod mount;
pub mod mountpoint;
pub mod nbd;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod pattern;
pub mod ublk;
pub mod verity;
mod workers;

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use engine::{BlockDevice, Readahead, ReadaheadOptions};

pub use workers::Workers;

/// Errors of the frontends.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    #[error("{path} is already a mount point; unmount it first or choose another directory")]
    Busy { path: PathBuf },
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error("bad NBD address {addr:?}: {msg}")]
    Address { addr: String, msg: String },
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    #[error(transparent)]
    Ublk(#[from] ublk::UblkError),
}

pub type Result<T> = std::result::Result<T, ServeError>;

pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> ServeError {
    let path = path.into();
    move |source| ServeError::Io(vabc_io::Error::new(op, path, source))
}

/// The read-ahead in front of a frontend's device.
pub(crate) type DevReadahead = Readahead<Arc<dyn BlockDevice>>;

/// The read-ahead a frontend reads `dev` through, when `opts` asks for one (`what`
/// names the export in errors).
pub(crate) fn readahead_for(
    dev: &Arc<dyn BlockDevice>,
    opts: Option<&ReadaheadOptions>,
    what: impl Into<PathBuf>,
) -> Result<Option<Arc<DevReadahead>>> {
    opts.map(|o| {
        Readahead::new(dev.clone(), o.clone())
            .map(Arc::new)
            .map_err(io_err("spawn readahead for", what))
    })
    .transpose()
}

/// Reads `[offset, offset + buf.len())` of `dev`, through `readahead` when there is one,
/// and hands the bytes to `reply`: straight from a read-ahead chunk when one holds them
/// all (no copy), otherwise from `buf`.
pub(crate) fn read_then<R>(
    dev: &dyn BlockDevice,
    readahead: Option<&DevReadahead>,
    buf: &mut [u8],
    offset: u64,
    reply: impl FnOnce(&[u8]) -> R,
) -> engine::Result<R> {
    match readahead {
        Some(ra) => ra.read_with(buf, offset, reply),
        None => dev.read_at(buf, offset).map(|()| reply(buf)),
    }
}

/// `lseek(SEEK_DATA)` (`hole` false) or `lseek(SEEK_HOLE)` on the served file, from
/// [`BlockDevice::allocation`]: the first byte at or after `offset` of data (or of a
/// zero run, the end of the file counting as one). `Err(errno)`: ENXIO at or past the
/// end, or when only zeros follow for SEEK_DATA.
pub(crate) fn seek_data_hole(
    dev: &dyn BlockDevice,
    offset: u64,
    hole: bool,
) -> std::result::Result<u64, i32> {
    // The map is asked for a window at a time: `cp` alternates SEEK_DATA and SEEK_HOLE
    // over the whole file, and a map to the end each time would make that quadratic.
    const WINDOW: u64 = 64 << 20;
    let size = dev.size();
    if offset >= size {
        return Err(libc::ENXIO);
    }
    let mut at = offset;
    while at < size {
        let runs = dev
            .allocation(at, WINDOW.min(size - at))
            .map_err(|e| e.errno())?;
        for r in runs {
            if r.zero == hole {
                return Ok(at);
            }
            at += r.len;
        }
    }
    if hole { Ok(size) } else { Err(libc::ENXIO) }
}

/// Marks this process as part of the block I/O path so memory reclaim does not wait on
/// the I/O it is itself serving (libfuse#700). Needs CAP_SYS_RESOURCE.
// <linux/prctl.h>; not exported by the libc crate.
const PR_SET_IO_FLUSHER: libc::c_int = 57;

pub fn set_io_flusher() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only; no pointers are passed.
    let rc = unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
