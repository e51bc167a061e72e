//! `vabc bundle`: the update as one signed file for shipping (`create`, `info`,
//! `verify`), turned into device-form COWs on the device (`install`) or into the new
//! images (`apply`). The format is in the `bundle` crate and docs/04-bundle.md.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use bundle::format::Trust;
use bundle::sign::{PublicKey, SecretKey};
use bundle::{BundleManifest, BundleReader, Partition};
use cow::Compression;
use delta::write::CowOptions;
use serde::Serialize;

use crate::checks::mismatch;
use crate::progress::Bar;
use crate::report;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Make a bundle from old/new image pairs, one per partition.
    Create(CreateArgs),
    /// Print what a bundle holds (without checking its signature).
    Info(InfoArgs),
    /// Check a bundle's signature and every payload's hash.
    Verify(VerifyArgs),
    /// Pre-flight report against the device's bases: right base?, download size, COW
    /// space, merge I/O, estimated install and merge time.
    Plan(PlanArgs),
    /// Turn a bundle into the device-form COWs (and their manifests), checking the
    /// signature and each base before writing; resumable.
    Install(InstallArgs),
    /// Make the new images from a bundle and the old ones (sizes and sha256 checked).
    Apply(InstallArgs),
}

#[derive(clap::Args)]
struct CreateArgs {
    /// A partition's update: its name, old image and new image. Repeat for more
    /// partitions (system, vendor, ...).
    #[arg(
        short = 'p',
        long = "partition",
        value_name = "NAME=OLD,NEW",
        required_unless_present = "full",
        value_parser = crate::args::name_eq
    )]
    partitions: Vec<String>,
    /// A partition's full image, an update without a base: its COW writes every block
    /// (ZERO and REPLACE only), so it installs over whatever the partition holds, as
    /// long as the partition has the size the bundle states (--partition-size, or
    /// NEW's size). Larger than a delta; for a first install or a lost base.
    #[arg(long = "full", value_name = "NAME=NEW", value_parser = crate::args::name_eq)]
    full: Vec<String>,
    /// Size of a --full partition on the device (default: its NEW's size); a device's
    /// partition of another size is refused.
    #[arg(long = "partition-size", value_name = "NAME=SIZE", value_parser = crate::args::name_eq)]
    partition_sizes: Vec<String>,
    /// Where to write the bundle.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Sign with this Ed25519 private key (PEM, `openssl genpkey -algorithm ed25519`).
    #[arg(long, value_name = "KEY.pem", required_unless_present = "unsigned")]
    key: Option<PathBuf>,
    /// Make an unsigned bundle (installing it then needs --allow-unsigned).
    #[arg(long, conflicts_with = "key")]
    unsigned: bool,
    /// Codec of the COWs the device writes (as `vabc diff --compression`). lz4, the
    /// codec Android devices decode at boot, by default: the device-form COW is laid
    /// out for reading, its size costs no download.
    #[arg(long, default_value = "lz4", value_name = "CODEC[:LEVEL]")]
    cow_compression: String,
    /// Largest REPLACE unit of the device's COWs.
    #[arg(long, default_value = "64k", value_parser = crate::args::parse_size)]
    cow_compression_factor: u64,
    /// COW format version of the device's COWs (2 or 3).
    #[arg(long, default_value_t = 3)]
    cow_version: u16,
    /// Ops ascending by block, the merge order as sequence data (see `vabc diff`).
    #[arg(long)]
    block_order: bool,
    /// No XOR ops (see `vabc diff --no-xor`).
    #[arg(long)]
    no_xor: bool,
    /// Store XORs in source runs shorter than this as REPLACE (see `vabc diff`).
    #[arg(long, default_value_t = 0, value_name = "BLOCKS")]
    min_xor_run: u64,
    /// zstd level of the payloads' data frames (1-22), in frames of 1024 blocks: 19
    /// makes the smallest bundle of a large update, at about twice xdelta3 -9's time
    /// (bench/results/bundle.md). By default frames of 64 blocks with a short optimal-parse
    /// search, or one frame at level 19 for an update of at most 1024 changed blocks
    /// that compresses much better so (docs/04-bundle.md).
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..=22))]
    level: Option<i32>,
    /// Threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Record each new image's dm-verity root hash and tree parameters (sha256,
    /// 4096-byte blocks, as `vabc verity format`): install then writes NAME.verity
    /// beside each COW, checked against the signed root hash, for `vabc serve
    /// --verity-hash` and the kernel's dm-verity.
    #[arg(long)]
    verity: bool,
    /// Salt of the --verity trees, hex or "-" for none (default: 32 random bytes).
    #[arg(long, value_name = "HEX|-", requires = "verity")]
    verity_salt: Option<String>,
    /// The release's version, signed: a device refuses a bundle whose version is not
    /// greater than the one it runs. Default: the build time in seconds since 1970
    /// ($SOURCE_DATE_EPOCH when set), as update_engine's max_timestamp.
    #[arg(long, value_name = "N")]
    release_version: Option<u64>,
    /// Refuse the bundle after this time: seconds since 1970, or +DAYSd after the
    /// build (a device kept from newer releases stops installing this one).
    #[arg(long, value_name = "SECONDS|+DAYSd")]
    expires: Option<String>,
    /// Never install this bundle over a newer version, even with `update install
    /// --allow-downgrade`.
    #[arg(long)]
    no_downgrade: bool,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

/// The release a bundle states, from `create`'s options.
fn release_of(a: &CreateArgs) -> Result<bundle::Release> {
    let build_timestamp = match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .with_context(|| format!("SOURCE_DATE_EPOCH={v:?}: not a number of seconds"))?,
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let expires = match a.expires.as_deref() {
        None => None,
        Some(e) => Some(
            match e.strip_prefix('+').and_then(|d| d.strip_suffix('d')) {
                Some(days) => days
                    .parse::<u64>()
                    .ok()
                    .and_then(|d| d.checked_mul(86_400))
                    .and_then(|s| s.checked_add(build_timestamp)),
                None => e.parse::<u64>().ok(),
            }
            .with_context(|| format!("--expires {e:?}: seconds since 1970, or +DAYSd"))?,
        ),
    };
    if let Some(t) = expires
        && t <= build_timestamp
    {
        bail!("--expires {t}: not after the build time {build_timestamp}");
    }
    Ok(bundle::Release {
        version: a.release_version.unwrap_or(build_timestamp),
        build_timestamp,
        expires,
        no_downgrade: a.no_downgrade,
    })
}

#[derive(clap::Args)]
struct InfoArgs {
    /// The bundle (`-` for stdin).
    bundle: PathBuf,
    /// Also check the signature with this public key (as `verify` does; without it,
    /// info shows an unchecked manifest and says so).
    #[arg(long, value_name = "PUB.pem")]
    key: Option<PathBuf>,
    /// Print the manifest as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub(crate) struct KeyArgs {
    /// The public key bundles must be signed with (PEM, `openssl pkey -pubout`).
    #[arg(
        long,
        value_name = "PUB.pem",
        required_unless_present = "allow_unsigned"
    )]
    key: Option<PathBuf>,
    /// Accept a bundle without checking any signature (only for bundles from a source
    /// you trust).
    #[arg(long, conflicts_with = "key")]
    allow_unsigned: bool,
}

impl KeyArgs {
    pub(crate) fn load(&self) -> Result<Option<PublicKey>> {
        self.key
            .as_deref()
            .map(PublicKey::load)
            .transpose()
            .map_err(Into::into)
    }
}

fn trust(key: &Option<PublicKey>) -> Trust<'_> {
    match key {
        Some(k) => Trust::Key(k),
        None => Trust::Unchecked,
    }
}

#[derive(clap::Args)]
struct VerifyArgs {
    /// The bundle (`-` for stdin).
    bundle: PathBuf,
    #[command(flatten)]
    key: KeyArgs,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct PlanArgs {
    /// The bundle (`-` for stdin; only its manifest is read).
    bundle: PathBuf,
    /// A partition's base image. Every partition of the bundle needs one.
    #[arg(short = 'b', long = "base", value_name = "NAME=PATH", required = true, value_parser = crate::args::name_eq)]
    bases: Vec<String>,
    #[command(flatten)]
    key: KeyArgs,
    /// The device's storage speed in MB/s for the estimates; default: measured while
    /// the bases are read to check them.
    #[arg(long, value_name = "MB/S")]
    speed: Option<f64>,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

/// Arguments of `install` and `apply`.
#[derive(clap::Args)]
struct InstallArgs {
    /// The bundle: a file, `-` for stdin, or an http:// or https:// URL (a cut
    /// download resumes with range requests).
    bundle: PathBuf,
    /// A partition's base image (its old image, on the device). Every partition of the
    /// bundle needs one.
    #[arg(short = 'b', long = "base", value_name = "NAME=PATH", required = true, value_parser = crate::args::name_eq)]
    bases: Vec<String>,
    /// Where to write, per partition, NAME.cow and NAME.cow.manifest (install) or
    /// NAME.img (apply).
    #[arg(short = 'o', long = "out-dir", value_name = "DIR")]
    out_dir: PathBuf,
    #[command(flatten)]
    key: KeyArgs,
    /// Threads of the COW writer (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

impl InstallArgs {
    /// What `install` and `apply` ask of the library.
    fn request<'a>(
        &'a self,
        bases: &'a [(String, PathBuf)],
        key: &'a Option<PublicKey>,
    ) -> ota::install::Request<'a> {
        ota::install::Request {
            bundle: &self.bundle,
            bases,
            out_dir: &self.out_dir,
            trust: trust(key),
            threads: self.threads,
        }
    }
}

pub fn run(a: Args) -> Result<ExitCode> {
    match a.cmd {
        Sub::Create(a) => create(a),
        Sub::Info(a) => info(a),
        Sub::Verify(a) => verify(a),
        Sub::Plan(a) => plan(a),
        Sub::Install(a) => install(a).map(|_| ExitCode::SUCCESS),
        Sub::Apply(a) => apply(a),
    }
}

/// `NAME=REST`, with a name fit for a file name.
fn split_name(s: &str, what: &str) -> Result<(String, String)> {
    let Some((name, rest)) = s.split_once('=') else {
        bail!("{what} {s:?}: expected NAME=...");
    };
    if !bundle::format::is_partition_name(name) {
        bail!("{what} {s:?}: a partition name is 1 to 64 letters, digits, '_' and '-'");
    }
    Ok((name.to_string(), rest.to_string()))
}

#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct CreateReport {
    output: PathBuf,
    size: u64,
    signed: bool,
    signer: Option<String>,
    partitions: Vec<PartReport>,
    seconds: f64,
}

#[derive(Serialize, schemars::JsonSchema)]
struct PartReport {
    name: String,
    /// A full image (no base).
    full: bool,
    partition_size: u64,
    base_size: u64,
    new_size: u64,
    payload_bytes: u64,
    plan_bytes: u64,
    data_bytes: u64,
    /// Blocks per data frame.
    frame_blocks: u32,
    cow_size: u64,
    ops: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    verity_root_hash: Option<String>,
}

fn part_report(p: &Partition) -> PartReport {
    PartReport {
        name: p.name.clone(),
        full: p.full,
        partition_size: p.partition_bytes(),
        base_size: p.image.base.size,
        new_size: p.image.new.size,
        payload_bytes: p.payload.length,
        plan_bytes: p.payload.plan_length,
        data_bytes: p.payload.data_bytes,
        frame_blocks: p.payload.frame_blocks,
        cow_size: p.cow.size,
        ops: p.image.cow_ops,
        verity_root_hash: p.verity.as_ref().map(|v| v.root_hash.clone()),
    }
}

/// The partitions `create`'s options name.
fn partition_specs(a: &CreateArgs) -> Result<Vec<ota::create::PartitionSpec>> {
    use ota::create::{Base, PartitionSpec};
    let mut parts = Vec::new();
    for s in &a.partitions {
        let (name, rest) = split_name(s, "--partition")?;
        let Some((old, new)) = rest.split_once(',') else {
            bail!("--partition {s:?}: expected NAME=OLD,NEW");
        };
        parts.push(PartitionSpec {
            name,
            base: Base::Image(PathBuf::from(old)),
            new: PathBuf::from(new),
        });
    }
    for s in &a.full {
        let (name, new) = split_name(s, "--full")?;
        parts.push(PartitionSpec {
            name,
            base: Base::Full(None),
            new: PathBuf::from(new),
        });
    }
    let mut sized = Vec::new();
    for s in &a.partition_sizes {
        let (name, size) = split_name(s, "--partition-size")?;
        let size = crate::args::parse_size(&size)
            .map_err(|e| anyhow::anyhow!("--partition-size {s:?}: {e}"))?;
        let Some(part) = parts.iter_mut().find(|p| p.name == name) else {
            bail!("--partition-size {name}: no --full partition of that name");
        };
        match &mut part.base {
            Base::Full(s) => *s = Some(size),
            Base::Image(old) => bail!(
                "--partition-size {name}: a delta's partition is its OLD ({}), whole; \
                 --partition-size is for --full partitions",
                old.display()
            ),
        }
        if sized.contains(&name) {
            bail!("--partition-size {name}: given twice");
        }
        sized.push(name);
    }
    Ok(parts)
}

fn create(a: CreateArgs) -> Result<ExitCode> {
    let t0 = std::time::Instant::now();
    let key = a.key.as_deref().map(SecretKey::load).transpose()?;
    let compression: Compression = a
        .cow_compression
        .parse()
        .with_context(|| format!("--cow-compression {}", a.cow_compression))?;
    let factor = u32::try_from(a.cow_compression_factor).unwrap_or(u32::MAX);
    let parts = partition_specs(&a)?;
    let opts = ota::create::CreateOptions {
        cow: CowOptions {
            version: a.cow_version,
            compression,
            compression_factor: factor,
            threads: a.threads,
            block_order: a.block_order,
        },
        xor: !a.no_xor,
        min_xor_run: a.min_xor_run,
        level: a.level,
        threads: a.threads,
        verity: a.verity.then(|| a.verity_salt.clone()),
        release: release_of(&a)?,
    };
    let manifest = ota::create::create(&a.output, key.as_ref(), &parts, &opts, &Bar::new())?;
    ota::output::keep_outputs();
    let size = std::fs::metadata(&a.output)
        .with_context(|| format!("stat {}", a.output.display()))?
        .len();
    let report = CreateReport {
        output: a.output.clone(),
        size,
        signed: key.is_some(),
        signer: manifest.signer.clone(),
        partitions: manifest.partitions.iter().map(part_report).collect(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    if a.json {
        report::print(&report)?;
    } else {
        println!(
            "{}: {size} bytes, {} partition(s), {} in {:.1} s",
            a.output.display(),
            manifest.partitions.len(),
            match &manifest.signer {
                Some(id) => format!("signed by key {id}"),
                None => "unsigned".into(),
            },
            report.seconds
        );
        for p in &report.partitions {
            println!(
                "  {}: {} -> {} bytes, payload {} bytes (plan {}, data {} decoded in frames of {} blocks), device COW {} bytes, {} ops",
                p.name,
                p.base_size,
                p.new_size,
                p.payload_bytes,
                p.plan_bytes,
                p.data_bytes,
                p.frame_blocks,
                p.cow_size,
                p.ops
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn info(a: InfoArgs) -> Result<ExitCode> {
    let key = a.key.as_deref().map(PublicKey::load).transpose()?;
    let r = BundleReader::open(
        ota::install::open_bundle(&a.bundle)?,
        &a.bundle,
        trust(&key),
    )?;
    let m = r.manifest();
    if a.json {
        report::print(InfoReport {
            bundle: &a.bundle,
            format_version: bundle::FORMAT_VERSION,
            signed: r.is_signed(),
            signature_checked: key.is_some(),
            payload_bytes: m.payload_bytes(),
            manifest: m,
        })?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: vabc bundle version {}, made by {}, {} ({})",
        a.bundle.display(),
        bundle::FORMAT_VERSION,
        m.created_by,
        match (&m.signer, r.is_signed()) {
            (Some(id), true) => format!("signed by key {id}"),
            _ => "unsigned".into(),
        },
        match &key {
            Some(k) => format!("the signature verifies with key {}", k.id()),
            None => "signature not checked; --key PUB.pem checks it".into(),
        }
    );
    for p in &m.partitions {
        let base = if p.full {
            format!("full image for a {}-byte partition", p.partition_bytes())
        } else {
            format!(
                "base {} bytes (sha256 {})",
                p.image.base.size, p.image.base.sha256
            )
        };
        println!(
            "  {}: {base}, new {} bytes (sha256 {})",
            p.name, p.image.new.size, p.image.new.sha256
        );
        println!(
            "    payload {} bytes; blocks: {} unchanged, {} copy, {} xor, {} zero, {} replace",
            p.payload.length,
            p.plan.unchanged,
            p.plan.copy,
            p.plan.xor,
            p.plan.zero,
            p.plan.replace
        );
        println!(
            "    device COW: v{}, {}, {} KiB units, {} bytes, {} ops",
            p.cow.version,
            p.cow.compression,
            p.cow.compression_factor >> 10,
            p.cow.size,
            p.image.cow_ops
        );
        if let Some(v) = &p.verity {
            println!(
                "    dm-verity: root hash {} ({}, {} data blocks of {}, salt {})",
                v.root_hash,
                v.hash_algorithm,
                v.data_blocks,
                v.data_block_size,
                if v.salt.is_empty() { "-" } else { &v.salt }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(a: VerifyArgs) -> Result<ExitCode> {
    let key = a.key.load()?;
    let mut r = BundleReader::open(
        ota::install::open_bundle(&a.bundle)?,
        &a.bundle,
        trust(&key),
    )?;
    let mut n = 0;
    while let Some((_, stream)) = r.payload() {
        stream.finish()?;
        n += 1;
    }
    let signer = r.manifest().signer.clone();
    if a.json {
        report::print(VerifyReport {
            bundle: &a.bundle,
            signature: if key.is_some() {
                "verified"
            } else {
                "not checked"
            },
            signer,
            partitions: n,
            payload_bytes: r.manifest().payload_bytes(),
        })?;
    } else {
        println!(
            "{}: {} ({n} partition payloads hash as the manifest says)",
            a.bundle.display(),
            match &key {
                Some(k) => format!("signature verified with key {}", k.id()),
                None => "signature NOT checked (--allow-unsigned)".into(),
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct PlanPart {
    name: String,
    /// Whether the base is the one the bundle was made for.
    base_ok: bool,
    /// The first difference when it is not.
    base_mismatch: Option<String>,
    download_bytes: u64,
    cow_bytes: u64,
    /// The dm-verity hash file install writes beside the COW (0 without --verity).
    verity_bytes: u64,
    /// Bytes the merge writes into the base (every changed block) and reads (COPY and
    /// XOR sources, and the COW).
    merge_write_bytes: u64,
    merge_read_bytes: u64,
}

fn plan(a: PlanArgs) -> Result<ExitCode> {
    let key = a.key.load()?;
    let r = BundleReader::open(
        ota::install::open_bundle(&a.bundle)?,
        &a.bundle,
        trust(&key),
    )?;
    let m = r.manifest();
    let bases = ota::install::match_bases(&named_bases(&a.bases)?, m)?;
    let t = std::time::Instant::now();
    let mut read = 0u64;
    let mut parts = Vec::new();
    for (p, base) in m.partitions.iter().zip(&bases) {
        let (size, reader) = ota::install::base_reader(base)?;
        let found = p
            .image
            .base
            .first_mismatch(&reader, base, size, |_| true)
            .with_context(|| format!("check the base {}", base.display()))?;
        read += size.min(p.image.base.size);
        let bs = cow::BLOCK_SIZE as u64;
        let c = &p.plan;
        parts.push(PlanPart {
            name: p.name.clone(),
            base_ok: found.is_none(),
            base_mismatch: found.map(|m| m.to_string()),
            download_bytes: p.payload.length,
            cow_bytes: p.cow.size,
            verity_bytes: ota::trees::hashfile_bytes(p.verity.as_ref()),
            merge_write_bytes: (c.copy + c.xor + c.zero + c.replace) * bs,
            merge_read_bytes: (c.copy + c.xor) * bs + p.cow.size,
        });
    }
    let measured = read as f64 / t.elapsed().as_secs_f64().max(1e-6) / 1e6;
    let speed = a.speed.unwrap_or(measured);
    let sum = |f: fn(&PlanPart) -> u64| parts.iter().map(f).sum::<u64>();
    let download = sum(|p| p.download_bytes) + r.payload_start();
    let cow = sum(|p| p.cow_bytes);
    let trees = sum(|p| p.verity_bytes);
    let merge_io = sum(|p| p.merge_write_bytes + p.merge_read_bytes);
    // Install: read every base once (the check), write the COWs; merge: its reads and
    // writes (flushes and seeks not counted: a lower bound).
    let install_s = (read + cow + trees) as f64 / 1e6 / speed;
    let merge_s = merge_io as f64 / 1e6 / speed;
    let all_ok = parts.iter().all(|p| p.base_ok);
    if a.json {
        report::print(PlanReport {
            bundle: &a.bundle,
            bases_ok: all_ok,
            download_bytes: download,
            cow_bytes: cow,
            verity_bytes: trees,
            merge_io_bytes: merge_io,
            speed_mb_s: speed,
            speed_measured: a.speed.is_none(),
            install_seconds: install_s,
            merge_seconds: merge_s,
            partitions: &parts,
        })?;
    } else {
        for p in &parts {
            println!(
                "{}: base {}; download {} bytes, COW {} bytes, merge writes {} and reads {} bytes",
                p.name,
                match &p.base_mismatch {
                    None => "ok".to_string(),
                    Some(m) => format!("WRONG ({m})"),
                },
                p.download_bytes,
                p.cow_bytes,
                p.merge_write_bytes,
                p.merge_read_bytes
            );
        }
        println!(
            "total: download {download} bytes, COW space {} bytes; at {speed:.0} MB/s ({}): \
             install ~{install_s:.1} s, merge ~{merge_s:.1} s (lower bounds)",
            cow + trees,
            if a.speed.is_none() {
                "measured reading the bases"
            } else {
                "stated"
            }
        );
    }
    if !all_ok {
        mismatch!("a base is not the one the bundle was made for (see above)");
    }
    Ok(ExitCode::SUCCESS)
}

fn install(a: InstallArgs) -> Result<Vec<ota::install::Installed>> {
    let key = a.key.load()?;
    // The output folder is made if it is missing (its parent must exist), and removed
    // again if the install is interrupted or fails before it holds anything.
    if !a.out_dir.exists() {
        ota::output::part_of_output(&a.out_dir, || {
            std::fs::create_dir(&a.out_dir)
                .with_context(|| format!("--out-dir {}: cannot create it", a.out_dir.display()))
        })?;
    }
    let bases = named_bases(&a.bases)?;
    let done = ota::install::install(&a.request(&bases, &key), &mut |_, _, _| Ok(()), &Bar::new())?;
    ota::output::keep_outputs();
    if a.json {
        report::print(InstallReport {
            bundle: &a.bundle,
            out_dir: &a.out_dir,
            partitions: &done,
        })?;
    } else {
        for d in &done {
            println!(
                "{}: {} ({} bytes){}{}{}",
                d.name,
                d.cow.display(),
                d.cow_size,
                match (&d.verity, &d.root_hash) {
                    (Some(t), Some(r)) =>
                        format!(", dm-verity tree {}, root hash {r}", t.display()),
                    _ => String::new(),
                },
                if d.written { "" } else { ", already installed" },
                if d.resumed_bytes > 0 {
                    format!(
                        ", {} payload bytes saved by an earlier download",
                        d.resumed_bytes
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    Ok(done)
}

/// `--base NAME=PATH` options as name and path.
pub(crate) fn named_bases(specs: &[String]) -> Result<Vec<(String, PathBuf)>> {
    specs
        .iter()
        .map(|s| split_name(s, "--base").map(|(n, p)| (n, PathBuf::from(p))))
        .collect()
}

fn apply(a: InstallArgs) -> Result<ExitCode> {
    let key = a.key.load()?;
    let bases = named_bases(&a.bases)?;
    let outputs = ota::install::apply(&a.request(&bases, &key), &Bar::new())?;
    ota::output::keep_outputs();
    if a.json {
        report::print(ApplyReport {
            bundle: &a.bundle,
            partitions: &outputs,
        })?;
    } else {
        for o in &outputs {
            println!(
                "{}: {} ({} bytes, sha256 {}){}",
                o.name,
                o.image.display(),
                o.size,
                o.sha256,
                match (&o.verity, &o.root_hash) {
                    (Some(t), Some(r)) =>
                        format!(", dm-verity tree {}, root hash {r}", t.display()),
                    _ => String::new(),
                }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `vabc bundle apply --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct ApplyReport<'a> {
    bundle: &'a Path,
    partitions: &'a [ota::install::Applied],
}

/// `vabc bundle install --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct InstallReport<'a> {
    bundle: &'a Path,
    out_dir: &'a Path,
    partitions: &'a [ota::install::Installed],
}

/// `vabc bundle verify --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct VerifyReport<'a> {
    bundle: &'a Path,
    /// "verified", or "not checked" (--allow-unsigned).
    signature: &'static str,
    signer: Option<String>,
    partitions: usize,
    payload_bytes: u64,
}

/// `vabc bundle plan --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct PlanReport<'a> {
    bundle: &'a Path,
    bases_ok: bool,
    download_bytes: u64,
    cow_bytes: u64,
    verity_bytes: u64,
    merge_io_bytes: u64,
    speed_mb_s: f64,
    speed_measured: bool,
    install_seconds: f64,
    merge_seconds: f64,
    partitions: &'a [PlanPart],
}

/// `vabc bundle info --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct InfoReport<'a> {
    bundle: &'a Path,
    format_version: u32,
    signed: bool,
    /// Whether --key checked the signature (a failed check is an error).
    signature_checked: bool,
    payload_bytes: u64,
    manifest: &'a BundleManifest,
}
