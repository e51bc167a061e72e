//! Outputs are written to a temporary file beside their destination and renamed over it
//! only once complete and synced: an error never leaves a half-written output behind
//! (the temporary file is deleted when dropped), and neither does SIGINT, SIGTERM or
//! SIGHUP ([`on_signal_remove_temps`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};
use tempfile::NamedTempFile;

/// A temporary file in `dest`'s directory (same file system, so the final rename is
/// atomic), named `.NAME.XXXXXX.tmp` after `dest`.
pub fn temp_beside(dest: &Path) -> Result<NamedTempFile> {
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(&dir)
        .with_context(|| format!("create a temporary file in {}", dir.display()))?;
    pending(tmp.path());
    Ok(tmp)
}

/// Registers a temporary file made elsewhere (the COW writer's) for removal on a signal.
pub fn pending(path: &Path) {
    PENDING
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(path.to_path_buf());
}

/// Temporary files not yet renamed into place (some may be gone already, deleted on an
/// error): what a signal must remove.
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// On SIGINT, SIGTERM or SIGHUP: delete every pending temporary file, say so (with
/// `note`, e.g. how to resume), and exit with 128 + the signal's number, as a shell
/// reports a process killed by it.
pub fn on_signal_remove_temps(note: &'static str) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("install signal handlers")?;
    std::thread::Builder::new()
        .name("vabc-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                let pending = PENDING.lock().unwrap_or_else(|p| p.into_inner());
                for p in pending.iter() {
                    let _ = std::fs::remove_file(p);
                }
                eprintln!("vabc: interrupted; {note}");
                std::process::exit(128 + sig);
            }
        })
        .context("start the signal thread")?;
    Ok(())
}

/// Syncs `tmp` and renames it to `dest`.
pub fn commit(tmp: NamedTempFile, dest: &Path) -> Result<()> {
    tmp.as_file()
        .sync_all()
        .with_context(|| format!("fsync {}", tmp.path().display()))?;
    PENDING
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|p| p != tmp.path());
    // Temporary files are created 0600; the output gets the mode any new file would.
    set_default_mode(tmp.path())?;
    tmp.persist(dest)
        .with_context(|| format!("rename the temporary file to {}", dest.display()))?;
    Ok(())
}

/// Gives a regular file the mode a newly created file gets (0666 less the umask);
/// leaves devices alone.
pub fn set_default_mode(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let md = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
    if !md.is_file() {
        return Ok(());
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666 & !umask()))
        .with_context(|| format!("chmod {}", path.display()))
}

/// The process's umask, from /proc (setting it to read it back would race with other
/// threads creating files); 022 if /proc does not say.
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

/// Writes `data` to `dest` through a synced temporary file and a rename.
pub fn write_atomic(dest: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut tmp = temp_beside(dest)?;
    tmp.write_all(data)
        .with_context(|| format!("write {}", tmp.path().display()))?;
    commit(tmp, dest)
}
