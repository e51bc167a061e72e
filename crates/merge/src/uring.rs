//! io_uring engine: a window's reads go out as one batch, its writes as one
//! batch followed by one fdatasync, with the window buffer registered once
//! so data moves with READ/WRITE_FIXED. The queue is kept full (a completion
//! makes room for the next entry) and entries go out in offset order.
//!
//! With [`UringIo::with_direct`], every transfer whose offset, length and
//! memory are page-aligned goes through a second, `O_DIRECT` descriptor of
//! the same file: a merge writes each block twice (scratch copy, then
//! destination) and reads it once, and through the page cache all of that
//! is copied and written back by the kernel on top. Unaligned transfers
//! (XOR sources at byte offsets, stored payloads, the header) stay buffered;
//! the kernel keeps both views of the file coherent.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use io_uring::{IoUring, opcode, squeue, types};

use crate::io::{Dev, IoStats, MergeIo};
use engine::DIRECT_ALIGN as ALIGN;

use vabc_io::direct::reopen as reopen_direct;

/// Largest single read or write submitted (keeps SQEs independent of the
/// caller's run lengths).
const MAX_IO: usize = 1 << 20;

/// How long a ring may make no progress before it counts as stalled.
const STALL: std::time::Duration = std::time::Duration::from_secs(60);

pub struct UringIo {
    ring: IoUring,
    depth: usize,
    base: File,
    cow: File,
    /// `O_DIRECT` descriptors of the same files, when enabled and supported.
    base_direct: Option<File>,
    cow_direct: Option<File>,
    stats: IoStats,
    /// Registered buffer: (start, len).
    fixed: Option<(usize, usize)>,
    /// Background transfers (`start_reads`, `start_writes`): all of them,
    /// the next to submit, how many are in flight, how many reads and
    /// writes have not completed, the first error of each, short transfers.
    bg: Vec<Sqe>,
    bg_next: usize,
    bg_in_flight: usize,
    bg_left: [usize; 2],
    bg_err: [Option<io::Error>; 2],
    bg_short: Vec<usize>,
}

// SAFETY: the raw pointers in `bg` are addresses of the caller's buffers, which the
// caller keeps alive until their transfers are waited for (the contract of
// `start_reads`/`start_writes`); nothing else aliases them through this value. Moving
// the engine to another thread (a merge prepared before serving, run on its own
// thread) moves that bookkeeping with it and shares nothing; the ring and the files
// are Send themselves.
unsafe impl Send for UringIo {}

/// Index of `bg_left` for a transfer's direction.
fn kind(write: bool) -> usize {
    usize::from(write)
}

/// user_data tags: foreground entries carry their index, background reads
/// their index with this bit, an fsync `FSYNC_TAG`.
const BG_TAG: u64 = 1 << 62;
const FSYNC_TAG: u64 = u64::MAX;

#[derive(Clone, Copy)]
struct Sqe {
    fd: i32,
    off: u64,
    ptr: *mut u8,
    len: usize,
    write: bool,
}

impl UringIo {
    /// `depth`: submission queue entries (AOSP uses 8; 64 keeps a 2 MiB
    /// window in one submission).
    pub fn new(base: File, cow: File, depth: u32) -> io::Result<Self> {
        let ring = vabc_io::ring::new(depth)?;
        Ok(UringIo {
            ring,
            depth: depth.max(2) as usize,
            base,
            cow,
            base_direct: None,
            cow_direct: None,
            stats: IoStats::default(),
            fixed: None,
            bg: Vec::new(),
            bg_next: 0,
            bg_in_flight: 0,
            bg_left: [0; 2],
            bg_err: [None, None],
            bg_short: Vec::new(),
        })
    }

    /// Also open both files with `O_DIRECT` and use that for aligned
    /// transfers. A file whose filesystem refuses `O_DIRECT` (tmpfs) stays
    /// buffered; any other failure is returned.
    pub fn with_direct(mut self) -> io::Result<Self> {
        self.base_direct = reopen_direct(&self.base)?;
        self.cow_direct = reopen_direct(&self.cow)?;
        Ok(self)
    }

    /// Whether (base, COW) have an `O_DIRECT` path.
    pub fn direct(&self) -> (bool, bool) {
        (self.base_direct.is_some(), self.cow_direct.is_some())
    }

    fn fd(&self, dev: Dev) -> i32 {
        match dev {
            Dev::Base => self.base.as_raw_fd(),
            Dev::Cow => self.cow.as_raw_fd(),
        }
    }

    /// The `O_DIRECT` descriptor for this transfer, if it can take it.
    fn direct_fd(&self, s: &Sqe) -> Option<i32> {
        let aligned = |x: usize| x.is_multiple_of(ALIGN);
        let direct = if s.fd == self.base.as_raw_fd() {
            &self.base_direct
        } else {
            &self.cow_direct
        };
        direct
            .as_ref()
            .filter(|_| aligned(s.off as usize) && aligned(s.len) && aligned(s.ptr as usize))
            .map(|d| d.as_raw_fd())
    }

    fn entry(&self, s: &Sqe) -> squeue::Entry {
        let direct = self.direct_fd(s);
        let e = self.entry_for(s, direct);
        if s.write && direct.is_none() {
            // A buffered write goes straight to io_uring's workers, as
            // AOSP's merge submits its writes (IOSQE_ASYNC): on this kernel
            // an inline attempt that has to be retried was seen to never
            // complete, once in a few hundred merges.
            e.flags(squeue::Flags::ASYNC)
        } else {
            e
        }
    }

    fn entry_for(&self, s: &Sqe, direct: Option<i32>) -> squeue::Entry {
        let fd = types::Fd(direct.unwrap_or(s.fd));
        let len = s.len as u32;
        let fixed = self
            .fixed
            .filter(|&(start, flen)| {
                let p = s.ptr as usize;
                p >= start && p + s.len <= start + flen
            })
            .is_some();
        match (s.write, fixed) {
            (false, false) => opcode::Read::new(fd, s.ptr, len).offset(s.off).build(),
            (false, true) => opcode::ReadFixed::new(fd, s.ptr, len, 0)
                .offset(s.off)
                .build(),
            (true, false) => opcode::Write::new(fd, s.ptr, len).offset(s.off).build(),
            (true, true) => opcode::WriteFixed::new(fd, s.ptr, len, 0)
                .offset(s.off)
                .build(),
        }
    }

    /// Queue one entry. The caller keeps at most `depth` entries in flight
    /// (foreground and background together), so the queue has room.
    ///
    /// # Safety
    /// Any buffer the entry names must stay valid until its completion is
    /// reaped.
    unsafe fn push(&mut self, e: &squeue::Entry) -> io::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.ring
                .submission()
                .push(e)
                .map_err(|_| io::Error::other("io_uring submission queue full"))
        }
    }

    /// Top up the ring with background reads while there is room.
    fn fill_background(&mut self, fg_in_flight: usize) -> io::Result<()> {
        while fg_in_flight + self.bg_in_flight < self.depth && self.bg_next < self.bg.len() {
            let i = self.bg_next;
            let e = self.entry(&self.bg[i]).user_data(BG_TAG | i as u64);
            // SAFETY: `start_reads`' caller guarantees the buffers of `bg`
            // live until `wait_reads`, which reaps every one of them.
            unsafe { self.push(&e)? };
            self.bg_next += 1;
            self.bg_in_flight += 1;
        }
        Ok(())
    }

    /// Submit what is queued, wait for at least `want` completions and reap
    /// them: background ones are settled here, the others returned as
    /// (user_data, result).
    fn reap(&mut self, want: usize) -> io::Result<Vec<(u64, i32)>> {
        self.submit_and_wait(want)?;
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let mut fg = Vec::with_capacity(cqes.len());
        for (ud, res) in cqes {
            if ud != FSYNC_TAG && ud & BG_TAG != 0 {
                self.bg_in_flight -= 1;
                let i = (ud & !BG_TAG) as usize;
                self.bg_left[kind(self.bg[i].write)] -= 1;
                if res < 0 {
                    let err = &mut self.bg_err[kind(self.bg[i].write)];
                    if err.is_none() && res != -libc::ECANCELED {
                        *err = Some(io::Error::from_raw_os_error(-res));
                    }
                } else if (res as usize) < self.bg[i].len {
                    self.bg_short.push(i);
                }
            } else {
                fg.push((ud, res));
            }
        }
        Ok(fg)
    }

    /// Run `sqes` keeping up to `depth` entries in flight: completions make
    /// room for the next entries at once, instead of waiting for a whole
    /// group. Entries go out sorted by file and offset so that neighbours
    /// reach the device together and the block layer can merge them.
    /// Background reads share the ring, foreground entries first.
    fn run(&mut self, sqes: &[Sqe]) -> io::Result<()> {
        let mut order: Vec<usize> = (0..sqes.len()).collect();
        order.sort_by_key(|&i| (sqes[i].fd, sqes[i].off));
        let mut next = 0;
        let mut in_flight = 0;
        let mut first_err: Option<io::Error> = None;
        let mut short: Vec<usize> = Vec::new();
        loop {
            // After an error nothing new goes out, but what is in flight is
            // still reaped: the kernel may own those buffers until then.
            while first_err.is_none()
                && in_flight + self.bg_in_flight < self.depth
                && next < order.len()
            {
                let i = order[next];
                let e = self.entry(&sqes[i]).user_data(i as u64);
                // SAFETY: every buffer pointer in `sqes` comes from a slice
                // the caller keeps borrowed until this function returns, and
                // we reap every submitted entry below before returning (or
                // abort the process), so the kernel never touches memory
                // after it is released.
                unsafe { self.push(&e)? };
                next += 1;
                in_flight += 1;
            }
            self.fill_background(in_flight)?;
            if in_flight == 0 && (next == order.len() || first_err.is_some()) {
                break;
            }
            // Wait for half of what is in flight: room for a useful refill
            // at a fraction of the io_uring_enter calls of one per entry.
            for (ud, res) in self.reap(in_flight.div_ceil(2).max(1))? {
                in_flight -= 1;
                let i = ud as usize;
                if res < 0 {
                    if first_err.is_none() && res != -libc::ECANCELED {
                        first_err = Some(io::Error::from_raw_os_error(-res));
                    }
                } else if (res as usize) < sqes[i].len {
                    short.push(i);
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        for i in short {
            self.finish_short(&sqes[i])?;
        }
        Ok(())
    }

    /// Short transfers (rare: signals, EOF of a growing file) are finished
    /// synchronously.
    fn finish_short(&mut self, s: &Sqe) -> io::Result<()> {
        let file = if s.fd == self.base.as_raw_fd() {
            &self.base
        } else {
            &self.cow
        };
        // SAFETY: the pointer and length come from a live slice the caller
        // lent us (or, for background reads, guaranteed live until
        // `wait_reads` returns); its I/O has completed.
        let buf = unsafe { std::slice::from_raw_parts_mut(s.ptr, s.len) };
        if s.write {
            file.write_all_at(buf, s.off)?;
        } else {
            file.read_exact_at(buf, s.off)?;
        }
        self.stats.syscalls += 1;
        Ok(())
    }

    /// fdatasync of `fd` once every foreground entry before it completed, so
    /// it covers all of them (no links needed). Background reads may run
    /// alongside.
    fn fsync(&mut self, fd: i32) -> io::Result<()> {
        let t = Instant::now();
        let r = self.fsync_inner(fd);
        self.stats.sync_wait += t.elapsed();
        r
    }

    fn fsync_inner(&mut self, fd: i32) -> io::Result<()> {
        // A sync covers the writes started before it (`start_writes`).
        self.wait_background(true)?;
        self.stats.fsyncs += 1;
        while self.bg_in_flight >= self.depth {
            // Make room: the fsync needs one slot.
            let _ = self.reap(1)?;
        }
        let e = opcode::Fsync::new(types::Fd(fd))
            .flags(types::FsyncFlags::DATASYNC)
            .build()
            .user_data(FSYNC_TAG);
        // SAFETY: an fsync entry carries no buffer.
        unsafe { self.push(&e)? };
        loop {
            for (ud, res) in self.reap(1)? {
                if ud == FSYNC_TAG {
                    return if res < 0 {
                        Err(io::Error::from_raw_os_error(-res))
                    } else {
                        Ok(())
                    };
                }
            }
            self.fill_background(1)?;
        }
    }

    fn split(fd: i32, off: u64, ptr: *mut u8, len: usize, write: bool, out: &mut Vec<Sqe>) {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(MAX_IO);
            out.push(Sqe {
                fd,
                off: off + at as u64,
                // SAFETY (pointer arithmetic): `at < len`, inside the slice.
                ptr: ptr.wrapping_add(at),
                len: n,
                write,
            });
            at += n;
        }
    }

    /// One batch of writes (they never overlap), optionally followed by an fdatasync.
    fn writes(&mut self, dev: Dev, reqs: &[(u64, &[u8])], sync: bool) -> io::Result<()> {
        let fd = self.fd(dev);
        let mut sqes = Vec::with_capacity(reqs.len());
        for (off, buf) in reqs {
            // The kernel only reads from this memory for a write.
            Self::split(
                fd,
                *off,
                buf.as_ptr() as *mut u8,
                buf.len(),
                true,
                &mut sqes,
            );
        }
        self.count(&sqes);
        // The writes of one batch never overlap (the merge writes each
        // destination and scratch range once per batch), so they need no
        // ordering among themselves; the sync follows once they completed.
        let t = Instant::now();
        let r = self.run(&sqes);
        self.stats.write_wait += t.elapsed();
        r?;
        if sync {
            self.fsync(fd)?;
        }
        Ok(())
    }

    /// Submit what is queued and wait for `want` completions. A ring that
    /// makes no progress for `STALL` is treated as a crash: the kernel may
    /// still own our buffers, so returning would not be memory-safe, and the
    /// merge protocol resumes from any crash point.
    fn submit_and_wait(&mut self, want: usize) -> io::Result<()> {
        let ts = types::Timespec::new().sec(STALL.as_secs());
        let args = types::SubmitArgs::new().timespec(&ts);
        loop {
            self.stats.syscalls += 1;
            match self.ring.submitter().submit_with_args(want, &args) {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {
                    if !self.ring.completion().is_empty() {
                        return Ok(());
                    }
                    log::warn!(
                        "vabc: io_uring made no progress for {} s; stopping (the merge resumes on the next run)",
                        STALL.as_secs()
                    );
                    std::process::abort();
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Wait for every background read (`write` false) or write (true); the
    /// first error of that kind is returned. Entries are forgotten once both
    /// kinds are done.
    fn wait_background(&mut self, write: bool) -> io::Result<()> {
        while self.bg_left[kind(write)] > 0 {
            self.fill_background(0)?;
            let fg = self.reap(self.bg_in_flight.div_ceil(2).max(1))?;
            debug_assert!(fg.is_empty(), "foreground completion outside run");
        }
        let err = self.bg_err[kind(write)].take();
        let (mine, others): (Vec<usize>, Vec<usize>) = std::mem::take(&mut self.bg_short)
            .into_iter()
            .partition(|&i| self.bg[i].write == write);
        self.bg_short = others;
        let result = match err {
            Some(e) => Err(e),
            None => mine.iter().try_for_each(|&i| {
                let s = self.bg[i];
                self.finish_short(&s)
            }),
        };
        if self.bg_left == [0, 0] {
            self.bg.clear();
            self.bg_next = 0;
            self.bg_short.clear();
        }
        result
    }

    /// Queue background transfers and hand them to the kernel now;
    /// completions are reaped by later calls.
    fn start_background(&mut self, mut sqes: Vec<Sqe>) -> io::Result<()> {
        // Batches add up until waited for; indices into `bg` stay valid.
        sqes.sort_by_key(|s| s.off);
        self.count(&sqes);
        for s in &sqes {
            self.bg_left[kind(s.write)] += 1;
        }
        self.bg.extend(sqes);
        self.fill_background(0)?;
        self.stats.syscalls += 1;
        self.ring.submit()?;
        Ok(())
    }

    fn count(&mut self, sqes: &[Sqe]) {
        for s in sqes {
            if s.write {
                self.stats.writes += 1;
                self.stats.bytes_written += s.len as u64;
            } else {
                self.stats.reads += 1;
                self.stats.bytes_read += s.len as u64;
            }
        }
    }
}

impl MergeIo for UringIo {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let fd = self.fd(dev);
        let mut sqes = Vec::with_capacity(reqs.len());
        for (off, buf) in reqs.iter_mut() {
            Self::split(fd, *off, buf.as_mut_ptr(), buf.len(), false, &mut sqes);
        }
        self.count(&sqes);
        let t = Instant::now();
        let r = self.run(&sqes);
        self.stats.read_wait += t.elapsed();
        r
    }

    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.writes(dev, reqs, false)
    }

    fn sync(&mut self, dev: Dev) -> io::Result<()> {
        let fd = self.fd(dev);
        self.fsync(fd)
    }

    /// The batch of writes, then one fdatasync.
    fn write_and_sync(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.writes(dev, reqs, true)
    }

    fn stats(&self) -> IoStats {
        self.stats
    }

    unsafe fn start_reads(&mut self, dev: Dev, reqs: &[(u64, *mut u8, usize)]) -> io::Result<()> {
        let fd = self.fd(dev);
        let mut sqes = Vec::with_capacity(reqs.len());
        for &(off, ptr, len) in reqs {
            Self::split(fd, off, ptr, len, false, &mut sqes);
        }
        self.start_background(sqes)
    }

    fn wait_reads(&mut self) -> io::Result<()> {
        let t = Instant::now();
        let r = self.wait_background(false);
        self.stats.read_wait += t.elapsed();
        r
    }

    unsafe fn start_writes(
        &mut self,
        dev: Dev,
        reqs: &[(u64, *const u8, usize)],
    ) -> io::Result<()> {
        let fd = self.fd(dev);
        let mut sqes = Vec::with_capacity(reqs.len());
        for &(off, ptr, len) in reqs {
            // The kernel only reads from this memory for a write.
            Self::split(fd, off, ptr as *mut u8, len, true, &mut sqes);
        }
        self.start_background(sqes)
    }

    fn wait_writes(&mut self) -> io::Result<()> {
        let t = Instant::now();
        let r = self.wait_background(true);
        self.stats.write_wait += t.elapsed();
        r
    }

    fn register(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.unregister();
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: the caller guarantees (trait contract) that `buf` stays
        // alive and is not moved until `unregister`, which the merge calls
        // before dropping the buffer.
        unsafe { self.ring.submitter().register_buffers(&[iov])? };
        self.stats.syscalls += 1;
        self.fixed = Some((buf.as_ptr() as usize, buf.len()));
        Ok(())
    }

    fn unregister(&mut self) {
        if self.fixed.take().is_some() {
            // Failure only means there was nothing registered.
            let _ = self.ring.submitter().unregister_buffers();
            self.stats.syscalls += 1;
        }
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        // Background transfers still running would use memory their owner
        // may free next: reap them first.
        let _ = self.wait_reads();
        let _ = self.wait_writes();
        self.unregister();
    }
}
