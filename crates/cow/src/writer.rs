//! Writing COW files that AOSP accepts (§3 and the checklist in §10).
//!
//! Durability follows AOSP's contract: the header and the zeroed scratch
//! area are written and synced first; a label is a durable checkpoint (every
//! op before it survives a crash, and a writer re-opened at that label
//! continues from there); the v2 footer or the v3 header written by
//! [`CowWriter::finalize`] commits the rest.
//!
//! Compression runs on a rayon pool. Each unit is compressed independently
//! and the results are reassembled in submission order, so the output does
//! not depend on the thread count.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use zerocopy::IntoBytes;

use crate::codec::{Codec, Compression, Encoder};
use crate::error::{CowError, Result, io_err};
use crate::format::*;
use crate::reader::{CowReader, OpenOptions as ReadOptions};

/// Options of a new COW. `Default` gives Android 15's choice: v3, lz4,
/// 64 KiB compression units, with a 2 MiB scratch area.
#[derive(Clone, Debug)]
pub struct WriterOptions {
    /// 2 or 3.
    pub version: u16,
    pub compression: Compression,
    /// Level for XOR payloads instead of `compression`'s (same codec).
    /// Readers cannot tell: each payload is a standard stream of its codec.
    pub xor_level: Option<i32>,
    /// v3 `max_compression_size`: 4 KiB..256 KiB, a power of two.
    pub compression_factor: u32,
    /// v2 cluster size in op slots (0 = unclustered, else ≥ 2).
    pub cluster_ops: u32,
    /// v3 op-array capacity; must cover every op written. 0 = `max_blocks`.
    pub op_count_max: u64,
    /// Bytes reserved (zeroed) for the merge scratch area: AOSP's 2 MiB
    /// ([`SCRATCH_SIZE`], the default), or 0 for none. Smaller areas make
    /// shorter merge windows (tests use them to keep files small).
    pub scratch_size: u32,
    /// Compression threads; 0 = one per CPU.
    pub threads: usize,
    /// Reject ops for blocks at or past this number.
    pub max_blocks: Option<u64>,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            version: 3,
            compression: Compression::new(Codec::Lz4),
            xor_level: None,
            compression_factor: 65536,
            cluster_ops: 1024,
            op_count_max: 0,
            scratch_size: SCRATCH_SIZE,
            threads: 0,
            max_blocks: None,
        }
    }
}

/// What `finalize` wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct CowSizeInfo {
    /// Bytes of the finished file.
    pub cow_size: u64,
    /// Data ops (COPY, REPLACE, ZERO, XOR).
    pub op_count: u64,
    /// Stored payload bytes.
    pub data_bytes: u64,
}

/// Destination blocks already written, to refuse a second data op for the
/// same block (AOSP's readers disagree on which one wins). Sparse bitmap in
/// 64 Ki-block pages.
#[derive(Default)]
struct BlockSet {
    pages: HashMap<u64, Box<[u64; 1024]>>,
}

impl BlockSet {
    /// Insert; false if it was already there.
    fn insert(&mut self, b: u64) -> bool {
        let page = self
            .pages
            .entry(b >> 16)
            .or_insert_with(|| Box::new([0; 1024]));
        let (w, bit) = (((b >> 6) & 1023) as usize, b & 63);
        let had = page[w] & (1 << bit) != 0;
        page[w] |= 1 << bit;
        !had
    }
}

struct V2State {
    /// Cluster size in slots (0 = unclustered).
    n: u64,
    /// First slot of the current cluster, or the next record when unclustered.
    cluster_start: u64,
    /// Encoded records of the current cluster (unclustered: pending records
    /// and their inline data, starting at `cluster_start`).
    records: Vec<u8>,
    slots_used: u64,
    /// Payload bytes of the current cluster not yet on disk.
    data: Vec<u8>,
    /// Payload bytes of the current cluster already on disk.
    data_flushed: u64,
    /// Where the next payload byte goes.
    data_cursor: u64,
    /// Records written so far, as the footer counts them.
    records_total: u64,
    seen_data_op: bool,
}

struct V3State {
    seq_start: u64,
    resume_start: u64,
    op_start: u64,
    data_start: u64,
    layout_fixed: bool,
    /// Records on disk or pending.
    op_count: u64,
    pending_records: Vec<u8>,
    /// Index of the first pending record.
    pending_first: u64,
    pending_data: Vec<u8>,
    pending_data_start: u64,
    data_cursor: u64,
    resume_points: Vec<ResumePoint>,
}

enum State {
    V2(V2State),
    V3(V3State),
}

/// Writes a COW file; see the module docs for durability.
pub struct CowWriter {
    path: PathBuf,
    file: File,
    is_regular: bool,
    opts: WriterOptions,
    header: Header,
    state: State,
    sequence: Vec<u32>,
    written: BlockSet,
    data_ops: u64,
    data_bytes: u64,
    pool: Option<rayon::ThreadPool>,
}

/// Flush pending payload once this much is buffered.
const FLUSH_BYTES: usize = 4 << 20;
/// Compress at most this much input per parallel batch (bounds memory).
const BATCH_BYTES: usize = 16 << 20;

impl CowWriter {
    /// Create (or truncate) `path` and write the header and scratch area.
    pub fn create(path: impl AsRef<Path>, opts: WriterOptions) -> Result<CowWriter> {
        let path = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(io_err(path, "create", 0))?;
        Self::from_file(file, path, opts)
    }

    /// Start a new COW in an open file (a temp file or a block device);
    /// `path` names it in messages.
    pub fn from_file(file: File, path: &Path, opts: WriterOptions) -> Result<CowWriter> {
        check_options(&opts)?;
        let is_regular = file.metadata().map_err(io_err(path, "stat", 0))?.is_file();
        let buffer_size = opts.scratch_size;
        let header = if opts.version == 2 {
            Header {
                major_version: 2,
                header_size: HEADER_SIZE_V2,
                footer_size: FOOTER_SIZE_V2,
                op_size: OP_SIZE_V2,
                block_size: BLOCK_SIZE as u32,
                cluster_ops: opts.cluster_ops,
                buffer_size,
                ..Default::default()
            }
        } else {
            let op_count_max = match (opts.op_count_max, opts.max_blocks) {
                (0, Some(m)) => m,
                (n, _) => n,
            };
            if op_count_max == 0 {
                return Err(CowError::Usage {
                    path: path.to_path_buf(),
                    msg: "a v3 COW needs op_count_max (or max_blocks) before the first op".into(),
                });
            }
            Header {
                major_version: 3,
                header_size: HEADER_SIZE_V3,
                op_size: OP_SIZE_V3,
                block_size: BLOCK_SIZE as u32,
                buffer_size,
                resume_point_max: RESUME_POINT_MAX,
                op_count_max,
                compression_algorithm: opts.compression.codec.id(),
                max_compression_size: opts.compression_factor,
                ..Default::default()
            }
        };
        let start = header.payload_start();
        let state = if opts.version == 2 {
            let n = u64::from(opts.cluster_ops);
            State::V2(V2State {
                n,
                cluster_start: start,
                records: Vec::new(),
                slots_used: 0,
                data: Vec::new(),
                data_flushed: 0,
                data_cursor: start + n * u64::from(OP_SIZE_V2),
                records_total: 0,
                seen_data_op: false,
            })
        } else {
            State::V3(V3State {
                seq_start: start,
                resume_start: 0,
                op_start: 0,
                data_start: 0,
                layout_fixed: false,
                op_count: 0,
                pending_records: Vec::new(),
                pending_first: 0,
                pending_data: Vec::new(),
                pending_data_start: 0,
                data_cursor: 0,
                resume_points: Vec::new(),
            })
        };
        let w = CowWriter {
            path: path.to_path_buf(),
            file,
            is_regular,
            pool: make_pool(opts.threads)?,
            opts,
            header,
            state,
            sequence: Vec::new(),
            written: BlockSet::default(),
            data_ops: 0,
            data_bytes: 0,
        };
        // Header and zeroed scratch area first, durably (AOSP's order).
        let mut head = w.header.encode();
        head.resize(start as usize, 0);
        w.write_at(&head, 0)?;
        w.sync()?;
        Ok(w)
    }

    /// Re-open a COW at `label` to continue writing it: everything after the
    /// label is discarded and will be overwritten (AOSP's resume). The
    /// version and compression must match the file's.
    pub fn resume(path: impl AsRef<Path>, opts: WriterOptions, label: u64) -> Result<CowWriter> {
        let path = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err(path, "open", 0))?;
        let reader = CowReader::from_file(
            file.try_clone().map_err(io_err(path, "dup", 0))?,
            path,
            ReadOptions { label: Some(label) },
        )?;
        let h = reader.header().clone();
        let usage = |msg: String| CowError::Usage {
            path: path.to_path_buf(),
            msg,
        };
        if h.major_version != opts.version {
            return Err(usage(format!(
                "cannot resume a v{} COW as v{}",
                h.major_version, opts.version
            )));
        }
        let file_codec = if h.major_version == 3 {
            reader.codec()
        } else {
            // v2 files name their codec only on data ops.
            if reader.codec() == Codec::None {
                opts.compression.codec
            } else {
                reader.codec()
            }
        };
        if file_codec != opts.compression.codec {
            return Err(usage(format!(
                "the COW uses {file_codec}, not {}",
                opts.compression.codec
            )));
        }
        let mut opts = opts;
        let is_regular = file.metadata().map_err(io_err(path, "stat", 0))?.is_file();
        let mut written = BlockSet::default();
        for op in reader.ops() {
            for b in op.new_block..op.end_block() {
                written.insert(b);
            }
        }
        let state = if h.major_version == 2 {
            opts.cluster_ops = h.cluster_ops;
            let tail = reader
                .v2_tail
                .ok_or_else(|| usage("no resume position".into()))?;
            let n = u64::from(h.cluster_ops);
            let mut records = vec![0u8; (tail.slots_used * u64::from(OP_SIZE_V2)) as usize];
            if n > 0 {
                reader.read_file_at(&mut records, tail.cluster_start)?;
            } else {
                records.clear();
            }
            State::V2(V2State {
                n,
                cluster_start: tail.cluster_start,
                records,
                slots_used: tail.slots_used,
                data: Vec::new(),
                data_flushed: if n > 0 {
                    tail.data_cursor - (tail.cluster_start + n * u64::from(OP_SIZE_V2))
                } else {
                    0
                },
                data_cursor: tail.data_cursor,
                records_total: tail.records,
                seen_data_op: tail.seen_data_op,
            })
        } else {
            opts.compression_factor = reader.max_compression_size();
            opts.op_count_max = h.op_count_max;
            let seq_start = h.payload_start();
            let resume_start = seq_start + 4 * h.sequence_data_count;
            let op_start = resume_start + RESUME_POINT_SIZE as u64 * u64::from(h.resume_point_max);
            let op_count = reader.ops().len() as u64;
            let data_cursor = reader.data_start() + reader.data_bytes();
            State::V3(V3State {
                seq_start,
                resume_start,
                op_start,
                data_start: reader.data_start(),
                layout_fixed: true,
                op_count,
                pending_records: Vec::new(),
                pending_first: op_count,
                pending_data: Vec::new(),
                pending_data_start: data_cursor,
                data_cursor,
                resume_points: reader
                    .labels()
                    .iter()
                    .map(|l| ResumePoint {
                        label: l.label,
                        op_index: l.ops_before,
                    })
                    .collect(),
            })
        };
        check_options(&opts)?;
        let dropped = reader.v3_dropped_records;
        let mut w = CowWriter {
            path: path.to_path_buf(),
            file,
            is_regular,
            pool: make_pool(opts.threads)?,
            opts,
            header: h,
            state,
            sequence: reader.sequence().to_vec(),
            written,
            data_ops: reader.ops().len() as u64,
            data_bytes: reader.data_bytes(),
        };
        if let State::V2(s) = &w.state
            && s.n > 0
            && s.slots_used == s.n - 1
        {
            // The label took the last free slot: the original writer closed
            // the cluster right after it, and so do we.
            w.close_cluster_v2(0)?;
        }
        if let State::V3(s) = &w.state {
            // Clear the records that followed the label, then commit the
            // shortened op count at once, so a crash from here on never
            // shows a mix of old and new records.
            let (start, count) = (s.op_start + s.op_count * u64::from(OP_SIZE_V3), dropped);
            if count > 0 {
                let zeros = vec![0u8; (count * u64::from(OP_SIZE_V3)) as usize];
                w.write_at(&zeros, start)?;
            }
            w.commit_v3_header()?;
        }
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Set the merge order of the ordered (COPY/XOR) ops: their destination
    /// blocks, in the order they must be merged. Must come before any op.
    pub fn add_sequence(&mut self, new_blocks: &[u32]) -> Result<()> {
        match &self.state {
            State::V2(s) => {
                if s.seen_data_op {
                    return Err(self.usage("sequence data must come before any data op"));
                }
                if s.n == 0 {
                    return Err(self.usage(
                        "sequence data needs a clustered v2 COW (AOSP's reader breaks on cluster_ops = 0)",
                    ));
                }
                for chunk in new_blocks.chunks(SEQUENCE_ENTRIES_PER_OP) {
                    let data = sequence_to_wire(chunk);
                    self.push_v2(op_type::SEQUENCE, 0, 0, 0, Some(&data))?;
                }
            }
            State::V3(s) => {
                if s.layout_fixed {
                    return Err(self.usage("sequence data must come before any op or label"));
                }
            }
        }
        self.sequence.extend_from_slice(new_blocks);
        Ok(())
    }

    /// `num_blocks` COPY ops: new_block + i ← old_block + i.
    pub fn add_copy(&mut self, new_block: u64, old_block: u64, num_blocks: u64) -> Result<()> {
        if old_block
            .checked_add(num_blocks)
            .is_none_or(|e| e > V3_SOURCE_MASK)
        {
            return Err(self.usage(format!("COPY source block {old_block} is out of range")));
        }
        for i in 0..num_blocks {
            self.claim(new_block + i, 1)?;
            self.push_op(OpKind::Copy, new_block + i, old_block + i, 0, None)?;
        }
        Ok(())
    }

    /// `num_blocks` ZERO ops.
    pub fn add_zero_blocks(&mut self, new_block: u64, num_blocks: u64) -> Result<()> {
        for i in 0..num_blocks {
            self.claim(new_block + i, 1)?;
            self.push_op(OpKind::Zero, new_block + i, 0, 0, None)?;
        }
        Ok(())
    }

    /// REPLACE ops for `data` (whole blocks) at `new_block`. In v3, runs are
    /// cut greedily into the largest power-of-two units that fit, up to the
    /// compression factor.
    pub fn add_raw_blocks(&mut self, new_block: u64, data: &[u8]) -> Result<()> {
        self.check_data(data)?;
        let total = (data.len() / BLOCK_SIZE) as u64;
        for b in new_block..new_block + total {
            self.claim(b, 1)?;
        }
        let max_unit = if self.opts.version == 3 {
            (self.opts.compression_factor as usize / BLOCK_SIZE) as u64
        } else {
            1
        };
        let mut units: Vec<(u64, usize, usize)> = Vec::new(); // (block, start, len)
        let mut at = 0u64;
        while at < total {
            let left = total - at;
            let n = prev_power_of_two(left.min(max_unit));
            units.push((
                new_block + at,
                at as usize * BLOCK_SIZE,
                n as usize * BLOCK_SIZE,
            ));
            at += n;
        }
        self.write_units(OpKind::Replace, data, &units, |_| 0)
    }

    /// XOR ops: `xored` holds new ⊕ source, block by block; block i reads
    /// 4096 source bytes at byte (old_block + i) × 4096 + offset.
    pub fn add_xor_blocks(
        &mut self,
        new_block: u64,
        xored: &[u8],
        old_block: u64,
        offset: u16,
    ) -> Result<()> {
        self.check_data(xored)?;
        if usize::from(offset) >= BLOCK_SIZE {
            return Err(self.usage(format!("XOR offset {offset} is not below the block size")));
        }
        let total = (xored.len() / BLOCK_SIZE) as u64;
        let last = (old_block + total) * BLOCK_SIZE_U64 + u64::from(offset);
        if last > V3_SOURCE_MASK {
            return Err(self.usage(format!("XOR source block {old_block} is out of range")));
        }
        for b in new_block..new_block + total {
            self.claim(b, 1)?;
        }
        let units: Vec<(u64, usize, usize)> = (0..total)
            .map(|i| (new_block + i, i as usize * BLOCK_SIZE, BLOCK_SIZE))
            .collect();
        self.write_units(OpKind::Xor, xored, &units, |b| {
            (old_block + (b - new_block)) * BLOCK_SIZE_U64 + u64::from(offset)
        })
    }

    /// A durable checkpoint: everything before it survives a crash, and
    /// [`CowWriter::resume`] at this label continues from here.
    pub fn add_label(&mut self, label: u64) -> Result<()> {
        if matches!(self.state, State::V2(_)) {
            self.push_v2(op_type::LABEL, 0, 0, label, None)?;
            self.flush_v2(false)?;
            return self.sync_data();
        }
        self.fix_v3_layout()?;
        self.flush_v3()?;
        // Payload and records reach the disk before the metadata that
        // points at them (AOSP uses one fsync for both).
        self.sync_data()?;
        if let State::V3(s) = &mut self.state {
            s.resume_points.retain(|p| p.label < label);
            s.resume_points.push(ResumePoint {
                label,
                op_index: s.op_count,
            });
            let excess = s
                .resume_points
                .len()
                .saturating_sub(RESUME_POINT_MAX as usize);
            s.resume_points.drain(..excess);
        }
        self.commit_v3_header()
    }

    /// Write everything out: the v2 footer (file truncated after it), or the
    /// v3 header as commit record. Syncs.
    pub fn finalize(mut self) -> Result<CowSizeInfo> {
        let cow_size = if matches!(self.state, State::V2(_)) {
            self.finalize_v2()?
        } else {
            self.fix_v3_layout()?;
            self.flush_v3()?;
            self.sync_data()?;
            self.commit_v3_header()?;
            let State::V3(s) = &self.state else {
                unreachable!("checked above")
            };
            let end = s.data_cursor;
            if self.is_regular {
                self.file
                    .set_len(end)
                    .map_err(io_err(&self.path, "truncate", end))?;
                self.sync()?;
            }
            end
        };
        Ok(CowSizeInfo {
            cow_size,
            op_count: self.data_ops,
            data_bytes: self.data_bytes,
        })
    }

    // ---- internals ----

    fn usage(&self, msg: impl Into<String>) -> CowError {
        CowError::Usage {
            path: self.path.clone(),
            msg: msg.into(),
        }
    }

    fn write_at(&self, buf: &[u8], off: u64) -> Result<()> {
        self.file
            .write_all_at(buf, off)
            .map_err(io_err(&self.path, "write", off))
    }

    fn sync(&self) -> Result<()> {
        self.file.sync_all().map_err(io_err(&self.path, "fsync", 0))
    }

    fn sync_data(&self) -> Result<()> {
        self.file
            .sync_data()
            .map_err(io_err(&self.path, "fdatasync", 0))
    }

    fn check_data(&self, data: &[u8]) -> Result<()> {
        if data.is_empty() || !data.len().is_multiple_of(BLOCK_SIZE) {
            return Err(self.usage(format!(
                "data of {} bytes is not a whole, non-zero number of 4096-byte blocks",
                data.len()
            )));
        }
        Ok(())
    }

    /// Record that blocks are about to get an op; refuse duplicates and
    /// blocks past the limits.
    fn claim(&mut self, block: u64, n: u64) -> Result<()> {
        for b in block..block + n {
            if b > u64::from(u32::MAX) || self.opts.max_blocks.is_some_and(|m| b >= m) {
                return Err(self.usage(format!("new block {b} is out of range")));
            }
            if !self.written.insert(b) {
                return Err(self.usage(format!(
                    "new block {b} already has an op (never two data ops for one block)"
                )));
            }
        }
        Ok(())
    }

    /// Compress units in parallel, then append them in order.
    fn write_units(
        &mut self,
        kind: OpKind,
        data: &[u8],
        units: &[(u64, usize, usize)],
        source_of: impl Fn(u64) -> u64,
    ) -> Result<()> {
        let mut comp = self.opts.compression;
        if let (OpKind::Xor, Some(l)) = (kind, self.opts.xor_level) {
            comp.level = Some(l);
        }
        let unit_max = if self.opts.version == 3 {
            self.opts.compression_factor as usize
        } else {
            BLOCK_SIZE
        };
        let mut i = 0;
        while i < units.len() {
            // A batch of at most BATCH_BYTES of input.
            let mut j = i;
            let mut bytes = 0;
            while j < units.len() && (j == i || bytes + units[j].2 <= BATCH_BYTES) {
                bytes += units[j].2;
                j += 1;
            }
            let batch = &units[i..j];
            let compress = || -> Result<Vec<Vec<u8>>> {
                batch
                    .par_iter()
                    .map_init(
                        || Encoder::new(comp, unit_max),
                        |enc, &(_, s, l)| enc.compress(&data[s..s + l]),
                    )
                    .collect()
            };
            let packed = if comp.codec == Codec::None {
                batch
                    .iter()
                    .map(|&(_, s, l)| data[s..s + l].to_vec())
                    .collect()
            } else {
                match &self.pool {
                    Some(p) => p.install(compress)?,
                    None => compress()?,
                }
            };
            for (&(block, s, l), c) in batch.iter().zip(packed) {
                let raw = &data[s..s + l];
                let stored: &[u8] = if self.store_raw(c.len(), l) { raw } else { &c };
                let exp = (l / BLOCK_SIZE).trailing_zeros();
                self.push_op(kind, block, source_of(block), exp, Some(stored))?;
            }
            i = j;
        }
        Ok(())
    }

    /// The raw-storage rules of §2.6.
    fn store_raw(&self, compressed: usize, unit: usize) -> bool {
        match self.opts.compression.codec {
            Codec::None => true,
            // v2 gz/brotli always store the compressed stream, even when
            // larger (AOSP's readers always inflate them).
            Codec::Gz | Codec::Brotli if self.opts.version == 2 => false,
            _ => compressed >= unit,
        }
    }

    fn push_op(
        &mut self,
        kind: OpKind,
        new_block: u64,
        source: u64,
        exp: u32,
        payload: Option<&[u8]>,
    ) -> Result<()> {
        self.data_ops += 1;
        self.data_bytes += payload.map_or(0, |p| p.len() as u64);
        if matches!(self.state, State::V2(_)) {
            let compression = match kind {
                OpKind::Replace | OpKind::Xor => self.opts.compression.codec.id() as u8,
                _ => 0,
            };
            return self.push_v2(kind.type_id(), compression, new_block, source, payload);
        }
        self.fix_v3_layout()?;
        let State::V3(s) = &mut self.state else {
            unreachable!("v3 state")
        };
        if s.op_count + 1 > self.header.op_count_max {
            return Err(CowError::Usage {
                path: self.path.clone(),
                msg: format!(
                    "op_count_max {} exceeded (op for new block {new_block})",
                    self.header.op_count_max
                ),
            });
        }
        let len = payload.map_or(0, <[u8]>::len);
        let src = if kind == OpKind::Replace {
            s.data_cursor
        } else {
            source
        };
        RecordV3::new(kind, new_block as u32, src, exp, len as u32)
            .encode_into(&mut s.pending_records);
        s.op_count += 1;
        if let Some(p) = payload {
            s.pending_data.extend_from_slice(p);
            s.data_cursor += p.len() as u64;
        }
        if s.pending_data.len() >= FLUSH_BYTES || s.pending_records.len() >= FLUSH_BYTES {
            self.flush_v3()?;
        }
        Ok(())
    }

    /// Append a v2 record. REPLACE and SEQUENCE records get their payload's
    /// absolute offset as `source`.
    fn push_v2(
        &mut self,
        op_type: u8,
        compression: u8,
        new_block: u64,
        source: u64,
        payload: Option<&[u8]>,
    ) -> Result<()> {
        let State::V2(s) = &mut self.state else {
            unreachable!("v2 state")
        };
        let len = payload.map_or(0, <[u8]>::len);
        if len > usize::from(u16::MAX) {
            return Err(CowError::Usage {
                path: self.path.clone(),
                msg: format!("v2 payload of {len} bytes does not fit data_length"),
            });
        }
        let rec_size = u64::from(OP_SIZE_V2);
        // In unclustered mode the payload follows its own record.
        let data_at = if s.n == 0 {
            s.cluster_start + s.records.len() as u64 + rec_size
        } else {
            s.data_cursor
        };
        let src = match op_type {
            op_type::SEQUENCE | op_type::REPLACE => data_at,
            _ => source,
        };
        let rec = RecordV2 {
            op_type,
            compression,
            data_length: len as u16,
            new_block,
            source: src,
        };
        rec.encode_into(&mut s.records);
        s.records_total += 1;
        if op_type != op_type::LABEL {
            s.seen_data_op |= op_type != op_type::SEQUENCE;
        }
        if let Some(p) = payload {
            if s.n == 0 {
                s.records.extend_from_slice(p);
            } else {
                s.data.extend_from_slice(p);
            }
            s.data_cursor = data_at + len as u64;
        }
        if s.n == 0 {
            s.data_cursor = s.cluster_start + s.records.len() as u64;
            if s.records.len() >= FLUSH_BYTES {
                self.flush_v2(false)?;
            }
            return Ok(());
        }
        s.slots_used += 1;
        if s.slots_used == s.n - 1 {
            // One slot left: it takes the CLUSTER op.
            self.close_cluster_v2(0)?;
        } else if s.data.len() >= FLUSH_BYTES {
            self.flush_v2(false)?;
        }
        Ok(())
    }

    /// Close the cluster with a CLUSTER op that skips the `unused` slots
    /// after it and this cluster's data, to where the next cluster starts.
    fn close_cluster_v2(&mut self, unused: u64) -> Result<()> {
        let State::V2(s) = &mut self.state else {
            unreachable!("v2 state")
        };
        let skip = unused * u64::from(OP_SIZE_V2) + s.data_flushed + s.data.len() as u64;
        RecordV2 {
            op_type: op_type::CLUSTER,
            source: skip,
            ..Default::default()
        }
        .encode_into(&mut s.records);
        s.records_total += 1;
        s.slots_used += 1;
        self.flush_v2(true)
    }

    /// Write the current cluster's records (unused slots zeroed) and pending
    /// data. `close` starts the next cluster after it.
    fn flush_v2(&mut self, close: bool) -> Result<()> {
        let State::V2(s) = &mut self.state else {
            unreachable!("v2 state")
        };
        let rec_size = u64::from(OP_SIZE_V2);
        if s.n == 0 {
            let (buf, at) = (std::mem::take(&mut s.records), s.cluster_start);
            s.cluster_start += buf.len() as u64;
            s.data_cursor = s.cluster_start;
            return self.write_at(&buf, at);
        }
        let mut slots = std::mem::take(&mut s.records);
        let used = slots.len();
        slots.resize((s.n * rec_size) as usize, 0);
        let data_at = s.cluster_start + s.n * rec_size + s.data_flushed;
        let data = std::mem::take(&mut s.data);
        let cluster_start = s.cluster_start;
        s.data_flushed += data.len() as u64;
        if close {
            s.cluster_start = s.data_cursor.max(cluster_start + s.n * rec_size);
            s.slots_used = 0;
            s.data_flushed = 0;
            s.data_cursor = s.cluster_start + s.n * rec_size;
        } else {
            slots.truncate(used);
            s.records = slots.clone();
            slots.resize((s.n * rec_size) as usize, 0);
        }
        // Records and data are adjacent: one write when both are pending.
        if data.is_empty() {
            self.write_at(&slots, cluster_start)
        } else if data_at == cluster_start + slots.len() as u64 {
            slots.extend_from_slice(&data);
            self.write_at(&slots, cluster_start)
        } else {
            self.write_at(&slots, cluster_start)?;
            self.write_at(&data, data_at)
        }
    }

    fn finalize_v2(&mut self) -> Result<u64> {
        let rec_size = u64::from(OP_SIZE_V2);
        let State::V2(s) = &mut self.state else {
            unreachable!("v2 state")
        };
        if s.n > 0 && s.data_flushed + s.data.len() as u64 > 0 {
            // The footer must start a fresh cluster after this one's data.
            let unused = s.n - s.slots_used - 1;
            self.close_cluster_v2(unused)?;
        }
        let State::V2(s) = &mut self.state else {
            unreachable!("v2 state")
        };
        let footer_at = s.cluster_start + s.records.len() as u64;
        let mut tail = std::mem::take(&mut s.records);
        let footer = WireFooterV2 {
            op: WireOpV2::from(&RecordV2 {
                op_type: op_type::FOOTER,
                compression: 0,
                data_length: FOOTER_TRAILER as u16,
                new_block: s.records_total * rec_size,
                source: s.records_total,
            }),
            unused: [0; FOOTER_TRAILER],
        };
        tail.extend_from_slice(footer.as_bytes());
        let start = s.cluster_start;
        let end = start + tail.len() as u64;
        debug_assert_eq!(footer_at + FOOTER_SIZE_V2 as u64, end);
        self.write_at(&tail, start)?;
        if self.is_regular {
            self.file
                .set_len(end)
                .map_err(io_err(&self.path, "truncate", end))?;
        }
        self.sync()?;
        Ok(end)
    }

    /// The v3 region offsets depend on the sequence length, so they are
    /// fixed (and the sequence written) at the first op or label.
    fn fix_v3_layout(&mut self) -> Result<()> {
        let State::V3(s) = &mut self.state else {
            return Ok(());
        };
        if s.layout_fixed {
            return Ok(());
        }
        self.header.sequence_data_count = self.sequence.len() as u64;
        s.resume_start = s.seq_start + 4 * self.sequence.len() as u64;
        s.op_start = s.resume_start + RESUME_POINT_SIZE as u64 * u64::from(RESUME_POINT_MAX);
        s.data_start = s.op_start + u64::from(OP_SIZE_V3) * self.header.op_count_max;
        s.data_cursor = s.data_start;
        s.pending_data_start = s.data_start;
        s.layout_fixed = true;
        let mut region = sequence_to_wire(&self.sequence);
        region.resize(
            region.len() + RESUME_POINT_SIZE * RESUME_POINT_MAX as usize,
            0,
        );
        let at = s.seq_start;
        self.write_at(&region, at)
    }

    fn flush_v3(&mut self) -> Result<()> {
        let State::V3(s) = &mut self.state else {
            unreachable!("v3 state")
        };
        let recs = std::mem::take(&mut s.pending_records);
        let data = std::mem::take(&mut s.pending_data);
        let rec_at = s.op_start + s.pending_first * u64::from(OP_SIZE_V3);
        let data_at = s.pending_data_start;
        s.pending_first = s.op_count;
        s.pending_data_start = s.data_cursor;
        if !recs.is_empty() {
            self.write_at(&recs, rec_at)?;
        }
        if !data.is_empty() {
            self.write_at(&data, data_at)?;
        }
        Ok(())
    }

    /// Rewrite the resume buffer and the header (the v3 commit record), then
    /// fsync.
    fn commit_v3_header(&mut self) -> Result<()> {
        let State::V3(s) = &self.state else {
            return Ok(());
        };
        let mut points = vec![WireResumePoint::default(); RESUME_POINT_MAX as usize];
        for (slot, p) in points.iter_mut().zip(&s.resume_points) {
            *slot = WireResumePoint::from(p);
        }
        let resume_at = s.resume_start;
        // Stored clamped: AOSP's own count grows without bound, but its
        // readers accept the clamped value.
        self.header.resume_point_count = s.resume_points.len() as u32;
        self.header.op_count = s.op_count;
        self.write_at(points.as_bytes(), resume_at)?;
        self.write_at(&self.header.encode(), 0)?;
        self.sync()
    }
}

fn prev_power_of_two(n: u64) -> u64 {
    1 << (63 - n.leading_zeros())
}

fn make_pool(threads: usize) -> Result<Option<rayon::ThreadPool>> {
    if threads == 0 {
        return Ok(None);
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("cow-compress-{i}"))
        .build()
        .map(Some)
        .map_err(|e| CowError::InvalidOption(format!("cannot start {threads} threads: {e}")))
}

fn check_options(o: &WriterOptions) -> Result<()> {
    let bad = |m: String| Err(CowError::InvalidOption(m));
    if o.version != 2 && o.version != 3 {
        return bad(format!("COW version {} is not 2 or 3", o.version));
    }
    if o.version == 2 && o.cluster_ops == 1 {
        return bad("cluster_ops must be 0 or at least 2".into());
    }
    let f = o.compression_factor;
    if o.version == 3
        && (!f.is_power_of_two()
            || f < BLOCK_SIZE as u32
            || f > (BLOCK_SIZE as u32) << MAX_FACTOR_EXPONENT)
    {
        return bad(format!(
            "compression factor {f} is not a power of two from 4096 to 262144"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_units() {
        assert_eq!(prev_power_of_two(19), 16);
        assert_eq!(prev_power_of_two(3), 2);
        assert_eq!(prev_power_of_two(1), 1);
    }

    #[test]
    fn block_set() {
        let mut s = BlockSet::default();
        assert!(s.insert(5));
        assert!(!s.insert(5));
        assert!(s.insert(1 << 40));
        assert!(s.insert(65536 + 5));
    }
}
