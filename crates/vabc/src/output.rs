//! Outputs are written to a temporary file beside their destination and renamed over it
//! only once complete and synced: an error never leaves a half-written output behind
//! (the temporary file is deleted when dropped).

use std::path::{Path, PathBuf};

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
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(&dir)
        .with_context(|| format!("create a temporary file in {}", dir.display()))
}

/// Syncs `tmp` and renames it to `dest`.
pub fn commit(tmp: NamedTempFile, dest: &Path) -> Result<()> {
    tmp.as_file()
        .sync_all()
        .with_context(|| format!("fsync {}", tmp.path().display()))?;
    tmp.persist(dest)
        .with_context(|| format!("rename the temporary file to {}", dest.display()))?;
    Ok(())
}

/// Writes `data` to `dest` through a synced temporary file and a rename.
pub fn write_atomic(dest: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut tmp = temp_beside(dest)?;
    tmp.write_all(data)
        .with_context(|| format!("write {}", tmp.path().display()))?;
    commit(tmp, dest)
}
