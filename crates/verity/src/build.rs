//! Streaming, parallel tree construction.
//!
//! Memory stays bounded whatever the image size: data is read in fixed-size
//! chunks by a prefetch thread while rayon hashes the previous chunk, and each
//! finished level is written to the output at once and read back from there to
//! build the level above, so no level is ever held whole in memory.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::mpsc;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::hash::BlockHasher;
use crate::params::{Params, TreeLayout};
use vabc_io::{ReadAt, WriteAt};

/// Bytes read per chunk. Large enough to amortise per-chunk costs and keep both
/// cores busy, small enough that two in flight are negligible memory.
pub(crate) const CHUNK_BYTES: usize = 8 << 20;
/// Assembled hash blocks are written out once this many bytes are pending.
const FLUSH_BYTES: usize = 4 << 20;
/// Blocks per rayon task: one 4 KiB block hashes in ~3 µs, so this keeps task
/// overhead well under 1 %.
pub(crate) const MIN_BLOCKS_PER_TASK: usize = 32;

/// A readable input of known length, named for error messages.
#[derive(Clone, Copy)]
pub struct Input<'a> {
    pub reader: &'a (dyn ReadAt + 'a),
    pub name: &'a Path,
    /// Readable bytes. Blocks past it read as zeros (the last block may be partial).
    pub len: u64,
}

/// Progress callback: called with the number of data bytes hashed so far.
pub type Progress<'a> = &'a (dyn Fn(u64) + Sync);

/// A chunk of input: mapped from the file when possible, else read into a buffer.
enum Chunk {
    Buf(Vec<u8>),
    Map(memmap2::Mmap),
}

impl std::ops::Deref for Chunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Chunk::Buf(b) => b,
            Chunk::Map(m) => m,
        }
    }
}

/// Mapping offsets must be page-aligned; this covers every page size Linux uses.
const MAP_ALIGN: u64 = 64 << 10;

/// Reads `count` blocks of `block_size` starting at byte `base` from `input` in
/// chunks on a helper thread, zero-filling past `input.len`, and hands each
/// chunk (first block index, bytes) to `consume` on the calling thread, until
/// the end or until `consume` breaks.
///
/// Whole chunks of a file are mapped (and pre-faulted by the helper thread)
/// rather than read: that saves copying every byte through the page cache,
/// which costs about a third of the CPU time of hashing with SHA-NI.
pub(crate) fn for_each_chunk(
    input: Input<'_>,
    base: u64,
    count: u64,
    block_size: usize,
    mut consume: impl FnMut(u64, &[u8]) -> Result<ControlFlow<()>>,
) -> Result<()> {
    let per_chunk = (CHUNK_BYTES / block_size).max(1) as u64;
    let bs = block_size as u64;
    let read_chunk = |first: u64, mut buf: Vec<u8>| -> Result<Chunk> {
        let n = per_chunk.min(count - first);
        let off = base + first * bs;
        let len = n * bs;
        if let Some(file) = input.reader.as_file()
            && off.is_multiple_of(MAP_ALIGN)
            && off + len <= input.len
        {
            // SAFETY: the mapping is read-only and private to this chunk. If
            // another process rewrites the file meanwhile we hash whatever
            // bytes are there, as read() would; if it truncates the file, the
            // process gets SIGBUS, the documented hazard of mapping a file.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .offset(off)
                    .len(len as usize)
                    .populate()
                    .map(file)
            };
            // Some files (e.g. on special filesystems) cannot be mapped: read them.
            if let Ok(map) = map {
                return Ok(Chunk::Map(map));
            }
        }
        buf.resize(len as usize, 0);
        let avail = input.len.saturating_sub(off).min(len) as usize;
        input
            .reader
            .read_exact_at(&mut buf[..avail], off)
            .map_err(|e| Error::io("read", input.name, off, e))?;
        buf[avail..].fill(0);
        Ok(Chunk::Buf(buf))
    };
    if count <= per_chunk {
        if count > 0 {
            let chunk = read_chunk(0, Vec::new())?;
            // A single chunk: breaking early changes nothing.
            let _ = consume(0, &chunk)?;
        }
        return Ok(());
    }
    std::thread::scope(|s| {
        // Two buffers circulate: one being hashed, one being filled.
        let (full_tx, full_rx) = mpsc::sync_channel::<Result<(u64, Chunk)>>(1);
        let (empty_tx, empty_rx) = mpsc::channel::<Vec<u8>>();
        for _ in 0..2 {
            let _ = empty_tx.send(Vec::new());
        }
        s.spawn(move || {
            let mut first = 0;
            while first < count {
                let Ok(buf) = empty_rx.recv() else { return };
                let r = read_chunk(first, buf).map(|c| (first, c));
                let failed = r.is_err();
                if full_tx.send(r).is_err() || failed {
                    return;
                }
                first += per_chunk;
            }
        });
        for msg in full_rx {
            let (first, chunk) = msg?;
            if consume(first, &chunk)?.is_break() {
                // Dropping the channels on return stops the reader.
                break;
            }
            let buf = match chunk {
                Chunk::Buf(b) => b,
                Chunk::Map(_) => Vec::new(),
            };
            // The reader may already have finished; a failed send just drops the buffer.
            let _ = empty_tx.send(buf);
        }
        Ok(())
    })
}

/// Hashes consecutive `block_size` blocks of `src` in parallel into `out`
/// (`digest_size` bytes each, packed).
pub(crate) fn hash_blocks(hasher: &BlockHasher, src: &[u8], block_size: usize, out: &mut Vec<u8>) {
    let d = hasher.digest_size();
    out.resize(src.len() / block_size * d, 0);
    out.par_chunks_mut(d * MIN_BLOCKS_PER_TASK)
        .zip(src.par_chunks(block_size * MIN_BLOCKS_PER_TASK))
        .for_each(|(o, b)| hasher.hash_blocks_into(b, block_size, o));
}

/// Packs digests into hash blocks for one level and writes them out in order.
struct LevelWriter<'w, W: WriteAt> {
    out: &'w mut W,
    out_name: &'w Path,
    next_offset: u64,
    pending: Vec<u8>,
    in_block: u64,
    hbs: usize,
    per: u64,
    stride: usize,
}

impl<'w, W: WriteAt> LevelWriter<'w, W> {
    fn new(out: &'w mut W, out_name: &'w Path, offset: u64, layout: &TreeLayout) -> Self {
        LevelWriter {
            out,
            out_name,
            next_offset: offset,
            pending: Vec::with_capacity(FLUSH_BYTES + layout.hash_block_size as usize),
            in_block: 0,
            hbs: layout.hash_block_size as usize,
            per: layout.hashes_per_block,
            stride: layout.digest_stride,
        }
    }

    fn push(&mut self, digests: &[u8], digest_size: usize) -> Result<()> {
        for d in digests.chunks_exact(digest_size) {
            if self.in_block == 0 {
                // A fresh zero block: slot padding and the unused tail stay zero.
                self.pending.resize(self.pending.len() + self.hbs, 0);
            }
            let at = self.pending.len() - self.hbs + self.in_block as usize * self.stride;
            self.pending[at..at + digest_size].copy_from_slice(d);
            self.in_block += 1;
            if self.in_block == self.per {
                self.in_block = 0;
                if self.pending.len() >= FLUSH_BYTES {
                    self.flush()?;
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.out
            .write_all_at(&self.pending, self.next_offset)
            .map_err(|e| Error::io("write", self.out_name, self.next_offset, e))?;
        self.next_offset += self.pending.len() as u64;
        self.pending.clear();
        Ok(())
    }
}

/// Builds the tree for `data` and writes it at byte `tree_offset` of `out`
/// (the levels only: write a superblock separately if one is wanted).
/// Returns the root hash.
///
/// `out` must read back what was written, because each level is built from
/// the one below as stored. It may be the same file as the data as long as
/// the tree does not overlap the data blocks.
pub fn build_tree<W: WriteAt + ReadAt>(
    data: Input<'_>,
    params: &Params,
    out: &mut W,
    out_name: &Path,
    tree_offset: u64,
    progress: Option<Progress<'_>>,
) -> Result<Vec<u8>> {
    let layout = params.layout()?;
    let dbs = params.data_block_size as usize;
    let hbs = params.hash_block_size as usize;
    check_data_len(data, params)?;
    let hasher = BlockHasher::new(params);
    let d = hasher.digest_size();

    if layout.levels.is_empty() {
        let mut block = vec![0u8; dbs];
        let avail = data.len.min(dbs as u64) as usize;
        data.reader
            .read_exact_at(&mut block[..avail], 0)
            .map_err(|e| Error::io("read", data.name, 0, e))?;
        if let Some(p) = progress {
            p(dbs as u64);
        }
        return Ok(hasher.hash(&block)[..d].to_vec());
    }

    // Level 0 from the data.
    let mut digests = Vec::new();
    {
        let mut w = LevelWriter::new(
            out,
            out_name,
            tree_offset + layout.levels[0].offset,
            &layout,
        );
        for_each_chunk(data, 0, params.data_blocks, dbs, |first, buf| {
            hash_blocks(&hasher, buf, dbs, &mut digests);
            w.push(&digests, d)?;
            if let Some(p) = progress {
                p((first * dbs as u64) + buf.len() as u64);
            }
            Ok(ControlFlow::Continue(()))
        })?;
        w.flush()?;
    }

    // Each higher level from the one below, read back from the output.
    for k in 1..layout.levels.len() {
        let below = layout.levels[k - 1];
        let mut level_out = LevelWriter::new(
            out,
            out_name,
            tree_offset + layout.levels[k].offset,
            &layout,
        );
        let base = tree_offset + below.offset;
        let mut buf = Vec::new();
        let per_chunk = (CHUNK_BYTES / hbs).max(1) as u64;
        let mut first = 0;
        while first < below.blocks {
            let n = per_chunk.min(below.blocks - first);
            buf.resize(n as usize * hbs, 0);
            let off = base + first * hbs as u64;
            level_out
                .out
                .read_exact_at(&mut buf, off)
                .map_err(|e| Error::io("read back", out_name, off, e))?;
            hash_blocks(&hasher, &buf, hbs, &mut digests);
            level_out.push(&digests, d)?;
            first += n;
        }
        level_out.flush()?;
    }

    let top = tree_offset + layout.levels[layout.levels.len() - 1].offset;
    let mut block = vec![0u8; hbs];
    out.read_exact_at(&mut block, top)
        .map_err(|e| Error::io("read back", out_name, top, e))?;
    Ok(hasher.hash(&block)[..d].to_vec())
}

/// Builds a tree in memory (no superblock). For small images and tests.
pub fn build_tree_in_memory(data: Input<'_>, params: &Params) -> Result<(Vec<u8>, Vec<u8>)> {
    let mut tree = Vec::new();
    let root = build_tree(data, params, &mut tree, Path::new("<memory>"), 0, None)?;
    let size = params.layout()?.tree_size() as usize;
    tree.resize(size, 0);
    Ok((tree, root))
}

pub(crate) fn check_data_len(data: Input<'_>, params: &Params) -> Result<()> {
    // Only the final block may be partial; anything shorter is a caller error.
    let dbs = u64::from(params.data_block_size);
    let needed = (params.data_blocks - 1) * dbs + 1;
    if data.len < needed {
        return Err(Error::Truncated {
            path: data.name.to_path_buf(),
            what: format!("{} data blocks of {dbs} bytes", params.data_blocks),
            needed: params.data_size(),
            actual: data.len,
        });
    }
    Ok(())
}
