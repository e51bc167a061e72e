//! Outputs written to a temporary file beside their destination and renamed over it
//! once complete and synced: an error never leaves a half-written output behind (the
//! temporary file is deleted when dropped). Same folder, same file system, so the
//! rename is atomic.

use std::io;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

/// A temporary file `.NAME.XXXXXX.tmp` in `dir`, named after the output NAME it will
/// become.
pub fn temp_in(dir: &Path, name: &str) -> io::Result<NamedTempFile> {
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
}

/// A temporary file beside `dest` ([`temp_in`] its folder, after its name).
pub fn temp_beside(dest: &Path) -> io::Result<NamedTempFile> {
    temp_in(&parent_of(dest), &name_of(dest))
}

/// The folder `dest` is in (`.` for a bare name).
pub fn parent_of(dest: &Path) -> PathBuf {
    match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn name_of(dest: &Path) -> String {
    dest.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Syncs `tmp` and renames it to `dest`, then syncs `dest`'s folder so that the rename
/// survives a power cut.
pub fn persist(tmp: NamedTempFile, dest: &Path) -> crate::Result<std::fs::File> {
    tmp.as_file()
        .sync_all()
        .map_err(crate::error::on("sync", tmp.path()))?;
    let file = tmp
        .persist(dest)
        .map_err(|e| crate::Error::new("rename the finished output to", dest, e.error))?;
    let dir = parent_of(dest);
    std::fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(crate::error::on("sync the folder", &dir))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_temp_lives_beside_its_output_until_renamed_over_it() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.cow");
        let mut t = temp_beside(&dest).unwrap();
        let name = t.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(".out.cow.") && name.ends_with(".tmp"),
            "{name}"
        );
        assert_eq!(t.path().parent(), Some(dir.path()));
        std::io::Write::write_all(&mut t, b"done").unwrap();
        persist(t, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"done");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert_eq!(parent_of(Path::new("x")), PathBuf::from("."));
    }
}
