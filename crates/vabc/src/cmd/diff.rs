//! `vabc diff OLD NEW -o UPDATE.cow`: make the COW that turns OLD into NEW.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::ValueEnum;
use cow::Compression;
use delta::PlanOptions;
use delta::write::CowOptions;
use serde::Serialize;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    V2,
    V3,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The image on the device (file or block device); or `--base`.
    #[arg(
        value_name = "OLD",
        required_unless_present = "base",
        conflicts_with = "base"
    )]
    pub old: Option<PathBuf>,
    /// The image to ship (file or block device); or `--new`.
    #[arg(
        value_name = "NEW",
        required_unless_present = "new_image",
        conflicts_with = "new_image"
    )]
    pub new: Option<PathBuf>,
    /// OLD, spelt as the other commands name the image an update applies to.
    #[arg(long, value_name = "OLD")]
    pub base: Option<PathBuf>,
    /// NEW, as a flag.
    #[arg(long = "new", id = "new_image", value_name = "NEW")]
    pub new_image: Option<PathBuf>,
    /// Output COW file (written to a temporary file, renamed when complete).
    #[arg(short, long)]
    pub output: PathBuf,
    /// COW format version.
    #[arg(long, value_enum, default_value = "v3")]
    pub format: Format,
    /// Payload codec: none, gz, lz4, zstd or brotli, optionally with a level
    /// (`zstd:3`). Default zstd level 19: on the `system` corpus pair it is
    /// 11% smaller than level 3 and 38% smaller than lz4, decodes as fast,
    /// and still takes well under xdelta3 -9's time (see the delta crate's
    /// documentation for the measurements). `lz4` is Android's fast encoder;
    /// `lz4:1` to `lz4:12` write the same blocks with LZ4HC (smaller, slower).
    #[arg(long, default_value = "zstd:19")]
    pub compression: String,
    /// Largest REPLACE compression unit (v3): 4k, 8k, 16k, 32k, 64k, 128k or 256k.
    /// Default 128k: only REPLACE runs of 32+ blocks (new files) use it, so
    /// it makes the `system` COW 1.3% smaller than 64k (Android's value)
    /// at no measurable cost in random 4 KiB reads of the served image.
    #[arg(long, default_value = "128k", value_parser = parse_factor)]
    pub compression_factor: u32,
    /// Only COPY, ZERO and REPLACE ops (no XOR).
    #[arg(long)]
    pub no_xor: bool,
    /// Store an XOR as a REPLACE when its source block is rewritten by
    /// another op more than this many blocks away (0, the default: keep
    /// every XOR). Such reads chain distant parts of the merge order
    /// together, which scatters the merge's writes. A trade of size for
    /// merge speed: on the `system` ext4 pair 4096 makes the COW 2.9%
    /// larger (lz4: 4.9%) and the merge issue 41% fewer I/O requests and
    /// run ~10% faster; 1024: +16% (lz4 +19%), 50% fewer requests.
    #[arg(long, value_name = "BLOCKS", default_value_t = 0)]
    pub far_xor_blocks: u64,
    /// Store as REPLACE the XORs whose OLD sources, with the OLD reads of
    /// the NEW blocks within 1 MiB (holes of up to 32 KiB read through),
    /// form a run shorter than this many blocks that only XORs read (0,
    /// the default: keep every XOR). Each such run is a small read of its
    /// own when the image is served or merged. A trade of size for cold
    /// sequential reads before the merge; see README. 64 measured best on
    /// the corpus; above ~500 whole XOR runs are converted too.
    #[arg(long, value_name = "BLOCKS", default_value_t = 0)]
    pub min_xor_run: u64,
    /// v3: store the ops, and so their data, ascending by block, with the
    /// merge order as sequence data (4 bytes more per COPY/XOR op), instead
    /// of in merge order. Reading the image in order before the merge then
    /// finds the data of neighbouring blocks together in the COW rather
    /// than scattered wherever the merge order took them.
    #[arg(long)]
    pub block_order: bool,
    /// Worker threads (0 = one per CPU). The output does not depend on it.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Treat images whose size is not a multiple of 4096 as zero-padded to
    /// the next 4 KiB. The COW then describes the padded NEW and needs a padded
    /// base: the base given to apply, merge or serve must be OLD zero-padded to a
    /// multiple of 4096 too; apply it with `--size` = the padded size and truncate
    /// the result to NEW's size.
    #[arg(long)]
    pub pad: bool,
    /// Print the op census, bytes per op type, sizes and times as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also build the dm-verity tree of NEW (sha256, 4096-byte blocks, with a
    /// superblock, as `vabc verity format` does) so a device can check the
    /// result of the merge; prints its root hash.
    #[arg(long)]
    pub verity: bool,
    /// Where --verity writes the tree (default: OUTPUT.verity).
    #[arg(long, value_name = "FILE", requires = "verity")]
    pub verity_hash_out: Option<PathBuf>,
    /// Salt of the --verity tree, hex or "-" for none (default: 32 random bytes).
    #[arg(long, value_name = "HEX|-", requires = "verity")]
    pub verity_salt: Option<String>,
}

fn parse_factor(s: &str) -> Result<u32, String> {
    let v = crate::args::parse_size(s)?;
    if !(4096..=262_144).contains(&v) || !v.is_power_of_two() {
        return Err(format!(
            "{s:?}: the factor must be a power of two from 4k to 256k"
        ));
    }
    Ok(v as u32)
}

#[derive(Serialize, schemars::JsonSchema)]
struct Blocks {
    unchanged: u64,
    zero: u64,
    copy: u64,
    xor: u64,
    replace: u64,
    cycle_breaks: u64,
    far_xors: u64,
    lone_xors: u64,
}

#[derive(Serialize, schemars::JsonSchema)]
struct Bytes {
    copy: u64,
    zero: u64,
    xor: u64,
    replace: u64,
}

#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct Report {
    old: PathBuf,
    new: PathBuf,
    output: PathBuf,
    old_size: u64,
    new_size: u64,
    new_physical_size: u64,
    format: u16,
    compression: String,
    compression_factor: u32,
    xor: bool,
    block_order: bool,
    blocks: Blocks,
    bytes: Bytes,
    ops: u64,
    replace_ops: u64,
    cow_size: u64,
    /// The sidecar that says which base the COW needs and what it makes.
    manifest: PathBuf,
    base_sha256: String,
    new_sha256: String,
    index_bytes: usize,
    plan_seconds: f64,
    write_seconds: f64,
    seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    verity: Option<super::verity::TreeReport>,
}

/// The unit REPLACE data is compressed in: v2 has no multi-block units.
fn effective_factor(version: u16, asked: u32) -> u32 {
    if version >= 3 { asked } else { 4096 }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let compression: Compression = args
        .compression
        .parse()
        .with_context(|| format!("--compression {}", args.compression))?;
    let version = match args.format {
        Format::V2 => 2,
        Format::V3 => 3,
    };
    // clap requires one spelling of each (a positional or its flag), never both.
    let (Some(old_path), Some(new_path)) = (
        args.base.as_ref().or(args.old.as_ref()),
        args.new_image.as_ref().or(args.new.as_ref()),
    ) else {
        bail!("diff needs OLD (or --base) and NEW (or --new)");
    };
    let opts = update_options(&args, version, compression);
    let u = ota::create::cow_update(
        old_path,
        new_path,
        &args.output,
        &opts,
        &crate::progress::Bar::new(),
    )?;
    // Complete: the outputs stay.
    ota::output::keep_outputs();
    let report = make_report(&args, old_path, new_path, version, compression, &u, t0);
    if args.json {
        crate::report::print(&report)?;
    } else {
        print_text(&args, version, &report, &u.plan);
    }
    Ok(ExitCode::SUCCESS)
}

/// The COW, plan and tree options the flags ask for.
fn update_options(
    args: &Args,
    version: u16,
    compression: Compression,
) -> ota::create::CowUpdateOptions {
    ota::create::CowUpdateOptions {
        cow: CowOptions {
            version,
            compression,
            compression_factor: args.compression_factor,
            threads: args.threads,
            block_order: args.block_order,
        },
        plan: PlanOptions {
            xor: !args.no_xor,
            threads: args.threads,
            far_xor_blocks: args.far_xor_blocks,
            min_xor_run: args.min_xor_run,
            ..PlanOptions::for_codec(compression.codec)
        },
        pad: args.pad,
        verity: args.verity.then(|| {
            let hashfile = args.verity_hash_out.clone().unwrap_or_else(|| {
                let mut p = args.output.clone().into_os_string();
                p.push(".verity");
                PathBuf::from(p)
            });
            (hashfile, args.verity_salt.clone())
        }),
    }
}

/// `vabc diff --json`'s report of what was made.
fn make_report(
    args: &Args,
    old_path: &std::path::Path,
    new_path: &std::path::Path,
    version: u16,
    compression: Compression,
    u: &ota::create::CowUpdate,
    t0: Instant,
) -> Report {
    let (plan, w, m) = (&u.plan, &u.written, &u.manifest);
    let verity = u.tree.as_ref().map(|(hashfile, f)| {
        super::verity::TreeReport::new(
            hashfile.clone(),
            verity::format_uuid(&f.uuid),
            &f.params,
            &f.root,
            f.hash_blocks,
        )
    });
    let c = plan.census;
    Report {
        old: old_path.to_path_buf(),
        new: new_path.to_path_buf(),
        output: args.output.clone(),
        old_size: plan.old_size,
        new_size: plan.new_size,
        new_physical_size: u.new_physical_size,
        format: version,
        compression: compression.to_string(),
        compression_factor: effective_factor(version, args.compression_factor),
        xor: !args.no_xor,
        block_order: args.block_order,
        blocks: Blocks {
            unchanged: c.unchanged,
            zero: c.zero,
            copy: c.copy,
            xor: c.xor,
            replace: c.replace,
            cycle_breaks: c.cycle_breaks,
            far_xors: c.far_xors,
            lone_xors: c.lone_xors,
        },
        bytes: Bytes {
            copy: 0,
            zero: 0,
            xor: w.xor_bytes,
            replace: w.replace_bytes,
        },
        ops: w.ops,
        replace_ops: w.replace_ops,
        cow_size: w.cow_size,
        manifest: u.manifest_path.clone(),
        base_sha256: m.base.sha256.clone(),
        new_sha256: m.new.sha256.clone(),
        index_bytes: plan.index_bytes,
        plan_seconds: u.plan_seconds,
        write_seconds: w.seconds,
        seconds: t0.elapsed().as_secs_f64(),
        verity,
    }
}

/// The report as text.
fn print_text(args: &Args, version: u16, report: &Report, plan: &delta::Plan) {
    let c = plan.census;
    println!(
        "{}: {} bytes, {} ops (v{}, {}, {} KiB units{}) in {:.2} s",
        args.output.display(),
        report.cow_size,
        report.ops,
        version,
        report.compression,
        effective_factor(version, args.compression_factor) / 1024,
        if args.block_order && version >= 3 {
            ", block order"
        } else {
            ""
        },
        report.seconds
    );
    println!(
        "blocks: {} unchanged, {} zero, {} copy, {} xor ({} bytes), {} replace ({} bytes; {} from merge cycles, {} from far XORs, {} from lone XORs)",
        c.unchanged,
        c.zero,
        c.copy,
        c.xor,
        report.bytes.xor,
        c.replace,
        report.bytes.replace,
        c.cycle_breaks,
        c.far_xors,
        c.lone_xors
    );
    if let Some(v) = &report.verity {
        println!(
            "verity: root hash {} ({}, salt {}, {} data blocks of {}) in {}",
            v.root_hash,
            v.hash_algorithm,
            if v.salt.is_empty() { "-" } else { &v.salt },
            v.data_blocks,
            v.data_block_size,
            v.hashfile.display()
        );
    }
    if plan.new_size != plan.old_size {
        println!(
            "new image is {} bytes (old {}): apply with --size {}",
            plan.new_size, plan.old_size, plan.new_size
        );
    }
}
