//! What can go wrong reading, checking and applying a payload, each naming where: the
//! source and byte offset, or the partition and operation.

/// A payload error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or device could not be read or written.
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    /// The payload's bytes are not a valid payload.
    #[error("{source_name}: {what}{}", at(*offset))]
    Format {
        /// The payload (file, URL, or `ZIP!payload.bin`).
        source_name: String,
        /// Byte offset in the payload, where there is one.
        offset: Option<u64>,
        /// What is wrong.
        what: String,
    },
    /// An operation is invalid, or its data or source does not check.
    #[error("partition {partition}, operation {index} ({op}): {what}")]
    Op {
        /// The partition.
        partition: String,
        /// The operation's index in the partition, from 0.
        index: usize,
        /// The operation's type.
        op: &'static str,
        /// What is wrong.
        what: String,
    },
    /// An operation type this crate does not apply.
    #[error(
        "partition {partition}, operation {index}: {op} is not supported: vabc applies \
         REPLACE, REPLACE_BZ, REPLACE_XZ, REPLACE_ZSTD, ZERO, DISCARD, SOURCE_COPY, \
         SOURCE_BSDIFF, BROTLI_BSDIFF, PUFFDIFF, LZ4DIFF_BSDIFF, LZ4DIFF_PUFFDIFF and \
         ZUCCHINI (raw elements)"
    )]
    Unsupported {
        /// The partition.
        partition: String,
        /// The operation's index in the partition, from 0.
        index: usize,
        /// The operation's type.
        op: String,
    },
    /// A partition as a whole is wrong: missing, wrong size, wrong hash.
    #[error("partition {partition}: {what}")]
    Partition {
        /// The partition.
        partition: String,
        /// What is wrong.
        what: String,
    },
    /// A signature is missing or does not verify, or a key is unusable.
    #[error("{what}")]
    Signature {
        /// What is wrong.
        what: String,
    },
}

fn at(offset: Option<u64>) -> String {
    offset
        .map(|o| format!(" (at offset {o})"))
        .unwrap_or_default()
}

/// A result whose error is an [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn format(
        source_name: &str,
        offset: impl Into<Option<u64>>,
        what: impl Into<String>,
    ) -> Error {
        Error::Format {
            source_name: source_name.to_string(),
            offset: offset.into(),
            what: what.into(),
        }
    }

    pub(crate) fn op(
        partition: &str,
        index: usize,
        op: &crate::proto::InstallOperation,
        what: impl Into<String>,
    ) -> Error {
        Error::Op {
            partition: partition.to_string(),
            index,
            op: crate::format::op_name(op),
            what: what.into(),
        }
    }

    pub(crate) fn partition(partition: &str, what: impl Into<String>) -> Error {
        Error::Partition {
            partition: partition.to_string(),
            what: what.into(),
        }
    }

    pub(crate) fn signature(what: impl Into<String>) -> Error {
        Error::Signature { what: what.into() }
    }
}
