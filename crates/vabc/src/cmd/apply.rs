//! `vabc apply`: write the snapshot view (base + COW) to a new image.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;

#[derive(clap::Args)]
pub struct Args {
    /// The old image the COW was made against (file or block device).
    #[arg(long)]
    base: PathBuf,
    /// The COW file.
    #[arg(long)]
    cow: PathBuf,
    /// Where to write the new image. A file is written to a temporary name
    /// beside it and renamed on success; a block device is written in place.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Apply the COW only up to this label (resume point).
    #[arg(long)]
    label: Option<u64>,
    /// Size of the new image in bytes, K/M/G/T suffixes allowed (the COW format does
    /// not record it). Default: the size in the update's manifest.
    #[arg(long, value_parser = crate::args::parse_size)]
    size: Option<u64>,
    #[command(flatten)]
    check: crate::checks::CheckArgs,
    /// Print a JSON report on stdout.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    ota::output::check_dest(&a.output, "-o")?;
    let req = ota::snapshot::ApplyRequest {
        base: a.base.clone(),
        cow: a.cow.clone(),
        output: a.output.clone(),
        label: a.label,
        size: a.size,
        manifest: ota::snapshot::ManifestChoice {
            path: a.check.manifest.clone(),
            skip: a.check.no_base_check,
        },
    };
    let done = ota::snapshot::apply(&req, &crate::progress::Bar::new())?;
    if a.json {
        crate::report::print(ApplyReport {
            output: &a.output,
            size: done.size,
            base: &a.base,
            cow: &a.cow,
            base_checked: done.base_checked,
            new_sha256: done.new_sha256.as_deref(),
        })?;
    } else {
        println!(
            "wrote {} ({} bytes) from {} + {}",
            a.output.display(),
            done.size,
            a.base.display(),
            a.cow.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `vabc apply --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct ApplyReport<'a> {
    output: &'a std::path::Path,
    size: u64,
    base: &'a std::path::Path,
    cow: &'a std::path::Path,
    base_checked: bool,
    new_sha256: Option<&'a str>,
}
