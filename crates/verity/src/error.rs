//! One error type for the crate. Every variant that concerns a file names it,
//! and every variant about on-disk content names the byte offset (and block
//! number where there is one), so a caller can print it as is.

use std::io;
use std::path::PathBuf;

/// Errors from building, checking and reading dm-verity trees and AVB footers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O call failed.
    #[error(transparent)]
    Io(#[from] vabc_io::Error),

    /// The parameters cannot describe a valid tree (bad block size, salt too long, ...).
    #[error("invalid verity parameters: {0}")]
    InvalidParams(String),

    /// A hash algorithm name this crate does not implement.
    #[error("unknown hash algorithm {0:?} (supported: sha1, sha256, sha512)")]
    UnknownAlgorithm(String),

    /// A file is shorter than the layout needs.
    #[error("{}: truncated: {what} needs {needed} bytes but the file has {actual}", path.display())]
    Truncated {
        path: PathBuf,
        what: String,
        needed: u64,
        actual: u64,
    },

    /// A data block's digest differs from the one stored in the leaf level.
    #[error("{}: data block {block} (offset {offset}) does not match its hash", path.display())]
    DataBlockMismatch {
        path: PathBuf,
        block: u64,
        offset: u64,
    },

    /// A tree block's digest differs from the one stored in its parent.
    #[error(
        "{}: hash tree block {index} of level {level} (offset {offset}) does not match its parent hash",
        path.display()
    )]
    HashBlockMismatch {
        path: PathBuf,
        /// 0 is the leaf level (digests of data blocks).
        level: usize,
        index: u64,
        offset: u64,
    },

    /// The top of the tree does not hash to the expected root hash.
    #[error("{}: root hash mismatch: block at offset {offset} hashes to {actual}, expected {expected}", path.display())]
    RootHashMismatch {
        path: PathBuf,
        offset: u64,
        expected: String,
        actual: String,
    },

    /// A block index past the end of the protected data.
    #[error("data block {block} is out of range: the tree covers {data_blocks} blocks")]
    BlockOutOfRange { block: u64, data_blocks: u64 },

    /// A buffer of the wrong length was passed for one data block.
    #[error("data block {block}: buffer is {len} bytes, expected {expected}")]
    BadBlockLength {
        block: u64,
        len: usize,
        expected: u32,
    },

    /// The dm-verity superblock is missing or inconsistent.
    #[error("{}: bad verity superblock at offset {offset}: {reason}", path.display())]
    BadSuperblock {
        path: PathBuf,
        offset: u64,
        reason: String,
    },

    /// An AVB footer, vbmeta header or descriptor is malformed.
    #[error("{}: bad AVB metadata at offset {offset}: {reason}", path.display())]
    BadAvb {
        path: PathBuf,
        offset: u64,
        reason: String,
    },

    /// An AVB operation that cannot be done on this image as asked.
    #[error("{}: {reason}", path.display())]
    AvbRefused { path: PathBuf, reason: String },

    /// The system random source failed (used for default salts and UUIDs).
    #[error("cannot get random bytes: {0}")]
    Random(String),
}

impl Error {
    /// True when the error means "content does not match its hash": the
    /// condition a block device must answer with EIO.
    pub fn is_integrity_error(&self) -> bool {
        matches!(
            self,
            Error::DataBlockMismatch { .. }
                | Error::HashBlockMismatch { .. }
                | Error::RootHashMismatch { .. }
        )
    }

    pub(crate) fn io(
        op: &'static str,
        path: &std::path::Path,
        offset: u64,
        source: io::Error,
    ) -> Self {
        Error::Io(vabc_io::Error::new(op, path, source).at(offset))
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;
