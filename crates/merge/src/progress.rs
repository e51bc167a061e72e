//! How far a COW's merge has gone, read the same way by every command.
//!
//! A merge records its progress in the COW: `num_merge_ops` in the header (ops merged,
//! in merge order) and the scratch area's state byte. Until both say "nothing yet", the
//! base may already hold new blocks: a merge killed inside its first window has
//! published that window (state `STATE_DONE`) and overwritten base blocks while the
//! counter is still 0. `apply` must then refuse, `serve` must serve through the merge
//! state, and a check of the base must expect a partly merged image.

use cow::CowReader;

use crate::error::{MergeError, Result};
use crate::merger::STATE_DONE;

/// Where a COW's merge stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Nothing merged: the base is still the old image.
    NotStarted,
    /// Partly merged: the base holds old and new blocks.
    InProgress { merged: u64, total: u64 },
    /// Every op merged: the base is the new image.
    Complete { total: u64 },
}

impl Progress {
    pub fn started(self) -> bool {
        self != Progress::NotStarted
    }
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Progress::NotStarted => f.write_str("not started"),
            Progress::InProgress { merged, total } => {
                write!(f, "in progress ({merged} of {total} ops merged)")
            }
            Progress::Complete { total } => write!(f, "complete ({total} ops merged)"),
        }
    }
}

/// Reads the merge progress recorded in `cow`, rejecting a counter past the op count.
pub fn read(cow: &CowReader) -> Result<Progress> {
    let h = cow.header();
    let total = cow.merge_order()?.len() as u64;
    let merged = h.num_merge_ops;
    if merged > total {
        return Err(MergeError::Corrupt {
            path: cow.path().to_path_buf(),
            offset: 26,
            msg: format!("num_merge_ops {merged} exceeds the {total} ops in merge order"),
        });
    }
    let mut state = [0u8; 1];
    if h.buffer_size > 0 {
        cow.read_file_at(&mut state, u64::from(h.header_size))?;
    }
    Ok(match merged {
        0 if state[0] != STATE_DONE => Progress::NotStarted,
        m if m == total && total > 0 => Progress::Complete { total },
        m => Progress::InProgress { merged: m, total },
    })
}
