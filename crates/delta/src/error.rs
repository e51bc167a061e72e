//! One error type for the crate. Variants about an input or output file
//! carry its path, and read failures the offset, so a user can find the
//! problem without a debugger.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeltaError {
    /// An input image or the output could not be opened, created, synced or
    /// renamed.
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    /// A read of an input image failed (or hit an unexpected end of file).
    #[error("{path}: read of {len} bytes at offset {offset} failed: {source}")]
    Read {
        path: PathBuf,
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    /// The image size is not a whole number of 4 KiB blocks.
    #[error(
        "{path}: size {size} bytes is not a multiple of 4096 (the COW format works on 4 KiB blocks; \
         {tail} trailing bytes); pad the image, or pass --pad to treat it as zero-padded"
    )]
    UnalignedSize { path: PathBuf, size: u64, tail: u64 },
    /// The image has more blocks than the COW format can address.
    #[error("{path}: {blocks} blocks of 4 KiB; the COW format addresses at most 2^32 blocks")]
    TooLarge { path: PathBuf, blocks: u64 },
    /// The planned merge order is not safe op by op (a planner bug: the
    /// COW is not written).
    #[error("internal error: planned merge order is unsafe: {0}")]
    UnsafeOrder(String),
    /// The COW writer, reader or validator reported an error.
    #[error(transparent)]
    Cow(#[from] cow::CowError),
    /// The finished COW did not read back as planned.
    #[error("{path}: read-back check failed: {msg}")]
    Verify { path: PathBuf, msg: String },
    /// The thread pool could not be created.
    #[error("cannot start {threads} worker threads: {msg}")]
    Threads { threads: usize, msg: String },
}

pub type Result<T, E = DeltaError> = std::result::Result<T, E>;
