//! The update bundle: one signed file for a whole update, built for size and trust, that
//! the device turns into the COWs it serves and merges.
//!
//! A COW is the device form of an update: AOSP's layout, a 2 MiB scratch area, op
//! records, each payload compressed on its own so that any block reads at once. It is
//! a poor form to ship. A bundle carries, per partition, the *plan* the COW is written
//! from (which op makes each block, and the merge order) and the new data the COW's
//! REPLACE and XOR ops need, compressed as one long zstd stream instead of one unit at
//! a time; the device runs the same deterministic COW writer on it
//! ([`delta::write::write_cow`]) and gets, byte for byte, the COW the host would have
//! written, which the signed manifest names by its sha256.
//!
//! Layout (little-endian; `docs/04-bundle.md` has the field-by-field description):
//!
//! ```text
//! header (32 bytes)  magic "VABCBNDL", format version, manifest and signature lengths
//! manifest           JSON (BundleManifest): partitions, their base and new identities,
//!                    the COW they make, their payloads' offsets, lengths and sha256
//! signature          Ed25519 over header + manifest (absent in an unsigned bundle)
//! payloads           per partition, in manifest order: plan, then data stream
//! ```
//!
//! Everything after the signature is bound to it through the manifest's hashes, so a
//! reader checks the signature first and each payload's sha256 as it streams through
//! it; nothing a payload makes is kept (renamed into place) before its hash matched.
//!
//! * [`format`](mod@format): the header, the manifest, reading and writing the container;
//! * [`sign`]: keys (PEM files as `openssl genpkey -algorithm ed25519` writes them),
//!   signing and verification, through `ed25519-dalek`;
//! * [`plan_wire`]: a [`delta::Plan`] as compact bytes;
//! * [`http`]: a bundle fetched from a URL with range requests, resuming cut
//!   connections;
//! * [`data`]: the new data of a plan as one compressed stream, recorded while the
//!   host writes its COW and replayed while the device writes its own.

pub mod data;
pub mod format;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod plan_wire;
pub mod sign;
pub mod source;

use std::io;
use std::path::PathBuf;

pub use format::{
    BundleManifest, BundleReader, BundleWriter, CowParams, FORMAT_VERSION, HEADER_SIZE, MAGIC,
    Partition, PayloadInfo, PayloadStream, PlanCounts, Release, SourceHealth, Trust, VerityInfo,
    read_head,
};
pub use source::Source;

/// Errors of reading, writing and checking bundles.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BundleError {
    /// A read or write failed.
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    /// The bundle is not one this version reads, or is damaged.
    #[error("{path}: offset {offset}: {msg}")]
    Format {
        /// The bundle.
        path: PathBuf,
        /// Where the problem is.
        offset: u64,
        /// What is wrong.
        msg: String,
    },
    /// The signature does not verify, or a signed bundle was expected.
    #[error("{path}: {msg}")]
    Signature {
        /// The bundle or key file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A payload's bytes do not hash to what the signed manifest says.
    #[error(
        "{path}: payload of partition {partition:?} (offset {offset}, {len} bytes) has sha256 {got}, the manifest says {want}: the bundle is damaged"
    )]
    PayloadHash {
        /// The bundle.
        path: PathBuf,
        /// The partition.
        partition: String,
        /// Where its payload starts in the bundle.
        offset: u64,
        /// Its length.
        len: u64,
        /// What the bytes hash to.
        got: String,
        /// What the manifest says.
        want: String,
    },
    /// Planning or writing a COW failed.
    #[error(transparent)]
    Delta(#[from] delta::DeltaError),
}

/// Results of this crate.
pub type Result<T, E = BundleError> = std::result::Result<T, E>;

pub(crate) fn io_err(
    path: impl Into<PathBuf>,
    op: &'static str,
    offset: u64,
) -> impl FnOnce(io::Error) -> BundleError {
    let path = path.into();
    move |source| BundleError::Io(vabc_io::Error::new(op, path, source).at(offset))
}
