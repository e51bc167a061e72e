//! vabc's application: what a device update does, as a library. The `vabc` command
//! line parses arguments, calls this crate and prints its reports; an OTA client (a
//! RAUC- or Mender-like agent, a custom updater) calls the same functions.
//!
//! * [`create`]: an update bundle made on the host from old/new image pairs, signed.
//! * [`install`]: a bundle (a file or an HTTP(S) URL, resumable) checked and turned
//!   into the device's COWs, each proven to make the signed new image.
//! * [`device`]: the device's update driver: install into a store, mark-good,
//!   rollback, status, and the proofs a boot and a merge make against the signed head.
//! * [`trust`]: the checks before a base is read through a COW or a block is written:
//!   the right base for how far the merge has gone, every op decoding to the new image.
//! * [`trees`]: dm-verity trees as an update makes, installs and reuses them.
//! * [`output`]: outputs written to a temporary name and renamed once complete, with
//!   a registry of what an interrupt must remove.
//! * [`progress`]: the [`Observer`] that long work reports to.
//! * [`android`]: Android's own OTA payloads (`payload.bin`, an OTA zip, a URL)
//!   verified and turned into partition images.
//!
//! Errors are one [`Error`] type; [`Error::is_mismatch`] tells a check that found the
//! wrong data from a failure that kept the step from deciding.
//!
//! The crates below hold the formats and engines: `cow` (AOSP's COW format), `delta`
//! (planning and writing COWs), `bundle` (the signed bundle), `payload` (Android's
//! payload.bin), `manifest` (image
//! identities), `verity` (dm-verity and AVB), `merge`, `serve` and `update` (the
//! device's state machine).

#![warn(missing_docs)]

pub mod android;
pub mod boot;
pub mod create;
pub mod device;
pub mod error;
pub mod install;
pub mod output;
pub mod progress;
pub mod serving;
pub mod snapshot;
pub mod trees;
pub mod trust;

pub use error::{Context, Error, Result};
pub use progress::{Event, Observer, Silent};
