//! What a payload holds, as `vabc payload info` prints it (text or JSON).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::format::{Payload, op_name};
use crate::proto::{CowMergeType, PartitionInfo};

/// The whole payload.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Info {
    /// The payload file, zip entry or URL.
    pub source: String,
    /// Bytes of payload.
    pub payload_bytes: u64,
    /// Major version (2).
    pub major_version: u64,
    /// Minor version: 0 for a full payload.
    pub minor_version: u32,
    /// "full" or "incremental".
    pub kind: &'static str,
    /// Block size of every extent.
    pub block_size: u32,
    /// Bytes of manifest.
    pub manifest_bytes: u64,
    /// Bytes of metadata signature (0: unsigned).
    pub metadata_signature_bytes: u32,
    /// Where the data starts.
    pub data_offset: u64,
    /// Offset and length of the payload signature, when there is one.
    pub payload_signature: Option<[u64; 2]>,
    /// The newest build timestamp in the update (seconds since 1970).
    pub max_timestamp: Option<i64>,
    /// The security patch level.
    pub security_patch_level: Option<String>,
    /// Whether only some partitions are updated.
    pub partial_update: bool,
    /// Dynamic partitions and the Virtual A/B Compression parameters.
    pub dynamic_partitions: Option<Dynamic>,
    /// The partitions, in manifest order.
    pub partitions: Vec<Partition>,
}

/// Dynamic partitions and the COW's parameters.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Dynamic {
    /// Groups of `super`: name, size limit, partitions.
    pub groups: Vec<Group>,
    /// Virtual A/B.
    pub snapshot_enabled: bool,
    /// Virtual A/B Compression.
    pub vabc_enabled: bool,
    /// The COW's compression ("lz4", "gz", ...; empty: the device's default, gz).
    pub vabc_compression_param: Option<String>,
    /// The COW format version.
    pub cow_version: Option<u32>,
    /// Bytes compressed as one unit in the COW.
    pub compression_factor: Option<u64>,
    /// COW writer features: threaded, batch_writes.
    pub vabc_features: Vec<&'static str>,
}

/// A group of dynamic partitions.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Group {
    /// Its name.
    pub name: String,
    /// Its size limit in bytes.
    pub size: Option<u64>,
    /// Its partitions.
    pub partitions: Vec<String>,
}

/// One partition's update.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Partition {
    /// Its name.
    pub name: String,
    /// The old partition's size (incremental payloads).
    pub old_size: Option<u64>,
    /// The old partition's SHA-256.
    pub old_sha256: Option<String>,
    /// The new partition's size.
    pub new_size: Option<u64>,
    /// The new partition's SHA-256.
    pub new_sha256: Option<String>,
    /// The partition's version.
    pub version: Option<String>,
    /// Operations.
    pub operations: u64,
    /// Operations by type (update_engine's names).
    pub operations_by_type: BTreeMap<String, u64>,
    /// Bytes of data the operations carry.
    pub data_bytes: u64,
    /// Merge operations (Virtual A/B Compression order).
    pub merge_operations: u64,
    /// Merge operations by type (COW_COPY, COW_XOR, COW_REPLACE).
    pub merge_operations_by_type: BTreeMap<String, u64>,
    /// The generator's estimate of the COW's size.
    pub estimate_cow_size: Option<u64>,
    /// The generator's bound on the COW's op count (v3).
    pub estimate_op_count_max: Option<u64>,
    /// Whether the device computes a dm-verity hash tree.
    pub hash_tree: bool,
    /// Whether the device computes FEC data.
    pub fec: bool,
}

fn sha(i: &Option<PartitionInfo>) -> Option<String> {
    i.as_ref().and_then(|i| i.hash.as_deref()).map(hex::encode)
}

impl Info {
    /// What `p` holds.
    pub fn of(p: &Payload) -> Info {
        let m = &p.manifest;
        let partitions = m
            .partitions
            .iter()
            .map(|part| {
                let mut by_type = BTreeMap::new();
                for op in &part.operations {
                    let n = match op_name(op) {
                        "unknown type" => format!("type {}", op.r#type),
                        n => n.to_string(),
                    };
                    *by_type.entry(n).or_insert(0) += 1;
                }
                let mut merge_by_type = BTreeMap::new();
                for op in &part.merge_operations {
                    let t = op.r#type.unwrap_or(0);
                    let n = match CowMergeType::try_from(t) {
                        Ok(CowMergeType::CowCopy) => "COW_COPY".to_string(),
                        Ok(CowMergeType::CowXor) => "COW_XOR".to_string(),
                        Ok(CowMergeType::CowReplace) => "COW_REPLACE".to_string(),
                        Err(_) => format!("type {t}"),
                    };
                    *merge_by_type.entry(n).or_insert(0) += 1;
                }
                Partition {
                    name: part.partition_name.clone(),
                    old_size: part.old_partition_info.as_ref().and_then(|i| i.size),
                    old_sha256: sha(&part.old_partition_info),
                    new_size: part.new_partition_info.as_ref().and_then(|i| i.size),
                    new_sha256: sha(&part.new_partition_info),
                    version: part.version.clone(),
                    operations: part.operations.len() as u64,
                    operations_by_type: by_type,
                    data_bytes: part
                        .operations
                        .iter()
                        .fold(0u64, |n, o| n.saturating_add(o.data_length.unwrap_or(0))),
                    merge_operations: part.merge_operations.len() as u64,
                    merge_operations_by_type: merge_by_type,
                    estimate_cow_size: part.estimate_cow_size,
                    estimate_op_count_max: part.estimate_op_count_max,
                    hash_tree: part.hash_tree_extent.is_some(),
                    fec: part.fec_extent.is_some(),
                }
            })
            .collect();
        let dynamic_partitions = m.dynamic_partition_metadata.as_ref().map(|d| {
            let f = d.vabc_feature_set.clone().unwrap_or_default();
            let mut features = Vec::new();
            if f.threaded == Some(true) {
                features.push("threaded");
            }
            if f.batch_writes == Some(true) {
                features.push("batch_writes");
            }
            Dynamic {
                groups: d
                    .groups
                    .iter()
                    .map(|g| Group {
                        name: g.name.clone(),
                        size: g.size,
                        partitions: g.partition_names.clone(),
                    })
                    .collect(),
                snapshot_enabled: d.snapshot_enabled.unwrap_or(false),
                vabc_enabled: d.vabc_enabled.unwrap_or(false),
                vabc_compression_param: d.vabc_compression_param.clone(),
                cow_version: d.cow_version,
                compression_factor: d.compression_factor,
                vabc_features: features,
            }
        });
        Info {
            source: p.source().name().to_string(),
            payload_bytes: p.source().len(),
            major_version: p.header.major_version,
            minor_version: p.minor_version(),
            kind: if p.is_incremental() {
                "incremental"
            } else {
                "full"
            },
            block_size: p.block_size(),
            manifest_bytes: p.header.manifest_len,
            metadata_signature_bytes: p.header.metadata_signature_len,
            data_offset: p.header.data_offset(),
            payload_signature: p.payload_signature_range().map(|(a, b)| [a, b]),
            max_timestamp: m.max_timestamp,
            security_patch_level: m.security_patch_level.clone(),
            partial_update: m.partial_update.unwrap_or(false),
            dynamic_partitions,
            partitions,
        }
    }
}
