//! One error type for the crate. Every variant that concerns a file carries
//! its path and the byte offset where the problem was found, so a user can
//! go straight to it with a hex dump.

use std::io;
use std::path::PathBuf;

use crate::format::OpKind;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CowError {
    /// A read, write, sync or open failed.
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    /// The file is not a valid COW (bad magic, impossible sizes, truncation…).
    #[error("{path}: offset {offset}: {msg}")]
    Format {
        path: PathBuf,
        offset: u64,
        msg: String,
    },
    /// A payload could not be decoded.
    #[error(
        "{path}: offset {offset}: cannot decode {codec} payload of {kind} op for new block {new_block}: {msg}"
    )]
    Decode {
        path: PathBuf,
        offset: u64,
        codec: &'static str,
        kind: OpKind,
        new_block: u64,
        msg: String,
    },
    /// A resume label that the file does not hold.
    #[error("{path}: label {label} not found")]
    LabelNotFound { path: PathBuf, label: u64 },
    /// The merge order would corrupt the image if merged op by op.
    #[error("{path}: merge order is unsafe: {source}")]
    MergeOrder {
        path: PathBuf,
        #[source]
        source: MergeOrderError,
    },
    /// The writer was used against the format's rules.
    #[error("{path}: {msg}")]
    Usage { path: PathBuf, msg: String },
    /// Compression failed (should not happen with valid input).
    #[error("{codec} compression failed: {msg}")]
    Compress { codec: &'static str, msg: String },
    /// Invalid option value.
    #[error("{0}")]
    InvalidOption(String),
}

/// Why a merge order is unsafe, with the position in the merge order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MergeOrderError {
    #[error(
        "position {position}: {kind} op for new block {new_block} reads source block {source_block}, which the op at position {overwritten_at} (new block {source_block}) already overwrote"
    )]
    SourceOverwritten {
        position: usize,
        kind: OpKind,
        new_block: u64,
        source_block: u64,
        overwritten_at: usize,
    },
    #[error(
        "position {position}: {kind} op for new block {new_block} comes after a REPLACE/ZERO op (position {replace_at}); ordered ops must all come first"
    )]
    OrderedAfterReplace {
        position: usize,
        kind: OpKind,
        new_block: u64,
        replace_at: usize,
    },
    #[error(
        "sequence entry {index} names new block {new_block}, which has no COPY/XOR/REPLACE/ZERO op"
    )]
    MissingSequenceOp { index: usize, new_block: u64 },
}

pub type Result<T, E = CowError> = std::result::Result<T, E>;

/// Attach path/offset context to an `io::Error`.
pub(crate) fn io_err<'a>(
    path: &'a std::path::Path,
    op: &'static str,
    offset: u64,
) -> impl FnOnce(io::Error) -> CowError + 'a {
    move |source| CowError::Io(vabc_io::Error::new(op, path, source).at(offset))
}

pub(crate) fn format_err(path: &std::path::Path, offset: u64, msg: impl Into<String>) -> CowError {
    CowError::Format {
        path: path.to_path_buf(),
        offset,
        msg: msg.into(),
    }
}
