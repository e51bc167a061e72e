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
//! 3. write W's destinations to the base, sync;
//! 4. `num_merge_ops += |W|` and `read_ahead_state = 1` in one header write,
//!    sync.
//!
//! A crash before 2 re-reads W's sources, still intact since no destination
//! of W was written. A crash between 2 and 4 finds state 2 and rewrites W
//! from the scratch copy (idempotent). After 4, W is done.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cow::format::{BLOCK_SIZE, BLOCK_SIZE_U64};
use cow::view::xor_into;
use cow::{CowReader, Op, OpKind};

use crate::error::{MergeError, Result};
use crate::io::{Dev, IoStats, MergeIo};
use crate::status::MergeStatus;

/// `read_ahead_state` values (`snapuserd_kernel.h`).
pub const STATE_NOT_STARTED: u8 = 0;
pub const STATE_IN_PROGRESS: u8 = 1;
pub const STATE_DONE: u8 = 2;

/// Scratch entry: new_block u64, file_offset u64.
const META_ENTRY: usize = 16;

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
}

impl Default for MergeOptions {
    fn default() -> Self {
        MergeOptions {
            window_ops: 510,
            commit_ops: 256,
            run_blocks: 256,
            max_commits: None,
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
    pub commits: u64,
    pub io: IoStats,
}

impl MergeReport {
    pub fn complete(&self) -> bool {
        self.merged == self.total_ops
    }
}

/// A window whose source reads were started (`Merge::start_sources`).
struct Pending {
    pos: usize,
    n: usize,
    /// Where each XOR op's stored payload starts in the payload buffer.
    at: Vec<usize>,
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
    meta_off: u64,
    meta_cap: usize,
    data_off: u64,
    window_cap: usize,
    opts: MergeOptions,
    status: Option<Arc<MergeStatus>>,
    cancel: Option<Arc<AtomicBool>>,
}

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
        Ok(Merge {
            cow,
            cow_path,
            order,
            ordered,
            header_size,
            meta_off: header_size as u64 + 1,
            meta_cap,
            data_off: (header_size + meta_size) as u64,
            window_cap,
            opts,
            status: None,
            cancel: None,
        })
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

    /// `num_merge_ops` (header offset 26) and the state byte after the header.
    fn parse_progress(&self, head: &[u8]) -> (u64, u8) {
        let mut n = [0u8; 8];
        n.copy_from_slice(&head[26..34]);
        (u64::from_le_bytes(n), head[self.header_size])
    }

    /// Run (or resume) the merge to completion, or until
    /// `opts.max_commits`. `progress(merged, total)` after every commit.
    pub fn run(&self, io: &mut dyn MergeIo, progress: &dyn Fn(u64, u64)) -> Result<MergeReport> {
        let total = self.order.len();
        let mut head = vec![0u8; self.header_size + 1];
        io.read_many(Dev::Cow, &mut [(0, &mut head[..])])
            .map_err(|e| self.cow_io("read header", 0, e))?;
        let (mut pos, state) = self.parse_progress(&head);
        if pos > total as u64 {
            return Err(MergeError::Corrupt {
                path: self.cow_path.clone(),
                offset: 26,
                msg: format!("num_merge_ops {pos} exceeds the {total} ops of the merge order"),
            });
        }
        let mut report = MergeReport {
            total_ops: total as u64,
            started_at: pos,
            merged: pos,
            ..Default::default()
        };
        if let Some(s) = &self.status {
            s.set_merged(pos as usize);
        }
        // Two window buffers in one registered allocation: window N is
        // written from one half while window N+1's sources are read into
        // the other. XOR payloads of each half have their own buffer.
        let cap = self.window_cap.max(1) * BLOCK_SIZE;
        let mut window = vec![0u8; 2 * cap];
        let mut stored: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
        if self.window_cap > 0 {
            io.register(&mut window)
                .map_err(|e| self.cow_io("register buffer", 0, e))?;
        }
        let result = (|| -> Result<()> {
            let mut commits = 0usize;
            let out_of_budget = |c: usize| {
                self.opts.max_commits.is_some_and(|m| c >= m)
                    || self
                        .cancel
                        .as_ref()
                        .is_some_and(|f| f.load(Ordering::Relaxed))
            };
            if state == STATE_DONE && (pos as usize) < self.ordered {
                let n = self.replay_window(io, pos as usize, &mut window[..cap])?;
                if n > 0 {
                    pos += n as u64;
                    self.commit(io, &mut head, pos)?;
                    report.replayed_window = true;
                    report.windows += 1;
                    commits += 1;
                    progress(pos, total as u64);
                }
            }
            let mut half = 0;
            let mut pending: Option<Pending> = None;
            while (pos as usize) < self.ordered && !out_of_budget(commits) {
                let n = (self.ordered - pos as usize).min(self.window_cap);
                let (a, b) = window.split_at_mut(cap);
                let (cur, other) = if half == 0 { (a, b) } else { (b, a) };
                let p = match pending.take() {
                    Some(p) => p,
                    // SAFETY: `cur` and `stored[half]` are not touched
                    // until `finish_sources` below waits for the reads.
                    None => unsafe {
                        self.start_sources(
                            io,
                            pos as usize,
                            n,
                            cur.as_mut_ptr(),
                            &mut stored[half],
                        )?
                    },
                };
                debug_assert_eq!((p.pos, p.n), (pos as usize, n));
                self.finish_sources(io, &p, cur, &stored[half])?;
                // Read the next window's sources while this one is written:
                // in a valid merge order (`Merge::new` checked it) no op
                // reads a block an earlier op writes, so these writes cannot
                // change what those reads return.
                let next = pos as usize + n;
                if next < self.ordered && !out_of_budget(commits + 1) {
                    let m = (self.ordered - next).min(self.window_cap);
                    // SAFETY: `other` and `stored[1 - half]` are left alone
                    // until the next iteration's `finish_sources` waits for
                    // these reads; `run` waits for them on every other path
                    // before the buffers are dropped.
                    pending = Some(unsafe {
                        self.start_sources(io, next, m, other.as_mut_ptr(), &mut stored[1 - half])?
                    });
                }
                self.merge_window(io, pos as usize, n, cur)?;
                half = 1 - half;
                pos += n as u64;
                self.commit(io, &mut head, pos)?;
                report.windows += 1;
                commits += 1;
                progress(pos, total as u64);
            }
            while (pos as usize) < total && !out_of_budget(commits) {
                let n = self.merge_replace_batch(io, pos as usize)?;
                pos += n as u64;
                self.commit(io, &mut head, pos)?;
                commits += 1;
                progress(pos, total as u64);
            }
            report.commits = commits as u64;
            Ok(())
        })();
        // Reads still in flight (a prefetch after the last commit of a
        // bounded run, or an error) must finish before `window` is freed.
        let waited = io.wait_reads();
        io.unregister();
        result?;
        waited.map_err(|e| self.base_io("read sources", 0, e))?;
        report.merged = pos;
        report.io = io.stats();
        Ok(report)
    }

    fn cow_io(&self, op: &'static str, offset: u64, e: std::io::Error) -> MergeError {
        MergeError::Io {
            path: self.cow_path.clone(),
            op,
            offset,
            source: e,
        }
    }

    fn base_io(&self, op: &'static str, offset: u64, e: std::io::Error) -> MergeError {
        MergeError::Io {
            path: PathBuf::from("base"),
            op,
            offset,
            source: e,
        }
    }

    /// Start reading the sources of order[pos..pos+n] into `buf` (slot i =
    /// op i) and the XOR payloads among them into `stored`.
    ///
    /// # Safety
    /// `buf` points to at least `n` blocks; neither it nor `stored` is
    /// read, written or moved until `finish_sources` (or `io.wait_reads`)
    /// returned.
    unsafe fn start_sources(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        n: usize,
        buf: *mut u8,
        stored: &mut Vec<u8>,
    ) -> Result<Pending> {
        let ops = &self.order[pos..pos + n];
        // Coalesce runs of consecutive source offsets into single reads.
        let mut runs: Vec<(u64, usize, usize)> = Vec::new(); // (offset, first slot, slots)
        for (i, op) in ops.iter().enumerate() {
            let off = match op.kind {
                OpKind::Copy => op.source * BLOCK_SIZE_U64,
                _ => op.source,
            };
            match runs.last_mut() {
                Some((o, s, c)) if *o + (*c as u64) * BLOCK_SIZE_U64 == off && *s + *c == i => {
                    *c += 1
                }
                _ => runs.push((off, i, 1)),
            }
        }
        let mut reqs: Vec<(u64, *mut u8, usize)> = runs
            .iter()
            // Slot arithmetic stays inside the `n` blocks the caller gave.
            .map(|&(off, s, c)| (off, buf.wrapping_add(s * BLOCK_SIZE), c * BLOCK_SIZE))
            .collect();
        let first = runs.first().map_or(0, |r| r.0);
        // SAFETY: forwarded from the caller: the slots stay untouched until
        // the reads are waited for.
        unsafe { io.start_reads(Dev::Base, &reqs) }
            .map_err(|e| self.base_io("read sources", first, e))?;
        // XOR payloads: adjacent in the COW (the writer lays them out in op
        // order) are one read.
        let mut at = Vec::new();
        let mut cow_runs: Vec<(u64, usize)> = Vec::new(); // (file offset, length)
        let mut len = 0;
        for op in ops.iter().filter(|o| o.kind == OpKind::Xor) {
            at.push(len);
            let l = op.data_length as usize;
            match cow_runs.last_mut() {
                Some((o, rl)) if *o + *rl as u64 == op.data_offset => *rl += l,
                _ => cow_runs.push((op.data_offset, l)),
            }
            len += l;
        }
        stored.clear();
        stored.resize(len, 0);
        reqs.clear();
        let mut p = 0;
        for &(off, l) in &cow_runs {
            reqs.push((off, stored.as_mut_ptr().wrapping_add(p), l));
            p += l;
        }
        if !reqs.is_empty() {
            // SAFETY: `stored` is not resized or touched until the reads are
            // waited for (caller's contract).
            unsafe { io.start_reads(Dev::Cow, &reqs) }
                .map_err(|e| self.cow_io("read payloads", cow_runs[0].0, e))?;
        }
        Ok(Pending { pos, n, at, first })
    }

    /// Wait for the reads `start_sources` started and apply the XORs.
    fn finish_sources(
        &self,
        io: &mut dyn MergeIo,
        p: &Pending,
        buf: &mut [u8],
        stored: &[u8],
    ) -> Result<()> {
        io.wait_reads()
            .map_err(|e| self.base_io("read sources", p.first, e))?;
        let mut payload = vec![0u8; BLOCK_SIZE];
        let mut k = 0;
        for (i, op) in self.order[p.pos..p.pos + p.n].iter().enumerate() {
            if op.kind == OpKind::Xor {
                let s = &stored[p.at[k]..p.at[k] + op.data_length as usize];
                self.cow.decode_payload(op, s, &mut payload)?;
                xor_into(&mut buf[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE], &payload);
                k += 1;
            }
        }
        Ok(())
    }

    /// Read the stored payloads of `ops` with as few reads as possible:
    /// payloads adjacent in the COW (the usual case: the writer lays them
    /// out in op order) are one read. Returns the bytes and each op's
    /// position in them.
    fn read_payloads(&self, io: &mut dyn MergeIo, ops: &[&Op]) -> Result<(Vec<u8>, Vec<usize>)> {
        let total: usize = ops.iter().map(|o| o.data_length as usize).sum();
        let mut stored = vec![0u8; total];
        let mut at = Vec::with_capacity(ops.len());
        let mut runs: Vec<(u64, usize)> = Vec::new(); // (file offset, length)
        let mut pos = 0;
        for op in ops {
            at.push(pos);
            let len = op.data_length as usize;
            match runs.last_mut() {
                Some((o, l)) if *o + *l as u64 == op.data_offset => *l += len,
                _ => runs.push((op.data_offset, len)),
            }
            pos += len;
        }
        let mut reqs: Vec<(u64, &mut [u8])> = Vec::with_capacity(runs.len());
        let mut rest: &mut [u8] = &mut stored;
        for &(off, len) in &runs {
            let (head, tail) = rest.split_at_mut(len);
            reqs.push((off, head));
            rest = tail;
        }
        let first = runs.first().map_or(0, |r| r.0);
        io.read_many(Dev::Cow, &mut reqs)
            .map_err(|e| self.cow_io("read payloads", first, e))?;
        Ok((stored, at))
    }

    fn merge_window(&self, io: &mut dyn MergeIo, pos: usize, n: usize, buf: &[u8]) -> Result<()> {
        // Publish: metadata + data, sync, then the state byte, sync.
        let mut meta = Vec::with_capacity((n + 1) * META_ENTRY);
        for (i, op) in self.order[pos..pos + n].iter().enumerate() {
            meta.extend_from_slice(&op.new_block.to_le_bytes());
            meta.extend_from_slice(&(self.data_off + (i * BLOCK_SIZE) as u64).to_le_bytes());
        }
        meta.extend_from_slice(&[0u8; META_ENTRY]);
        io.write_and_sync(
            Dev::Cow,
            &[
                (self.meta_off, &meta),
                (self.data_off, &buf[..n * BLOCK_SIZE]),
            ],
        )
        .map_err(|e| self.cow_io("write scratch", self.meta_off, e))?;
        io.write_and_sync(Dev::Cow, &[(self.header_size as u64, &[STATE_DONE])])
            .map_err(|e| self.cow_io("write state", self.header_size as u64, e))?;
        self.write_destinations(io, pos, n, buf)
    }

    /// Bring a shared status up to what the device holds, before serving
    /// reads: merged count, and a published window's scratch copy (whose
    /// sources may already be overwritten).
    pub fn load_status(&self, io: &mut dyn MergeIo, status: &MergeStatus) -> Result<()> {
        let (pos, state) = self.progress(io)?;
        status.set_merged(pos as usize);
        if state == STATE_DONE && (pos as usize) < self.ordered {
            let mut buf = vec![0u8; self.window_cap * BLOCK_SIZE];
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
    fn replay_window(&self, io: &mut dyn MergeIo, pos: usize, buf: &mut [u8]) -> Result<usize> {
        let n = self.read_scratch(io, pos, buf)?;
        if n > 0 {
            self.write_destinations(io, pos, n, buf)?;
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
            let (mut b, mut o) = ([0u8; 8], [0u8; 8]);
            b.copy_from_slice(&e[..8]);
            o.copy_from_slice(&e[8..]);
            let (block, off) = (u64::from_le_bytes(b), u64::from_le_bytes(o));
            if block == 0 && off == 0 {
                break;
            }
            let at = self.meta_off + (i * META_ENTRY) as u64;
            let expect = self.order.get(pos + i);
            let slot_ok = off == self.data_off + (i * BLOCK_SIZE) as u64;
            if i >= self.window_cap
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
        Ok(n)
    }

    fn write_destinations(
        &self,
        io: &mut dyn MergeIo,
        pos: usize,
        n: usize,
        buf: &[u8],
    ) -> Result<()> {
        let ops = &self.order[pos..pos + n];
        if let Some(s) = &self.status {
            // Readers of this window switch to the in-memory copy; the call
            // waits for reads of its sources still in flight.
            s.begin_window(pos, ops.iter().map(|o| o.new_block), &buf[..n * BLOCK_SIZE]);
        }
        let mut runs: Vec<(u64, usize, usize)> = Vec::new(); // (block, first slot, count)
        for (i, op) in ops.iter().enumerate() {
            match runs.last_mut() {
                Some((b, s, c)) if *b + *c as u64 == op.new_block && *s + *c == i => *c += 1,
                _ => runs.push((op.new_block, i, 1)),
            }
        }
        let reqs: Vec<(u64, &[u8])> = runs
            .iter()
            .map(|&(b, s, c)| {
                (
                    b * BLOCK_SIZE_U64,
                    &buf[s * BLOCK_SIZE..(s + c) * BLOCK_SIZE],
                )
            })
            .collect();
        let first = runs.first().map_or(0, |r| r.0 * BLOCK_SIZE_U64);
        io.write_and_sync(Dev::Base, &reqs)
            .map_err(|e| self.base_io("write destinations", first, e))
    }

    /// Merge up to `commit_ops` REPLACE/ZERO ops from `pos`; returns how many.
    fn merge_replace_batch(&self, io: &mut dyn MergeIo, pos: usize) -> Result<usize> {
        const MAX_BYTES: usize = 8 << 20;
        let mut end = pos;
        let mut bytes = 0;
        while end < self.order.len() && end - pos < self.opts.commit_ops {
            let sz = self.order[end].unit_size();
            if end > pos && bytes + sz > MAX_BYTES {
                break;
            }
            bytes += sz;
            end += 1;
        }
        let ops = &self.order[pos..end];
        let mut data = vec![0u8; bytes];
        let replaces: Vec<&Op> = ops.iter().filter(|o| o.kind == OpKind::Replace).collect();
        let (stored, stored_at) = self.read_payloads(io, &replaces)?;
        let mut k = 0;
        let mut runs: Vec<(u64, usize, usize)> = Vec::new(); // (block, byte start, len)
        let mut at = 0;
        for op in ops {
            let len = op.unit_size();
            match op.kind {
                OpKind::Replace => {
                    let s = &stored[stored_at[k]..stored_at[k] + op.data_length as usize];
                    self.cow.decode_payload(op, s, &mut data[at..at + len])?;
                    k += 1;
                }
                OpKind::Zero => {}
                OpKind::Copy | OpKind::Xor => {
                    return Err(MergeError::Corrupt {
                        path: self.cow_path.clone(),
                        offset: 0,
                        msg: format!(
                            "{} op for block {} after REPLACE/ZERO ops",
                            op.kind, op.new_block
                        ),
                    });
                }
            }
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
        let reqs: Vec<(u64, &[u8])> = runs
            .iter()
            .map(|&(b, s, l)| (b * BLOCK_SIZE_U64, &data[s..s + l]))
            .collect();
        let first = runs.first().map_or(0, |r| r.0 * BLOCK_SIZE_U64);
        io.write_and_sync(Dev::Base, &reqs)
            .map_err(|e| self.base_io("write REPLACE/ZERO", first, e))?;
        Ok(end - pos)
    }

    /// `num_merge_ops = pos`, `read_ahead_state = 1`: one write of the
    /// header and the state byte (same page), then sync.
    fn commit(&self, io: &mut dyn MergeIo, head: &mut [u8], pos: u64) -> Result<()> {
        head[26..34].copy_from_slice(&pos.to_le_bytes());
        head[self.header_size] = STATE_IN_PROGRESS;
        io.write_and_sync(Dev::Cow, &[(0, head)])
            .map_err(|e| self.cow_io("commit header", 0, e))?;
        if let Some(s) = &self.status {
            s.set_merged(pos as usize);
        }
        Ok(())
    }
}
