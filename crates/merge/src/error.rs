use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MergeError {
    #[error(transparent)]
    Cow(#[from] cow::CowError),
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    #[error("{path}: base is {size} bytes, but the COW needs {needed}: wrong base image?")]
    BaseTooSmall {
        path: PathBuf,
        size: u64,
        needed: u64,
    },
    #[error(
        "{path}: the COW has no scratch area, so its COPY/XOR ops cannot be merged crash-safely"
    )]
    NoScratch { path: PathBuf },
    #[error("{path}: offset {offset}: {msg}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        msg: String,
    },
}

pub type Result<T, E = MergeError> = std::result::Result<T, E>;
