//! dm-verity hash trees, byte-compatible with `veritysetup format` (cryptsetup
//! 2.6), and unsigned AVB hashtree footers in avbtool's layout.
//!
//! - [`build_tree`] hashes a device into a tree (streaming, all cores, memory
//!   bounded by a few chunk buffers whatever the image size);
//! - [`verify_tree`] checks a whole device top down and names the first bad block;
//! - [`BlockVerifier`] checks single blocks as a server reads them, caching
//!   each tree block once it has been verified against its parent;
//! - [`Superblock`] is veritysetup's optional 512-byte header;
//! - [`avb`] writes and reads AVB footers, vbmeta blobs and hashtree descriptors.
//!
//! Layout rules and their sources (veritysetup, the kernel's dm-verity, avbtool) are in
//! docs/06-verifying.md.

pub mod avb;
mod build;
mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
mod hash;
mod params;
mod sha256x2;
mod superblock;
mod verifier;
mod verify;

pub use build::{Input, Progress, build_tree, build_tree_in_memory};
pub use error::{Error, Result};
pub use hash::{BlockHasher, MAX_DIGEST_SIZE};
pub use params::{
    Format, HashAlgorithm, Level, MAX_BLOCK_SIZE, MAX_SALT_SIZE, MIN_BLOCK_SIZE, Params,
    SUPERBLOCK_SIZE, TreeLayout, tree_offset,
};
pub use superblock::{Superblock, format_uuid, parse_uuid, random_bytes, random_uuid};
pub use vabc_io::{ReadAt, WriteAt};
pub use verifier::BlockVerifier;
pub use verify::{verify_in_memory, verify_levels, verify_tree};
