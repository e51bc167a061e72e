//! Mount points: a free folder to mount on, and whether a path is mounted on. Both
//! the FUSE export and the mount stack ask; neither owns the question.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::{Result, ServeError, io_err};

/// `dir`, canonical, if it is an existing directory that nothing is mounted on yet: where
/// a FUSE export or a filesystem may be mounted.
pub(crate) fn free_mount_dir(dir: &Path) -> Result<PathBuf> {
    let meta = std::fs::metadata(dir).map_err(io_err("mount point", dir))?;
    if !meta.is_dir() {
        return Err(ServeError::Invalid {
            path: dir.to_path_buf(),
            msg: "mount point is not a directory".into(),
        });
    }
    let dir = dir.canonicalize().map_err(io_err("resolve", dir))?;
    if is_mount_point(&dir)? {
        return Err(ServeError::Busy { path: dir });
    }
    Ok(dir)
}

/// Whether `path` (canonical) is the mount point of some mount in this namespace.
pub fn is_mount_point(path: &Path) -> Result<bool> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(io_err("read", "/proc/self/mountinfo"))?;
    let want = path.as_os_str().as_bytes();
    Ok(info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mountinfo(mp) == want))
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape_mountinfo(r"/mnt/a\040b"), b"/mnt/a b");
        assert_eq!(unescape_mountinfo(r"/x\\y"), br"/x\\y");
        assert_eq!(unescape_mountinfo(r"/x\134y"), br"/x\y");
    }
}
