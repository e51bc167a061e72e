//! What a killed `vabc serve` leaves behind, and how to remove it.
//!
//! A daemon that ends normally tears down everything it set up. One that is killed
//! (SIGKILL, the OOM killer, a crash) cannot: the kernel keeps a dead FUSE mount
//! (reads fail with `ENOTCONN`), the file system mounted on top of it, and a ublk
//! device whose block node is gone but whose `/dev/ublkcN` stays until someone sends
//! `DEL_DEV`. None of these ever serve wrong data: every read of them fails.
//!
//! So that they can be removed without guessing, a serving daemon writes a [`Record`]
//! of what it set up into [`run_dir`] once it is ready, and deletes it when it has torn
//! everything down. [`cleanup`] (`vabc cleanup`) reads the records of daemons that are
//! no longer running and removes what they name, in the reverse order of set-up:
//! the file system mount, the loop device, the FUSE mount, the ublk device. A process
//! is identified by its pid and its start time, so a reused pid is not mistaken for
//! the daemon.
//!
//! Commands that write files (`diff`, `apply`, `bundle`, `update`) record their
//! temporary files and folders the same way ([`Record::temps`], `temps-PID.json`),
//! so that what a SIGKILL left is found too. Only names vabc gives its temporary
//! files are removed ([`is_temp_name`]): a record is input like any file, and a
//! forged one must not be able to delete anything else.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{ServeError, io_err};

/// Where records live: `$VABC_RUN_DIR`, else `/run/vabc` for root, else
/// `$XDG_RUNTIME_DIR/vabc`, else a per-user folder under the temporary directory.
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("VABC_RUN_DIR") {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/vabc");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("vabc"),
        None => std::env::temp_dir().join(format!("vabc-{uid}")),
    }
}

/// What one serving daemon set up.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Record {
    pub pid: u32,
    /// Field 22 of `/proc/PID/stat` (clock ticks after boot).
    pub start_time: u64,
    /// N of `/dev/ublkbN`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_dev_id: Option<u32>,
    /// Where the FUSE export is mounted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fuse_dir: Option<PathBuf>,
    /// Loop devices over the FUSE file: number and backing file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loop_devices: Vec<(u32, PathBuf)>,
    /// The new image's file system, mounted by `--mount`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_target: Option<PathBuf>,
    /// Temporary files and folders not yet renamed into place or removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub temps: Vec<PathBuf>,
}

/// Whether `path` has a name vabc gives its temporary files and folders: a dot, then
/// `vabc-` or a `.tmp` / `.installing` ending (`.u.cow.Ab12Cd.tmp`,
/// `.system.cow.4242.installing`, `.vabc-bundle.Ab12Cd`).
pub fn is_temp_name(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
        n.len() > 1
            && n.starts_with('.')
            && (n.starts_with(".vabc-") || n.ends_with(".tmp") || n.ends_with(".installing"))
    })
}

/// Removes a temporary file or folder (a folder with what it holds; a symbolic link
/// itself, never what it points to); gone already is fine.
pub fn remove_temp(path: &Path) -> io::Result<()> {
    let r = match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => remove_folder(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Removes a work folder that the command's other threads may still be writing into
/// (a signal's removal runs while they go on). It is renamed aside first: a thread
/// that creates a file in it by its path then fails instead of re-filling a folder
/// `remove_dir_all` has already emptied, which would leave it behind (ENOTEMPTY).
/// The new name is a temporary one too, so a SIGKILL in between leaves nothing
/// `vabc cleanup` would not recognise.
fn remove_folder(path: &Path) -> io::Result<()> {
    let aside = path.file_name().map(|n| {
        let mut n = n.to_os_string();
        n.push(".removing.tmp");
        path.with_file_name(n)
    });
    let target = match aside {
        Some(a) if std::fs::rename(path, &a).is_ok() => a,
        _ => path.to_path_buf(),
    };
    std::fs::remove_dir_all(target)
}

/// A record on disk; removed on drop (after a clean tear-down).
#[derive(Debug)]
pub struct RecordFile {
    path: PathBuf,
}

impl Drop for RecordFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Record {
    /// A record for this process.
    pub fn for_self() -> Result<Record, ServeError> {
        let pid = std::process::id();
        let start_time = start_time(pid).map_err(io_err("read", "/proc/self/stat"))?;
        Ok(Record {
            pid,
            start_time,
            ..Record::default()
        })
    }

    /// Writes the record into `dir` ([`run_dir`] outside tests): a temporary file,
    /// then a rename.
    pub fn write(&self, dir: &Path) -> Result<RecordFile, ServeError> {
        self.write_as(dir, "serve")
    }

    /// Writes the record as `KIND-PID.json` in `dir`: `serve` for a daemon's set-up,
    /// `temps` for a command's temporary files (rewritten as they come and go).
    pub fn write_as(&self, dir: &Path, kind: &str) -> Result<RecordFile, ServeError> {
        // Writable by its owner only, whatever the umask: `cleanup` believes no other.
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o755)
            .create(dir)
            .map_err(io_err("create", dir))?;
        let path = dir.join(format!("{kind}-{}.json", self.pid));
        let tmp = dir.join(format!(".{kind}-{}.json.tmp", self.pid));
        let text = serde_json::to_string_pretty(self).map_err(|e| ServeError::Invalid {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        std::fs::write(&tmp, text).map_err(io_err("write", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err("rename to", &path))?;
        Ok(RecordFile { path })
    }

    /// Whether the process that wrote the record is still running.
    pub fn is_running(&self) -> bool {
        start_time(self.pid).is_ok_and(|t| t == self.start_time)
    }
}

fn start_time(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may contain spaces and parentheses: fields after it
    // start after its last ')'.
    let rest = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or_else(|| io::Error::other("malformed /proc/PID/stat"))?;
    rest.split_whitespace()
        .nth(19)
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| io::Error::other("malformed /proc/PID/stat"))
}

/// One thing [`cleanup`] removed, or failed to remove.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct Removed {
    /// The daemon that left it behind.
    pub pid: u32,
    /// `mount`, `loop`, `fuse`, `ublk`, `temp`, or `record`.
    pub kind: &'static str,
    pub what: String,
    /// `None` when removed (or already gone); else why not.
    pub error: Option<String>,
}

/// Removes what dead daemons left behind, as recorded in `dir` (see the module documentation). Records of
/// running daemons are left alone. A record is deleted once everything it names is
/// gone; on a failure it stays, so a later run can try again.
pub fn cleanup(dir: &Path) -> Result<Vec<Removed>, ServeError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read", dir)(e)),
    };
    // Records say what to unmount and delete: only a folder no one else can write
    // is believed (a shared /tmp/vabc-UID could be made by another user first).
    {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::symlink_metadata(dir).map_err(io_err("stat", dir))?;
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        if !md.is_dir() || md.uid() != me || md.mode() & 0o022 != 0 {
            return Err(ServeError::Invalid {
                path: dir.to_path_buf(),
                msg: format!(
                    "not a folder of uid {me} that only it can write (owner {}, mode {:o}): \
                     its records are not trusted; nothing was removed",
                    md.uid(),
                    md.mode() & 0o7777
                ),
            });
        }
    }
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                (n.starts_with("serve-") || n.starts_with("temps-")) && n.ends_with(".json")
            })
        })
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for path in paths {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            // Its process ended cleanly between the listing and now, and removed its
            // own record: nothing of it is left to clean.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err("read", &path)(e)),
        };
        let rec: Record = serde_json::from_str(&text).map_err(|e| ServeError::Invalid {
            path: path.clone(),
            msg: format!("not a vabc record: {e}"),
        })?;
        if rec.is_running() {
            continue;
        }
        let before = out.len();
        remove_all(&rec, &mut out);
        if out[before..].iter().all(|r| r.error.is_none()) {
            let error = std::fs::remove_file(&path).err().map(|e| e.to_string());
            out.push(Removed {
                pid: rec.pid,
                kind: "record",
                what: path.display().to_string(),
                error,
            });
        }
    }
    Ok(out)
}

fn remove_all(rec: &Record, out: &mut Vec<Removed>) {
    let mut note = |kind, what: String, r: Result<(), ServeError>| {
        out.push(Removed {
            pid: rec.pid,
            kind,
            what,
            error: r.err().map(|e| e.to_string()),
        })
    };
    if let Some(t) = &rec.mount_target {
        note("mount", t.display().to_string(), unmount_detached(t));
    }
    for (n, backing) in &rec.loop_devices {
        note(
            "loop",
            format!("/dev/loop{n}"),
            crate::mount::LoopDevice::detach_leftover(*n, backing),
        );
    }
    if let Some(d) = &rec.fuse_dir {
        note("fuse", d.display().to_string(), unmount_detached(d));
    }
    for t in &rec.temps {
        let r = if is_temp_name(t) {
            remove_temp(t).map_err(io_err("remove", t))
        } else {
            Err(ServeError::Invalid {
                path: t.clone(),
                msg: "not a name vabc gives a temporary file: left alone".into(),
            })
        };
        note("temp", t.display().to_string(), r);
    }
    if let Some(id) = rec.ublk_dev_id {
        let r = crate::ublk::KernelTransport::open()
            .and_then(|t| t.delete_leftover(id))
            .map_err(|e| ServeError::Invalid {
                path: PathBuf::from(format!("/dev/ublkc{id}")),
                msg: e.to_string(),
            });
        note("ublk", format!("/dev/ublkc{id}"), r);
    }
}

/// Detaches the mount on `path` (`umount -l`), if there is one: a dead FUSE mount
/// cannot be unmounted any other way while something still holds it.
fn unmount_detached(path: &Path) -> Result<(), ServeError> {
    let Ok(canon) = path.canonicalize() else {
        // ENOTCONN on a dead FUSE mount point itself: try the path as given.
        return umount2_detach(path);
    };
    if !crate::mount::is_mount_point(&canon)? {
        return Ok(());
    }
    umount2_detach(&canon)
}

fn umount2_detach(path: &Path) -> Result<(), ServeError> {
    use std::os::unix::ffi::OsStrExt;
    let c =
        std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| ServeError::Invalid {
            path: path.into(),
            msg: "path contains a NUL byte".into(),
        })?;
    // SAFETY: `c` is a NUL-terminated path valid for the call.
    let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        // EINVAL: not a mount point (already gone).
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(io_err("unmount", path)(e));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_start_time_identifies_this_process() {
        let me = Record::for_self().unwrap();
        assert!(me.is_running());
        let other = Record {
            start_time: me.start_time + 1,
            ..me.clone()
        };
        assert!(
            !other.is_running(),
            "a reused pid must not count as the daemon"
        );
    }

    #[test]
    fn records_round_trip_and_only_dead_ones_are_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let me = Record::for_self().unwrap();
        let live = me.write(dir.path()).unwrap();
        let dead = Record {
            pid: u32::MAX - 1,
            start_time: 1,
            ..Record::default()
        };
        let _dead_file = dead.write(dir.path()).unwrap();
        let removed = cleanup(dir.path()).unwrap();
        assert_eq!(removed.len(), 1, "{removed:?}");
        assert_eq!((removed[0].pid, removed[0].kind), (u32::MAX - 1, "record"));
        assert!(dir.path().join(format!("serve-{}.json", me.pid)).exists());
        assert!(
            !dir.path()
                .join(format!("serve-{}.json", u32::MAX - 1))
                .exists()
        );
        drop(live);
        assert!(!dir.path().join(format!("serve-{}.json", me.pid)).exists());
    }

    #[test]
    fn records_in_a_folder_others_can_write_are_not_believed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join(".precious.tmp");
        std::fs::write(&victim, b"keep").unwrap();
        let rec = Record {
            pid: u32::MAX - 3,
            start_time: 1,
            temps: vec![victim.clone()],
            ..Record::default()
        };
        let _f = rec.write_as(dir.path(), "temps").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = cleanup(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not trusted"), "{e}");
        assert!(victim.exists());
    }

    #[test]
    fn a_work_folder_being_filled_is_removed_whole() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..20 {
            let folder = dir.path().join(format!(".vabc-bundle.R{round}"));
            std::fs::create_dir(&folder).unwrap();
            for i in 0..200 {
                std::fs::write(folder.join(format!("old{i}")), b"x").unwrap();
            }
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let writer = {
                let (folder, stop) = (folder.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut i = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = std::fs::write(folder.join(format!("new{i}")), b"x");
                        i += 1;
                    }
                })
            };
            remove_temp(&folder).unwrap();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            writer.join().unwrap();
            let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
            assert!(left.is_empty(), "round {round}: {left:?}");
        }
    }

    #[test]
    fn a_dead_commands_temporary_files_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let file = d.join(".u.cow.Ab12Cd.tmp");
        let folder = d.join(".vabc-bundle.Xy");
        let other = d.join("precious.img");
        let link = d.join(".link.tmp");
        std::fs::write(&file, b"x").unwrap();
        std::fs::create_dir(&folder).unwrap();
        std::fs::write(folder.join("system.cow"), b"x").unwrap();
        std::fs::write(&other, b"keep").unwrap();
        std::os::unix::fs::symlink(&other, &link).unwrap();
        let rec = Record {
            pid: u32::MAX - 2,
            start_time: 1,
            temps: vec![file.clone(), folder.clone(), other.clone(), link.clone()],
            ..Record::default()
        };
        let _f = rec.write_as(d, "temps").unwrap();
        let removed = cleanup(d).unwrap();
        assert!(!file.exists() && !folder.exists() && !link.exists());
        assert_eq!(
            std::fs::read(&other).unwrap(),
            b"keep",
            "not a temporary name"
        );
        let refused: Vec<_> = removed.iter().filter(|r| r.error.is_some()).collect();
        assert_eq!(refused.len(), 1, "{removed:?}");
        assert!(refused[0].what.ends_with("precious.img"));
        // The record stays (one entry was refused) for someone to look at.
        assert!(d.join(format!("temps-{}.json", u32::MAX - 2)).exists());
    }
}
