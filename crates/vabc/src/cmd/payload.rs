//! `vabc payload`: Android's own OTA payloads (`payload.bin`, the OTA zip holding it, or
//! either at an HTTP(S) URL): what they hold, their signatures, their partitions.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use serde::Serialize;

use crate::report;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Print what a payload holds: partitions, sizes and hashes, operations by type,
    /// the Virtual A/B Compression parameters (without checking signatures).
    Info(InfoArgs),
    /// Check the metadata and payload signatures with the payload's public key (reads
    /// the whole payload).
    Verify(VerifyArgs),
    /// Write partition images: a full payload's, or an incremental one's made from the
    /// old images. The metadata signature is checked first and every operation's data
    /// against its signed hash; every image is checked against its signed hash before
    /// it is renamed into place.
    Extract(ExtractArgs),
    /// Turn an incremental payload into the COWs a Virtual A/B Compression device
    /// writes for it (NAME.cow and its manifest): its merge operations as COPY and XOR
    /// ops in their order, the rest as ZERO and REPLACE, with the payload's COW
    /// version, compression and unit. `vabc serve`, `apply` and `merge` take them.
    Cow(CowArgs),
}

#[derive(clap::Args)]
struct InfoArgs {
    /// The payload: payload.bin, an OTA zip holding it, or an http(s):// URL of either.
    payload: String,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct VerifyArgs {
    /// The payload: payload.bin, an OTA zip holding it, or an http(s):// URL of either.
    payload: String,
    /// The public key the payload was signed with (PEM: PUBLIC KEY or RSA PUBLIC KEY,
    /// RSA or EC P-256), or its certificate (PEM CERTIFICATE, as an OTA package's
    /// otacert: take it from a place you trust, not from the package). Repeat for
    /// several accepted keys.
    #[arg(long = "key", value_name = "PUBKEY.pem", required = true)]
    keys: Vec<PathBuf>,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct ExtractArgs {
    /// The payload: payload.bin, an OTA zip holding it, or an http(s):// URL of either
    /// (only the asked partitions' data is fetched).
    payload: String,
    /// The folder to write NAME.img into.
    #[arg(short = 'o', long = "output-dir")]
    out_dir: PathBuf,
    /// Partitions to write, by name, comma-separated (default: all).
    #[arg(short = 'p', long = "partitions", value_delimiter = ',')]
    partitions: Vec<String>,
    /// The folder of the old images (NAME.img), for an incremental payload.
    #[arg(long)]
    old: Option<PathBuf>,
    /// The public key the payload was signed with, or its certificate (PEM; see
    /// `payload verify --help`). Repeat for several.
    #[arg(
        long = "key",
        value_name = "PUBKEY.pem",
        required_unless_present = "no_verify"
    )]
    keys: Vec<PathBuf>,
    /// Check no signature: the data is then checked only against the hashes the
    /// manifest carries, which whoever altered the payload could have rewritten.
    #[arg(long, conflicts_with = "keys")]
    no_verify: bool,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct CowArgs {
    #[command(flatten)]
    from: ExtractArgs,
    /// COW format version (2 or 3; default: the payload's cow_version, else 2).
    #[arg(long)]
    cow_version: Option<u16>,
    /// COW compression: none, gz, lz4, brotli or zstd, with an optional level
    /// (zstd:3). Default: the payload's vabc_compression_param, else gz.
    #[arg(long)]
    compression: Option<String>,
    /// Bytes per compression unit, 4K to 256K (v3; default: the payload's
    /// compression_factor, else 4K).
    #[arg(long, value_parser = crate::args::parse_size)]
    compression_factor: Option<u64>,
}

pub fn run(a: Args) -> Result<ExitCode> {
    match a.cmd {
        Sub::Info(a) => info(a),
        Sub::Verify(a) => verify(a),
        Sub::Extract(a) => extract(a),
        Sub::Cow(a) => cow(a),
    }
}

fn request(a: &ExtractArgs) -> ota::android::ExtractRequest {
    ota::android::ExtractRequest {
        source: a.payload.clone(),
        out_dir: a.out_dir.clone(),
        partitions: a.partitions.clone(),
        old_dir: a.old.clone(),
        keys: if a.no_verify {
            ota::android::KeyChoice::NoVerify
        } else {
            ota::android::KeyChoice::Keys(a.keys.clone())
        },
    }
}

fn signature_said(a: &ExtractArgs) -> &'static str {
    if a.no_verify {
        "not checked (--no-verify)"
    } else {
        "metadata signature verified"
    }
}

fn cow(a: CowArgs) -> Result<ExitCode> {
    let factor = match a.compression_factor {
        Some(f) => Some(
            u32::try_from(f).map_err(|_| anyhow::anyhow!("--compression-factor {f}: too large"))?,
        ),
        None => None,
    };
    let choice = ota::android::CowChoice {
        version: a.cow_version,
        compression: a.compression.clone(),
        compression_factor: factor,
    };
    let (_, params, cows) =
        ota::android::to_cows(&request(&a.from), &choice, &crate::progress::Bar::new())?;
    ota::output::keep_outputs();
    if a.from.json {
        report::print(CowReport {
            payload: &a.from.payload,
            signature: signature_said(&a.from),
            cow: params,
            partitions: cows,
        })?;
    } else {
        for c in &cows {
            let blocks: Vec<String> = c.blocks.iter().map(|(k, n)| format!("{k} {n}")).collect();
            println!(
                "wrote {} ({} bytes; blocks: {}) against {}",
                c.cow.display(),
                c.cow_bytes,
                blocks.join(", "),
                c.base.display()
            );
        }
        println!(
            "{}: {} COW(s), v{} {} in {}-byte units, signature {}",
            a.from.payload,
            cows.len(),
            params.version,
            params.compression,
            params.compression_factor,
            signature_said(&a.from)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn info(a: InfoArgs) -> Result<ExitCode> {
    let p = ota::android::open(&a.payload)?;
    let info = payload::info::Info::of(&p);
    if a.json {
        report::print(info)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: {} bytes, payload version {}.{} ({}), {} B blocks",
        info.source,
        info.payload_bytes,
        info.major_version,
        info.minor_version,
        info.kind,
        info.block_size
    );
    println!(
        "  manifest {} bytes, metadata signature {} bytes, payload signature {}",
        info.manifest_bytes,
        info.metadata_signature_bytes,
        info.payload_signature
            .map_or("none".to_string(), |[_, n]| format!("{n} bytes"))
    );
    if let Some(t) = info.max_timestamp {
        println!("  max timestamp {t}");
    }
    if let Some(s) = &info.security_patch_level {
        println!("  security patch level {s}");
    }
    if let Some(d) = &info.dynamic_partitions {
        println!(
            "  dynamic partitions: virtual A/B {}, compression {} (COW v{}, {} compression, factor {}{})",
            if d.snapshot_enabled { "on" } else { "off" },
            if d.vabc_enabled { "on" } else { "off" },
            d.cow_version.map_or("?".into(), |v| v.to_string()),
            d.vabc_compression_param.as_deref().unwrap_or("default"),
            d.compression_factor
                .map_or("default".into(), |f| f.to_string()),
            if d.vabc_features.is_empty() {
                String::new()
            } else {
                format!(", {}", d.vabc_features.join(", "))
            },
        );
        for g in &d.groups {
            println!(
                "    group {} ({} bytes): {}",
                g.name,
                g.size.unwrap_or(0),
                g.partitions.join(", ")
            );
        }
    }
    for part in &info.partitions {
        let size = |s: Option<u64>| s.map_or("-".to_string(), |s| s.to_string());
        println!(
            "  {}: {} -> {} bytes, {} operations, {} data bytes, {} merge operations",
            part.name,
            size(part.old_size),
            size(part.new_size),
            part.operations,
            part.data_bytes,
            part.merge_operations
        );
        let ops: Vec<String> = part
            .operations_by_type
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect();
        println!("    {}", ops.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(a: VerifyArgs) -> Result<ExitCode> {
    let p = ota::android::verify(&a.payload, &a.keys, &crate::progress::Bar::new())?;
    if a.json {
        report::print(VerifyReport {
            payload: &a.payload,
            metadata_signature: "verified",
            payload_signature: "verified",
            payload_bytes: p.source().len(),
        })?;
    } else {
        println!(
            "{}: metadata and payload signatures verified ({} bytes)",
            a.payload,
            p.source().len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn extract(a: ExtractArgs) -> Result<ExitCode> {
    let (p, parts) = ota::android::extract(&request(&a), &crate::progress::Bar::new())?;
    ota::output::keep_outputs();
    let verified = signature_said(&a);
    if a.json {
        report::print(ExtractReport {
            payload: &a.payload,
            kind: if p.is_incremental() {
                "incremental"
            } else {
                "full"
            },
            signature: verified,
            fetched_bytes: p.source().fetched(),
            partitions: parts,
        })?;
    } else {
        for e in &parts {
            println!(
                "wrote {} ({} bytes, sha256 {})",
                e.path.display(),
                e.size,
                e.sha256.as_deref().unwrap_or("-")
            );
        }
        println!(
            "{}: {} partition(s), signature {verified}",
            a.payload,
            parts.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `vabc payload verify --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct VerifyReport<'a> {
    payload: &'a str,
    metadata_signature: &'static str,
    payload_signature: &'static str,
    payload_bytes: u64,
}

/// `vabc payload extract --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct ExtractReport<'a> {
    payload: &'a str,
    /// "full" or "incremental".
    kind: &'static str,
    /// Whether the metadata signature was checked.
    signature: &'static str,
    /// Bytes fetched over HTTP (absent for a local file).
    fetched_bytes: Option<u64>,
    partitions: Vec<ota::android::Extracted>,
}

/// `vabc payload cow --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct CowReport<'a> {
    payload: &'a str,
    /// Whether the metadata signature was checked.
    signature: &'static str,
    /// The COW parameters used.
    cow: ::payload::cow::CowParams,
    partitions: Vec<ota::android::CowMade>,
}
