//! Tree parameters and the on-disk layout that follows from them.
//!
//! The layout rules are veritysetup's (cryptsetup `lib/verity/verity_hash.c`):
//! fan-out `2^floor(log2(hash_block_size / digest_size))` in both formats;
//! format 1 stores each digest in a power-of-two slot, format 0 packs them at
//! the digest size; levels are added until one fits in a single block; the top
//! level is stored first.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Hash functions dm-verity trees are built with here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgorithm {
    Sha1,
    Sha256,
    Sha512,
}

impl HashAlgorithm {
    /// The name veritysetup, the kernel and avbtool use.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgorithm::Sha1 => "sha1",
            HashAlgorithm::Sha256 => "sha256",
            HashAlgorithm::Sha512 => "sha512",
        }
    }

    /// Digest length in bytes.
    pub fn digest_size(self) -> usize {
        match self {
            HashAlgorithm::Sha1 => 20,
            HashAlgorithm::Sha256 => 32,
            HashAlgorithm::Sha512 => 64,
        }
    }
}

impl fmt::Display for HashAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HashAlgorithm {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sha1" => Ok(HashAlgorithm::Sha1),
            "sha256" => Ok(HashAlgorithm::Sha256),
            "sha512" => Ok(HashAlgorithm::Sha512),
            _ => Err(Error::UnknownAlgorithm(s.to_string())),
        }
    }
}

/// dm-verity hash format ("hash type" in veritysetup).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// Type 0, the original Chrome OS format: salt appended, digests packed.
    ChromeOs = 0,
    /// Type 1, the normal format: salt prepended, digests in power-of-two slots.
    V1 = 1,
}

impl Format {
    pub fn from_u32(v: u32) -> Result<Self> {
        match v {
            0 => Ok(Format::ChromeOs),
            1 => Ok(Format::V1),
            _ => Err(Error::InvalidParams(format!(
                "hash format {v} is not 0 or 1"
            ))),
        }
    }
    pub fn as_u32(self) -> u32 {
        self as u32
    }
}

/// Largest salt the superblock (and veritysetup) can hold.
pub const MAX_SALT_SIZE: usize = 256;
/// Smallest and largest block sizes accepted (veritysetup's limits).
pub const MIN_BLOCK_SIZE: u32 = 512;
pub const MAX_BLOCK_SIZE: u32 = 65536;

/// Everything that determines a tree's bytes and root hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    pub format: Format,
    pub algorithm: HashAlgorithm,
    pub data_block_size: u32,
    pub hash_block_size: u32,
    /// Number of data blocks covered by the tree.
    pub data_blocks: u64,
    pub salt: Vec<u8>,
}

impl Params {
    /// veritysetup's defaults (format 1, sha256, 4096/4096) for `data_blocks`
    /// blocks with the given salt.
    pub fn new(data_blocks: u64, salt: Vec<u8>) -> Self {
        Params {
            format: Format::V1,
            algorithm: HashAlgorithm::Sha256,
            data_block_size: 4096,
            hash_block_size: 4096,
            data_blocks,
            salt,
        }
    }

    /// Checks the limits veritysetup enforces.
    pub fn validate(&self) -> Result<()> {
        for (what, bs) in [
            ("data block size", self.data_block_size),
            ("hash block size", self.hash_block_size),
        ] {
            if !bs.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bs) {
                return Err(Error::InvalidParams(format!(
                    "{what} {bs} is not a power of two between {MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE}"
                )));
            }
        }
        if self.salt.len() > MAX_SALT_SIZE {
            return Err(Error::InvalidParams(format!(
                "salt is {} bytes, at most {MAX_SALT_SIZE} are allowed",
                self.salt.len()
            )));
        }
        if self.data_blocks == 0 {
            return Err(Error::InvalidParams(
                "the data area has no complete block".into(),
            ));
        }
        // Offsets are computed in bytes as u64; keep them clear of overflow.
        if self
            .data_blocks
            .checked_mul(u64::from(self.data_block_size))
            .is_none_or(|b| b > i64::MAX as u64)
        {
            return Err(Error::InvalidParams(format!(
                "{} data blocks of {} bytes is too large",
                self.data_blocks, self.data_block_size
            )));
        }
        Ok(())
    }

    /// Size in bytes of the protected data.
    pub fn data_size(&self) -> u64 {
        self.data_blocks * u64::from(self.data_block_size)
    }

    /// The tree shape for these parameters.
    pub fn layout(&self) -> Result<TreeLayout> {
        self.validate()?;
        Ok(TreeLayout::new(self))
    }
}

/// One level of the tree. Level 0 holds the digests of the data blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Level {
    /// Hash blocks in this level.
    pub blocks: u64,
    /// Byte offset of the level from the start of the hash area.
    pub offset: u64,
}

/// Shape of a tree: fan-out, digest placement and where each level lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeLayout {
    pub digest_size: usize,
    /// Distance between consecutive digests inside a hash block.
    pub digest_stride: usize,
    /// Digests per hash block.
    pub hashes_per_block: u64,
    pub hash_block_size: u32,
    /// Index 0 is the leaf level; the last entry is the single-block top.
    /// Empty when there is only one data block (the root is its digest).
    pub levels: Vec<Level>,
    /// Total hash blocks over all levels.
    pub hash_blocks: u64,
}

impl TreeLayout {
    fn new(p: &Params) -> Self {
        let digest_size = p.algorithm.digest_size();
        let hbs = u64::from(p.hash_block_size);
        let per_log = (hbs / digest_size as u64).ilog2();
        let hashes_per_block = 1u64 << per_log;
        let digest_stride = match p.format {
            Format::V1 => digest_size.next_power_of_two(),
            Format::ChromeOs => digest_size,
        };
        let mut counts = Vec::new();
        let mut n = p.data_blocks;
        while n > 1 {
            n = n.div_ceil(hashes_per_block);
            counts.push(n);
        }
        let hash_blocks: u64 = counts.iter().sum();
        // Top level first on disk: a level's offset is the size of all levels above it.
        let mut levels = Vec::with_capacity(counts.len());
        let mut above: u64 = hash_blocks;
        for &blocks in &counts {
            above -= blocks;
            levels.push(Level {
                blocks,
                offset: above * hbs,
            });
        }
        TreeLayout {
            digest_size,
            digest_stride,
            hashes_per_block,
            hash_block_size: p.hash_block_size,
            levels,
            hash_blocks,
        }
    }

    /// Bytes taken by the tree (no superblock).
    pub fn tree_size(&self) -> u64 {
        self.hash_blocks * u64::from(self.hash_block_size)
    }

    /// Byte range, inside a hash block, of the digest for child `index`.
    pub fn slot_in_block(&self, index: u64) -> (u64, usize) {
        let block = index / self.hashes_per_block;
        let pos = (index % self.hashes_per_block) as usize * self.digest_stride;
        (block, pos)
    }
}

/// Size of the dm-verity superblock.
pub const SUPERBLOCK_SIZE: u64 = 512;

/// Where the tree starts on the hash device, as veritysetup computes it
/// (`VERITY_hash_offset_block`): after the superblock, rounded up to a hash block.
pub fn tree_offset(hash_offset: u64, superblock: bool, hash_block_size: u32) -> u64 {
    let hbs = u64::from(hash_block_size);
    if superblock {
        (hash_offset + SUPERBLOCK_SIZE).div_ceil(hbs) * hbs
    } else {
        hash_offset / hbs * hbs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_gib_sha256_layout() {
        let p = Params::new(262_144, vec![0; 32]);
        let l = p.layout().unwrap();
        let counts: Vec<u64> = l.levels.iter().map(|l| l.blocks).collect();
        assert_eq!(counts, vec![2048, 16, 1]);
        assert_eq!(l.tree_size(), 8_458_240);
        assert_eq!(l.levels[2].offset, 0);
        assert_eq!(l.levels[1].offset, 4096);
        assert_eq!(l.levels[0].offset, 17 * 4096);
    }

    #[test]
    fn fan_out_rules() {
        let mut p = Params::new(1000, vec![]);
        p.algorithm = HashAlgorithm::Sha1;
        let l = p.layout().unwrap();
        assert_eq!((l.hashes_per_block, l.digest_stride), (128, 32));
        p.format = Format::ChromeOs;
        let l = p.layout().unwrap();
        assert_eq!((l.hashes_per_block, l.digest_stride), (128, 20));
        p.algorithm = HashAlgorithm::Sha512;
        p.hash_block_size = 512;
        assert_eq!(p.layout().unwrap().hashes_per_block, 8);
    }

    #[test]
    fn single_block_has_no_levels() {
        let l = Params::new(1, vec![]).layout().unwrap();
        assert!(l.levels.is_empty());
        assert_eq!(l.tree_size(), 0);
    }

    #[test]
    fn rejects_bad_params() {
        let mut p = Params::new(1, vec![0; 257]);
        assert!(p.validate().is_err());
        p.salt.clear();
        p.data_block_size = 1000;
        assert!(p.validate().is_err());
        p.data_block_size = 131072;
        assert!(p.validate().is_err());
        p.data_block_size = 4096;
        p.data_blocks = 0;
        assert!(p.validate().is_err());
        assert!("md5".parse::<HashAlgorithm>().is_err());
    }

    #[test]
    fn tree_offsets() {
        assert_eq!(tree_offset(0, true, 4096), 4096);
        assert_eq!(tree_offset(0, true, 512), 512);
        assert_eq!(tree_offset(0, false, 4096), 0);
        assert_eq!(tree_offset(8192, true, 4096), 12288);
    }
}
