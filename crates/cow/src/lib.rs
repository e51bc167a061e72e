//! The AOSP Virtual A/B COW format: reader, writer, merge order and the
//! snapshot view (base + COW).
//!
//! The format is Android's, byte for byte (versions 1, 2 and 3, see
//! docs/02-cow-format.md): a COW written by update_engine reads here and
//! a COW written here reads on a device.
//!
//! - [`mod@format`]: on-disk structures and constants.
//! - [`codec`]: the payload codecs (none, gz, brotli, lz4, zstd).
//! - [`reader`]: parse a COW into ops; random access to any op's payload.
//! - [`merge`]: AOSP's merge-order derivation and the op-by-op validator.
//! - [`writer`]: write v2 or v3 COWs, resume at a label.
//! - [`view`]: the new image as base + COW.

pub mod codec;
pub mod error;
pub mod format;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod merge;
pub mod reader;
pub mod view;
pub mod writer;

pub use codec::{Codec, Compression};
pub use error::{CowError, MergeOrderError, Result};
pub use format::{BLOCK_SIZE, Header, Op, OpKind, ResumePoint};
pub use reader::{CowReader, Footer, Label, OpenOptions};
pub use view::SnapshotView;
pub use writer::{CowSizeInfo, CowWriter, WriterOptions};
