//! `vabc inspect`: what is in a COW file (AOSP's `inspect_cow`, plus JSON).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use cow::{CowReader, Op, OpKind, OpenOptions};
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// The COW file (or block device).
    cow: PathBuf,
    /// List the ops (stream order unless --order says otherwise).
    #[arg(long)]
    ops: bool,
    /// Order of the op listing; `merge` is the order a merge applies them.
    #[arg(long, value_enum, default_value_t = Order::Stream)]
    order: Order,
    /// Check that merging op by op in merge order is safe; exit 3 if not.
    #[arg(long)]
    verify_merge: bool,
    /// Read only up to this label (resume point), as a resumed writer would.
    #[arg(long)]
    label: Option<u64>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// A dry run of what a merge checks before its first write: every op's payload
    /// decodes and, with --base, the base is the one the update's manifest names and
    /// base + COW make exactly its new image. Writes nothing; exit 3 on failure.
    #[arg(long)]
    check: bool,
    /// The base image for --check.
    #[arg(long, requires = "check", value_name = "OLD.img")]
    base: Option<PathBuf>,
    #[command(flatten)]
    checks: crate::checks::CheckArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Order {
    Stream,
    Merge,
}

#[derive(Serialize, schemars::JsonSchema)]
struct OpJson {
    #[serde(rename = "type")]
    kind: OpKind,
    new_block: u64,
    source: u64,
    blocks: u32,
    data_offset: u64,
    data_length: u32,
}

impl From<&Op> for OpJson {
    fn from(o: &Op) -> Self {
        OpJson {
            kind: o.kind,
            new_block: o.new_block,
            source: o.source,
            blocks: o.blocks,
            data_offset: o.data_offset,
            data_length: o.data_length,
        }
    }
}

#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct Summary<'a> {
    file: String,
    file_size: u64,
    version: String,
    header: &'a cow::Header,
    compression: cow::Codec,
    compression_factor: u32,
    ops_total: usize,
    op_counts: BTreeMap<&'static str, usize>,
    blocks_by_type: BTreeMap<&'static str, u64>,
    blocks_covered: u64,
    end_block: u64,
    data_bytes: u64,
    sequence_entries: usize,
    labels: Vec<cow::Label>,
    footer: Option<&'a cow::Footer>,
    /// How far a merge of this COW has gone: a merge records its progress in the COW.
    merge_state: String,
    merge_complete: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    check: Option<VerifyJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    verify_merge: Option<VerifyJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    order: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ops: Option<Vec<OpJson>>,
}

#[derive(Serialize, schemars::JsonSchema)]
struct VerifyJson {
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let r = CowReader::open_with(&a.cow, OpenOptions { label: a.label })
        .with_context(|| format!("cannot read COW {}", a.cow.display()))?;
    let h = r.header();
    let mut op_counts = BTreeMap::new();
    let mut blocks_by_type = BTreeMap::new();
    for op in r.ops() {
        *op_counts.entry(op.kind.name()).or_insert(0) += 1;
        *blocks_by_type.entry(op.kind.name()).or_insert(0u64) += u64::from(op.blocks);
    }
    let verify = a.verify_merge.then(|| match r.verify_merge() {
        Ok(()) => VerifyJson {
            ok: true,
            error: None,
        },
        Err(e) => VerifyJson {
            ok: false,
            error: Some(e.to_string()),
        },
    });
    let progress = merge::progress::read(&r);
    let merge_state = match &progress {
        Ok(p) => p.to_string(),
        Err(e) => format!("invalid: {e}"),
    };
    let check = a.check.then(|| match run_check(&a, &r) {
        Ok(()) => VerifyJson {
            ok: true,
            error: None,
        },
        Err(e) => VerifyJson {
            ok: false,
            error: Some(crate::error_chain(&e)),
        },
    });
    let listing: Option<Vec<&Op>> = if a.ops || a.order == Order::Merge {
        Some(match a.order {
            Order::Stream => r.ops().iter().collect(),
            Order::Merge => r
                .merge_order()
                .with_context(|| "cannot derive the merge order")?
                .into_iter()
                .map(|i| &r.ops()[i])
                .collect(),
        })
    } else {
        None
    };
    let summary = Summary {
        file: a.cow.display().to_string(),
        file_size: r.file_size(),
        version: format!("{}.{}", h.major_version, h.minor_version),
        header: h,
        compression: r.codec(),
        compression_factor: r.max_compression_size(),
        ops_total: r.ops().len(),
        op_counts,
        blocks_covered: blocks_by_type.values().sum(),
        blocks_by_type,
        end_block: r.end_block(),
        data_bytes: r.data_bytes(),
        sequence_entries: r.sequence().len(),
        labels: r.labels().to_vec(),
        footer: r.footer(),
        merge_complete: matches!(progress, Ok(merge::Progress::Complete { .. })),
        merge_state,
        check,
        verify_merge: verify,
        order: listing.as_ref().map(|_| match a.order {
            Order::Stream => "stream",
            Order::Merge => "merge",
        }),
        ops: listing
            .as_ref()
            .map(|l| l.iter().map(|o| OpJson::from(*o)).collect()),
    };
    if a.json {
        crate::report::print(&summary)?;
    } else {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        match print_text(&mut out, &summary).and_then(|()| out.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(ExitCode::SUCCESS),
            r => r.context("cannot write to stdout")?,
        }
    }
    let mut failed = false;
    for v in [&summary.verify_merge, &summary.check]
        .into_iter()
        .flatten()
    {
        if let Some(e) = &v.error {
            eprintln!("vabc: {e}");
            failed = true;
        }
    }
    if let Err(e) = &progress {
        eprintln!("vabc: {e}");
        failed = true;
    }
    Ok(if failed {
        ExitCode::from(crate::checks::EXIT_MISMATCH)
    } else {
        ExitCode::SUCCESS
    })
}

/// `--check`: what `vabc merge` proves before its first write, without writing.
fn run_check(a: &Args, r: &CowReader) -> Result<()> {
    use rayon::prelude::*;
    r.ops()
        .par_iter()
        .filter(|op| matches!(op.kind, OpKind::Xor | OpKind::Replace))
        .try_for_each_init(Vec::new, |buf, op| {
            buf.resize(op.unit_size(), 0);
            r.read_payload(op, buf)
        })
        .with_context(|| format!("decode every payload of {}", a.cow.display()))?;
    let Some(base_path) = &a.base else {
        return Ok(());
    };
    let base = std::fs::File::open(base_path)
        .with_context(|| format!("cannot open base {}", base_path.display()))?;
    let progress = merge::progress::read(r)?;
    let manifest = crate::checks::load_manifest(&a.checks, &a.cow, r)?;
    if let Some(m) = &manifest {
        ota::trust::check_base(m, progress, r, &base, base_path)?;
    }
    if !progress.started() {
        ota::trust::prove_result(manifest.as_ref(), r, &base, base_path, None)?;
    }
    Ok(())
}

/// The text report. A reader that goes away early (`vabc inspect --ops |
/// head`) makes a write fail with BrokenPipe, which `run` treats as the end.
fn print_text(out: &mut impl Write, s: &Summary) -> std::io::Result<()> {
    let h = s.header;
    writeln!(out, "File:               {}", s.file)?;
    writeln!(out, "File size:          {}", s.file_size)?;
    writeln!(out, "Version:            {}", s.version)?;
    writeln!(out, "Header size:        {}", h.header_size)?;
    writeln!(out, "Footer size:        {}", h.footer_size)?;
    writeln!(out, "Block size:         {}", h.block_size)?;
    if h.major_version < 3 {
        writeln!(out, "Cluster ops:        {}", h.cluster_ops)?;
    }
    writeln!(out, "Merge ops:          {}", h.num_merge_ops)?;
    writeln!(out, "Merge state:        {}", s.merge_state)?;
    writeln!(out, "Scratch area:       {} bytes", h.buffer_size)?;
    writeln!(out, "Compression:        {}", s.compression)?;
    if h.major_version == 3 {
        writeln!(out, "Compression factor: {}", s.compression_factor)?;
        writeln!(
            out,
            "Op count / max:     {} / {}",
            h.op_count, h.op_count_max
        )?;
        writeln!(
            out,
            "Resume points:      {} stored ({} in header)",
            s.labels.len(),
            h.resume_point_count
        )?;
    }
    match s.footer {
        Some(f) => writeln!(
            out,
            "Footer:             {} ops, {} bytes, at offset {}",
            f.num_ops, f.ops_size, f.offset
        )?,
        None if h.major_version < 3 => writeln!(out, "Footer:             none")?,
        None => {}
    }
    writeln!(out, "Sequence entries:   {}", s.sequence_entries)?;
    let labels: Vec<String> = s
        .labels
        .iter()
        .map(|l| format!("{} (after {} ops)", l.label, l.ops_before))
        .collect();
    writeln!(
        out,
        "Labels:             {}",
        if labels.is_empty() {
            "none".to_string()
        } else {
            labels.join(", ")
        }
    )?;
    writeln!(out, "Ops:                {}", s.ops_total)?;
    for kind in ["COPY", "XOR", "REPLACE", "ZERO"] {
        writeln!(
            out,
            "  {:<8}          {:>8} ops {:>10} blocks",
            kind,
            s.op_counts.get(kind).copied().unwrap_or(0),
            s.blocks_by_type.get(kind).copied().unwrap_or(0)
        )?;
    }
    writeln!(out, "Blocks covered:     {}", s.blocks_covered)?;
    writeln!(out, "End block:          {}", s.end_block)?;
    writeln!(out, "Data size:          {} bytes", s.data_bytes)?;
    if let Some(v) = &s.check {
        match v.ok {
            true => writeln!(out, "Check:              passed")?,
            false => writeln!(out, "Check:              FAILED")?,
        }
    }
    if let Some(v) = &s.verify_merge {
        if v.ok {
            writeln!(out, "Merge sequence is consistent.")?;
        } else {
            writeln!(out, "Merge sequence is inconsistent!")?;
        }
    }
    if let Some(ops) = &s.ops {
        writeln!(out, "Ops in {} order:", s.order.unwrap_or("stream"))?;
        for (i, o) in ops.iter().enumerate() {
            let detail = match o.kind {
                OpKind::Copy => format!("source block {}", o.source),
                OpKind::Xor => format!(
                    "source byte {} (block {} + {}), data {}@{}",
                    o.source,
                    o.source / 4096,
                    o.source % 4096,
                    o.data_length,
                    o.data_offset
                ),
                OpKind::Replace => format!(
                    "{} block(s), data {}@{}",
                    o.blocks, o.data_length, o.data_offset
                ),
                OpKind::Zero => String::new(),
            };
            writeln!(
                out,
                "{i:>8} {:<7} new block {:>10} {detail}",
                o.kind.name(),
                o.new_block
            )?;
        }
    }
    Ok(())
}
