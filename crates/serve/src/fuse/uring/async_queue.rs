//! Asynchronous queue threads: one thread serves many ring entries at once and never
//! blocks on a file read.
//!
//! With the synchronous design ([`QueueThread::serve_sync`]) a thread answers one
//! request at a time, blocking in the engine's `pread`, so a queue needs as many threads
//! as requests in flight, and the kernel wakes and puts one to sleep per request: on a
//! 2-CPU machine at queue depth 32 that was a third of the CPU time spent switching.
//! Here a READ of the exported file (shorter than [`PLAN_MAX`]) is turned into a read
//! plan by the engine ([`engine::ReadPlanner`]): its base-image and COW reads go on the
//! thread's own ring, straight into the entry's payload buffer (or a scratch buffer),
//! next to the FUSE commands, and the thread goes on with the next completion. When the
//! last read of a request completes, the engine finishes it (XOR, decompression) and the
//! answer is committed. Each loop iteration submits every new read and commit at once
//! and waits for the next completion.
//!
//! While one of its planned reads is in flight, the thread first polls the ring for a
//! short while ([`AsyncParts::poll`]) before it sleeps: the completions and the next
//! requests are tens of microseconds away, and sleeping costs more than that. On a VM
//! an idle vCPU halts, and waking it goes through the hypervisor; the chain of such
//! wake-ups per request (loop worker, this thread, the completion) left half of the CPU
//! time idle at queue depth 32 with the disk below its rate (bench/results/serve.md).
//!
//! What cannot be planned (a device with a merge hook or a verifier, devices that are
//! not a `CowEngine`) and large READs (sequential streams, which the readahead wrapper
//! serves from memory; it must see them to detect the stream) go to a small pool of
//! worker threads that call the device as the synchronous design does, then hand the
//! entry back through a channel and an eventfd read on the ring. Other requests (LOOKUP,
//! GETATTR, ...) touch no file and are answered inline.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use engine::{BlockDevice, ReadInto, ReadPlan, ReadPlanner};
use io_uring::{cqueue, opcode, squeue, types};

use super::ring::{Ent, QueueThread, Request, Ring, push, submit};
use crate::fuse::fs::{DiskFs, FILE_ID, Outcome};
use crate::fuse::proto;
use engine::AlignedBuf;

/// READs shorter than this are planned on the queue thread; longer ones go to the
/// workers through the readahead wrapper, which only looks at requests of at least
/// 32 KiB (shorter ones are random reads to it).
pub(crate) const PLAN_MAX: usize = 32 << 10;

/// What a queue thread needs for the asynchronous design.
pub(crate) struct AsyncParts {
    /// The device without the readahead wrapper: the one that plans reads.
    pub(crate) planned: Arc<dyn BlockDevice>,
    /// Requests for the worker pool.
    pub(crate) jobs: Sender<Job>,
    /// How long to poll the ring for completions before sleeping, while a planned read
    /// is in flight (zero: never poll).
    ///
    /// At random 4 KiB QD32 (2 vCPUs) polling from one planned read in flight gained
    /// 11% IOPS on average over not polling, with each build run both first and second
    /// in alternating pairs (the second of two runs of the same image tends to be faster
    /// here); from two, only 5-7% in pairs where it ran second (the less busy queue
    /// rarely holds two). Polling with nothing in flight costs CPU at QD1, where it
    /// spins between requests (+30 µs per request, against +19 µs from one). Requests
    /// with a worker (large reads) do not count: polling for them gained nothing at
    /// sequential 1 MiB QD8 (-5% on average over both orders), and spinning takes a CPU
    /// from the workers.
    pub(crate) poll: Duration,
}

impl super::ring::Answer for AsyncParts {
    fn ring_entries(&self, entries: usize) -> u32 {
        ring_entries(entries)
    }

    fn serve(
        self: Box<Self>,
        q: &QueueThread,
        ring: &mut Ring,
        ents: &mut [Ent],
        pending: Vec<cqueue::Entry>,
    ) {
        serve(q, *self, ring, ents, pending)
    }
}

/// Submission queue size for `entries` ring entries: a FUSE command per entry plus a
/// few reads per planned request; a fuller queue is submitted early ([`push`]).
pub(crate) fn ring_entries(entries: usize) -> u32 {
    (entries * 4 + 2).next_power_of_two() as u32
}

// user_data: kind in the top byte, read number in the next 24 bits, entry index in the
// low 32 bits: a FUSE command's is the entry index, as at REGISTER.
const KIND_SHIFT: u32 = 56;
const READ_SHIFT: u32 = 32;
const CMD: u64 = 0;
const READ: u64 = 1;
const EVENT: u64 = 2;

fn user_data(kind: u64, ent: usize, read: usize) -> u64 {
    kind << KIND_SHIFT | (read as u64) << READ_SHIFT | ent as u64
}

/// A request handed to the worker pool. The worker writes the reply into the entry's
/// payload buffer, which the queue thread leaves alone until the answer comes back.
pub(crate) struct Job {
    ent: usize,
    req: Request,
    payload: *mut u8,
    payload_len: usize,
    done: Arc<Done>,
}

// SAFETY: `payload` points into a ring entry's payload buffer, owned by the queue thread
// that sent the job; that thread does not touch the buffer (nor free it: it keeps
// serving until every live entry has been answered, this one included) until the
// worker's answer for this entry has arrived, so the worker has exclusive access.
unsafe impl Send for Job {}

/// The way back from the workers to one queue thread.
pub(crate) struct Done {
    tx: Sender<(usize, Outcome)>,
    /// Written after each answer; the queue thread keeps a read of it on its ring.
    efd: OwnedFd,
}

impl Done {
    fn send(&self, ent: usize, outcome: Outcome) {
        let _ = self.tx.send((ent, outcome));
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. A failure (the
        // counter saturated) still leaves the eventfd readable, which is all we need.
        let _ = unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// Starts `n` workers answering [`Job`]s through `fs` (the readahead-wrapped device);
/// they end when every sender of `jobs` is gone.
pub(crate) fn spawn_workers(
    n: usize,
    fs: &Arc<DiskFs>,
    jobs: &Receiver<Job>,
) -> io::Result<Vec<JoinHandle<()>>> {
    (0..n.max(1))
        .map(|i| {
            let (fs, jobs) = (fs.clone(), jobs.clone());
            std::thread::Builder::new()
                .name(format!("vabc-fuse-w{i}"))
                .spawn(move || {
                    for job in jobs.iter() {
                        // SAFETY: see `impl Send for Job`: the buffer is live and ours
                        // alone until we answer.
                        let out =
                            unsafe { std::slice::from_raw_parts_mut(job.payload, job.payload_len) };
                        let fixed = proto::fixed_arg_size(job.req.ih.opcode)
                            .min(proto::FUSE_URING_OP_IN_OUT_SZ);
                        let outcome = fs.handle(&job.req.ih, &job.req.op_in[..fixed], &[], out);
                        job.done.send(job.ent, outcome);
                    }
                })
        })
        .collect()
}

/// Per-entry state of a planned READ.
#[derive(Default)]
struct Slot {
    req: Option<Request>,
    plan: ReadPlan,
    scratch: AlignedBuf,
    /// Reply length.
    len: usize,
    offset: u64,
    /// Reads still in flight.
    pending: usize,
    /// The first failed read: (errno, read number).
    failed: Option<(i32, usize)>,
    /// The request is with the worker pool.
    worker: bool,
}

struct Server<'a> {
    q: &'a QueueThread,
    planner: Option<&'a dyn ReadPlanner>,
    jobs: &'a Sender<Job>,
    done: &'a Arc<Done>,
    size: u64,
}

/// Serves the registered `ents` until all are gone; `cqes` are completions already
/// taken from the ring.
pub(crate) fn serve(
    q: &QueueThread,
    parts: AsyncParts,
    ring: &mut Ring,
    ents: &mut [Ent],
    mut cqes: Vec<cqueue::Entry>,
) {
    // SAFETY: plain syscall; the descriptor is owned below.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if efd < 0 {
        log::warn!(
            "vabc serve: FUSE io_uring queue {}: eventfd: {}; serving synchronously",
            q.qid,
            io::Error::last_os_error()
        );
        return q.serve_sync(ring, ents, cqes);
    }
    let (tx, answers) = crossbeam_channel::unbounded();
    let done = Arc::new(Done {
        tx,
        // SAFETY: `efd` is a fresh descriptor nobody else owns.
        efd: unsafe { OwnedFd::from_raw_fd(efd) },
    });
    let s = Server {
        q,
        planner: parts.planned.planner(),
        jobs: &parts.jobs,
        done: &done,
        size: parts.planned.size(),
    };
    let mut slots: Vec<Slot> = ents.iter().map(|_| Slot::default()).collect();
    // Target of the eventfd read; lives until that read has completed (below).
    let mut counter = Box::new(0u64);
    let mut event_armed = s.arm_event(ring, &mut counter);
    let mut names = Vec::new();
    loop {
        for cqe in cqes.drain(..) {
            let ud = cqe.user_data();
            let idx = (ud & 0xffff_ffff) as usize;
            match ud >> KIND_SHIFT {
                CMD => {
                    let Some(ent) = ents.get_mut(idx).filter(|e| e.live) else {
                        continue;
                    };
                    if cqe.result() < 0 {
                        // ENOTCONN/ECANCELED: torn down by unmount or abort.
                        ent.live = false;
                        continue;
                    }
                    s.on_request(ring, idx, ent, &mut slots[idx], &mut names);
                }
                READ => {
                    let read = ((ud >> READ_SHIFT) & 0xff_ffff) as usize;
                    if let (Some(ent), Some(slot)) = (ents.get_mut(idx), slots.get_mut(idx)) {
                        s.on_read(ring, idx, ent, slot, read, cqe.result());
                    }
                }
                // The eventfd read: answers from the workers are drained below.
                _ => event_armed = false,
            }
        }
        while let Ok((idx, outcome)) = answers.try_recv() {
            let Some(slot) = slots.get_mut(idx) else {
                continue;
            };
            slot.worker = false;
            if let (Some(ent), Some(req)) = (ents.get_mut(idx), slot.req.take()) {
                s.answer(ring, idx, ent, &req, outcome);
            }
        }
        if !ents.iter().any(|e| e.live) {
            break;
        }
        if !event_armed {
            event_armed = s.arm_event(ring, &mut counter);
        }
        if !parts.poll.is_zero() && slots.iter().any(|s| s.req.is_some() && !s.worker) {
            if let Err(e) = poll(ring, parts.poll) {
                log::warn!("vabc serve: FUSE io_uring queue {}: {e}", q.qid);
                break;
            }
            cqes.extend(ring.completion());
            if !cqes.is_empty() {
                continue;
            }
        }
        if let Err(e) = submit(ring, 1) {
            log::warn!("vabc serve: FUSE io_uring queue {}: {e}", q.qid);
            break;
        }
        cqes.extend(ring.completion());
    }
    // After a ring failure, workers may still be writing into payload buffers: wait for
    // them before the buffers go away (normally none is out: its entry is still live).
    for slot in &slots {
        if slot.worker {
            let _ = answers.recv_timeout(std::time::Duration::from_secs(30));
        }
    }
    // The eventfd read points at `counter`: make it complete before that goes away.
    if event_armed {
        let one = 1u64;
        // SAFETY: 8 bytes from a live u64 to our eventfd.
        let _ = unsafe { libc::write(done.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        'wait: for _ in 0..100 {
            if submit(ring, 1).is_err() {
                break;
            }
            for cqe in ring.completion() {
                if cqe.user_data() >> KIND_SHIFT == EVENT {
                    event_armed = false;
                    break 'wait;
                }
            }
        }
    }
    if event_armed {
        // The ring failed with the read still pending: 8 bytes leaked beat a write
        // into freed memory.
        std::mem::forget(counter);
    }
}

/// Submits what is queued, then asks the kernel for completions without sleeping until
/// one is there or `budget` has passed. With `DEFER_TASKRUN` the kernel posts them only
/// when asked (`IORING_ENTER_GETEVENTS`), so the poll must enter the kernel each time
/// rather than watch the completion queue from user space.
fn poll(ring: &mut Ring, budget: Duration) -> io::Result<()> {
    let start = Instant::now();
    if !ring.submission().is_empty() {
        submit(ring, 0)?;
    }
    loop {
        // SAFETY: no argument is passed, so there is no pointer for the kernel to read;
        // nothing is submitted (the queue was submitted above).
        match unsafe {
            ring.submitter()
                .enter::<libc::sigset_t>(0, 0, IORING_ENTER_GETEVENTS, None)
        } {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
        if !ring.completion().is_empty() || start.elapsed() >= budget {
            return Ok(());
        }
        std::hint::spin_loop();
    }
}

/// From the kernel's `io_uring.h` (the io-uring crate keeps its flag constants private).
const IORING_ENTER_GETEVENTS: u32 = 1;

impl Server<'_> {
    /// Answers `req`, held by entry `idx`, and re-arms the entry.
    fn answer(&self, ring: &mut Ring, idx: usize, ent: &mut Ent, req: &Request, outcome: Outcome) {
        self.q
            .commit(ring, ent, req, outcome, user_data(CMD, idx, 0));
    }

    /// Queues a read of the eventfd into `counter`; false if it could not be queued.
    fn arm_event(&self, ring: &mut Ring, counter: &mut u64) -> bool {
        let sqe = opcode::Read::new(
            types::Fd(self.done.efd.as_raw_fd()),
            (counter as *mut u64).cast(),
            8,
        )
        .build()
        .user_data(user_data(EVENT, 0, 0));
        // SAFETY: `counter` outlives the read: `serve` waits for its completion before
        // returning.
        unsafe { push(ring, &squeue::Entry128::from(sqe)) }.is_ok()
    }

    fn on_request(
        &self,
        ring: &mut Ring,
        idx: usize,
        ent: &mut Ent,
        slot: &mut Slot,
        names: &mut Vec<u8>,
    ) {
        let req = Request::of(ent);
        if req.ih.opcode != proto::READ {
            let outcome = self.q.handle(&req, ent, names);
            return self.answer(ring, idx, ent, &req, outcome);
        }
        let plannable = proto::read::<proto::ReadIn>(&req.op_in)
            .filter(|r| req.ih.nodeid == FILE_ID && r.offset < self.size)
            .map(|r| {
                (
                    r.offset,
                    u64::from(r.size).min(self.size - r.offset) as usize,
                )
            })
            .filter(|&(_, n)| n > 0 && n < PLAN_MAX && n <= self.q.payload_size);
        if let (Some((offset, n)), Some(planner)) = (plannable, self.planner) {
            match planner.plan_read(offset, n, &mut slot.plan) {
                Ok(true) => {
                    slot.req = Some(req);
                    (slot.offset, slot.len) = (offset, n);
                    return self.start_reads(ring, idx, ent, slot);
                }
                Ok(false) => {}
                Err(e) => {
                    log::warn!("vabc serve: FUSE read of {n} bytes at offset {offset}: {e}");
                    let outcome = Outcome::Error(e.errno());
                    return self.answer(ring, idx, ent, &req, outcome);
                }
            }
        }
        let payload = ent.payload.slice_mut(self.q.payload_size);
        slot.req = Some(req);
        slot.worker = true;
        let job = Job {
            ent: idx,
            req,
            payload: payload.as_mut_ptr(),
            payload_len: payload.len(),
            done: self.done.clone(),
        };
        if let Err(e) = self.jobs.send(job) {
            // No workers left (shutting down): answer here.
            (slot.req, slot.worker) = (None, false);
            let job = e.into_inner();
            let outcome = self.q.handle(&job.req, ent, names);
            self.answer(ring, idx, ent, &req, outcome);
        }
    }

    /// Submits the reads of the plan in `slot` for the request it holds.
    fn start_reads(&self, ring: &mut Ring, idx: usize, ent: &mut Ent, slot: &mut Slot) {
        let n = slot.len;
        slot.failed = None;
        slot.pending = 0;
        let scratch_len = slot.plan.scratch_len();
        let scratch = slot.scratch.slice_mut(scratch_len).as_mut_ptr();
        let payload = ent.payload.slice_mut(self.q.payload_size).as_mut_ptr();
        for (i, r) in slot.plan.reads().iter().enumerate() {
            let (base, room, at) = match r.into {
                ReadInto::Buf(at) => (payload, n, at),
                ReadInto::Scratch(at) => (scratch, scratch_len, at),
            };
            if at.checked_add(r.len).is_none_or(|end| end > room) || r.len > u32::MAX as usize {
                slot.failed.get_or_insert((libc::EINVAL, i));
                continue;
            }
            // SAFETY: `at + len` lies inside the buffer (checked above).
            let dst = unsafe { base.add(at) };
            let sqe = opcode::Read::new(types::Fd(r.fd), dst, r.len as u32)
                .offset(r.offset)
                .build()
                .user_data(user_data(READ, idx, i));
            // SAFETY: the read fills bytes of the entry's payload buffer or the slot's
            // scratch buffer, both owned by this thread, not resized or freed while
            // reads are pending (the entry is not answered, so not reused, before its
            // last read completes; `serve` runs until every entry is answered).
            match unsafe { push(ring, &squeue::Entry128::from(sqe)) } {
                Ok(()) => slot.pending += 1,
                Err(_) => {
                    slot.failed.get_or_insert((libc::EAGAIN, i));
                }
            }
        }
        if slot.pending == 0 {
            self.finish(ring, idx, ent, slot);
        }
    }

    fn on_read(
        &self,
        ring: &mut Ring,
        idx: usize,
        ent: &mut Ent,
        slot: &mut Slot,
        read: usize,
        result: i32,
    ) {
        let want = slot.plan.reads().get(read).map_or(0, |r| r.len);
        if result < 0 {
            slot.failed.get_or_insert((-result, read));
        } else if result as usize != want {
            // Plans stay inside the files, so a short read is an error of the file.
            slot.failed.get_or_insert((libc::EIO, read));
        }
        slot.pending = slot.pending.saturating_sub(1);
        if slot.pending == 0 {
            self.finish(ring, idx, ent, slot);
        }
    }

    /// All reads of the request in `slot` are done: assemble and answer it.
    fn finish(&self, ring: &mut Ring, idx: usize, ent: &mut Ent, slot: &mut Slot) {
        let Some(req) = slot.req.take() else {
            return;
        };
        let (n, offset) = (slot.len, slot.offset);
        let outcome = match (slot.failed, self.planner) {
            (Some((errno, read)), _) => {
                let r = slot.plan.reads().get(read);
                log::warn!(
                    "vabc serve: FUSE read of {n} bytes at offset {offset}: reading {} bytes at \
                     offset {} of the backing file failed: {}",
                    r.map_or(0, |r| r.len),
                    r.map_or(0, |r| r.offset),
                    io::Error::from_raw_os_error(errno)
                );
                Outcome::Error(libc::EIO)
            }
            (None, Some(planner)) => {
                let buf = &mut ent.payload.slice_mut(self.q.payload_size)[..n];
                let scratch = &slot.scratch.slice_mut(slot.plan.scratch_len())[..];
                match planner.finish_read(&slot.plan, buf, scratch) {
                    Ok(()) => {
                        self.q.counters.planned.fetch_add(1, Ordering::Relaxed);
                        Outcome::Reply(n)
                    }
                    Err(e) => {
                        log::warn!("vabc serve: FUSE read of {n} bytes at offset {offset}: {e}");
                        Outcome::Error(e.errno())
                    }
                }
            }
            (None, None) => Outcome::Error(libc::EIO),
        };
        self.answer(ring, idx, ent, &req, outcome);
    }
}
