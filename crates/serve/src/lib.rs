//! Frontends that put a [`engine::BlockDevice`] in front of the kernel or of clients:
//!
//! * [`fuse`]: one read-only regular file (`DIR/disk.img`) through FUSE, with many
//!   requests in flight, `FOPEN_DIRECT_IO` and 1 MiB requests;
//! * [`fuse_uring`]: the same file served over FUSE-over-io_uring (per-CPU rings);
//! * [`mount`]: the whole stack on top of it: loop device in direct-I/O mode + `mount -o
//!   ro` for ext4, or a file-backed EROFS mount with no loop device; torn down in reverse;
//! * [`nbd`]: an NBD server (fixed newstyle, read-only, many connections);
//! * [`verity`]: dm-verity checking of every block served (EIO on a mismatch);
//! * [`ublk`]: a kernel block device `/dev/ublkbN` served through the ublk driver
//!   (unit-tested with a fake transport; the kernel side is untested here).

pub mod fuse;
pub mod fuse_uring;
#[doc(hidden)]
pub mod fuzzing;
pub mod mount;
pub mod nbd;
pub mod ublk;
pub mod verity;
mod workers;

use std::io;
use std::path::PathBuf;

pub use workers::Workers;

/// Errors of the frontends.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
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
    move |source| ServeError::Io { op, path, source }
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
