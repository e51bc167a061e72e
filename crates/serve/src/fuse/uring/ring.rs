//! One FUSE-over-io_uring queue thread: its own io_uring (128-byte SQEs, the FUSE
//! command lives in the SQE's 80-byte command area), a few ring entries each with a
//! header buffer and a 1 MiB payload buffer, registered with
//! `FUSE_IO_URING_CMD_REGISTER`; each completion carries one request, answered on this
//! thread straight into that entry's buffers and sent back with
//! `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also re-arms the entry.
//!
//! Several threads may register entries for the same queue id: the kernel hands a
//! request to any available entry of the issuing CPU's queue, so the threads of a queue
//! work like a pool while the engine blocks in one of them.
//!
//! The thread ends once the kernel has torn down all its entries (unmount or abort:
//! every entry completes with an error).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;

use engine::AlignedBuf;
use io_uring::{IoUring, cqueue, opcode, squeue, types};

use crate::fuse::Counters;
use crate::fuse::fs::{DiskFs, Outcome};
use crate::fuse::proto::{self, UringCmdReq, UringEntInOut, UringReqHeader};

pub(crate) struct Ent {
    /// Written by the kernel when it hands us a request, read by it on commit; we touch
    /// it only in between (after the completion, before the next submission).
    pub(crate) header: Box<UringReqHeader>,
    pub(crate) payload: AlignedBuf,
    /// `iov[0]` = header, `iov[1]` = payload; read by the kernel at REGISTER.
    iov: Box<[libc::iovec; 2]>,
    pub(crate) live: bool,
}

pub(crate) struct QueueThread {
    pub(crate) fuse: Arc<File>,
    pub(crate) fs: Arc<DiskFs>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) qid: u16,
    pub(crate) cpu: Option<usize>,
    pub(crate) entries: usize,
    pub(crate) payload_size: usize,
    /// `None`: answer every request on this thread, blocking in the engine.
    pub(crate) async_mode: Option<Box<dyn Answer>>,
}

/// Another way for a queue thread to answer its ring's requests than one at a time on
/// the thread ([`QueueThread::serve_sync`]): the worker pool's (`async_queue`).
pub(crate) trait Answer: Send {
    /// Submission entries the ring needs for `entries` registered requests.
    fn ring_entries(&self, entries: usize) -> u32;
    /// Answers requests until the ring is torn down; `pending` are the completions
    /// already reaped.
    fn serve(
        self: Box<Self>,
        q: &QueueThread,
        ring: &mut Ring,
        ents: &mut [Ent],
        pending: Vec<cqueue::Entry>,
    );
}

/// The ring of a queue thread: 128-byte SQEs for the FUSE commands.
pub(crate) type Ring = IoUring<squeue::Entry128, cqueue::Entry>;

// The SQE's `len` field (struct io_uring_sqe: opcode, flags, ioprio, fd, off, addr, len).
const SQE_LEN_OFFSET: usize = 24;
const _: () = assert!(size_of::<squeue::Entry128>() == 128);

/// REGISTER needs `sqe->len == 2` (two iovecs), which the `io-uring` crate's
/// `UringCmd80` builder does not expose.
pub(crate) fn set_sqe_len(sqe: &mut squeue::Entry128, len: u32) {
    // SAFETY: Entry128 is #[repr(C)] around the kernel's 64-byte `struct io_uring_sqe`
    // (plus the 64-byte command tail); `len` is a u32 at byte 24 of it (uapi layout).
    // The write stays inside the 128-byte value, which we hold exclusively.
    unsafe {
        (sqe as *mut squeue::Entry128)
            .cast::<u8>()
            .add(SQE_LEN_OFFSET)
            .cast::<u32>()
            .write_unaligned(len)
    };
}

fn build_ring(entries: u32) -> io::Result<Ring> {
    // One thread owns the ring: the kernel may then run the request hand-over (task
    // work) only when we wait for completions, instead of interrupting us.
    vabc_io::ring::for_one_thread(entries)
}

pub(crate) fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is a plain bit array, all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET bounds-checks `cpu` against the set's size.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; `set` is valid for the call.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl QueueThread {
    /// Registers the entries, reports the outcome through `registered`, then serves
    /// until all entries are gone.
    pub(crate) fn run(mut self, registered: Sender<io::Result<()>>) {
        if let Some(cpu) = self.cpu {
            // An offline CPU cannot be pinned to; its queue still needs entries for the
            // kernel to call the ring ready, so serve it unpinned.
            let _ = pin_to_cpu(cpu);
        }
        let mut ents: Vec<Ent> = (0..self.entries)
            .map(|_| {
                let mut header = Box::<UringReqHeader>::default();
                let mut payload = AlignedBuf::new(self.payload_size);
                let iov = Box::new([
                    libc::iovec {
                        iov_base: (&mut *header as *mut UringReqHeader).cast(),
                        iov_len: size_of::<UringReqHeader>(),
                    },
                    libc::iovec {
                        iov_base: payload.slice_mut(self.payload_size).as_mut_ptr().cast(),
                        iov_len: self.payload_size,
                    },
                ]);
                Ent {
                    header,
                    payload,
                    iov,
                    live: true,
                }
            })
            .collect();
        // Declared after `ents`, so dropped before them on every return: closing the ring
        // cancels the kernel's hold on the buffers before they are freed.
        let ring_entries = match &self.async_mode {
            Some(a) => a.ring_entries(self.entries),
            None => (self.entries * 2).next_power_of_two() as u32,
        };
        let mut ring = match build_ring(ring_entries) {
            Ok(r) => r,
            Err(e) => {
                let _ = registered.send(Err(e));
                return;
            }
        };
        let fd = types::Fd(self.fuse.as_raw_fd());
        for (i, e) in ents.iter().enumerate() {
            let cmd = UringCmdReq {
                qid: self.qid,
                ..Default::default()
            };
            let mut sqe = opcode::UringCmd80::new(fd, proto::FUSE_IO_URING_CMD_REGISTER)
                .cmd(cmd.to_cmd())
                .addr(Some(e.iov.as_ptr() as u64))
                .build()
                .user_data(i as u64);
            set_sqe_len(&mut sqe, 2);
            // SAFETY: the SQE points at `e.iov` and through it at the entry's buffers,
            // all heap allocations owned by `ents`, which outlives the ring's use of
            // them: we return only after every entry has completed with an error (the
            // kernel has let go of it) or the ring is dropped first (below).
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                let _ = registered.send(Err(io::Error::other("io_uring submission queue full")));
                return;
            }
        }
        if let Err(e) = submit(&mut ring, 0) {
            let _ = registered.send(Err(e));
            return;
        }
        // A refused REGISTER completes at once; an accepted one stays pending until the
        // kernel has a request for it.
        let mut first_err = None;
        let mut pending = Vec::new();
        for cqe in ring.completion() {
            pending.push(cqe);
        }
        for cqe in &pending {
            if cqe.result() < 0 {
                ents[cqe.user_data() as usize].live = false;
                first_err.get_or_insert(io::Error::from_raw_os_error(-cqe.result()));
            }
        }
        let _ = registered.send(first_err.map_or(Ok(()), Err));
        match self.async_mode.take() {
            Some(answer) => answer.serve(&self, &mut ring, &mut ents, pending),
            None => self.serve_sync(&mut ring, &mut ents, pending),
        }
    }

    /// One request at a time per entry, answered on this thread (blocking in the engine).
    pub(crate) fn serve_sync(
        &self,
        ring: &mut Ring,
        ents: &mut [Ent],
        mut pending: Vec<cqueue::Entry>,
    ) {
        let mut scratch = Vec::new();
        loop {
            for cqe in pending.drain(..) {
                let idx = cqe.user_data() as usize;
                let Some(ent) = ents.get_mut(idx).filter(|e| e.live) else {
                    continue;
                };
                if cqe.result() < 0 {
                    // ENOTCONN/ECANCELED: torn down by unmount or abort.
                    ent.live = false;
                    continue;
                }
                let req = Request::of(ent);
                let outcome = self.handle(&req, ent, &mut scratch);
                self.commit(ring, ent, &req, outcome, idx as u64);
            }
            if !ents.iter().any(|e| e.live) {
                break;
            }
            if let Err(e) = submit(ring, 1) {
                log::warn!("vabc serve: FUSE io_uring queue {}: {e}", self.qid);
                break;
            }
            pending.extend(ring.completion());
        }
    }

    /// Answers `req` (in `ent`) through the file system, the reply going to the entry's
    /// payload buffer.
    pub(crate) fn handle(&self, req: &Request, ent: &mut Ent, scratch: &mut Vec<u8>) -> Outcome {
        let fixed = proto::fixed_arg_size(req.ih.opcode).min(proto::FUSE_URING_OP_IN_OUT_SZ);
        let arg = &req.op_in[..fixed];
        let payload = ent.payload.slice_mut(self.payload_size);
        // Names arrive in the payload buffer, which is also where the reply goes.
        scratch.clear();
        scratch.extend_from_slice(&payload[..(req.payload_sz as usize).min(payload.len())]);
        self.fs.handle(&req.ih, arg, scratch, payload)
    }

    /// Writes the answer into `ent`'s header and queues COMMIT_AND_FETCH for it (the
    /// command that also re-arms the entry), with `user_data`.
    pub(crate) fn commit(
        &self,
        ring: &mut Ring,
        ent: &mut Ent,
        req: &Request,
        outcome: Outcome,
        user_data: u64,
    ) {
        self.counters.ring.fetch_add(1, Ordering::Relaxed);
        if req.ih.opcode == proto::READ {
            self.counters.reads.record_since(req.received);
        }
        let (error, n) = match outcome {
            Outcome::Reply(n) => (0, n),
            Outcome::Error(e) => (-e, 0),
            // Never sent over the ring; answer anyway so the entry is re-armed.
            Outcome::NoReply => (-libc::ENOSYS, 0),
        };
        let hdr = &mut *ent.header;
        let out = proto::OutHeader {
            len: (size_of::<proto::OutHeader>() + n) as u32,
            error,
            unique: req.ih.unique,
        };
        hdr.in_out[..size_of::<proto::OutHeader>()].copy_from_slice(proto::bytes(&out));
        hdr.ring_ent_in_out = UringEntInOut {
            payload_sz: n as u32,
            commit_id: req.commit_id,
            ..Default::default()
        };
        let cmd = UringCmdReq {
            commit_id: req.commit_id,
            qid: self.qid,
            ..Default::default()
        };
        let sqe = opcode::UringCmd80::new(
            types::Fd(self.fuse.as_raw_fd()),
            proto::FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
        )
        .cmd(cmd.to_cmd())
        .build()
        .user_data(user_data);
        // SAFETY: as for REGISTER: the entry's buffers stay allocated while the kernel
        // may use them (the ring is dropped before the entries).
        if unsafe { push(ring, &sqe) }.is_err() {
            ent.live = false;
        }
    }
}

/// A request as the kernel put it in an entry's header, copied out so the header can
/// take the answer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub(crate) ih: proto::InHeader,
    pub(crate) op_in: [u8; proto::FUSE_URING_OP_IN_OUT_SZ],
    pub(crate) payload_sz: u32,
    pub(crate) commit_id: u64,
    pub(crate) received: std::time::Instant,
}

impl Request {
    pub(crate) fn of(ent: &Ent) -> Request {
        let hdr = &*ent.header;
        Request {
            ih: proto::read(&hdr.in_out).unwrap_or_default(),
            op_in: hdr.op_in,
            payload_sz: hdr.ring_ent_in_out.payload_sz,
            commit_id: hdr.ring_ent_in_out.commit_id,
            received: std::time::Instant::now(),
        }
    }
}

/// Queues `sqe`, first submitting what is queued when the submission queue is full.
///
/// # Safety
/// As for [`io_uring::SubmissionQueue::push`]: whatever `sqe` points to stays valid
/// until its completion arrives.
pub(crate) unsafe fn push(ring: &mut Ring, sqe: &squeue::Entry128) -> io::Result<()> {
    for _ in 0..2 {
        // SAFETY: forwarded to the caller.
        if unsafe { ring.submission().push(sqe) }.is_ok() {
            return Ok(());
        }
        ring.submit()?;
    }
    Err(io::Error::other("io_uring submission queue full"))
}

pub(crate) fn submit(ring: &mut Ring, want: usize) -> io::Result<()> {
    engine::io_uring_enter(ring, want).map(drop)
}
