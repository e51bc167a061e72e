//! Android Verified Boot (AVB) hashtree footers, unsigned, in the layout
//! `avbtool add_hashtree_footer --do_not_generate_fec --algorithm NONE` writes
//! (AOSP `external/avb`, avbtool 1.3.0). All AVB integers are big-endian.
//!
//! ```text
//! [ image, zero-padded to the block size ]   tree_offset = padded image size
//! [ dm-verity format-1 tree, no superblock ]
//! [ vbmeta blob, zero-padded to the block size ]
//! [ hole up to partition_size - block_size ]
//! [ last block: zeros, then the 64-byte AvbFooter ]
//! ```
//!
//! FEC is not produced (avbtool itself shells out to an external `fec` tool);
//! the descriptor says so with `fec_num_roots = 0`. The vbmeta blob has an
//! empty authentication block: signing can be added by filling it and the
//! public key fields, which the header layout already carries.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use sha1::Digest as _;
use zerocopy::big_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::build::{Input, Progress, build_tree};
use crate::error::{Error, Result};
use crate::params::{Format, HashAlgorithm, Params};
use crate::superblock::random_bytes;

pub const FOOTER_SIZE: usize = 64;
pub const VBMETA_HEADER_SIZE: usize = 256;
const FOOTER_MAGIC: &[u8; 4] = b"AVBf";
const VBMETA_MAGIC: &[u8; 4] = b"AVB0";
/// avbtool's upper bounds, used to decide whether an image fits a partition.
const MAX_VBMETA_SIZE: u64 = 64 * 1024;
const MAX_FOOTER_SIZE: u64 = 4096;
/// avbtool's image block size (used for padding and the footer block).
pub const AVB_BLOCK_SIZE: u64 = 4096;
/// The release string avbtool 1.3.0 writes. Kept by default so the bytes match
/// images made by avbtool (and tools that compare vbmeta blobs).
pub const DEFAULT_RELEASE_STRING: &str = "avbtool 1.3.0";
pub const TAG_PROPERTY: u64 = 0;
pub const TAG_HASHTREE: u64 = 1;
pub const TAG_HASH: u64 = 2;
pub const TAG_KERNEL_CMDLINE: u64 = 3;
pub const TAG_CHAIN_PARTITION: u64 = 4;

/// libavb `AvbFooter` as it lies on disk.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct WireFooter {
    magic: [u8; 4],
    version_major: U32,
    version_minor: U32,
    original_image_size: U64,
    vbmeta_offset: U64,
    vbmeta_size: U64,
    reserved: [u8; 28],
}

/// libavb `AvbVBMetaImageHeader` as it lies on disk.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct WireVbmetaHeader {
    magic: [u8; 4],
    required_libavb_version_major: U32,
    required_libavb_version_minor: U32,
    authentication_data_block_size: U64,
    auxiliary_data_block_size: U64,
    algorithm_type: U32,
    hash_offset: U64,
    hash_size: U64,
    signature_offset: U64,
    signature_size: U64,
    public_key_offset: U64,
    public_key_size: U64,
    public_key_metadata_offset: U64,
    public_key_metadata_size: U64,
    descriptors_offset: U64,
    descriptors_size: U64,
    rollback_index: U64,
    flags: U32,
    rollback_index_location: U32,
    /// NUL-terminated.
    release_string: [u8; 48],
    reserved: [u8; 80],
}

/// libavb `AvbDescriptor`: what every descriptor starts with.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct WireDescriptorHeader {
    tag: U64,
    num_bytes_following: U64,
}

/// The fixed part of libavb `AvbHashtreeDescriptor`; the partition name, salt and
/// root digest follow.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct WireHashtreeDescriptor {
    header: WireDescriptorHeader,
    dm_verity_version: U32,
    image_size: U64,
    tree_offset: U64,
    tree_size: U64,
    data_block_size: U32,
    hash_block_size: U32,
    fec_num_roots: U32,
    fec_offset: U64,
    fec_size: U64,
    /// NUL-padded.
    hash_algorithm: [u8; 32],
    partition_name_len: U32,
    salt_len: U32,
    root_digest_len: U32,
    flags: U32,
    reserved: [u8; 60],
}

// libavb's sizes: a struct that drifts from them does not build.
const _: () = {
    assert!(size_of::<WireFooter>() == FOOTER_SIZE);
    assert!(size_of::<WireVbmetaHeader>() == VBMETA_HEADER_SIZE);
    assert!(size_of::<WireDescriptorHeader>() == 16);
    assert!(size_of::<WireHashtreeDescriptor>() == 180);
};

/// `s` in a NUL-padded field of `N` bytes, cut to `max` bytes.
fn padded<const N: usize>(s: &str, max: usize) -> [u8; N] {
    let mut field = [0u8; N];
    let n = s.len().min(max);
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
    field
}

/// The text of a NUL-padded field: up to its first NUL.
fn unpadded(field: &[u8]) -> String {
    let end = field.iter().position(|&c| c == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// The 64-byte footer at the very end of a partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footer {
    pub version_major: u32,
    pub version_minor: u32,
    pub original_image_size: u64,
    pub vbmeta_offset: u64,
    pub vbmeta_size: u64,
}

impl Footer {
    pub fn encode(&self) -> [u8; FOOTER_SIZE] {
        zerocopy::transmute!(WireFooter {
            magic: *FOOTER_MAGIC,
            version_major: U32::new(self.version_major),
            version_minor: U32::new(self.version_minor),
            original_image_size: U64::new(self.original_image_size),
            vbmeta_offset: U64::new(self.vbmeta_offset),
            vbmeta_size: U64::new(self.vbmeta_size),
            reserved: [0; 28],
        })
    }

    /// `None` when the bytes do not start with the footer magic.
    pub fn decode(b: &[u8; FOOTER_SIZE]) -> Option<Self> {
        let w: &WireFooter = zerocopy::transmute_ref!(b);
        if &w.magic != FOOTER_MAGIC {
            return None;
        }
        Some(Footer {
            version_major: w.version_major.get(),
            version_minor: w.version_minor.get(),
            original_image_size: w.original_image_size.get(),
            vbmeta_offset: w.vbmeta_offset.get(),
            vbmeta_size: w.vbmeta_size.get(),
        })
    }
}

/// The fixed 256-byte vbmeta header (libavb `AvbVBMetaImageHeader`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VbmetaHeader {
    pub required_libavb_version_major: u32,
    pub required_libavb_version_minor: u32,
    pub authentication_data_block_size: u64,
    pub auxiliary_data_block_size: u64,
    pub algorithm_type: u32,
    pub hash_offset: u64,
    pub hash_size: u64,
    pub signature_offset: u64,
    pub signature_size: u64,
    pub public_key_offset: u64,
    pub public_key_size: u64,
    pub public_key_metadata_offset: u64,
    pub public_key_metadata_size: u64,
    pub descriptors_offset: u64,
    pub descriptors_size: u64,
    pub rollback_index: u64,
    pub flags: u32,
    pub rollback_index_location: u32,
    pub release_string: String,
}

impl VbmetaHeader {
    pub fn encode(&self) -> [u8; VBMETA_HEADER_SIZE] {
        zerocopy::transmute!(WireVbmetaHeader {
            magic: *VBMETA_MAGIC,
            required_libavb_version_major: U32::new(self.required_libavb_version_major),
            required_libavb_version_minor: U32::new(self.required_libavb_version_minor),
            authentication_data_block_size: U64::new(self.authentication_data_block_size),
            auxiliary_data_block_size: U64::new(self.auxiliary_data_block_size),
            algorithm_type: U32::new(self.algorithm_type),
            hash_offset: U64::new(self.hash_offset),
            hash_size: U64::new(self.hash_size),
            signature_offset: U64::new(self.signature_offset),
            signature_size: U64::new(self.signature_size),
            public_key_offset: U64::new(self.public_key_offset),
            public_key_size: U64::new(self.public_key_size),
            public_key_metadata_offset: U64::new(self.public_key_metadata_offset),
            public_key_metadata_size: U64::new(self.public_key_metadata_size),
            descriptors_offset: U64::new(self.descriptors_offset),
            descriptors_size: U64::new(self.descriptors_size),
            rollback_index: U64::new(self.rollback_index),
            flags: U32::new(self.flags),
            rollback_index_location: U32::new(self.rollback_index_location),
            // Room for the terminating NUL.
            release_string: padded(&self.release_string, 47),
            reserved: [0; 80],
        })
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        let (w, _) = WireVbmetaHeader::ref_from_prefix(b).ok()?;
        if &w.magic != VBMETA_MAGIC {
            return None;
        }
        Some(VbmetaHeader {
            required_libavb_version_major: w.required_libavb_version_major.get(),
            required_libavb_version_minor: w.required_libavb_version_minor.get(),
            authentication_data_block_size: w.authentication_data_block_size.get(),
            auxiliary_data_block_size: w.auxiliary_data_block_size.get(),
            algorithm_type: w.algorithm_type.get(),
            hash_offset: w.hash_offset.get(),
            hash_size: w.hash_size.get(),
            signature_offset: w.signature_offset.get(),
            signature_size: w.signature_size.get(),
            public_key_offset: w.public_key_offset.get(),
            public_key_size: w.public_key_size.get(),
            public_key_metadata_offset: w.public_key_metadata_offset.get(),
            public_key_metadata_size: w.public_key_metadata_size.get(),
            descriptors_offset: w.descriptors_offset.get(),
            descriptors_size: w.descriptors_size.get(),
            rollback_index: w.rollback_index.get(),
            flags: w.flags.get(),
            rollback_index_location: w.rollback_index_location.get(),
            release_string: unpadded(&w.release_string),
        })
    }
}

/// libavb `AvbHashtreeDescriptor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashtreeDescriptor {
    pub dm_verity_version: u32,
    pub image_size: u64,
    pub tree_offset: u64,
    pub tree_size: u64,
    pub data_block_size: u32,
    pub hash_block_size: u32,
    pub fec_num_roots: u32,
    pub fec_offset: u64,
    pub fec_size: u64,
    pub hash_algorithm: String,
    pub partition_name: String,
    pub salt: Vec<u8>,
    pub root_digest: Vec<u8>,
    pub flags: u32,
}

/// Fixed part of the hashtree descriptor, including the 16-byte tag/length header.
const HASHTREE_FIXED: usize = size_of::<WireHashtreeDescriptor>();

impl HashtreeDescriptor {
    /// Tag, length and body, padded to a multiple of 8.
    pub fn encode(&self) -> Vec<u8> {
        let var = self.partition_name.len() + self.salt.len() + self.root_digest.len();
        let following =
            (HASHTREE_FIXED - size_of::<WireDescriptorHeader>() + var).next_multiple_of(8);
        let fixed = WireHashtreeDescriptor {
            header: WireDescriptorHeader {
                tag: U64::new(TAG_HASHTREE),
                num_bytes_following: U64::new(following as u64),
            },
            dm_verity_version: U32::new(self.dm_verity_version),
            image_size: U64::new(self.image_size),
            tree_offset: U64::new(self.tree_offset),
            tree_size: U64::new(self.tree_size),
            data_block_size: U32::new(self.data_block_size),
            hash_block_size: U32::new(self.hash_block_size),
            fec_num_roots: U32::new(self.fec_num_roots),
            fec_offset: U64::new(self.fec_offset),
            fec_size: U64::new(self.fec_size),
            hash_algorithm: padded(&self.hash_algorithm, 32),
            partition_name_len: U32::new(self.partition_name.len() as u32),
            salt_len: U32::new(self.salt.len() as u32),
            root_digest_len: U32::new(self.root_digest.len() as u32),
            flags: U32::new(self.flags),
            reserved: [0; 60],
        };
        let mut b = Vec::with_capacity(size_of::<WireDescriptorHeader>() + following);
        b.extend_from_slice(fixed.as_bytes());
        b.extend_from_slice(self.partition_name.as_bytes());
        b.extend_from_slice(&self.salt);
        b.extend_from_slice(&self.root_digest);
        b.resize(size_of::<WireDescriptorHeader>() + following, 0);
        b
    }

    /// Parses a whole descriptor (header included); `None` if malformed.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let (w, rest) = WireHashtreeDescriptor::ref_from_prefix(b).ok()?;
        if w.header.tag.get() != TAG_HASHTREE {
            return None;
        }
        let name_len = w.partition_name_len.get() as usize;
        let salt_len = w.salt_len.get() as usize;
        let root_len = w.root_digest_len.get() as usize;
        let end = name_len.checked_add(salt_len)?.checked_add(root_len)?;
        if end > rest.len() {
            return None;
        }
        let (name, rest) = rest.split_at(name_len);
        let (salt, rest) = rest.split_at(salt_len);
        let root = &rest[..root_len];
        Some(HashtreeDescriptor {
            dm_verity_version: w.dm_verity_version.get(),
            image_size: w.image_size.get(),
            tree_offset: w.tree_offset.get(),
            tree_size: w.tree_size.get(),
            data_block_size: w.data_block_size.get(),
            hash_block_size: w.hash_block_size.get(),
            fec_num_roots: w.fec_num_roots.get(),
            fec_offset: w.fec_offset.get(),
            fec_size: w.fec_size.get(),
            hash_algorithm: unpadded(&w.hash_algorithm),
            partition_name: String::from_utf8_lossy(name).into_owned(),
            salt: salt.to_vec(),
            root_digest: root.to_vec(),
            flags: w.flags.get(),
        })
    }

    /// dm-verity parameters this descriptor describes.
    pub fn verity_params(&self) -> Result<Params> {
        let p = Params {
            format: Format::from_u32(self.dm_verity_version)?,
            algorithm: self.hash_algorithm.parse()?,
            data_block_size: self.data_block_size,
            hash_block_size: self.hash_block_size,
            data_blocks: self.image_size / u64::from(self.data_block_size.max(1)),
            salt: self.salt.clone(),
        };
        p.validate()?;
        Ok(p)
    }
}

/// A descriptor from a vbmeta auxiliary block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Descriptor {
    Hashtree(HashtreeDescriptor),
    /// Any other tag, kept raw (header included).
    Other {
        tag: u64,
        bytes: Vec<u8>,
    },
}

/// Builds the vbmeta blob for `descriptors` with no signature.
pub fn vbmeta_blob(descriptors: &[u8], release_string: &str) -> Vec<u8> {
    let aux_size = (descriptors.len() as u64).next_multiple_of(64);
    let header = VbmetaHeader {
        required_libavb_version_major: 1,
        required_libavb_version_minor: 0,
        authentication_data_block_size: 0,
        auxiliary_data_block_size: aux_size,
        // avbtool places the (empty) public key and its metadata after the descriptors.
        public_key_offset: descriptors.len() as u64,
        public_key_metadata_offset: descriptors.len() as u64,
        descriptors_size: descriptors.len() as u64,
        release_string: release_string.to_string(),
        ..VbmetaHeader::default()
    };
    let mut blob = header.encode().to_vec();
    blob.extend_from_slice(descriptors);
    blob.resize(VBMETA_HEADER_SIZE + aux_size as usize, 0);
    blob
}

/// Options for [`add_hashtree_footer`].
#[derive(Debug, Clone)]
pub struct HashtreeFooterOptions {
    /// Final size of the partition; 0 appends without padding to a partition.
    pub partition_size: u64,
    pub partition_name: String,
    pub algorithm: HashAlgorithm,
    /// `None`: random, as long as the digest (avbtool's default).
    pub salt: Option<Vec<u8>>,
    pub release_string: String,
}

impl HashtreeFooterOptions {
    pub fn new(partition_size: u64, partition_name: &str) -> Self {
        HashtreeFooterOptions {
            partition_size,
            partition_name: partition_name.to_string(),
            algorithm: HashAlgorithm::Sha256,
            salt: None,
            release_string: DEFAULT_RELEASE_STRING.to_string(),
        }
    }
}

/// Tree size avbtool reserves for an image of `image_size` bytes
/// (`calc_hash_level_offsets`, one block size for data and hash).
fn avb_tree_size(image_size: u64, block_size: u64, slot: u64) -> u64 {
    let mut size = image_size;
    let mut total = 0;
    while size > block_size {
        let blocks = size.div_ceil(block_size);
        size = (blocks * slot).next_multiple_of(block_size);
        total += size;
    }
    total
}

/// What [`add_hashtree_footer`] wrote.
#[derive(Debug, Clone)]
pub struct FooterInfo {
    pub footer: Footer,
    pub descriptor: HashtreeDescriptor,
}

/// Appends a hash tree, an unsigned vbmeta blob with a hashtree descriptor and
/// an AVB footer to `path`, in place, as avbtool does.
///
/// Safety of the in-place change: every check (existing footer, partition
/// size) happens before the first write; the original bytes are never
/// modified; the footer is written last, after the rest is synced, so an
/// interrupted run never leaves a valid-looking footer; and on error the file
/// is truncated back to its original size.
///
/// Unlike avbtool, an image that already has a footer is refused rather than
/// rewritten, because rewriting would destroy the old metadata before the new
/// one is known to be good.
pub fn add_hashtree_footer(
    path: &Path,
    opts: &HashtreeFooterOptions,
    progress: Option<Progress<'_>>,
) -> Result<FooterInfo> {
    let refuse = |reason: String| Error::AvbRefused {
        path: path.to_path_buf(),
        reason,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| Error::io("open for writing", path, 0, e))?;
    let original = file
        .metadata()
        .map_err(|e| Error::io("stat", path, 0, e))?
        .len();
    if original >= FOOTER_SIZE as u64 {
        let mut b = [0u8; FOOTER_SIZE];
        let off = original - FOOTER_SIZE as u64;
        file.read_exact_at(&mut b, off)
            .map_err(|e| Error::io("read", path, off, e))?;
        if let Some(f) = Footer::decode(&b) {
            return Err(refuse(format!(
                "already has an AVB footer at offset {off} (original image size {}); \
                 start again from the original image",
                f.original_image_size
            )));
        }
    }
    if original == 0 {
        return Err(refuse("image is empty".into()));
    }
    if opts.partition_name.is_empty() {
        return Err(Error::InvalidParams("partition name is empty".into()));
    }
    let bs = AVB_BLOCK_SIZE;
    let digest_size = opts.algorithm.digest_size();
    let slot = digest_size.next_power_of_two() as u64;
    if opts.partition_size > 0 {
        if !opts.partition_size.is_multiple_of(bs) {
            return Err(refuse(format!(
                "partition size {} is not a multiple of the block size {bs}",
                opts.partition_size
            )));
        }
        let reserved =
            avb_tree_size(opts.partition_size, bs, slot) + MAX_VBMETA_SIZE + MAX_FOOTER_SIZE;
        let max_image = opts.partition_size.saturating_sub(reserved);
        if original > max_image {
            return Err(refuse(format!(
                "image size {original} exceeds the maximum image size {max_image} that fits a \
                 partition of {} bytes with its hash tree and metadata",
                opts.partition_size
            )));
        }
    }
    let salt = match &opts.salt {
        Some(s) => s.clone(),
        None => random_bytes(digest_size)?,
    };
    let padded = original.next_multiple_of(bs);
    let params = Params {
        format: Format::V1,
        algorithm: opts.algorithm,
        data_block_size: bs as u32,
        hash_block_size: bs as u32,
        data_blocks: padded / bs,
        salt,
    };
    let layout = params.layout()?;
    let tree_size = layout.tree_size();
    let vbmeta_offset = padded + tree_size;

    // The root is only known after hashing, but every size is known now, so
    // the fit check is complete before anything is written.
    let mut descriptor = HashtreeDescriptor {
        dm_verity_version: 1,
        image_size: padded,
        tree_offset: padded,
        tree_size,
        data_block_size: bs as u32,
        hash_block_size: bs as u32,
        fec_num_roots: 0,
        fec_offset: 0,
        fec_size: 0,
        hash_algorithm: opts.algorithm.name().to_string(),
        partition_name: opts.partition_name.clone(),
        salt: params.salt.clone(),
        root_digest: vec![0; digest_size],
        flags: 0,
    };
    let vbmeta_len = vbmeta_blob(&descriptor.encode(), &opts.release_string).len() as u64;
    let metadata_end = vbmeta_offset + vbmeta_len.next_multiple_of(bs);
    let footer_block = if opts.partition_size > 0 {
        if metadata_end + bs > opts.partition_size {
            return Err(refuse(format!(
                "image, tree and metadata need {} bytes, more than the partition size {}",
                metadata_end + bs,
                opts.partition_size
            )));
        }
        opts.partition_size - bs
    } else {
        metadata_end
    };

    let result = write_footer(
        &file,
        path,
        original,
        &params,
        &mut descriptor,
        &opts.release_string,
        footer_block,
        progress,
    );
    match result {
        Ok(footer) => Ok(FooterInfo { footer, descriptor }),
        Err(e) => {
            // Best effort: the original bytes were never touched, so cutting
            // the file back restores the input exactly.
            let _ = file.set_len(original);
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn write_footer(
    file: &File,
    path: &Path,
    original: u64,
    params: &Params,
    descriptor: &mut HashtreeDescriptor,
    release_string: &str,
    footer_block: u64,
    progress: Option<Progress<'_>>,
) -> Result<Footer> {
    let padded = descriptor.image_size;
    let bs = AVB_BLOCK_SIZE;
    if padded > original {
        let zeros = vec![0u8; (padded - original) as usize];
        file.write_all_at(&zeros, original)
            .map_err(|e| Error::io("write", path, original, e))?;
    }
    let data = Input {
        reader: file,
        name: path,
        len: padded,
    };
    let mut out = file;
    let root = build_tree(data, params, &mut out, path, padded, progress)?;
    descriptor.root_digest = root;
    let mut blob = vbmeta_blob(&descriptor.encode(), release_string);
    let vbmeta_size = blob.len() as u64;
    blob.resize(blob.len().next_multiple_of(bs as usize), 0);
    let vbmeta_offset = padded + descriptor.tree_size;
    file.write_all_at(&blob, vbmeta_offset)
        .map_err(|e| Error::io("write", path, vbmeta_offset, e))?;
    // The gap up to the footer block stays a hole, as avbtool leaves it.
    file.set_len(footer_block)
        .map_err(|e| Error::io("extend", path, footer_block, e))?;
    file.sync_all().map_err(|e| Error::io("sync", path, 0, e))?;
    let footer = Footer {
        version_major: 1,
        version_minor: 0,
        original_image_size: original,
        vbmeta_offset,
        vbmeta_size,
    };
    let mut last = vec![0u8; bs as usize];
    last[bs as usize - FOOTER_SIZE..].copy_from_slice(&footer.encode());
    file.write_all_at(&last, footer_block)
        .map_err(|e| Error::io("write", path, footer_block, e))?;
    file.sync_all().map_err(|e| Error::io("sync", path, 0, e))?;
    Ok(footer)
}

/// Everything `info` shows about an image.
#[derive(Debug, Clone)]
pub struct ImageInfo {
    pub image_size: u64,
    /// `None` for a bare vbmeta image.
    pub footer: Option<Footer>,
    pub header: VbmetaHeader,
    pub descriptors: Vec<Descriptor>,
    pub public_key: Vec<u8>,
}

/// Reads the footer (if any), vbmeta header and descriptors of `path`.
pub fn read_image_info(path: &Path) -> Result<ImageInfo> {
    let file = File::open(path).map_err(|e| Error::io("open", path, 0, e))?;
    let image_size = file
        .metadata()
        .map_err(|e| Error::io("stat", path, 0, e))?
        .len();
    read_image_info_at(&file, image_size, path)
}

/// [`read_image_info`] over any source of `image_size` bytes (`path` names it
/// in errors): lets the fuzz target parse images without touching a disk.
pub fn read_image_info_at(
    file: &(impl vabc_io::ReadAt + ?Sized),
    image_size: u64,
    path: &Path,
) -> Result<ImageInfo> {
    let bad = |offset: u64, reason: String| Error::BadAvb {
        path: path.to_path_buf(),
        offset,
        reason,
    };
    let read = |off: u64, len: u64| -> Result<Vec<u8>> {
        if off.checked_add(len).is_none_or(|end| end > image_size) {
            return Err(bad(
                off,
                format!("{len} bytes needed but the file has {image_size}"),
            ));
        }
        let mut b = vec![0u8; len as usize];
        vabc_io::ReadAt::read_exact_at(file, &mut b, off)
            .map_err(|e| Error::io("read", path, off, e))?;
        Ok(b)
    };
    let mut footer = None;
    if image_size >= FOOTER_SIZE as u64 {
        let off = image_size - FOOTER_SIZE as u64;
        let b: [u8; FOOTER_SIZE] = read(off, FOOTER_SIZE as u64)?
            .try_into()
            .map_err(|_| bad(off, "short footer".into()))?;
        footer = Footer::decode(&b);
        if let Some(f) = &footer
            && f.version_major != 1
        {
            return Err(bad(
                off,
                format!(
                    "unsupported footer version {}.{}",
                    f.version_major, f.version_minor
                ),
            ));
        }
    }
    let vb_off = footer.as_ref().map_or(0, |f| f.vbmeta_offset);
    let hb = read(vb_off, VBMETA_HEADER_SIZE as u64)?;
    let header = VbmetaHeader::decode(&hb).ok_or_else(|| {
        bad(
            vb_off,
            if footer.is_some() {
                "no vbmeta header (\"AVB0\") where the footer points".into()
            } else {
                "no AVB footer and no vbmeta header (\"AVB0\") at the start".into()
            },
        )
    })?;
    // Both sizes come from the file: an absurd one must be an error, not a
    // wrapped offset that happens to point inside it.
    let aux_off = (vb_off + VBMETA_HEADER_SIZE as u64)
        .checked_add(header.authentication_data_block_size)
        .filter(|&o| o <= image_size)
        .ok_or_else(|| {
            bad(
                vb_off,
                format!(
                    "authentication block of {} bytes runs past the end of the file",
                    header.authentication_data_block_size
                ),
            )
        })?;
    if header.auxiliary_data_block_size > MAX_VBMETA_SIZE * 16 {
        return Err(bad(
            aux_off,
            format!(
                "auxiliary block of {} bytes is implausible",
                header.auxiliary_data_block_size
            ),
        ));
    }
    let aux = read(aux_off, header.auxiliary_data_block_size)?;
    let slice = |o: u64, n: u64, what: &str| -> Result<&[u8]> {
        o.checked_add(n)
            .filter(|&end| end <= aux.len() as u64)
            .map(|end| &aux[o as usize..end as usize])
            .ok_or_else(|| {
                bad(
                    aux_off.saturating_add(o),
                    format!("{what} runs past the auxiliary block"),
                )
            })
    };
    let desc_bytes = slice(
        header.descriptors_offset,
        header.descriptors_size,
        "descriptors",
    )?;
    let public_key = slice(
        header.public_key_offset,
        header.public_key_size,
        "public key",
    )?
    .to_vec();
    let mut descriptors = Vec::new();
    let mut o = 0usize;
    while o < desc_bytes.len() {
        let at = aux_off + header.descriptors_offset + o as u64;
        let (head, _) = WireDescriptorHeader::ref_from_prefix(&desc_bytes[o..])
            .map_err(|_| bad(at, "truncated descriptor header".into()))?;
        let (tag, following) = (head.tag.get(), head.num_bytes_following.get());
        let total = following
            .checked_add(16)
            .filter(|&t| t <= (desc_bytes.len() - o) as u64)
            .ok_or_else(|| {
                bad(
                    at,
                    format!("descriptor of {following} bytes runs past the descriptor area"),
                )
            })? as usize;
        let body = &desc_bytes[o..o + total];
        let d = if tag == TAG_HASHTREE {
            Descriptor::Hashtree(
                HashtreeDescriptor::decode(body)
                    .ok_or_else(|| bad(at, "malformed hashtree descriptor".into()))?,
            )
        } else {
            Descriptor::Other {
                tag,
                bytes: body.to_vec(),
            }
        };
        descriptors.push(d);
        o += total;
    }
    Ok(ImageInfo {
        image_size,
        footer,
        header,
        descriptors,
        public_key,
    })
}

fn algorithm_name(t: u32) -> String {
    match t {
        0 => "NONE".into(),
        1 => "SHA256_RSA2048".into(),
        2 => "SHA256_RSA4096".into(),
        3 => "SHA256_RSA8192".into(),
        4 => "SHA512_RSA2048".into(),
        5 => "SHA512_RSA4096".into(),
        6 => "SHA512_RSA8192".into(),
        n => format!("UNKNOWN({n})"),
    }
}

/// Formats `info` the way `avbtool info_image` prints it.
pub fn format_image_info(info: &ImageInfo) -> String {
    let mut o = String::new();
    // Writing to a String cannot fail.
    let _ = write_info(&mut o, info);
    o
}

fn write_info(o: &mut String, info: &ImageInfo) -> std::fmt::Result {
    if let Some(f) = &info.footer {
        writeln!(
            o,
            "Footer version:           {}.{}",
            f.version_major, f.version_minor
        )?;
        writeln!(o, "Image size:               {} bytes", info.image_size)?;
        writeln!(
            o,
            "Original image size:      {} bytes",
            f.original_image_size
        )?;
        writeln!(o, "VBMeta offset:            {}", f.vbmeta_offset)?;
        writeln!(o, "VBMeta size:              {} bytes", f.vbmeta_size)?;
        writeln!(o, "--")?;
    }
    let h = &info.header;
    writeln!(
        o,
        "Minimum libavb version:   {}.{}",
        h.required_libavb_version_major, h.required_libavb_version_minor
    )?;
    writeln!(o, "Header Block:             {VBMETA_HEADER_SIZE} bytes")?;
    writeln!(
        o,
        "Authentication Block:     {} bytes",
        h.authentication_data_block_size
    )?;
    writeln!(
        o,
        "Auxiliary Block:          {} bytes",
        h.auxiliary_data_block_size
    )?;
    if !info.public_key.is_empty() {
        writeln!(
            o,
            "Public key (sha1):        {}",
            hex::encode(sha1::Sha1::digest(&info.public_key))
        )?;
    }
    writeln!(
        o,
        "Algorithm:                {}",
        algorithm_name(h.algorithm_type)
    )?;
    writeln!(o, "Rollback Index:           {}", h.rollback_index)?;
    writeln!(o, "Flags:                    {}", h.flags)?;
    writeln!(o, "Rollback Index Location:  {}", h.rollback_index_location)?;
    writeln!(o, "Release String:           '{}'", h.release_string)?;
    writeln!(o, "Descriptors:")?;
    if info.descriptors.is_empty() {
        writeln!(o, "    (none)")?;
    }
    for d in &info.descriptors {
        match d {
            Descriptor::Hashtree(t) => {
                writeln!(o, "    Hashtree descriptor:")?;
                writeln!(o, "      Version of dm-verity:  {}", t.dm_verity_version)?;
                writeln!(o, "      Image Size:            {} bytes", t.image_size)?;
                writeln!(o, "      Tree Offset:           {}", t.tree_offset)?;
                writeln!(o, "      Tree Size:             {} bytes", t.tree_size)?;
                writeln!(
                    o,
                    "      Data Block Size:       {} bytes",
                    t.data_block_size
                )?;
                writeln!(
                    o,
                    "      Hash Block Size:       {} bytes",
                    t.hash_block_size
                )?;
                writeln!(o, "      FEC num roots:         {}", t.fec_num_roots)?;
                writeln!(o, "      FEC offset:            {}", t.fec_offset)?;
                writeln!(o, "      FEC size:              {} bytes", t.fec_size)?;
                writeln!(o, "      Hash Algorithm:        {}", t.hash_algorithm)?;
                writeln!(o, "      Partition Name:        {}", t.partition_name)?;
                writeln!(o, "      Salt:                  {}", hex::encode(&t.salt))?;
                writeln!(
                    o,
                    "      Root Digest:           {}",
                    hex::encode(&t.root_digest)
                )?;
                writeln!(o, "      Flags:                 {}", t.flags)?;
            }
            Descriptor::Other { tag, bytes } => {
                let kind = match *tag {
                    TAG_PROPERTY => "Property",
                    TAG_HASH => "Hash",
                    TAG_KERNEL_CMDLINE => "Kernel Cmdline",
                    TAG_CHAIN_PARTITION => "Chain Partition",
                    _ => "Unknown",
                };
                writeln!(o, "    {kind} descriptor (not decoded):")?;
                writeln!(o, "      Tag:                   {tag}")?;
                writeln!(o, "      Size:                  {} bytes", bytes.len())?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avb_tree_size_matches_verity_layout() {
        // 129 blocks: two leaf blocks plus a top block.
        assert_eq!(avb_tree_size(129 * 4096, 4096, 32), 3 * 4096);
        assert_eq!(avb_tree_size(128 * 4096, 4096, 32), 4096);
        assert_eq!(avb_tree_size(4096, 4096, 32), 0);
    }

    #[test]
    fn wire_structs_have_libavb_sizes() {
        use std::mem::offset_of;
        assert_eq!(size_of::<WireFooter>(), 64);
        assert_eq!(size_of::<WireVbmetaHeader>(), 256);
        assert_eq!(offset_of!(WireVbmetaHeader, release_string), 128);
        assert_eq!(size_of::<WireDescriptorHeader>(), 16);
        assert_eq!(size_of::<WireHashtreeDescriptor>(), 180);
        assert_eq!(offset_of!(WireHashtreeDescriptor, hash_algorithm), 72);
        assert_eq!(offset_of!(WireHashtreeDescriptor, partition_name_len), 104);
    }

    /// An image avbtool wrote (shared/verity-vectors, read in place): its footer,
    /// vbmeta header and hashtree descriptor decode to what `avbtool info_image`
    /// printed and encode back to the same bytes.
    #[test]
    fn avbtool_image_round_trips() {
        use std::io::Read;
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/verity-vectors/avb/avb_128blk_sha256_p1MiB.img.gz");
        let gz = File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut img = Vec::new();
        flate2::read::GzDecoder::new(gz)
            .read_to_end(&mut img)
            .unwrap();
        assert_eq!(img.len(), 1 << 20);

        let fb: &[u8; FOOTER_SIZE] = img[img.len() - FOOTER_SIZE..].try_into().unwrap();
        let footer = Footer::decode(fb).unwrap();
        assert_eq!(
            (
                footer.original_image_size,
                footer.vbmeta_offset,
                footer.vbmeta_size
            ),
            (524288, 528384, 512)
        );
        assert_eq!(&footer.encode(), fb);

        let vb = &img[footer.vbmeta_offset as usize..][..footer.vbmeta_size as usize];
        let header = VbmetaHeader::decode(vb).unwrap();
        assert_eq!(header.release_string, "avbtool 1.3.0");
        assert_eq!(
            (
                header.authentication_data_block_size,
                header.auxiliary_data_block_size
            ),
            (0, 256)
        );
        assert_eq!(header.encode(), vb[..VBMETA_HEADER_SIZE]);

        let aux = &vb[VBMETA_HEADER_SIZE..];
        let desc = &aux[header.descriptors_offset as usize..][..header.descriptors_size as usize];
        let d = HashtreeDescriptor::decode(desc).unwrap();
        assert_eq!(
            (d.image_size, d.tree_offset, d.tree_size),
            (524288, 524288, 4096)
        );
        assert_eq!(
            (d.hash_algorithm.as_str(), d.partition_name.as_str()),
            ("sha256", "system")
        );
        assert_eq!(
            hex::encode(&d.root_digest),
            "4fbd644d0adfaeda4f3fded13993411b8bf27b37fd0decae40c402d1a5fe7559"
        );
        assert_eq!(d.encode(), desc);
        assert_eq!(vbmeta_blob(desc, &header.release_string), vb);
    }

    #[test]
    fn footer_roundtrip() {
        let f = Footer {
            version_major: 1,
            version_minor: 0,
            original_image_size: 524288,
            vbmeta_offset: 528384,
            vbmeta_size: 512,
        };
        let expected = [
            "41564266",
            "00000001",
            "00000000",
            "0000000000080000",
            "0000000000081000",
            "0000000000000200",
            &"00".repeat(28),
        ]
        .concat();
        assert_eq!(hex::encode(f.encode()), expected);
        assert_eq!(Footer::decode(&f.encode()), Some(f));
    }
}
