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

fn be_u32(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn be_u64(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_be_bytes(a)
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
        let mut b = [0u8; FOOTER_SIZE];
        b[0..4].copy_from_slice(FOOTER_MAGIC);
        b[4..8].copy_from_slice(&self.version_major.to_be_bytes());
        b[8..12].copy_from_slice(&self.version_minor.to_be_bytes());
        b[12..20].copy_from_slice(&self.original_image_size.to_be_bytes());
        b[20..28].copy_from_slice(&self.vbmeta_offset.to_be_bytes());
        b[28..36].copy_from_slice(&self.vbmeta_size.to_be_bytes());
        b
    }

    /// `None` when the bytes do not start with the footer magic.
    pub fn decode(b: &[u8; FOOTER_SIZE]) -> Option<Self> {
        if &b[0..4] != FOOTER_MAGIC {
            return None;
        }
        Some(Footer {
            version_major: be_u32(b, 4),
            version_minor: be_u32(b, 8),
            original_image_size: be_u64(b, 12),
            vbmeta_offset: be_u64(b, 20),
            vbmeta_size: be_u64(b, 28),
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
        let mut b = [0u8; VBMETA_HEADER_SIZE];
        b[0..4].copy_from_slice(VBMETA_MAGIC);
        let mut o = 4;
        let put32 = |b: &mut [u8], o: &mut usize, v: u32| {
            b[*o..*o + 4].copy_from_slice(&v.to_be_bytes());
            *o += 4;
        };
        put32(&mut b, &mut o, self.required_libavb_version_major);
        put32(&mut b, &mut o, self.required_libavb_version_minor);
        let put64 = |b: &mut [u8], o: &mut usize, v: u64| {
            b[*o..*o + 8].copy_from_slice(&v.to_be_bytes());
            *o += 8;
        };
        put64(&mut b, &mut o, self.authentication_data_block_size);
        put64(&mut b, &mut o, self.auxiliary_data_block_size);
        put32(&mut b, &mut o, self.algorithm_type);
        for v in [
            self.hash_offset,
            self.hash_size,
            self.signature_offset,
            self.signature_size,
            self.public_key_offset,
            self.public_key_size,
            self.public_key_metadata_offset,
            self.public_key_metadata_size,
            self.descriptors_offset,
            self.descriptors_size,
            self.rollback_index,
        ] {
            put64(&mut b, &mut o, v);
        }
        put32(&mut b, &mut o, self.flags);
        put32(&mut b, &mut o, self.rollback_index_location);
        debug_assert_eq!(o, 128);
        let rs = self.release_string.as_bytes();
        // The field is 48 bytes and NUL-terminated.
        let n = rs.len().min(47);
        b[128..128 + n].copy_from_slice(&rs[..n]);
        b
    }

    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < VBMETA_HEADER_SIZE || &b[0..4] != VBMETA_MAGIC {
            return None;
        }
        let rs = &b[128..176];
        let end = rs.iter().position(|&c| c == 0).unwrap_or(rs.len());
        Some(VbmetaHeader {
            required_libavb_version_major: be_u32(b, 4),
            required_libavb_version_minor: be_u32(b, 8),
            authentication_data_block_size: be_u64(b, 12),
            auxiliary_data_block_size: be_u64(b, 20),
            algorithm_type: be_u32(b, 28),
            hash_offset: be_u64(b, 32),
            hash_size: be_u64(b, 40),
            signature_offset: be_u64(b, 48),
            signature_size: be_u64(b, 56),
            public_key_offset: be_u64(b, 64),
            public_key_size: be_u64(b, 72),
            public_key_metadata_offset: be_u64(b, 80),
            public_key_metadata_size: be_u64(b, 88),
            descriptors_offset: be_u64(b, 96),
            descriptors_size: be_u64(b, 104),
            rollback_index: be_u64(b, 112),
            flags: be_u32(b, 120),
            rollback_index_location: be_u32(b, 124),
            release_string: String::from_utf8_lossy(&rs[..end]).into_owned(),
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
const HASHTREE_FIXED: usize = 180;

impl HashtreeDescriptor {
    /// Tag, length and body, padded to a multiple of 8.
    pub fn encode(&self) -> Vec<u8> {
        let var = self.partition_name.len() + self.salt.len() + self.root_digest.len();
        let following = (HASHTREE_FIXED - 16 + var).next_multiple_of(8);
        let mut b = vec![0u8; 16 + following];
        b[0..8].copy_from_slice(&TAG_HASHTREE.to_be_bytes());
        b[8..16].copy_from_slice(&(following as u64).to_be_bytes());
        b[16..20].copy_from_slice(&self.dm_verity_version.to_be_bytes());
        b[20..28].copy_from_slice(&self.image_size.to_be_bytes());
        b[28..36].copy_from_slice(&self.tree_offset.to_be_bytes());
        b[36..44].copy_from_slice(&self.tree_size.to_be_bytes());
        b[44..48].copy_from_slice(&self.data_block_size.to_be_bytes());
        b[48..52].copy_from_slice(&self.hash_block_size.to_be_bytes());
        b[52..56].copy_from_slice(&self.fec_num_roots.to_be_bytes());
        b[56..64].copy_from_slice(&self.fec_offset.to_be_bytes());
        b[64..72].copy_from_slice(&self.fec_size.to_be_bytes());
        let alg = self.hash_algorithm.as_bytes();
        let n = alg.len().min(32);
        b[72..72 + n].copy_from_slice(&alg[..n]);
        b[104..108].copy_from_slice(&(self.partition_name.len() as u32).to_be_bytes());
        b[108..112].copy_from_slice(&(self.salt.len() as u32).to_be_bytes());
        b[112..116].copy_from_slice(&(self.root_digest.len() as u32).to_be_bytes());
        b[116..120].copy_from_slice(&self.flags.to_be_bytes());
        let mut o = HASHTREE_FIXED;
        for part in [
            self.partition_name.as_bytes(),
            &self.salt,
            &self.root_digest,
        ] {
            b[o..o + part.len()].copy_from_slice(part);
            o += part.len();
        }
        b
    }

    /// Parses a whole descriptor (header included); `None` if malformed.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < HASHTREE_FIXED || be_u64(b, 0) != TAG_HASHTREE {
            return None;
        }
        let alg = &b[72..104];
        let alg_end = alg.iter().position(|&c| c == 0).unwrap_or(32);
        let name_len = be_u32(b, 104) as usize;
        let salt_len = be_u32(b, 108) as usize;
        let root_len = be_u32(b, 112) as usize;
        let end = HASHTREE_FIXED
            .checked_add(name_len)?
            .checked_add(salt_len)?
            .checked_add(root_len)?;
        if end > b.len() {
            return None;
        }
        let name = &b[HASHTREE_FIXED..HASHTREE_FIXED + name_len];
        let salt = &b[HASHTREE_FIXED + name_len..HASHTREE_FIXED + name_len + salt_len];
        let root = &b[end - root_len..end];
        Some(HashtreeDescriptor {
            dm_verity_version: be_u32(b, 16),
            image_size: be_u64(b, 20),
            tree_offset: be_u64(b, 28),
            tree_size: be_u64(b, 36),
            data_block_size: be_u32(b, 44),
            hash_block_size: be_u32(b, 48),
            fec_num_roots: be_u32(b, 52),
            fec_offset: be_u64(b, 56),
            fec_size: be_u64(b, 64),
            hash_algorithm: String::from_utf8_lossy(&alg[..alg_end]).into_owned(),
            partition_name: String::from_utf8_lossy(name).into_owned(),
            salt: salt.to_vec(),
            root_digest: root.to_vec(),
            flags: be_u32(b, 116),
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
    file: &(impl crate::io::ReadAt + ?Sized),
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
        crate::io::ReadAt::read_exact_at(file, &mut b, off)
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
        if desc_bytes.len() - o < 16 {
            return Err(bad(at, "truncated descriptor header".into()));
        }
        let tag = be_u64(desc_bytes, o);
        let following = be_u64(desc_bytes, o + 8);
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
