//! The I/O floor under every vabc crate: one of each low-level piece, so that a fix
//! (an alignment rule, an errno kept, an interrupted wait retried) lands everywhere.
//!
//! - [`ReadAt`] / [`WriteAt`]: positional reads and writes of a file, a device or bytes
//!   in memory, from `&self`, so that many threads share one descriptor.
//! - [`direct`]: `O_DIRECT` opening, its alignment, and reads of any range through an
//!   aligned bounce buffer ([`direct::Disk`]: a disk as it is on the storage, not as a
//!   mounted file system's page cache shows it).
//! - [`AlignedBuf`]: buffers that `O_DIRECT` can fill, huge-page backed when large.
//! - [`size_of`]: a regular file's or a block device's size.
//! - [`temp`]: a temporary file beside an output, renamed over it once complete.
//! - [`ring`]: io_uring set-up and submission.
//! - [`Error`]: an I/O failure with what was done (op), where (path, offset) and the
//!   operating system's error (errno); the other crates' errors carry it.
//!
//! Everything here wraps the standard library, `tempfile` and `io-uring`; only the
//! ioctl for a block device's size and the huge-page buffer are written by hand, as no
//! maintained crate offers them without a much larger dependency.

#![warn(missing_docs)]

pub mod buf;
pub mod direct;
pub mod error;
pub mod read;
pub mod ring;
pub mod size;
pub mod temp;

pub use buf::{AlignedBuf, HUGE_PAGE};
pub use direct::{DIRECT_ALIGN, Direct, Disk, Image};
pub use error::{Error, Result, at, on};
pub use read::{ReadAt, ReadFn, WriteAt};
pub use size::size_of;
