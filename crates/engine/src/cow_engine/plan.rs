//! Read plans: a request's layout, for frontends that do the file reads themselves.
//!
//! A queue-based frontend (one io_uring per FUSE queue) must not block in `pread`: while
//! one request waits for the disk, the thread has others to start. So instead of
//! [`BlockDevice::read_at`](crate::BlockDevice::read_at) it asks for the request's plan
//! ([`ReadPlanner::plan_read`]): the file reads that fetch everything the request needs
//! (base ranges, unchanged blocks and COPY/XOR sources, straight into the reply buffer
//! where `O_DIRECT` alignment allows, else into a scratch buffer; the stored bytes of
//! XOR and REPLACE payloads from the COW, buffered, so a page-cache hit costs no disk
//! read), submits them all on its own ring, and once they have all completed calls
//! [`ReadPlanner::finish_read`], which does the CPU part (XOR, decompression, copies
//! out of the scratch buffer) and whatever the plan left to the synchronous path (ZERO,
//! units already in the decoded-unit cache, the buffered tail of the base).
//!
//! The segments come from the same planner as `read_at` (`CowEngine::plan`), so both
//! paths agree block for block. Engines with a merge hook or a verifier are not planned
//! (`plan_read` returns `false`): their reads need the merge guard held across the data
//! assembly, or every block checked, which only `read_at` does.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use cow::OpKind;

use super::{CowEngine, Seg, xor_into, xor_to};
use crate::error::{EngineError, Result};
use crate::io::DIRECT_ALIGN;
use crate::{BLOCK_SIZE, check_range};

/// Where a planned read puts its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadInto {
    /// At this byte offset of the request's buffer (which must start at a
    /// [`DIRECT_ALIGN`] boundary).
    Buf(usize),
    /// At this byte offset of the scratch buffer (also aligned; at least
    /// [`ReadPlan::scratch_len`] bytes).
    Scratch(usize),
}

/// One file read of a plan: `len` bytes of `fd` from `offset`, into `into`. A read that
/// comes back short or fails fails the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedRead {
    pub fd: RawFd,
    pub offset: u64,
    pub len: usize,
    pub into: ReadInto,
}

/// What [`ReadPlanner::finish_read`] does for one segment, in request order.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// The segment's bytes were read in place.
    Done,
    /// Copy the segment from the scratch buffer at this offset.
    Copy { at: usize },
    /// XOR block: the payload's stored bytes are at `raw` in the scratch buffer; the
    /// source bytes are in place (`src: None`) or at `src` in the scratch buffer.
    Xor {
        op: u32,
        block_offset: usize,
        src: Option<usize>,
        raw: usize,
    },
    /// REPLACE unit whose stored bytes are at `raw` in the scratch buffer.
    Decode {
        op: u32,
        unit_offset: usize,
        raw: usize,
    },
    /// Through the engine's synchronous path (ZERO, cached units, the unaligned tail).
    Sync,
}

/// The layout of one read request; reusable across requests (no allocation once grown).
#[derive(Debug, Default)]
pub struct ReadPlan {
    len: usize,
    segs: Vec<(Seg, Step)>,
    reads: Vec<PlannedRead>,
    scratch_len: usize,
}

impl ReadPlan {
    pub fn new() -> ReadPlan {
        ReadPlan::default()
    }

    /// The reads to issue (all may be in flight at once, in any order).
    pub fn reads(&self) -> &[PlannedRead] {
        &self.reads
    }

    /// Bytes of scratch buffer the reads and [`ReadPlanner::finish_read`] need.
    pub fn scratch_len(&self) -> usize {
        self.scratch_len
    }

    /// Length of the planned request.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reserves `len` bytes of scratch at a [`DIRECT_ALIGN`] boundary.
    fn alloc(&mut self, len: usize) -> usize {
        let at = self.scratch_len.next_multiple_of(DIRECT_ALIGN);
        self.scratch_len = at + len;
        at
    }
}

/// Devices that can describe a read as file reads plus CPU work; see the module comment.
pub trait ReadPlanner: Send + Sync {
    /// Plans `[offset, offset + len)` into `plan` (its previous contents are dropped).
    /// `Ok(false)`: this device cannot plan reads right now; use `read_at`.
    fn plan_read(&self, offset: u64, len: usize, plan: &mut ReadPlan) -> Result<bool>;

    /// Completes a planned request once every one of its reads has filled its bytes:
    /// `buf` is the request's buffer (`plan.len()` bytes), `scratch` the scratch buffer.
    fn finish_read(&self, plan: &ReadPlan, buf: &mut [u8], scratch: &[u8]) -> Result<()>;
}

fn direct_aligned(file_offset: u64, len: usize, dst: usize) -> bool {
    file_offset.is_multiple_of(DIRECT_ALIGN as u64)
        && len.is_multiple_of(DIRECT_ALIGN)
        && dst.is_multiple_of(DIRECT_ALIGN)
}

impl CowEngine {
    /// Plans a read of base bytes `[src, src + len)` for the request bytes at `dst`:
    /// `Some(None)` when they land in place, `Some(Some(at))` when at `at` in the
    /// scratch buffer, `None` when only the synchronous path can read them (the part of
    /// an `O_DIRECT` base past its last whole block).
    fn plan_base(
        &self,
        src: u64,
        len: usize,
        dst: usize,
        plan: &mut ReadPlan,
    ) -> Option<Option<usize>> {
        // With no parts, the descriptor aligned reads go to: O_DIRECT when open so.
        let fd = self.base.fd_for_parts(&[], 0)?;
        self.stats.base_reads.fetch_add(1, Ordering::Relaxed);
        if !self.base.is_direct() || direct_aligned(src, len, dst) {
            plan.reads.push(PlannedRead {
                fd,
                offset: src,
                len,
                into: ReadInto::Buf(dst),
            });
            return Some(None);
        }
        // The aligned superset into scratch, as `ImageFile::read_exact_at` bounces it.
        let a = DIRECT_ALIGN as u64;
        let start = src / a * a;
        let end = (src + len as u64).div_ceil(a) * a;
        if end > self.base.size() {
            return None;
        }
        let at = plan.alloc((end - start) as usize);
        plan.reads.push(PlannedRead {
            fd,
            offset: start,
            len: (end - start) as usize,
            into: ReadInto::Scratch(at),
        });
        Some(Some(at + (src - start) as usize))
    }

    /// Plans a read of the stored bytes of op `op` from the COW (buffered: a hit in the
    /// page cache completes at once); returns their scratch offset.
    fn plan_payload(&self, op: u32, plan: &mut ReadPlan) -> Option<usize> {
        let file = self.cow_buffered.as_ref()?;
        let op = &self.reader.ops()[op as usize];
        let len = op.data_length as usize;
        let at = plan.alloc(len);
        plan.reads.push(PlannedRead {
            fd: file.as_raw_fd(),
            offset: op.data_offset,
            len,
            into: ReadInto::Scratch(at),
        });
        Some(at)
    }

    fn plan_step(&self, seg: Seg, dst: usize, plan: &mut ReadPlan) -> Step {
        let ops = self.reader.ops();
        match seg {
            Seg::Base { offset, len } => match self.plan_base(offset, len, dst, plan) {
                Some(None) => Step::Done,
                Some(Some(at)) => Step::Copy { at },
                None => Step::Sync,
            },
            Seg::Xor {
                op,
                block_offset,
                len,
            } => {
                let source = ops[op as usize].source + block_offset as u64;
                // Payload first: without a COW descriptor nothing is planned for it.
                let mark = (plan.reads.len(), plan.scratch_len);
                let Some(raw) = self.plan_payload(op, plan) else {
                    return Step::Sync;
                };
                match self.plan_base(source, len, dst, plan) {
                    Some(src) => Step::Xor {
                        op,
                        block_offset,
                        src,
                        raw,
                    },
                    None => {
                        plan.reads.truncate(mark.0);
                        plan.scratch_len = mark.1;
                        Step::Sync
                    }
                }
            }
            Seg::Replace {
                op, unit_offset, ..
            } if ops[op as usize].kind == OpKind::Replace
                && (ops[op as usize].blocks == 1 || self.cache.get(op).is_none()) =>
            {
                match self.plan_payload(op, plan) {
                    Some(raw) => Step::Decode {
                        op,
                        unit_offset,
                        raw,
                    },
                    None => Step::Sync,
                }
            }
            // ZERO, and units the cache holds (a copy from memory).
            Seg::Zero { .. } | Seg::Replace { .. } => Step::Sync,
        }
    }

    fn finish_step(&self, seg: Seg, step: Step, dst: &mut [u8], scratch: &[u8]) -> Result<()> {
        let ops = self.reader.ops();
        let part = |at: usize, n: usize| -> Result<&[u8]> {
            scratch
                .get(at..at + n)
                .ok_or_else(|| EngineError::Mismatch {
                    path: self.cow_path.clone(),
                    msg: format!(
                        "scratch buffer of {} bytes is shorter than the plan needs ({})",
                        scratch.len(),
                        at + n
                    ),
                })
        };
        match step {
            Step::Done => Ok(()),
            Step::Copy { at } => {
                dst.copy_from_slice(part(at, dst.len())?);
                Ok(())
            }
            Step::Xor {
                op,
                block_offset,
                src,
                raw,
            } => {
                let op = &ops[op as usize];
                let mut payload = [0u8; BLOCK_SIZE];
                self.reader.decode_payload(
                    op,
                    part(raw, op.data_length as usize)?,
                    &mut payload,
                )?;
                let p = &payload[block_offset..block_offset + dst.len()];
                match src {
                    Some(at) => xor_to(dst, part(at, dst.len())?, p),
                    None => xor_into(dst, p),
                }
                Ok(())
            }
            Step::Decode {
                op: index,
                unit_offset,
                raw,
            } => {
                let op = &ops[index as usize];
                let stored = part(raw, op.data_length as usize)?;
                let unit = op.unit_size();
                self.stats.unit_decodes.fetch_add(1, Ordering::Relaxed);
                if unit_offset == 0 && dst.len() == unit {
                    self.reader.decode_payload(op, stored, dst)?;
                } else if op.blocks == 1 {
                    let mut tmp = [0u8; BLOCK_SIZE];
                    self.reader.decode_payload(op, stored, &mut tmp)?;
                    dst.copy_from_slice(&tmp[unit_offset..unit_offset + dst.len()]);
                } else {
                    // Kept for the unit's other blocks, as `read_at` does.
                    let mut v = vec![0u8; unit];
                    self.reader.decode_payload(op, stored, &mut v)?;
                    dst.copy_from_slice(&v[unit_offset..unit_offset + dst.len()]);
                    self.cache.insert(index, Arc::new(v));
                }
                Ok(())
            }
            Step::Sync => self.run_seg(seg, dst),
        }
    }
}

impl ReadPlanner for CowEngine {
    fn plan_read(&self, offset: u64, len: usize, plan: &mut ReadPlan) -> Result<bool> {
        check_range(offset, len, self.size)?;
        plan.len = 0;
        plan.segs.clear();
        plan.reads.clear();
        plan.scratch_len = 0;
        if self.merge.is_some() || self.verifier.is_some() {
            return Ok(false);
        }
        let mut segs = Vec::new();
        // No merge guard, so no scratch patches either.
        let mut patches = Vec::new();
        self.plan(offset, len, &mut segs, None, &mut patches);
        let mut dst = 0usize;
        for seg in segs {
            let step = self.plan_step(seg, dst, plan);
            plan.segs.push((seg, step));
            dst += seg.len();
        }
        debug_assert_eq!(dst, len);
        debug_assert!(patches.is_empty());
        plan.len = len;
        Ok(true)
    }

    fn finish_read(&self, plan: &ReadPlan, buf: &mut [u8], scratch: &[u8]) -> Result<()> {
        if buf.len() != plan.len {
            return Err(EngineError::Mismatch {
                path: self.cow_path.clone(),
                msg: format!(
                    "finish_read: buffer of {} bytes for a plan of {}",
                    buf.len(),
                    plan.len
                ),
            });
        }
        let mut rest = buf;
        for &(seg, step) in &plan.segs {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(seg.len());
            rest = tail;
            self.finish_step(seg, step, head, scratch)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::AlignedBuf;
    use crate::{BlockDevice, CowEngineOptions};
    use std::os::unix::fs::FileExt;

    /// Executes a plan with blocking reads: what an asynchronous frontend does with its
    /// ring, minus the ring.
    fn run_plan(e: &CowEngine, offset: u64, len: usize, direct: bool) -> (Vec<u8>, Kinds) {
        let mut plan = ReadPlan::new();
        assert!(e.plan_read(offset, len, &mut plan).unwrap());
        let mut kinds = Kinds::default();
        for (_, step) in &plan.segs {
            match step {
                Step::Done => kinds.in_place = true,
                Step::Copy { .. } => kinds.copy = true,
                Step::Xor { src: None, .. } => kinds.xor_in_place = true,
                Step::Xor { src: Some(_), .. } => kinds.xor_scratch = true,
                Step::Decode { .. } => kinds.decode = true,
                Step::Sync => kinds.sync = true,
            }
        }
        let mut buf = AlignedBuf::new(len);
        let mut scratch = AlignedBuf::new(plan.scratch_len());
        let out = buf.slice_mut(len);
        let sc = scratch.slice_mut(plan.scratch_len());
        for r in plan.reads() {
            let dst = match r.into {
                ReadInto::Buf(at) => &mut out[at..at + r.len],
                ReadInto::Scratch(at) => &mut sc[at..at + r.len],
            };
            // SAFETY: the planner's descriptors stay open while `e` lives; the File is
            // forgotten below so it does not close them.
            let f = std::mem::ManuallyDrop::new(unsafe {
                <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(r.fd)
            });
            f.read_exact_at(dst, r.offset).unwrap();
            if direct && e.base.is_direct() && r.fd != e.cow_buffered.as_ref().unwrap().as_raw_fd()
            {
                assert!(direct_aligned(r.offset, r.len, dst.as_ptr() as usize));
            }
        }
        e.finish_read(&plan, out, sc).unwrap();
        (out.to_vec(), kinds)
    }

    /// Which steps the plans of a test used.
    #[derive(Debug, Default)]
    struct Kinds {
        in_place: bool,
        copy: bool,
        xor_in_place: bool,
        xor_scratch: bool,
        decode: bool,
        sync: bool,
    }

    #[test]
    fn planned_reads_match_read_at_on_the_aosp_vectors() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/aosp-cow-vectors");
        let want = std::fs::read(dir.join("expected.img")).unwrap();
        let mut cows: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|d| d.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cow"))
            .collect();
        cows.sort();
        assert!(cows.len() >= 3);
        let mut seen = Kinds::default();
        for cow in &cows {
            for direct in [true, false] {
                let e = CowEngine::open(
                    &dir.join("base.img"),
                    cow,
                    &CowEngineOptions {
                        direct_io: direct,
                        // Small, so units leave the cache and are planned again.
                        cache_bytes: 64 << 10,
                        ..Default::default()
                    },
                )
                .unwrap();
                let size = e.size() as usize;
                assert_eq!(size, want.len());
                let mut ranges = vec![(0, size), (4097, 200_001.min(size - 4097))];
                for b in 0..size / BLOCK_SIZE {
                    ranges.push((b * BLOCK_SIZE, BLOCK_SIZE));
                    ranges.push((
                        b * BLOCK_SIZE + 100,
                        (3 * BLOCK_SIZE).min(size - b * BLOCK_SIZE - 100),
                    ));
                }
                for (off, len) in ranges {
                    let (got, k) = run_plan(&e, off as u64, len, direct);
                    seen.in_place |= k.in_place;
                    seen.copy |= k.copy;
                    seen.xor_in_place |= k.xor_in_place;
                    seen.xor_scratch |= k.xor_scratch;
                    seen.decode |= k.decode;
                    seen.sync |= k.sync;
                    assert!(
                        got == want[off..off + len],
                        "{} direct={direct} offset {off} len {len}",
                        cow.display()
                    );
                    let mut sync = vec![0u8; len];
                    e.read_at(&mut sync, off as u64).unwrap();
                    assert!(got == sync);
                }
            }
        }
        // Every kind of step was exercised.
        assert!(
            seen.in_place
                && seen.copy
                && seen.xor_in_place
                && seen.xor_scratch
                && seen.decode
                && seen.sync,
            "{seen:?}"
        );
    }

    #[test]
    fn out_of_range_is_refused_and_merge_hooks_are_not_planned() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/aosp-cow-vectors");
        let mut e = CowEngine::open(
            &dir.join("base.img"),
            &dir.join("v3_lz4_65536.cow"),
            &CowEngineOptions::default(),
        )
        .unwrap();
        let mut plan = ReadPlan::new();
        assert!(e.plan_read(e.size(), 1, &mut plan).is_err());
        struct NoMerge;
        struct Guard;
        impl crate::MergeGuard for Guard {
            fn redirect(&self, _: usize, _: &cow::Op) -> crate::MergeRedirect {
                crate::MergeRedirect::Cow
            }
        }
        impl crate::MergeHook for NoMerge {
            fn begin_read(&self) -> Box<dyn crate::MergeGuard + '_> {
                Box::new(Guard)
            }
        }
        e.set_merge_hook(Arc::new(NoMerge));
        assert!(!e.plan_read(0, 4096, &mut plan).unwrap());
        assert!(plan.reads().is_empty());
    }
}
