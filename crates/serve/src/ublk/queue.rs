//! The transport-free part of a ublk queue: turn one I/O descriptor into a
//! [`BlockDevice`] call, and the fetch → handle → commit-and-fetch loop over a
//! [`QueueTransport`], with the requests of a queue served concurrently by its workers.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use engine::{AlignedBuf, BlockDevice, EngineError};

use super::sys;
use super::{SECTOR_SHIFT, UblkError};

/// The operation of a request (`UBLK_IO_OP_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    Read,
    Write,
    Flush,
    Discard,
    WriteSame,
    WriteZeroes,
    /// Zone operations and anything newer than this frontend.
    Other(u8),
}

impl IoOp {
    pub fn from_raw(op: u8) -> IoOp {
        match op {
            sys::IO_OP_READ => IoOp::Read,
            sys::IO_OP_WRITE => IoOp::Write,
            sys::IO_OP_FLUSH => IoOp::Flush,
            sys::IO_OP_DISCARD => IoOp::Discard,
            sys::IO_OP_WRITE_SAME => IoOp::WriteSame,
            sys::IO_OP_WRITE_ZEROES => IoOp::WriteZeroes,
            other => IoOp::Other(other),
        }
    }

    pub fn to_raw(self) -> u8 {
        match self {
            IoOp::Read => sys::IO_OP_READ,
            IoOp::Write => sys::IO_OP_WRITE,
            IoOp::Flush => sys::IO_OP_FLUSH,
            IoOp::Discard => sys::IO_OP_DISCARD,
            IoOp::WriteSame => sys::IO_OP_WRITE_SAME,
            IoOp::WriteZeroes => sys::IO_OP_WRITE_ZEROES,
            IoOp::Other(op) => op,
        }
    }
}

/// One request as the driver describes it in the tag's `ublksrv_io_desc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoDesc {
    /// Op in bits 0-7, `UBLK_IO_F_*` flags above.
    pub op_flags: u32,
    pub nr_sectors: u32,
    pub start_sector: u64,
}

impl IoDesc {
    pub fn new(op: IoOp, flags: u32, start_sector: u64, nr_sectors: u32) -> IoDesc {
        IoDesc {
            op_flags: op.to_raw() as u32 | (flags << 8),
            nr_sectors,
            start_sector,
        }
    }

    pub fn op(&self) -> IoOp {
        IoOp::from_raw((self.op_flags & 0xff) as u8)
    }

    pub fn flags(&self) -> u32 {
        self.op_flags >> 8
    }

    /// Byte range of the request; `None` when it overflows 64 bits.
    pub fn byte_range(&self) -> Option<(u64, usize)> {
        let off = self.start_sector.checked_mul(1 << SECTOR_SHIFT)?;
        let len = (self.nr_sectors as usize).checked_mul(1 << SECTOR_SHIFT)?;
        Some((off, len))
    }
}

/// What the kernel side reports for one tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueEvent {
    /// The tag carries a request; answer it with [`QueueTransport::commit_and_fetch`].
    Request { tag: u16, desc: IoDesc },
    /// The device is stopping: the tag will not be used again.
    Aborted { tag: u16 },
}

/// The kernel side of one queue (`/dev/ublkcN` + an io_uring in the real transport).
///
/// Every call happens on the queue's own thread: the driver binds a queue to the task
/// that fetched its tags.
pub trait QueueTransport {
    /// Arms `tag` for its first request. The driver moves the tag's data through `buf`,
    /// which the caller keeps alive and in place until the transport is dropped.
    fn fetch(&mut self, tag: u16, buf: &mut [u8]) -> Result<(), UblkError>;

    /// Completes the tag's request with `result` (bytes done or `-errno`) and re-arms the
    /// tag with the same buffer for its next request.
    fn commit_and_fetch(&mut self, tag: u16, result: i32, buf: &mut [u8]) -> Result<(), UblkError>;

    /// A handle that makes [`wait`](Self::wait) return, from any thread: blocked now, or
    /// at once when called next. Workers call it when they have finished requests for
    /// the queue thread to commit (the driver takes commits only from that thread).
    fn waker(&mut self) -> Result<Waker, UblkError>;

    /// Blocks until at least one event or a wake-up, pending commits submitted first,
    /// and appends the events to `out` (none after a mere wake-up).
    fn wait(&mut self, out: &mut Vec<QueueEvent>) -> Result<(), UblkError>;
}

/// Wakes a queue thread from [`QueueTransport::wait`]; see [`QueueTransport::waker`].
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Counters of one queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub reads: u64,
    pub read_bytes: u64,
    pub flushes: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

impl QueueStats {
    pub(crate) fn add(&mut self, o: &QueueStats) {
        self.reads += o.reads;
        self.read_bytes += o.read_bytes;
        self.flushes += o.flushes;
        self.errors += o.errors;
    }
}

/// Engine errors are logged with their context, but not a flood of them: a failing disk
/// under a busy queue would otherwise drown the log.
const LOGGED_ERRORS: u64 = 16;

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    flushes: AtomicU64,
    errors: AtomicU64,
}

/// Answers descriptors of one queue from a [`BlockDevice`]; shared by the queue's
/// workers.
pub struct QueueCore<'d> {
    dev: &'d dyn BlockDevice,
    q_id: u16,
    /// `dev_sectors * 512`: the device as the kernel sees it, which ends on a sector
    /// boundary even when `dev.size()` does not.
    dev_bytes: u64,
    size: u64,
    max_io_bytes: usize,
    read_only: bool,
    stats: Counters,
    /// Where each READ's time from its arrival to its commit is recorded.
    latency: Option<Arc<trace::Histogram>>,
    /// Requests handed to the workers and not yet started, for a read-ahead in `dev` to
    /// see how deep the queue is (see [`engine::Readahead::queued`]).
    queued: Option<&'d AtomicUsize>,
}

impl<'d> QueueCore<'d> {
    pub fn new(
        dev: &'d dyn BlockDevice,
        q_id: u16,
        dev_sectors: u64,
        max_io_bytes: usize,
    ) -> QueueCore<'d> {
        QueueCore {
            dev,
            q_id,
            dev_bytes: dev_sectors << SECTOR_SHIFT,
            size: dev.size(),
            max_io_bytes,
            read_only: dev.is_read_only(),
            stats: Counters::default(),
            latency: None,
            queued: None,
        }
    }

    /// Records the time of each READ, from its arrival to its commit, in `h`.
    pub fn with_latency(mut self, h: Arc<trace::Histogram>) -> QueueCore<'d> {
        self.latency = Some(h);
        self
    }

    /// Counts the requests waiting for a worker in `queued`.
    pub fn with_queued(mut self, queued: &'d AtomicUsize) -> QueueCore<'d> {
        self.queued = Some(queued);
        self
    }

    pub fn stats(&self) -> QueueStats {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        QueueStats {
            reads: n(&self.stats.reads),
            read_bytes: n(&self.stats.read_bytes),
            flushes: n(&self.stats.flushes),
            errors: n(&self.stats.errors),
        }
    }

    /// Executes `desc` against the device with `buf` as the tag's data buffer. Returns
    /// what is committed: bytes transferred or `-errno`.
    pub fn handle(&self, desc: &IoDesc, buf: &mut [u8]) -> i32 {
        let _span = match trace::spans::enabled().then(|| desc.byte_range()).flatten() {
            Some((off, len)) if desc.op() == IoOp::Read => {
                trace::spans::span("ublk read", off, len as u64)
            }
            _ => None,
        };
        let r = self.execute(desc, buf);
        if r < 0 {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn execute(&self, desc: &IoDesc, buf: &mut [u8]) -> i32 {
        let op = desc.op();
        if op == IoOp::Flush {
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
            return match self.dev.flush() {
                Ok(()) => 0,
                Err(e) => self.engine_error(desc, &e),
            };
        }
        if let IoOp::Other(_) = op {
            return -libc::EINVAL;
        }
        let Some((off, len)) = desc.byte_range() else {
            return -libc::EINVAL;
        };
        let in_range = off
            .checked_add(len as u64)
            .is_some_and(|e| e <= self.dev_bytes);
        if !in_range || len > self.max_io_bytes || len > buf.len() {
            return -libc::EINVAL;
        }
        // The committed result is an i32 of bytes; max_io_bytes keeps it far below.
        let done = len as i32;
        match op {
            IoOp::Read => {
                let buf = &mut buf[..len];
                // Past the device's byte size but inside its last sector: zeros, as a
                // loop device shows the tail of a file that is not a sector multiple.
                let avail = self.size.saturating_sub(off).min(len as u64) as usize;
                buf[avail..].fill(0);
                if avail > 0
                    && let Err(e) = self.dev.read_at(&mut buf[..avail], off)
                {
                    return self.engine_error(desc, &e);
                }
                self.stats.reads.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .read_bytes
                    .fetch_add(len as u64, Ordering::Relaxed);
                done
            }
            _ if self.read_only => -libc::EROFS,
            IoOp::Write => {
                let end = (off + len as u64).min(self.size);
                let n = end.saturating_sub(off) as usize;
                match self.dev.write_at(&buf[..n], off) {
                    Ok(()) => done,
                    Err(e) => self.engine_error(desc, &e),
                }
            }
            // A writable BlockDevice has no discard or zeroing hook (yet).
            _ => -libc::EOPNOTSUPP,
        }
    }

    fn engine_error(&self, desc: &IoDesc, e: &EngineError) -> i32 {
        let errno = match e {
            EngineError::ReadOnly { .. } => libc::EROFS,
            EngineError::OutOfRange { .. } => libc::EINVAL,
            _ => libc::EIO,
        };
        let errors = self.stats.errors.load(Ordering::Relaxed);
        if errors < LOGGED_ERRORS {
            log::warn!(
                "vabc serve: ublk queue {}: {:?} of {} sectors at sector {} failed: {e}",
                self.q_id,
                desc.op(),
                desc.nr_sectors,
                desc.start_sector
            );
        } else if errors == LOGGED_ERRORS {
            log::warn!(
                "vabc serve: ublk queue {}: further I/O errors are not logged",
                self.q_id
            );
        }
        -errno
    }

    /// Records a committed request's time if it was a READ.
    fn committed(&self, desc: &IoDesc, received: Instant) {
        if let Some(h) = &self.latency
            && desc.op() == IoOp::Read
        {
            h.record_since(received);
        }
    }
}

/// A request on its way to a worker: the tag's buffer travels with it and comes back
/// with the result. Moving an [`AlignedBuf`] moves no bytes, so the address the driver
/// was given for the tag stays valid.
struct Job {
    tag: u16,
    desc: IoDesc,
    buf: AlignedBuf,
    received: Instant,
    result: i32,
}

/// Requests the workers have finished, waiting for the queue thread to commit them.
struct Finished {
    jobs: Mutex<Vec<Job>>,
    wake: Waker,
}

impl Finished {
    fn push(&self, job: Job) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let first = jobs.is_empty();
        jobs.push(job);
        drop(jobs);
        // Only the first needs a wake-up: the queue thread takes them all at once, and
        // until it has, a non-empty list means a wake-up is on its way.
        if first {
            (self.wake)();
        }
    }

    fn take_into(&self, out: &mut Vec<Job>) {
        let mut jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::swap(&mut *jobs, out);
    }
}

/// Runs one queue until the transport aborts every tag: arms all `depth` tags, then
/// hands each request to one of `workers` threads and commits its result, re-arming the
/// tag in the same step, once the worker is done. Requests of one queue are served
/// concurrently, many reading the disk at once as the FUSE and NBD frontends do. With
/// `workers == 0` each request is answered on this thread before the next is looked at
/// (one read on the disk per queue).
///
/// `armed` is called once every tag has been handed to the transport: the driver's
/// `START_DEV` waits for that on every queue.
pub fn run_queue<T: QueueTransport>(
    core: &QueueCore<'_>,
    transport: &mut T,
    bufs: &mut [AlignedBuf],
    workers: usize,
    armed: impl FnOnce(),
) -> Result<QueueStats, UblkError> {
    let finished = match workers {
        0 => None,
        _ => Some(Finished {
            jobs: Mutex::new(Vec::with_capacity(bufs.len())),
            wake: transport.waker()?,
        }),
    };
    let max_io = core.max_io_bytes;
    for (tag, buf) in bufs.iter_mut().enumerate() {
        transport.fetch(tag as u16, buf.slice_mut(max_io))?;
    }
    armed();
    let Some(finished) = finished else {
        return serve_tags(core, transport, bufs, None);
    };
    let (tx, rx) = crossbeam_channel::bounded::<Job>(bufs.len());
    std::thread::scope(|s| {
        for i in 0..workers {
            let rx = rx.clone();
            let finished = &finished;
            let spawned = std::thread::Builder::new()
                .name(format!("ublk-q{}-{i}", core.q_id))
                .spawn_scoped(s, move || {
                    while let Ok(mut job) = rx.recv() {
                        if let Some(q) = core.queued {
                            q.fetch_sub(1, Ordering::Relaxed);
                        }
                        job.result = core.handle(&job.desc, job.buf.slice_mut(max_io));
                        finished.push(job);
                    }
                });
            if let Err(e) = spawned {
                // The workers already started end when `tx` is dropped.
                return Err(UblkError::Queue {
                    q_id: core.q_id,
                    msg: format!("cannot start worker thread: {e}"),
                });
            }
        }
        drop(rx);
        // Returning ends the workers (their channel closes); the scope waits for them,
        // so a request still running finishes before its buffer is dropped.
        serve_tags(core, transport, bufs, Some((tx, &finished)))
    })
}

/// A tag between fetch and abort.
#[derive(Clone, Copy, Default)]
struct Tag {
    live: bool,
    /// Handed to a worker, not yet committed.
    busy: bool,
    /// Aborted while busy: dead once committed.
    aborted: bool,
}

/// The loop of [`run_queue`] once the tags are armed: with `pool`, requests go to the
/// workers and come back through its [`Finished`] list; without, they are answered here.
fn serve_tags<T: QueueTransport>(
    core: &QueueCore<'_>,
    transport: &mut T,
    bufs: &mut [AlignedBuf],
    pool: Option<(crossbeam_channel::Sender<Job>, &Finished)>,
) -> Result<QueueStats, UblkError> {
    let depth = bufs.len();
    let max_io = core.max_io_bytes;
    let mut tags = vec![
        Tag {
            live: true,
            ..Tag::default()
        };
        depth
    ];
    let mut live = depth;
    let mut events = Vec::with_capacity(depth);
    let mut done = Vec::with_capacity(depth);
    while live > 0 {
        events.clear();
        transport.wait(&mut events)?;
        for ev in &events {
            match *ev {
                QueueEvent::Request { tag, desc } => {
                    let t = tag as usize;
                    if tags.get(t).is_none_or(|s| !s.live || s.busy) {
                        return Err(UblkError::Queue {
                            q_id: core.q_id,
                            msg: format!("request on tag {tag}, which is not armed"),
                        });
                    }
                    let received = Instant::now();
                    match &pool {
                        Some((tx, _)) => {
                            tags[t].busy = true;
                            if let Some(q) = core.queued {
                                q.fetch_add(1, Ordering::Relaxed);
                            }
                            let job = Job {
                                tag,
                                desc,
                                buf: std::mem::take(&mut bufs[t]),
                                received,
                                result: 0,
                            };
                            // Never blocks: the channel has a slot per tag.
                            if tx.send(job).is_err() {
                                return Err(UblkError::Queue {
                                    q_id: core.q_id,
                                    msg: "the workers are gone".into(),
                                });
                            }
                        }
                        None => {
                            let buf = bufs[t].slice_mut(max_io);
                            let result = core.handle(&desc, buf);
                            core.committed(&desc, received);
                            transport.commit_and_fetch(tag, result, buf)?;
                        }
                    }
                }
                QueueEvent::Aborted { tag } => {
                    let t = tag as usize;
                    match tags.get_mut(t) {
                        // The driver aborts a tag only once its request is committed; a
                        // transport that reports it earlier gets the commit first.
                        Some(s) if s.live && s.busy => s.aborted = true,
                        Some(s) if s.live => {
                            s.live = false;
                            live -= 1;
                        }
                        _ => {}
                    }
                }
            }
        }
        let Some((_, finished)) = &pool else {
            continue;
        };
        finished.take_into(&mut done);
        for job in done.drain(..) {
            let t = job.tag as usize;
            bufs[t] = job.buf;
            core.committed(&job.desc, job.received);
            transport.commit_and_fetch(job.tag, job.result, bufs[t].slice_mut(max_io))?;
            let s = &mut tags[t];
            s.busy = false;
            if s.aborted {
                s.live = false;
                live -= 1;
            }
        }
    }
    Ok(core.stats())
}
