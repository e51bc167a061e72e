//! Batched execution of large requests: sorted, merged source reads.
//!
//! A 1 MiB read of an updated image is a few hundred single-block COPY/XOR ops. In
//! destination order their sources are scattered, but sorted they are nearly contiguous:
//! on the corpus `system` ext4 pair a 1 MiB request needs ~250 base blocks from ~4 source
//! runs, and its XOR payloads sit together in the COW data area (the writer emits data in
//! op order). So a large request sorts the source ranges of its base and XOR segments,
//! cuts them into runs (neighbours at most [`BASE_GAP`] apart are read together, the gap
//! discarded), reads each run with one `pread` (in parallel on the I/O pool when there are
//! several), and scatters the bytes to their destinations. The XOR payloads and the
//! stored bytes of fully covered REPLACE units are fetched the same way from the COW, then
//! decoded from memory (`CowReader::decode_payload`). Hundreds of 4 KiB reads become a
//! handful of large ones; the price is one memory copy of the request.

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use cow::OpKind;

use super::{CowEngine, Seg, xor_into};
use crate::error::{EngineError, Result};
use crate::io::{AlignedBuf, DIRECT_ALIGN};
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
        if buf.capacity() > RUN_MAX as usize + DIRECT_ALIGN {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < POOL_KEEP {
            free.push(buf);
        }
    }
}

/// Where a run's bytes land: straight in the one destination it serves, or a bounce
/// buffer that is scattered afterwards (`skip`: bytes before the run's start that
/// alignment added).
enum Fetch<'a> {
    Direct(&'a mut [u8]),
    Bounce { buf: AlignedBuf, skip: usize },
}

impl CowEngine {
    /// Runs `plan` over `buf` with merged source reads; see the module comment. Only for
    /// plans with several base/XOR segments (small requests stay on the inline path).
    pub(super) fn execute_gathered(&self, plan: &[Seg], buf: &mut [u8]) -> Result<()> {
        let ops = self.reader.ops();
        // Destinations of base/XOR segments and of fully covered REPLACE units, by item.
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
        let base_runs = plan_runs(&mut base_wants, BASE_GAP, RUN_MAX);
        let cow_runs = plan_runs(&mut cow_wants, COW_GAP, RUN_MAX);

        // Phase 1: every run in flight at once; zero and partial-unit segments meanwhile.
        let mut base_fetch: Vec<Fetch<'_>> = Vec::with_capacity(base_runs.len());
        for run in &base_runs {
            let w = &base_wants[run.wants.start];
            // A run of one base segment is read in place, as the inline path would.
            base_fetch.push(
                if run.wants.len() == 1 && matches!(targets[w.item].0, Seg::Base { .. }) {
                    Fetch::Direct(std::mem::take(&mut targets[w.item].1))
                } else {
                    Fetch::Bounce {
                        buf: self.bounce.take(run.end - run.start + DIRECT_ALIGN as u64),
                        skip: 0,
                    }
                },
            );
        }
        let mut cow_bufs: Vec<AlignedBuf> = cow_runs
            .iter()
            .map(|run| self.bounce.take(run.end - run.start))
            .collect();
        let io_result = {
            // File offset and destination of every read.
            let mut base_io: Vec<(u64, &mut [u8])> = base_runs
                .iter()
                .zip(base_fetch.iter_mut())
                .map(|(run, fetch)| match fetch {
                    Fetch::Direct(dst) => (run.start, &mut **dst),
                    Fetch::Bounce { buf, skip } => {
                        // Widen to the O_DIRECT alignment (clipped at the end of the file,
                        // where the image reads the tail through its buffered descriptor).
                        let a = DIRECT_ALIGN as u64;
                        let start = run.start / a * a;
                        let end = run.end.div_ceil(a).saturating_mul(a).min(self.base.size());
                        *skip = (run.start - start) as usize;
                        (start, buf.slice_mut((end - start) as usize))
                    }
                })
                .collect();
            let mut cow_io: Vec<(u64, &mut [u8])> = cow_runs
                .iter()
                .zip(cow_bufs.iter_mut())
                .map(|(run, buf)| (run.start, buf.slice_mut((run.end - run.start) as usize)))
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
            self.recycle(base_fetch, cow_bufs);
            return Err(e);
        }

        // Phase 2: scatter the base bytes, then decode the COW payloads over them.
        for (run, fetch) in base_runs.iter().zip(base_fetch.iter()) {
            let Fetch::Bounce { buf, skip } = fetch else {
                continue;
            };
            let data = &buf.as_slice()[*skip..];
            for w in &base_wants[run.wants.clone()] {
                let from = (w.start - run.start) as usize;
                let dst = &mut targets[w.item].1;
                dst.copy_from_slice(&data[from..from + dst.len()]);
            }
        }
        let result = self.decode_from_runs(&cow_runs, &cow_wants, &cow_bufs, &mut targets);
        self.recycle(base_fetch, cow_bufs);
        result
    }

    /// Reads `(offset, buffer)` pairs from the base and from the COW: all submitted at
    /// once through this thread's io_uring, or, without one, on the I/O pool.
    fn read_runs(
        &self,
        base_io: &mut [(u64, &mut [u8])],
        cow_io: &mut [(u64, &mut [u8])],
    ) -> Result<()> {
        let cow_fd = self.cow_file.as_ref().map(|f| f.as_raw_fd());
        let jobs = base_io.len() + cow_io.len();
        if jobs > 1 && (cow_io.is_empty() || cow_fd.is_some()) && uring::available() {
            let mut reads: Vec<uring::Read<'_>> = Vec::with_capacity(jobs);
            // Where each read comes from, for error messages: (is_cow, offset).
            let mut whence: Vec<(bool, u64)> = Vec::with_capacity(jobs);
            let mut sync: Vec<(u64, &mut [u8])> = Vec::new();
            for (offset, buf) in base_io.iter_mut() {
                match self.base.fd_for(buf, *offset) {
                    Some(fd) => {
                        whence.push((false, *offset));
                        reads.push(uring::Read {
                            fd,
                            offset: *offset,
                            buf,
                        });
                    }
                    None => sync.push((*offset, &mut **buf)),
                }
            }
            if let Some(fd) = cow_fd {
                for (offset, buf) in cow_io.iter_mut() {
                    whence.push((true, *offset));
                    reads.push(uring::Read {
                        fd,
                        offset: *offset,
                        buf,
                    });
                }
            }
            if let Some(results) = uring::read_batch(&mut reads) {
                for (offset, buf) in sync {
                    self.base.read_exact_at(buf, offset)?;
                }
                for (r, (is_cow, offset)) in results.into_iter().zip(whence) {
                    r.map_err(|source| EngineError::Io {
                        op: "read",
                        path: if is_cow {
                            self.cow_path.clone()
                        } else {
                            self.base.path().to_path_buf()
                        },
                        offset,
                        source,
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
        let read_base = |offset: u64, buf: &mut [u8]| self.base.read_exact_at(buf, offset);
        let read_cow = |offset: u64, buf: &mut [u8]| {
            self.reader
                .read_file_at(buf, offset)
                .map_err(EngineError::from)
        };
        match &self.io_pool {
            Some(io_pool) if jobs > 1 => io_pool.in_place_scope(|scope| {
                let record = &record;
                for (offset, buf) in base_io.iter_mut() {
                    let (offset, buf) = (*offset, &mut **buf);
                    scope.spawn(move |_| record(read_base(offset, buf)));
                }
                for (offset, buf) in cow_io.iter_mut() {
                    let (offset, buf) = (*offset, &mut **buf);
                    scope.spawn(move |_| record(read_cow(offset, buf)));
                }
            }),
            _ => {
                for (offset, buf) in base_io.iter_mut() {
                    record(read_base(*offset, buf));
                }
                for (offset, buf) in cow_io.iter_mut() {
                    record(read_cow(*offset, buf));
                }
            }
        }
        match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Applies the XOR payloads and decodes the REPLACE units whose stored bytes are in
    /// `bufs`. Two or more REPLACE units decode on the decode pool, XOR blocks inline.
    fn decode_from_runs(
        &self,
        runs: &[Run],
        wants: &[Want],
        bufs: &[AlignedBuf],
        targets: &mut [(Seg, &mut [u8])],
    ) -> Result<()> {
        let ops = self.reader.ops();
        // Stored bytes of each item, indexed by item.
        let mut stored: Vec<Option<&[u8]>> = vec![None; targets.len()];
        let mut replaces = 0usize;
        for (run, buf) in runs.iter().zip(bufs) {
            let data = buf.as_slice();
            for w in &wants[run.wants.clone()] {
                let from = (w.start - run.start) as usize;
                stored[w.item] = Some(&data[from..from + (w.end - w.start) as usize]);
                replaces += usize::from(matches!(targets[w.item].0, Seg::Replace { .. }));
            }
        }
        let mut payload = [0u8; BLOCK_SIZE];
        let mut decode = |seg: Seg, raw: &[u8], dst: &mut [u8]| -> Result<()> {
            match seg {
                Seg::Xor {
                    op,
                    block_offset,
                    len,
                } => {
                    self.reader
                        .decode_payload(&ops[op as usize], raw, &mut payload)?;
                    xor_into(dst, &payload[block_offset..block_offset + len]);
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
            Some(pool) if replaces >= 2 => {
                let first_error: Mutex<Option<EngineError>> = Mutex::new(None);
                let record = |r: Result<()>| {
                    if let Err(e) = r {
                        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                    }
                };
                pool.in_place_scope(|scope| {
                    let record = &record;
                    for ((seg, dst), raw) in targets.iter_mut().zip(&stored) {
                        let Some(raw) = *raw else { continue };
                        if let Seg::Replace { op, .. } = *seg {
                            let dst: &mut [u8] = dst;
                            scope.spawn(move |_| {
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
                            record(decode(*seg, raw, dst));
                        }
                    }
                });
                match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            }
            _ => {
                for ((seg, dst), raw) in targets.iter_mut().zip(&stored) {
                    if let Some(raw) = *raw {
                        decode(*seg, raw, dst)?;
                    }
                }
                Ok(())
            }
        }
    }

    fn recycle(&self, base: Vec<Fetch<'_>>, cow: Vec<AlignedBuf>) {
        for f in base {
            if let Fetch::Bounce { buf, .. } = f {
                self.bounce.give(buf);
            }
        }
        for b in cow {
            self.bounce.give(b);
        }
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
