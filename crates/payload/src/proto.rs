//! The payload's manifest and signatures: the messages of update_engine's
//! `update_metadata.proto` (proto2, package `chromeos_update_engine`) that a reader
//! needs, as `prost` derives. Field numbers and types follow the proto; fields this
//! crate does not use are left out (protobuf skips unknown fields), and so are the
//! deprecated major-version-1 ones.

/// A run of blocks.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Extent {
    /// First block.
    #[prost(uint64, optional, tag = "1")]
    pub start_block: Option<u64>,
    /// Blocks in the run.
    #[prost(uint64, optional, tag = "2")]
    pub num_blocks: Option<u64>,
}

impl Extent {
    /// An extent of `num_blocks` blocks from `start_block`.
    pub fn new(start_block: u64, num_blocks: u64) -> Extent {
        Extent {
            start_block: Some(start_block),
            num_blocks: Some(num_blocks),
        }
    }

    /// First block (0 when absent).
    pub fn start(&self) -> u64 {
        self.start_block.unwrap_or(0)
    }

    /// Blocks in the run (0 when absent).
    pub fn len(&self) -> u64 {
        self.num_blocks.unwrap_or(0)
    }

    /// Whether the run has no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Signatures over a hash: the metadata signature and the payload signature are each
/// one of these.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Signatures {
    /// One per signing key.
    #[prost(message, repeated, tag = "1")]
    pub signatures: Vec<Signature>,
}

/// One signature.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Signature {
    /// Deprecated by update_engine; kept for old payloads.
    #[prost(uint32, optional, tag = "1")]
    pub version: Option<u32>,
    /// The signature, padded to a fixed size when `unpadded_signature_size` is set.
    #[prost(bytes = "vec", optional, tag = "2")]
    pub data: Option<Vec<u8>>,
    /// Length of the signature inside `data` (EC signatures vary in length).
    #[prost(fixed32, optional, tag = "3")]
    pub unpadded_signature_size: Option<u32>,
}

/// A partition's size and SHA-256.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PartitionInfo {
    /// Bytes.
    #[prost(uint64, optional, tag = "1")]
    pub size: Option<u64>,
    /// SHA-256 of the first `size` bytes.
    #[prost(bytes = "vec", optional, tag = "2")]
    pub hash: Option<Vec<u8>>,
}

/// The operation types (`InstallOperation.Type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum OpType {
    /// The data, as is.
    Replace = 0,
    /// The data, bzip2-compressed.
    ReplaceBz = 1,
    /// In place, major version 1 only.
    Move = 2,
    /// In place, major version 1 only.
    Bsdiff = 3,
    /// Blocks of the old partition.
    SourceCopy = 4,
    /// A BSDIFF40 patch of the old partition's blocks.
    SourceBsdiff = 5,
    /// Zeros.
    Zero = 6,
    /// Blocks whose content does not matter (written as zeros).
    Discard = 7,
    /// The data, xz-compressed.
    ReplaceXz = 8,
    /// A puffin patch (deflate streams diffed uncompressed).
    Puffdiff = 9,
    /// A BSDF2 patch (brotli or bzip2 streams).
    BrotliBsdiff = 10,
    /// A zucchini patch (executable-aware).
    Zucchini = 11,
    /// A bsdiff patch of LZ4-compressed blocks (EROFS).
    Lz4diffBsdiff = 12,
    /// A puffdiff of LZ4-compressed blocks (EROFS).
    Lz4diffPuffdiff = 13,
    /// The data, zstd-compressed (newer than Android 14's proto).
    ReplaceZstd = 14,
}

impl OpType {
    /// The name update_engine gives the type.
    pub fn name(self) -> &'static str {
        match self {
            OpType::Replace => "REPLACE",
            OpType::ReplaceBz => "REPLACE_BZ",
            OpType::Move => "MOVE",
            OpType::Bsdiff => "BSDIFF",
            OpType::SourceCopy => "SOURCE_COPY",
            OpType::SourceBsdiff => "SOURCE_BSDIFF",
            OpType::Zero => "ZERO",
            OpType::Discard => "DISCARD",
            OpType::ReplaceXz => "REPLACE_XZ",
            OpType::Puffdiff => "PUFFDIFF",
            OpType::BrotliBsdiff => "BROTLI_BSDIFF",
            OpType::Zucchini => "ZUCCHINI",
            OpType::Lz4diffBsdiff => "LZ4DIFF_BSDIFF",
            OpType::Lz4diffPuffdiff => "LZ4DIFF_PUFFDIFF",
            OpType::ReplaceZstd => "REPLACE_ZSTD",
        }
    }

    /// Whether the operation reads the old partition.
    pub fn reads_source(self) -> bool {
        matches!(
            self,
            OpType::SourceCopy
                | OpType::SourceBsdiff
                | OpType::BrotliBsdiff
                | OpType::Puffdiff
                | OpType::Zucchini
                | OpType::Lz4diffBsdiff
                | OpType::Lz4diffPuffdiff
        )
    }
}

/// One operation: how some blocks of the new partition are made.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InstallOperation {
    /// An [`OpType`]; kept as a number so that an unknown one is reported, not lost.
    #[prost(enumeration = "OpType", required, tag = "1")]
    pub r#type: i32,
    /// Where the operation's data starts, from the first byte after the metadata
    /// signature.
    #[prost(uint64, optional, tag = "2")]
    pub data_offset: Option<u64>,
    /// Bytes of data.
    #[prost(uint64, optional, tag = "3")]
    pub data_length: Option<u64>,
    /// Blocks of the old partition read, in order.
    #[prost(message, repeated, tag = "4")]
    pub src_extents: Vec<Extent>,
    /// Bytes of the source a patch reads.
    #[prost(uint64, optional, tag = "5")]
    pub src_length: Option<u64>,
    /// Blocks of the new partition written, in order.
    #[prost(message, repeated, tag = "6")]
    pub dst_extents: Vec<Extent>,
    /// Bytes a patch makes.
    #[prost(uint64, optional, tag = "7")]
    pub dst_length: Option<u64>,
    /// SHA-256 of the data.
    #[prost(bytes = "vec", optional, tag = "8")]
    pub data_sha256_hash: Option<Vec<u8>>,
    /// SHA-256 of the source blocks read.
    #[prost(bytes = "vec", optional, tag = "9")]
    pub src_sha256_hash: Option<Vec<u8>>,
}

/// The merge operation types (`CowMergeOperation.Type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum CowMergeType {
    /// The destination is a copy of the source.
    CowCopy = 0,
    /// The destination is the source XOR data.
    CowXor = 1,
    /// Raw data.
    CowReplace = 2,
}

/// One step of the merge order that Virtual A/B Compression devices follow.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CowMergeOperation {
    /// A [`CowMergeType`].
    #[prost(enumeration = "CowMergeType", optional, tag = "1")]
    pub r#type: Option<i32>,
    /// Blocks read (one more than `dst_extent` when `src_offset` is not 0).
    #[prost(message, optional, tag = "2")]
    pub src_extent: Option<Extent>,
    /// Blocks written.
    #[prost(message, optional, tag = "3")]
    pub dst_extent: Option<Extent>,
    /// Byte offset of the source inside its first block.
    #[prost(uint32, optional, tag = "4")]
    pub src_offset: Option<u32>,
}

/// Everything about one partition's update.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PartitionUpdate {
    /// "system", "vendor", ...
    #[prost(string, required, tag = "1")]
    pub partition_name: String,
    /// Whether a postinstall step runs.
    #[prost(bool, optional, tag = "2")]
    pub run_postinstall: Option<bool>,
    /// The postinstall program.
    #[prost(string, optional, tag = "3")]
    pub postinstall_path: Option<String>,
    /// The file system the postinstall step mounts.
    #[prost(string, optional, tag = "4")]
    pub filesystem_type: Option<String>,
    /// The old partition (incremental payloads).
    #[prost(message, optional, tag = "6")]
    pub old_partition_info: Option<PartitionInfo>,
    /// The new partition.
    #[prost(message, optional, tag = "7")]
    pub new_partition_info: Option<PartitionInfo>,
    /// The operations, applied in order.
    #[prost(message, repeated, tag = "8")]
    pub operations: Vec<InstallOperation>,
    /// Whether a failing postinstall step is ignored.
    #[prost(bool, optional, tag = "9")]
    pub postinstall_optional: Option<bool>,
    /// Blocks the dm-verity hash tree covers.
    #[prost(message, optional, tag = "10")]
    pub hash_tree_data_extent: Option<Extent>,
    /// Blocks of the hash tree the device computes.
    #[prost(message, optional, tag = "11")]
    pub hash_tree_extent: Option<Extent>,
    /// The tree's hash ("sha256", ...).
    #[prost(string, optional, tag = "12")]
    pub hash_tree_algorithm: Option<String>,
    /// The tree's salt.
    #[prost(bytes = "vec", optional, tag = "13")]
    pub hash_tree_salt: Option<Vec<u8>>,
    /// Blocks the FEC data covers.
    #[prost(message, optional, tag = "14")]
    pub fec_data_extent: Option<Extent>,
    /// Blocks of FEC data the device computes.
    #[prost(message, optional, tag = "15")]
    pub fec_extent: Option<Extent>,
    /// FEC roots.
    #[prost(uint32, optional, tag = "16", default = "2")]
    pub fec_roots: Option<u32>,
    /// The partition's version (a build fingerprint or timestamp).
    #[prost(string, optional, tag = "17")]
    pub version: Option<String>,
    /// The merge order of a Virtual A/B Compression update.
    #[prost(message, repeated, tag = "18")]
    pub merge_operations: Vec<CowMergeOperation>,
    /// The COW's size, as the generator estimated it.
    #[prost(uint64, optional, tag = "19")]
    pub estimate_cow_size: Option<u64>,
    /// The COW's op count, at most (v3).
    #[prost(uint64, optional, tag = "20")]
    pub estimate_op_count_max: Option<u64>,
}

/// A group of dynamic partitions in `super`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DynamicPartitionGroup {
    /// Its name.
    #[prost(string, required, tag = "1")]
    pub name: String,
    /// Its size limit.
    #[prost(uint64, optional, tag = "2")]
    pub size: Option<u64>,
    /// Its partitions.
    #[prost(string, repeated, tag = "3")]
    pub partition_names: Vec<String>,
}

/// Features of the device's COW writer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct VabcFeatureSet {
    /// Compression on several threads.
    #[prost(bool, optional, tag = "1")]
    pub threaded: Option<bool>,
    /// Ops written in batches.
    #[prost(bool, optional, tag = "2")]
    pub batch_writes: Option<bool>,
}

/// How the device lays out its dynamic partitions and writes its COWs.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DynamicPartitionMetadata {
    /// The groups.
    #[prost(message, repeated, tag = "1")]
    pub groups: Vec<DynamicPartitionGroup>,
    /// Virtual A/B.
    #[prost(bool, optional, tag = "2")]
    pub snapshot_enabled: Option<bool>,
    /// Virtual A/B Compression.
    #[prost(bool, optional, tag = "3")]
    pub vabc_enabled: Option<bool>,
    /// The COW's compression ("lz4", "gz", "none", ...).
    #[prost(string, optional, tag = "4")]
    pub vabc_compression_param: Option<String>,
    /// The COW format version (2 or 3).
    #[prost(uint32, optional, tag = "5")]
    pub cow_version: Option<u32>,
    /// Writer features.
    #[prost(message, optional, tag = "6")]
    pub vabc_feature_set: Option<VabcFeatureSet>,
    /// Bytes compressed as one unit in the COW.
    #[prost(uint64, optional, tag = "7")]
    pub compression_factor: Option<u64>,
}

/// The manifest: the whole update's description.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaArchiveManifest {
    /// Block size of every extent.
    #[prost(uint32, optional, tag = "3", default = "4096")]
    pub block_size: Option<u32>,
    /// Where the payload signature starts, from the first data byte.
    #[prost(uint64, optional, tag = "4")]
    pub signatures_offset: Option<u64>,
    /// Bytes of the payload signature.
    #[prost(uint64, optional, tag = "5")]
    pub signatures_size: Option<u64>,
    /// 0 for a full payload, the delta format's version otherwise.
    #[prost(uint32, optional, tag = "12", default = "0")]
    pub minor_version: Option<u32>,
    /// The partitions.
    #[prost(message, repeated, tag = "13")]
    pub partitions: Vec<PartitionUpdate>,
    /// The newest build timestamp in the update (downgrade protection).
    #[prost(int64, optional, tag = "14")]
    pub max_timestamp: Option<i64>,
    /// Dynamic partitions and the COW's parameters.
    #[prost(message, optional, tag = "15")]
    pub dynamic_partition_metadata: Option<DynamicPartitionMetadata>,
    /// Whether the payload updates only some partitions.
    #[prost(bool, optional, tag = "16")]
    pub partial_update: Option<bool>,
    /// The security patch level ("2024-05-01").
    #[prost(string, optional, tag = "18")]
    pub security_patch_level: Option<String>,
}

/// The messages of a manifest, by what they decode to.
#[derive(Clone, Copy)]
enum Kind {
    Manifest,
    Partition,
    Operation,
    Merge,
    Extent,
    Info,
    Signature,
    Dynamic,
    Group,
    Features,
}

impl Kind {
    fn size(self) -> u64 {
        use std::mem::size_of;
        (match self {
            Kind::Manifest => size_of::<DeltaArchiveManifest>(),
            Kind::Partition => size_of::<PartitionUpdate>(),
            Kind::Operation => size_of::<InstallOperation>(),
            Kind::Merge => size_of::<CowMergeOperation>(),
            Kind::Extent => size_of::<Extent>(),
            Kind::Info => size_of::<PartitionInfo>(),
            Kind::Signature => size_of::<Signature>(),
            Kind::Dynamic => size_of::<DynamicPartitionMetadata>(),
            Kind::Group => size_of::<DynamicPartitionGroup>(),
            Kind::Features => size_of::<VabcFeatureSet>(),
        }) as u64
    }

    /// The message kind of field `tag`, when it is a message this crate decodes.
    fn child(self, tag: u32) -> Option<Kind> {
        Some(match (self, tag) {
            (Kind::Manifest, 13) => Kind::Partition,
            (Kind::Manifest, 15) => Kind::Dynamic,
            (Kind::Partition, 5) => Kind::Signature,
            (Kind::Partition, 6 | 7) => Kind::Info,
            (Kind::Partition, 8) => Kind::Operation,
            (Kind::Partition, 10 | 11 | 14 | 15) => Kind::Extent,
            (Kind::Partition, 18) => Kind::Merge,
            (Kind::Operation, 4 | 6) => Kind::Extent,
            (Kind::Merge, 2 | 3) => Kind::Extent,
            (Kind::Dynamic, 1) => Kind::Group,
            (Kind::Dynamic, 6) => Kind::Features,
            _ => return None,
        })
    }
}

/// The memory a manifest takes once decoded, estimated from its wire form without
/// decoding it: every message counted at its decoded size (twice, for the growth of
/// the vectors holding it), every string and byte field at its length. A message of
/// two bytes on the wire decodes to hundreds, so a manifest's length alone does not
/// bound its decoded size.
pub fn decoded_size(manifest: &[u8]) -> Result<u64, String> {
    walk(manifest, Kind::Manifest, 0)
}

fn walk(mut buf: &[u8], kind: Kind, depth: u32) -> Result<u64, String> {
    use prost::encoding::{WireType, decode_key, decode_varint};
    if depth > 4 {
        return Err("messages nested deeper than the manifest's".into());
    }
    let mut total = 2 * kind.size();
    while !buf.is_empty() {
        let (tag, wire) = decode_key(&mut buf).map_err(|e| e.to_string())?;
        match wire {
            WireType::Varint => {
                decode_varint(&mut buf).map_err(|e| e.to_string())?;
            }
            WireType::SixtyFourBit | WireType::ThirtyTwoBit => {
                let n = if wire == WireType::SixtyFourBit { 8 } else { 4 };
                buf = buf.get(n..).ok_or("a fixed-size field runs past the end")?;
            }
            WireType::LengthDelimited => {
                let len = decode_varint(&mut buf).map_err(|e| e.to_string())?;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&l| l <= buf.len())
                    .ok_or("a field runs past the end")?;
                let (field, rest) = buf.split_at(len);
                buf = rest;
                total = total.saturating_add(match kind.child(tag) {
                    Some(child) => walk(field, child, depth + 1)?,
                    // A string or bytes field: its bytes and its container.
                    None => len as u64 + 24,
                });
            }
            WireType::StartGroup | WireType::EndGroup => {
                return Err("a group field, which no payload manifest has".into());
            }
        }
    }
    Ok(total)
}
