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
use crate::hash::BlockHasher;
use crate::io::ReadAt;
use crate::params::{Params, TreeLayout};

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
        if block >= self.params.data_blocks {
            return Err(Error::BlockOutOfRange {
                block,
                data_blocks: self.params.data_blocks,
            });
        }
        if data.len() != self.params.data_block_size as usize {
            return Err(Error::BadBlockLength {
                block,
                len: data.len(),
                expected: self.params.data_block_size,
            });
        }
        let d = self.hasher.digest_size();
        let got = self.hasher.hash(data);
        let expected: &[u8] = if self.layout.levels.is_empty() {
            &self.root
        } else {
            let (leaf, pos) = self.layout.slot_in_block(block);
            &self.tree_block(0, leaf)?[pos..pos + d]
        };
        if got[..d] != *expected {
            return Err(Error::DataBlockMismatch {
                path: self.data_name.clone(),
                block,
                offset: block * u64::from(self.params.data_block_size),
            });
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

    #[test]
    fn is_send_sync() {
        assert_send_sync::<BlockVerifier<File>>();
        assert_send_sync::<BlockVerifier<Vec<u8>>>();
    }
}
