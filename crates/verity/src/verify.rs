//! Whole-device verification, top down: the top block against the root hash,
//! each level against the one above, then every data block against the leaves.
//! Going top down means the first mismatch found is the real culprit: a
//! corrupted tree block is reported as such rather than as bad data below it.

use std::ops::ControlFlow;
use std::path::Path;

use crate::build::{Input, Progress, check_data_len, for_each_chunk, hash_blocks};
use crate::error::{Error, Result};
use crate::hash::BlockHasher;
use crate::params::{Params, TreeLayout};

/// Checks every data block and every tree block of a device against `root`.
///
/// `hash` is the device holding the tree at byte `tree_offset` (past any
/// superblock). Returns the first mismatch: the tree from the top down, then
/// the lowest-numbered bad data block.
pub fn verify_tree(
    data: Input<'_>,
    params: &Params,
    hash: Input<'_>,
    tree_offset: u64,
    root: &[u8],
    progress: Option<Progress<'_>>,
) -> Result<()> {
    let (layout, hasher, d) = prepare(params, root)?;
    check_data_len(data, params)?;
    let dbs = params.data_block_size as usize;

    if layout.levels.is_empty() {
        // The root is the digest of the only data block.
        let mut block = vec![0u8; dbs];
        let avail = data.len.min(dbs as u64) as usize;
        data.reader
            .read_exact_at(&mut block[..avail], 0)
            .map_err(|e| Error::io("read", data.name, 0, e))?;
        if hasher.hash(&block)[..d] != *root {
            return Err(Error::DataBlockMismatch {
                path: data.name.to_path_buf(),
                block: 0,
                offset: 0,
            });
        }
        return Ok(());
    }

    verify_levels(params, hash, tree_offset, root)?;

    let leaves = tree_offset + layout.levels[0].offset;
    if let Some(bad) = check_level(
        data,
        0,
        params.data_blocks,
        dbs,
        &hasher,
        &layout,
        hash,
        leaves,
        progress,
    )? {
        return Err(Error::DataBlockMismatch {
            path: data.name.to_path_buf(),
            block: bad,
            offset: bad * dbs as u64,
        });
    }
    Ok(())
}

/// The hash tree alone, top down: the top block against the root hash, each level
/// against the one above. What a device checks of a tree file before it trusts the
/// leaves' digests (the data blocks are checked as they are read). Cost: one read and
/// one hash of the tree, about 0.8% of the data it covers.
pub fn verify_levels(
    params: &Params,
    hash: Input<'_>,
    tree_offset: u64,
    root: &[u8],
) -> Result<()> {
    let (layout, hasher, d) = prepare(params, root)?;
    if layout.levels.is_empty() {
        // The root is the digest of the only data block: no tree to check.
        return Ok(());
    }
    let hbs = params.hash_block_size as usize;
    let needed = tree_offset + layout.tree_size();
    if hash.len < needed {
        return Err(Error::Truncated {
            path: hash.name.to_path_buf(),
            what: format!(
                "a {}-block hash tree at offset {tree_offset}",
                layout.hash_blocks
            ),
            needed,
            actual: hash.len,
        });
    }

    let top_level = layout.levels.len() - 1;
    let top_off = tree_offset + layout.levels[top_level].offset;
    let mut top = vec![0u8; hbs];
    hash.reader
        .read_exact_at(&mut top, top_off)
        .map_err(|e| Error::io("read", hash.name, top_off, e))?;
    let actual = &hasher.hash(&top)[..d];
    if actual != root {
        return Err(Error::RootHashMismatch {
            path: hash.name.to_path_buf(),
            offset: top_off,
            expected: hex::encode(root),
            actual: hex::encode(actual),
        });
    }

    for k in (0..top_level).rev() {
        let level = layout.levels[k];
        let base = tree_offset + level.offset;
        let parent_base = tree_offset + layout.levels[k + 1].offset;
        if let Some(bad) = check_level(
            hash,
            base,
            level.blocks,
            hbs,
            &hasher,
            &layout,
            hash,
            parent_base,
            None,
        )? {
            return Err(Error::HashBlockMismatch {
                path: hash.name.to_path_buf(),
                level: k,
                index: bad,
                offset: base + bad * hbs as u64,
            });
        }
    }

    Ok(())
}

/// The tree's layout and hasher for `params`, and its digest size, which `root`
/// must have.
fn prepare(params: &Params, root: &[u8]) -> Result<(TreeLayout, BlockHasher, usize)> {
    let layout = params.layout()?;
    let hasher = BlockHasher::new(params);
    let d = hasher.digest_size();
    if root.len() != d {
        return Err(Error::InvalidParams(format!(
            "root hash is {} bytes, {} needs {d}",
            root.len(),
            params.algorithm
        )));
    }
    Ok((layout, hasher, d))
}

/// Hashes `count` child blocks of `child_size` at `child_base` in `children`
/// and compares each with its digest in the (already trusted) parent level at
/// `parent_base` in `parents`. Returns the first mismatching child.
#[allow(clippy::too_many_arguments)]
fn check_level(
    children: Input<'_>,
    child_base: u64,
    count: u64,
    child_size: usize,
    hasher: &BlockHasher,
    layout: &TreeLayout,
    parents: Input<'_>,
    parent_base: u64,
    progress: Option<Progress<'_>>,
) -> Result<Option<u64>> {
    let d = layout.digest_size;
    let hbs = layout.hash_block_size as u64;
    let mut parent_buf = Vec::new();
    let mut digests = Vec::new();
    let mut found = None;
    for_each_chunk(children, child_base, count, child_size, |first, buf| {
        let n = (buf.len() / child_size) as u64;
        let (pb0, _) = layout.slot_in_block(first);
        let (pb1, _) = layout.slot_in_block(first + n - 1);
        parent_buf.resize(((pb1 - pb0 + 1) * hbs) as usize, 0);
        let off = parent_base + pb0 * hbs;
        parents
            .reader
            .read_exact_at(&mut parent_buf, off)
            .map_err(|e| Error::io("read", parents.name, off, e))?;
        hash_blocks(hasher, buf, child_size, &mut digests);
        let bad = (0..n as usize).position(|i| {
            let (pb, pos) = layout.slot_in_block(first + i as u64);
            let at = ((pb - pb0) * hbs) as usize + pos;
            digests[i * d..(i + 1) * d] != parent_buf[at..at + d]
        });
        if let Some(p) = progress {
            p(first * child_size as u64 + buf.len() as u64);
        }
        Ok(match bad {
            Some(i) => {
                found = Some(first + i as u64);
                ControlFlow::Break(())
            }
            None => ControlFlow::Continue(()),
        })
    })?;
    Ok(found)
}

/// Convenience for tests and small trees: verify with the data and tree in memory.
pub fn verify_in_memory(data: &[u8], params: &Params, tree: &[u8], root: &[u8]) -> Result<()> {
    let d = Input {
        reader: &data,
        name: Path::new("<data>"),
        len: data.len() as u64,
    };
    let t = Input {
        reader: &tree,
        name: Path::new("<tree>"),
        len: tree.len() as u64,
    };
    verify_tree(d, params, t, 0, root, None)
}
