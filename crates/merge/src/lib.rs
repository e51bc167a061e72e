//! In-place merge of a COW into its base image: crash-safe (power loss at
//! any point loses nothing; running again resumes), resumable across
//! implementations (AOSP's scratch-area layout and header counter), and
//! fast (batched I/O, one fsync per window, io_uring).
//!
//! - [`merger`]: the protocol (windows through the scratch area, then
//!   REPLACE/ZERO batches, commits in `num_merge_ops`).
//! - [`io`]: the I/O trait and the `sync` baseline engine.
//! - [`uring`]: the io_uring engine.
//! - [`progress`]: how far a COW's merge has gone, as every command reads it.
//! - [`status`]: merge progress shared with readers serving the image.
//! - [`view`]: a reader of the new image that is correct during a merge.

pub mod error;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod io;
pub mod merger;
pub mod progress;
pub mod serving;
pub mod status;
pub mod uring;
pub mod view;

pub use error::{MergeError, Result};
pub use io::{Dev, Engine, IoStats, MergeIo, SyncIo};
pub use merger::{BlockCheck, Merge, MergeOptions, MergeReport};
pub use progress::Progress;
pub use status::MergeStatus;
pub use uring::UringIo;
