//! `vabc apply`: write the snapshot view (base + COW) to a new image.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use cow::{CowReader, SnapshotView};

use crate::progress;

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
    let cow = CowReader::open_with(&a.cow, cow::OpenOptions { label: a.label })
        .with_context(|| format!("cannot read COW {}", a.cow.display()))?;
    let base =
        File::open(&a.base).with_context(|| format!("cannot open base {}", a.base.display()))?;
    ota::output::check_dest(&a.output, "-o")?;
    for input in [&a.base, &a.cow] {
        if same_file(input, &a.output) {
            bail!(
                "output {} is the same file as input {}",
                a.output.display(),
                input.display()
            );
        }
    }
    // One reading of the merge state for every command: a merge killed inside its first
    // window has overwritten base blocks while its counter still says 0.
    let progress = merge::progress::read(&cow)?;
    if progress.started() {
        bail!(
            "{}: its merge is {progress}, so a base is no longer the old image; \
             finish the merge (vabc merge) or serve it (vabc serve) instead",
            a.cow.display(),
        );
    }
    // The manifest describes the whole update: with --label the base is still checked
    // against it (through the whole COW), but the partial result is not the new image.
    let manifest = match a.label {
        None => {
            let m = crate::checks::load_manifest(&a.check, &a.cow, &cow)?;
            if let Some(m) = &m {
                ota::trust::check_base(m, progress, &cow, &base, &a.base)?;
            }
            m
        }
        Some(_) => {
            let whole = CowReader::open(&a.cow)
                .with_context(|| format!("cannot read COW {}", a.cow.display()))?;
            if let Some(m) = crate::checks::load_manifest(&a.check, &a.cow, &whole)? {
                ota::trust::check_base(&m, progress, &whole, &base, &a.base)?;
            }
            None
        }
    };
    let size = a.size.or(manifest.as_ref().map(|m| m.new.size));
    let view = SnapshotView::new(&cow, &base, &a.base, size)?;
    let needed = cow.source_extent();
    if view.base_size() < needed {
        bail!(
            "{}: base is {} bytes, but the COW {} reads source data up to byte {needed}: wrong base image?",
            a.base.display(),
            view.base_size(),
            a.cow.display()
        );
    }
    let size = view.size();
    if a.size.is_none() && manifest.is_none() {
        ota::trust::bound_without_size(&view, &a.cow)?;
    }
    let bar = progress::Progress::new(size, "apply", progress::Unit::Bytes);
    let report = |done: u64| bar.set_position(done);

    if is_block_device(&a.output) {
        // Written in place, so it cannot be undone: prove the result first.
        if manifest.is_some() {
            ota::trust::prove_result(manifest.as_ref(), &cow, &base, &a.base, Some(size))?;
        }
        let out = OpenOptions::new()
            .write(true)
            .open(&a.output)
            .with_context(|| format!("cannot open {}", a.output.display()))?;
        let dev_size = cow::view::file_size(&out, &a.output)?;
        if dev_size < size {
            bail!(
                "{}: device is {dev_size} bytes, the new image needs {size}",
                a.output.display()
            );
        }
        view.write_to(&out, &a.output, false, &report)?;
        out.sync_all()
            .with_context(|| format!("fsync {}", a.output.display()))?;
    } else {
        // Dropped (and so deleted) on any error: no half-written output.
        let tmp = ota::output::temp_beside(&a.output)?;
        tmp.as_file()
            .set_len(size)
            .with_context(|| format!("cannot size {}", tmp.path().display()))?;
        // Zeros stay holes: an image that is mostly empty (or an op that names a far
        // block) costs no disk space for them.
        view.write_to(tmp.as_file(), tmp.path(), true, &report)?;
        if let Some(m) = &manifest {
            // Before the rename: a corrupt COW must not leave a wrong image behind.
            let found = m
                .new
                .first_mismatch(tmp.as_file(), tmp.path(), size, |_| true)?;
            if let Some(mismatch) = found {
                crate::checks::mismatch!(
                    "{} + {} does not make the new image the update promises: {mismatch}; \
                     the COW is corrupt ({} not written)",
                    a.base.display(),
                    a.cow.display(),
                    a.output.display()
                );
            }
        }
        ota::output::part_of_output(&a.output, || ota::output::commit(tmp, &a.output))?;
        ota::output::keep_outputs();
    }
    bar.finish();
    if a.json {
        crate::report::print(ApplyReport {
            output: &a.output,
            size,
            base: &a.base,
            cow: &a.cow,
            base_checked: manifest.is_some(),
            new_sha256: manifest.as_ref().map(|m| m.new.sha256.as_str()),
        })?;
    } else {
        println!(
            "wrote {} ({size} bytes) from {} + {}",
            a.output.display(),
            a.base.display(),
            a.cow.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn is_block_device(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device())
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
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
