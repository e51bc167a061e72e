//! On-disk structures of the AOSP COW format, versions 1 to 3.
//!
//! Everything is little-endian and packed. The layouts follow `cow_format.h` in
//! AOSP's libsnapshot; docs/02-cow-format.md says where AOSP defines each field and
//! what the code's "spec §N" comments refer to. Each fixed layout is a `Wire*`
//! struct whose zerocopy derives prove that every byte pattern is a value and that
//! it has alignment 1 and no padding, so decoding is a copy that cannot fail or
//! read out of place; the version-independent types ([`Header`], [`RecordV2`], ...)
//! are what the rest of the crate checks and uses.

use serde::Serialize;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Block size of every COW this crate reads or writes (snapuserd refuses others).
pub const BLOCK_SIZE: usize = 4096;
/// `BLOCK_SIZE` as a `u64`, for offset arithmetic.
pub const BLOCK_SIZE_U64: u64 = BLOCK_SIZE as u64;

/// `!!WOcwoC` read as a little-endian u64.
pub const COW_MAGIC: u64 = 0x436f_7763_4f57_2121;

/// Bytes every header starts with: magic, major, minor, header_size.
pub const PREFIX_SIZE: usize = 14;
pub const HEADER_SIZE_V1: u16 = 34;
pub const HEADER_SIZE_V2: u16 = 38;
pub const HEADER_SIZE_V3: u16 = 78;
pub const OP_SIZE_V2: u16 = 20;
pub const OP_SIZE_V3: u16 = 16;
pub const FOOTER_SIZE_V2: u16 = 84;
/// Bytes after the footer op record (the former checksum slots, always zero).
pub const FOOTER_TRAILER: usize = 64;
pub const RESUME_POINT_SIZE: usize = 16;
/// The v3 writer keeps at most this many resume points (`kNumResumePoints`).
pub const RESUME_POINT_MAX: u32 = 4;
/// The scratch (read-ahead) area reserved after the header (`BUFFER_REGION_DEFAULT_SIZE`).
pub const SCRATCH_SIZE: u32 = 2 * 1024 * 1024;
/// Entries per v2 SEQUENCE op: `block_size * 2 / sizeof(u32)`.
pub const SEQUENCE_ENTRIES_PER_OP: usize = BLOCK_SIZE * 2 / 4;
/// Largest v3 compression factor exponent: 4096 << 6 = 256 KiB.
pub const MAX_FACTOR_EXPONENT: u32 = 6;

/// v3 `source_info` bit fields (the masks in `cow_format.h` are authoritative).
pub const V3_SOURCE_MASK: u64 = (1 << 48) - 1;
pub const V3_RESERVED_MASK: u64 = ((1 << 9) - 1) << 48;
pub const V3_FACTOR_SHIFT: u32 = 57;
pub const V3_FACTOR_MASK: u64 = 0b111;
pub const V3_TYPE_SHIFT: u32 = 60;

/// Op type ids (§2.5).
pub mod op_type {
    pub const COPY: u8 = 1;
    pub const REPLACE: u8 = 2;
    pub const ZERO: u8 = 3;
    pub const LABEL: u8 = 4;
    pub const CLUSTER: u8 = 5;
    pub const XOR: u8 = 6;
    pub const SEQUENCE: u8 = 7;
    pub const FOOTER: u8 = 0xff;
}

/// The kind of a data-bearing (non-metadata) op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum OpKind {
    Copy,
    Replace,
    Zero,
    Xor,
}

impl OpKind {
    pub fn type_id(self) -> u8 {
        match self {
            OpKind::Copy => op_type::COPY,
            OpKind::Replace => op_type::REPLACE,
            OpKind::Zero => op_type::ZERO,
            OpKind::Xor => op_type::XOR,
        }
    }

    pub fn from_type_id(id: u8) -> Option<OpKind> {
        match id {
            op_type::COPY => Some(OpKind::Copy),
            op_type::REPLACE => Some(OpKind::Replace),
            op_type::ZERO => Some(OpKind::Zero),
            op_type::XOR => Some(OpKind::Xor),
            _ => None,
        }
    }

    /// COPY and XOR read a source that other merges may overwrite, so their
    /// order matters (AOSP's `IsOrderedOp`).
    pub fn is_ordered(self) -> bool {
        matches!(self, OpKind::Copy | OpKind::Xor)
    }

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Copy => "COPY",
            OpKind::Replace => "REPLACE",
            OpKind::Zero => "ZERO",
            OpKind::Xor => "XOR",
        }
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One data op of a parsed COW, in a version-independent form (AOSP likewise
/// translates v2 records into v3 ones in memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub kind: OpKind,
    /// First destination block in the new image.
    pub new_block: u64,
    /// COPY: source block. XOR: source *byte* offset. REPLACE: absolute file
    /// offset of the payload (as stored on disk). ZERO: 0.
    pub source: u64,
    /// Blocks covered: `1 << e` for a v3 multi-block REPLACE, otherwise 1.
    pub blocks: u32,
    /// Absolute file offset of the stored payload (REPLACE and XOR), else 0.
    pub data_offset: u64,
    /// Stored payload bytes (REPLACE and XOR), else 0.
    pub data_length: u32,
}

impl Op {
    /// Bytes the payload decodes to.
    pub fn unit_size(&self) -> usize {
        self.blocks as usize * BLOCK_SIZE
    }

    /// One past the last destination block.
    pub fn end_block(&self) -> u64 {
        self.new_block + u64::from(self.blocks)
    }

    /// Source blocks the op reads from the base image: none, one, or two for
    /// an XOR whose byte offset is not block-aligned.
    pub fn source_blocks(&self) -> impl Iterator<Item = u64> + use<> {
        let (first, count) = match self.kind {
            OpKind::Copy => (self.source, 1),
            OpKind::Xor => (
                self.source / BLOCK_SIZE_U64,
                if self.source.is_multiple_of(BLOCK_SIZE_U64) {
                    1
                } else {
                    2
                },
            ),
            OpKind::Replace | OpKind::Zero => (0, 0),
        };
        first..first + count
    }
}

/// A v3 resume point: label value and the op count when it was added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct ResumePoint {
    pub label: u64,
    pub op_index: u64,
}

/// The COW header, with the v3-only fields zero for older versions (AOSP reads
/// any header into a zero-filled v3-sized struct).
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, schemars::JsonSchema)]
pub struct Header {
    pub major_version: u16,
    pub minor_version: u16,
    pub header_size: u16,
    pub footer_size: u16,
    pub op_size: u16,
    pub block_size: u32,
    pub cluster_ops: u32,
    pub num_merge_ops: u64,
    pub buffer_size: u32,
    pub sequence_data_count: u64,
    pub resume_point_count: u32,
    pub resume_point_max: u32,
    pub op_count: u64,
    pub op_count_max: u64,
    pub compression_algorithm: u32,
    pub max_compression_size: u32,
}

/// The header as it lies on disk: the v3 layout, of which v1 and v2 headers
/// are a prefix (`header_size` says how much of it a file holds).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(crate) struct WireHeader {
    pub magic: U64,
    pub major_version: U16,
    pub minor_version: U16,
    pub header_size: U16,
    pub footer_size: U16,
    pub op_size: U16,
    pub block_size: U32,
    pub cluster_ops: U32,
    pub num_merge_ops: U64,
    pub buffer_size: U32,
    pub sequence_data_count: U64,
    pub resume_point_count: U32,
    pub resume_point_max: U32,
    pub op_count: U64,
    pub op_count_max: U64,
    pub compression_algorithm: U32,
    pub max_compression_size: U32,
}

/// A v1/v2 op record as it lies on disk.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(crate) struct WireOpV2 {
    pub op_type: u8,
    pub compression: u8,
    pub data_length: U16,
    pub new_block: U64,
    pub source: U64,
}

/// The v2 footer: a FOOTER op record (ops_size in `new_block`, num_ops in
/// `source`) and the former checksum slots, written as zeros.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(crate) struct WireFooterV2 {
    pub op: WireOpV2,
    pub unused: [u8; FOOTER_TRAILER],
}

/// A v3 op record as it lies on disk.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(crate) struct WireOpV3 {
    pub data_length: U32,
    pub new_block: U32,
    pub source_info: U64,
}

/// A v3 resume point as it lies in the resume buffer.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(crate) struct WireResumePoint {
    pub label: U64,
    pub op_index: U64,
}

/// One entry of the scratch area's metadata (AOSP's `ScratchMetadata`), at
/// `header_size + 1`, packed: the block a saved copy is for, and the copy's absolute
/// offset in the COW file. The list ends with an all-zero entry.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    FromBytes,
    IntoBytes,
    KnownLayout,
    Immutable,
    Unaligned,
)]
#[repr(C)]
pub struct ScratchEntry {
    /// The new image's block the copy is for.
    pub new_block: U64,
    /// Absolute offset of the 4 KiB copy in the COW file.
    pub file_offset: U64,
}

/// Where the header keeps `num_merge_ops`, the merge's durable progress (the merge
/// rewrites it, and only it, in the header).
pub const NUM_MERGE_OPS_OFFSET: usize = std::mem::offset_of!(WireHeader, num_merge_ops);

/// `num_merge_ops` of a header's bytes (`head` holds at least the v1 header).
pub fn num_merge_ops(head: &[u8]) -> Option<u64> {
    let at = head.get(NUM_MERGE_OPS_OFFSET..NUM_MERGE_OPS_OFFSET + size_of::<U64>())?;
    U64::read_from_bytes(at).ok().map(U64::get)
}

/// Sets `num_merge_ops` in a header's bytes; `false` when `head` is too short.
pub fn set_num_merge_ops(head: &mut [u8], n: u64) -> bool {
    match head.get_mut(NUM_MERGE_OPS_OFFSET..NUM_MERGE_OPS_OFFSET + size_of::<U64>()) {
        Some(at) => {
            at.copy_from_slice(U64::new(n).as_bytes());
            true
        }
        None => false,
    }
}

// The sizes §2 fixes: a struct that drifts from them does not build.
const _: () = {
    assert!(size_of::<WireHeader>() == HEADER_SIZE_V3 as usize);
    assert!(std::mem::offset_of!(WireHeader, footer_size) == PREFIX_SIZE);
    assert!(size_of::<WireOpV2>() == OP_SIZE_V2 as usize);
    assert!(size_of::<WireFooterV2>() == FOOTER_SIZE_V2 as usize);
    assert!(size_of::<WireOpV3>() == OP_SIZE_V3 as usize);
    assert!(size_of::<WireResumePoint>() == RESUME_POINT_SIZE);
    assert!(size_of::<ScratchEntry>() == 16);
};

/// Sequence data (a v2 SEQUENCE op's payload, the v3 sequence buffer) as it
/// lies on disk: little-endian u32 block numbers.
pub(crate) fn sequence_to_wire(blocks: &[u32]) -> Vec<u8> {
    let wire: Vec<U32> = blocks.iter().map(|&b| U32::new(b)).collect();
    wire.as_bytes().to_vec()
}

/// The block numbers of sequence data; `None` when `b` is not a whole number
/// of entries.
pub(crate) fn sequence_from_wire(b: &[u8]) -> Option<impl Iterator<Item = u32> + '_> {
    let wire = <[U32]>::ref_from_bytes(b).ok()?;
    Some(wire.iter().map(|v| v.get()))
}

impl From<&WireHeader> for Header {
    fn from(w: &WireHeader) -> Header {
        Header {
            major_version: w.major_version.get(),
            minor_version: w.minor_version.get(),
            header_size: w.header_size.get(),
            footer_size: w.footer_size.get(),
            op_size: w.op_size.get(),
            block_size: w.block_size.get(),
            cluster_ops: w.cluster_ops.get(),
            num_merge_ops: w.num_merge_ops.get(),
            buffer_size: w.buffer_size.get(),
            sequence_data_count: w.sequence_data_count.get(),
            resume_point_count: w.resume_point_count.get(),
            resume_point_max: w.resume_point_max.get(),
            op_count: w.op_count.get(),
            op_count_max: w.op_count_max.get(),
            compression_algorithm: w.compression_algorithm.get(),
            max_compression_size: w.max_compression_size.get(),
        }
    }
}

impl From<&Header> for WireHeader {
    fn from(h: &Header) -> WireHeader {
        WireHeader {
            magic: U64::new(COW_MAGIC),
            major_version: U16::new(h.major_version),
            minor_version: U16::new(h.minor_version),
            header_size: U16::new(h.header_size),
            footer_size: U16::new(h.footer_size),
            op_size: U16::new(h.op_size),
            block_size: U32::new(h.block_size),
            cluster_ops: U32::new(h.cluster_ops),
            num_merge_ops: U64::new(h.num_merge_ops),
            buffer_size: U32::new(h.buffer_size),
            sequence_data_count: U64::new(h.sequence_data_count),
            resume_point_count: U32::new(h.resume_point_count),
            resume_point_max: U32::new(h.resume_point_max),
            op_count: U64::new(h.op_count),
            op_count_max: U64::new(h.op_count_max),
            compression_algorithm: U32::new(h.compression_algorithm),
            max_compression_size: U32::new(h.max_compression_size),
        }
    }
}

impl Header {
    /// Decode from the first `header_size` bytes (zero-extended to 78).
    pub fn decode(raw: &[u8; HEADER_SIZE_V3 as usize]) -> (u64, Header) {
        let w: &WireHeader = zerocopy::transmute_ref!(raw);
        (w.magic.get(), Header::from(w))
    }

    /// Encode `header_size` bytes.
    pub fn encode(&self) -> Vec<u8> {
        let w = WireHeader::from(self);
        let b = w.as_bytes();
        b[..usize::from(self.header_size).min(b.len())].to_vec()
    }

    /// The bytes of a COW file a merge rewrites: the header's merge counter
    /// (`num_merge_ops`) and the scratch area. Everything else stays as the
    /// writer left it (a writer leaves both zero), so a hash of the file with
    /// these ranges taken as zeros identifies a COW through its merge.
    pub fn merge_written_ranges(&self) -> [std::ops::Range<u64>; 2] {
        let merge_ops = NUM_MERGE_OPS_OFFSET as u64;
        [
            merge_ops..merge_ops + size_of::<U64>() as u64,
            u64::from(self.header_size)..self.payload_start(),
        ]
    }

    /// Offset of the first byte after header + scratch area: where v2 op
    /// records or the v3 sequence buffer begin.
    pub fn payload_start(&self) -> u64 {
        u64::from(self.header_size) + u64::from(self.buffer_size)
    }
}

/// A raw v1/v2 op record (20 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RecordV2 {
    pub op_type: u8,
    pub compression: u8,
    pub data_length: u16,
    pub new_block: u64,
    pub source: u64,
}

impl RecordV2 {
    /// Decodes the record at the start of `b`; bytes missing past its end are
    /// taken as zeros (the reader reads records whole, through `WireOpV2`).
    pub fn decode(b: &[u8]) -> RecordV2 {
        let mut w = WireOpV2::new_zeroed();
        let n = b.len().min(size_of::<WireOpV2>());
        w.as_mut_bytes()[..n].copy_from_slice(&b[..n]);
        RecordV2::from(&w)
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(WireOpV2::from(self).as_bytes());
    }
}

impl From<&WireOpV2> for RecordV2 {
    fn from(w: &WireOpV2) -> RecordV2 {
        RecordV2 {
            op_type: w.op_type,
            compression: w.compression,
            data_length: w.data_length.get(),
            new_block: w.new_block.get(),
            source: w.source.get(),
        }
    }
}

impl From<&RecordV2> for WireOpV2 {
    fn from(r: &RecordV2) -> WireOpV2 {
        WireOpV2 {
            op_type: r.op_type,
            compression: r.compression,
            data_length: U16::new(r.data_length),
            new_block: U64::new(r.new_block),
            source: U64::new(r.source),
        }
    }
}

/// A raw v3 op record (16 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RecordV3 {
    pub data_length: u32,
    pub new_block: u32,
    pub source_info: u64,
}

impl RecordV3 {
    /// Decodes the record at the start of `b`; bytes missing past its end are
    /// taken as zeros (the reader reads records whole, through `WireOpV3`).
    pub fn decode(b: &[u8]) -> RecordV3 {
        let mut w = WireOpV3::new_zeroed();
        let n = b.len().min(size_of::<WireOpV3>());
        w.as_mut_bytes()[..n].copy_from_slice(&b[..n]);
        RecordV3::from(&w)
    }

    pub fn new(kind: OpKind, new_block: u32, source: u64, exponent: u32, data_length: u32) -> Self {
        RecordV3 {
            data_length,
            new_block,
            source_info: (u64::from(kind.type_id()) << V3_TYPE_SHIFT)
                | ((u64::from(exponent) & V3_FACTOR_MASK) << V3_FACTOR_SHIFT)
                | (source & V3_SOURCE_MASK),
        }
    }

    pub fn op_type(&self) -> u8 {
        (self.source_info >> V3_TYPE_SHIFT) as u8
    }
    pub fn exponent(&self) -> u32 {
        ((self.source_info >> V3_FACTOR_SHIFT) & V3_FACTOR_MASK) as u32
    }
    pub fn source(&self) -> u64 {
        self.source_info & V3_SOURCE_MASK
    }
    pub fn reserved(&self) -> u64 {
        self.source_info & V3_RESERVED_MASK
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(WireOpV3::from(self).as_bytes());
    }
}

impl From<&WireOpV3> for RecordV3 {
    fn from(w: &WireOpV3) -> RecordV3 {
        RecordV3 {
            data_length: w.data_length.get(),
            new_block: w.new_block.get(),
            source_info: w.source_info.get(),
        }
    }
}

impl From<&RecordV3> for WireOpV3 {
    fn from(r: &RecordV3) -> WireOpV3 {
        WireOpV3 {
            data_length: U32::new(r.data_length),
            new_block: U32::new(r.new_block),
            source_info: U64::new(r.source_info),
        }
    }
}

impl From<&WireResumePoint> for ResumePoint {
    fn from(w: &WireResumePoint) -> ResumePoint {
        ResumePoint {
            label: w.label.get(),
            op_index: w.op_index.get(),
        }
    }
}

impl From<&ResumePoint> for WireResumePoint {
    fn from(p: &ResumePoint) -> WireResumePoint {
        WireResumePoint {
            label: U64::new(p.label),
            op_index: U64::new(p.op_index),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_v3() {
        let h = Header {
            major_version: 3,
            header_size: HEADER_SIZE_V3,
            op_size: OP_SIZE_V3,
            block_size: 4096,
            buffer_size: SCRATCH_SIZE,
            sequence_data_count: 8,
            resume_point_count: 4,
            resume_point_max: 4,
            op_count: 29,
            op_count_max: 256,
            compression_algorithm: 3,
            max_compression_size: 65536,
            ..Default::default()
        };
        let enc = h.encode();
        assert_eq!(enc.len(), 78);
        let mut raw = [0u8; 78];
        raw.copy_from_slice(&enc);
        let (magic, back) = Header::decode(&raw);
        assert_eq!(magic, COW_MAGIC);
        assert_eq!(back, h);
    }

    #[test]
    fn magic_bytes() {
        assert_eq!(U64::new(COW_MAGIC).as_bytes(), b"!!WOcwoC");
    }

    /// A file of the AOSP interop vectors (shared/aosp-cow-vectors, read in place).
    fn vector(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/aosp-cow-vectors")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn wire_structs_have_the_format_sizes() {
        assert_eq!(size_of::<WireHeader>(), 78);
        assert_eq!(size_of::<WireOpV2>(), 20);
        assert_eq!(size_of::<WireFooterV2>(), 84);
        assert_eq!(size_of::<WireOpV3>(), 16);
        assert_eq!(size_of::<WireResumePoint>(), 16);
        assert_eq!(size_of::<U32>(), 4);
        // Fields at the offsets of the spec's tables (§2.2): error messages name them.
        assert_eq!(std::mem::offset_of!(WireHeader, num_merge_ops), 26);
        assert_eq!(std::mem::offset_of!(WireHeader, buffer_size), 34);
        assert_eq!(std::mem::offset_of!(WireHeader, op_count), 54);
        assert_eq!(std::mem::offset_of!(WireHeader, max_compression_size), 74);
    }

    /// AOSP's own v2 fixture: header, the first cluster's records and the
    /// footer decode to what its MANIFEST says and encode back to the same bytes.
    #[test]
    fn aosp_v2_fixture_round_trips() {
        let file = vector("aosp-testdata/cow_v2");
        let mut raw = [0u8; HEADER_SIZE_V3 as usize];
        raw[..usize::from(HEADER_SIZE_V2)].copy_from_slice(&file[..usize::from(HEADER_SIZE_V2)]);
        let (magic, h) = Header::decode(&raw);
        assert_eq!(magic, COW_MAGIC);
        assert_eq!(
            (h.major_version, h.header_size, h.footer_size, h.op_size),
            (2, 38, 84, 20)
        );
        assert_eq!((h.cluster_ops, h.num_merge_ops), (5, 1));
        assert_eq!(h.encode(), &file[..38]);

        let start = h.payload_start() as usize;
        let cluster = &file[start..start + 5 * usize::from(OP_SIZE_V2)];
        let records: Vec<RecordV2> = <[WireOpV2]>::ref_from_bytes(cluster)
            .unwrap()
            .iter()
            .map(RecordV2::from)
            .collect();
        let kinds: Vec<u8> = records.iter().map(|r| r.op_type).collect();
        assert_eq!(
            kinds,
            [
                op_type::COPY,
                op_type::REPLACE,
                op_type::LABEL,
                op_type::XOR,
                op_type::CLUSTER
            ]
        );
        assert_eq!((records[0].new_block, records[0].source), (0, 5));
        assert_eq!((records[3].new_block, records[3].source), (50, 98314));
        let mut again = Vec::new();
        for r in &records {
            r.encode_into(&mut again);
        }
        assert_eq!(again, cluster);
        assert_eq!(RecordV2::decode(&cluster[20..40]), records[1]);

        let at = 0x20_218e;
        let bytes = &file[at..at + usize::from(FOOTER_SIZE_V2)];
        let footer = WireFooterV2::read_from_bytes(bytes).unwrap();
        let op = RecordV2::from(&footer.op);
        assert_eq!(
            (op.op_type, op.data_length, op.new_block, op.source),
            (op_type::FOOTER, 64, 360, 18)
        );
        let again = WireFooterV2 {
            op: WireOpV2::from(&op),
            unused: [0; FOOTER_TRAILER],
        };
        assert_eq!(again.as_bytes(), bytes);
    }

    /// A v3 file written by AOSP: header, sequence buffer, resume buffer and op
    /// array decode to the writer calls of its MANIFEST and encode back.
    #[test]
    fn aosp_v3_vector_round_trips() {
        let file = vector("v3_none_4096.cow");
        let raw: &[u8; HEADER_SIZE_V3 as usize] = file[..78].try_into().unwrap();
        let (magic, h) = Header::decode(raw);
        assert_eq!(magic, COW_MAGIC);
        assert_eq!((h.major_version, h.header_size, h.op_size), (3, 78, 16));
        assert_eq!(
            (h.sequence_data_count, h.op_count, h.op_count_max),
            (8, 29, 256)
        );
        assert_eq!((h.resume_point_count, h.resume_point_max), (6, 4));
        assert_eq!(h.encode(), &file[..78]);

        let seq_start = h.payload_start() as usize;
        let seq = &file[seq_start..seq_start + 4 * h.sequence_data_count as usize];
        let blocks: Vec<u32> = sequence_from_wire(seq).unwrap().collect();
        assert_eq!(blocks, [10, 11, 12, 20, 200, 201, 202, 203]);
        assert_eq!(sequence_to_wire(&blocks), seq);
        assert!(sequence_from_wire(&seq[..5]).is_none());

        let resume_start = seq.len() + seq_start;
        let resume = &file[resume_start..resume_start + 4 * RESUME_POINT_SIZE];
        let points: Vec<ResumePoint> = <[WireResumePoint]>::ref_from_bytes(resume)
            .unwrap()
            .iter()
            .map(ResumePoint::from)
            .collect();
        let labels: Vec<u64> = points.iter().map(|p| p.label).collect();
        assert_eq!(labels, [3, 4, 5, 6]);
        let wire: Vec<WireResumePoint> = points.iter().map(WireResumePoint::from).collect();
        assert_eq!(wire.as_bytes(), resume);

        let op_start = resume_start + 4 * RESUME_POINT_SIZE;
        let ops = &file[op_start..op_start + 29 * usize::from(OP_SIZE_V3)];
        let records: Vec<RecordV3> = <[WireOpV3]>::ref_from_bytes(ops)
            .unwrap()
            .iter()
            .map(RecordV3::from)
            .collect();
        assert_eq!(
            (
                records[0].op_type(),
                records[0].new_block,
                records[0].source()
            ),
            (op_type::COPY, 10, 11)
        );
        let mut again = Vec::new();
        for r in &records {
            r.encode_into(&mut again);
        }
        assert_eq!(again, ops);
        assert_eq!(RecordV3::decode(&ops[16..32]), records[1]);
    }

    /// Input shorter than a record decodes as if zero-extended, never panics.
    #[test]
    fn short_records_decode_zero_extended() {
        let r = RecordV2::decode(&[op_type::COPY, 0, 0, 0, 7]);
        assert_eq!((r.op_type, r.new_block, r.source), (op_type::COPY, 7, 0));
        assert_eq!(RecordV3::decode(&[]), RecordV3::default());
    }

    #[test]
    fn v3_record_bits() {
        let r = RecordV3::new(OpKind::Replace, 100, 0x2000_4000, 4, 1234);
        assert_eq!(r.op_type(), op_type::REPLACE);
        assert_eq!(r.exponent(), 4);
        assert_eq!(r.source(), 0x2000_4000);
        assert_eq!(r.reserved(), 0);
        let mut v = Vec::new();
        r.encode_into(&mut v);
        assert_eq!(RecordV3::decode(&v), r);
    }

    #[test]
    fn xor_source_blocks() {
        let op = Op {
            kind: OpKind::Xor,
            new_block: 1,
            source: 40 * 4096 + 100,
            blocks: 1,
            data_offset: 0,
            data_length: 0,
        };
        assert_eq!(op.source_blocks().collect::<Vec<_>>(), vec![40, 41]);
        let aligned = Op {
            source: 40 * 4096,
            ..op
        };
        assert_eq!(aligned.source_blocks().collect::<Vec<_>>(), vec![40]);
    }
}
