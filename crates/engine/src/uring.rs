//! Several positional reads in flight from one thread, through a per-thread io_uring.
//!
//! A large request's source runs (a handful of base-image ranges and COW payload ranges)
//! are submitted together and awaited together by the thread serving the request: no
//! hop to a thread pool and no pool threads spinning for work, which on a small machine
//! cost as much CPU as the reads themselves. Where io_uring is unavailable (old kernel,
//! seccomp, `kernel.io_uring_disabled`), [`read_batch`] says so and the caller issues
//! blocking `pread`s instead.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, types};

/// Submission queue size of each thread's ring; longer batches go in several rounds.
const RING_ENTRIES: u32 = 64;

/// One read: fill `buf` from `offset` of `fd`.
#[derive(Debug)]
pub(crate) struct Read<'a> {
    pub fd: RawFd,
    pub offset: u64,
    pub buf: &'a mut [u8],
}

enum Ring {
    Untried,
    Ready(Box<IoUring>),
    Unavailable,
}

thread_local! {
    static RING: RefCell<Ring> = const { RefCell::new(Ring::Untried) };
}

/// Makes this thread behave as if io_uring were unavailable (tests of the fallback).
#[cfg(test)]
pub(crate) fn disable_for_this_thread() {
    RING.with(|cell| *cell.borrow_mut() = Ring::Unavailable);
}

/// Whether this thread can use [`read_batch`] (creates its ring on first use).
pub(crate) fn available() -> bool {
    RING.with(|cell| {
        let Ok(mut slot) = cell.try_borrow_mut() else {
            return false;
        };
        if matches!(*slot, Ring::Untried) {
            *slot = match IoUring::new(RING_ENTRIES) {
                Ok(r) => Ring::Ready(Box::new(r)),
                Err(_) => Ring::Unavailable,
            };
        }
        matches!(*slot, Ring::Ready(_))
    })
}

/// Reads every entry of `reads` completely, all submitted at once. Returns `None` when
/// this thread has no io_uring (nothing was read; use `pread`), otherwise one result per
/// read: a short read that hits the end of the file is `UnexpectedEof`.
pub(crate) fn read_batch(reads: &mut [Read<'_>]) -> Option<Vec<io::Result<()>>> {
    RING.with(|cell| {
        // A re-entrant call (cannot happen today: nothing in a batch calls back into the
        // engine) would find the ring borrowed; it then falls back to pread.
        let mut slot = cell.try_borrow_mut().ok()?;
        if matches!(*slot, Ring::Untried) {
            *slot = match IoUring::new(RING_ENTRIES) {
                Ok(r) => Ring::Ready(Box::new(r)),
                Err(_) => Ring::Unavailable,
            };
        }
        let Ring::Ready(ring) = &mut *slot else {
            return None;
        };
        Some(run(ring, reads))
    })
}

fn run(ring: &mut IoUring, reads: &mut [Read<'_>]) -> Vec<io::Result<()>> {
    let n = reads.len();
    let mut done = vec![0usize; n];
    let mut results: Vec<Option<io::Result<()>>> = (0..n).map(|_| None).collect();
    // Reads waiting to be (re)submitted, as indices; short reads come back for the rest.
    let mut queue: Vec<usize> = (0..n).rev().collect();
    let mut in_flight = 0usize;
    let mut finished = 0usize;
    while finished < n {
        {
            let mut sq = ring.submission();
            while let Some(&i) = queue.last() {
                if sq.is_full() {
                    break;
                }
                let r = &mut reads[i];
                let rest = &mut r.buf[done[i]..];
                let len = rest.len().min(u32::MAX as usize) as u32;
                let entry = opcode::Read::new(types::Fd(r.fd), rest.as_mut_ptr(), len)
                    .offset(r.offset + done[i] as u64)
                    .build()
                    .user_data(i as u64);
                // SAFETY: the entry points into `reads[i].buf`, which the caller keeps
                // borrowed (and so alive and unmoved) until this function returns, and
                // this function returns only after every submitted entry has completed.
                // Each buffer has at most one read in flight at a time.
                if unsafe { sq.push(&entry) }.is_err() {
                    break;
                }
                queue.pop();
                in_flight += 1;
            }
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) => {}
            Err(e) if in_flight == 0 => {
                // Nothing in flight refers to the buffers: fail what is left and return.
                for i in queue.drain(..) {
                    results[i] = Some(Err(io::Error::new(e.kind(), e.to_string())));
                    finished += 1;
                }
                continue;
            }
            // Entries may be in flight: keep waiting for them (io_uring_enter's other
            // errors are argument errors that the first call of a ring would report).
            Err(_) => std::thread::yield_now(),
        }
        for cqe in ring.completion() {
            in_flight -= 1;
            let i = cqe.user_data() as usize;
            let res = cqe.result();
            if res < 0 {
                if matches!(-res, libc::EINTR | libc::EAGAIN) {
                    queue.push(i);
                } else {
                    results[i] = Some(Err(io::Error::from_raw_os_error(-res)));
                    finished += 1;
                }
            } else if res == 0 {
                results[i] = Some(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "end of file after {} of {} bytes",
                        done[i],
                        reads[i].buf.len()
                    ),
                )));
                finished += 1;
            } else {
                done[i] += res as usize;
                if done[i] >= reads[i].buf.len() {
                    results[i] = Some(Ok(()));
                    finished += 1;
                } else {
                    queue.push(i);
                }
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(io::Error::other("read not completed"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + i / 4096) as u8).collect()
    }

    #[test]
    fn batch_matches_pread_including_unaligned_long_and_eof() {
        let data = pattern(3 * 1024 * 1024 + 777);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        let file = f.as_file();
        // (offset, len): unaligned, page-sized, 1 MiB, the tail to the last byte, and
        // more reads than the ring has entries.
        let mut specs = vec![
            (1u64, 10usize),
            (4096, 4096),
            (12_345, 1 << 20),
            (data.len() as u64 - 777, 777),
        ];
        specs.extend((0..150).map(|i| (i * 9973 % 3_000_000, 5000)));
        let mut bufs: Vec<Vec<u8>> = specs.iter().map(|&(_, l)| vec![0u8; l]).collect();
        let mut reads: Vec<Read<'_>> = specs
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&(offset, _), buf)| Read {
                fd: file.as_raw_fd(),
                offset,
                buf,
            })
            .collect();
        let results = read_batch(&mut reads).expect("io_uring available");
        assert!(results.iter().all(|r| r.is_ok()));
        drop(reads);
        for (&(offset, len), buf) in specs.iter().zip(&bufs) {
            let mut want = vec![0u8; len];
            file.read_exact_at(&mut want, offset).unwrap();
            assert!(*buf == want, "read of {len} at {offset}");
        }
    }

    #[test]
    fn direct_io_reads_and_errors() {
        let data = pattern(1 << 20);
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        f.as_file().sync_all().unwrap();
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(f.path());
        let mut aligned = crate::AlignedBuf::new(256 << 10);
        let mut past = vec![0u8; 100];
        let mut small = [0u8; 16];
        let fd = direct
            .as_ref()
            .map_or(f.as_file().as_raw_fd(), |d| d.as_raw_fd());
        let mut reads = vec![
            Read {
                fd,
                offset: 512 << 10,
                buf: aligned.slice_mut(256 << 10),
            },
            // Starts past the end: an error for this read only.
            Read {
                fd: f.as_file().as_raw_fd(),
                offset: data.len() as u64 + 10,
                buf: &mut past,
            },
            Read {
                fd: -1,
                offset: 0,
                buf: &mut small,
            },
        ];
        let results = read_batch(&mut reads).expect("io_uring available");
        assert!(results[0].is_ok());
        let eof = results[1].as_ref().unwrap_err();
        assert_eq!(eof.kind(), io::ErrorKind::UnexpectedEof, "{eof}");
        assert_eq!(
            results[2].as_ref().unwrap_err().raw_os_error(),
            Some(libc::EBADF)
        );
        drop(reads);
        assert!(aligned.as_slice() == &data[512 << 10..768 << 10]);
    }
}
