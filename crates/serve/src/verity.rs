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
        self.verify_blocks(block, data).map_err(|(_, msg)| msg)
    }

    /// All verity blocks of the run at once, so they are hashed in pairs; the
    /// block reported is the engine block holding the first one that failed.
    fn verify_blocks(&self, first_block: u64, data: &[u8]) -> Result<(), (u64, String)> {
        let dbs = self.data_block_size;
        let first = first_block * self.per_block;
        let data_blocks = self.verifier.params().data_blocks;
        // The tree covers whole blocks below `data_blocks`; anything else is
        // refused after the covered part has been checked, so the first bad
        // block in the run is the one named.
        let covered = ((data.len() / dbs) as u64).min(data_blocks.saturating_sub(first));
        let (checked, rest) = data.split_at(covered as usize * dbs);
        self.verifier
            .verify_blocks(first, checked)
            .map_err(|(vblock, e)| (vblock / self.per_block, e.to_string()))?;
        if !rest.is_empty() {
            let vblock = first + covered;
            return Err((
                vblock / self.per_block,
                format!(
                    "bytes at offset {} are not covered by the hash tree ({data_blocks} data \
                     blocks of {dbs}); refusing to serve unverified data",
                    vblock * dbs as u64
                ),
            ));
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
    fn batches_pass_good_data_and_name_the_bad_engine_block() {
        for dbs in [4096u32, 512] {
            let (mut data, params, tree, root) = setup(dbs, 300 * 4096);
            let c = check(tree, &params, &root, data.len() as u64);
            c.verify_blocks(0, &data).unwrap();
            c.verify_blocks(3, &data[3 * 4096..264 * 4096]).unwrap();
            // First, odd, middle and last engine block of the run from block 3.
            for bad in [3usize, 7, 133, 263] {
                data[bad * 4096 + 4095] ^= 0x04;
                let (block, msg) = c.verify_blocks(3, &data[3 * 4096..264 * 4096]).unwrap_err();
                assert_eq!(block, bad as u64, "dbs {dbs}: {msg}");
                let vblock = (bad + 1) * (4096 / dbs as usize) - 1;
                assert!(msg.contains(&format!("block {vblock}")), "{msg}");
                assert_eq!(
                    c.verify(bad as u64, &data[bad * 4096..][..4096])
                        .unwrap_err(),
                    msg
                );
                data[bad * 4096 + 4095] ^= 0x04;
            }
        }
    }

    #[test]
    fn batch_with_a_partial_last_block() {
        // 512-byte verity blocks protect a device that ends 1 KiB into engine
        // block 8: the partial block is verified with the rest.
        let (mut data, params, tree, root) = setup(512, 8 * 4096 + 1024);
        let c = check(tree.clone(), &params, &root, data.len() as u64);
        c.verify_blocks(5, &data[5 * 4096..]).unwrap();
        data[8 * 4096 + 1000] ^= 1;
        assert_eq!(c.verify_blocks(5, &data[5 * 4096..]).unwrap_err().0, 8);
        data[8 * 4096 + 1000] ^= 1;
        data[6 * 4096] ^= 1;
        assert_eq!(c.verify_blocks(5, &data[5 * 4096..]).unwrap_err().0, 6);
        data[6 * 4096] ^= 1;
        // 4 KiB verity blocks cannot cover a partial block: the whole ones before
        // it pass, then it is refused.
        let (data, params, tree, root) = setup(4096, 8 * 4096);
        let c = check(tree, &params, &root, 8 * 4096 + 1024);
        let mut dev = data.clone();
        dev.extend_from_slice(&[0; 1024]);
        let (block, msg) = c.verify_blocks(5, &dev[5 * 4096..]).unwrap_err();
        assert_eq!(block, 8);
        assert!(msg.contains("not covered"), "{msg}");
        dev[5 * 4096] ^= 1;
        assert_eq!(c.verify_blocks(5, &dev[5 * 4096..]).unwrap_err().0, 5);
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
