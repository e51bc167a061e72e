//! io_uring engine: a window's reads go out as one batch, its writes as one
//! batch followed by one fdatasync, with
//! the window buffer registered once so data moves with READ/WRITE_FIXED.
//! One `io_uring_enter` per batch instead of a syscall per block.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use io_uring::{IoUring, opcode, squeue, types};

use crate::io::{Dev, IoStats, MergeIo};

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
    stats: IoStats,
    /// Registered buffer: (start, len).
    fixed: Option<(usize, usize)>,
}

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
        let ring = IoUring::new(depth.max(2))?;
        Ok(UringIo {
            ring,
            depth: depth.max(2) as usize,
            base,
            cow,
            stats: IoStats::default(),
            fixed: None,
        })
    }

    fn fd(&self, dev: Dev) -> i32 {
        match dev {
            Dev::Base => self.base.as_raw_fd(),
            Dev::Cow => self.cow.as_raw_fd(),
        }
    }

    fn entry(&self, s: &Sqe) -> squeue::Entry {
        let fd = types::Fd(s.fd);
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

    /// Submit `sqes` (and optionally a final fsync of `sync_fd`) in groups
    /// that fit the ring, waiting for each group.
    fn run(&mut self, sqes: &[Sqe], sync_fd: Option<i32>) -> io::Result<()> {
        let total = sqes.len() + usize::from(sync_fd.is_some());
        let mut next = 0;
        while next < total {
            let group_end = (next + self.depth).min(total);
            let mut expected = Vec::with_capacity(group_end - next);
            for i in next..group_end {
                let e = if i < sqes.len() {
                    self.entry(&sqes[i])
                } else {
                    let fd = sync_fd.unwrap_or_default();
                    opcode::Fsync::new(types::Fd(fd))
                        .flags(types::FsyncFlags::DATASYNC)
                        .build()
                };
                let e = e.user_data(i as u64);
                // SAFETY: every buffer pointer in `sqes` comes from a slice
                // the caller keeps borrowed until this function returns, and
                // we wait for all completions of the group below (or abort
                // the process), so the kernel never touches memory after it
                // is released. The queue has room: at most `depth` entries
                // per group and the previous group was fully reaped.
                unsafe {
                    self.ring
                        .submission()
                        .push(&e)
                        .map_err(|_| io::Error::other("io_uring submission queue full"))?;
                }
                expected.push(if i < sqes.len() { sqes[i].len } else { 0 });
            }
            let n = group_end - next;
            self.submit_and_wait(n)?;
            let mut done = 0;
            let mut first_err: Option<io::Error> = None;
            let mut short: Vec<usize> = Vec::new();
            while done < n {
                let cqes: Vec<(u64, i32)> = self
                    .ring
                    .completion()
                    .map(|c| (c.user_data(), c.result()))
                    .collect();
                if cqes.is_empty() {
                    self.submit_and_wait(1)?;
                    continue;
                }
                for (ud, res) in cqes {
                    done += 1;
                    let i = ud as usize;
                    if res < 0 {
                        if first_err.is_none() && res != -libc::ECANCELED {
                            first_err = Some(io::Error::from_raw_os_error(-res));
                        }
                    } else if (res as usize) < expected[i - next] {
                        short.push(i);
                    }
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
            // Short transfers (rare: signals, EOF of a growing file) are
            // finished synchronously.
            for i in short {
                let s = &sqes[i];
                let file = if s.fd == self.base.as_raw_fd() {
                    &self.base
                } else {
                    &self.cow
                };
                // SAFETY: the pointer and length come from a live slice the
                // caller lent us for the duration of this call.
                let buf = unsafe { std::slice::from_raw_parts_mut(s.ptr, s.len) };
                if s.write {
                    file.write_all_at(buf, s.off)?;
                } else {
                    file.read_exact_at(buf, s.off)?;
                }
                self.stats.syscalls += 1;
            }
            next = group_end;
        }
        Ok(())
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
        self.run(&sqes, None)?;
        if sync {
            self.stats.fsyncs += 1;
            self.run(&[], Some(fd))?;
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
                    eprintln!(
                        "vabc: io_uring made no progress for {} s; stopping (the merge resumes on the next run)",
                        STALL.as_secs()
                    );
                    std::process::abort();
                }
                Err(e) => return Err(e),
            }
        }
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
        self.run(&sqes, None)
    }

    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.writes(dev, reqs, false)
    }

    fn sync(&mut self, dev: Dev) -> io::Result<()> {
        let fd = self.fd(dev);
        self.stats.fsyncs += 1;
        self.run(&[], Some(fd))
    }

    /// The batch of writes, then one fdatasync.
    fn write_and_sync(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.writes(dev, reqs, true)
    }

    fn stats(&self) -> IoStats {
        self.stats
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
        self.unregister();
    }
}
