//! Android's own updates: a `payload.bin` (alone, in an OTA zip, or at a URL) checked
//! against its signing key and turned into partition images.
//!
//! An extraction writes every asked partition to a temporary file and renames them
//! all only once every one is whole and matches its hash in the signed manifest: an
//! error leaves no output, and no earlier partition from a failed run.

use std::path::PathBuf;

use payload::apply::{Old, Trust};
use payload::{Keys, Payload, Source};

use crate::error::{Context as _, Error, Result};
use crate::progress::{Event, Observer};

/// Where a payload's signatures are checked from.
#[derive(Debug, Clone)]
pub enum KeyChoice {
    /// PEM public keys, any of which may have signed.
    Keys(Vec<PathBuf>),
    /// Nothing is checked against a key (`--no-verify`): only the hashes the
    /// manifest carries, which a forger rewrites with the data.
    NoVerify,
}

/// Opens a payload (a path or URL of a `payload.bin` or an OTA zip) without checking
/// its signatures.
pub fn open(spec: &str) -> Result<Payload> {
    let src = Source::open(spec).map_err(payload_error)?;
    Payload::open(src).map_err(payload_error)
}

/// Opens a payload as `keys` says: with keys, its metadata signature is checked over
/// the bytes read before the manifest is decoded.
pub fn open_with(spec: &str, keys: &KeyChoice) -> Result<(Payload, Trust)> {
    let src = Source::open(spec).map_err(payload_error)?;
    match keys {
        KeyChoice::Keys(paths) => {
            let keys = load_keys(paths)?;
            let p = Payload::open_verified(src, &keys).map_err(payload_error)?;
            Ok((p, Trust::Verified))
        }
        KeyChoice::NoVerify => Ok((
            Payload::open(src).map_err(payload_error)?,
            Trust::Unverified,
        )),
    }
}

/// Opens a payload with its metadata signature checked by `keys`, then checks its
/// payload signature too, reading every byte.
pub fn verify(spec: &str, keys: &[PathBuf], observer: &dyn Observer) -> Result<Payload> {
    let keys = load_keys(keys)?;
    let src = Source::open(spec).map_err(payload_error)?;
    let p = Payload::open_verified(src, &keys).map_err(payload_error)?;
    observer.event(Event::Start {
        phase: "verifying the payload",
        total: payload::verify::payload_hashed_len(&p),
    });
    let r = payload::verify::verify_payload(&p, &keys, &|n| observer.event(Event::Advance(n)));
    observer.event(Event::Finish);
    r.map_err(payload_error)?;
    Ok(p)
}

fn load_keys(paths: &[PathBuf]) -> Result<Keys> {
    if paths.is_empty() {
        crate::error::invalid!(
            "no key given: name the payload's public key (--key FILE), or --no-verify"
        );
    }
    let mut keys = Keys::default();
    for k in paths {
        keys.extend(Keys::from_pem_file(k).map_err(payload_error)?);
    }
    Ok(keys)
}

/// A payload error as the application's: a signature or hash that does not match is
/// a [`Error::Mismatch`].
pub fn payload_error(e: payload::Error) -> Error {
    let text = e.to_string();
    let mismatch = match &e {
        payload::Error::Signature { .. } => true,
        payload::Error::Op { what, .. } | payload::Error::Partition { what, .. } => {
            what.contains("SHA-256")
        }
        _ => false,
    };
    if mismatch {
        Error::Mismatch(text)
    } else {
        Error::Invalid(text)
    }
}

/// What to extract.
#[derive(Debug, Clone)]
pub struct ExtractRequest {
    /// The payload's path or URL (a `payload.bin` or an OTA zip).
    pub source: String,
    /// The folder the images are written to, as `NAME.img`.
    pub out_dir: PathBuf,
    /// Partitions to extract; empty: all.
    pub partitions: Vec<String>,
    /// The folder holding the old images (`NAME.img`), for an incremental payload.
    pub old_dir: Option<PathBuf>,
    /// How the payload is trusted.
    pub keys: KeyChoice,
}

/// One partition written.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct Extracted {
    /// Its name.
    pub name: String,
    /// The image written.
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// Its SHA-256, as the manifest gives it (checked).
    pub sha256: Option<String>,
}

/// Extracts (full payloads) or makes from the old images (incremental payloads) the
/// partitions `req` names; returns them and the payload as opened.
pub fn extract(req: &ExtractRequest, observer: &dyn Observer) -> Result<(Payload, Vec<Extracted>)> {
    let (p, made) = make_images(req, observer)?;
    // Together one output: a failed rename removes the images renamed before it
    // (until the caller's `keep_outputs`).
    let mut out = Vec::new();
    for m in made {
        crate::output::part_of_output(&m.dest, || crate::output::commit(m.tmp, &m.dest))?;
        out.push(m.extracted);
    }
    Ok((p, out))
}

/// A partition image made, still under its temporary name.
struct Made {
    tmp: tempfile::NamedTempFile,
    dest: PathBuf,
    old: Option<PathBuf>,
    extracted: Extracted,
}

/// Every asked partition written to a temporary file in the output folder and checked
/// against the signed hash.
fn make_images(req: &ExtractRequest, observer: &dyn Observer) -> Result<(Payload, Vec<Made>)> {
    if !req.out_dir.is_dir() {
        crate::error::invalid!(
            "-o {}: not a folder; create it first",
            req.out_dir.display()
        );
    }
    let (p, trust) = open_with(&req.source, &req.keys)?;
    let names: Vec<&str> = p
        .manifest
        .partitions
        .iter()
        .map(|x| x.partition_name.as_str())
        .collect();
    let chosen: Vec<_> = if req.partitions.is_empty() {
        p.manifest.partitions.iter().collect()
    } else {
        req.partitions
            .iter()
            .map(|want| {
                p.partition(want).ok_or_else(|| {
                    Error::Invalid(format!(
                        "-p {want}: the payload has no such partition (it has {})",
                        names.join(", ")
                    ))
                })
            })
            .collect::<Result<_>>()?
    };
    if p.is_incremental() && req.old_dir.is_none() {
        crate::error::invalid!(
            "{}: an incremental payload (minor version {}): give the folder of the old images (--old DIR, holding NAME.img)",
            p.source().name(),
            p.minor_version()
        );
    }
    let mut made = Vec::new();
    for part in chosen {
        let name = &part.partition_name;
        let dest = req.out_dir.join(format!("{name}.img"));
        let old_path = match (&req.old_dir, p.is_incremental()) {
            (Some(dir), true) => Some(dir.join(format!("{name}.img"))),
            _ => None,
        };
        let old_file = match &old_path {
            Some(path) => {
                let f = std::fs::File::open(path)
                    .map_err(|e| Error::io("open the old image", path, e))?;
                let size = vabc_io::size_of(&f).map_err(|e| Error::io("size", path, e))?;
                Some((f, size))
            }
            None => None,
        };
        let old = old_file.as_ref().map(|(f, size)| Old {
            image: f,
            size: *size,
        });
        let tmp = crate::output::temp_beside(&dest)?;
        let total = part.operations.iter().fold(0u64, |n, o| {
            n.saturating_add(payload::apply::blocks(&o.dst_extents))
        });
        observer.event(Event::Start {
            phase: "extracting",
            total,
        });
        let r = payload::apply::apply_partition(
            &p,
            part,
            old,
            tmp.as_file(),
            tmp.path(),
            trust,
            &|n| observer.event(Event::Advance(n)),
        );
        observer.event(Event::Finish);
        r.map_err(payload_error)
            .with_context(|| format!("extract {name} from {}", p.source().name()))?;
        let size = part
            .new_partition_info
            .as_ref()
            .and_then(|i| i.size)
            .unwrap_or(0);
        let sha256 = part
            .new_partition_info
            .as_ref()
            .and_then(|i| i.hash.as_deref())
            .map(hex::encode);
        made.push(Made {
            tmp,
            extracted: Extracted {
                name: name.clone(),
                path: dest.clone(),
                size,
                sha256,
            },
            dest,
            old: old_path,
        });
    }
    Ok((p, made))
}

/// One partition's COW made.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct CowMade {
    /// The partition.
    pub name: String,
    /// The COW written (`NAME.cow`, its manifest beside it as `NAME.cow.manifest`).
    pub cow: PathBuf,
    /// The COW's size in bytes.
    pub cow_bytes: u64,
    /// The old image it applies to.
    pub base: PathBuf,
    /// Blocks by op: copy, xor, zero, replace, unchanged.
    pub blocks: std::collections::BTreeMap<&'static str, u64>,
    /// The new image's SHA-256 (checked).
    pub new_sha256: Option<String>,
}

/// How [`to_cows`] writes the COWs; `None` fields take the payload's own values.
#[derive(Debug, Clone, Default)]
pub struct CowChoice {
    /// COW format version (2 or 3).
    pub version: Option<u16>,
    /// Compression ("lz4", "gz", "zstd:3", ...).
    pub compression: Option<String>,
    /// Bytes per compression unit.
    pub compression_factor: Option<u32>,
}

/// Turns an incremental payload into the COWs a Virtual A/B Compression device writes
/// for it (`NAME.cow` and its manifest in `req.out_dir`), with the payload's COW
/// version, compression and unit unless `choice` says otherwise. Each new image is
/// made and checked first (in a temporary file, removed after).
pub fn to_cows(
    req: &ExtractRequest,
    choice: &CowChoice,
    observer: &dyn Observer,
) -> Result<(Payload, payload::cow::CowParams, Vec<CowMade>)> {
    let (p, made) = make_images(req, observer)?;
    if !p.is_incremental() {
        crate::error::invalid!(
            "{}: a full payload has no old image to make a COW against; extract it instead",
            p.source().name()
        );
    }
    let asked = payload::cow::cow_params(&p);
    let params = payload::cow::CowParams {
        version: choice.version.unwrap_or(asked.version),
        compression: choice.compression.clone().unwrap_or(asked.compression),
        compression_factor: choice
            .compression_factor
            .unwrap_or(asked.compression_factor),
    };
    let compression: cow::Compression = params
        .compression
        .parse()
        .with_context(|| format!("the COW compression {:?}", params.compression))?;
    let opts = delta::write::CowOptions {
        version: params.version,
        compression,
        compression_factor: params.compression_factor,
        threads: 0,
        block_order: false,
    };
    let mut out = Vec::new();
    for m in made {
        let name = m.extracted.name.clone();
        let part = p
            .partition(&name)
            .ok_or_else(|| Error::Invalid(format!("no partition {name}")))?;
        let old_path = m
            .old
            .clone()
            .ok_or_else(|| Error::Invalid(format!("{name}: no old image")))?;
        let old = delta::ImageFile::open(&old_path, true)?;
        let new = delta::ImageFile::open(m.tmp.path(), true)?;
        let plan = payload::cow::plan(&p, part, &old, &new).map_err(payload_error)?;
        let cow_path = req.out_dir.join(format!("{name}.cow"));
        let (written, _, _, _) = crate::create::write_planned(
            &plan,
            (&old, &old_path),
            (&new, m.tmp.path()),
            &cow_path,
            &opts,
            None,
            observer,
        )
        .with_context(|| format!("the COW of {name}"))?;
        let c = plan.census;
        out.push(CowMade {
            name,
            cow: cow_path,
            cow_bytes: written.cow_size,
            base: old_path,
            blocks: [
                ("copy", c.copy),
                ("xor", c.xor),
                ("zero", c.zero),
                ("replace", c.replace),
                ("unchanged", c.unchanged),
            ]
            .into_iter()
            .collect(),
            new_sha256: m.extracted.sha256,
        });
    }
    Ok((p, params, out))
}
