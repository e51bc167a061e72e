//! On-disk structures of the AOSP COW format, versions 1 to 3.
//!
//! Everything is little-endian and packed. The layouts follow `cow_format.h`
//! in AOSP's libsnapshot; see `shared/spec/aosp-cow.md` §2 for the field-by-field
//! description. Structures are encoded and decoded by hand (no `repr(packed)`
//! transmutes) so that a corrupt file can never produce an unaligned or
//! out-of-range value without going through a check.

use serde::Serialize;

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

/// Little-endian field access over a byte slice whose length was checked by
/// the caller.
pub(crate) fn le_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
pub(crate) fn le_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
pub(crate) fn le_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

impl Header {
    /// Decode from the first `header_size` bytes (zero-extended to 78).
    pub fn decode(raw: &[u8; HEADER_SIZE_V3 as usize]) -> (u64, Header) {
        let magic = le_u64(raw, 0);
        let h = Header {
            major_version: le_u16(raw, 8),
            minor_version: le_u16(raw, 10),
            header_size: le_u16(raw, 12),
            footer_size: le_u16(raw, 14),
            op_size: le_u16(raw, 16),
            block_size: le_u32(raw, 18),
            cluster_ops: le_u32(raw, 22),
            num_merge_ops: le_u64(raw, 26),
            buffer_size: le_u32(raw, 34),
            sequence_data_count: le_u64(raw, 38),
            resume_point_count: le_u32(raw, 46),
            resume_point_max: le_u32(raw, 50),
            op_count: le_u64(raw, 54),
            op_count_max: le_u64(raw, 62),
            compression_algorithm: le_u32(raw, 70),
            max_compression_size: le_u32(raw, 74),
        };
        (magic, h)
    }

    /// Encode `header_size` bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_SIZE_V3 as usize);
        b.extend_from_slice(&COW_MAGIC.to_le_bytes());
        b.extend_from_slice(&self.major_version.to_le_bytes());
        b.extend_from_slice(&self.minor_version.to_le_bytes());
        b.extend_from_slice(&self.header_size.to_le_bytes());
        b.extend_from_slice(&self.footer_size.to_le_bytes());
        b.extend_from_slice(&self.op_size.to_le_bytes());
        b.extend_from_slice(&self.block_size.to_le_bytes());
        b.extend_from_slice(&self.cluster_ops.to_le_bytes());
        b.extend_from_slice(&self.num_merge_ops.to_le_bytes());
        b.extend_from_slice(&self.buffer_size.to_le_bytes());
        b.extend_from_slice(&self.sequence_data_count.to_le_bytes());
        b.extend_from_slice(&self.resume_point_count.to_le_bytes());
        b.extend_from_slice(&self.resume_point_max.to_le_bytes());
        b.extend_from_slice(&self.op_count.to_le_bytes());
        b.extend_from_slice(&self.op_count_max.to_le_bytes());
        b.extend_from_slice(&self.compression_algorithm.to_le_bytes());
        b.extend_from_slice(&self.max_compression_size.to_le_bytes());
        b.truncate(usize::from(self.header_size));
        b
    }

    /// The bytes of a COW file a merge rewrites: the header's merge counter
    /// (`num_merge_ops`) and the scratch area. Everything else stays as the
    /// writer left it (a writer leaves both zero), so a hash of the file with
    /// these ranges taken as zeros identifies a COW through its merge.
    pub fn merge_written_ranges(&self) -> [std::ops::Range<u64>; 2] {
        [26..34, u64::from(self.header_size)..self.payload_start()]
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
    pub fn decode(b: &[u8]) -> RecordV2 {
        RecordV2 {
            op_type: b[0],
            compression: b[1],
            data_length: le_u16(b, 2),
            new_block: le_u64(b, 4),
            source: le_u64(b, 12),
        }
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.push(self.op_type);
        out.push(self.compression);
        out.extend_from_slice(&self.data_length.to_le_bytes());
        out.extend_from_slice(&self.new_block.to_le_bytes());
        out.extend_from_slice(&self.source.to_le_bytes());
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
    pub fn decode(b: &[u8]) -> RecordV3 {
        RecordV3 {
            data_length: le_u32(b, 0),
            new_block: le_u32(b, 4),
            source_info: le_u64(b, 8),
        }
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
        out.extend_from_slice(&self.data_length.to_le_bytes());
        out.extend_from_slice(&self.new_block.to_le_bytes());
        out.extend_from_slice(&self.source_info.to_le_bytes());
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
        assert_eq!(&COW_MAGIC.to_le_bytes(), b"!!WOcwoC");
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
