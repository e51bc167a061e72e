//! The transport-free part of a ublk queue: turn one I/O descriptor into a
//! [`BlockDevice`] call, and the fetch → handle → commit-and-fetch loop over a
//! [`QueueTransport`].

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

    /// Blocks until at least one event, pending commits submitted first, and appends the
    /// events to `out`.
    fn wait(&mut self, out: &mut Vec<QueueEvent>) -> Result<(), UblkError>;
}

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

/// Answers descriptors of one queue from a [`BlockDevice`].
pub struct QueueCore<'d> {
    dev: &'d dyn BlockDevice,
    q_id: u16,
    /// `dev_sectors * 512`: the device as the kernel sees it, which ends on a sector
    /// boundary even when `dev.size()` does not.
    dev_bytes: u64,
    size: u64,
    max_io_bytes: usize,
    read_only: bool,
    stats: QueueStats,
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
            stats: QueueStats::default(),
        }
    }

    pub fn stats(&self) -> QueueStats {
        self.stats
    }

    /// Executes `desc` against the device with `buf` as the tag's data buffer. Returns
    /// what is committed: bytes transferred or `-errno`.
    pub fn handle(&mut self, desc: &IoDesc, buf: &mut [u8]) -> i32 {
        let r = self.execute(desc, buf);
        if r < 0 {
            self.stats.errors += 1;
        }
        r
    }

    fn execute(&mut self, desc: &IoDesc, buf: &mut [u8]) -> i32 {
        let op = desc.op();
        if op == IoOp::Flush {
            self.stats.flushes += 1;
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
                self.stats.reads += 1;
                self.stats.read_bytes += len as u64;
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

    fn engine_error(&mut self, desc: &IoDesc, e: &EngineError) -> i32 {
        let errno = match e {
            EngineError::ReadOnly { .. } => libc::EROFS,
            EngineError::OutOfRange { .. } => libc::EINVAL,
            _ => libc::EIO,
        };
        if self.stats.errors < LOGGED_ERRORS {
            eprintln!(
                "vabc serve: ublk queue {}: {:?} of {} sectors at sector {} failed: {e}",
                self.q_id,
                desc.op(),
                desc.nr_sectors,
                desc.start_sector
            );
        } else if self.stats.errors == LOGGED_ERRORS {
            eprintln!(
                "vabc serve: ublk queue {}: further I/O errors are not logged",
                self.q_id
            );
        }
        -errno
    }
}

/// Runs one queue until the transport aborts every tag: arms all `depth` tags, then
/// answers each request and re-arms its tag in the same step. Requests of one queue are
/// served one after another on this thread; parallelism comes from one queue per CPU
/// (blk-mq maps each CPU to a queue), as snapuserd's ublk server runs one queue per
/// read worker.
///
/// `armed` is called once every tag has been handed to the transport: the driver's
/// `START_DEV` waits for that on every queue.
pub fn run_queue<T: QueueTransport>(
    core: &mut QueueCore<'_>,
    transport: &mut T,
    bufs: &mut [AlignedBuf],
    armed: impl FnOnce(),
) -> Result<QueueStats, UblkError> {
    let depth = bufs.len();
    let max_io = core.max_io_bytes;
    for (tag, buf) in bufs.iter_mut().enumerate() {
        transport.fetch(tag as u16, buf.slice_mut(max_io))?;
    }
    armed();
    let mut tag_live = vec![true; depth];
    let mut live = depth;
    let mut events = Vec::with_capacity(depth);
    while live > 0 {
        events.clear();
        transport.wait(&mut events)?;
        for ev in &events {
            match *ev {
                QueueEvent::Request { tag, desc } => {
                    let t = tag as usize;
                    if !tag_live.get(t).copied().unwrap_or(false) {
                        return Err(UblkError::Queue {
                            q_id: core.q_id,
                            msg: format!("request on tag {tag}, which is not armed"),
                        });
                    }
                    let buf = bufs[t].slice_mut(max_io);
                    let result = core.handle(&desc, buf);
                    transport.commit_and_fetch(tag, result, buf)?;
                }
                QueueEvent::Aborted { tag } => {
                    let t = tag as usize;
                    if tag_live.get(t).copied().unwrap_or(false) {
                        tag_live[t] = false;
                        live -= 1;
                    }
                }
            }
        }
    }
    Ok(core.stats())
}
