//! The command line's side of the trust checks (`ota::trust` holds them): the flags
//! that choose a manifest or skip the base check, and the exit status of a check that
//! found data other than it must be.

use std::path::{Path, PathBuf};

use cow::CowReader;
use manifest::Manifest;

/// Exit status of an [`ota::Error::Mismatch`] (docs/cli.md): data other than it must
/// be, as against the 1 of an error that kept the command from deciding.
pub const EXIT_MISMATCH: u8 = 3;

/// `bail!` for an [`ota::Error::Mismatch`].
macro_rules! mismatch {
    ($($arg:tt)*) => {
        return Err(anyhow::Error::new(ota::Error::Mismatch(format!($($arg)*))))
    };
}
pub(crate) use mismatch;

/// Flags shared by the commands that read a base through a COW.
#[derive(clap::Args, Debug, Clone)]
pub struct CheckArgs {
    /// The update's manifest: which base it needs and which image it makes (default:
    /// COW.manifest, written by `vabc diff`).
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    /// Skip the check that the base is the image the update was made for (and, for
    /// merge and apply, that the result will be the new image).
    #[arg(long)]
    pub no_base_check: bool,
}

/// The manifest that applies to `cow` ([`ota::trust::load_manifest`]), none with
/// `--no-base-check`.
pub fn load_manifest(
    args: &CheckArgs,
    cow_path: &Path,
    cow: &CowReader,
) -> ota::Result<Option<Manifest>> {
    if args.no_base_check {
        return Ok(None);
    }
    ota::trust::load_manifest(args.manifest.as_deref(), cow_path, cow)
}
