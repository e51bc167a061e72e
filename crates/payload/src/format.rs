//! The payload's layout (major version 2, as every Android since 2016 ships it):
//!
//! ```text
//! 0          "CrAU"
//! 4          major version, u64 big-endian (2)
//! 12         manifest length M, u64 big-endian
//! 20         metadata signature length S, u32 big-endian
//! 24         manifest (DeltaArchiveManifest, protobuf)
//! 24+M       metadata signature (Signatures over SHA-256 of bytes 0..24+M)
//! 24+M+S     data: each operation's at data_offset from here; the payload
//!            signature at signatures_offset, over every byte before it except the
//!            metadata signature
//! ```

use prost::Message as _;

use crate::error::{Error, Result};
use crate::proto::{DeltaArchiveManifest, InstallOperation, OpType, PartitionUpdate};
use crate::source::Source;

/// The header's length.
pub const HEADER_LEN: u64 = 24;
/// The only major version Android writes since 2016.
pub const MAJOR_VERSION: u64 = 2;
/// The largest manifest read: a full OTA's manifest of a hundred thousand operations
/// is a few MiB; anything past this is a crafted length.
pub const MAX_MANIFEST: u64 = 64 << 20;
/// The most memory a decoded manifest may take (estimated before decoding it): a
/// message of two bytes on the wire decodes to hundreds, so a crafted manifest of
/// empty messages would otherwise take tens of GiB.
pub const MAX_DECODED_MANIFEST: u64 = 1 << 30;
/// The largest metadata signature read (a few signatures of a few hundred bytes).
pub const MAX_METADATA_SIGNATURE: u32 = 1 << 20;

/// The fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The major version (2).
    pub major_version: u64,
    /// Bytes of manifest.
    pub manifest_len: u64,
    /// Bytes of metadata signature.
    pub metadata_signature_len: u32,
}

impl Header {
    /// Parses the first [`HEADER_LEN`] bytes of `name`.
    pub fn parse(name: &str, b: &[u8; HEADER_LEN as usize]) -> Result<Header> {
        if &b[..4] != b"CrAU" {
            return Err(Error::format(
                name,
                0,
                format!(
                    "not an Android OTA payload (magic {:02x?}, want \"CrAU\")",
                    &b[..4]
                ),
            ));
        }
        let be64 = |at: usize| u64::from_be_bytes(b[at..at + 8].try_into().unwrap_or_default());
        let major_version = be64(4);
        if major_version != MAJOR_VERSION {
            return Err(Error::format(
                name,
                4,
                format!("major version {major_version}: only {MAJOR_VERSION} is read"),
            ));
        }
        let manifest_len = be64(12);
        if manifest_len > MAX_MANIFEST {
            return Err(Error::format(
                name,
                12,
                format!(
                    "manifest of {manifest_len} bytes: more than {MAX_MANIFEST} is not a real payload"
                ),
            ));
        }
        let metadata_signature_len = u32::from_be_bytes([b[20], b[21], b[22], b[23]]);
        if metadata_signature_len > MAX_METADATA_SIGNATURE {
            return Err(Error::format(
                name,
                20,
                format!(
                    "metadata signature of {metadata_signature_len} bytes: more than {MAX_METADATA_SIGNATURE} is not a real payload"
                ),
            ));
        }
        Ok(Header {
            major_version,
            manifest_len,
            metadata_signature_len,
        })
    }

    /// Bytes the metadata signature covers: header and manifest.
    pub fn metadata_len(&self) -> u64 {
        HEADER_LEN + self.manifest_len
    }

    /// Where the data starts.
    pub fn data_offset(&self) -> u64 {
        self.metadata_len() + u64::from(self.metadata_signature_len)
    }
}

/// A payload opened: its header and manifest read, nothing else yet.
#[derive(Debug)]
pub struct Payload {
    source: Source,
    /// The header.
    pub header: Header,
    /// The manifest.
    pub manifest: DeltaArchiveManifest,
    /// The metadata signature's bytes (a `Signatures` message), empty when unsigned.
    pub metadata_signature: Vec<u8>,
    /// The header and manifest as read, once: what the manifest was decoded from and
    /// what the metadata signature is checked over (a second read, from a server
    /// or a file that changes, could give other bytes).
    metadata: Vec<u8>,
}

impl Payload {
    /// Reads the header, manifest and metadata signature of `source`, checking no
    /// signature.
    pub fn open(source: Source) -> Result<Payload> {
        Payload::open_checked(source, None)
    }

    /// Reads the header, manifest and metadata signature of `source` and checks the
    /// metadata signature with `keys` over the bytes read, before the manifest is
    /// decoded: what is decoded is what was signed.
    pub fn open_verified(source: Source, keys: &crate::Keys) -> Result<Payload> {
        Payload::open_checked(source, Some(keys))
    }

    fn open_checked(source: Source, keys: Option<&crate::Keys>) -> Result<Payload> {
        let name = source.name().to_string();
        if source.len() < HEADER_LEN {
            return Err(Error::format(
                &name,
                0,
                format!("{} bytes: too short for a payload header", source.len()),
            ));
        }
        let mut h = [0u8; HEADER_LEN as usize];
        source.read_at(&mut h, 0)?;
        let header = Header::parse(&name, &h)?;
        if header.data_offset() > source.len() {
            return Err(Error::format(
                &name,
                12,
                format!(
                    "the manifest and metadata signature ({} bytes) run past the end ({} bytes)",
                    header.data_offset() - HEADER_LEN,
                    source.len()
                ),
            ));
        }
        let mut metadata = h.to_vec();
        metadata.extend(source.read_vec(HEADER_LEN, header.manifest_len)?);
        let metadata_signature = source.read_vec(
            header.metadata_len(),
            u64::from(header.metadata_signature_len),
        )?;
        if let Some(keys) = keys {
            keys.verify(
                "metadata signature",
                &metadata_signature,
                &sha256(&metadata),
            )?;
        }
        let bytes = &metadata[HEADER_LEN as usize..];
        let decoded = crate::proto::decoded_size(bytes).map_err(|what| {
            Error::format(
                &name,
                HEADER_LEN,
                format!("the manifest does not decode: {what}"),
            )
        })?;
        if decoded > MAX_DECODED_MANIFEST {
            return Err(Error::format(
                &name,
                HEADER_LEN,
                format!(
                    "the manifest would take {decoded} bytes of memory decoded (more than \
                     {MAX_DECODED_MANIFEST}): not a real payload's"
                ),
            ));
        }
        let manifest = DeltaArchiveManifest::decode(bytes).map_err(|e| {
            Error::format(
                &name,
                HEADER_LEN,
                format!("the manifest does not decode: {e}"),
            )
        })?;
        let p = Payload {
            source,
            header,
            manifest,
            metadata_signature,
            metadata,
        };
        p.check_manifest()?;
        Ok(p)
    }

    /// The header and manifest bytes, as read once and decoded.
    pub fn metadata_bytes(&self) -> &[u8] {
        &self.metadata
    }

    /// Where the bytes come from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The block size of every extent.
    pub fn block_size(&self) -> u32 {
        self.manifest.block_size.unwrap_or(4096)
    }

    /// 0 for a full payload.
    pub fn minor_version(&self) -> u32 {
        self.manifest.minor_version.unwrap_or(0)
    }

    /// Whether it needs the old partitions (an incremental payload).
    pub fn is_incremental(&self) -> bool {
        self.minor_version() != 0
    }

    /// The partition called `name`.
    pub fn partition(&self, name: &str) -> Option<&PartitionUpdate> {
        self.manifest
            .partitions
            .iter()
            .find(|p| p.partition_name == name)
    }

    /// The payload signature's place (offset from the start of the payload, length),
    /// when the manifest names one.
    pub fn payload_signature_range(&self) -> Option<(u64, u64)> {
        let off = self.manifest.signatures_offset?;
        let len = self.manifest.signatures_size?;
        Some((self.header.data_offset().checked_add(off)?, len))
    }

    /// An operation's data, read and (when the manifest gives its hash) checked.
    pub fn op_data(&self, partition: &str, index: usize, op: &InstallOperation) -> Result<Vec<u8>> {
        let (Some(off), Some(len)) = (op.data_offset, op.data_length) else {
            return Ok(Vec::new());
        };
        let bad = |what: String| Error::op(partition, index, op, what);
        let at = self
            .header
            .data_offset()
            .checked_add(off)
            .ok_or_else(|| bad(format!("data offset {off} overflows")))?;
        if at.checked_add(len).is_none_or(|e| e > self.source.len()) {
            return Err(bad(format!(
                "data at {at}, {len} bytes, runs past the end of {} ({} bytes)",
                self.source.name(),
                self.source.len()
            )));
        }
        let data = self.source.read_vec(at, len)?;
        if let Some(want) = &op.data_sha256_hash {
            let got = sha256(&data);
            if got.as_slice() != want.as_slice() {
                return Err(bad(format!(
                    "its data (at offset {at} of {}) has SHA-256 {}, the manifest says {}",
                    self.source.name(),
                    hex::encode(got),
                    hex::encode(want)
                )));
            }
        }
        Ok(data)
    }

    /// Checks what the manifest says before anything is read from the data: block
    /// size, partition names.
    fn check_manifest(&self) -> Result<()> {
        let name = self.source.name();
        let bs = self.block_size();
        if !(512..=(1 << 20)).contains(&bs) || !bs.is_power_of_two() {
            return Err(Error::format(
                name,
                HEADER_LEN,
                format!("block size {bs} is not a power of two from 512 to 1 MiB"),
            ));
        }
        // Told apart as a case-insensitive file system would: NAME.img is written.
        let mut seen = std::collections::BTreeSet::new();
        for p in &self.manifest.partitions {
            let n = &p.partition_name;
            let ok = !n.is_empty()
                && n.len() <= 64
                && n.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
                && !n.starts_with('-');
            if !ok {
                return Err(Error::format(
                    name,
                    HEADER_LEN,
                    format!("partition name {n:?} is not a plain name (letters, digits, _ and -)"),
                ));
            }
            if !seen.insert(n.to_ascii_lowercase()) {
                return Err(Error::format(
                    name,
                    HEADER_LEN,
                    format!("partition {n} is named twice"),
                ));
            }
        }
        Ok(())
    }
}

/// The name of an operation's type, or "type N" for one this crate does not know.
pub fn op_name(op: &InstallOperation) -> &'static str {
    OpType::try_from(op.r#type).map_or("unknown type", OpType::name)
}

pub(crate) fn sha256(data: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(data).into()
}
