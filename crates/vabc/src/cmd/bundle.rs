//! `vabc bundle`: the update as one signed file for shipping (`create`, `info`,
//! `verify`), turned into device-form COWs on the device (`install`) or into the new
//! images (`apply`). The format is in the `bundle` crate and docs/08-bundle.md.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use bundle::format::Trust;
use bundle::sign::{PublicKey, SecretKey};
use bundle::{
    BundleManifest, BundleReader, BundleWriter, CowParams, Partition, PayloadInfo, VerityInfo,
};
use cow::Compression;
use delta::write::{CowOptions, write_cow};
use delta::{BlockImage, ImageFile, PlanOptions};
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::diff::Bar;
use crate::checks::mismatch;

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
    /// (bench/RESULTS.md). By default frames of 64 blocks with a short optimal-parse
    /// search, or one frame at level 19 for an update of at most 1024 changed blocks
    /// that compresses much better so (docs/08-bundle.md).
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

fn sha256_file(path: &Path) -> Result<(u64, String)> {
    let mut f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let got = f
            .read(&mut buf)
            .with_context(|| format!("read {} at offset {n}", path.display()))?;
        if got == 0 {
            return Ok((n, hex::encode(h.finalize())));
        }
        h.update(&buf[..got]);
        n += got as u64;
    }
}

#[derive(Serialize)]
struct CreateReport {
    schema_version: u32,
    output: PathBuf,
    size: u64,
    signed: bool,
    signer: Option<String>,
    partitions: Vec<PartReport>,
    seconds: f64,
}

#[derive(Serialize)]
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

fn create(a: CreateArgs) -> Result<ExitCode> {
    let t0 = std::time::Instant::now();
    let key = a.key.as_deref().map(SecretKey::load).transpose()?;
    let compression: Compression = a
        .cow_compression
        .parse()
        .with_context(|| format!("--cow-compression {}", a.cow_compression))?;
    let factor = u32::try_from(a.cow_compression_factor)
        .ok()
        .filter(|f| f.is_power_of_two() && (4096..=256 << 10).contains(f))
        .with_context(|| {
            format!(
                "--cow-compression-factor {}: a power of two from 4k to 256k",
                a.cow_compression_factor
            )
        })?;
    if !(2..=3).contains(&a.cow_version) {
        bail!("--cow-version {}: 2 or 3", a.cow_version);
    }
    let mut parts: Vec<(String, Option<PathBuf>, PathBuf)> = Vec::new();
    let mut add = |name: String, old: Option<PathBuf>, new: PathBuf| {
        if parts.iter().any(|(n, _, _)| *n == name) {
            bail!("partition {name}: named twice");
        }
        parts.push((name, old, new));
        Ok(())
    };
    for s in &a.partitions {
        let (name, rest) = split_name(s, "--partition")?;
        let Some((old, new)) = rest.split_once(',') else {
            bail!("--partition {s:?}: expected NAME=OLD,NEW");
        };
        add(name, Some(PathBuf::from(old)), PathBuf::from(new))?;
    }
    for s in &a.full {
        let (name, new) = split_name(s, "--full")?;
        add(name, None, PathBuf::from(new))?;
    }
    let mut sizes = std::collections::BTreeMap::new();
    for s in &a.partition_sizes {
        let (name, size) = split_name(s, "--partition-size")?;
        let size = crate::args::parse_size(&size)
            .map_err(|e| anyhow::anyhow!("--partition-size {s:?}: {e}"))?;
        match parts.iter().find(|(n, _, _)| *n == name) {
            Some((_, None, _)) => {}
            Some((_, Some(old), _)) => bail!(
                "--partition-size {name}: a delta's partition is its OLD ({}), whole; \
                 --partition-size is for --full partitions",
                old.display()
            ),
            None => bail!("--partition-size {name}: no --full partition of that name"),
        }
        if sizes.insert(name.clone(), size).is_some() {
            bail!("--partition-size {name}: given twice");
        }
    }
    let release = release_of(&a)?;
    crate::output::check_dest(&a.output, "-o")?;
    // Every temporary file goes into one work folder beside the output, which an
    // interrupt or `vabc cleanup` removes whole.
    let work = crate::output::temp_dir_beside(&a.output, "bundle")?;
    let mut writer = BundleWriter::new_in(&a.output, work.path())?;
    writer.set_release(release);
    let copts = CowOptions {
        version: a.cow_version,
        compression,
        compression_factor: factor,
        threads: a.threads,
        block_order: a.block_order,
    };
    for (name, old_path, new_path) in &parts {
        let old = match old_path {
            Some(old) => Base::Image(old),
            None => Base::None(sizes.get(name).copied()),
        };
        let part = create_partition(&a, &mut writer, work.path(), name, old, new_path, &copts)
            .with_context(|| format!("partition {name}"))?;
        writer.add_partition(part)?;
    }
    let created_by = format!("vabc {}", env!("CARGO_PKG_VERSION"));
    let manifest = crate::output::part_of_output(&a.output, || {
        let m = writer.finish(key.as_ref(), &created_by)?;
        crate::output::set_default_mode(&a.output)?;
        Ok(m)
    })?;
    crate::output::keep_outputs();
    let size = std::fs::metadata(&a.output)
        .with_context(|| format!("stat {}", a.output.display()))?
        .len();
    let report = CreateReport {
        schema_version: crate::SCHEMA_VERSION,
        output: a.output.clone(),
        size,
        signed: key.is_some(),
        signer: manifest.signer.clone(),
        partitions: manifest.partitions.iter().map(part_report).collect(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
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

/// What a partition's update is made against.
enum Base<'a> {
    /// A delta from this old image, which is the whole partition.
    Image(&'a Path),
    /// A full image, for a partition of this size (default: the new image's).
    None(Option<u64>),
}

fn create_partition(
    a: &CreateArgs,
    writer: &mut BundleWriter,
    work: &Path,
    name: &str,
    base: Base,
    new_path: &Path,
    copts: &CowOptions,
) -> Result<Partition> {
    let new = ImageFile::open(new_path, false)?;
    // A full image is planned against an empty base: every block is then ZERO or
    // REPLACE, and nothing is read from the device's partition.
    let (old_path, full_size) = match base {
        Base::Image(p) => (p.to_path_buf(), None),
        Base::None(size) => {
            let empty = work.join(format!("{name}.no-base"));
            std::fs::File::create(&empty).with_context(|| format!("create {}", empty.display()))?;
            let size = size.unwrap_or(new.size());
            if size < new.size() || size % 4096 != 0 {
                bail!(
                    "--partition-size {name}={size}: a multiple of 4096 of at least NEW's {} bytes",
                    new.size()
                );
            }
            (empty, Some(size))
        }
    };
    let old_path = old_path.as_path();
    let old = ImageFile::open(old_path, false)?;
    if full_size.is_none() {
        if old.size() == 0 {
            bail!(
                "{}: OLD is empty; an update without a base is a full image: --full {name}=NEW",
                old_path.display()
            );
        }
        if new.size() > old.size() {
            bail!(
                "{}: NEW is {} bytes, larger than OLD {} ({} bytes), which the bundle takes as \
                 the whole partition (the device's base must be exactly as large); give OLD as \
                 the partition it will be, padded to its size (`truncate -s SIZE` on a copy)",
                new_path.display(),
                new.size(),
                old_path.display(),
                old.size()
            );
        }
    }
    let bar = Bar::new();
    let popts = PlanOptions {
        xor: !a.no_xor,
        threads: a.threads,
        min_xor_run: a.min_xor_run,
        ..PlanOptions::for_codec(copts.compression.codec)
    };
    let plan = delta::plan(&old, &new, &popts, &bar)?;
    let plan_bytes = bundle::plan_wire::encode(&plan, a.level.unwrap_or(19))
        .with_context(|| format!("encode the plan of {name}"))?;
    let out = writer.payload_file();
    out.write_all(&(plan_bytes.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&plan_bytes))
        .context("write the bundle's payload")?;
    let threads = match a.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // The COW the device will write, written here first: its hash goes into the
    // manifest, and its ops give the per-op hashes.
    let cow_path = work.join(format!("{name}.cow"));
    let frames = bundle::data::FrameParams::choose(a.level, &plan, &old, &new)?;
    let sopts = bundle::data::StreamOptions {
        frames,
        threads,
        merge_ordered: copts.version >= 3 && !copts.block_order,
    };
    let (_, data_bytes) = bundle::data::record(&new, &old, &plan, out, &a.output, sopts, |rec| {
        write_cow(&plan, &old, rec, &cow_path, copts, &bar)
    })?;
    let (cow_size, cow_sha) = sha256_file(&cow_path)?;
    let id = |img: &ImageFile, path: &Path, size: u64, region_size: u64| {
        let read = |off: u64, buf: &mut [u8]| {
            BlockImage::read_exact_at(img, buf, off).map_err(std::io::Error::other)
        };
        manifest::ImageId::compute_in(&read, path, size, region_size)
    };
    let written = cow::CowReader::open(&cow_path)?;
    // The per-op hashes (16 hex digits per op: 2 MB on the `system` pair) are not
    // shipped: the device computes them from the COW it wrote, whose sha256 the
    // manifest fixes.
    let mut image = manifest::Manifest {
        schema_version: manifest::SCHEMA_VERSION,
        base: id(
            &old,
            old_path,
            plan.old_size,
            bundle_region_size(plan.old_size),
        )?,
        new: id(&new, new_path, plan.new_size, manifest::REGION_SIZE)?,
        cow_ops: written.ops().len() as u64,
        merged_op_hashes: None,
    };
    // Nor the new image's region hashes (32 bytes of entropy per 4 MiB): the device
    // reads the new image through its COW once installed, computes them and checks the
    // whole image's sha256, which stays. The base's are coarse (bundle_region_size).
    image.new.regions.clear();
    let verity = if a.verity {
        let tree = work.join(format!("{name}.verity"));
        let f = super::verity::format_default(new_path, &tree, a.verity_salt.as_deref())
            .with_context(|| format!("verity tree of {}", new_path.display()))?;
        std::fs::remove_file(&tree).with_context(|| format!("remove {}", tree.display()))?;
        Some(VerityInfo {
            format: f.params.format.as_u32(),
            hash_algorithm: f.params.algorithm.name().to_string(),
            data_block_size: f.params.data_block_size,
            hash_block_size: f.params.hash_block_size,
            data_blocks: f.params.data_blocks,
            salt: hex::encode(&f.params.salt),
            uuid: verity::format_uuid(&f.uuid),
            root_hash: hex::encode(&f.root),
        })
    } else {
        None
    };
    let c = plan.census;
    Ok(Partition {
        // OLD is the whole partition: the device's base must be as large, so that
        // the base identity covers every byte of it.
        partition_size: full_size.unwrap_or(image.base.size),
        full: full_size.is_some(),
        name: name.to_string(),
        image,
        cow: CowParams {
            version: copts.version,
            compression: copts.compression.to_string(),
            compression_factor: copts.compression_factor,
            block_order: copts.block_order,
            size: cow_size,
            sha256: cow_sha,
        },
        plan: bundle::PlanCounts {
            unchanged: c.unchanged,
            copy: c.copy,
            xor: c.xor,
            zero: c.zero,
            replace: c.replace,
        },
        payload: PayloadInfo::unplaced(8 + plan_bytes.len() as u64, data_bytes, frames.blocks),
        verity,
    })
}

/// Region size of a base's identity in a bundle: at most 16 regions (and at least
/// 4 MiB each), enough to say which part of a wrong base is wrong; the device computes
/// the 4 MiB regions of its manifest sidecar once the whole base matched.
fn bundle_region_size(size: u64) -> u64 {
    (size.div_ceil(16))
        .next_power_of_two()
        .max(manifest::REGION_SIZE)
}

/// The bundle named on the command line, as a stream: a file, `-` for stdin, or an
/// `http://` / `https://` URL (fetched with range requests that resume a cut
/// connection).
fn open_input(path: &Path) -> Result<Box<dyn bundle::Source>> {
    if path == Path::new("-") {
        return Ok(Box::new(std::io::stdin()));
    }
    if is_url(path) {
        let text = path.to_string_lossy();
        // Smaller than a file's buffer: a payload passed over is not fetched.
        return Ok(Box::new(std::io::BufReader::with_capacity(
            256 << 10,
            bundle::http::RangeReader::new(&text),
        )));
    }
    let f = File::open(path).with_context(|| format!("cannot open bundle {}", path.display()))?;
    Ok(Box::new(std::io::BufReader::with_capacity(1 << 20, f)))
}

fn info(a: InfoArgs) -> Result<ExitCode> {
    let key = a.key.as_deref().map(PublicKey::load).transpose()?;
    let r = BundleReader::open(open_input(&a.bundle)?, &a.bundle, trust(&key))?;
    let m = r.manifest();
    if a.json {
        #[derive(Serialize)]
        struct Info<'a> {
            schema_version: u32,
            bundle: &'a Path,
            format_version: u32,
            signed: bool,
            /// Whether --key checked the signature (a failed check is an error).
            signature_checked: bool,
            payload_bytes: u64,
            manifest: &'a BundleManifest,
        }
        let out = Info {
            schema_version: crate::SCHEMA_VERSION,
            bundle: &a.bundle,
            format_version: bundle::FORMAT_VERSION,
            signed: r.is_signed(),
            signature_checked: key.is_some(),
            payload_bytes: m.payload_bytes(),
            manifest: m,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
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
    let mut r = BundleReader::open(open_input(&a.bundle)?, &a.bundle, trust(&key))?;
    let mut n = 0;
    while let Some((_, stream)) = r.payload() {
        stream.finish()?;
        n += 1;
    }
    let signer = r.manifest().signer.clone();
    if a.json {
        let out = serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "bundle": a.bundle,
            "signature": if key.is_some() { "verified" } else { "not checked" },
            "signer": signer,
            "partitions": n,
            "payload_bytes": r.manifest().payload_bytes(),
        });
        println!("{out:#}");
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

#[derive(Serialize)]
struct PlanPart {
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
    let r = BundleReader::open(open_input(&a.bundle)?, &a.bundle, trust(&key))?;
    let m = r.manifest();
    let bases = bases(&a.bases, m)?;
    let t = std::time::Instant::now();
    let mut read = 0u64;
    let mut parts = Vec::new();
    for (p, base) in m.partitions.iter().zip(&bases) {
        let (size, reader) = base_reader(base)?;
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
            verity_bytes: hashfile_bytes(p),
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
        let out = serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "bundle": a.bundle,
            "bases_ok": all_ok,
            "download_bytes": download,
            "cow_bytes": cow,
            "verity_bytes": trees,
            "merge_io_bytes": merge_io,
            "speed_mb_s": speed,
            "speed_measured": a.speed.is_none(),
            "install_seconds": install_s,
            "merge_seconds": merge_s,
            "partitions": parts,
        });
        println!("{out:#}");
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

/// What install did per partition.
#[derive(Serialize)]
pub(crate) struct Installed {
    pub name: String,
    pub base: PathBuf,
    pub cow: PathBuf,
    pub manifest: PathBuf,
    pub cow_size: u64,
    /// The dm-verity hash file of the new image (bundles made with --verity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verity: Option<PathBuf>,
    /// Its root hash, hex (the signed manifest's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_hash: Option<String>,
    /// False when an earlier, interrupted install had already finished it.
    pub written: bool,
    /// Payload bytes an earlier, interrupted download had saved (not fetched again).
    pub resumed_bytes: u64,
}

/// Each partition's base, by name; every partition must have one.
fn bases(specs: &[String], m: &BundleManifest) -> Result<Vec<PathBuf>> {
    let mut named = Vec::new();
    for s in specs {
        let (name, path) = split_name(s, "--base")?;
        if m.partition(&name).is_none() {
            bail!(
                "--base {name}: the bundle has no partition {name:?} (it has {})",
                m.partitions
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        named.push((name, PathBuf::from(path)));
    }
    m.partitions
        .iter()
        .map(|p| {
            named
                .iter()
                .find(|(n, _)| *n == p.name)
                .map(|(_, path)| path.clone())
                .with_context(|| format!("no --base {}=PATH for the bundle's partition", p.name))
        })
        .collect()
}

fn install(a: InstallArgs) -> Result<Vec<Installed>> {
    let key = a.key.load()?;
    // The output folder is made if it is missing (its parent must exist), and removed
    // again if the install is interrupted or fails before it holds anything.
    if !a.out_dir.exists() {
        crate::output::part_of_output(&a.out_dir, || {
            std::fs::create_dir(&a.out_dir)
                .with_context(|| format!("--out-dir {}: cannot create it", a.out_dir.display()))
        })?;
    }
    let done = install_into(
        &a.bundle,
        &a.bases,
        &a.out_dir,
        trust(&key),
        a.threads,
        &mut |_, _, _| Ok(()),
    )?;
    crate::output::keep_outputs();
    if a.json {
        let out = serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "bundle": a.bundle,
            "out_dir": a.out_dir,
            "partitions": done,
        });
        println!("{out:#}");
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

/// What `install_into` calls once everything is checked: the manifest, the bundle's
/// signed head, each partition's base.
pub(crate) type OnChecked<'a> = dyn FnMut(&BundleManifest, &[u8], &[PathBuf]) -> Result<()> + 'a;

/// Installs the bundle at `bundle_path` into `out_dir` (see `install`); `on_checked`
/// runs once the signature, every base and the free space are checked, before
/// anything is written (an error there writes nothing), with the manifest and the
/// bundle's signed head.
pub(crate) fn install_into(
    bundle_path: &Path,
    base_specs: &[String],
    out_dir: &Path,
    trust: Trust<'_>,
    threads: usize,
    on_checked: &mut OnChecked<'_>,
) -> Result<Vec<Installed>> {
    let mut r = BundleReader::open(open_input(bundle_path)?, bundle_path, trust)?;
    // A bundle file too short for its payloads is refused before anything is
    // written (a stream finds out as it reads, and leaves only temporary files).
    if let Ok(md) = std::fs::metadata(bundle_path)
        && md.is_file()
    {
        let need = r.payload_start() + r.manifest().payload_bytes();
        if md.len() < need {
            bail!(
                "{}: truncated: {} bytes, its manifest needs {need}; nothing was written",
                bundle_path.display(),
                md.len()
            );
        }
        // Nothing unsigned rides along: every byte of a bundle is the signed head or
        // a payload its manifest hashes.
        if md.len() > need {
            bail!(
                "{}: offset {need}: {} bytes after the last payload, which no signature \
                 covers: not a bundle as vabc writes it; nothing was written",
                bundle_path.display(),
                md.len() - need
            );
        }
    }
    let bases = bases(base_specs, r.manifest())?;
    if !out_dir.is_dir() {
        bail!("--out-dir {}: not a directory", out_dir.display());
    }
    let _lock = lock_dir(out_dir)?;
    // Every base before the first byte is written: a wrong one names its first wrong
    // region, and nothing is written.
    let base_ids = r
        .manifest()
        .partitions
        .iter()
        .zip(&bases)
        .map(|(p, base)| check_base(p, base))
        .collect::<Result<Vec<_>>>()?;
    let spooling = is_url(bundle_path);
    check_space(r.manifest(), out_dir, spooling)?;
    on_checked(r.manifest(), r.head(), &bases)?;
    let mut done = Vec::new();
    let mut i = 0;
    while let Some((part, mut stream)) = r.payload() {
        let (base, base_id) = (&bases[i], &base_ids[i]);
        i += 1;
        let cow_path = out_dir.join(format!("{}.cow", part.name));
        let manifest_path = manifest::Manifest::path_for(&cow_path);
        let spool = spooling.then(|| spool_path(out_dir, &part));
        remove_stale(out_dir, &part.name, spool.as_deref())?;
        // An earlier run that was interrupted after this partition: keep its COW.
        if sha256_file(&cow_path).ok() == Some((part.cow.size, part.cow.sha256.clone())) {
            stream.skip()?;
            if let Some(sp) = &spool {
                remove_if_there(sp)?;
            }
            let sidecar = device_manifest(&part, &cow_path, base, base_id)?;
            let verity = match &part.verity {
                Some(v) if !has_hashfile(v, &out_dir.join(format!("{}.verity", part.name))) => {
                    Some(install_verity(&part, v, &cow_path, base, out_dir)?)
                }
                Some(_) => Some(out_dir.join(format!("{}.verity", part.name))),
                None => None,
            };
            crate::output::write_atomic(&manifest_path, sidecar.to_json().as_bytes())?;
            // A run killed right after the rename may not have given it its mode.
            crate::output::set_default_mode(&cow_path)?;
            done.push(Installed {
                name: part.name.clone(),
                base: base.clone(),
                cow: cow_path,
                manifest: manifest_path,
                cow_size: part.cow.size,
                verity,
                root_hash: part.verity.as_ref().map(|v| v.root_hash.clone()),
                written: false,
                resumed_bytes: 0,
            });
            continue;
        }
        let resumed_bytes = match &spool {
            Some(sp) => stream.spool(sp)?,
            None => 0,
        };
        if resumed_bytes > 0 {
            log::info!(
                "partition {}: {resumed_bytes} of its {} payload bytes were saved by an \
                 earlier install; downloading the rest",
                part.name,
                part.payload.length
            );
        }
        // Saved bytes that turn out wrong (the plan or a frame does not decode, or the
        // payload does not hash to the signed sha256) while the source answered are
        // dropped, so that the next run downloads them afresh instead of failing on
        // them again. A network failure, a local one (no space, an unreadable base) and
        // anything after the payload's hash matched keep them for the next run.
        let health = stream.source_health();
        let drop_saved = |e: anyhow::Error| {
            if let Some(sp) = &spool
                && !health.failed()
                && sp.exists()
            {
                log::warn!(
                    "partition {}: the payload read did not decode or hash; its saved \
                     download {} is dropped, the next install fetches it again",
                    part.name,
                    sp.display()
                );
                let _ = std::fs::remove_file(sp);
            }
            e
        };
        // Errors of the payload's bytes, as against the writer's or the base's.
        let bytes_wrong = |e: &anyhow::Error| {
            e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<bundle::BundleError>(),
                    Some(bundle::BundleError::PayloadHash { .. })
                ) || c
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData)
            })
        };
        let plan = read_plan(&mut stream, &part, bundle_path).map_err(drop_saved)?;
        let old = ImageFile::open(base, false)?;
        let copts = CowOptions {
            version: part.cow.version,
            compression: part.cow.compression.parse().with_context(|| {
                format!("partition {}: codec {:?}", part.name, part.cow.compression)
            })?,
            compression_factor: part.cow.compression_factor,
            threads,
            block_order: part.cow.block_order,
        };
        // Written under a temporary name and renamed only once its hash and the
        // payload's are right.
        let tmp_cow = out_dir.join(format!(".{}.cow.installing", part.name));
        crate::output::pending(&tmp_cow);
        let pos = stream.position();
        let replayer = bundle::data::Replayer::new(
            &old,
            &plan,
            copts.version >= 3 && !copts.block_order,
            part.payload.frame_blocks,
            &mut stream,
            pos,
            bundle_path,
            part.image.new.size,
        )
        .context("start the data stream")
        .map_err(|e| if bytes_wrong(&e) { drop_saved(e) } else { e })?;
        let written = write_cow(&plan, &old, &replayer, &tmp_cow, &copts, &Bar::new());
        let rest = replayer.finish().map(drop);
        let payload = written
            .map_err(anyhow::Error::from)
            .and_then(|_| rest.map_err(|m| anyhow::anyhow!("{}: {m}", bundle_path.display())))
            .and_then(|_| stream.finish().map_err(anyhow::Error::from))
            .map_err(|e| if bytes_wrong(&e) { drop_saved(e) } else { e });
        let result = payload
            .and_then(|()| sha256_file(&tmp_cow))
            .and_then(|got| {
                if got != (part.cow.size, part.cow.sha256.clone()) {
                    bail!(
                        "partition {}: the COW written from the bundle is {} bytes with sha256 {}, \
                         the manifest says {} bytes with sha256 {} (a vabc of another version?)",
                        part.name,
                        got.0,
                        got.1,
                        part.cow.size,
                        part.cow.sha256
                    );
                }
                Ok(())
            });
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp_cow);
            let from_saved = match &spool {
                Some(sp) if resumed_bytes > 0 => format!(
                    "; its first {resumed_bytes} payload bytes were read back from {}",
                    sp.display()
                ),
                _ => String::new(),
            };
            return Err(e.context(format!(
                "install partition {} (nothing kept{from_saved})",
                part.name
            )));
        }
        // The hash file before the COW's rename: a kept COW always has its tree.
        let proved = device_manifest(&part, &tmp_cow, base, base_id).and_then(|m| {
            let tree = part
                .verity
                .as_ref()
                .map(|v| install_verity(&part, v, &tmp_cow, base, out_dir))
                .transpose()?;
            Ok((m, tree))
        });
        let (sidecar, verity) = match proved {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp_cow);
                return Err(e.context(format!("install partition {} (nothing kept)", part.name)));
            }
        };
        crate::output::write_atomic(&manifest_path, sidecar.to_json().as_bytes())?;
        std::fs::rename(&tmp_cow, &cow_path)
            .with_context(|| format!("rename {} to {}", tmp_cow.display(), cow_path.display()))?;
        crate::output::set_default_mode(&cow_path)?;
        if let Some(sp) = &spool {
            remove_if_there(sp)?;
        }
        if let Ok(d) = File::open(out_dir) {
            let _ = d.sync_all();
        }
        done.push(Installed {
            name: part.name.clone(),
            base: base.clone(),
            cow: cow_path,
            manifest: manifest_path,
            cow_size: part.cow.size,
            verity,
            root_hash: part.verity.as_ref().map(|v| v.root_hash.clone()),
            written: true,
            resumed_bytes,
        });
    }
    Ok(done)
}

/// Reads the plan at the start of partition `part`'s payload.
fn read_plan<R: std::io::Read>(
    stream: &mut bundle::PayloadStream<'_, R>,
    part: &Partition,
    bundle_path: &Path,
) -> Result<delta::Plan> {
    let at = stream.position() + 8;
    let plan_bytes = stream.read_plan()?;
    bundle::plan_wire::decode(&plan_bytes, part.image.new.size).map_err(|msg| {
        anyhow::anyhow!(
            "{}: offset {at}: partition {}: {msg}",
            bundle_path.display(),
            part.name
        )
    })
}

/// The manifest `vabc diff` would have written beside the COW: the bundle's, with the
/// base's 4 MiB identity from [`check_base`], and the new image's region hashes and
/// per-op hashes computed from the COW over the base (the new image's sha256 checked
/// against the bundle's).
fn device_manifest(
    p: &Partition,
    cow_path: &Path,
    base: &Path,
    base_id: &manifest::ImageId,
) -> Result<manifest::Manifest> {
    let cow = cow::CowReader::open(cow_path)?;
    let file = File::open(base).with_context(|| format!("cannot open base {}", base.display()))?;
    let view = cow::SnapshotView::new(&cow, &file, base, Some(p.image.new.size))?;
    let read = |off: u64, buf: &mut [u8]| {
        view.read_blocks(off / cow::BLOCK_SIZE as u64, buf)
            .map_err(std::io::Error::other)
    };
    // A full read of the new image through the COW: it proves base + COW make the
    // image the signed manifest names, before the COW is kept.
    let new = manifest::ImageId::compute(&read, cow_path, p.image.new.size)?;
    if new.sha256 != p.image.new.sha256 {
        mismatch!(
            "partition {}: base {} + the installed COW make an image with sha256 {}, the \
             bundle's new image has {}; nothing was kept",
            p.name,
            base.display(),
            new.sha256,
            p.image.new.sha256
        );
    }
    Ok(manifest::Manifest {
        merged_op_hashes: Some(crate::checks::op_hashes(&cow, &read, cow_path)?),
        new,
        base: base_id.clone(),
        ..p.image.clone()
    })
}

/// The new image read through a COW, as the dm-verity tree builder reads its data.
struct ViewAt<'a>(cow::SnapshotView<'a>);

impl verity::ReadAt for ViewAt<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let bs = cow::BLOCK_SIZE as u64;
        if !offset.is_multiple_of(bs) {
            return Err(std::io::Error::other(format!(
                "read at {offset}, not a multiple of {bs}"
            )));
        }
        self.0
            .read_blocks(offset / bs, buf)
            .map_err(std::io::Error::other)
    }
}

/// Tree parameters of a signed [`VerityInfo`].
pub(crate) fn verity_params(v: &VerityInfo) -> Result<(verity::Params, [u8; 16])> {
    let params = verity::Params {
        format: verity::Format::from_u32(v.format)?,
        algorithm: v.hash_algorithm.parse()?,
        data_block_size: v.data_block_size,
        hash_block_size: v.hash_block_size,
        data_blocks: v.data_blocks,
        salt: hex::decode(&v.salt).context("the salt is not hex")?,
    };
    params.validate()?;
    Ok((params, verity::parse_uuid(&v.uuid)?))
}

/// Whether `path` holds the tree `v` describes, whole: left by an install of this
/// bundle that was cut short. Its superblock must carry the signed parameters (the
/// UUID is made anew for every bundle) and its levels must hash up to the signed
/// root hash; a tree that does not is written again, never reused.
fn has_hashfile(v: &VerityInfo, path: &Path) -> bool {
    let Ok((params, uuid)) = verity_params(v) else {
        return false;
    };
    let Ok(f) = File::open(path) else {
        return false;
    };
    let mut b = vec![0u8; verity::SUPERBLOCK_SIZE as usize];
    use std::os::unix::fs::FileExt;
    let sb_ok = f.read_exact_at(&mut b, 0).is_ok()
        && verity::Superblock::decode(&b, path, 0)
            .is_ok_and(|sb| sb.uuid == uuid && sb.params == params);
    let (Ok(root), Ok(md)) = (hex::decode(&v.root_hash), f.metadata()) else {
        return false;
    };
    sb_ok
        && verity::verify_levels(
            &params,
            verity::Input {
                reader: &f,
                name: path,
                len: md.len(),
            },
            verity::tree_offset(0, true, params.hash_block_size),
            &root,
        )
        .is_ok()
}

/// Writes `out_dir/NAME.verity`: the dm-verity tree of partition `p`'s new image, read
/// through `cow_path` over `base`, with the signed parameters; its root hash must be
/// the signed one.
fn install_verity(
    p: &Partition,
    v: &VerityInfo,
    cow_path: &Path,
    base: &Path,
    out_dir: &Path,
) -> Result<PathBuf> {
    let (params, uuid) =
        verity_params(v).with_context(|| format!("partition {}: verity parameters", p.name))?;
    let cow = cow::CowReader::open(cow_path)?;
    let file = File::open(base).with_context(|| format!("cannot open base {}", base.display()))?;
    let view = ViewAt(cow::SnapshotView::new(
        &cow,
        &file,
        base,
        Some(p.image.new.size),
    )?);
    let input = verity::Input {
        reader: &view,
        name: cow_path,
        len: p.image.new.size,
    };
    let path = out_dir.join(format!("{}.verity", p.name));
    let f = super::verity::write_hashfile(input, params, uuid, &path)?;
    if hex::encode(&f.root) != v.root_hash {
        let _ = std::fs::remove_file(&path);
        mismatch!(
            "partition {}: the dm-verity tree of the installed image has root hash {}, the \
             bundle says {}; nothing was kept",
            p.name,
            hex::encode(&f.root),
            v.root_hash
        );
    }
    Ok(path)
}

/// What an install killed while it worked on partition `name` left in `dir`: the COW
/// being written (`.NAME.cow.installing`), the COW writer's temporary file beside it,
/// the manifest sidecar's (`.NAME.cow.manifest.*.tmp`) and the hash file's
/// (`.NAME.verity.*.tmp`); and the saved downloads of this partition other than
/// `keep` (another bundle's: [`spool_path`]).
pub(crate) fn remove_stale(dir: &Path, name: &str, keep: Option<&Path>) -> Result<()> {
    let installing = format!(".{name}.cow.installing");
    let writer_temp = format!(".{installing}.");
    let sidecar_temp = format!(".{name}.cow.manifest.");
    let tree_temp = format!(".{name}.verity.");
    let spool_prefix = format!(".{name}.payload.");
    for e in std::fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let e = e.with_context(|| format!("list {}", dir.display()))?;
        let f = e.file_name().to_string_lossy().into_owned();
        let temp = f.ends_with(".tmp")
            && [&writer_temp, &sidecar_temp, &tree_temp]
                .iter()
                .any(|p| f.starts_with(p.as_str()));
        // Another bundle's saved download of this partition.
        let other_spool = f.starts_with(&spool_prefix)
            && f.ends_with(".part")
            && keep.and_then(Path::file_name) != Some(e.file_name().as_os_str());
        if f == installing || temp || other_spool {
            std::fs::remove_file(e.path())
                .with_context(|| format!("remove the stale {}", e.path().display()))?;
        }
    }
    Ok(())
}

/// Checks `base` against the bundle's identity of partition `p`'s base and returns
/// its identity in 4 MiB regions, which the manifest sidecar records: one computation
/// (one read of the base) compared by sha256; only a base that differs is compared
/// region by region, to name where.
fn check_base(p: &Partition, base: &Path) -> Result<manifest::ImageId> {
    let (size, read) = base_reader(base)?;
    let want = &p.image.base;
    let partition = p.partition_bytes();
    // The identity covers the whole partition: a base of another size (a bundle made
    // from an empty or a shorter image included) is not the one it was made for.
    if size != partition {
        mismatch!(
            "{} is {size} bytes, but partition {} of this bundle is {partition} bytes: not the \
             partition the bundle was made for; nothing was written",
            base.display(),
            p.name
        );
    }
    if p.image.new.size > partition {
        mismatch!(
            "partition {}: the new image ({} bytes) is larger than the partition ({partition} \
             bytes); nothing was written",
            p.name,
            p.image.new.size
        );
    }
    let id = manifest::ImageId::compute(&read, base, want.size)
        .with_context(|| format!("check the base {}", base.display()))?;
    if id.sha256 == want.sha256 {
        return Ok(id);
    }
    let found = want
        .first_mismatch(&read, base, size, |_| true)
        .with_context(|| format!("check the base {}", base.display()))?;
    let what = match found {
        Some(m) => m.to_string(),
        None => format!("its sha256 is not {}", want.sha256),
    };
    mismatch!(
        "{} is not the base partition {} of this bundle was made for: {what}; nothing was written",
        base.display(),
        p.name
    );
}

/// Bytes of the dm-verity hash file install writes for `p` (superblock and tree).
fn hashfile_bytes(p: &Partition) -> u64 {
    p.verity
        .as_ref()
        .and_then(|v| verity_params(v).ok())
        .and_then(|(params, _)| {
            let tree = params.layout().ok()?.tree_size();
            Some(verity::tree_offset(0, true, params.hash_block_size) + tree)
        })
        .unwrap_or(0)
}

/// A base's size and a reader of it as the disk holds it: a block device may be
/// mounted (the running old system) with its file system's own view of it in the
/// page cache (`cow::direct`).
fn base_reader(base: &Path) -> Result<(u64, impl manifest::ReadAt)> {
    let disk = cow::direct::Disk::open(base)
        .with_context(|| format!("cannot open base {}", base.display()))?;
    let size = cow::view::file_size(disk.file(), base)?;
    Ok((size, move |off: u64, buf: &mut [u8]| {
        disk.read_exact_at(buf, off)
    }))
}

/// Refuses an install whose COWs (and hash files) do not fit in `dir`; a download
/// (`spooling`) also saves one partition's payload at a time beside them.
fn check_space(m: &BundleManifest, dir: &Path, spooling: bool) -> Result<()> {
    let todo: Vec<&Partition> = m
        .partitions
        .iter()
        .filter(|p| {
            let cow = dir.join(format!("{}.cow", p.name));
            std::fs::metadata(cow).map(|md| md.len()).ok() != Some(p.cow.size)
        })
        .collect();
    let mut need: u64 = todo.iter().map(|p| p.cow.size + hashfile_bytes(p)).sum();
    if spooling {
        need += todo
            .iter()
            .map(|p| {
                let saved = std::fs::metadata(spool_path(dir, p)).map_or(0, |md| md.len());
                p.payload.length.saturating_sub(saved)
            })
            .max()
            .unwrap_or(0);
    }
    let free = free_bytes(dir)?;
    if free < need {
        bail!(
            "{}: {free} bytes free, the bundle's COWs need {need}{}; nothing was written",
            dir.display(),
            if spooling {
                " (with the largest payload, saved while it downloads)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// Holds `dir` for one install at a time (an advisory lock on the folder itself,
/// released when the returned file closes): two installs into one folder would remove
/// each other's temporary files and saved downloads. Where the file system has no
/// locks, the install goes on unlocked.
fn lock_dir(dir: &Path) -> Result<File> {
    use std::os::fd::AsRawFd;
    let f = File::open(dir).with_context(|| format!("open {}", dir.display()))?;
    // SAFETY: flock takes a descriptor `f` owns and keeps open across the call.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            bail!(
                "{}: another install is writing into this folder; nothing was written",
                dir.display()
            );
        }
        // A file system without locks (some network and FUSE ones) still installs.
        log::debug!("{}: cannot lock ({e}); installing without", dir.display());
    }
    Ok(f)
}

/// Whether the bundle is fetched over HTTP(S) (see [`open_input`]).
fn is_url(path: &Path) -> bool {
    let text = path.to_string_lossy();
    text.starts_with("http://") || text.starts_with("https://")
}

/// Where a download saves partition `p`'s payload while it installs it, named by the
/// payload's signed sha256 so that a resumed install reads back only its own bytes
/// ([`bundle::PayloadStream::spool`]).
fn spool_path(dir: &Path, p: &Partition) -> PathBuf {
    // An unsigned manifest's hash may be anything: only hex digits go into the name.
    let id: String = p
        .payload
        .sha256
        .chars()
        .take(16)
        .map(|c| if c.is_ascii_hexdigit() { c } else { '_' })
        .collect();
    dir.join(format!(".{}.payload.{id}.part", p.name))
}

fn remove_if_there(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("remove {}", path.display()))
        }
        _ => Ok(()),
    }
}

fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .with_context(|| format!("{}: path contains a NUL byte", dir.display()))?;
    // SAFETY: statvfs writes only into `st`, which lives across the call; `c` is a
    // NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statvfs {}", dir.display()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

fn apply(a: InstallArgs) -> Result<ExitCode> {
    let key = a.key.load()?;
    if !a.out_dir.is_dir() {
        bail!("--out-dir {}: not a directory", a.out_dir.display());
    }
    let work = crate::output::temp_dir_beside(&a.out_dir.join("x"), "bundle-apply")?;
    let done = install_into(
        &a.bundle,
        &a.bases,
        work.path(),
        trust(&key),
        a.threads,
        &mut |_, _, _| Ok(()),
    )?;
    let mut outputs = Vec::new();
    for d in &done {
        let base_spec = &d.base;
        let m = manifest::Manifest::load(&d.manifest)?;
        let cow = cow::CowReader::open(&d.cow)?;
        let base = File::open(base_spec)
            .with_context(|| format!("cannot open base {}", base_spec.display()))?;
        let view = cow::SnapshotView::new(&cow, &base, base_spec, Some(m.new.size))?;
        let out = a.out_dir.join(format!("{}.img", d.name));
        let tmp = crate::output::temp_beside(&out)?;
        tmp.as_file()
            .set_len(m.new.size)
            .with_context(|| format!("cannot size {}", tmp.path().display()))?;
        view.write_to(tmp.as_file(), tmp.path(), true, &|_| {})?;
        if let Some(found) = m
            .new
            .first_mismatch(tmp.as_file(), tmp.path(), m.new.size, |_| true)?
        {
            mismatch!(
                "partition {}: the image made from the bundle is not the new image: {found}; \
                 nothing was written",
                d.name
            );
        }
        crate::output::part_of_output(&out, || crate::output::commit(tmp, &out))?;
        let mut o = serde_json::json!({
            "name": d.name,
            "image": out,
            "size": m.new.size,
            "sha256": m.new.sha256,
        });
        if let (Some(tree), Some(root)) = (&d.verity, &d.root_hash) {
            let dest = a.out_dir.join(format!("{}.verity", d.name));
            std::fs::rename(tree, &dest)
                .with_context(|| format!("rename {} to {}", tree.display(), dest.display()))?;
            o["verity"] = serde_json::json!(dest);
            o["root_hash"] = serde_json::json!(root);
        }
        outputs.push(o);
    }
    crate::output::keep_outputs();
    if a.json {
        let out = serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "bundle": a.bundle,
            "partitions": outputs,
        });
        println!("{out:#}");
    } else {
        for o in &outputs {
            println!(
                "{}: {} ({} bytes, sha256 {}){}",
                o["name"].as_str().unwrap_or_default(),
                o["image"].as_str().unwrap_or_default(),
                o["size"],
                o["sha256"].as_str().unwrap_or_default(),
                match (o["verity"].as_str(), o["root_hash"].as_str()) {
                    (Some(t), Some(r)) => format!(", dm-verity tree {t}, root hash {r}"),
                    _ => String::new(),
                }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
