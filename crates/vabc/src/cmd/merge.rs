//! `vabc merge`: merge a COW into its base image in place, crash-safely.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use merge::MergeOptions;

#[derive(clap::Args)]
pub struct Args {
    /// The base image (file or block device): overwritten with the new image.
    #[arg(long)]
    base: PathBuf,
    /// The COW; its header and scratch area record merge progress, so running
    /// the same command again after an interruption resumes.
    #[arg(long)]
    cow: PathBuf,
    /// I/O engine: `uring` batches each window; `sync` is the per-op
    /// pread/pwrite/fsync baseline (~20x slower); `auto`: uring where this
    /// process may use io_uring (a sysctl or a container's seccomp filter can
    /// forbid it), else sync.
    #[arg(long, value_enum, default_value_t = EngineKind::Auto)]
    engine: EngineKind,
    /// Kept for old scripts: progress is now shown by default (docs/cli.md).
    #[arg(long, hide = true)]
    progress: bool,
    /// uring engine: move data through the page cache instead of O_DIRECT
    /// (aligned transfers use O_DIRECT by default, where the filesystem
    /// supports it).
    #[arg(long)]
    buffered: bool,
    /// io_uring queue depth.
    #[arg(long, default_value_t = 64)]
    queue_depth: u32,
    /// Ordered ops per scratch window (at most 510 with a 2 MiB scratch area).
    #[arg(long, default_value_t = 510)]
    window_ops: usize,
    /// Copy every window through the scratch area, as AOSP's snapuserd does.
    /// By default a window in which no op overwrites another op's source is
    /// written straight to the base: it is just as crash-safe (its sources
    /// survive a crash) with half the writes and syncs.
    #[arg(long)]
    always_scratch: bool,
    /// Write every REPLACE/ZERO block after the ordered ops, as AOSP's
    /// snapuserd does. By default a REPLACE/ZERO block that no op still
    /// reads is written with an ordered window whose destination runs it
    /// joins: fewer, longer writes.
    #[arg(long)]
    no_early_writes: bool,
    /// Print a JSON report (ops, time, syscalls, fsyncs).
    #[arg(long)]
    json: bool,
    /// Pause after this many durable commits (the next run resumes).
    #[arg(long)]
    max_commits: Option<usize>,
    /// Merge a COW that has no manifest (one from another tool): its base cannot be
    /// checked, so a wrong base is overwritten with an image that is neither old nor
    /// new. Every op is still decoded before the first write. `vabc manifest OLD NEW
    /// --cow COW` makes a manifest instead.
    #[arg(long)]
    without_manifest: bool,
    #[command(flatten)]
    check: crate::checks::CheckArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum EngineKind {
    Auto,
    Uring,
    Sync,
}

impl From<EngineKind> for merge::Engine {
    fn from(k: EngineKind) -> Self {
        match k {
            EngineKind::Auto => merge::Engine::Auto,
            EngineKind::Uring => merge::Engine::Uring,
            EngineKind::Sync => merge::Engine::Sync,
        }
    }
}

pub fn run(a: Args) -> Result<ExitCode> {
    let req = ota::snapshot::MergeRequest {
        base: a.base.clone(),
        cow: a.cow.clone(),
        manifest: ota::snapshot::ManifestChoice {
            path: a.check.manifest.clone(),
            skip: a.check.no_base_check,
        },
        without_manifest: a.without_manifest,
        options: MergeOptions {
            window_ops: a.window_ops,
            max_commits: a.max_commits,
            direct_windows: !a.always_scratch,
            early_blocks: if a.no_early_writes {
                0
            } else {
                MergeOptions::default().early_blocks
            },
            ..Default::default()
        },
        engine: a.engine.into(),
        queue_depth: a.queue_depth,
        buffered: a.buffered,
    };
    let done = ota::snapshot::merge(&req, &crate::progress::Bar::new())?;
    let (report, secs) = (&done.report, done.seconds);
    if a.json {
        crate::report::print(MergeReport {
            base: &a.base,
            cow: &a.cow,
            engine: done.engine,
            total_ops: report.total_ops,
            started_at: report.started_at,
            merged: report.merged,
            complete: report.complete(),
            replayed_window: report.replayed_window,
            windows: report.windows,
            direct_windows: report.direct_windows,
            early_blocks: report.early_blocks,
            commits: report.commits,
            seconds: secs,
            check_seconds: done.check_seconds,
            base_checked: done.base_checked,
            result_proven: done.result_proven,
            syscalls: report.io.syscalls,
            reads: report.io.reads,
            writes: report.io.writes,
            fsyncs: report.io.fsyncs,
            read_wait_seconds: report.io.read_wait.as_secs_f64(),
            write_wait_seconds: report.io.write_wait.as_secs_f64(),
            sync_wait_seconds: report.io.sync_wait.as_secs_f64(),
            bytes_read: report.io.bytes_read,
            bytes_written: report.io.bytes_written,
        })?;
    } else if report.started_at == report.total_ops {
        println!(
            "{}: merge already complete ({} ops)",
            a.cow.display(),
            report.total_ops
        );
    } else {
        let resumed = if report.started_at > 0 {
            format!(" (resumed at op {})", report.started_at)
        } else {
            String::new()
        };
        println!(
            "merged {} of {} ops into {}{resumed} in {secs:.2} s ({} syscalls, {} fsyncs)",
            report.merged - report.started_at,
            report.total_ops,
            a.base.display(),
            report.io.syscalls,
            report.io.fsyncs
        );
        if !report.complete() {
            println!(
                "paused after {} of {} ops; run again to resume",
                report.merged, report.total_ops
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `vabc merge --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct MergeReport<'a> {
    base: &'a std::path::Path,
    cow: &'a std::path::Path,
    engine: &'static str,
    total_ops: u64,
    started_at: u64,
    merged: u64,
    complete: bool,
    replayed_window: bool,
    windows: u64,
    direct_windows: u64,
    early_blocks: u64,
    commits: u64,
    seconds: f64,
    check_seconds: f64,
    base_checked: bool,
    result_proven: bool,
    syscalls: u64,
    reads: u64,
    writes: u64,
    fsyncs: u64,
    read_wait_seconds: f64,
    write_wait_seconds: f64,
    sync_wait_seconds: f64,
    bytes_read: u64,
    bytes_written: u64,
}
