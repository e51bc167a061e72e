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

/// Opens a payload: a path or URL of a `payload.bin` or an OTA zip.
pub fn open(spec: &str) -> Result<Payload> {
    let src = Source::open(spec).map_err(payload_error)?;
    Payload::open(src).map_err(payload_error)
}

/// Reads `keys` and checks the metadata signature (`whole`: the payload signature
/// too, reading every byte).
pub fn verify(p: &Payload, keys: &[PathBuf], whole: bool, observer: &dyn Observer) -> Result<()> {
    let keys = load_keys(keys)?;
    payload::verify::verify_metadata(p, &keys).map_err(payload_error)?;
    if whole {
        observer.event(Event::Start {
            phase: "verifying the payload",
            total: payload::verify::payload_hashed_len(p),
        });
        let r = payload::verify::verify_payload(p, &keys, &|n| observer.event(Event::Advance(n)));
        observer.event(Event::Finish);
        r.map_err(payload_error)?;
    }
    Ok(())
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
    if !req.out_dir.is_dir() {
        crate::error::invalid!(
            "-o {}: not a folder; create it first",
            req.out_dir.display()
        );
    }
    let p = open(&req.source)?;
    let trust = match &req.keys {
        KeyChoice::Keys(k) => {
            verify(&p, k, false, observer)?;
            Trust::Verified
        }
        KeyChoice::NoVerify => Trust::Unverified,
    };
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
    let mut done = Vec::new();
    for part in chosen {
        let name = &part.partition_name;
        let dest = req.out_dir.join(format!("{name}.img"));
        let old_file = match (&req.old_dir, p.is_incremental()) {
            (Some(dir), true) => {
                let path = dir.join(format!("{name}.img"));
                let f = std::fs::File::open(&path)
                    .map_err(|e| Error::io("open the old image", &path, e))?;
                let size = vabc_io::size_of(&f).map_err(|e| Error::io("size", &path, e))?;
                Some((f, size))
            }
            _ => None,
        };
        let old = old_file.as_ref().map(|(f, size)| Old {
            image: f,
            size: *size,
        });
        let tmp = crate::output::temp_beside(&dest)?;
        let total = part
            .operations
            .iter()
            .map(|o| payload::apply::blocks(&o.dst_extents))
            .sum();
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
        done.push((
            tmp,
            Extracted {
                name: name.clone(),
                path: dest,
                size,
                sha256,
            },
        ));
    }
    // Together one output: a failed rename removes the images renamed before it
    // (until the caller's `keep_outputs`).
    let mut out = Vec::new();
    for (tmp, e) in done {
        crate::output::part_of_output(&e.path, || crate::output::commit(tmp, &e.path))?;
        out.push(e);
    }
    Ok((p, out))
}
