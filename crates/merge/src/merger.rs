//! The merge protocol (spec §2.7, §4.3): ordered ops go through the COW's
//! scratch area one window at a time, REPLACE/ZERO follow in batches, and
//! progress is committed in the header's `num_merge_ops`. The layout of the
//! scratch area is AOSP's, so a merge started by snapuserd can be finished
//! here and the other way round.
//!
//! One ordered window W (at most 510 ops):
//! 1. read W's sources from the base (and XOR them with their payloads) —
//!    in fact started while the previous window is written, which the
//!    merge order makes safe (no op reads a block an earlier op writes);
//! 2. write them and their metadata into the scratch area, sync;
//!    then `read_ahead_state = 2`, sync — W is now recoverable from the COW;
//! 3. write W's destinations to the base, sync — while those writes run,
//!    the next window is assembled (its sources waited for, XORs applied,
//!    blocks put in destination order) in a second buffer, so that this
//!    CPU work costs no disk time;
//! 4. `num_merge_ops += |W|` and `read_ahead_state = 1` in one header write,
//!    sync.
//!
//! A crash before 2 re-reads W's sources, still intact since no destination
//! of W was written. A crash between 2 and 4 finds state 2 and rewrites W
//! from the scratch copy (idempotent). After 4, W is done.
//!
//! **Direct windows.** The scratch copy exists for windows where one op
//! overwrites another op's source: replaying such a window from the base
//! after a crash would read clobbered sources. A window in which no op
//! writes a block any op of the window reads (its own included: an XOR of a
//! block changed in place, replayed, would XOR the new data) needs no copy — a crash in
//! step 3 leaves every source of W (and, by the merge order, of every later
//! op) intact, so re-reading them is exactly AOSP's restart rule for state
//! 1 — and skips step 2 entirely: half the writes and half the syncs. Window
//! boundaries are the merger's choice (a resumed merge, AOSP's or ours,
//! starts from `num_merge_ops`, whatever windows were used), so each window
//! starts at the previous one's end and is the longest overlap-free run of
//! ops (up to the scratch capacity) when that run is long enough to pay for
//! its two syncs, else an ordinary scratch window. Merge orders that keep
//! moved regions together (`vabc diff`'s) make most windows direct.
//!
//! **Early REPLACE/ZERO writes.** A REPLACE/ZERO block that no op still to
//! be merged reads goes out with an ordered window whose destination runs it
//! joins, rather than as a request of its own in the REPLACE phase (the
//! rules that keep this crash-safe are in `early`).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use cow::format::{BLOCK_SIZE, BLOCK_SIZE_U64, ScratchEntry};
use cow::view::xor_into;
use cow::{CowReader, Op, OpKind};

use crate::error::{MergeError, Result};
use crate::io::{Dev, IoStats, MergeIo};
use crate::status::MergeStatus;
use engine::{AlignedBuf, DIRECT_ALIGN};
use zerocopy::{FromBytes, IntoBytes};

mod early;
mod prepare;
use early::EarlyPlan;
use prepare::{Job, Prepared};

/// `read_ahead_state` values (`snapuserd_kernel.h`).
pub const STATE_NOT_STARTED: u8 = 0;
pub const STATE_IN_PROGRESS: u8 = 1;
pub const STATE_DONE: u8 = 2;

/// Scratch entry: new_block u64, file_offset u64.
const META_ENTRY: usize = size_of::<ScratchEntry>();

/// "No op" in per-op and per-block tables of op indices.
const NONE: u32 = u32::MAX;

/// Tunables. Defaults are AOSP's.
#[derive(Clone, Copy, Debug)]
pub struct MergeOptions {
    /// Ordered ops per scratch window (≤ what the scratch area holds, 510
    /// for AOSP's 2 MiB).
    pub window_ops: usize,
    /// REPLACE/ZERO ops per commit.
    pub commit_ops: usize,
    /// Largest contiguous destination run written at once, in blocks.
    pub run_blocks: u64,
    /// Stop after this many commits (tests and pause support); None = all.
    pub max_commits: Option<usize>,
    /// Write windows without overlap inside directly, skipping the scratch
    /// copy (see the module docs); `false` copies every window, as AOSP does.
    pub direct_windows: bool,
    /// Shortest overlap-free run written as a direct window (capped at the
    /// window size). A direct window costs 2 syncs; a scratch window of 510
    /// ops 4 syncs and a 2 MiB copy, about as much as 2 syncs per ~128 ops
    /// on the disks measured (bench/merge.sh: ~0.35 ms per sync, ~1.3 ms per
    /// 2 MiB copy).
    pub direct_min_ops: usize,
    /// Longest direct window: it uses no scratch space, so only memory
    /// bounds it (6 blocks of buffer per op); longer windows mean fewer
    /// syncs.
    pub direct_max_ops: usize,
    /// REPLACE/ZERO batches (each at most `commit_ops` ops and 8 MiB)
    /// decoded ahead by a worker that starts with the merge: their
    /// decompression (~0.2 s for the 108 MB of the `system` pair's) then
    /// runs while the ordered windows wait for the disk, instead of after.
    /// Bounds the memory held: up to this many × 8 MiB.
    pub replace_ahead: usize,
    /// Most REPLACE/ZERO blocks written with one ordered window, where they
    /// join its destination runs (see `early`); 0 writes them all in the
    /// REPLACE phase, as AOSP does.
    pub early_blocks: usize,
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            window_ops: 510,
            commit_ops: 256,
            run_blocks: 256,
            max_commits: None,
            direct_windows: true,
            direct_min_ops: 128,
            direct_max_ops: 1024,
            replace_ahead: 16,
            early_blocks: 1024,
        }
    }
}

/// What a merge run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MergeReport {
    /// Ops in merge order.
    pub total_ops: u64,
    /// `num_merge_ops` when the run started.
    pub started_at: u64,
    /// `num_merge_ops` when it ended.
    pub merged: u64,
    /// The run found a published scratch window and replayed it.
    pub replayed_window: bool,
    pub windows: u64,
    /// Windows written without the scratch copy (included in `windows`).
    pub direct_windows: u64,
    /// REPLACE/ZERO blocks written with the ordered windows.
    pub early_blocks: u64,
    pub commits: u64,
    pub io: IoStats,
}

impl MergeReport {
    pub fn complete(&self) -> bool {
        self.merged == self.total_ops
    }
}

/// What a window writes to the base: its ops' blocks, in op order, and the
/// REPLACE/ZERO blocks written early with it (see `early`): (block, op)
/// pairs in block order and their data, a block each.
#[derive(Clone, Copy)]
struct WindowData<'b> {
    blocks: &'b [u8],
    early: &'b [(u64, usize)],
    early_data: &'b [u8],
}

impl<'b> WindowData<'b> {
    fn plain(blocks: &'b [u8]) -> Self {
        WindowData {
            blocks,
            early: &[],
            early_data: &[],
        }
    }
}

/// A window's write runs (`Merge::arrange`): (first block, first block
/// slot, blocks), over its sorted copy or, when `!in_sorted`, over the
/// window's own blocks.
struct Arranged {
    runs: Vec<(u64, usize, usize)>,
    in_sorted: bool,
}

impl Arranged {
    /// (byte offset, data) of each run, over the bytes the runs index.
    fn requests<'d>(&self, data: &'d [u8]) -> Vec<(u64, &'d [u8])> {
        self.runs
            .iter()
            .map(|&(b, s, c)| {
                (
                    b * BLOCK_SIZE_U64,
                    &data[s * BLOCK_SIZE..(s + c) * BLOCK_SIZE],
                )
            })
            .collect()
    }
}

/// A window assembled in a slot and arranged, ready to be written.
struct Ready {
    pos: usize,
    n: usize,
    direct: bool,
    arranged: Arranged,
}

/// A window whose source reads were started (`Merge::start_sources`).
struct Pending {
    pos: usize,
    n: usize,
    /// Where each op's source block starts in the staging area.
    staged_at: Vec<usize>,
    /// First source offset (for error messages).
    first: u64,
}

/// A validated merge of one COW into one base: everything that can be
/// checked is checked here, before anything is written.
pub struct Merge<'a> {
    cow: &'a CowReader,
    cow_path: PathBuf,
    /// Ops in merge order.
    order: Vec<Op>,
    /// The first `ordered` entries of `order` are COPY/XOR.
    ordered: usize,
    header_size: usize,
    /// Bytes of the COW mirrored in memory: header, state byte and scratch
    /// area rounded up to whole pages (see `run`).
    mirror_len: usize,
    meta_off: u64,
    meta_cap: usize,
    data_off: u64,
    window_cap: usize,
    /// Entries the scratch area holds: a published window (ours with other
    /// options, or snapuserd's) can be this long, whatever `window_cap` is.
    scratch_cap: usize,
    /// Ops of the longest window, direct or not (sizes the buffers).
    max_window: usize,
    /// Blocks any op touches lie below this (`Merge::new` checked the base
    /// covers them), so per-block tables can be plain vectors.
    blocks: usize,
    /// Per ordered op j: the last op before it that reads j's destination
    /// or writes one of j's sources (j itself if it reads its own
    /// destination), [`NONE`] if none. A direct window starting at `pos`
    /// can hold j only if that op lies before `pos` (see `window_at`).
    conflict: Vec<u32>,
    base_size: u64,
    opts: MergeOptions,
    status: Option<Arc<MergeStatus>>,
    cancel: Option<Arc<AtomicBool>>,
    scratch_check: Option<BlockCheck>,
}

/// Checks a new-image block (its number, its bytes) against an identity the caller
/// trusts; `Err` says why not.
pub type BlockCheck = Arc<dyn Fn(u64, &[u8]) -> std::result::Result<(), String> + Send + Sync>;

impl<'a> Merge<'a> {
    /// Check the COW's merge order (refusing an unsafe one, like AOSP's
    /// VerifyMergeOps) and that the base is big enough.
    pub fn new(
        cow: &'a CowReader,
        base_size: u64,
        base_path: PathBuf,
        opts: MergeOptions,
    ) -> Result<Self> {
        let cow_path = cow.path().to_path_buf();
        cow.verify_merge()?;
        let order: Vec<Op> = cow
            .merge_order()?
            .into_iter()
            .map(|i| cow.ops()[i])
            .collect();
        let ordered = order.iter().take_while(|o| o.kind.is_ordered()).count();
        let needed = (cow.end_block() * BLOCK_SIZE_U64).max(cow.source_extent());
        if base_size < needed {
            return Err(MergeError::BaseTooSmall {
                path: base_path,
                size: base_size,
                needed,
            });
        }
        let h = cow.header();
        let header_size = usize::from(h.header_size);
        let buffer = h.buffer_size as usize;
        // AOSP: metadata takes buffer_size * 16 / 4096 bytes after the state
        // byte's offset; the data follows.
        let meta_size = buffer * META_ENTRY / BLOCK_SIZE;
        let meta_cap = (meta_size.saturating_sub(1) / META_ENTRY).saturating_sub(1);
        let data_cap = buffer.saturating_sub(meta_size) / BLOCK_SIZE;
        let window_cap = meta_cap.min(data_cap).min(opts.window_ops);
        if ordered > 0 && window_cap == 0 {
            return Err(MergeError::NoScratch { path: cow_path });
        }
        if ordered > 0 && (header_size + buffer) as u64 > cow.file_size() {
            return Err(MergeError::Corrupt {
                path: cow_path,
                offset: cow.file_size(),
                msg: format!(
                    "the file ends inside its {buffer}-byte scratch area (at {})",
                    cow.file_size()
                ),
            });
        }
        let blocks = usize::try_from(needed.div_ceil(BLOCK_SIZE_U64)).unwrap_or(usize::MAX);
        let conflict = conflicts(&order[..ordered], blocks);
        Ok(Merge {
            cow,
            cow_path,
            order,
            ordered,
            header_size,
            // Whole pages, so that an O_DIRECT engine can write them; never
            // past the end of the file, which must not grow.
            mirror_len: (header_size + buffer)
                .next_multiple_of(DIRECT_ALIGN)
                .min(usize::try_from(cow.file_size()).unwrap_or(usize::MAX))
                .max(header_size + 1),
            meta_off: header_size as u64 + 1,
            meta_cap,
            data_off: (header_size + meta_size) as u64,
            window_cap,
            scratch_cap: meta_cap.min(data_cap),
            max_window: if opts.direct_windows {
                window_cap.max(opts.direct_max_ops)
            } else {
                window_cap
            },
            blocks,
            conflict,
            base_size,
            opts,
            status: None,
            cancel: None,
            scratch_check: None,
        })
    }

    /// Check every block of a published scratch window with `check` before it is
    /// served or written to the base. The scratch area is the one part of a COW the
    /// merge itself rewrites, so no hash of the COW as installed can cover it: a
    /// device that must write only signed blocks checks them here against a signed
    /// tree (the update's dm-verity tree).
    pub fn with_scratch_check(mut self, check: BlockCheck) -> Self {
        self.scratch_check = Some(check);
        self
    }

    /// Share progress with readers serving the image during the merge.
    pub fn with_status(mut self, status: Arc<MergeStatus>) -> Self {
        self.status = Some(status);
        self
    }

    /// Stop at the next commit once `flag` is set (a later run resumes).
    pub fn with_cancel(mut self, flag: Arc<AtomicBool>) -> Self {
        self.cancel = Some(flag);
        self
    }

    pub fn total_ops(&self) -> u64 {
        self.order.len() as u64
    }

    /// Ops in merge order (what `num_merge_ops` counts).
    pub fn order(&self) -> &[Op] {
        &self.order
    }

    /// Read `num_merge_ops` and the state byte as they are on the device.
    pub fn progress(&self, io: &mut dyn MergeIo) -> Result<(u64, u8)> {
        let mut head = vec![0u8; self.header_size + 1];
        io.read_many(Dev::Cow, &mut [(0, &mut head[..])])
            .map_err(|e| self.cow_io("read header", 0, e))?;
        Ok(self.parse_progress(&head))
    }

    /// `num_merge_ops` and the state byte after the header (`head` holds both: it
    /// is `header_size + 1` bytes or more).
    fn parse_progress(&self, head: &[u8]) -> (u64, u8) {
        (
            cow::format::num_merge_ops(head).unwrap_or(0),
            head[self.header_size],
        )
    }

    /// The window starting at ordered op `pos`: its length, and whether it is
    /// written directly (no op in it writes a block an op in it reads, its
    /// own source included).
    fn window_at(&self, pos: usize) -> (usize, bool) {
        let left = self.ordered - pos;
        let cap = left.min(self.window_cap);
        if !self.opts.direct_windows {
            return (cap, false);
        }
        let longest = left.min(self.max_window);
        let n = self.conflict[pos..pos + longest]
            .iter()
            .position(|&c| c != NONE && c as usize >= pos)
            .unwrap_or(longest);
        if n == left || n >= self.opts.direct_min_ops.min(self.window_cap) {
            (n, true)
        } else {
            (cap, false)
        }
    }

    /// Run (or resume) the merge to completion, or until
    /// `opts.max_commits`. `progress(merged, total)` after every commit.
    pub fn run(&self, io: &mut dyn MergeIo, progress: &dyn Fn(u64, u64)) -> Result<MergeReport> {
        let total = self.order.len();
        let (mut head, mut pos, state) = self.read_head(io)?;
        let mut report = MergeReport {
            total_ops: total as u64,
            started_at: pos,
            merged: pos,
            ..Default::default()
        };
        if let Some(s) = &self.status {
            s.set_merged(pos as usize);
        }
        // A published window to replay first has its own boundaries; such a
        // run (rare: a crash inside a window) writes nothing early.
        let replay = state == STATE_DONE && (pos as usize) < self.ordered;
        let plan = self.plan_early(if replay { self.ordered } else { pos as usize });
        report.early_blocks = plan.blocks() as u64;
        let (cap, early_cap) = self.slot_sizes(&plan);
        let mut arena = AlignedBuf::new(6 * cap + 2 * early_cap);
        // Registering only saves the kernel a page lookup per transfer; where
        // it is refused (an unprivileged user's RLIMIT_MEMLOCK), plain
        // transfers do the same job.
        if self.window_cap > 0 && io.register(&mut arena).is_err() {
            io.unregister();
        }
        let mut slots = Slots::new(&mut arena, cap, early_cap);
        // The decoder's reads, and the time spent waiting for it.
        let mut decoder = IoStats::default();
        let result = std::thread::scope(|scope| -> Result<()> {
            let (job_tx, job_rx) = mpsc::channel::<Job>();
            let (done_tx, done_rx) = mpsc::channel::<Result<Prepared>>();
            let plan = &plan;
            scope.spawn(move || prepare::serve(self, plan, job_rx, done_tx));
            let replace_rx = self.spawn_replace_worker(scope, pos as usize, plan);
            let mut run = Running {
                io: &mut *io,
                head: &mut head,
                pos: &mut pos,
                commits: 0,
                progress,
            };
            let mut link = DecoderLink {
                jobs: job_tx,
                done: done_rx,
                queued: VecDeque::new(),
            };
            if replay {
                let n = self.replay_window(
                    run.io,
                    *run.pos as usize,
                    slots.windows[0],
                    slots.sorteds[0],
                )?;
                if n > 0 {
                    self.commit_window(&mut run, n)?;
                    report.replayed_window = true;
                    report.windows += 1;
                }
            }
            self.merge_windows(
                &mut run,
                &mut slots,
                &mut link,
                &mut decoder,
                plan,
                &mut report,
            )?;
            // REPLACE/ZERO, in the batches the worker decoded ahead.
            while (*run.pos as usize) < total && !self.out_of_budget(run.commits) {
                *run.pos = self.merge_replace_batch(
                    run.io,
                    run.head,
                    *run.pos,
                    &replace_rx,
                    &mut decoder,
                    plan,
                )?;
                run.commits += 1;
                progress(*run.pos, total as u64);
            }
            report.commits = run.commits as u64;
            Ok(())
        });
        // Transfers still in flight (a prefetch after the last commit of a
        // bounded run, or an error) must finish before `arena` is freed.
        let waited = io.wait_reads();
        let written = io.wait_writes();
        io.unregister();
        result?;
        waited.map_err(|e| self.base_io("read sources", 0, e))?;
        written.map_err(|e| self.base_io("write destinations", 0, e))?;
        report.merged = pos;
        report.io = io.stats();
        report.io.syscalls += decoder.syscalls;
        report.io.reads += decoder.reads;
        report.io.bytes_read += decoder.bytes_read;
        report.io.read_wait += decoder.read_wait;
        Ok(report)
    }

    /// One window slot's size and the room for its early blocks. One registered,
    /// page-aligned allocation (so that an engine can move it with O_DIRECT) holds two
    /// window slots, each: a window's blocks in op order, and its blocks in destination
    /// order with the REPLACE/ZERO blocks written early (see `arrange`); and the
    /// staging area the next window's sources are read into while one is written (see
    /// `start_sources`). While one slot's destinations are written, the next window is
    /// assembled in the other (see `merge_windows`). XOR payloads are decoded by a
    /// worker thread (see `prepare`). Room for our longest window and for a published
    /// one to replay, but no more than the ordered ops (a small update needs a small
    /// buffer, quick to allocate and pin).
    fn slot_sizes(&self, plan: &EarlyPlan) -> (usize, usize) {
        let cap = self
            .max_window
            .max(self.scratch_cap)
            .min(self.ordered)
            .max(1)
            * BLOCK_SIZE;
        (cap, plan.max_window() * BLOCK_SIZE)
    }

    /// The REPLACE/ZERO worker: batches from the first REPLACE/ZERO op not merged
    /// yet, in order. It stops when the receiver is dropped (the run's scope ends),
    /// so a run that ends early never leaves it blocked.
    fn spawn_replace_worker<'s, 'e>(
        &'e self,
        scope: &'s std::thread::Scope<'s, 'e>,
        pos: usize,
        plan: &'e EarlyPlan,
    ) -> mpsc::Receiver<Result<(usize, usize, Prepared)>> {
        let total = self.order.len();
        let (replace_tx, replace_rx) =
            mpsc::sync_channel::<Result<(usize, usize, Prepared)>>(self.opts.replace_ahead);
        let first_replace = pos.max(self.ordered);
        if first_replace < total {
            scope.spawn(move || {
                let mut at = first_replace;
                while at < total {
                    let (end, _) = self.replace_batch(at, plan);
                    let r = self
                        .prepare(Job::Replace { pos: at }, plan)
                        .map(|p| (at, end, p));
                    let failed = r.is_err();
                    if replace_tx.send(r).is_err() || failed {
                        break;
                    }
                    at = end;
                }
            });
        }
        replace_rx
    }

    /// `num_merge_ops += n`, durably, and the progress said.
    fn commit_window(&self, run: &mut Running<'_, '_>, n: usize) -> Result<()> {
        *run.pos += n as u64;
        self.commit(run.io, run.head, *run.pos)?;
        run.commits += 1;
        (run.progress)(*run.pos, self.order.len() as u64);
        Ok(())
    }

    /// The ordered (COPY/XOR) windows from `run.pos`. Window k's destination writes
    /// run while window k + 1 is assembled in the other slot; only then does the merge
    /// wait for them, sync and commit k. Done in turn, that CPU work left the disk
    /// idle: on the `system` pair ~0.4 s of a 1.8 s merge ran outside any I/O wait, and
    /// 2 ms of extra CPU per window made the merge 0.6 s longer
    /// (bench/results/merge.md).
    fn merge_windows(
        &self,
        run: &mut Running<'_, '_>,
        slots: &mut Slots<'_>,
        link: &mut DecoderLink,
        decoder: &mut IoStats,
        plan: &EarlyPlan,
        report: &mut MergeReport,
    ) -> Result<()> {
        let mut ready: Option<Ready> = None;
        let mut slot = 0;
        while (*run.pos as usize) < self.ordered && !self.out_of_budget(run.commits) {
            let at = *run.pos as usize;
            let w = match ready.take() {
                Some(w) => w,
                None => {
                    let prefetch = !self.out_of_budget(run.commits + 1);
                    slots.assemble(self, run.io, at, prefetch, slot, link, decoder, plan)?
                }
            };
            debug_assert_eq!(w.pos, at);
            let blocks = &slots.windows[slot][..w.n * BLOCK_SIZE];
            if !w.direct {
                self.publish_scratch(run.io, at, w.n, blocks, run.head)?;
            }
            // SAFETY: this slot's buffers are not touched until `wait_writes` below
            // returned: the next window is assembled in the other slot, and every exit
            // from here on waits for these writes (below, or at the end of `run`)
            // before the arena is released.
            let first = unsafe {
                self.start_destinations(run.io, at, w.n, blocks, slots.sorteds[slot], &w.arranged)?
            };
            let next = at + w.n;
            if next < self.ordered && !self.out_of_budget(run.commits + 1) {
                let prefetch = !self.out_of_budget(run.commits + 2);
                ready = Some(slots.assemble(
                    self,
                    run.io,
                    next,
                    prefetch,
                    1 - slot,
                    link,
                    decoder,
                    plan,
                )?);
            }
            run.io
                .wait_writes()
                .map_err(|e| self.base_io("write destinations", first, e))?;
            run.io
                .sync(Dev::Base)
                .map_err(|e| self.base_io("sync destinations", first, e))?;
            self.commit_window(run, w.n)?;
            report.windows += 1;
            if w.direct {
                report.direct_windows += 1;
            }
            slot = 1 - slot;
        }
        Ok(())
    }

    /// Reads the COW's header and scratch area into a page-aligned mirror and returns
    /// it with the merge's progress (`num_merge_ops`) and state byte.
    fn read_head(&self, io: &mut dyn MergeIo) -> Result<(AlignedBuf, u64, u8)> {
        // The header page(s) and the scratch area live in `head`, a
        // page-aligned copy of the COW's first `mirror_len` bytes: the
        // protocol's COW writes are whole pages of it (the bytes around
        // what changes are rewritten with what the file already holds), so
        // they can bypass the page cache.
        let mut head = AlignedBuf::new(self.mirror_len);
        // Only the pages of the header and state byte and the last page
        // (which may hold bytes past the scratch area) are read. The pages
        // between hold scratch metadata and data only: a publication
        // rewrites them up to where readers stop (the zero entry, the
        // window's last slot), and a published window is replayed from the
        // file, not from here. On the `medium` pair, reading the whole 2 MiB
        // took a fifth of the merge.
        let first = (self.header_size + 1)
            .next_multiple_of(DIRECT_ALIGN)
            .min(self.mirror_len);
        let last = (self.mirror_len - 1) / DIRECT_ALIGN * DIRECT_ALIGN;
        let (front, back) = head.split_at_mut(first.max(last));
        let mut reqs = vec![(0, &mut front[..first])];
        if last >= first {
            reqs.push((last as u64, back));
        }
        io.read_many(Dev::Cow, &mut reqs)
            .map_err(|e| self.cow_io("read header and scratch area", 0, e))?;
        let (pos, state) = self.parse_progress(&head);
        let total = self.order.len();
        if pos > total as u64 {
            return Err(MergeError::Corrupt {
                path: self.cow_path.clone(),
                offset: 26,
                msg: format!("num_merge_ops {pos} exceeds the {total} ops of the merge order"),
            });
        }
        Ok((head, pos, state))
    }

    /// Whether a run must stop before its commit number `commits` (`max_commits`, or
    /// cancelled).
    fn out_of_budget(&self, commits: usize) -> bool {
        self.opts.max_commits.is_some_and(|m| commits >= m)
            || self
                .cancel
                .as_ref()
                .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Writes the next batch of REPLACE/ZERO ops, decoded ahead by the worker, from
    /// op `pos` on, and commits it; returns the new `num_merge_ops`.
    fn merge_replace_batch(
        &self,
        io: &mut dyn MergeIo,
        head: &mut [u8],
        pos: u64,
        batches: &mpsc::Receiver<Result<(usize, usize, Prepared)>>,
        decoder: &mut IoStats,
        plan: &EarlyPlan,
    ) -> Result<u64> {
        let t = Instant::now();
        let (at, end, batch) = batches.recv().map_err(|_| {
            self.cow_io(
                "decode payloads",
                0,
                std::io::Error::other("the REPLACE decoder stopped"),
            )
        })??;
        decoder.read_wait += t.elapsed();
        decoder.syscalls += batch.reads;
        decoder.reads += batch.reads;
        decoder.bytes_read += batch.bytes;
        if at != pos as usize {
            return Err(self.cow_io(
                "decode payloads",
                0,
                std::io::Error::other(format!("REPLACE batch at op {at} decoded for op {pos}")),
            ));
        }
        self.write_replace_batch(io, at, end, &batch.data, plan)?;
        self.commit(io, head, end as u64)?;
        Ok(end as u64)
    }

    fn cow_io(&self, op: &'static str, offset: u64, e: std::io::Error) -> MergeError {
        MergeError::Io(vabc_io::Error::new(op, &self.cow_path, e).at(offset))
    }

    fn base_io(&self, op: &'static str, offset: u64, e: std::io::Error) -> MergeError {
        MergeError::Io(vabc_io::Error::new(op, PathBuf::from("base"), e).at(offset))
    }

    /// Start reading the sources of order[pos..pos+n] into the staging
    /// area (the XOR payloads are the decoder's, see `prepare`). Sources are read
    /// in offset order, neighbours and overlaps merged: a window that walks
    /// a shifted run backwards (or XORs a file at a byte offset) then reads
    /// it as a few large requests, instead of one 4 KiB read per op in op
    /// order. `finish_sources` puts each block in its op's slot.
    ///
    /// # Safety
    /// `staging` points to at least `2 * n` blocks, which are not read,
    /// written or moved until `finish_sources` (or `io.wait_reads`)
    /// returned.
    unsafe fn start_sources(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        n: usize,
        staging: *mut u8,
    ) -> Result<Pending> {
        let ops = &self.order[pos..pos + n];
        let mut by_off: Vec<(u64, usize)> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| match op.kind {
                OpKind::Copy => (op.source * BLOCK_SIZE_U64, i),
                _ => (op.source, i),
            })
            .collect();
        by_off.sort_unstable();
        // (offset, length, staging position); each run starts on a page
        // boundary of the staging area, so that with at most `n` runs of
        // whole blocks it fits in `2 * n` blocks.
        // Runs are widened to whole blocks, so that an XOR source at a byte
        // offset is read with O_DIRECT like the rest (through the page
        // cache it would cost a copy and pull in readahead the merge never
        // uses); an op touches at most 2 blocks, so they still fit.
        let mut runs: Vec<(u64, usize, usize)> = Vec::new();
        let mut staged_at = vec![0usize; n];
        let block = BLOCK_SIZE_U64;
        for &(off, i) in &by_off {
            let start = off / block * block;
            // (Merge::new checked that every source lies inside the base.)
            let end = (off + block).next_multiple_of(block).min(self.base_size);
            match runs.last_mut() {
                Some((o, l, p)) if start <= *o + *l as u64 => {
                    *l = (end.max(*o + *l as u64) - *o) as usize;
                    staged_at[i] = *p + (off - *o) as usize;
                }
                _ => {
                    let p = runs.last().map_or(0, |&(_, l, p)| p + l);
                    runs.push((start, (end - start) as usize, p));
                    staged_at[i] = p + (off - start) as usize;
                }
            }
        }
        let reqs: Vec<(u64, *mut u8, usize)> = runs
            .iter()
            // Staging arithmetic stays inside the `2 * n` blocks the caller
            // gave (see above).
            .map(|&(off, l, p)| (off, staging.wrapping_add(p), l))
            .collect();
        let first = by_off.first().map_or(0, |r| r.0);
        // SAFETY: forwarded from the caller: the slots stay untouched until
        // the reads are waited for.
        unsafe { io.start_reads(Dev::Base, &reqs) }
            .map_err(|e| self.base_io("read sources", first, e))?;
        Ok(Pending {
            pos,
            n,
            staged_at,
            first,
        })
    }

    /// Wait for the reads `start_sources` started, put each source block in
    /// its op's slot of `buf` and apply the XORs (`xors`: the decoded
    /// payloads of the window's XOR ops, in op order).
    fn finish_sources(
        &self,
        io: &mut dyn MergeIo,
        p: &Pending,
        buf: &mut [u8],
        staging: &[u8],
        xors: &[u8],
    ) -> Result<()> {
        io.wait_reads()
            .map_err(|e| self.base_io("read sources", p.first, e))?;
        for (i, &at) in p.staged_at.iter().enumerate() {
            buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]
                .copy_from_slice(&staging[at..at + BLOCK_SIZE]);
        }
        let mut k = 0;
        for (i, op) in self.order[p.pos..p.pos + p.n].iter().enumerate() {
            if op.kind == OpKind::Xor {
                xor_into(
                    &mut buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE],
                    &xors[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE],
                );
                k += 1;
            }
        }
        Ok(())
    }

    /// Make a scratch window recoverable from the COW before its
    /// destinations are written (module docs, step 2).
    fn publish_scratch(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        n: usize,
        buf: &[u8],
        head: &mut [u8],
    ) -> Result<()> {
        // Publish: metadata + data, sync, then the state byte, sync. The
        // first write rewrites the header page with the state byte it
        // already holds, so a torn write cannot publish anything.
        let mut at = self.meta_off as usize;
        for (i, op) in self.order[pos..pos + n].iter().enumerate() {
            let entry = ScratchEntry {
                new_block: op.new_block.into(),
                file_offset: (self.data_off + (i * BLOCK_SIZE) as u64).into(),
            };
            head[at..at + META_ENTRY].copy_from_slice(entry.as_bytes());
            at += META_ENTRY;
        }
        head[at..at + META_ENTRY].fill(0);
        let slot = self.data_off as usize;
        head[slot..slot + n * BLOCK_SIZE].copy_from_slice(&buf[..n * BLOCK_SIZE]);
        let end = (slot + n * BLOCK_SIZE)
            .next_multiple_of(DIRECT_ALIGN)
            .min(head.len());
        io.write_and_sync(Dev::Cow, &[(0, &head[..end])])
            .map_err(|e| self.cow_io("write scratch", self.meta_off, e))?;
        head[self.header_size] = STATE_DONE;
        io.write_and_sync(Dev::Cow, &[(0, self.header_page(head))])
            .map_err(|e| self.cow_io("write state", self.header_size as u64, e))
    }

    /// The first page of the mirrored COW start (or all of it, if shorter).
    fn header_page<'h>(&self, head: &'h [u8]) -> &'h [u8] {
        &head[..head.len().min(DIRECT_ALIGN)]
    }

    /// Bring a shared status up to what the device holds, before serving
    /// reads: merged count, and a published window's scratch copy (whose
    /// sources may already be overwritten).
    pub fn load_status(&self, io: &mut dyn MergeIo, status: &MergeStatus) -> Result<()> {
        let (pos, state) = self.progress(io)?;
        status.set_merged(pos as usize);
        if state == STATE_DONE && (pos as usize) < self.ordered {
            let mut buf = vec![0u8; self.scratch_cap * BLOCK_SIZE];
            let n = self.read_scratch(io, pos as usize, &mut buf)?;
            if n > 0 {
                status.begin_window(
                    pos as usize,
                    self.order[pos as usize..pos as usize + n]
                        .iter()
                        .map(|o| o.new_block),
                    &buf[..n * BLOCK_SIZE],
                );
            }
        }
        Ok(())
    }

    /// A window was published but maybe not fully merged: rewrite it from
    /// the scratch copy. Returns its op count (0: nothing usable).
    fn replay_window(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        buf: &mut [u8],
        sorted: &mut [u8],
    ) -> Result<usize> {
        let n = self.read_scratch(io, pos, buf)?;
        if n > 0 {
            self.write_destinations(io, pos, n, WindowData::plain(buf), sorted)?;
        }
        Ok(n)
    }

    /// Load a published window from the scratch area, checking that it is
    /// the next part of the merge order. Returns its op count.
    fn read_scratch(&self, io: &mut dyn MergeIo, pos: usize, buf: &mut [u8]) -> Result<usize> {
        let mut meta = vec![0u8; (self.meta_cap + 1) * META_ENTRY];
        io.read_many(Dev::Cow, &mut [(self.meta_off, &mut meta[..])])
            .map_err(|e| self.cow_io("read scratch metadata", self.meta_off, e))?;
        let mut n = 0;
        for (i, e) in meta.chunks_exact(META_ENTRY).enumerate() {
            let e = ScratchEntry::read_from_bytes(e).unwrap_or_default();
            let (block, off) = (e.new_block.get(), e.file_offset.get());
            if block == 0 && off == 0 {
                break;
            }
            let at = self.meta_off + (i * META_ENTRY) as u64;
            let expect = self.order.get(pos + i);
            let slot_ok = off == self.data_off + (i * BLOCK_SIZE) as u64;
            if i >= self.scratch_cap
                || pos + i >= self.ordered
                || expect.is_none_or(|op| op.new_block != block)
                || !slot_ok
            {
                return Err(MergeError::Corrupt {
                    path: self.cow_path.clone(),
                    offset: at,
                    msg: format!(
                        "scratch entry {i} (block {block} at {off}) does not match the merge order at op {}",
                        pos + i
                    ),
                });
            }
            n += 1;
        }
        if n == 0 {
            return Ok(0);
        }
        io.read_many(Dev::Cow, &mut [(self.data_off, &mut buf[..n * BLOCK_SIZE])])
            .map_err(|e| self.cow_io("read scratch data", self.data_off, e))?;
        if let Some(check) = &self.scratch_check {
            for (i, block) in buf[..n * BLOCK_SIZE].chunks_exact(BLOCK_SIZE).enumerate() {
                let new_block = self.order[pos + i].new_block;
                check(new_block, block).map_err(|msg| MergeError::Corrupt {
                    path: self.cow_path.clone(),
                    offset: self.data_off + (i * BLOCK_SIZE) as u64,
                    msg: format!(
                        "the scratch copy of block {new_block} (op {}) is not the new image's: \
                         {msg}; nothing was written",
                        pos + i
                    ),
                })?;
            }
        }
        Ok(n)
    }

    /// Write a window's blocks to their destinations, with the REPLACE/ZERO
    /// blocks the plan puts there, then sync. The merge order often walks a
    /// shifted run of blocks backwards (a block moving up must be written
    /// after the one above it), so the blocks are put in ascending
    /// destination order first (into `sorted`): neighbours then form one
    /// large write instead of hundreds of 4 KiB ones. The order of writes
    /// inside a window does not matter, since they are all made durable
    /// together before the window is committed.
    /// Readers served while merging switch to the window's in-memory copy
    /// before its destinations are overwritten; the call waits for reads of
    /// its sources still in flight.
    fn begin_window(&self, pos: usize, n: usize, blocks: &[u8]) {
        if let Some(s) = &self.status {
            let ops = &self.order[pos..pos + n];
            s.begin_window(
                pos,
                ops.iter().map(|o| o.new_block),
                &blocks[..n * BLOCK_SIZE],
            );
        }
    }

    /// Write a window's destinations (and its early blocks) and sync.
    fn write_destinations(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        n: usize,
        data: WindowData<'_>,
        sorted: &mut [u8],
    ) -> Result<()> {
        let arranged = self.arrange(pos, n, data, sorted);
        // SAFETY: both buffers are borrowed until this function returns,
        // after the writes were waited for.
        let first = unsafe { self.start_destinations(io, pos, n, data.blocks, sorted, &arranged)? };
        io.wait_writes()
            .map_err(|e| self.base_io("write destinations", first, e))?;
        io.sync(Dev::Base)
            .map_err(|e| self.base_io("sync destinations", first, e))
    }

    /// Switch readers to the window's in-memory copy, then start writing
    /// its destinations as `arranged` (over `sorted`, or over `blocks` when
    /// they were in order already). Returns the first offset written, for
    /// error messages.
    ///
    /// # Safety
    /// `blocks` and `sorted` stay unchanged and alive until `wait_writes`
    /// or `sync` returned.
    unsafe fn start_destinations(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        n: usize,
        blocks: &[u8],
        sorted: &[u8],
        arranged: &Arranged,
    ) -> Result<u64> {
        self.begin_window(pos, n, blocks);
        let data = if arranged.in_sorted { sorted } else { blocks };
        let reqs: Vec<(u64, *const u8, usize)> = arranged
            .requests(data)
            .iter()
            .map(|&(off, d)| (off, d.as_ptr(), d.len()))
            .collect();
        let first = reqs.first().map_or(0, |r| r.0);
        // SAFETY: forwarded from the caller.
        unsafe { io.start_writes(Dev::Base, &reqs) }
            .map_err(|e| self.base_io("write destinations", first, e))?;
        Ok(first)
    }

    /// A window's blocks in destination order, cut into write runs: its
    /// ops' blocks and the early REPLACE/ZERO blocks, copied into `sorted`
    /// unless the ops are in order already and nothing is written early
    /// (then they are written from the window itself).
    fn arrange(&self, pos: usize, n: usize, data: WindowData<'_>, sorted: &mut [u8]) -> Arranged {
        let buf = data.blocks;
        let ops = &self.order[pos..pos + n];
        let WindowData {
            early, early_data, ..
        } = data;
        // (block, source slice), the window's ops then the early blocks.
        let mut blocks: Vec<(u64, &[u8])> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| (op.new_block, &buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]))
            .chain(
                early
                    .iter()
                    .zip(early_data.chunks_exact(BLOCK_SIZE))
                    .map(|(&(b, _), d)| (b, d)),
            )
            .collect();
        let in_sorted = !(early.is_empty() && blocks.is_sorted_by_key(|b| b.0));
        if in_sorted {
            blocks.sort_unstable_by_key(|b| b.0);
            for (k, (_, d)) in blocks.iter().enumerate() {
                sorted[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE].copy_from_slice(d);
            }
        }
        let mut runs: Vec<(u64, usize, usize)> = Vec::new(); // (block, first slot, count)
        for (k, &(block, _)) in blocks.iter().enumerate() {
            match runs.last_mut() {
                Some((b, _, c))
                    if *b + *c as u64 == block && (*c as u64) < self.opts.run_blocks =>
                {
                    *c += 1
                }
                _ => runs.push((block, k, 1)),
            }
        }
        Arranged { runs, in_sorted }
    }

    /// The REPLACE/ZERO batch starting at `pos`: up to `commit_ops` ops
    /// and 8 MiB of new data to write, plus the ops among them that `plan`
    /// wrote early. Returns (end, bytes to write).
    fn replace_batch(&self, pos: usize, plan: &EarlyPlan) -> (usize, usize) {
        const MAX_BYTES: usize = 8 << 20;
        let (mut end, mut ops, mut bytes) = (pos, 0, 0);
        while end < self.order.len() && ops < self.opts.commit_ops {
            if !plan.done(end) {
                let sz = self.order[end].unit_size();
                if ops > 0 && bytes + sz > MAX_BYTES {
                    break;
                }
                bytes += sz;
                ops += 1;
            }
            end += 1;
        }
        (end, bytes)
    }

    /// Write the decoded batch order[pos..end] (`data`, see `prepare`: the
    /// ops not written early), in runs of consecutive blocks, then sync.
    fn write_replace_batch(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        end: usize,
        data: &[u8],
        plan: &EarlyPlan,
    ) -> Result<()> {
        let mut runs: Vec<(u64, usize, usize)> = Vec::new(); // (block, byte start, len)
        let mut at = 0;
        for (i, op) in self.order.iter().enumerate().take(end).skip(pos) {
            if plan.done(i) {
                continue;
            }
            let len = op.unit_size();
            match runs.last_mut() {
                Some((b, s, l))
                    if *b + (*l / BLOCK_SIZE) as u64 == op.new_block
                        && *s + *l == at
                        && (*l + len) as u64 <= self.opts.run_blocks * BLOCK_SIZE_U64 =>
                {
                    *l += len
                }
                _ => runs.push((op.new_block, at, len)),
            }
            at += len;
        }
        if runs.is_empty() {
            // Everything was written (and synced) with the ordered windows.
            return Ok(());
        }
        let reqs: Vec<(u64, &[u8])> = runs
            .iter()
            .map(|&(b, s, l)| (b * BLOCK_SIZE_U64, &data[s..s + l]))
            .collect();
        let first = runs.first().map_or(0, |r| r.0 * BLOCK_SIZE_U64);
        io.write_and_sync(Dev::Base, &reqs)
            .map_err(|e| self.base_io("write REPLACE/ZERO", first, e))
    }

    /// `num_merge_ops = pos`, `read_ahead_state = 1`: one write of the
    /// header page (the header and the state byte share it), then sync.
    fn commit(&self, io: &mut dyn MergeIo, head: &mut [u8], pos: u64) -> Result<()> {
        cow::format::set_num_merge_ops(head, pos);
        head[self.header_size] = STATE_IN_PROGRESS;
        io.write_and_sync(Dev::Cow, &[(0, self.header_page(head))])
            .map_err(|e| self.cow_io("commit header", 0, e))?;
        if let Some(s) = &self.status {
            s.set_merged(pos as usize);
        }
        Ok(())
    }
}

/// An op index (or a mark) per block: a vector when the blocks an update
/// touches are few enough for one, else a map, so that an update of a huge
/// sparse image costs memory by its ops, not by its size.
enum BlockTable {
    Dense(Vec<u32>),
    Sparse(HashMap<u64, u32>),
}

impl BlockTable {
    /// A table for blocks below `blocks`, of an update with `ops` ops.
    fn new(blocks: usize, ops: usize) -> Self {
        // 16 Mi blocks (64 GiB of image, 64 MiB of table) are always
        // fine; beyond, only when the update itself is that big.
        if blocks <= (16 << 20).max(8 * ops) {
            BlockTable::Dense(vec![NONE; blocks])
        } else {
            BlockTable::Sparse(HashMap::new())
        }
    }

    /// The value of block `b`, [`NONE`] if it has none.
    fn get(&self, b: u64) -> u32 {
        match self {
            BlockTable::Dense(v) => usize::try_from(b)
                .ok()
                .and_then(|b| v.get(b).copied())
                .unwrap_or(NONE),
            BlockTable::Sparse(m) => m.get(&b).copied().unwrap_or(NONE),
        }
    }

    /// Set block `b`'s value (a block past the table's end has none).
    fn set(&mut self, b: u64, x: u32) {
        match self {
            BlockTable::Dense(v) => {
                if let Some(slot) = usize::try_from(b).ok().and_then(|b| v.get_mut(b)) {
                    *slot = x;
                }
            }
            BlockTable::Sparse(m) => {
                m.insert(b, x);
            }
        }
    }
}

/// [`Merge::conflict`] for `ordered` (ops in merge order), whose blocks
/// lie below `blocks`. An op conflicts with a window holding an earlier op
/// that reads its destination (replaying that op after a crash would read
/// the new data) or writes one of its sources (which a valid order never
/// has), and with every window when it reads its own destination (an XOR of
/// a block changed in place: replayed after its write, it would combine its
/// payload with the new data instead of the old).
fn conflicts(ordered: &[Op], blocks: usize) -> Vec<u32> {
    let mut last_reader = BlockTable::new(blocks, ordered.len());
    let mut last_writer = BlockTable::new(blocks, ordered.len());
    let later = |a: u32, b: u32| match (a, b) {
        (NONE, x) | (x, NONE) => x,
        (a, b) => a.max(b),
    };
    let mut out = Vec::with_capacity(ordered.len());
    for (j, op) in ordered.iter().enumerate() {
        // Past 2^32 - 1 ops every op conflicts (scratch windows): safe.
        let j = u32::try_from(j).unwrap_or(NONE - 1);
        let mut c = last_reader.get(op.new_block);
        for b in op.source_blocks() {
            let w = if b == op.new_block {
                j
            } else {
                last_writer.get(b)
            };
            c = later(c, w);
        }
        out.push(c);
        for b in op.source_blocks() {
            last_reader.set(b, j);
        }
        last_writer.set(op.new_block, j);
    }
    out
}

/// What one run of the merge moves forward: its I/O, the header mirror, the merged
/// op count and the commits made.
struct Running<'r, 'p> {
    io: &'r mut dyn MergeIo,
    head: &'r mut [u8],
    pos: &'r mut u64,
    commits: usize,
    progress: &'p dyn Fn(u64, u64),
}

/// The two window slots and the staging area of one run, carved from its arena
/// ([`Merge::slot_sizes`]), and the window whose sources are being read ahead.
struct Slots<'a> {
    windows: [&'a mut [u8]; 2],
    sorteds: [&'a mut [u8]; 2],
    /// The staging area (2 * cap bytes), written by reads in flight: a raw pointer,
    /// as those reads outlive any borrow of it.
    staging: *mut u8,
    cap: usize,
    /// The window whose sources are being read: started while the one before it
    /// was written.
    pending: Option<Pending>,
    /// The prefetched window's (length, direct), cut when its reads were started.
    next_window: Option<(usize, bool)>,
}

impl<'a> Slots<'a> {
    fn new(arena: &'a mut AlignedBuf, cap: usize, early_cap: usize) -> Slots<'a> {
        let (windows, rest) = arena.split_at_mut(2 * cap);
        let (sorteds, staging) = rest.split_at_mut(2 * (cap + early_cap));
        let (w0, w1) = windows.split_at_mut(cap);
        let (s0, s1) = sorteds.split_at_mut(cap + early_cap);
        Slots {
            windows: [w0, w1],
            sorteds: [s0, s1],
            staging: staging.as_mut_ptr(),
            cap,
            pending: None,
            next_window: None,
        }
    }

    /// Assemble the window at `at` in slot `slot`'s buffers: wait for its sources,
    /// apply its XORs, start reading the next window's sources when `prefetch` (in a
    /// valid merge order, which `Merge::new` checked, no op reads a block an earlier
    /// op writes, so writes still running cannot change what those reads return; its
    /// XOR payloads are decoded meanwhile), and arrange its blocks for writing.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        &mut self,
        m: &Merge,
        io: &mut dyn MergeIo,
        at: usize,
        prefetch: bool,
        slot: usize,
        link: &mut DecoderLink,
        decoder: &mut IoStats,
        plan: &EarlyPlan,
    ) -> Result<Ready> {
        let (n, direct) = self.next_window.take().unwrap_or_else(|| m.window_at(at));
        let p = match self.pending.take() {
            Some(p) => p,
            None => {
                link.send(Job::Xor { pos: at, n });
                // SAFETY: the staging area (2 * cap bytes) is not touched until
                // `finish_sources` below waits for the reads.
                unsafe { m.start_sources(io, at, n, self.staging)? }
            }
        };
        debug_assert_eq!((p.pos, p.n), (at, n));
        let xors = link.take(m, Job::Xor { pos: at, n }, decoder)?;
        // SAFETY: the staging area is 2 * cap bytes inside the arena, disjoint from
        // every slice in use; `finish_sources` reads it only after waiting for the
        // reads into it.
        let staged = unsafe { std::slice::from_raw_parts(self.staging, 2 * self.cap) };
        let window = &mut *self.windows[slot];
        m.finish_sources(io, &p, window, staged, &xors.data)?;
        let next = at + n;
        if prefetch && next < m.ordered {
            let (len, d) = m.window_at(next);
            self.next_window = Some((len, d));
            link.send(Job::Xor { pos: next, n: len });
            // SAFETY: the staging area (consumed by `finish_sources` above) is left
            // alone until the next assembly's `finish_sources` waits for these reads;
            // `run` waits for them on every other path before the arena is dropped.
            self.pending = Some(unsafe { m.start_sources(io, next, len, self.staging)? });
        }
        let data = WindowData {
            blocks: window,
            early: plan.window(at),
            early_data: &xors.early,
        };
        let arranged = m.arrange(at, n, data, self.sorteds[slot]);
        Ok(Ready {
            pos: at,
            n,
            direct,
            arranged,
        })
    }
}

/// The run's link to the XOR decoder thread (`prepare::serve`): jobs sent, in order,
/// and their answers.
struct DecoderLink {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Result<Prepared>>,
    /// Jobs sent and not answered yet, in order.
    queued: VecDeque<Job>,
}

impl DecoderLink {
    fn send(&mut self, job: Job) {
        // The decoder runs until we hang up; should it have died, `take` reports it.
        let _ = self.jobs.send(job);
        self.queued.push_back(job);
    }

    /// Waits for the answer to `job`, adding its reads and the wait to `dec`.
    fn take(&mut self, m: &Merge, job: Job, dec: &mut IoStats) -> Result<Prepared> {
        let t = Instant::now();
        loop {
            let front = self.queued.pop_front();
            let answer = self.done.recv().map_err(|_| {
                m.cow_io(
                    "decode payloads",
                    0,
                    std::io::Error::other("the payload decoder stopped"),
                )
            })?;
            // Answers to jobs no longer wanted (none in practice) are skipped.
            if front == Some(job) {
                let p = answer?;
                dec.read_wait += t.elapsed();
                dec.syscalls += p.reads;
                dec.reads += p.reads;
                dec.bytes_read += p.bytes;
                return Ok(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// The direct window a scan with sets finds (the rule `window_at`
    /// applies through `conflicts`): the longest run of ops from `pos` in
    /// which no op writes a block an op before it in the run reads, or reads
    /// a block one before it writes, or reads its own destination.
    fn direct_len_by_sets(ops: &[Op], pos: usize, longest: usize) -> usize {
        let (mut dests, mut sources) = (HashSet::new(), HashSet::new());
        let mut n = 0;
        for op in &ops[pos..(pos + longest).min(ops.len())] {
            if sources.contains(&op.new_block)
                || op
                    .source_blocks()
                    .any(|b| b == op.new_block || dests.contains(&b))
            {
                break;
            }
            dests.insert(op.new_block);
            sources.extend(op.source_blocks());
            n += 1;
        }
        n
    }

    fn op(xor: bool, new_block: u64, source: u64) -> Op {
        Op {
            kind: if xor { OpKind::Xor } else { OpKind::Copy },
            new_block,
            source,
            blocks: 1,
            data_offset: 0,
            data_length: 0,
        }
    }

    proptest! {
        // Any op list (valid merge order or not), dense or sparse tables.
        #[test]
        fn conflicts_cut_windows_like_sets(
            raw in prop::collection::vec((any::<bool>(), 0u64..40, 0u64..40 * 4096), 1..120),
            longest in 1usize..64,
            sparse in any::<bool>(),
        ) {
            let ops: Vec<Op> = raw
                .iter()
                .map(|&(x, d, s)| if x { op(true, d, s) } else { op(false, d, s / 4096) })
                .collect();
            // 41 blocks (an unaligned XOR of block 39 reads block 40), or
            // far more than 16 Mi and 8 per op: a map.
            let blocks = if sparse { 1 << 40 } else { 41 };
            let c = conflicts(&ops, blocks);
            for pos in 0..ops.len() {
                let l = longest.min(ops.len() - pos);
                let by_table = c[pos..pos + l]
                    .iter()
                    .position(|&c| c != NONE && c as usize >= pos)
                    .unwrap_or(l);
                prop_assert_eq!(by_table, direct_len_by_sets(&ops, pos, l), "pos {}", pos);
            }
        }
    }
}
