//! Outputs are written to a temporary file beside their destination and renamed over it
//! only once complete and synced: an error never leaves a half-written output behind
//! (the temporary file is deleted when dropped), and neither does SIGINT, SIGTERM or
//! SIGHUP ([`on_signal_remove_temps`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tempfile::NamedTempFile;

use crate::error::{Context, Error, Result};

/// A temporary file in `dest`'s directory (same file system, so the final rename is
/// atomic), named `.NAME.XXXXXX.tmp` after `dest`.
pub fn temp_beside(dest: &Path) -> Result<NamedTempFile> {
    registered(
        || {
            vabc_io::temp::temp_beside(dest).with_context(|| {
                format!("create a temporary file in {}", parent_of(dest).display())
            })
        },
        |t| t.path().to_path_buf(),
    )
}

/// A temporary folder beside `dest` (`.vabc-WHAT.XXXXXX`), removed with what it holds
/// on a signal, on drop, and by `vabc cleanup` after a SIGKILL.
pub fn temp_dir_beside(dest: &Path, what: &str) -> Result<tempfile::TempDir> {
    let dir = parent_of(dest);
    registered(
        || {
            tempfile::Builder::new()
                .prefix(&format!(".vabc-{what}."))
                .tempdir_in(&dir)
                .with_context(|| format!("create a work folder in {}", dir.display()))
        },
        |t| t.path().to_path_buf(),
    )
}

/// Refuses an output path (given as `option`) that cannot become a file: an existing
/// folder, or one in a folder that does not exist. Checked before any work, so that a
/// long run does not end in a failed rename.
pub fn check_dest(dest: &Path, option: &str) -> Result<()> {
    if dest.is_dir() {
        crate::error::invalid!(
            "{option} {}: is a folder; name the file to write (e.g. {})",
            dest.display(),
            dest.join("update.vabc").display()
        );
    }
    let dir = parent_of(dest);
    if !dir.is_dir() {
        crate::error::invalid!(
            "{option} {}: the folder {} does not exist; create it first",
            dest.display(),
            dir.display()
        );
    }
    Ok(())
}

use vabc_io::temp::parent_of;

/// A temporary file `.NAME.XXXXXX.tmp` in `dir`, registered (for writers in other
/// crates: `delta::Progress::make_temp`).
pub fn temp_in(dir: &Path, name: &str) -> std::io::Result<NamedTempFile> {
    registered(
        || vabc_io::temp::temp_in(dir, name),
        |t| t.path().to_path_buf(),
    )
}

/// Writes `dest` with `write`, one of several files that together are a command's
/// output (a COW, its manifest and tree): from the moment it is in place until
/// [`keep_outputs`], an interrupt or an error removes it, so that a command that
/// did not finish leaves none of them.
pub fn part_of_output<T, E>(
    dest: &Path,
    write: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    // Registered before it is written (renamed into place), so that no moment is left
    // where it is there and unregistered; an interrupt before the rename removes the
    // file it was about to replace, which the command was replacing anyway. Never a
    // device or a folder.
    let regular = std::fs::symlink_metadata(dest).map_or(true, |m| m.is_file());
    if regular {
        OUTPUTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dest.to_path_buf());
    }
    write()
}

/// The command finished: the files written with [`part_of_output`] stay, and a
/// signal from now on no longer ends it (it is about to exit with 0).
pub fn keep_outputs() {
    // Under the signal thread's lock: a signal is handled wholly before this (and the
    // outputs removed) or finds the command finished.
    let _pending = lock();
    OUTPUTS.lock().unwrap_or_else(|p| p.into_inner()).clear();
    FINISHED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Outputs of an unfinished command ([`part_of_output`]): removed by a signal or an
/// error, not recorded for `vabc cleanup` (they are not temporary names, and a
/// SIGKILL leaves a command's outputs as they are, as it does any program's).
static OUTPUTS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Makes a temporary file or folder and registers it in one step: the signal thread
/// takes the same lock, so nothing is created that a signal could leave behind.
fn registered<T, E>(
    make: impl FnOnce() -> std::result::Result<T, E>,
    path: impl Fn(&T) -> PathBuf,
) -> std::result::Result<T, E> {
    let mut pending = lock();
    let made = make()?;
    pending.push(path(&made));
    persist(&pending);
    Ok(made)
}

/// Registers a temporary file made elsewhere (the COW writer's, or one about to be
/// created under a fixed name) for removal on a signal.
pub fn pending(path: &Path) {
    let mut pending = lock();
    pending.push(path.to_path_buf());
    persist(&pending);
}

/// The temporary files and folders not yet renamed into place (some may be gone
/// already, deleted on an error): what a signal must remove.
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The record of them that `vabc cleanup` reads should this process be killed.
static RECORD: Mutex<Option<serve::leftovers::RecordFile>> = Mutex::new(None);

fn lock() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    PENDING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Rewrites this process's record of its temporary files (or removes it when there
/// are none). Best effort: without a writable run folder, a SIGKILL's leftovers are
/// not found by `vabc cleanup`, and nothing else changes.
fn persist(pending: &[PathBuf]) {
    let mut record = RECORD.lock().unwrap_or_else(|p| p.into_inner());
    if pending.is_empty() {
        *record = None; // removes the file
        return;
    }
    let Ok(mut rec) = serve::leftovers::Record::for_self() else {
        return;
    };
    rec.temps = pending
        .iter()
        .map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone()))
        .collect();
    match rec.write_as(&serve::leftovers::run_dir(), "temps") {
        Ok(f) => {
            // The file is rewritten in place: forget the old handle without deleting.
            if let Some(old) = record.replace(f) {
                std::mem::forget(old);
            }
        }
        Err(e) => log::debug!("vabc: no record of temporary files: {e}"),
    }
}

/// Forgets `path` (renamed into place, or removed).
fn done(path: &Path) {
    let mut pending = lock();
    pending.retain(|p| p != path);
    persist(&pending);
}

/// Removes every temporary file and folder still registered (the command ends, with
/// or without an error), this process's record of them, and the outputs of a command
/// that did not finish ([`part_of_output`]).
pub fn remove_pending() {
    remove_locked(&mut lock());
}

fn remove_locked(pending: &mut Vec<PathBuf>) {
    for p in pending.drain(..) {
        let _ = serve::leftovers::remove_temp(&p);
    }
    persist(pending);
    for o in OUTPUTS.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
        // A folder only if it is empty: what it holds is a resumable command's work.
        let _ = match o.is_dir() {
            true => std::fs::remove_dir(o),
            false => std::fs::remove_file(o),
        };
    }
}

/// Set by [`keep_outputs`]: the command's outputs are complete, and a signal from
/// then on is left to the command's own imminent exit.
static FINISHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// On SIGINT, SIGTERM or SIGHUP: delete every pending temporary file and folder, say
/// so (with `note`, e.g. how to resume), and exit with 128 + the signal's number, as a
/// shell reports a process killed by it. After [`keep_outputs`] the command has
/// finished; it is not cut short then, so that an exit status from a signal always
/// means nothing was written.
pub fn on_signal_remove_temps(note: &'static str) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("install signal handlers")?;
    std::thread::Builder::new()
        .name("vabc-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                // Held until exit: no other thread registers a file from here on.
                let mut pending = lock();
                if FINISHED.load(std::sync::atomic::Ordering::SeqCst) {
                    drop(pending);
                    return;
                }
                eprintln!("vabc: interrupted; {note}");
                // The record first, the files last and the exit at once: the command's
                // threads run on meanwhile, and one may create a file it registered
                // before it made it (an install's `.NAME.cow.PID.installing`) between the
                // removal and the end. That window is a few unlink calls wide.
                *RECORD.lock().unwrap_or_else(|p| p.into_inner()) = None;
                remove_locked(&mut pending);
                // SAFETY: _exit ends the process at once; stderr is unbuffered and
                // nothing else is left to flush.
                unsafe { libc::_exit(128 + sig) };
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
    // Temporary files are created 0600; the output gets the mode any new file would.
    set_default_mode(tmp.path())?;
    let path = tmp.path().to_path_buf();
    let r = tmp
        .persist(dest)
        .map_err(|e| Error::from(e.error))
        .with_context(|| {
            format!(
                "rename the temporary file {} to {}",
                path.display(),
                dest.display()
            )
        });
    done(&path);
    r.map(|_| ())
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
