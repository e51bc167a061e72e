//! `vabc manifest`: write the manifest of an existing COW (one made by another tool,
//! such as AOSP's update_engine, which writes none), from its old and new images.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use cow::CowReader;
use manifest::{ImageId, Manifest};

#[derive(clap::Args)]
pub struct Args {
    /// The image the COW applies to.
    old: PathBuf,
    /// The image it makes.
    new: PathBuf,
    /// The COW.
    #[arg(long)]
    cow: PathBuf,
    /// Where to write it (default: COW.manifest).
    #[arg(short = 'o', long = "output")]
    output: Option<PathBuf>,
    /// Skip checking that OLD + COW make NEW (a full decode pass).
    #[arg(long)]
    no_check: bool,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

fn id(path: &Path) -> Result<ImageId> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let size = cow::view::file_size(&f, path)?;
    Ok(ImageId::compute(&f, path, size)?)
}

pub fn run(a: Args) -> Result<ExitCode> {
    let cow =
        CowReader::open(&a.cow).with_context(|| format!("cannot read COW {}", a.cow.display()))?;
    if merge::progress::read(&cow)?.started() {
        bail!(
            "{}: its merge has started, so {} may no longer be its base; make the manifest \
             from an unmerged copy",
            a.cow.display(),
            a.old.display()
        );
    }
    let new =
        std::fs::File::open(&a.new).with_context(|| format!("cannot open {}", a.new.display()))?;
    let m = Manifest {
        schema_version: manifest::SCHEMA_VERSION,
        base: id(&a.old)?,
        new: id(&a.new)?,
        cow_ops: cow.ops().len() as u64,
        merged_op_hashes: Some(ota::trust::op_hashes(&cow, &new, &a.new)?),
    };
    if !a.no_check {
        let base = std::fs::File::open(&a.old)
            .with_context(|| format!("cannot open {}", a.old.display()))?;
        ota::trust::prove_result(Some(&m), &cow, &base, &a.old, None)?;
    }
    let out = a.output.unwrap_or_else(|| Manifest::path_for(&a.cow));
    ota::output::write_atomic(&out, m.to_json().as_bytes())?;
    if a.json {
        crate::report::print(ManifestReport {
            manifest: &out,
            base_sha256: &m.base.sha256,
            new_sha256: &m.new.sha256,
            new_size: m.new.size,
            cow_ops: m.cow_ops,
            checked: !a.no_check,
        })?;
    } else {
        println!("{}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `vabc manifest --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct ManifestReport<'a> {
    manifest: &'a std::path::Path,
    base_sha256: &'a str,
    new_sha256: &'a str,
    new_size: u64,
    cow_ops: u64,
    checked: bool,
}
