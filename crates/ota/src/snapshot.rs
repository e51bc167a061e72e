//! A COW over its base, on a host or a device without the update store: written out as
//! the new image ([`apply()`]), or merged into the base in place ([`merge()`]). Both check
//! the base against the update's manifest before they read it through the COW, and
//! prove the result before anything irreversible.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cow::{CowReader, SnapshotView};
use manifest::Manifest;

use crate::error::{Context, Error, Result, invalid, mismatch};
use crate::progress::{Event, Observer};

/// Which manifest says what a COW is for.
#[derive(Debug, Clone, Default)]
pub struct ManifestChoice {
    /// This manifest (default: `COW.manifest` when it exists).
    pub path: Option<PathBuf>,
    /// No manifest, and so no check of the base.
    pub skip: bool,
}

impl ManifestChoice {
    fn load(&self, cow_path: &Path, cow: &CowReader) -> Result<Option<Manifest>> {
        if self.skip {
            return Ok(None);
        }
        crate::trust::load_manifest(self.path.as_deref(), cow_path, cow)
    }
}

/// What [`apply()`] writes.
#[derive(Debug, Clone)]
pub struct ApplyRequest {
    /// The old image the COW was made against.
    pub base: PathBuf,
    /// The COW.
    pub cow: PathBuf,
    /// The new image: a file is written under a temporary name and renamed once
    /// complete and proven; a block device is written in place, after the proof.
    pub output: PathBuf,
    /// Only up to this label (a resume point): the result is then not the new image.
    pub label: Option<u64>,
    /// The new image's size (default: the manifest's).
    pub size: Option<u64>,
    /// The manifest.
    pub manifest: ManifestChoice,
}

/// What [`apply()`] wrote.
#[derive(Debug, Clone)]
pub struct Applied {
    /// Bytes written.
    pub size: u64,
    /// Whether the base was checked against a manifest.
    pub base_checked: bool,
    /// The new image's sha256, when a manifest said it.
    pub new_sha256: Option<String>,
}

/// Writes base + COW to `req.output`. The observer hears one phase, `apply`, in bytes.
pub fn apply(req: &ApplyRequest, observer: &dyn Observer) -> Result<Applied> {
    let (base_path, cow_path, output) = (&req.base, &req.cow, &req.output);
    let cow = CowReader::open_with(cow_path, cow::OpenOptions { label: req.label })
        .with_context(|| format!("cannot read COW {}", cow_path.display()))?;
    let base = File::open(base_path).map_err(|e| Error::io("open base", base_path, e))?;
    crate::output::check_dest(output, "the output")?;
    for input in [base_path, cow_path] {
        if same_file(input, output) {
            invalid!(
                "output {} is the same file as input {}",
                output.display(),
                input.display()
            );
        }
    }
    // One reading of the merge state for every command: a merge killed inside its first
    // window has overwritten base blocks while its counter still says 0.
    let progress = merge::progress::read(&cow)?;
    if progress.started() {
        invalid!(
            "{}: its merge is {progress}, so a base is no longer the old image; \
             finish the merge (vabc merge) or serve it (vabc serve) instead",
            cow_path.display(),
        );
    }
    // The manifest describes the whole update: with a label the base is still checked
    // against it (through the whole COW), but the partial result is not the new image.
    let manifest = match req.label {
        None => {
            let m = req.manifest.load(cow_path, &cow)?;
            if let Some(m) = &m {
                crate::trust::check_base(m, progress, &cow, &base, base_path)?;
            }
            m
        }
        Some(_) => {
            let whole = CowReader::open(cow_path)
                .with_context(|| format!("cannot read COW {}", cow_path.display()))?;
            if let Some(m) = req.manifest.load(cow_path, &whole)? {
                crate::trust::check_base(&m, progress, &whole, &base, base_path)?;
            }
            None
        }
    };
    let size = req.size.or(manifest.as_ref().map(|m| m.new.size));
    let view = SnapshotView::new(&cow, &base, base_path, size)?;
    let needed = cow.source_extent();
    if view.base_size() < needed {
        invalid!(
            "{}: base is {} bytes, but the COW {} reads source data up to byte {needed}: wrong base image?",
            base_path.display(),
            view.base_size(),
            cow_path.display()
        );
    }
    let size = view.size();
    if req.size.is_none() && manifest.is_none() {
        crate::trust::bound_without_size(&view, cow_path)?;
    }
    observer.event(Event::Start {
        phase: "apply",
        total: size,
    });
    let last = std::sync::atomic::AtomicU64::new(0);
    let report = |done: u64| {
        let before = last.swap(done, std::sync::atomic::Ordering::Relaxed);
        observer.event(Event::Advance(done.saturating_sub(before)));
    };
    let to = Target {
        req,
        view: &view,
        manifest: manifest.as_ref(),
        size,
    };
    if is_block_device(output) {
        to.write_device(&cow, &base, &report)?;
    } else {
        to.write_file(&report)?;
    }
    observer.event(Event::Finish);
    Ok(Applied {
        size,
        base_checked: manifest.is_some(),
        new_sha256: manifest.map(|m| m.new.sha256),
    })
}

/// Where [`apply()`] writes the view.
struct Target<'a> {
    req: &'a ApplyRequest,
    view: &'a SnapshotView<'a>,
    manifest: Option<&'a Manifest>,
    size: u64,
}

impl Target<'_> {
    /// Written in place, so it cannot be undone: the result is proven first.
    fn write_device(
        &self,
        cow: &CowReader,
        base: &File,
        report: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        let (output, size) = (&self.req.output, self.size);
        if self.manifest.is_some() {
            crate::trust::prove_result(self.manifest, cow, base, &self.req.base, Some(size))?;
        }
        let out = OpenOptions::new()
            .write(true)
            .open(output)
            .map_err(|e| Error::io("open", output, e))?;
        let dev_size = cow::view::file_size(&out, output)?;
        if dev_size < size {
            invalid!(
                "{}: device is {dev_size} bytes, the new image needs {size}",
                output.display()
            );
        }
        self.view.write_to(&out, output, false, report)?;
        out.sync_all().map_err(|e| Error::io("fsync", output, e))?;
        Ok(())
    }

    /// A temporary file, dropped (and so deleted) on any error, renamed once proven.
    fn write_file(&self, report: &(dyn Fn(u64) + Sync)) -> Result<()> {
        let (output, size) = (&self.req.output, self.size);
        let tmp = crate::output::temp_beside(output)?;
        tmp.as_file()
            .set_len(size)
            .map_err(|e| Error::io("size", tmp.path(), e))?;
        // Zeros stay holes: an image that is mostly empty (or an op that names a far
        // block) costs no disk space for them.
        self.view
            .write_to(tmp.as_file(), tmp.path(), true, report)?;
        if let Some(m) = self.manifest {
            // Before the rename: a corrupt COW must not leave a wrong image behind.
            let found = m
                .new
                .first_mismatch(tmp.as_file(), tmp.path(), size, |_| true)?;
            if let Some(mismatch) = found {
                mismatch!(
                    "{} + {} does not make the new image the update promises: {mismatch}; \
                     the COW is corrupt ({} not written)",
                    self.req.base.display(),
                    self.req.cow.display(),
                    output.display()
                );
            }
        }
        crate::output::part_of_output(output, || crate::output::commit(tmp, output))?;
        crate::output::keep_outputs();
        Ok(())
    }
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

/// What [`merge()`] merges, and how.
#[derive(Debug, Clone)]
pub struct MergeRequest {
    /// The base, overwritten with the new image.
    pub base: PathBuf,
    /// The COW; its header and scratch area record the merge's progress, so a merge
    /// run again after an interruption resumes.
    pub cow: PathBuf,
    /// The manifest.
    pub manifest: ManifestChoice,
    /// Merge a COW that has no manifest (one from another tool): its base cannot be
    /// checked. Every op is still decoded before the first write.
    pub without_manifest: bool,
    /// The merge's windows, commits and early writes.
    pub options: merge::MergeOptions,
    /// The I/O engine.
    pub engine: merge::Engine,
    /// io_uring queue depth.
    pub queue_depth: u32,
    /// The uring engine moves data through the page cache instead of `O_DIRECT`.
    pub buffered: bool,
}

/// What [`merge()`] did.
#[derive(Debug, Clone)]
pub struct Merged {
    /// The merge's own report.
    pub report: merge::MergeReport,
    /// The I/O engine that ran ("uring" or "sync").
    pub engine: &'static str,
    /// Seconds the merge took.
    pub seconds: f64,
    /// Seconds the checks before it took.
    pub check_seconds: f64,
    /// Whether the base was checked against a manifest.
    pub base_checked: bool,
    /// Whether the result was proven (every op decoded to the new image) before the
    /// first write.
    pub result_proven: bool,
}

/// Merges the COW into its base in place, crash-safely and resumably. Nothing is
/// written before the base is known to be the right one and, for a merge not yet
/// started, every op is known to decode to the new image (the way Android reads every
/// block of the snapshot through dm-verity before it allows a merge). The observer
/// hears one phase, `merge`, in ops.
pub fn merge(req: &MergeRequest, observer: &dyn Observer) -> Result<Merged> {
    let (base_path, cow_path) = (&req.base, &req.cow);
    let cow = CowReader::open(cow_path)
        .with_context(|| format!("cannot read COW {}", cow_path.display()))?;
    let open_rw = |p: &Path| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .map_err(|e| Error::io("open for writing", p, e))
    };
    let base = open_rw(base_path)?;
    let cow_file = open_rw(cow_path)?;
    let base_size = cow::view::file_size(&base, base_path)?;
    let progress = merge::progress::read(&cow)?;
    let manifest = req.manifest.load(cow_path, &cow)?;
    if manifest.is_none() && !req.manifest.skip && !req.without_manifest {
        invalid!(
            "{}: no manifest ({} is missing), so nothing says which base this COW was made \
             for, and a merge overwrites {} in place: make one with `vabc manifest OLD NEW \
             --cow {}` (or name it with --manifest); --without-manifest merges without it, \
             overwriting a wrong base; nothing was written",
            cow_path.display(),
            Manifest::path_for(cow_path).display(),
            base_path.display(),
            cow_path.display()
        );
    }
    let t_check = Instant::now();
    // Every op still to merge decodes before the first write, whatever else is
    // checked: a payload that does not decode stops the merge with the base intact,
    // not one window in.
    crate::trust::decode_every_op(&cow)?;
    if let Some(m) = &manifest {
        crate::trust::check_base(m, progress, &cow, &base, base_path)?;
    }
    let result_proven = !progress.started() && !req.manifest.skip;
    if result_proven {
        crate::trust::prove_result(manifest.as_ref(), &cow, &base, base_path, None)?;
    }
    let check_seconds = t_check.elapsed().as_secs_f64();
    // Validates the merge order and sizes before anything is written.
    let m = merge::Merge::new(&cow, base_size, base_path.clone(), req.options)?;
    let (mut io, engine) =
        merge::io::open(req.engine, base, cow_file, req.queue_depth, req.buffered)?;
    observer.event(Event::Start {
        phase: "merge",
        total: m.total_ops(),
    });
    let last = std::sync::atomic::AtomicU64::new(0);
    let t = Instant::now();
    let report = m.run(io.as_mut(), &|done, _| {
        let before = last.swap(done, std::sync::atomic::Ordering::Relaxed);
        observer.event(Event::Advance(done.saturating_sub(before)));
    })?;
    let seconds = t.elapsed().as_secs_f64();
    observer.event(Event::Finish);
    if let Some(m) = &manifest {
        check_merged(&report, m, &cow, base_path, cow_path, base_size)?;
    }
    Ok(Merged {
        report,
        engine,
        seconds,
        check_seconds,
        base_checked: manifest.is_some(),
        result_proven,
    })
}

/// A resumed merge trusted the COW's record of what was already merged; the result
/// it claims is checked. Only the regions ops write: the others were checked against
/// the manifest before the merge, and nothing wrote to them since.
fn check_merged(
    report: &merge::MergeReport,
    m: &Manifest,
    cow: &CowReader,
    base_path: &Path,
    cow_path: &Path,
    base_size: u64,
) -> Result<()> {
    if !(report.complete() && report.merged > report.started_at) {
        return Ok(());
    }
    let base = File::open(base_path).map_err(|e| Error::io("open", base_path, e))?;
    let written = crate::trust::written_region_mask(cow, m.new.region_size)?;
    let found = m.new.first_mismatch(&base, base_path, base_size, |r| {
        written.get(r).copied().unwrap_or(false)
    })?;
    if let Some(mismatch) = found {
        mismatch!(
            "{}: the merge is complete but the base is not the new image: {mismatch}; \
             the merge progress recorded in {} did not match the base",
            base_path.display(),
            cow_path.display()
        );
    }
    Ok(())
}
