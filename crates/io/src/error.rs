//! One I/O error for every crate: what was being done, to which file, where in it, and
//! the operating system's error, whose errno stays reachable through
//! [`Error::errno`] (a caller tells `ENOSPC` from `EIO` without parsing text).

use std::borrow::Cow;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// An I/O failure: `cannot OP PATH [at offset N]: SOURCE`.
#[derive(Debug, thiserror::Error)]
#[error("cannot {op} {}{}: {source}", .path.display(), Offset(*.offset))]
pub struct Error {
    /// What was being done, a verb phrase the path completes ("read", "open",
    /// "rename the finished COW to").
    pub op: Cow<'static, str>,
    /// The file, device or folder.
    pub path: PathBuf,
    /// Byte offset in it, where the operation had one.
    pub offset: Option<u64>,
    /// The operating system's error.
    #[source]
    pub source: io::Error,
}

/// A result whose error is an [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

struct Offset(Option<u64>);

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(o) => write!(f, " at offset {o}"),
            None => Ok(()),
        }
    }
}

impl Error {
    /// `op` on `path` failed with `source`.
    pub fn new(
        op: impl Into<Cow<'static, str>>,
        path: impl Into<PathBuf>,
        source: io::Error,
    ) -> Error {
        Error {
            op: op.into(),
            path: path.into(),
            offset: None,
            source,
        }
    }

    /// The same error, at byte `offset` of the file.
    #[must_use]
    pub fn at(mut self, offset: u64) -> Error {
        self.offset = Some(offset);
        self
    }

    /// The operating system's error number, when the failure came from a system call.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }

    /// The kind of the underlying error.
    pub fn kind(&self) -> io::ErrorKind {
        self.source.kind()
    }
}

/// A `map_err` adapter: `file.sync_all().map_err(on("sync", path))?`.
pub fn on<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::new(op, path, source)
}

/// [`on`] at byte `offset`: `f.read_exact_at(b, o).map_err(at("read", path, o))?`.
pub fn at<'a>(
    op: &'static str,
    path: &'a Path,
    offset: u64,
) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::new(op, path, source).at(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_op_the_path_and_the_offset_and_keeps_the_errno() {
        let e = at("read", Path::new("/x/base.img"), 8192)(io::Error::from_raw_os_error(libc::EIO));
        assert!(
            e.to_string()
                .starts_with("cannot read /x/base.img at offset 8192: "),
            "{e}"
        );
        assert_eq!(e.errno(), Some(libc::EIO));
        let e = on("open", Path::new("/x/y"))(io::ErrorKind::NotFound.into());
        assert!(e.to_string().starts_with("cannot open /x/y: "), "{e}");
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert_eq!(e.errno(), None);
    }
}
