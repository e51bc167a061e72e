//! Batched execution of large requests: sorted, merged source reads.
//!
//! A 1 MiB read of an updated image is a few hundred single-block COPY/XOR ops. In
//! destination order their sources are scattered, but sorted they are nearly contiguous:
//! on the corpus `system` ext4 pair a 1 MiB request needs ~250 base blocks from ~4 source
//! runs, and its XOR payloads sit together in the COW data area (the writer emits data in
//! op order). So a large request sorts the source ranges of its base and XOR segments and
//! cuts them into runs (neighbours at most [`BASE_GAP`] apart are read together, the gap
//! discarded). Each run is one vectored read, all of them submitted at once through the
//! thread's io_uring (in parallel on the I/O pool without one): page-aligned sources
//! whose destination is page-aligned too (COPY and unchanged blocks, XORs at block
//! offsets, into a FUSE worker's aligned reply buffer) are scattered by the kernel
//! straight to their destination, with `O_DIRECT` where the base allows it; the rest of
//! the run (gaps, XOR sources at byte offsets, sources two destinations share) lands in a
//! bounce buffer. The XOR payloads and the stored bytes of fully covered REPLACE units are
//! fetched the same way from the COW (`O_DIRECT` too), then decoded from memory
//! (`CowReader::decode_payload`): an XOR block is written as source XOR payload in one
//! pass. Hundreds of 4 KiB reads become a handful of large ones, and on the corpus pairs
//! most bytes are never copied by the CPU on the way to the reply.

use std::ops::Range;
use std::sync::Mutex;

use cow::{Op, OpKind};

use smallvec::SmallVec;

use super::{CowEngine, Seg, xor_into, xor_to};
use crate::error::{EngineError, Result};
use crate::io::{AlignedBuf, DIRECT_ALIGN, ImageFile};
use crate::{BLOCK_SIZE, uring};

/// Base sources at most this far apart are read as one run. Reading the gap costs less
/// than another request to the device; it also bounds the waste to this much per source.
pub(super) const BASE_GAP: u64 = 32 << 10;
/// COW payloads are usually back to back; this tolerates a few unrelated ones between.
const COW_GAP: u64 = 16 << 10;
/// Longest run read with one call, so bounce buffers stay bounded.
const RUN_MAX: u64 = 2 << 20;
/// Bounce buffers kept for reuse (larger ones are freed after the request).
const POOL_KEEP: usize = 64;

/// One range to fetch: bytes `[start, end)` of a file, for entry `item` of the caller's
/// list of targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Want {
    pub start: u64,
    pub end: u64,
    pub item: usize,
}

/// Bytes `[start, end)` read with one call; they serve `wants[wants]` (after sorting).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub start: u64,
    pub end: u64,
    pub wants: Range<usize>,
}

/// Sorts `wants` by offset and cuts them into runs: a want joins the current run when it
/// starts at most `gap` bytes past the run's end and the run stays within `max_len`
/// bytes (a single want longer than that is a run of its own). Overlapping wants (two
/// destinations with the same source) share the bytes.
pub(crate) fn plan_runs(wants: &mut [Want], gap: u64, max_len: u64) -> Vec<Run> {
    wants.sort_unstable_by_key(|w| (w.start, w.end, w.item));
    let mut runs: Vec<Run> = Vec::new();
    for (i, w) in wants.iter().enumerate() {
        if let Some(r) = runs.last_mut()
            && w.start <= r.end.saturating_add(gap)
            && w.end.max(r.end) - r.start <= max_len
        {
            r.end = r.end.max(w.end);
            r.wants.end = i + 1;
            continue;
        }
        runs.push(Run {
            start: w.start,
            end: w.end,
            wants: i..i + 1,
        });
    }
    runs
}

/// Free list of page-aligned bounce buffers, so large requests do not allocate and zero
/// a megabyte each.
#[derive(Debug, Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<AlignedBuf>>,
}

impl BufPool {
    /// A buffer that holds `len` bytes without growing if one is free (growing means
    /// allocating and zeroing again), else the largest.
    fn take(&self, len: u64) -> AlignedBuf {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let need = len as usize + DIRECT_ALIGN;
        let best = (0..free.len())
            .filter(|&i| free[i].capacity() >= need)
            .min_by_key(|&i| free[i].capacity())
            .or_else(|| (0..free.len()).max_by_key(|&i| free[i].capacity()));
        best.map(|i| free.swap_remove(i)).unwrap_or_default()
    }

    fn give(&self, buf: AlignedBuf) {
        // A run widened to the alignment on both sides, plus the alignment slack.
        if buf.capacity() > RUN_MAX as usize + 3 * DIRECT_ALIGN {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < POOL_KEEP {
            free.push(buf);
        }
    }
}

/// The buffers one run is read into, in file order: destinations that take their source
/// bytes as they are (aligned base segments), and pieces of the run's bounce buffer for
/// everything else (gaps, XOR sources at byte offsets, overlapping sources).
type Parts<'a> = SmallVec<[&'a mut [u8]; 4]>;

/// Parts per run: well under the kernel's iovec limit, so a run is one `readv`.
const PARTS_MAX: usize = 256;

/// `[start, end)` of `run` widened to the `O_DIRECT` alignment, clipped at `size` (where
/// the image reads the tail through its buffered descriptor).
fn extent(run: &Run, size: u64) -> (u64, u64) {
    let a = DIRECT_ALIGN as u64;
    let start = run.start / a * a;
    let end = run.end.div_ceil(a).saturating_mul(a).min(size).max(run.end);
    (start, end)
}

/// Splits the read of `run` (file bytes from `start`, `bounce` holding all of them) into
/// parts: each want that can be read in place (page-aligned source range and destination,
/// the whole segment, no other want sharing its bytes) gets its destination, taken out of
/// `dsts` and marked in `in_place`; the bytes between them go to the matching ranges of
/// `bounce`.
fn scatter_parts<'x>(
    run: &Run,
    start: u64,
    bounce: &'x mut [u8],
    wants: &[Want],
    dsts: &mut [(Seg, &'x mut [u8])],
    in_place: &mut [bool],
) -> Parts<'x> {
    let a = DIRECT_ALIGN as u64;
    let ws = &wants[run.wants.clone()];
    let mut parts: Parts<'x> = SmallVec::new();
    // `rest` is the bounce from file offset `pos` on.
    let mut rest: &'x mut [u8] = bounce;
    let mut pos = start;
    let mut max_end = start;
    for (k, w) in ws.iter().enumerate() {
        let shares_prev = w.start < max_end;
        max_end = max_end.max(w.end);
        let shares_next = ws.get(k + 1).is_some_and(|n| n.start < w.end);
        let (seg, dst) = &dsts[w.item];
        let fits = !shares_prev
            && !shares_next
            && matches!(seg, Seg::Base { .. } | Seg::Xor { .. })
            && w.start.is_multiple_of(a)
            && w.end.is_multiple_of(a)
            && dst.len() as u64 == w.end - w.start
            && (dst.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
            && parts.len() + 3 <= PARTS_MAX;
        if !fits {
            continue;
        }
        let (gap, r) = std::mem::take(&mut rest).split_at_mut((w.start - pos) as usize);
        let (_, r) = r.split_at_mut((w.end - w.start) as usize);
        rest = r;
        if !gap.is_empty() {
            parts.push(gap);
        }
        parts.push(std::mem::take(&mut dsts[w.item].1));
        in_place[w.item] = true;
        pos = w.end;
    }
    if !rest.is_empty() {
        parts.push(rest);
    }
    parts
}

impl CowEngine {
    /// Runs `plan` over `buf` with merged source reads; see the module comment. Only for
    /// plans with several base/XOR segments (small requests stay on the inline path).
    pub(super) fn execute_gathered(&self, plan: &[Seg], buf: &mut [u8]) -> Result<()> {
        let ops = self.reader.ops();
        let Sorted {
            mut targets,
            mut others,
            mut base_wants,
            mut cow_wants,
        } = sort_segments(ops, plan, buf);
        let base_runs = plan_runs(&mut base_wants, BASE_GAP, RUN_MAX);
        let cow_runs = plan_runs(&mut cow_wants, COW_GAP, RUN_MAX);
        let base_size = self.base.size();
        let base_ext: Vec<(u64, u64)> = base_runs.iter().map(|r| extent(r, base_size)).collect();
        // Without the second COW descriptor the runs are read as they are (`pread`).
        let cow_ext: Vec<(u64, u64)> = match &self.cow_file {
            Some(f) => cow_runs.iter().map(|r| extent(r, f.size())).collect(),
            None => cow_runs.iter().map(|r| (r.start, r.end)).collect(),
        };
        let mut base_bufs: Vec<AlignedBuf> = base_ext
            .iter()
            .map(|&(s, e)| self.bounce.take(e - s))
            .collect();
        let mut cow_bufs: Vec<AlignedBuf> = cow_ext
            .iter()
            .map(|&(s, e)| self.bounce.take(e - s))
            .collect();

        // Phase 1: every run in flight at once, each scattered by the kernel to the
        // destinations it can fill in place; zero and partial-unit segments meanwhile.
        let mut in_place = vec![false; targets.len()];
        let io_result = {
            // The destinations, reborrowed for the reads: the XOR ones are used again
            // afterwards, through `targets`.
            let mut dsts: Vec<(Seg, &mut [u8])> = targets
                .iter_mut()
                .map(|(seg, d)| (*seg, &mut **d))
                .collect();
            let mut base_io: Vec<(u64, Parts<'_>)> = base_runs
                .iter()
                .zip(&base_ext)
                .zip(base_bufs.iter_mut())
                .map(|((run, &(s, e)), b)| {
                    let bounce = b.slice_mut((e - s) as usize);
                    let parts =
                        scatter_parts(run, s, bounce, &base_wants, &mut dsts, &mut in_place);
                    (s, parts)
                })
                .collect();
            let mut cow_io: Vec<(u64, Parts<'_>)> = cow_ext
                .iter()
                .zip(cow_bufs.iter_mut())
                .map(|(&(s, e), b)| {
                    let mut parts = Parts::new();
                    parts.push(b.slice_mut((e - s) as usize));
                    (s, parts)
                })
                .collect();
            self.stats
                .base_reads
                .fetch_add(base_io.len() as u64, std::sync::atomic::Ordering::Relaxed);
            let r = self.read_runs(&mut base_io, &mut cow_io);
            // Zero and partial-unit segments, while nothing else needs this thread.
            let others_result = others
                .iter_mut()
                .try_for_each(|(seg, dst)| self.run_seg(*seg, dst));
            r.and(others_result)
        };
        if let Err(e) = io_result {
            self.recycle(base_bufs, cow_bufs);
            return Err(e);
        }
        let n: usize = (targets.iter().zip(&in_place))
            .filter(|(_, p)| **p)
            .map(|(t, _)| t.1.len())
            .sum();
        self.stats
            .in_place_bytes
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);

        // Phase 2: copy the base bytes that went to a bounce buffer (XOR sources are
        // combined with their payload in one pass instead), then decode the COW payloads.
        let mut base_src: Vec<Option<&[u8]>> = vec![None; targets.len()];
        for ((run, &(s, _)), b) in base_runs.iter().zip(&base_ext).zip(&base_bufs) {
            let data = b.as_slice();
            for w in &base_wants[run.wants.clone()] {
                let (seg, dst) = &mut targets[w.item];
                if in_place[w.item] {
                    continue;
                }
                let from = (w.start - s) as usize;
                let src = &data[from..from + dst.len()];
                match seg {
                    Seg::Xor { .. } => base_src[w.item] = Some(src),
                    _ => dst.copy_from_slice(src),
                }
            }
        }
        let stored =
            cow_runs
                .iter()
                .zip(&cow_ext)
                .zip(&cow_bufs)
                .flat_map(|((run, &(s, _)), b)| {
                    let data = b.as_slice();
                    cow_wants[run.wants.clone()].iter().map(move |w| {
                        let from = (w.start - s) as usize;
                        (w.item, &data[from..from + (w.end - w.start) as usize])
                    })
                });
        let result = self.decode_from_runs(stored, &base_src, &mut targets);
        self.recycle(base_bufs, cow_bufs);
        result
    }

    /// Reads `(offset, parts)` pairs (each part filled in turn from the file at `offset`)
    /// from the base and from the COW: all submitted at once through this thread's
    /// io_uring, or, without one, on the I/O pool.
    fn read_runs<'a>(
        &self,
        base_io: &mut [(u64, Parts<'a>)],
        cow_io: &mut [(u64, Parts<'a>)],
    ) -> Result<()> {
        let jobs = base_io.len() + cow_io.len();
        // Its arguments are worked out only when spans are on (the request path).
        let _span = trace::spans::enabled()
            .then(|| {
                let bytes = |io: &[(u64, Parts<'a>)]| -> u64 {
                    io.iter()
                        .flat_map(|(_, p)| p.iter())
                        .map(|p| p.len() as u64)
                        .sum()
                };
                let first = base_io.first().or(cow_io.first()).map_or(0, |(o, _)| *o);
                trace::spans::span("base+cow reads", first, bytes(base_io) + bytes(cow_io))
            })
            .flatten();
        // Even a single run goes through the ring: it may be scattered to many parts,
        // which one vectored read fills and `pread` would need one call for each.
        if (cow_io.is_empty() || self.cow_file.is_some()) && uring::available() {
            let mut reads: Vec<uring::Read<'_>> = Vec::with_capacity(jobs);
            // Where each read comes from, for error messages: (is_cow, offset).
            let mut whence: Vec<(bool, u64)> = Vec::with_capacity(jobs);
            let mut sync: Vec<(&ImageFile, u64, &mut Parts<'_>)> = Vec::new();
            let cow_io: &mut [(u64, Parts<'a>)] = match &self.cow_file {
                Some(_) => cow_io,
                None => &mut [],
            };
            let files = std::iter::repeat((&self.base, false))
                .zip(base_io.iter_mut())
                .chain(
                    std::iter::repeat((self.cow_file.as_ref().unwrap_or(&self.base), true))
                        .zip(cow_io.iter_mut()),
                );
            for ((file, is_cow), (offset, parts)) in files {
                match file.fd_for_parts(parts, *offset) {
                    Some(fd) => {
                        whence.push((is_cow, *offset));
                        reads.push(uring::Read {
                            fd,
                            offset: *offset,
                            bufs: parts.iter_mut().map(|p| &mut **p).collect(),
                        });
                    }
                    None => sync.push((file, *offset, parts)),
                }
            }
            if let Some(results) = uring::read_batch(&mut reads) {
                for (file, offset, parts) in sync {
                    read_parts(file, offset, parts)?;
                }
                for (r, (is_cow, offset)) in results.into_iter().zip(whence) {
                    r.map_err(|source| {
                        EngineError::Io(
                            vabc_io::Error::new(
                                "read",
                                if is_cow {
                                    self.cow_path.clone()
                                } else {
                                    self.base.path().to_path_buf()
                                },
                                source,
                            )
                            .at(offset),
                        )
                    })?;
                }
                return Ok(());
            }
            // The ring vanished between the two calls (re-entrancy): nothing was read.
            drop(reads);
        }
        let first_error: Mutex<Option<EngineError>> = Mutex::new(None);
        let record = |r: Result<()>| {
            if let Err(e) = r {
                let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                slot.get_or_insert(e);
            }
        };
        let read_base = |offset: u64, parts: &mut Parts<'_>| read_parts(&self.base, offset, parts);
        let read_cow = |offset: u64, parts: &mut Parts<'_>| match &self.cow_file {
            Some(f) => read_parts(f, offset, parts),
            None => parts
                .iter_mut()
                .try_fold(offset, |at, p| {
                    self.reader.read_file_at(p, at)?;
                    Ok(at + p.len() as u64)
                })
                .map(|_| ()),
        };
        match &self.io_pool {
            Some(io_pool) if jobs > 1 => io_pool.in_place_scope(|scope| {
                let record = &record;
                let (read_base, read_cow) = (&read_base, &read_cow);
                for (offset, parts) in base_io.iter_mut() {
                    let offset = *offset;
                    scope.spawn(move |_| record(read_base(offset, parts)));
                }
                for (offset, parts) in cow_io.iter_mut() {
                    let offset = *offset;
                    scope.spawn(move |_| record(read_cow(offset, parts)));
                }
            }),
            _ => {
                for (offset, parts) in base_io.iter_mut() {
                    record(read_base(*offset, parts));
                }
                for (offset, parts) in cow_io.iter_mut() {
                    record(read_cow(*offset, parts));
                }
            }
        }
        match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Applies the XOR payloads and decodes the REPLACE units whose stored bytes are
    /// `stored` (item, bytes). An XOR block is its base source (`base_src`, or the bytes
    /// already in place) XOR the decoded payload, written in one pass. Two or more REPLACE
    /// units decode on the decode pool, XOR blocks inline.
    fn decode_from_runs<'s>(
        &self,
        stored: impl Iterator<Item = (usize, &'s [u8])>,
        base_src: &[Option<&[u8]>],
        targets: &mut [(Seg, &mut [u8])],
    ) -> Result<()> {
        let ops = self.reader.ops();
        let _span = trace::spans::enabled()
            .then(|| {
                let out: u64 = targets.iter().map(|(_, t)| t.len() as u64).sum();
                trace::spans::span("decode", 0, out)
            })
            .flatten();
        // Stored bytes of each item, indexed by item.
        let mut raw_of: Vec<Option<&[u8]>> = vec![None; targets.len()];
        let mut replaces = 0usize;
        for (item, raw) in stored {
            raw_of[item] = Some(raw);
            replaces += usize::from(matches!(targets[item].0, Seg::Replace { .. }));
        }
        let mut payload = [0u8; BLOCK_SIZE];
        let mut decode = |seg: Seg, raw: &[u8], src: Option<&[u8]>, dst: &mut [u8]| -> Result<()> {
            match seg {
                Seg::Xor {
                    op,
                    block_offset,
                    len,
                } => {
                    self.reader
                        .decode_payload(&ops[op as usize], raw, &mut payload)?;
                    let p = &payload[block_offset..block_offset + len];
                    match src {
                        Some(src) => xor_to(dst, src, p),
                        None => xor_into(dst, p),
                    }
                }
                Seg::Replace { op, .. } => {
                    self.stats
                        .unit_decodes
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.reader.decode_payload(&ops[op as usize], raw, dst)?;
                }
                Seg::Base { .. } | Seg::Zero { .. } => {}
            }
            Ok(())
        };
        match &self.pool {
            Some(pool) if replaces >= 2 && self.decode_on_pool() => {
                let first_error: Mutex<Option<EngineError>> = Mutex::new(None);
                let record = |r: Result<()>| {
                    if let Err(e) = r {
                        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                    }
                };
                pool.local().in_place_scope(|scope| {
                    let record = &record;
                    for (((seg, dst), raw), src) in targets.iter_mut().zip(&raw_of).zip(base_src) {
                        let Some(raw) = *raw else { continue };
                        if let Seg::Replace { op, .. } = *seg {
                            let dst: &mut [u8] = dst;
                            crate::pool::timed(scope, &self.stats.queue_delays, move || {
                                self.stats
                                    .unit_decodes
                                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                record(
                                    self.reader
                                        .decode_payload(&ops[op as usize], raw, dst)
                                        .map_err(EngineError::from),
                                )
                            });
                        } else {
                            record(decode(*seg, raw, *src, dst));
                        }
                    }
                });
                match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            }
            _ => {
                for (((seg, dst), raw), src) in targets.iter_mut().zip(&raw_of).zip(base_src) {
                    if let Some(raw) = *raw {
                        decode(*seg, raw, *src, dst)?;
                    }
                }
                Ok(())
            }
        }
    }

    fn recycle(&self, base: Vec<AlignedBuf>, cow: Vec<AlignedBuf>) {
        for b in base.into_iter().chain(cow) {
            self.bounce.give(b);
        }
    }
}

/// Fills `parts` in turn from `file` at `offset` with blocking reads.
fn read_parts(file: &ImageFile, offset: u64, parts: &mut Parts<'_>) -> Result<()> {
    let mut at = offset;
    for p in parts.iter_mut() {
        file.read_exact_at(p, at)?;
        at += p.len() as u64;
    }
    Ok(())
}

/// A plan's segments sorted for gathering: the destinations of base/XOR segments and
/// of fully covered REPLACE units (`targets`, by item) with the source ranges they
/// want from the base and the COW, and the segments served one by one (`others`).
struct Sorted<'b> {
    targets: Vec<(Seg, &'b mut [u8])>,
    others: Vec<(Seg, &'b mut [u8])>,
    base_wants: Vec<Want>,
    cow_wants: Vec<Want>,
}

/// Cuts `buf` into each segment's destination and sorts them ([`Sorted`]).
fn sort_segments<'b>(ops: &[Op], plan: &[Seg], buf: &'b mut [u8]) -> Sorted<'b> {
    let mut targets: Vec<(Seg, &mut [u8])> = Vec::with_capacity(plan.len());
    let mut others: Vec<(Seg, &mut [u8])> = Vec::new();
    let mut base_wants: Vec<Want> = Vec::with_capacity(plan.len());
    let mut cow_wants: Vec<Want> = Vec::new();
    let mut rest = buf;
    for seg in plan {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(seg.len());
        rest = tail;
        let item = targets.len();
        match *seg {
            Seg::Base { offset, len } => base_wants.push(Want {
                start: offset,
                end: offset + len as u64,
                item,
            }),
            Seg::Xor {
                op,
                block_offset,
                len,
            } => {
                let op = &ops[op as usize];
                let start = op.source + block_offset as u64;
                base_wants.push(Want {
                    start,
                    end: start + len as u64,
                    item,
                });
                cow_wants.push(Want {
                    start: op.data_offset,
                    end: op.data_offset + u64::from(op.data_length),
                    item,
                });
            }
            Seg::Replace {
                op,
                unit_offset: 0,
                len,
            } if len == ops[op as usize].unit_size()
                && ops[op as usize].kind == OpKind::Replace =>
            {
                let op = &ops[op as usize];
                cow_wants.push(Want {
                    start: op.data_offset,
                    end: op.data_offset + u64::from(op.data_length),
                    item,
                });
            }
            _ => {
                others.push((*seg, head));
                continue;
            }
        }
        targets.push((*seg, head));
    }
    Sorted {
        targets,
        others,
        base_wants,
        cow_wants,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(start: u64, end: u64, item: usize) -> Want {
        Want { start, end, item }
    }

    #[test]
    fn runs_merge_sorted_neighbours_within_the_gap() {
        let mut wants = vec![
            w(8192, 12288, 0),
            w(0, 4096, 1),
            w(4096, 8192, 2),
            w(100_000, 104_096, 3),
            w(12288 + 100, 12288 + 200, 4),
        ];
        let runs = plan_runs(&mut wants, 1000, 1 << 20);
        assert_eq!(
            runs,
            vec![
                Run {
                    start: 0,
                    end: 12488,
                    wants: 0..4
                },
                Run {
                    start: 100_000,
                    end: 104_096,
                    wants: 4..5
                },
            ]
        );
        assert_eq!(
            wants.iter().map(|w| w.item).collect::<Vec<_>>(),
            vec![1, 2, 0, 4, 3]
        );
    }

    #[test]
    fn without_io_uring_the_io_pool_reads_the_runs() {
        use crate::{BlockDevice, CowEngineOptions};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/aosp-cow-vectors");
        let want = std::fs::read(dir.join("expected.img")).unwrap();
        uring::disable_for_this_thread();
        assert!(!uring::available());
        for cow in ["v3_lz4_65536.cow", "v2_gz_4096.cow", "v3_none_4096.cow"] {
            for direct in [true, false] {
                let e = CowEngine::open(
                    &dir.join("base.img"),
                    &dir.join(cow),
                    &CowEngineOptions {
                        direct_io: direct,
                        ..Default::default()
                    },
                )
                .unwrap();
                let mut buf = AlignedBuf::new(want.len());
                let out = buf.slice_mut(want.len());
                e.read_at(out, 0).unwrap();
                assert!(out == &want[..], "{cow} direct={direct}");
                let mut odd = vec![0u8; 200_001];
                e.read_at(&mut odd, 4097).unwrap();
                assert!(odd == want[4097..4097 + odd.len()], "{cow} direct={direct}");
            }
        }
    }

    #[test]
    fn runs_respect_the_length_cap_and_share_overlaps() {
        let mut wants = vec![
            w(0, 4096, 0),
            w(0, 4096, 1),
            w(4096, 8192, 2),
            w(8192, 20000, 3),
        ];
        let runs = plan_runs(&mut wants, 0, 8192);
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (runs[0].start, runs[0].end, runs[0].wants.clone()),
            (0, 8192, 0..3)
        );
        // Longer than the cap on its own: still one run.
        assert_eq!((runs[1].start, runs[1].end), (8192, 20000));
        assert!(plan_runs(&mut [], 0, 1).is_empty());
    }
}
