//! One error type for the application: what failed, with the file, the step and the
//! cause, and whether the failure is a [`Error::Mismatch`] (data other than it must
//! be) that a caller reports differently from a failure that kept it from deciding.

use std::path::PathBuf;

/// What an application step returns.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the application's steps. Messages name the file and, where one is
/// known, the offset; [`Error::Context`] adds the step that failed in front of its
/// cause, which stays reachable through [`std::error::Error::source`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A check found data other than it must be: a wrong base, a result that is not
    /// the new image, a store that was altered, a bundle the device refuses. Nothing
    /// was written because of it.
    #[error("{0}")]
    Mismatch(String),
    /// The booted base is half merged and the update cannot be served: no root may be
    /// mounted. Carries the reason the update could not be served as its source.
    #[error("{msg}")]
    HalfMerged {
        /// What the boot found.
        msg: String,
        /// Why the update could not be served.
        #[source]
        source: Box<Error>,
    },
    /// A request the application cannot carry out as given (a bad option value, a
    /// partition named twice, not enough space).
    #[error("{0}")]
    Invalid(String),
    /// A system call on a file failed: what was done, to which file, and the
    /// operating system's error ([`vabc_io::Error::errno`]).
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    /// A step that failed, and why.
    #[error("{msg}")]
    Context {
        /// The step.
        msg: String,
        /// The cause.
        #[source]
        source: Box<Error>,
    },
    /// An I/O error whose file the caller names in a [`Error::Context`].
    #[error(transparent)]
    Os(#[from] std::io::Error),
    /// Reading, writing or checking a bundle.
    #[error(transparent)]
    Bundle(#[from] bundle::BundleError),
    /// Reading a COW.
    #[error(transparent)]
    Cow(#[from] cow::CowError),
    /// Planning or writing a COW.
    #[error(transparent)]
    Delta(#[from] delta::DeltaError),
    /// A manifest sidecar.
    #[error(transparent)]
    Manifest(#[from] manifest::ManifestError),
    /// A merge.
    #[error(transparent)]
    Merge(#[from] merge::MergeError),
    /// The device's update store.
    #[error(transparent)]
    Update(#[from] update::UpdateError),
    /// A dm-verity tree or superblock.
    #[error(transparent)]
    Verity(#[from] verity::Error),
    /// Serving an image.
    #[error(transparent)]
    Serve(#[from] serve::ServeError),
    /// A JSON report or record.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl Error {
    /// An I/O error of `op` (a verb phrase the path completes: "open", "rename the
    /// COW to") on `path`.
    pub fn io(op: impl Into<String>, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io(vabc_io::Error::new(op.into(), path, source))
    }

    /// This error, or one of its causes, is a [`Error::Mismatch`].
    pub fn is_mismatch(&self) -> bool {
        self.find(|e| matches!(e, Error::Mismatch(_)))
    }

    /// This error, or one of its causes, is a [`Error::HalfMerged`].
    pub fn is_half_merged(&self) -> bool {
        self.find(|e| matches!(e, Error::HalfMerged { .. }))
    }

    /// Whether `f` holds for this error or for one of the [`Error`]s among its
    /// causes.
    fn find(&self, f: impl Fn(&Error) -> bool) -> bool {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cur {
            // A boxed cause is seen as the box itself.
            let found = e
                .downcast_ref::<Error>()
                .or_else(|| e.downcast_ref::<Box<Error>>().map(|b| &**b));
            if found.is_some_and(&f) {
                return true;
            }
            cur = e.source();
        }
        false
    }

    /// Whether the chain holds an error of the data read (a payload that does not
    /// hash, bytes that do not decode), as against the reader's or the writer's.
    pub(crate) fn is_bad_data(&self) -> bool {
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cur {
            if matches!(
                e.downcast_ref::<bundle::BundleError>(),
                Some(bundle::BundleError::PayloadHash { .. })
            ) || e
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData)
            {
                return true;
            }
            cur = e.source();
        }
        false
    }
}

/// An error and its causes joined by ": ", as anyhow's `{:#}` prints them, except
/// that a cause whose text already ends the message is not repeated: the libraries'
/// errors include their I/O cause in their own text (so that they read well alone)
/// and also return it as their source.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut cur = Some(e);
    while let Some(cause) = cur {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        cur = cause.source();
    }
    out
}

/// Adds the step that failed to an error, as [`Error::Context`].
pub trait Context<T> {
    /// Names the failed step with `msg`.
    fn context(self, msg: impl Into<String>) -> Result<T>;
    /// Names the failed step with the text `f` makes (only when it failed).
    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, msg: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Context {
            msg: msg.into(),
            source: Box::new(e.into()),
        })
    }

    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| Error::Context {
            msg: f().into(),
            source: Box::new(e.into()),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, msg: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| Error::Invalid(msg.into()))
    }

    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| Error::Invalid(f().into()))
    }
}

/// Returns an [`Error::Invalid`] made with `format!`.
macro_rules! invalid {
    ($($arg:tt)*) => {
        return Err($crate::Error::Invalid(format!($($arg)*)))
    };
}
pub(crate) use invalid;

/// Returns an [`Error::Mismatch`] made with `format!`.
macro_rules! mismatch {
    ($($arg:tt)*) => {
        return Err($crate::Error::Mismatch(format!($($arg)*)))
    };
}
pub(crate) use mismatch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_is_found_under_its_context() {
        let e: Result<()> = Err(Error::Mismatch("wrong base".into()));
        let e = e.context("install partition system").unwrap_err();
        assert!(e.is_mismatch());
        assert!(!e.is_half_merged());
        assert_eq!(e.to_string(), "install partition system");
        let cause = std::error::Error::source(&e).map(ToString::to_string);
        assert_eq!(cause.as_deref(), Some("wrong base"));
    }

    #[test]
    fn io_errors_keep_their_errno() {
        let e = Error::io(
            "open",
            "/x",
            std::io::Error::from_raw_os_error(libc::ENOENT),
        );
        let Error::Io(io) = &e else {
            panic!("not Io: {e:?}");
        };
        assert_eq!(io.errno(), Some(libc::ENOENT));
        assert!(e.to_string().starts_with("cannot open /x: "), "{e}");
    }
}
