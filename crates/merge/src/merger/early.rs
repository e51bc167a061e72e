//! REPLACE/ZERO blocks written early, together with an ordered window's
//! destinations.
//!
//! On a disk that is bound by its request rate, the merge's time is its
//! request count. Ordered windows write runs of destination blocks
//! separated by short gaps, and many of those gaps (and the blocks just
//! past a run's ends) are REPLACE/ZERO destinations: recompiled code
//! interleaves XOR blocks with rewritten ones. Written in the REPLACE phase
//! they cost a request each; written with the window they join its runs.
//! On the `system` corpus pair the io_uring merge's write requests fall
//! from 18.8k to 12.1k (17.8k blocks go early), for 1.1k more reads of
//! payloads from the COW (mostly served by the page cache's readahead: the
//! early ops of neighbouring windows lie close together in the file).
//!
//! A REPLACE/ZERO block `b` may be written with window W once no op still
//! to be merged reads it:
//! - every op reading `b` is in a window before W: a crash inside W (a
//!   direct one re-reads its sources, spec state 1) or any later resume,
//!   ours or snapuserd's with other window boundaries, never reads `b`;
//! - or it is in W itself and W goes through the scratch area: W's
//!   destinations (and so `b`) are written only after W's sources are
//!   saved and published (state 2), and a resume replays them from there.
//!
//! The next window's sources, read while W is written, do not include `b`
//! either. Writing `b` early is idempotent (its content comes from the COW),
//! it is made durable with W's destinations before W is committed, and a
//! reader of the snapshot view gets `b` from the COW until the REPLACE
//! phase counts its op merged, which returns the same bytes. The REPLACE
//! phase then skips the ops whose blocks were all written early by this
//! run; a later run (after a crash or a pause) does not know them and
//! writes them again, which is harmless. An op only partly written early
//! (a multi-block unit cut by a window's reach: 232 ops and 1 875 blocks on
//! the `system` pair) is decoded again and written whole in the REPLACE
//! phase: its request is needed for the rest of it anyway, and splitting
//! it around the early blocks would cost more requests than the 7 MB it
//! rewrites.

use std::collections::HashMap;

use cow::OpKind;

use super::{BlockTable, Merge, NONE};

/// Owner mark of a block two REPLACE/ZERO ops claim.
const CLAIMED: u32 = NONE - 1;

/// An op's index in a table; `plan_early` plans nothing for a merge order
/// too long for every index to fit below `CLAIMED`.
fn index(i: usize) -> u32 {
    i as u32
}

/// Longest gap between two destination runs of a window filled with
/// REPLACE/ZERO blocks, and longest extension of a run's end, in blocks.
const MAX_GAP: u64 = 32;
const MAX_EXTEND: u64 = 64;

/// Which REPLACE/ZERO blocks go with which window, for one run.
#[derive(Debug, Default)]
pub(super) struct EarlyPlan {
    /// Window start -> (block, index in the merge order of its op), by block.
    windows: HashMap<usize, Vec<(u64, usize)>>,
    /// Per REPLACE/ZERO op (index - `ordered`): all of its blocks are written
    /// early by this run.
    done: Vec<bool>,
    ordered: usize,
}

impl EarlyPlan {
    /// Blocks written with the window starting at `pos`.
    pub(super) fn window(&self, pos: usize) -> &[(u64, usize)] {
        self.windows.get(&pos).map_or(&[], |v| v.as_slice())
    }

    /// The REPLACE/ZERO op at merge-order index `i` was written whole with
    /// the windows.
    pub(super) fn done(&self, i: usize) -> bool {
        i.checked_sub(self.ordered)
            .and_then(|k| self.done.get(k))
            .copied()
            .unwrap_or(false)
    }

    /// Most blocks written early with one window (sizes the buffers).
    pub(super) fn max_window(&self) -> usize {
        self.windows.values().map(Vec::len).max().unwrap_or(0)
    }

    /// Blocks the plan writes early.
    pub(super) fn blocks(&self) -> usize {
        self.windows.values().map(Vec::len).sum()
    }
}

impl Merge<'_> {
    /// The plan for a run whose ordered windows start at `start` (cut by
    /// `window_at`, as `run` cuts them).
    pub(super) fn plan_early(&self, start: usize) -> EarlyPlan {
        let mut plan = EarlyPlan {
            ordered: self.ordered,
            done: vec![false; self.order.len() - self.ordered],
            ..Default::default()
        };
        let budget = self.opts.early_blocks;
        if budget == 0 || start >= self.ordered || self.order.len() >= CLAIMED as usize {
            return plan;
        }
        let ops = self.order.len();
        // The last ordered op reading each block; ordered destinations.
        let mut last_read = BlockTable::new(self.blocks, ops);
        let mut ordered_dest = BlockTable::new(self.blocks, ops);
        for (i, op) in self.order[..self.ordered].iter().enumerate() {
            for b in op.source_blocks() {
                last_read.set(b, index(i));
            }
            ordered_dest.set(op.new_block, 0);
        }
        // REPLACE/ZERO destinations, each with its op; a block claimed by
        // two ops (which a valid COW does not have) is left to the REPLACE
        // phase.
        let mut owner = BlockTable::new(self.blocks, ops);
        for (i, op) in self.order.iter().enumerate().skip(self.ordered) {
            if matches!(op.kind, OpKind::Replace | OpKind::Zero) {
                for b in op.new_block..op.end_block() {
                    let mark = if owner.get(b) == NONE {
                        index(i)
                    } else {
                        CLAIMED
                    };
                    owner.set(b, mark);
                }
            }
        }
        // Blocks this plan writes early (any value but NONE).
        let mut taken = BlockTable::new(self.blocks, ops);
        let mut pos = start;
        while pos < self.ordered {
            let (n, direct) = self.window_at(pos);
            // Readers of a block must all come before this limit.
            let limit = if direct { pos } else { pos + n };
            let eligible = |b: u64, taken: &BlockTable| -> Option<usize> {
                let op = owner.get(b);
                let last = last_read.get(b);
                let unread = last == NONE || (last as usize) < limit;
                (op != NONE
                    && op != CLAIMED
                    && unread
                    && taken.get(b) == NONE
                    && ordered_dest.get(b) == NONE)
                    .then_some(op as usize)
            };
            let mut dests: Vec<u64> = self.order[pos..pos + n]
                .iter()
                .map(|o| o.new_block)
                .collect();
            dests.sort_unstable();
            let mut mine: Vec<(u64, usize)> = Vec::new();
            // Gaps between runs, filled only whole (else no request is saved).
            for w in dests.windows(2) {
                let (lo, hi) = (w[0] + 1, w[1]);
                if hi <= lo || hi - lo > MAX_GAP || mine.len() + (hi - lo) as usize > budget {
                    continue;
                }
                let ops: Option<Vec<usize>> = (lo..hi).map(|b| eligible(b, &taken)).collect();
                if let Some(ops) = ops {
                    for (b, op) in (lo..hi).zip(ops) {
                        taken.set(b, 0);
                        mine.push((b, op));
                    }
                }
            }
            // Then the blocks just past each run's ends: each run of
            // REPLACE blocks taken whole saves its own request later.
            let mut ends: Vec<u64> = dests
                .iter()
                .chain(mine.iter().map(|m| &m.0))
                .copied()
                .collect();
            ends.sort_unstable();
            let written = |b: u64| ends.binary_search(&b).is_ok();
            for &d in &ends {
                if !written(d + 1) {
                    let mut b = d + 1;
                    while b <= d + MAX_EXTEND && mine.len() < budget {
                        let Some(op) = eligible(b, &taken) else { break };
                        taken.set(b, 0);
                        mine.push((b, op));
                        b += 1;
                    }
                }
                if d > 0 && !written(d - 1) {
                    let mut b = d - 1;
                    while b + MAX_EXTEND >= d && mine.len() < budget {
                        let Some(op) = eligible(b, &taken) else { break };
                        taken.set(b, 0);
                        mine.push((b, op));
                        let Some(prev) = b.checked_sub(1) else { break };
                        b = prev;
                    }
                }
            }
            if !mine.is_empty() {
                mine.sort_unstable();
                plan.windows.insert(pos, mine);
            }
            pos += n;
        }
        for (k, op) in self.order[self.ordered..].iter().enumerate() {
            plan.done[k] = matches!(op.kind, OpKind::Replace | OpKind::Zero)
                && (op.new_block..op.end_block()).all(|b| taken.get(b) != NONE);
        }
        plan
    }
}
