//! `vabc cleanup`: remove what killed vabc processes left behind: a daemon's dead FUSE
//! mounts, the file systems and loop devices stacked on them and its ublk devices,
//! and a writing command's temporary files and folders, as each recorded them. See
//! `serve::leftovers`.

use std::process::ExitCode;

use anyhow::Context;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print what was removed as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let dir = serve::leftovers::run_dir();
    let removed = serve::leftovers::cleanup(&dir)
        .with_context(|| format!("clean up after daemons recorded in {}", dir.display()))?;
    let failed = removed.iter().filter(|r| r.error.is_some()).count();
    if a.json {
        crate::report::print(CleanupReport {
            run_dir: &dir,
            removed: &removed,
            failed,
        })?;
    } else {
        for r in &removed {
            match &r.error {
                None => println!("removed {} {} (left by vabc pid {})", r.kind, r.what, r.pid),
                Some(e) => eprintln!(
                    "vabc cleanup: could not remove {} {} (left by vabc pid {}): {e}",
                    r.kind, r.what, r.pid
                ),
            }
        }
        if removed.is_empty() {
            println!("nothing to clean up");
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `vabc cleanup --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct CleanupReport<'a> {
    run_dir: &'a std::path::Path,
    removed: &'a [serve::leftovers::Removed],
    failed: usize,
}
