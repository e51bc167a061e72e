//! Plugs a running merge into the serving engine: the engine asks, for each
//! COPY/XOR block, whether to read the source, the scratch copy or the
//! merged block, under a guard the merge waits for (spec §4.5).

use std::sync::Arc;

use cow::{CowReader, Op};
use engine::{MergeGuard, MergeHook, MergeRedirect};

use crate::error::Result;
use crate::status::{MergeStatus, Source, View};

pub struct StatusHook {
    status: Arc<MergeStatus>,
    /// Merge-order position of each op (by index in `CowReader::ops()`).
    positions: Vec<usize>,
}

impl StatusHook {
    pub fn new(cow: &CowReader, status: Arc<MergeStatus>) -> Result<Self> {
        let mut positions = vec![usize::MAX; cow.ops().len()];
        for (pos, i) in cow.merge_order()?.into_iter().enumerate() {
            if positions[i] == usize::MAX {
                positions[i] = pos;
            }
        }
        Ok(StatusHook { status, positions })
    }
}

struct Guard<'a> {
    view: View<'a>,
    positions: &'a [usize],
}

impl MergeHook for StatusHook {
    fn begin_read(&self) -> Box<dyn MergeGuard + '_> {
        Box::new(Guard {
            view: self.status.view(),
            positions: &self.positions,
        })
    }
}

impl MergeGuard for Guard<'_> {
    fn redirect(&self, op_index: usize, op: &Op) -> MergeRedirect {
        let pos = self.positions.get(op_index).copied().unwrap_or(usize::MAX);
        match self.view.source(pos, op.new_block) {
            Source::Merged => MergeRedirect::BaseAtNewBlock,
            Source::Pending => MergeRedirect::Cow,
            Source::Scratch(d) => MergeRedirect::Scratch(d.to_vec()),
        }
    }
}
