//! The snapshot view: the new image as base + COW, read block range by block
//! range without materialising anything (AOSP's `CompressedSnapshotReader`,
//! but with snapuserd's "first op wins" rule for duplicate blocks).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::error::{CowError, Result, io_err};
use crate::format::{BLOCK_SIZE, BLOCK_SIZE_U64, Op, OpKind};
use crate::reader::CowReader;

/// Base image + COW, readable at any block range from many threads.
pub struct SnapshotView<'a> {
    cow: &'a CowReader,
    base: &'a File,
    /// The base opened with `O_DIRECT` when it is a block device: a mounted file
    /// system's view of it in the page cache is not what the disk holds
    /// ([`vabc_io::direct`]).
    direct: Option<File>,
    base_path: PathBuf,
    base_size: u64,
    size: u64,
}

impl<'a> SnapshotView<'a> {
    /// `size` is the new image's size in bytes. `None` takes the base size,
    /// extended to cover every op of the COW.
    pub fn new(
        cow: &'a CowReader,
        base: &'a File,
        base_path: &Path,
        size: Option<u64>,
    ) -> Result<Self> {
        let base_size = file_size(base, base_path)?;
        let covered = cow.end_block() * BLOCK_SIZE_U64;
        let size = size.unwrap_or(base_size.max(covered));
        Ok(SnapshotView {
            cow,
            base,
            direct: vabc_io::direct::open_if_block_device(base_path)
                .ok()
                .flatten(),
            base_path: base_path.to_path_buf(),
            base_size,
            size,
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn base_size(&self) -> u64 {
        self.base_size
    }

    /// Read base bytes, zero-filling anything past the end of the base.
    fn read_base(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let avail = self.base_size.saturating_sub(offset).min(buf.len() as u64) as usize;
        if avail > 0 {
            match &self.direct {
                Some(d) => vabc_io::direct::read_bounced(d, &mut buf[..avail], offset),
                None => self.base.read_exact_at(&mut buf[..avail], offset),
            }
            .map_err(io_err(&self.base_path, "read base", offset))?;
        }
        buf[avail..].fill(0);
        Ok(())
    }

    /// Fill `buf` (a whole number of blocks) with the new image's content
    /// starting at block `start`.
    pub fn read_blocks(&self, start: u64, buf: &mut [u8]) -> Result<()> {
        if !buf.len().is_multiple_of(BLOCK_SIZE) {
            return Err(CowError::Usage {
                path: self.cow.path().to_path_buf(),
                msg: format!(
                    "read_blocks: buffer of {} bytes is not whole blocks",
                    buf.len()
                ),
            });
        }
        let end = start + (buf.len() / BLOCK_SIZE) as u64;
        let index = self.cow.block_index();
        let ops = self.cow.ops();
        // First op that can touch the range: multi-block ops start at most
        // 63 blocks before the block they cover.
        let lo = start.saturating_sub(63);
        let first = index.partition_point(|&i| ops[i as usize].new_block < lo);
        let mut cursor = start;
        let mut unit: Vec<u8> = Vec::new();
        for &i in &index[first..] {
            let op = &ops[i as usize];
            if op.new_block >= end {
                break;
            }
            let (a, b) = (op.new_block.max(start), op.end_block().min(end));
            if a >= b {
                continue;
            }
            if a > cursor {
                let s = slot(start, cursor);
                let e = slot(start, a);
                self.read_base(&mut buf[s..e], cursor * BLOCK_SIZE_U64)?;
            }
            self.apply_op(op, a, b, start, buf, &mut unit)?;
            cursor = cursor.max(b);
        }
        if cursor < end {
            let s = slot(start, cursor);
            self.read_base(&mut buf[s..], cursor * BLOCK_SIZE_U64)?;
        }
        Ok(())
    }

    /// Write blocks `a..b` of `op` into `buf` (which starts at block `start`).
    fn apply_op(
        &self,
        op: &Op,
        a: u64,
        b: u64,
        start: u64,
        buf: &mut [u8],
        unit: &mut Vec<u8>,
    ) -> Result<()> {
        let dst = &mut buf[slot(start, a)..slot(start, b)];
        match op.kind {
            OpKind::Zero => dst.fill(0),
            OpKind::Copy => self.read_base(dst, op.source * BLOCK_SIZE_U64)?,
            OpKind::Xor => {
                self.read_base(dst, op.source)?;
                unit.resize(BLOCK_SIZE, 0);
                self.cow.read_payload(op, unit)?;
                xor_into(dst, unit);
            }
            OpKind::Replace => {
                if a == op.new_block && b == op.end_block() {
                    self.cow.read_payload(op, dst)?;
                } else {
                    unit.resize(op.unit_size(), 0);
                    self.cow.read_payload(op, unit)?;
                    let off = ((a - op.new_block) as usize) * BLOCK_SIZE;
                    dst.copy_from_slice(&unit[off..off + dst.len()]);
                }
            }
        }
        Ok(())
    }

    /// Write the whole new image to `out` (which must be empty or sized by
    /// the caller), in parallel 1 MiB chunks. `progress` gets byte counts. With
    /// `sparse`, chunks of zeros are not written: `out` must be a fresh file
    /// already extended to the image's size, whose holes read as zeros.
    pub fn write_to(
        &self,
        out: &File,
        out_path: &Path,
        sparse: bool,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        const CHUNK: u64 = 1 << 20;
        let chunks = self.size.div_ceil(CHUNK);
        let done = AtomicU64::new(0);
        (0..chunks).into_par_iter().try_for_each_init(
            || vec![0u8; CHUNK as usize],
            |buf, c| -> Result<()> {
                let off = c * CHUNK;
                let len = (self.size - off).min(CHUNK);
                let blocks = len.div_ceil(BLOCK_SIZE_U64) as usize;
                let b = &mut buf[..blocks * BLOCK_SIZE];
                self.read_blocks(off / BLOCK_SIZE_U64, b)?;
                let data = &b[..len as usize];
                if !(sparse && data.iter().all(|&x| x == 0)) {
                    out.write_all_at(data, off)
                        .map_err(io_err(out_path, "write", off))?;
                }
                progress(done.fetch_add(len, Ordering::Relaxed) + len);
                Ok(())
            },
        )
    }
}

fn slot(start: u64, block: u64) -> usize {
    ((block - start) as usize) * BLOCK_SIZE
}

/// XOR `src` into `dst`, a machine word at a time.
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    let n = dst.len().min(src.len());
    let (d, s) = (&mut dst[..n], &src[..n]);
    let mut dc = d.chunks_exact_mut(8);
    let mut sc = s.chunks_exact(8);
    for (x, y) in (&mut dc).zip(&mut sc) {
        let mut xa = [0u8; 8];
        xa.copy_from_slice(x);
        let mut ya = [0u8; 8];
        ya.copy_from_slice(y);
        x.copy_from_slice(&(u64::from_ne_bytes(xa) ^ u64::from_ne_bytes(ya)).to_ne_bytes());
    }
    for (x, y) in dc.into_remainder().iter_mut().zip(sc.remainder()) {
        *x ^= *y;
    }
}

/// Size of a regular file or block device.
pub fn file_size(file: &File, path: &Path) -> Result<u64> {
    vabc_io::size_of(file).map_err(io_err(path, "find the size of", 0))
}
