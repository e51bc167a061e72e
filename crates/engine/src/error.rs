//! One error type for the engine. Every variant carries enough context (file, offset,
//! operation) to be printed as is, and `errno()` maps it to what a transport returns.

use std::path::PathBuf;

/// Errors from opening or reading a block device.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A system call on one of the backing files failed.
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    /// The COW file could not be opened or parsed, or one of its payloads failed to decode.
    #[error(transparent)]
    Cow(#[from] cow::CowError),
    /// The base image, the COW and the requested size do not fit together.
    #[error("{path}: {msg}")]
    Mismatch { path: PathBuf, msg: String },
    /// A read outside `[0, size)`.
    #[error("read of {len} bytes at offset {offset} is outside the device ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// The device is read-only.
    #[error("write of {len} bytes at offset {offset} refused: the device is read-only")]
    ReadOnly { offset: u64, len: u64 },
    /// A block verifier (dm-verity, later) rejected data.
    #[error("block {block} failed verification: {msg}")]
    Verify { block: u64, msg: String },
}

impl EngineError {
    /// The errno a transport should report for this error.
    pub fn errno(&self) -> i32 {
        match self {
            EngineError::OutOfRange { .. } => libc::EINVAL,
            EngineError::ReadOnly { .. } => libc::EPERM,
            _ => libc::EIO,
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;
