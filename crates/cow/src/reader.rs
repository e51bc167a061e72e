//! Parsing a COW file into a version-independent op list, and random access
//! to the payload of any op.
//!
//! Memory is proportional to the op count: the reader keeps one `Op`
//! (40 bytes) per data op plus a sorted index, never image data. Payloads are
//! read with `pread`, so every `&self` method is safe to call from many
//! threads at once.

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use zerocopy::FromBytes;

use crate::codec::{self, Codec};
use crate::error::{CowError, Result, format_err, io_err};
use crate::format::*;
use crate::merge;

/// The v2 footer, as found on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Footer {
    /// File offset of the footer op record.
    pub offset: u64,
    pub num_ops: u64,
    pub ops_size: u64,
}

/// A label in the op stream (v2) or a resume point (v3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Label {
    pub label: u64,
    /// Number of data ops that precede the label.
    pub ops_before: u64,
}

/// Where a v1/v2 stream stops, so a writer can continue it (resume or append).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct V2Tail {
    /// Offset of the first slot of the current cluster (or of the next record
    /// when not clustered).
    pub cluster_start: u64,
    /// Slots of the current cluster already used.
    pub slots_used: u64,
    /// Where the next payload byte goes.
    pub data_cursor: u64,
    /// Records (data and metadata) parsed, as the footer will count them.
    pub records: u64,
    /// Whether a SEQUENCE or data op was seen (sequence ops must come first).
    pub seen_data_op: bool,
}

/// Options for opening a COW.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenOptions {
    /// Read only up to this label (v2: the LABEL op; v3: the resume point)
    /// and ignore everything after it, as AOSP does when resuming.
    pub label: Option<u64>,
}

/// A parsed COW file.
#[derive(Debug)]
pub struct CowReader {
    path: PathBuf,
    file: File,
    file_size: u64,
    header: Header,
    codec: Codec,
    ops: Vec<Op>,
    labels: Vec<Label>,
    sequence: Vec<u32>,
    footer: Option<Footer>,
    /// Op indices sorted by `new_block`, first op kept on duplicates (what
    /// snapuserd serves).
    index: Vec<u32>,
    /// Offset of the v3 data area, or of the v2 op stream.
    data_start: u64,
    pub(crate) v2_tail: Option<V2Tail>,
    /// Number of v3 records that follow the resume point we stopped at.
    pub(crate) v3_dropped_records: u64,
    requested_label: Option<u64>,
}

/// Buffered metadata reads over a file of known size, with bounds checks
/// that name the offset.
struct MetaReader<'a> {
    path: &'a Path,
    file: &'a File,
    size: u64,
    buf: Vec<u8>,
    buf_start: u64,
}

const META_WINDOW: usize = 1 << 20;

impl<'a> MetaReader<'a> {
    fn new(path: &'a Path, file: &'a File, size: u64) -> Self {
        MetaReader {
            path,
            file,
            size,
            buf: Vec::new(),
            buf_start: 0,
        }
    }

    fn read(&mut self, offset: u64, len: usize, what: &str) -> Result<&[u8]> {
        let end = offset
            .checked_add(len as u64)
            .ok_or_else(|| format_err(self.path, offset, format!("{what}: offset overflows")))?;
        if end > self.size {
            return Err(format_err(
                self.path,
                offset,
                format!(
                    "truncated: {what} needs {len} bytes at offset {offset}, but the file ends at {}",
                    self.size
                ),
            ));
        }
        let buf_end = self.buf_start + self.buf.len() as u64;
        if offset < self.buf_start || end > buf_end {
            let want = len.max(META_WINDOW).min((self.size - offset) as usize);
            self.buf.resize(want, 0);
            self.file
                .read_exact_at(&mut self.buf, offset)
                .map_err(io_err(self.path, "read", offset))?;
            self.buf_start = offset;
        }
        let s = (offset - self.buf_start) as usize;
        Ok(&self.buf[s..s + len])
    }

    /// The wire struct `T` at `offset`, checked as [`MetaReader::read`] checks.
    fn read_wire<T: FromBytes>(&mut self, offset: u64, what: &str) -> Result<T> {
        let path = self.path;
        let b = self.read(offset, size_of::<T>(), what)?;
        T::read_from_bytes(b).map_err(|_| {
            format_err(
                path,
                offset,
                format!("{what} is not {} bytes", size_of::<T>()),
            )
        })
    }
}

impl CowReader {
    /// Open and parse a COW file. A v2 file must have its footer.
    pub fn open(path: impl AsRef<Path>) -> Result<CowReader> {
        Self::open_with(path, OpenOptions::default())
    }

    /// Open a COW as it was at `label`: everything after it is ignored.
    pub fn open_at_label(path: impl AsRef<Path>, label: u64) -> Result<CowReader> {
        Self::open_with(path, OpenOptions { label: Some(label) })
    }

    pub fn open_with(path: impl AsRef<Path>, opts: OpenOptions) -> Result<CowReader> {
        let path = path.as_ref();
        let file = File::open(path).map_err(io_err(path, "open", 0))?;
        Self::from_file(file, path, opts)
    }

    /// Parse an already opened file (`path` is used in messages only).
    pub fn from_file(file: File, path: &Path, opts: OpenOptions) -> Result<CowReader> {
        let file_size = vabc_io::size_of(&file).map_err(io_err(path, "find the size of", 0))?;
        let mut r = CowReader {
            path: path.to_path_buf(),
            file,
            file_size,
            header: Header::default(),
            codec: Codec::None,
            ops: Vec::new(),
            labels: Vec::new(),
            sequence: Vec::new(),
            footer: None,
            index: Vec::new(),
            data_start: 0,
            v2_tail: None,
            v3_dropped_records: 0,
            requested_label: opts.label,
        };
        r.header = read_header(&r.file, path, file_size)?;
        if r.header.major_version == 3 {
            r.parse_v3(opts.label)?;
        } else {
            r.parse_v2(opts.label)?;
        }
        r.build_index();
        Ok(r)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn header(&self) -> &Header {
        &self.header
    }
    pub fn file_size(&self) -> u64 {
        self.file_size
    }
    /// The one compression algorithm of the file.
    pub fn codec(&self) -> Codec {
        self.codec
    }
    /// Data ops (COPY, REPLACE, ZERO, XOR) in stream order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }
    /// v2 labels in stream order, or v3 resume points (clamped to the max).
    pub fn labels(&self) -> &[Label] {
        &self.labels
    }
    /// Merge sequence: destination blocks of ordered ops, in merge order.
    pub fn sequence(&self) -> &[u32] {
        &self.sequence
    }
    pub fn footer(&self) -> Option<&Footer> {
        self.footer.as_ref()
    }
    /// The label this reader was opened at, if any.
    pub fn label(&self) -> Option<u64> {
        self.requested_label
    }
    /// Largest v3 compression unit in bytes (4096 for v1/v2).
    pub fn max_compression_size(&self) -> u32 {
        if self.header.major_version == 3 && self.header.max_compression_size != 0 {
            self.header.max_compression_size
        } else {
            BLOCK_SIZE as u32
        }
    }
    /// Offset where the v3 data area (or the v2 op stream) starts.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }
    /// Sum of stored payload bytes.
    pub fn data_bytes(&self) -> u64 {
        self.ops.iter().map(|o| u64::from(o.data_length)).sum()
    }
    /// Bytes of the base image that COPY and XOR ops read: a base shorter
    /// than this cannot be the source of this COW.
    pub fn source_extent(&self) -> u64 {
        self.ops
            .iter()
            .map(|o| match o.kind {
                OpKind::Copy => (o.source + 1) * BLOCK_SIZE_U64,
                OpKind::Xor => o.source + BLOCK_SIZE_U64,
                OpKind::Replace | OpKind::Zero => 0,
            })
            .max()
            .unwrap_or(0)
    }

    /// One past the highest destination block of any op.
    pub fn end_block(&self) -> u64 {
        self.ops.iter().map(Op::end_block).max().unwrap_or(0)
    }

    /// The op that provides `new_block`, and the block's index inside it.
    /// O(log n). Blocks without an op are unchanged from the base image.
    pub fn find_block(&self, new_block: u64) -> Option<(&Op, u32)> {
        let pos = self
            .index
            .partition_point(|&i| self.ops[i as usize].new_block <= new_block);
        // Look back over ops that start earlier but may still cover the block
        // (multi-block REPLACE is at most 64 blocks long).
        for &i in self.index[..pos].iter().rev() {
            let op = &self.ops[i as usize];
            if op.new_block + 64 <= new_block {
                break;
            }
            if new_block < op.end_block() {
                return Some((op, (new_block - op.new_block) as u32));
            }
        }
        None
    }

    /// Op indices sorted by `new_block` (duplicates removed, first op kept).
    pub fn block_index(&self) -> &[u32] {
        &self.index
    }

    /// The merge order as AOSP's `PrepMergeOps` derives it: indices into
    /// `ops()`.
    pub fn merge_order(&self) -> Result<Vec<usize>> {
        merge::merge_order(self.header.major_version, &self.ops, &self.sequence).map_err(|e| {
            CowError::MergeOrder {
                path: self.path.clone(),
                source: e,
            }
        })
    }

    /// Check that merging op by op in merge order is safe (`VerifyMergeOps`).
    pub fn verify_merge(&self) -> Result<()> {
        let order = self.merge_order()?;
        merge::verify_order(order.iter().map(|&i| &self.ops[i])).map_err(|e| CowError::MergeOrder {
            path: self.path.clone(),
            source: e,
        })
    }

    /// Decode an op's payload: the whole unit (`op.blocks * 4096` bytes) for
    /// REPLACE, the stored `new ^ source` block for XOR.
    pub fn read_payload(&self, op: &Op, out: &mut [u8]) -> Result<()> {
        let unit = op.unit_size();
        if out.len() != unit || !matches!(op.kind, OpKind::Replace | OpKind::Xor) {
            return Err(CowError::Usage {
                path: self.path.clone(),
                msg: format!(
                    "read_payload: {} op for block {} needs a {unit}-byte buffer, got {}",
                    op.kind,
                    op.new_block,
                    out.len()
                ),
            });
        }
        let len = op.data_length as usize;
        let raw = self.is_stored_raw(op);
        if raw {
            if len != unit {
                return Err(
                    self.decode_err(op, format!("raw payload is {len} bytes, expected {unit}"))
                );
            }
            return self.file.read_exact_at(out, op.data_offset).map_err(io_err(
                &self.path,
                "read payload",
                op.data_offset,
            ));
        }
        thread_local! {
            static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|s| {
            let mut buf = s.borrow_mut();
            buf.resize(len, 0);
            self.file
                .read_exact_at(&mut buf, op.data_offset)
                .map_err(io_err(&self.path, "read payload", op.data_offset))?;
            codec::decompress(self.codec, &buf, out).map_err(|m| self.decode_err(op, m))
        })
    }

    /// Decode an op's payload from its stored bytes (`data_length` bytes
    /// read from `data_offset` by the caller, e.g. in one batched read for
    /// many ops) into `out` (`op.blocks * 4096` bytes, 4096 for XOR).
    pub fn decode_payload(&self, op: &Op, stored: &[u8], out: &mut [u8]) -> Result<()> {
        let unit = op.unit_size();
        if out.len() != unit || stored.len() != op.data_length as usize {
            return Err(CowError::Usage {
                path: self.path.clone(),
                msg: format!(
                    "decode_payload: {} op for block {}: {} stored bytes into {} (expected {} into {unit})",
                    op.kind,
                    op.new_block,
                    stored.len(),
                    out.len(),
                    op.data_length
                ),
            });
        }
        if self.is_stored_raw(op) {
            if stored.len() != unit {
                return Err(self.decode_err(
                    op,
                    format!("raw payload is {} bytes, expected {unit}", stored.len()),
                ));
            }
            out.copy_from_slice(stored);
            return Ok(());
        }
        codec::decompress(self.codec, stored, out).map_err(|m| self.decode_err(op, m))
    }

    /// §2.6: v3 stores a unit raw exactly when `data_length == unit size`;
    /// v2 does so only for lz4/zstd (gz and brotli are always compressed).
    fn is_stored_raw(&self, op: &Op) -> bool {
        let full = op.data_length as usize == op.unit_size();
        match self.codec {
            Codec::None => true,
            Codec::Gz | Codec::Brotli if self.header.major_version < 3 => false,
            _ => full,
        }
    }

    fn decode_err(&self, op: &Op, msg: String) -> CowError {
        CowError::Decode {
            path: self.path.clone(),
            offset: op.data_offset,
            codec: self.codec.name(),
            kind: op.kind,
            new_block: op.new_block,
            msg,
        }
    }

    /// Read raw bytes of the COW file (for tools that inspect the layout).
    pub fn read_file_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(io_err(&self.path, "read", offset))
    }

    fn build_index(&mut self) {
        let mut idx: Vec<u32> = (0..self.ops.len() as u32).collect();
        // Stable sort keeps stream order among equal blocks, so dedup keeps
        // the first op, like snapuserd's block map.
        idx.sort_by_key(|&i| self.ops[i as usize].new_block);
        idx.dedup_by_key(|i| self.ops[*i as usize].new_block);
        self.index = idx;
    }

    fn set_codec_from_op(&mut self, id: u8, offset: u64) -> Result<()> {
        if id == 0 {
            return Ok(());
        }
        let codec = Codec::from_id(u32::from(id)).ok_or_else(|| {
            format_err(&self.path, offset, format!("unknown compression id {id}"))
        })?;
        if self.codec == Codec::None {
            self.codec = codec;
        } else if self.codec != codec {
            return Err(format_err(
                &self.path,
                offset,
                format!("mixed compression types: {} and {}", self.codec, codec),
            ));
        }
        Ok(())
    }

    fn parse_v2(&mut self, label: Option<u64>) -> Result<()> {
        let path = self.path.clone();
        let file = self.file.try_clone().map_err(io_err(&path, "dup", 0))?;
        let mut meta = MetaReader::new(&path, &file, self.file_size);
        let n = u64::from(self.header.cluster_ops);
        let rec = u64::from(OP_SIZE_V2);
        let start = self.header.payload_start();
        self.data_start = start;
        let mut tail = V2Tail {
            cluster_start: start,
            slots_used: 0,
            data_cursor: if n > 0 { start + n * rec } else { start },
            records: 0,
            seen_data_op: false,
        };
        // Ops are bounded by file size / 20, which guards the allocations below.
        loop {
            let rec_off = if n > 0 {
                if tail.slots_used == n {
                    // A full cluster without a CLUSTER op: the next one
                    // starts after its data.
                    tail.cluster_start = tail.data_cursor;
                    tail.slots_used = 0;
                    tail.data_cursor = tail.cluster_start + n * rec;
                }
                tail.cluster_start + tail.slots_used * rec
            } else {
                tail.cluster_start
            };
            if rec_off + rec > self.file_size {
                return Err(match label {
                    Some(l) => CowError::LabelNotFound {
                        path: path.clone(),
                        label: l,
                    },
                    None => format_err(
                        &path,
                        rec_off,
                        format!(
                            "no COW footer found: the op stream runs past the end of the file ({} bytes)",
                            self.file_size
                        ),
                    ),
                });
            }
            let r = RecordV2::from(&meta.read_wire::<WireOpV2>(rec_off, "op record")?);
            let next_inline = rec_off + rec;
            if n > 0 {
                tail.slots_used += 1;
            } else {
                // Unclustered: a payload follows its own record.
                tail.cluster_start = next_inline;
                tail.data_cursor = next_inline;
            }
            if r.op_type == op_type::FOOTER {
                return self.v2_footer(&mut meta, &r, rec_off, label, tail);
            }
            tail.records += 1;
            let check48 = |v: u64, what: &str| fits48(&path, rec_off, v, what);
            match r.op_type {
                op_type::CLUSTER => {
                    if n == 0 {
                        return Err(format_err(
                            &path,
                            rec_off,
                            "CLUSTER op in a non-clustered COW",
                        ));
                    }
                    check48(r.source, "cluster skip")?;
                    tail.cluster_start = next_inline + r.source;
                    tail.slots_used = 0;
                    tail.data_cursor = tail.cluster_start + n * rec;
                }
                op_type::LABEL => {
                    self.labels.push(Label {
                        label: r.source,
                        ops_before: self.ops.len() as u64,
                    });
                    if label == Some(r.source) {
                        self.v2_tail = Some(tail);
                        return Ok(());
                    }
                }
                op_type::SEQUENCE => self.v2_sequence(&mut meta, &r, rec_off, &mut tail)?,
                t => {
                    let op = self.v2_op(t, &r, rec_off, &mut tail)?;
                    tail.seen_data_op = true;
                    self.ops.push(op);
                }
            }
        }
    }

    /// The FOOTER record at `rec_off`: the end of the op stream, which must hold as
    /// many ops as it says (or, looking for `label`, a label that is not there).
    fn v2_footer(
        &mut self,
        meta: &mut MetaReader<'_>,
        r: &RecordV2,
        rec_off: u64,
        label: Option<u64>,
        mut tail: V2Tail,
    ) -> Result<()> {
        let path = self.path.clone();
        let rec = u64::from(OP_SIZE_V2);
        meta.read(rec_off + rec, FOOTER_TRAILER, "footer")?;
        // The footer reuses the record's slots: ops_size where new_block is, num_ops
        // where source is.
        let footer = Footer {
            offset: rec_off,
            num_ops: r.source,
            ops_size: r.new_block,
        };
        if let Some(l) = label {
            return Err(CowError::LabelNotFound { path, label: l });
        }
        if footer.num_ops != tail.records {
            return Err(format_err(
                &path,
                rec_off,
                format!(
                    "footer says {} ops, but {} were parsed",
                    footer.num_ops, tail.records
                ),
            ));
        }
        if footer.ops_size != footer.num_ops * rec {
            return Err(format_err(
                &path,
                rec_off,
                format!(
                    "footer ops_size {} does not match {} ops of {rec} bytes",
                    footer.ops_size, footer.num_ops
                ),
            ));
        }
        self.footer = Some(footer);
        if self.header.cluster_ops > 0 {
            tail.slots_used -= 1;
        } else {
            tail.cluster_start = rec_off;
        }
        self.v2_tail = Some(tail);
        Ok(())
    }

    /// A SEQUENCE record: the merge order it carries, read from its data.
    fn v2_sequence(
        &mut self,
        meta: &mut MetaReader<'_>,
        r: &RecordV2,
        rec_off: u64,
        tail: &mut V2Tail,
    ) -> Result<()> {
        let path = &self.path;
        let len = usize::from(r.data_length);
        if len % 4 != 0 {
            return Err(format_err(
                path,
                rec_off,
                format!("SEQUENCE op data length {len} is not a multiple of 4"),
            ));
        }
        fits48(path, rec_off, r.source, "sequence offset")?;
        let data = meta.read(r.source, len, "sequence data")?;
        let entries = sequence_from_wire(data).ok_or_else(|| {
            format_err(
                path,
                r.source,
                format!("sequence data of {len} bytes is not whole entries"),
            )
        })?;
        self.sequence.extend(entries);
        self.advance_data(tail, u64::from(r.data_length));
        Ok(())
    }

    /// Checks one v2 record of an op kind (`t`, not CLUSTER, LABEL, SEQUENCE or FOOTER)
    /// at `rec_off` and returns its op; an XOR payload sits at the data cursor of
    /// `tail`, which it advances past the payload.
    fn v2_op(&mut self, t: u8, r: &RecordV2, rec_off: u64, tail: &mut V2Tail) -> Result<Op> {
        let path = self.path.clone();
        let check48 = |v: u64, what: &str| fits48(&path, rec_off, v, what);
        let kind = OpKind::from_type_id(t)
            .ok_or_else(|| format_err(&path, rec_off, format!("unknown op type {t}")))?;
        if r.new_block >> 32 != 0 {
            return Err(format_err(
                &path,
                rec_off,
                format!("new block {} does not fit in 32 bits", r.new_block),
            ));
        }
        let mut op = Op {
            kind,
            new_block: r.new_block,
            source: r.source,
            blocks: 1,
            data_offset: 0,
            data_length: 0,
        };
        match kind {
            OpKind::Copy => check48(r.source, "COPY source block")?,
            OpKind::Zero => {}
            OpKind::Replace | OpKind::Xor => {
                check48(r.source, "source")?;
                if r.data_length == 0 {
                    return Err(format_err(
                        &path,
                        rec_off,
                        format!("{kind} op for block {} has no data", r.new_block),
                    ));
                }
                self.set_codec_from_op(r.compression, rec_off)?;
                op.data_length = u32::from(r.data_length);
                // REPLACE names its payload's absolute offset; XOR's sits at the data
                // cursor.
                op.data_offset = if kind == OpKind::Replace {
                    r.source
                } else {
                    tail.data_cursor
                };
                let end = op.data_offset + u64::from(op.data_length);
                if end > self.file_size {
                    return Err(format_err(
                        &path,
                        rec_off,
                        format!(
                            "{kind} op for block {}: payload at {}..{end} lies past the end of the file ({} bytes)",
                            r.new_block, op.data_offset, self.file_size
                        ),
                    ));
                }
                self.advance_data(tail, u64::from(r.data_length));
            }
        }
        Ok(op)
    }

    fn advance_data(&self, tail: &mut V2Tail, len: u64) {
        tail.data_cursor += len;
        if self.header.cluster_ops == 0 {
            tail.cluster_start += len;
            tail.data_cursor = tail.cluster_start;
        }
    }

    fn parse_v3(&mut self, label: Option<u64>) -> Result<()> {
        let path = self.path.clone();
        let file = self.file.try_clone().map_err(io_err(&path, "dup", 0))?;
        let mut meta = MetaReader::new(&path, &file, self.file_size);
        let h = self.header.clone();
        self.codec = Codec::from_id(h.compression_algorithm).ok_or_else(|| {
            format_err(
                &path,
                70,
                format!("unknown compression algorithm {}", h.compression_algorithm),
            )
        })?;
        let max_unit = if h.max_compression_size == 0 {
            BLOCK_SIZE as u32
        } else {
            h.max_compression_size
        };
        if !max_unit.is_power_of_two()
            || max_unit < BLOCK_SIZE as u32
            || max_unit > (BLOCK_SIZE as u32) << MAX_FACTOR_EXPONENT
        {
            return Err(format_err(
                &path,
                74,
                format!("max_compression_size {max_unit} is not 4 KiB..256 KiB and a power of two"),
            ));
        }
        let max_exp = (max_unit / BLOCK_SIZE as u32).trailing_zeros();
        let too_big = |what: &str, off: u64| {
            format_err(
                &path,
                off,
                format!("{what} does not fit in the file ({} bytes)", self.file_size),
            )
        };
        let seq_start = h.payload_start();
        let seq_bytes = h
            .sequence_data_count
            .checked_mul(4)
            .filter(|&b| b <= self.file_size)
            .ok_or_else(|| too_big("sequence_data_count", 38))?;
        let resume_start = seq_start + seq_bytes;
        if h.resume_point_max > 1024 {
            return Err(format_err(
                &path,
                50,
                format!("resume_point_max {} is implausible", h.resume_point_max),
            ));
        }
        let op_start = resume_start + RESUME_POINT_SIZE as u64 * u64::from(h.resume_point_max);
        // The op array may be sparse on disk (AOSP never writes unused
        // slots), so only the records in use must lie inside the file.
        let op_array = h
            .op_count_max
            .checked_mul(u64::from(OP_SIZE_V3))
            .ok_or_else(|| too_big("op_count_max", 62))?;
        let data_start = op_start
            .checked_add(op_array)
            .ok_or_else(|| too_big("op_count_max", 62))?;
        self.data_start = data_start;
        if h.op_count > h.op_count_max {
            return Err(format_err(
                &path,
                54,
                format!(
                    "op_count {} exceeds op_count_max {}",
                    h.op_count, h.op_count_max
                ),
            ));
        }
        // Sequence buffer.
        if seq_bytes > 0 {
            let data = meta.read(seq_start, seq_bytes as usize, "sequence buffer")?;
            let entries = sequence_from_wire(data).ok_or_else(|| {
                format_err(
                    &path,
                    seq_start,
                    format!("sequence buffer of {seq_bytes} bytes is not whole entries"),
                )
            })?;
            self.sequence = entries.collect();
        }

        // Resume points: AOSP never clamps the count, so a reader must.
        let n_points = h.resume_point_count.min(h.resume_point_max) as usize;
        let mut points = Vec::with_capacity(n_points);
        if n_points > 0 {
            let data = meta.read(resume_start, n_points * RESUME_POINT_SIZE, "resume buffer")?;
            let wire = <[WireResumePoint]>::ref_from_bytes(data).map_err(|_| {
                format_err(
                    &path,
                    resume_start,
                    format!("resume buffer of {} bytes is not whole points", data.len()),
                )
            })?;
            points.extend(wire.iter().map(ResumePoint::from));
        }
        let mut op_count = h.op_count;
        if let Some(l) = label {
            let p =
                points
                    .iter()
                    .find(|p| p.label == l)
                    .ok_or_else(|| CowError::LabelNotFound {
                        path: path.clone(),
                        label: l,
                    })?;
            if p.op_index > h.op_count_max {
                return Err(format_err(
                    &path,
                    resume_start,
                    format!(
                        "resume point {l} names op {} beyond op_count_max {}",
                        p.op_index, h.op_count_max
                    ),
                ));
            }
            self.v3_dropped_records = op_count.saturating_sub(p.op_index);
            op_count = p.op_index;
            points.retain(|q| q.label <= l);
        }
        self.labels = points
            .iter()
            .map(|p| Label {
                label: p.label,
                ops_before: p.op_index,
            })
            .collect();

        // Bounds the allocation below by the file size.
        let records_end = op_count
            .checked_mul(u64::from(OP_SIZE_V3))
            .and_then(|b| b.checked_add(op_start));
        if records_end.is_none_or(|e| e > self.file_size) {
            return Err(too_big("op_count records", 54));
        }
        self.ops.reserve_exact(op_count as usize);
        let mut cursor = data_start;
        for i in 0..op_count {
            let off = op_start + i * u64::from(OP_SIZE_V3);
            let r = RecordV3::from(&meta.read_wire::<WireOpV3>(off, "op record")?);
            let op = self.v3_op(&r, off, max_exp, &mut cursor)?;
            self.ops.push(op);
        }
        Ok(())
    }

    /// Checks one v3 op record at `off` and returns its op; REPLACE and XOR payloads
    /// follow each other from `cursor`, which it advances.
    fn v3_op(&self, r: &RecordV3, off: u64, max_exp: u32, cursor: &mut u64) -> Result<Op> {
        let path = &self.path;
        if r.reserved() != 0 {
            return Err(format_err(
                path,
                off,
                "reserved bits 48-56 of source_info are set",
            ));
        }
        let t = r.op_type();
        let kind = OpKind::from_type_id(t).ok_or_else(|| {
            format_err(
                path,
                off,
                format!("op type {t} is not valid in a v3 op record"),
            )
        })?;
        let e = r.exponent();
        if e != 0 && (kind != OpKind::Replace || e > max_exp) {
            return Err(format_err(
                path,
                off,
                format!(
                    "{kind} op has compression factor exponent {e} (max {} for REPLACE)",
                    max_exp
                ),
            ));
        }
        let mut op = Op {
            kind,
            new_block: u64::from(r.new_block),
            source: r.source(),
            blocks: 1 << e,
            data_offset: 0,
            data_length: 0,
        };
        match kind {
            OpKind::Copy | OpKind::Zero => {
                if r.data_length != 0 {
                    return Err(format_err(
                        path,
                        off,
                        format!("{kind} op carries {} data bytes", r.data_length),
                    ));
                }
            }
            OpKind::Replace | OpKind::Xor => {
                if kind == OpKind::Replace && op.source != *cursor {
                    return Err(format_err(
                        path,
                        off,
                        format!(
                            "REPLACE op for block {} says its data is at {}, but the data cursor is at {cursor}",
                            op.new_block, op.source
                        ),
                    ));
                }
                if r.data_length == 0 || r.data_length as usize > op.unit_size() {
                    return Err(format_err(
                        path,
                        off,
                        format!(
                            "{kind} op for block {} has data length {} (unit is {})",
                            op.new_block,
                            r.data_length,
                            op.unit_size()
                        ),
                    ));
                }
                op.data_offset = *cursor;
                op.data_length = r.data_length;
                *cursor += u64::from(r.data_length);
                if *cursor > self.file_size {
                    return Err(format_err(
                        path,
                        off,
                        format!(
                            "{kind} op for block {}: payload at {}..{} lies past the end of the file ({} bytes)",
                            op.new_block, op.data_offset, *cursor, self.file_size
                        ),
                    ));
                }
            }
        }
        Ok(op)
    }
}

/// An error unless `v` (the field `what` of the record at `off`) fits in 48 bits.
fn fits48(path: &Path, off: u64, v: u64, what: &str) -> Result<()> {
    if v >> 48 != 0 {
        return Err(format_err(
            path,
            off,
            format!("{what} {v:#x} does not fit in 48 bits"),
        ));
    }
    Ok(())
}

/// Read and check the header (§2.2).
pub(crate) fn read_header(file: &File, path: &Path, file_size: u64) -> Result<Header> {
    if file_size < PREFIX_SIZE as u64 {
        return Err(format_err(
            path,
            0,
            format!("truncated: {file_size} bytes is too short for a COW header"),
        ));
    }
    let mut raw = [0u8; HEADER_SIZE_V3 as usize];
    file.read_exact_at(&mut raw[..PREFIX_SIZE], 0)
        .map_err(io_err(path, "read header", 0))?;
    let prefix: &WireHeader = zerocopy::transmute_ref!(&raw);
    let (magic, header_size) = (prefix.magic.get(), prefix.header_size.get());
    if magic != COW_MAGIC {
        return Err(format_err(
            path,
            0,
            format!("bad magic {magic:#018x}: not a COW file (expected {COW_MAGIC:#018x})"),
        ));
    }
    if header_size > HEADER_SIZE_V3 || usize::from(header_size) < PREFIX_SIZE {
        return Err(format_err(
            path,
            12,
            format!("header_size {header_size} is not between 14 and 78"),
        ));
    }
    if u64::from(header_size) > file_size {
        return Err(format_err(
            path,
            0,
            format!("truncated: header needs {header_size} bytes, file is {file_size}"),
        ));
    }
    file.read_exact_at(
        &mut raw[PREFIX_SIZE..usize::from(header_size)],
        PREFIX_SIZE as u64,
    )
    .map_err(io_err(path, "read header", PREFIX_SIZE as u64))?;
    let (_, h) = Header::decode(&raw);
    let bad = |off: u64, msg: String| Err(format_err(path, off, msg));
    if !(1..=3).contains(&h.major_version) {
        return bad(8, format!("unsupported major version {}", h.major_version));
    }
    if h.minor_version != 0 {
        return bad(10, format!("unsupported minor version {}", h.minor_version));
    }
    if h.block_size as usize != BLOCK_SIZE {
        return bad(18, format!("block size {} is not 4096", h.block_size));
    }
    if h.major_version == 3 {
        if h.header_size != HEADER_SIZE_V3 {
            return bad(12, format!("v3 header_size {} is not 78", h.header_size));
        }
        if h.footer_size != 0 || h.op_size != OP_SIZE_V3 || h.cluster_ops != 0 {
            return bad(
                14,
                format!(
                    "v3 header has footer_size {}, op_size {}, cluster_ops {} (expected 0, 16, 0)",
                    h.footer_size, h.op_size, h.cluster_ops
                ),
            );
        }
    } else {
        if h.header_size != HEADER_SIZE_V1 && h.header_size != HEADER_SIZE_V2 {
            return bad(
                12,
                format!(
                    "v{} header_size {} is not 34 or 38",
                    h.major_version, h.header_size
                ),
            );
        }
        if h.footer_size != FOOTER_SIZE_V2 || h.op_size != OP_SIZE_V2 {
            return bad(
                14,
                format!(
                    "v{} header has footer_size {} and op_size {} (expected 84 and 20)",
                    h.major_version, h.footer_size, h.op_size
                ),
            );
        }
        if h.cluster_ops == 1 {
            return bad(22, "cluster_ops 1 is invalid (0 or at least 2)".to_string());
        }
    }
    if h.payload_start() > file_size {
        return bad(
            34,
            format!(
                "truncated: header + scratch area ({} bytes) is larger than the file ({file_size} bytes)",
                h.payload_start()
            ),
        );
    }
    Ok(h)
}
