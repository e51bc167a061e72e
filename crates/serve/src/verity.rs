//! dm-verity checking of everything a frontend serves: an adapter from
//! [`verity::BlockVerifier`] to the engine's [`engine::BlockVerifier`] hook.
//!
//! The engine hands over 4 KiB blocks; a verity data block of 512..4096 bytes
//! divides that evenly, so each engine block is checked as the verity blocks it
//! holds. Bytes the tree does not cover (past its data blocks, or a partial last
//! block) fail like a hash mismatch: the daemon never returns data it could not
//! verify.

use std::sync::Arc;

use ::verity::{BlockVerifier, ReadAt};
use engine::BLOCK_SIZE;

/// Errors setting up verified serving.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerityError {
    #[error(
        "verity data block size {0} is larger than the engine's {BLOCK_SIZE}-byte block; \
         serving supports data block sizes of 512 to {BLOCK_SIZE}"
    )]
    DataBlockSize(u32),
    #[error(
        "the hash tree protects {protected} bytes ({blocks} blocks of {block_size}), \
         more than the {device} bytes of the served device"
    )]
    TooLarge {
        protected: u64,
        blocks: u64,
        block_size: u32,
        device: u64,
    },
    #[error(transparent)]
    Verity(#[from] verity::Error),
}

/// Checks every engine block against a dm-verity tree.
pub struct VerityCheck<S: ReadAt> {
    verifier: Arc<BlockVerifier<S>>,
    /// Verity data blocks per engine block.
    per_block: u64,
    data_block_size: usize,
}

impl<S: ReadAt + Send> VerityCheck<S> {
    /// Wraps `verifier` for a device of `device_size` bytes. Checks the top tree
    /// level against the root hash now, so a wrong root hash or a damaged top
    /// block stops the server before it serves anything.
    pub fn new(verifier: BlockVerifier<S>, device_size: u64) -> Result<Self, VerityError> {
        let p = verifier.params();
        let dbs = p.data_block_size;
        if dbs as usize > BLOCK_SIZE {
            return Err(VerityError::DataBlockSize(dbs));
        }
        if p.data_size() > device_size {
            return Err(VerityError::TooLarge {
                protected: p.data_size(),
                blocks: p.data_blocks,
                block_size: dbs,
                device: device_size,
            });
        }
        verifier.check_root()?;
        Ok(VerityCheck {
            per_block: (BLOCK_SIZE / dbs as usize) as u64,
            data_block_size: dbs as usize,
            verifier: Arc::new(verifier),
        })
    }

    /// Bytes of the device the tree covers; reads past them fail.
    pub fn protected_bytes(&self) -> u64 {
        self.verifier.params().data_size()
    }

    pub fn verifier(&self) -> &BlockVerifier<S> {
        &self.verifier
    }
}

impl<S: ReadAt + Send> engine::BlockVerifier for VerityCheck<S> {
    fn verify(&self, block: u64, data: &[u8]) -> Result<(), String> {
        let dbs = self.data_block_size;
        let first = block * self.per_block;
        let data_blocks = self.verifier.params().data_blocks;
        for (i, chunk) in data.chunks(dbs).enumerate() {
            let vblock = first + i as u64;
            if chunk.len() != dbs || vblock >= data_blocks {
                return Err(format!(
                    "bytes at offset {} are not covered by the hash tree ({data_blocks} data \
                     blocks of {dbs}); refusing to serve unverified data",
                    vblock * dbs as u64
                ));
            }
            self.verifier
                .verify(vblock, chunk)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::verity::{Format, HashAlgorithm, Input, Params};
    use engine::BlockVerifier as _;

    fn setup(dbs: u32, len: usize) -> (Vec<u8>, Params, Vec<u8>, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4096) as u8).collect();
        let params = Params {
            format: Format::V1,
            algorithm: HashAlgorithm::Sha256,
            data_block_size: dbs,
            hash_block_size: 4096,
            data_blocks: (len / dbs as usize) as u64,
            salt: vec![7; 5],
        };
        let input = Input {
            reader: &data,
            name: std::path::Path::new("data"),
            len: len as u64,
        };
        let (tree, root) = verity::build_tree_in_memory(input, &params).unwrap();
        (data, params, tree, root)
    }

    fn check(tree: Vec<u8>, params: &Params, root: &[u8], size: u64) -> VerityCheck<Vec<u8>> {
        let v = BlockVerifier::new(tree, "tree", 0, params.clone(), root).unwrap();
        VerityCheck::new(v, size).unwrap()
    }

    #[test]
    fn small_data_blocks_are_checked_inside_each_engine_block() {
        let (mut data, params, tree, root) = setup(512, 64 * 4096);
        let c = check(tree, &params, &root, data.len() as u64);
        for b in 0..64u64 {
            c.verify(b, &data[b as usize * 4096..][..4096]).unwrap();
        }
        // A flip in the last 512-byte sub-block of engine block 9.
        data[9 * 4096 + 4000] ^= 0x10;
        let e = c.verify(9, &data[9 * 4096..][..4096]).unwrap_err();
        assert!(e.contains(&format!("block {}", 9 * 8 + 7)), "{e}");
        c.verify(10, &data[10 * 4096..][..4096]).unwrap();
    }

    #[test]
    fn uncovered_and_partial_blocks_fail() {
        let (data, params, tree, root) = setup(4096, 8 * 4096);
        // The device is one and a half blocks longer than the protected area.
        let c = check(tree, &params, &root, 8 * 4096 + 6144);
        c.verify(7, &data[7 * 4096..]).unwrap();
        assert!(
            c.verify(8, &[0u8; 4096])
                .unwrap_err()
                .contains("not covered")
        );
        assert!(
            c.verify(9, &[0u8; 2048])
                .unwrap_err()
                .contains("not covered")
        );
    }

    #[test]
    fn wrong_root_and_bad_sizes_are_refused_at_start() {
        let (_, params, tree, mut root) = setup(4096, 8 * 4096);
        root[3] ^= 1;
        let v = BlockVerifier::new(tree.clone(), "tree", 0, params.clone(), &root).unwrap();
        let e = VerityCheck::new(v, 8 * 4096).err().unwrap();
        assert!(
            matches!(e, VerityError::Verity(ref v) if v.is_integrity_error()),
            "{e}"
        );
        root[3] ^= 1;
        let v = BlockVerifier::new(tree, "tree", 0, params.clone(), &root).unwrap();
        let e = VerityCheck::new(v, 7 * 4096).err().unwrap();
        assert!(matches!(e, VerityError::TooLarge { .. }), "{e}");

        let (_, params, tree, root) = setup(8192, 8 * 8192);
        let v = BlockVerifier::new(tree, "tree", 0, params, &root).unwrap();
        let e = VerityCheck::new(v, 8 * 8192).err().unwrap();
        assert!(matches!(e, VerityError::DataBlockSize(8192)), "{e}");
    }
}
