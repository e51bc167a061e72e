//! Per-block verification for a block-serving daemon.
//!
//! Tree blocks are read on first use, checked against their parent (and the
//! top one against the root hash), and only then cached; later reads of any
//! data block under them cost one hash. A tree block that fails is not
//! cached, so a transient read error or a later repair is seen next time.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::hash::{BlockHasher, MAX_DIGEST_SIZE};
use crate::params::{Params, TreeLayout};
use vabc_io::ReadAt;

/// Checks single data blocks against a dm-verity tree. `Send + Sync`: share
/// one (e.g. in an `Arc`) between all serving threads.
pub struct BlockVerifier<S: ReadAt> {
    source: S,
    hash_name: PathBuf,
    data_name: PathBuf,
    tree_offset: u64,
    params: Params,
    layout: TreeLayout,
    hasher: BlockHasher,
    root: Vec<u8>,
    /// `cache[level][index]`: verified contents of that tree block.
    cache: Vec<Vec<OnceLock<Box<[u8]>>>>,
}

impl BlockVerifier<File> {
    /// Opens the hash device at `path`, with the tree at byte `tree_offset`
    /// (past any superblock; see [`crate::tree_offset`]).
    pub fn open(path: &Path, tree_offset: u64, params: Params, root: &[u8]) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io("open", path, 0, e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", path, 0, e))?
            .len();
        let v = Self::new(file, path, tree_offset, params, root)?;
        let needed = tree_offset + v.layout.tree_size();
        if len < needed {
            return Err(Error::Truncated {
                path: path.to_path_buf(),
                what: format!(
                    "a {}-block hash tree at offset {tree_offset}",
                    v.layout.hash_blocks
                ),
                needed,
                actual: len,
            });
        }
        Ok(v)
    }
}

impl<S: ReadAt> BlockVerifier<S> {
    /// Wraps any positioned source holding the tree at `tree_offset`.
    /// `hash_name` names it in errors. Nothing is read until the first `verify`.
    pub fn new(
        source: S,
        hash_name: impl Into<PathBuf>,
        tree_offset: u64,
        params: Params,
        root: &[u8],
    ) -> Result<Self> {
        let layout = params.layout()?;
        let hasher = BlockHasher::new(&params);
        if root.len() != hasher.digest_size() {
            return Err(Error::InvalidParams(format!(
                "root hash is {} bytes, {} needs {}",
                root.len(),
                params.algorithm,
                hasher.digest_size()
            )));
        }
        let cache = layout
            .levels
            .iter()
            .map(|l| (0..l.blocks).map(|_| OnceLock::new()).collect())
            .collect();
        Ok(BlockVerifier {
            source,
            hash_name: hash_name.into(),
            data_name: PathBuf::from("<data>"),
            tree_offset,
            params,
            layout,
            hasher,
            root: root.to_vec(),
            cache,
        })
    }

    /// Names the data device in mismatch errors.
    pub fn with_data_name(mut self, name: impl Into<PathBuf>) -> Self {
        self.data_name = name.into();
        self
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    pub fn layout(&self) -> &TreeLayout {
        &self.layout
    }

    /// Reads the top tree block and checks it against the root hash, so a
    /// server can refuse to start on a wrong root hash or a damaged top level
    /// instead of failing every read. No-op for a one-block device (no tree:
    /// the root is the data block's own digest).
    pub fn check_root(&self) -> Result<()> {
        match self.layout.levels.len() {
            0 => Ok(()),
            n => self.tree_block(n - 1, 0).map(|_| ()),
        }
    }

    /// Checks that `data` (exactly one data block) is block `block` of the
    /// protected device. On `Err` the caller must not use the data; an error
    /// with [`Error::is_integrity_error`] is a hash mismatch (EIO).
    pub fn verify(&self, block: u64, data: &[u8]) -> Result<()> {
        // Exactly one block: a run of one, so both paths compare digests the same way.
        if data.len() != self.params.data_block_size as usize {
            return Err(if block >= self.params.data_blocks {
                Error::BlockOutOfRange {
                    block,
                    data_blocks: self.params.data_blocks,
                }
            } else {
                Error::BadBlockLength {
                    block,
                    len: data.len(),
                    expected: self.params.data_block_size,
                }
            });
        }
        self.verify_blocks(block, data).map_err(|(_, e)| e)
    }

    /// Checks that `data` holds consecutive data blocks starting at `first`
    /// (a whole number of them, all inside the device). Blocks are hashed two
    /// at a time where the CPU can interleave them, and each leaf tree block is
    /// looked up once per run of blocks under it. On `Err`, the block number
    /// is the first block (in order) that failed, and the caller must not use
    /// any of the data.
    pub fn verify_blocks(&self, first: u64, data: &[u8]) -> std::result::Result<(), (u64, Error)> {
        /// Blocks hashed per round: 1 MiB of 4 KiB blocks, 8 KiB of SHA-256 digests.
        const BATCH: usize = 256;
        let dbs = self.params.data_block_size as usize;
        let d = self.hasher.digest_size();
        let whole = data.len() / dbs;
        let in_range = self.params.data_blocks.saturating_sub(first);
        let n = (whole as u64).min(in_range) as usize;
        let mut digests = [0u8; BATCH * MAX_DIGEST_SIZE];
        let mut leaf: Option<(u64, &[u8])> = None;
        for (c, chunk) in data[..n * dbs].chunks(BATCH * dbs).enumerate() {
            let count = chunk.len() / dbs;
            self.hasher
                .hash_blocks_into(chunk, dbs, &mut digests[..count * d]);
            for (i, got) in digests[..count * d].chunks_exact(d).enumerate() {
                let block = first + (c * BATCH + i) as u64;
                let expected: &[u8] = if self.layout.levels.is_empty() {
                    &self.root
                } else {
                    let (index, pos) = self.layout.slot_in_block(block);
                    let hashes = match leaf {
                        Some((at, hashes)) if at == index => hashes,
                        _ => {
                            let hashes = self.tree_block(0, index).map_err(|e| (block, e))?;
                            leaf = Some((index, hashes));
                            hashes
                        }
                    };
                    &hashes[pos..pos + d]
                };
                if got != expected {
                    return Err((
                        block,
                        Error::DataBlockMismatch {
                            path: self.data_name.clone(),
                            block,
                            offset: block * dbs as u64,
                        },
                    ));
                }
            }
        }
        let block = first + n as u64;
        if n < whole || (data.len() > n * dbs && block >= self.params.data_blocks) {
            return Err((
                block,
                Error::BlockOutOfRange {
                    block,
                    data_blocks: self.params.data_blocks,
                },
            ));
        }
        if data.len() > n * dbs {
            return Err((
                block,
                Error::BadBlockLength {
                    block,
                    len: data.len() - n * dbs,
                    expected: self.params.data_block_size,
                },
            ));
        }
        Ok(())
    }

    /// The verified contents of tree block `index` of `level`.
    fn tree_block(&self, level: usize, index: u64) -> Result<&[u8]> {
        let slot = &self.cache[level][index as usize];
        if let Some(b) = slot.get() {
            return Ok(b);
        }
        let hbs = self.layout.hash_block_size as usize;
        let off = self.tree_offset + self.layout.levels[level].offset + index * hbs as u64;
        let mut buf = vec![0u8; hbs];
        self.source
            .read_exact_at(&mut buf, off)
            .map_err(|e| Error::io("read", &self.hash_name, off, e))?;
        let d = self.hasher.digest_size();
        let got = self.hasher.hash(&buf);
        if level + 1 == self.layout.levels.len() {
            if got[..d] != *self.root {
                return Err(Error::RootHashMismatch {
                    path: self.hash_name.clone(),
                    offset: off,
                    expected: hex::encode(&self.root),
                    actual: hex::encode(&got[..d]),
                });
            }
        } else {
            let (parent, pos) = self.layout.slot_in_block(index);
            let expected = &self.tree_block(level + 1, parent)?[pos..pos + d];
            if got[..d] != *expected {
                return Err(Error::HashBlockMismatch {
                    path: self.hash_name.clone(),
                    level,
                    index,
                    offset: off,
                });
            }
        }
        // Two threads may verify the same block at once; both computed the
        // same verified bytes, so whichever lands first is kept.
        Ok(slot.get_or_init(|| buf.into_boxed_slice()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    fn setup(
        format: crate::Format,
        salt: Vec<u8>,
        dbs: u32,
        blocks: usize,
    ) -> (Vec<u8>, BlockVerifier<Vec<u8>>) {
        let len = blocks * dbs as usize;
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4096) as u8).collect();
        let params = Params {
            format,
            algorithm: crate::HashAlgorithm::Sha256,
            data_block_size: dbs,
            hash_block_size: 4096,
            data_blocks: blocks as u64,
            salt,
        };
        let input = crate::Input {
            reader: &data,
            name: Path::new("data"),
            len: len as u64,
        };
        let (tree, root) = crate::build_tree_in_memory(input, &params).unwrap();
        let v = BlockVerifier::new(tree, "tree", 0, params, &root).unwrap();
        (data, v)
    }

    #[test]
    fn batch_accepts_good_data_and_names_the_bad_block() {
        // Salts shorter than, exactly and longer than one SHA-256 block, both
        // salt positions: every shape of the paired hashing.
        for (format, salt_len) in [
            (crate::Format::V1, 0),
            (crate::Format::V1, 5),
            (crate::Format::V1, 64),
            (crate::Format::V1, 70),
            (crate::Format::ChromeOs, 5),
        ] {
            // 300 blocks: three leaf blocks (128 hashes each) and more than
            // one hashing round (256 blocks).
            let (mut data, v) = setup(format, vec![9; salt_len], 4096, 300);
            let bs = 4096;
            for (first, count) in [
                (0usize, 300usize),
                (3, 261),
                (127, 2),
                (5, 1),
                (299, 1),
                (0, 0),
            ] {
                v.verify_blocks(first as u64, &data[first * bs..(first + count) * bs])
                    .unwrap();
            }
            // A batch from block 3 to 263: flips in its first, an odd, a
            // leaf-boundary, the middle, the last-of-a-round and the last block.
            for bad in [3usize, 7, 128, 133, 258, 263] {
                data[bad * bs + 100] ^= 0x01;
                let (block, e) = v.verify_blocks(3, &data[3 * bs..264 * bs]).unwrap_err();
                assert_eq!(block, bad as u64, "{format:?} salt {salt_len}");
                assert!(
                    matches!(e, Error::DataBlockMismatch { block, .. } if block == bad as u64),
                    "{e}"
                );
                // The single-block check agrees.
                assert!(v.verify(bad as u64, &data[bad * bs..][..bs]).is_err());
                data[bad * bs + 100] ^= 0x01;
            }
            v.verify_blocks(3, &data[3 * bs..264 * bs]).unwrap();
        }
    }

    #[test]
    fn batch_with_partial_or_out_of_range_tail() {
        let (mut data, v) = setup(crate::Format::V1, vec![1, 2, 3], 4096, 20);
        let bs = 4096;
        // 9 whole blocks then half of block 19: the whole ones pass, the tail
        // is refused as a short block.
        let (block, e) = v
            .verify_blocks(10, &data[10 * bs..19 * bs + 2048])
            .unwrap_err();
        assert_eq!(block, 19);
        assert!(
            matches!(
                e,
                Error::BadBlockLength {
                    block: 19,
                    len: 2048,
                    ..
                }
            ),
            "{e}"
        );
        // A bad whole block before the partial tail is what gets reported.
        data[14 * bs] ^= 0x80;
        let (block, _) = v
            .verify_blocks(10, &data[10 * bs..19 * bs + 2048])
            .unwrap_err();
        assert_eq!(block, 14);
        data[14 * bs] ^= 0x80;
        // Past the protected blocks.
        let mut long = data[16 * bs..].to_vec();
        long.extend_from_slice(&[0; 4096 + 100]);
        let (block, e) = v.verify_blocks(16, &long).unwrap_err();
        assert_eq!(block, 20);
        assert!(matches!(e, Error::BlockOutOfRange { block: 20, .. }), "{e}");
        let (block, e) = v
            .verify_blocks(19, &long[3 * bs..3 * bs + 5000])
            .unwrap_err();
        assert_eq!(block, 20);
        assert!(matches!(e, Error::BlockOutOfRange { block: 20, .. }), "{e}");
    }

    #[test]
    fn batch_on_a_one_block_device_checks_the_root() {
        let (mut data, v) = setup(crate::Format::V1, vec![4; 32], 4096, 1);
        v.verify_blocks(0, &data).unwrap();
        data[4095] ^= 1;
        assert_eq!(v.verify_blocks(0, &data).unwrap_err().0, 0);
    }

    /// A tree source that counts its reads.
    struct Counted(Vec<u8>, std::sync::atomic::AtomicUsize);
    impl ReadAt for Counted {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.read_exact_at(buf, offset)
        }
    }

    #[test]
    fn each_tree_block_is_read_once() {
        let (data, v) = setup(crate::Format::V1, vec![3; 32], 4096, 300);
        let params = v.params().clone();
        let (tree, root) = (v.source, v.root);
        let hash_blocks = v.layout.hash_blocks;
        let v = BlockVerifier::new(Counted(tree, Default::default()), "tree", 0, params, &root)
            .unwrap();
        for _ in 0..2 {
            v.verify_blocks(0, &data).unwrap();
            for b in 0..300 {
                v.verify(b, &data[b as usize * 4096..][..4096]).unwrap();
            }
        }
        // Three leaves and the top block.
        assert_eq!(hash_blocks, 4);
        assert_eq!(v.source.1.load(std::sync::atomic::Ordering::Relaxed), 4);
    }

    #[test]
    fn is_send_sync() {
        assert_send_sync::<BlockVerifier<File>>();
        assert_send_sync::<BlockVerifier<Vec<u8>>>();
    }
}
