//! The container: a fixed header, the manifest (JSON), the signature, then each
//! partition's payload.
//!
//! JSON for the manifest (stored zstd-compressed: its hashes are hex) because it is
//! small, read once, shown to people (`vabc bundle info`), and grows by new optional
//! fields without a version bump; a reader refuses a header version it does not know.
//! Everything else is bytes bound to the manifest by sha256.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zerocopy::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::sign::{PublicKey, SIGNATURE_LEN, SecretKey};
use crate::{BundleError, Result, io_err};

/// The first 8 bytes of every bundle.
pub const MAGIC: [u8; 8] = *b"VABCBNDL";
/// The container version this build writes and reads: 3, whose manifest says how
/// many blocks each data frame holds (version 2 had frames of 1024; version 1, before
/// 2026-11-28, also carried the plan's merge sequence).
pub const FORMAT_VERSION: u32 = 3;
/// Bytes of the fixed header.
pub const HEADER_SIZE: usize = size_of::<Header>();
/// Largest manifest a reader accepts, stored and decoded: bounds what a damaged length
/// makes it allocate.
pub const MAX_MANIFEST: u32 = 64 << 20;

/// The fixed header.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct Header {
    magic: [u8; 8],
    version: U32,
    /// Zero; a reader refuses other values (room for flags a reader must understand).
    flags: U32,
    manifest_len: U32,
    /// 0 for an unsigned bundle, else [`SIGNATURE_LEN`].
    signature_len: U32,
    reserved: [u8; 8],
}

/// What a bundle holds: read first, signed, and the only thing a device must trust.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct BundleManifest {
    /// `vabc-bundle`.
    pub format: String,
    /// Who wrote it (`vabc 0.1.0`).
    pub created_by: String,
    /// Key id of the signer ([`PublicKey::id`]), `None` when unsigned.
    #[serde(default)]
    pub signer: Option<String>,
    /// What release this is, for the device's anti-rollback check.
    #[serde(flatten)]
    pub release: Release,
    /// The partitions, in payload order.
    pub partitions: Vec<Partition>,
}

/// A bundle's release: signed with the manifest, so that a device can refuse an
/// update that goes back (update_engine's `max_timestamp`, TUF's version numbers).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Release {
    /// Increases with every release; a device refuses one not greater than the
    /// version it runs (0 in bundles made before it existed).
    #[serde(default)]
    pub version: u64,
    /// When the bundle was built, seconds since 1970 (UTC).
    #[serde(default)]
    pub build_timestamp: u64,
    /// After this time (seconds since 1970) the bundle is refused: a device that is
    /// kept from seeing newer releases (a freeze attack) stops installing this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<u64>,
    /// Refuse to install this bundle over a newer version even when the device's
    /// user asks for a downgrade (`--allow-downgrade`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_downgrade: bool,
}

/// One partition's update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Partition {
    /// Partition name (`system`, `vendor`, ...): names its base and its outputs.
    pub name: String,
    /// Bytes of the partition the update is for: a device's base must be exactly this
    /// large, so that the base identity covers the whole partition (0 in bundles made
    /// before it existed: the base image's size).
    #[serde(default)]
    pub partition_size: u64,
    /// A full-image update: the COW writes every block of the new image (REPLACE and
    /// ZERO only), so any base of the partition's size takes it; its base identity is
    /// empty. Declared rather than inferred from an empty base, so that a delta made
    /// from an empty OLD by mistake is refused instead of installing anywhere.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub full: bool,
    /// The base it needs, the image it makes, and the per-op hashes of the COW it
    /// writes: the sidecar `vabc diff` writes beside a COW, written beside the
    /// installed one.
    pub image: manifest::Manifest,
    /// The COW the device writes.
    pub cow: CowParams,
    /// Blocks per op kind.
    pub plan: PlanCounts,
    /// Where its payload is and what it hashes to.
    pub payload: PayloadInfo,
    /// The dm-verity tree of the new image (made with `--verity`): the device builds
    /// the tree from the image it installed and checks its root against this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verity: Option<VerityInfo>,
}

/// dm-verity parameters and root hash of a partition's new image, as `veritysetup
/// format` takes and prints them; the tree itself is not shipped (about 0.8% of the
/// image, and the device computes it from the image it has just proved by sha256).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct VerityInfo {
    /// Hash format: 1 (the default) or 0 (Chrome OS's original).
    pub format: u32,
    /// `sha256`, `sha1` or `sha512`.
    pub hash_algorithm: String,
    pub data_block_size: u32,
    pub hash_block_size: u32,
    /// Blocks of the new image the tree covers.
    pub data_blocks: u64,
    /// Salt, hex (empty for none).
    pub salt: String,
    /// UUID of the hash file's superblock.
    pub uuid: String,
    /// Root hash, hex.
    pub root_hash: String,
}

/// The device-form COW: how it is written, and what it must come out as.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CowParams {
    /// COW format version, 2 or 3.
    pub version: u16,
    /// Codec and level, as `vabc diff --compression` takes it.
    pub compression: String,
    /// Largest REPLACE unit in bytes.
    pub compression_factor: u32,
    /// v3 ops ascending by block with the merge order as sequence data.
    pub block_order: bool,
    /// Size of the COW file.
    pub size: u64,
    /// sha256 of the COW file, hex.
    pub sha256: String,
}

/// Blocks per op kind of a partition's plan.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct PlanCounts {
    pub unchanged: u64,
    pub copy: u64,
    pub xor: u64,
    pub zero: u64,
    pub replace: u64,
}

/// A partition's payload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PayloadInfo {
    /// Offset from the start of the payload area (the first byte after the signature).
    pub offset: u64,
    /// Bytes.
    pub length: u64,
    /// sha256 of the payload, hex.
    pub sha256: String,
    /// Bytes of the plan section at its start (the data stream follows).
    pub plan_length: u64,
    /// Bytes the data stream decodes to (4 KiB per REPLACE and XOR block).
    pub data_bytes: u64,
    /// Blocks per frame of the data stream (the last frame may hold fewer); at most
    /// [`crate::data::MAX_FRAME_BLOCKS`].
    pub frame_blocks: u32,
}

impl PayloadInfo {
    /// A payload of a plan section of `plan_length` bytes and `data_bytes` of decoded
    /// data in frames of `frame_blocks`, not yet placed: [`BundleWriter::add_partition`]
    /// fills in where it is and what it hashes to.
    pub fn unplaced(plan_length: u64, data_bytes: u64, frame_blocks: u32) -> PayloadInfo {
        PayloadInfo {
            offset: 0,
            length: 0,
            sha256: String::new(),
            plan_length,
            data_bytes,
            frame_blocks,
        }
    }
}

impl Partition {
    /// Why this partition's kind and identities do not fit together, if they do not:
    /// a full image must not read its base, and a delta's base identity must cover
    /// the whole partition (an empty one covers nothing and would match any base).
    pub fn kind_problem(&self) -> Option<String> {
        let base = self.image.base.size;
        let plan = &self.plan;
        if self.full {
            if base != 0 {
                return Some(format!(
                    "a full-image update that names a base of {base} bytes"
                ));
            }
            if plan.copy != 0 || plan.xor != 0 || plan.unchanged != 0 {
                return Some(format!(
                    "a full-image update whose plan reads its base ({} COPY, {} XOR, {} \
                     unchanged blocks)",
                    plan.copy, plan.xor, plan.unchanged
                ));
            }
            if self.partition_size == 0 {
                return Some("a full-image update that does not state its partition's size".into());
            }
            return None;
        }
        if base == 0 {
            return Some(
                "an update against an empty base, which any partition would match; an update \
                 without a base must be declared a full image (`vabc bundle create --full`)"
                    .into(),
            );
        }
        if self.partition_size != 0 && self.partition_size != base {
            return Some(format!(
                "the base identity covers {base} bytes of a {}-byte partition",
                self.partition_size
            ));
        }
        None
    }

    /// Bytes of the partition the update is for ([`Partition::partition_size`]).
    pub fn partition_bytes(&self) -> u64 {
        match self.partition_size {
            0 => self.image.base.size,
            n => n,
        }
    }
}

impl BundleManifest {
    /// The partition named `name`.
    pub fn partition(&self, name: &str) -> Option<&Partition> {
        self.partitions.iter().find(|p| p.name == name)
    }

    /// Bytes of all payloads.
    pub fn payload_bytes(&self) -> u64 {
        self.partitions.iter().map(|p| p.payload.length).sum()
    }
}

fn header_bytes(manifest_len: usize, signed: bool) -> [u8; HEADER_SIZE] {
    let h = Header {
        magic: MAGIC,
        version: FORMAT_VERSION.into(),
        flags: 0.into(),
        manifest_len: (manifest_len as u32).into(),
        signature_len: if signed { SIGNATURE_LEN as u32 } else { 0 }.into(),
        reserved: [0; 8],
    };
    let mut out = [0u8; HEADER_SIZE];
    out.copy_from_slice(h.as_bytes());
    out
}

/// Writes a bundle: payloads first, into a temporary file beside the output, then the
/// header, manifest and signature in front of them on [`BundleWriter::finish`].
#[derive(Debug)]
pub struct BundleWriter {
    out: PathBuf,
    /// Where the temporary files go: a folder on `out`'s file system.
    temp_dir: PathBuf,
    payloads: tempfile::NamedTempFile,
    written: u64,
    partitions: Vec<Partition>,
    release: Release,
}

impl BundleWriter {
    /// A writer of the bundle `out` (created on [`BundleWriter::finish`]), its
    /// temporary files beside it.
    pub fn new(out: &Path) -> Result<BundleWriter> {
        let dir = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        BundleWriter::new_in(out, &dir)
    }

    /// A writer of the bundle `out` whose temporary files go into `temp_dir`, a folder
    /// on `out`'s file system (the finished bundle is renamed from there): a caller
    /// that removes that folder on an interrupt leaves nothing behind.
    pub fn new_in(out: &Path, temp_dir: &Path) -> Result<BundleWriter> {
        let payloads = temp_in(temp_dir, out)?;
        Ok(BundleWriter {
            out: out.to_path_buf(),
            temp_dir: temp_dir.to_path_buf(),
            payloads,
            written: 0,
            partitions: Vec::new(),
            release: Release::default(),
        })
    }

    /// Sets the release the manifest states.
    pub fn set_release(&mut self, release: Release) {
        self.release = release;
    }

    /// Where the next payload goes: append its bytes, then call
    /// [`BundleWriter::add_partition`].
    pub fn payload_file(&mut self) -> &mut File {
        self.payloads.as_file_mut()
    }

    /// Records the partition whose payload was appended since the last one; its
    /// `payload` offset, length and sha256 are filled in here.
    pub fn add_partition(&mut self, mut part: Partition) -> Result<()> {
        let path = self.payloads.path().to_path_buf();
        check_partition_name(&part.name, &self.out, 0)?;
        if self.partitions.iter().any(|p| p.name == part.name) {
            return Err(BundleError::Format {
                path: self.out.clone(),
                offset: 0,
                msg: format!("partition {:?} is added twice", part.name),
            });
        }
        let f = self.payloads.as_file_mut();
        let end = f.seek(SeekFrom::End(0)).map_err(io_err(&path, "seek", 0))?;
        let start = self.written;
        let mut hasher = Sha256::new();
        f.seek(SeekFrom::Start(start))
            .map_err(io_err(&path, "seek", start))?;
        std::io::copy(
            &mut (&mut *f).take(end - start),
            &mut HashWriter(&mut hasher),
        )
        .map_err(io_err(&path, "read back", start))?;
        part.payload.offset = start;
        part.payload.length = end - start;
        part.payload.sha256 = hex::encode(hasher.finalize());
        self.written = end;
        self.partitions.push(part);
        Ok(())
    }

    /// Writes header, manifest, signature (with `key`) and the payloads to the
    /// output, through a temporary file renamed into place. Returns the manifest.
    pub fn finish(self, key: Option<&SecretKey>, created_by: &str) -> Result<BundleManifest> {
        let manifest = BundleManifest {
            format: "vabc-bundle".into(),
            created_by: created_by.into(),
            signer: key.map(|k| k.public().id()),
            release: self.release,
            partitions: self.partitions,
        };
        let fail = |msg: String| BundleError::Format {
            path: self.out.clone(),
            offset: HEADER_SIZE as u64,
            msg,
        };
        let text = serde_json::to_vec(&manifest)
            .map_err(|e| fail(format!("cannot encode the manifest: {e}")))?;
        // Compressed: its hashes are hex, and a small update's bundle is mostly manifest.
        let json = zstd::bulk::compress(&text, 19)
            .map_err(|e| fail(format!("cannot compress the manifest: {e}")))?;
        let header = header_bytes(json.len(), key.is_some());
        let mut tmp = temp_in(&self.temp_dir, &self.out)?;
        let tpath = tmp.path().to_path_buf();
        let f = tmp.as_file_mut();
        f.write_all(&header).map_err(io_err(&tpath, "write", 0))?;
        f.write_all(&json)
            .map_err(io_err(&tpath, "write", HEADER_SIZE as u64))?;
        if let Some(k) = key {
            let sig = k.sign(&[&header, &json]);
            f.write_all(&sig).map_err(io_err(
                &tpath,
                "write",
                (HEADER_SIZE + json.len()) as u64,
            ))?;
        }
        let mut payloads =
            self.payloads
                .reopen()
                .map_err(io_err(self.payloads.path(), "reopen", 0))?;
        std::io::copy(&mut payloads, f).map_err(io_err(&tpath, "copy payloads into", 0))?;
        f.sync_all().map_err(io_err(&tpath, "sync", 0))?;
        tmp.persist(&self.out)
            .map_err(|e| io_err(&self.out, "rename the finished bundle to", 0)(e.error))?;
        Ok(manifest)
    }
}

fn temp_in(dir: &Path, out: &Path) -> Result<tempfile::NamedTempFile> {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    vabc_io::temp::temp_in(dir, &name).map_err(io_err(dir, "create a temporary file in", 0))
}

struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub use manifest::is_partition_name;

/// [`is_partition_name`], as the error of a bundle at `path` that breaks it.
fn check_partition_name(name: &str, path: &Path, offset: u64) -> Result<()> {
    if is_partition_name(name) {
        return Ok(());
    }
    Err(BundleError::Format {
        path: path.to_path_buf(),
        offset,
        msg: format!("partition name {name:?}: not 1 to 64 letters, digits, '_' or '-'"),
    })
}

/// Reads a bundle from any byte stream (a file, stdin, a download): header, manifest
/// and signature first, then each payload in order through
/// [`BundleReader::payload`].
pub struct BundleReader<R: Read> {
    input: R,
    path: PathBuf,
    /// Bytes consumed so far.
    pos: u64,
    payload_start: u64,
    manifest: BundleManifest,
    signed: bool,
    next: usize,
    /// Header, manifest and signature as read: what the signature covers.
    head: Vec<u8>,
}

impl<R: Read> std::fmt::Debug for BundleReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BundleReader")
            .field("path", &self.path)
            .field("pos", &self.pos)
            .finish()
    }
}

/// How a reader treats the signature.
#[derive(Clone, Copy, Debug)]
pub enum Trust<'a> {
    /// The bundle must be signed by this key.
    Key(&'a PublicKey),
    /// The bundle must be signed by one of `keys`; with `unsigned_ok`, an unsigned
    /// bundle (or any bundle, when `keys` is empty) is accepted unchecked (a
    /// development device's `--allow-unsigned`).
    AnyOf {
        keys: &'a [PublicKey],
        unsigned_ok: bool,
    },
    /// Accept any bundle, signed or not, without checking (`--allow-unsigned`,
    /// `vabc bundle info`).
    Unchecked,
}

impl<R: Read> BundleReader<R> {
    /// Reads the header, manifest and signature, and checks the signature as `trust`
    /// says. `path` names the input in errors (`-` for stdin).
    pub fn open(mut input: R, path: &Path, trust: Trust<'_>) -> Result<BundleReader<R>> {
        let fail = |offset: u64, msg: String| BundleError::Format {
            path: path.to_path_buf(),
            offset,
            msg,
        };
        let mut hb = [0u8; HEADER_SIZE];
        read_full(&mut input, &mut hb, path, 0, "the header")?;
        let h = Header::read_from_bytes(&hb).map_err(|_| fail(0, "short header".into()))?;
        if h.magic != MAGIC {
            return Err(fail(0, "not a vabc bundle (bad magic)".into()));
        }
        let version = h.version.get();
        if version != FORMAT_VERSION {
            return Err(fail(
                8,
                format!(
                    "bundle format version {version}; this vabc reads version {FORMAT_VERSION}"
                ),
            ));
        }
        if h.flags.get() != 0 {
            return Err(fail(
                12,
                format!("unknown header flags {:#x}", h.flags.get()),
            ));
        }
        let mlen = h.manifest_len.get();
        if mlen == 0 || mlen > MAX_MANIFEST {
            return Err(fail(16, format!("manifest length {mlen} is out of range")));
        }
        let slen = h.signature_len.get() as usize;
        if slen != 0 && slen != SIGNATURE_LEN {
            return Err(fail(
                20,
                format!("signature length {slen}; an Ed25519 signature is {SIGNATURE_LEN}"),
            ));
        }
        let mut json = vec![0u8; mlen as usize];
        read_full(
            &mut input,
            &mut json,
            path,
            HEADER_SIZE as u64,
            "the manifest",
        )?;
        let mut sig = vec![0u8; slen];
        let sig_at = (HEADER_SIZE + json.len()) as u64;
        read_full(&mut input, &mut sig, path, sig_at, "the signature")?;
        // The signature first: nothing of an unverified manifest is believed.
        check_signature(trust, path, &[&hb, &json], &sig)?;
        let mut text = Vec::new();
        zstd::stream::read::Decoder::new(&json[..])
            .and_then(|d| d.take(u64::from(MAX_MANIFEST) + 1).read_to_end(&mut text))
            .map_err(|e| fail(HEADER_SIZE as u64, format!("bad manifest: zstd: {e}")))?;
        if text.len() > MAX_MANIFEST as usize {
            return Err(fail(
                HEADER_SIZE as u64,
                format!("the manifest decodes to more than {MAX_MANIFEST} bytes"),
            ));
        }
        let manifest: BundleManifest = serde_json::from_slice(&text)
            .map_err(|e| fail(HEADER_SIZE as u64, format!("bad manifest: {e}")))?;
        if manifest.format != "vabc-bundle" {
            return Err(fail(
                HEADER_SIZE as u64,
                format!("manifest format {:?}, not vabc-bundle", manifest.format),
            ));
        }
        check_partitions(&manifest, path)?;
        let payload_start = sig_at + slen as u64;
        let mut head = Vec::with_capacity(payload_start as usize);
        head.extend_from_slice(&hb);
        head.extend_from_slice(&json);
        head.extend_from_slice(&sig);
        Ok(BundleReader {
            head,
            input,
            path: path.to_path_buf(),
            pos: payload_start,
            payload_start,
            manifest,
            signed: slen != 0,
            next: 0,
        })
    }

    /// The manifest (verified, if the reader was opened with a key).
    pub fn manifest(&self) -> &BundleManifest {
        &self.manifest
    }

    /// Whether the bundle carries a signature (checked only with [`Trust::Key`]).
    pub fn is_signed(&self) -> bool {
        self.signed
    }

    /// Where the payloads start in the bundle.
    pub fn payload_start(&self) -> u64 {
        self.payload_start
    }

    /// The bundle's head: header, manifest and signature, the bytes the signature
    /// covers (with the signature itself). A device keeps it to verify the update
    /// again at every boot and before its merge ([`read_head`]).
    pub fn head(&self) -> &[u8] {
        &self.head
    }

    /// The next partition's payload as a stream, hashed as it is read: call
    /// [`PayloadStream::finish`] once consumed, which fails unless the bytes hash to
    /// the manifest's sha256. `None` after the last partition.
    pub fn payload(&mut self) -> Option<(Partition, PayloadStream<'_, R>)> {
        let part = self.manifest.partitions.get(self.next)?.clone();
        self.next += 1;
        let len = part.payload.length;
        let start = self.pos;
        self.pos += len;
        Some((
            part.clone(),
            PayloadStream {
                inner: (&mut self.input).take(len),
                hasher: Sha256::new(),
                path: self.path.clone(),
                start,
                len,
                read: 0,
                part,
                spool: None,
                source_failed: Default::default(),
            },
        ))
    }
}

/// One payload, hashed as it is read.
pub struct PayloadStream<'a, R: Read> {
    inner: std::io::Take<&'a mut R>,
    hasher: Sha256,
    path: PathBuf,
    start: u64,
    len: u64,
    read: u64,
    part: Partition,
    spool: Option<Spool>,
    source_failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Whether reading a payload's source failed or ended early
/// ([`PayloadStream::source_health`]): a failure then lies with the network or the
/// file, not with the bytes read.
#[derive(Clone, Debug)]
pub struct SourceHealth(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl SourceHealth {
    /// True once a read of the source failed or found it ended early.
    pub fn failed(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A payload saved to a file as it downloads ([`PayloadStream::spool`]).
struct Spool {
    file: File,
    path: PathBuf,
    /// The bytes an earlier run saved, read back before the source.
    saved: u64,
}

/// Reads the payload's source, noting in `failed` an error or an early end.
fn read_source<R: Read>(
    inner: &mut std::io::Take<&mut R>,
    failed: &std::sync::atomic::AtomicBool,
    buf: &mut [u8],
) -> std::io::Result<usize> {
    let r = inner.read(buf);
    let failure = match &r {
        Ok(0) => inner.limit() > 0 && !buf.is_empty(),
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::Interrupted,
    };
    if failure {
        failed.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    r
}

impl<R: Read> Read for PayloadStream<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let n = match &mut self.spool {
            Some(sp) if self.read < sp.saved => {
                let left = usize::try_from(sp.saved - self.read).unwrap_or(usize::MAX);
                let want = buf.len().min(left);
                let at = self.read;
                let n = sp.file.read_at(&mut buf[..want], at).map_err(|e| {
                    std::io::Error::new(
                        e.kind(),
                        format!(
                            "read the saved download {} at offset {at}: {e}",
                            sp.path.display()
                        ),
                    )
                })?;
                if n == 0 && want > 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "the saved download {} ends at offset {at}: it shrank while it was read",
                            sp.path.display()
                        ),
                    ));
                }
                n
            }
            Some(sp) => {
                let n = read_source(&mut self.inner, &self.source_failed, buf)?;
                let at = self.read;
                sp.file.write_all_at(&buf[..n], at).map_err(|e| {
                    std::io::Error::new(
                        e.kind(),
                        format!(
                            "save the download to {} at offset {at}: {e}",
                            sp.path.display()
                        ),
                    )
                })?;
                n
            }
            None => read_source(&mut self.inner, &self.source_failed, buf)?,
        };
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

impl<R: Read> PayloadStream<'_, R> {
    /// Tells, also after the stream is gone, whether a read of its source failed: an
    /// install that fails for another reason blames the bytes it read (and drops the
    /// ones it saved, [`spool`](Self::spool)).
    pub fn source_health(&self) -> SourceHealth {
        SourceHealth(self.source_failed.clone())
    }

    /// Offset in the bundle of the next byte this stream returns.
    pub fn position(&self) -> u64 {
        self.start + self.read
    }

    /// Reads the plan section at the payload's start: its length (8 bytes,
    /// little-endian), which must be the manifest's and is bounded by the new image's
    /// block count before anything is allocated (a plan is a few bytes per block), then
    /// its bytes as they arrive, so that a stream ending early costs no more memory
    /// than it sent.
    pub fn read_plan(&mut self) -> Result<Vec<u8>> {
        let start = self.position();
        let path = self.path.clone();
        let fail = |offset: u64, msg: String| BundleError::Format {
            path: path.clone(),
            offset,
            msg,
        };
        let name = self.part.name.clone();
        let mut len = [0u8; 8];
        self.read_exact(&mut len).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => fail(
                start,
                format!("truncated: the bundle ends inside the plan of {name}"),
            ),
            _ => io_err(&self.path, "read the plan", start)(e),
        })?;
        let plan_len = u64::from_le_bytes(len);
        if plan_len.checked_add(8) != Some(self.part.payload.plan_length) {
            return Err(fail(
                start,
                format!(
                    "partition {name}: plan of {plan_len} bytes, the manifest says {}",
                    self.part.payload.plan_length.saturating_sub(8)
                ),
            ));
        }
        let blocks = self.part.image.new.size.div_ceil(4096);
        let max_plan = blocks.saturating_mul(64).saturating_add(1 << 20);
        if plan_len > max_plan {
            return Err(fail(
                start,
                format!(
                    "partition {name}: plan of {plan_len} bytes, more than any plan of its \
                     {blocks} blocks ({max_plan})"
                ),
            ));
        }
        let mut plan = Vec::new();
        let got = (&mut *self)
            .take(plan_len)
            .read_to_end(&mut plan)
            .map_err(io_err(&path, "read the plan", start + 8))?;
        if got as u64 != plan_len {
            return Err(fail(
                start + 8 + got as u64,
                format!(
                    "truncated: the bundle ends inside the plan of {name} ({got} of {plan_len} \
                     bytes)"
                ),
            ));
        }
        Ok(plan)
    }

    /// Reads what is left of the payload and checks its sha256 against the manifest.
    pub fn finish(mut self) -> Result<()> {
        let at = self.position();
        std::io::copy(&mut self, &mut std::io::sink()).map_err(io_err(
            &self.path,
            "read the payload",
            at,
        ))?;
        if self.read != self.len {
            return Err(BundleError::Format {
                path: self.path.clone(),
                offset: self.start + self.read,
                msg: format!(
                    "truncated: partition {:?} has {} of its {} payload bytes",
                    self.part.name, self.read, self.len
                ),
            });
        }
        let got = hex::encode(self.hasher.finalize_reset());
        if got != self.part.payload.sha256 {
            return Err(BundleError::PayloadHash {
                path: self.path.clone(),
                partition: self.part.name.clone(),
                offset: self.start,
                len: self.len,
                got,
                want: self.part.payload.sha256.clone(),
            });
        }
        Ok(())
    }
}

impl<R: crate::Source> PayloadStream<'_, R> {
    /// Saves the payload to the file at `path` as it is read, so that a run killed
    /// part-way (a power cut, a killed process) does not download it again: what an
    /// earlier run saved there is read back first and passed over in the source (a
    /// download then asks for the range after it). Returns the bytes read back; call
    /// it before reading. The saved bytes are not trusted: they go through the
    /// payload's sha256 with the rest. When they fail that, or do not decode, while
    /// [`source_health`](Self::source_health) is good, the caller removes the file. A
    /// file longer than the payload is from something else and is started again.
    pub fn spool(&mut self, path: &Path) -> Result<u64> {
        let at = self.position();
        if self.read != 0 {
            return Err(BundleError::Format {
                path: self.path.clone(),
                offset: at,
                msg: "a payload is spooled before it is read".into(),
            });
        }
        use std::os::unix::fs::OpenOptionsExt;
        // Not through a link: the name is predictable, and the file is written.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(io_err(path, "open the saved download", 0))?;
        let md = file
            .metadata()
            .map_err(io_err(path, "stat the saved download", 0))?;
        if !md.is_file() {
            return Err(BundleError::Format {
                path: path.to_path_buf(),
                offset: 0,
                msg: "the saved download's name is taken by something that is not a file".into(),
            });
        }
        let mut saved = md.len();
        if saved > self.len {
            file.set_len(0)
                .map_err(io_err(path, "truncate the saved download", 0))?;
            saved = 0;
        }
        self.inner.get_mut().skip(saved).map_err(io_err(
            &self.path,
            "pass over the saved download",
            at,
        ))?;
        self.inner.set_limit(self.len - saved);
        self.spool = Some(Spool {
            file,
            path: path.to_path_buf(),
            saved,
        });
        Ok(saved)
    }

    /// Passes over what is left of the payload without reading it (a file seeks, a
    /// download asks for the next range): for a partition an earlier install
    /// finished, whose COW is checked by its own signed sha256 instead.
    pub fn skip(mut self) -> Result<()> {
        let (at, left) = (self.position(), self.inner.limit());
        self.inner
            .get_mut()
            .skip(left)
            .map_err(io_err(&self.path, "pass over the payload", at))
    }
}

/// Reads a bundle head kept by a device ([`BundleReader::head`]): the signature
/// checked as `trust` says, the manifest parsed and checked as a whole bundle's is.
/// Bytes after the signature are refused: nothing unsigned rides along. Returns the
/// manifest and whether the head is signed.
pub fn read_head(bytes: &[u8], path: &Path, trust: Trust<'_>) -> Result<(BundleManifest, bool)> {
    let r = BundleReader::open(bytes, path, trust)?;
    if r.payload_start() != bytes.len() as u64 {
        return Err(BundleError::Format {
            path: path.to_path_buf(),
            offset: r.payload_start(),
            msg: format!(
                "{} bytes after the signed head, which holds only header, manifest and \
                 signature",
                bytes.len() as u64 - r.payload_start()
            ),
        });
    }
    Ok((r.manifest, r.signed))
}

fn read_full(
    input: &mut impl Read,
    buf: &mut [u8],
    path: &Path,
    offset: u64,
    what: &str,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match input.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(BundleError::Format {
                    path: path.to_path_buf(),
                    offset: offset + got as u64,
                    msg: format!(
                        "truncated: the bundle ends inside {what} ({got} of {} bytes)",
                        buf.len()
                    ),
                });
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(path, "read", offset + got as u64)(e)),
        }
    }
    Ok(())
}

/// `sig` over the `signed` parts, by a key `trust` names (or no signature, where it
/// allows that).
fn check_signature(trust: Trust<'_>, path: &Path, signed: &[&[u8]], sig: &[u8]) -> Result<()> {
    let (keys, unsigned_ok) = match trust {
        Trust::Key(k) => (std::slice::from_ref(k), false),
        Trust::AnyOf { keys, unsigned_ok } => (keys, unsigned_ok),
        Trust::Unchecked => (&[][..], true),
    };
    let sig_err = |msg: String| BundleError::Signature {
        path: path.to_path_buf(),
        msg,
    };
    if sig.is_empty() {
        if !unsigned_ok {
            return Err(sig_err(
                "the bundle is not signed; install it with --allow-unsigned only if you \
                 trust where it came from"
                    .into(),
            ));
        }
    } else if let Some(first) = keys.first() {
        if !keys.iter().any(|k| k.verify(signed, sig).is_ok()) {
            let why = first.verify(signed, sig).err().unwrap_or_default();
            return Err(sig_err(match keys.len() {
                1 => why,
                n => format!(
                    "the signature verifies with none of the {n} trusted keys ({}): {why}",
                    keys.iter()
                        .map(PublicKey::id)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }));
        }
    } else if !unsigned_ok {
        return Err(sig_err("no trusted key to check the signature with".into()));
    }
    Ok(())
}

/// The manifest's partitions: named once each, well formed, and their payloads one
/// after the other.
fn check_partitions(manifest: &BundleManifest, path: &Path) -> Result<()> {
    let fail = |offset: u64, msg: String| BundleError::Format {
        path: path.to_path_buf(),
        offset,
        msg,
    };
    let mut at = 0u64;
    for (i, p) in manifest.partitions.iter().enumerate() {
        check_partition_name(&p.name, path, HEADER_SIZE as u64)?;
        if manifest.partitions[..i].iter().any(|q| q.name == p.name) {
            return Err(fail(
                HEADER_SIZE as u64,
                format!("partition {:?} is named twice in the manifest", p.name),
            ));
        }
        if let Some(why) = p.kind_problem() {
            return Err(fail(
                HEADER_SIZE as u64,
                format!("partition {:?}: {why}", p.name),
            ));
        }
        if p.payload.offset != at || p.payload.plan_length > p.payload.length {
            return Err(fail(
                HEADER_SIZE as u64,
                format!(
                    "partition {:?}: payload at {} (+{} bytes) does not follow the one before it",
                    p.name, p.payload.offset, p.payload.length
                ),
            ));
        }
        let fb = p.payload.frame_blocks;
        if !(1..=crate::data::MAX_FRAME_BLOCKS).contains(&fb) {
            return Err(fail(
                HEADER_SIZE as u64,
                format!(
                    "partition {:?}: data frames of {fb} blocks (1 to {} allowed)",
                    p.name,
                    crate::data::MAX_FRAME_BLOCKS
                ),
            ));
        }
        at = at.checked_add(p.payload.length).ok_or_else(|| {
            fail(
                HEADER_SIZE as u64,
                format!("partition {:?}: payload length overflows", p.name),
            )
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unsigned bundle of one partition whose payload (`payload` bytes) is in
    /// frames of `frame_blocks`.
    fn one_partition(dir: &Path, frame_blocks: u32, payload: &[u8]) -> Vec<u8> {
        let out = dir.join("b.vabc");
        let mut w = BundleWriter::new(&out).unwrap();
        w.payload_file().write_all(payload).unwrap();
        let id = manifest::ImageId {
            size: 4096,
            sha256: "0".repeat(64),
            region_size: 4096,
            regions: Vec::new(),
        };
        w.add_partition(Partition {
            partition_size: 0,
            full: false,
            name: "system".into(),
            image: manifest::Manifest {
                schema_version: manifest::SCHEMA_VERSION,
                base: id.clone(),
                new: id,
                cow_ops: 0,
                merged_op_hashes: None,
            },
            cow: CowParams {
                version: 3,
                compression: "lz4".into(),
                compression_factor: 65536,
                block_order: false,
                size: 0,
                sha256: String::new(),
            },
            plan: PlanCounts::default(),
            payload: PayloadInfo::unplaced(0, 0, frame_blocks),
            verity: None,
        })
        .unwrap();
        w.finish(None, "test").unwrap();
        std::fs::read(&out).unwrap()
    }

    #[test]
    fn frames_of_zero_or_too_many_blocks_are_refused_with_the_manifest() {
        let dir = tempfile::tempdir().unwrap();
        for (fb, ok) in [
            (0, false),
            (1, true),
            (1024, true),
            (1025, false),
            (u32::MAX, false),
        ] {
            let bytes = one_partition(dir.path(), fb, b"x");
            let r = BundleReader::open(&bytes[..], Path::new("b.vabc"), Trust::Unchecked);
            match r {
                Ok(_) => assert!(ok, "frames of {fb} accepted"),
                Err(e) => {
                    assert!(!ok, "frames of {fb}: {e}");
                    let e = e.to_string();
                    assert!(
                        e.contains("b.vabc") && e.contains(&format!("frames of {fb} blocks")),
                        "{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn partition_names_are_file_name_safe() {
        for ok in ["system", "vendor_dlkm", "odm-a", "a", &"x".repeat(64)] {
            assert!(is_partition_name(ok), "{ok}");
        }
        for bad in [
            "",
            "../etc",
            "a/b",
            ".hidden",
            "sys tem",
            "é",
            &"x".repeat(65),
        ] {
            assert!(!is_partition_name(bad), "{bad}");
        }
    }

    /// The bytes of an unsigned bundle whose manifest is `edit`ed first (the
    /// manifest recompressed, the header's length fixed).
    fn with_manifest(bytes: &[u8], edit: impl Fn(&mut serde_json::Value)) -> Vec<u8> {
        let mlen = u32::from_le_bytes(bytes[16..20].try_into().unwrap()) as usize;
        let text =
            zstd::bulk::decompress(&bytes[HEADER_SIZE..HEADER_SIZE + mlen], 1 << 20).unwrap();
        let mut v: serde_json::Value = serde_json::from_slice(&text).unwrap();
        edit(&mut v);
        let json = zstd::bulk::compress(&serde_json::to_vec(&v).unwrap(), 3).unwrap();
        let mut out = header_bytes(json.len(), false).to_vec();
        out.extend_from_slice(&json);
        out.extend_from_slice(&bytes[HEADER_SIZE + mlen..]);
        out
    }

    #[test]
    fn a_partition_whose_kind_and_identities_disagree_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = one_partition(dir.path(), 64, b"x");
        let refused = |edit: &dyn Fn(&mut serde_json::Value), want: &str| {
            let e = BundleReader::open(
                &with_manifest(&bytes, edit)[..],
                Path::new("b.vabc"),
                Trust::Unchecked,
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(want) && e.contains("\"system\""), "{e}");
        };
        // A delta with an empty base would match any partition.
        refused(
            &|v| v["partitions"][0]["image"]["base"]["size"] = 0.into(),
            "empty base",
        );
        // A base identity that covers part of the partition.
        refused(
            &|v| v["partitions"][0]["partition_size"] = 8192.into(),
            "covers 4096 bytes of a 8192-byte partition",
        );
        // A full image reads nothing of its base, names none, and states its size.
        let full = |v: &mut serde_json::Value| {
            let p = &mut v["partitions"][0];
            p["full"] = true.into();
            p["image"]["base"]["size"] = 0.into();
            p["partition_size"] = 4096.into();
        };
        refused(
            &|v| {
                full(v);
                v["partitions"][0]["plan"]["copy"] = 1.into();
            },
            "reads its base (1 COPY",
        );
        refused(
            &|v| {
                full(v);
                v["partitions"][0]["image"]["base"]["size"] = 4096.into();
            },
            "names a base of 4096 bytes",
        );
        refused(
            &|v| {
                full(v);
                v["partitions"][0]["partition_size"] = 0.into();
            },
            "does not state its partition's size",
        );
        let ok = with_manifest(&bytes, full);
        let r = BundleReader::open(&ok[..], Path::new("b.vabc"), Trust::Unchecked).unwrap();
        assert!(r.manifest().partitions[0].full);
    }

    #[test]
    fn a_partition_named_twice_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = one_partition(dir.path(), 64, b"x");
        let twice = with_manifest(&bytes, |v| {
            let p = v["partitions"][0].clone();
            v["partitions"].as_array_mut().unwrap().push(p);
        });
        let e = BundleReader::open(&twice[..], Path::new("b.vabc"), Trust::Unchecked)
            .unwrap_err()
            .to_string();
        assert!(e.contains("named twice"), "{e}");
        // Nor can a writer add one twice.
        let mut w = BundleWriter::new(&dir.path().join("w.vabc")).unwrap();
        let r = BundleReader::open(&bytes[..], Path::new("b.vabc"), Trust::Unchecked).unwrap();
        let part = r.manifest().partitions[0].clone();
        w.add_partition(part.clone()).unwrap();
        assert!(
            w.add_partition(part)
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
    }

    #[test]
    fn a_plan_length_is_bounded_before_it_is_allocated() {
        let dir = tempfile::tempdir().unwrap();
        // A payload claiming a plan of 2^40 bytes (which a stream cannot be measured
        // against in advance): a clear error, no allocation of it.
        let huge = 1u64 << 40;
        let mut payload = huge.to_le_bytes().to_vec();
        payload.extend_from_slice(&[0u8; 64]);
        let bytes = one_partition(dir.path(), 64, &payload);
        let bytes = with_manifest(&bytes, |v| {
            v["partitions"][0]["payload"]["plan_length"] = (huge + 8).into();
            v["partitions"][0]["payload"]["length"] = (huge + 8).into();
        });
        let mut r = BundleReader::open(&bytes[..], Path::new("-"), Trust::Unchecked).unwrap();
        let (_, mut stream) = r.payload().unwrap();
        let e = stream.read_plan().unwrap_err().to_string();
        assert!(
            e.contains("more than any plan") && e.contains("offset"),
            "{e}"
        );
        // A stream that ends inside a plausible plan says so.
        let mut payload = 100u64.to_le_bytes().to_vec();
        payload.extend_from_slice(&[0u8; 10]);
        let bytes = one_partition(dir.path(), 64, &payload);
        let bytes = with_manifest(&bytes, |v| {
            v["partitions"][0]["payload"]["plan_length"] = 108.into();
            v["partitions"][0]["payload"]["length"] = 108.into();
        });
        let mut r = BundleReader::open(&bytes[..], Path::new("-"), Trust::Unchecked).unwrap();
        let (_, mut stream) = r.payload().unwrap();
        let e = stream.read_plan().unwrap_err().to_string();
        assert!(e.contains("truncated") && e.contains("10 of 100"), "{e}");
    }

    #[test]
    fn a_head_is_read_whole_and_alone() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = one_partition(dir.path(), 64, b"payload");
        let r = BundleReader::open(&bytes[..], Path::new("b.vabc"), Trust::Unchecked).unwrap();
        let head = r.head().to_vec();
        assert_eq!(head.len() as u64, r.payload_start());
        let (m, signed) = read_head(&head, Path::new("h"), Trust::Unchecked).unwrap();
        assert_eq!(&m, r.manifest());
        assert!(!signed);
        // Bytes after the signed head (here: the payload) are refused, naming where.
        let e = read_head(&bytes, Path::new("h"), Trust::Unchecked)
            .unwrap_err()
            .to_string();
        assert!(e.contains("after the signed head"), "{e}");
        // An unsigned head needs a device that accepts unsigned updates.
        let keys: &[PublicKey] = &[];
        let strict = Trust::AnyOf {
            keys,
            unsigned_ok: false,
        };
        let e = read_head(&head, Path::new("h"), strict)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not signed"), "{e}");
        let lax = Trust::AnyOf {
            keys,
            unsigned_ok: true,
        };
        assert!(read_head(&head, Path::new("h"), lax).is_ok());
    }
}
