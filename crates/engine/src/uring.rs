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
use smallvec::SmallVec;

/// `io_uring_enter`, again when a signal interrupts the wait: every ring of the
/// project that needs nothing more (the FUSE queues, ublk's control and queue rings)
/// enters through it; the merge's adds a stall timeout, and the read batches below
/// treat EAGAIN/EBUSY as "reap first".
pub use vabc_io::ring::enter;

/// Submission queue size of each thread's ring; longer batches go in several rounds.
const RING_ENTRIES: u32 = 64;

/// Most iovecs one `readv` takes (`UIO_MAXIOV`); longer lists go in several rounds.
const IOV_MAX: usize = 1024;

/// One read: fill `bufs`, in order, from the contiguous range of `fd` at `offset`.
/// Several buffers make one vectored read (a run of the file scattered to its
/// destinations by the kernel, with no bounce copy).
#[derive(Debug)]
pub(crate) struct Read<'a> {
    pub fd: RawFd,
    pub offset: u64,
    pub bufs: SmallVec<[&'a mut [u8]; 1]>,
}

impl<'a> Read<'a> {
    #[cfg(test)]
    pub(crate) fn new(fd: RawFd, offset: u64, buf: &'a mut [u8]) -> Read<'a> {
        let mut bufs = SmallVec::new();
        bufs.push(buf);
        Read { fd, offset, bufs }
    }

    /// Bytes this read fills.
    pub(crate) fn len(&self) -> usize {
        self.bufs.iter().map(|b| b.len()).sum()
    }
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

/// Whether this process may create io_uring instances at all. The engine itself then
/// reads with `pread`; frontends and the merge ask here to pick their own fallback.
pub use vabc_io::ring::usable;

/// Whether this thread can use [`read_batch`] (creates its ring on first use).
pub(crate) fn available() -> bool {
    RING.with(|cell| {
        let Ok(mut slot) = cell.try_borrow_mut() else {
            return false;
        };
        if matches!(*slot, Ring::Untried) {
            *slot = match vabc_io::ring::new(RING_ENTRIES) {
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
            *slot = match vabc_io::ring::new(RING_ENTRIES) {
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
    let lens: Vec<usize> = reads.iter().map(Read::len).collect();
    let mut done = vec![0usize; n];
    // iovecs of the vectored read in flight for each read, kept unmoved until it completes.
    let mut iovs: Vec<Vec<libc::iovec>> = (0..n).map(|_| Vec::new()).collect();
    let mut results: Vec<Option<io::Result<()>>> = (0..n).map(|_| None).collect();
    let mut finished = 0usize;
    for (i, len) in lens.iter().enumerate() {
        if *len == 0 {
            results[i] = Some(Ok(()));
            finished += 1;
        }
    }
    // Reads waiting to be (re)submitted, as indices; short reads come back for the rest.
    let mut queue: Vec<usize> = (0..n).rev().filter(|&i| lens[i] > 0).collect();
    let mut in_flight = 0usize;
    while finished < n {
        {
            let mut sq = ring.submission();
            while let Some(&i) = queue.last() {
                if sq.is_full() {
                    break;
                }
                let r = &mut reads[i];
                let at = r.offset + done[i] as u64;
                let entry = if r.bufs.len() == 1 {
                    let rest = &mut r.bufs[0][done[i]..];
                    let len = rest.len().min(u32::MAX as usize) as u32;
                    opcode::Read::new(types::Fd(r.fd), rest.as_mut_ptr(), len)
                        .offset(at)
                        .build()
                } else {
                    let v = &mut iovs[i];
                    fill_iovecs(v, &mut r.bufs, done[i]);
                    opcode::Readv::new(types::Fd(r.fd), v.as_ptr(), v.len() as u32)
                        .offset(at)
                        .build()
                };
                // SAFETY: the entry points into `reads[i].bufs` (directly or through
                // `iovs[i]`, which is not touched again until this entry completes); the
                // caller keeps the buffers borrowed (alive and unmoved) until this
                // function returns, and it returns only after every submitted entry has
                // completed. Each buffer has at most one read in flight at a time.
                if unsafe { sq.push(&entry.user_data(i as u64)) }.is_err() {
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
                    format!("end of file after {} of {} bytes", done[i], lens[i]),
                )));
                finished += 1;
            } else {
                done[i] += res as usize;
                if done[i] >= lens[i] {
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

/// The iovecs of `bufs` past their first `skip` bytes, neighbours in memory merged, at
/// most [`IOV_MAX`] (the rest comes back as a short read).
fn fill_iovecs(v: &mut Vec<libc::iovec>, bufs: &mut [&mut [u8]], mut skip: usize) {
    v.clear();
    for b in bufs.iter_mut() {
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let rest = &mut b[skip..];
        skip = 0;
        let (base, len) = (rest.as_mut_ptr(), rest.len());
        if let Some(last) = v.last_mut()
            && last.iov_base as usize + last.iov_len == base as usize
        {
            last.iov_len += len;
            continue;
        }
        if v.len() == IOV_MAX {
            break;
        }
        v.push(libc::iovec {
            iov_base: base.cast(),
            iov_len: len,
        });
    }
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

    /// A synced temporary file holding `data`, and a second descriptor of it opened
    /// `O_DIRECT` (an error where the filesystem refuses it).
    fn file_with(data: &[u8]) -> (tempfile::NamedTempFile, io::Result<std::fs::File>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(data).unwrap();
        f.as_file().sync_all().unwrap();
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(f.path());
        (f, direct)
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
            .map(|(&(offset, _), buf)| Read::new(file.as_raw_fd(), offset, buf))
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
        let (f, direct) = file_with(&data);
        let mut aligned = crate::AlignedBuf::new(256 << 10);
        let mut past = vec![0u8; 100];
        let mut small = [0u8; 16];
        let fd = direct
            .as_ref()
            .map_or(f.as_file().as_raw_fd(), |d| d.as_raw_fd());
        let mut reads = vec![
            Read::new(fd, 512 << 10, aligned.slice_mut(256 << 10)),
            // Starts past the end: an error for this read only.
            Read::new(f.as_file().as_raw_fd(), data.len() as u64 + 10, &mut past),
            Read::new(-1, 0, &mut small),
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

    #[test]
    fn vectored_reads_scatter_in_order_direct_and_buffered() {
        let data = pattern(8 << 20);
        let (f, direct) = file_with(&data);
        // Page-aligned pieces of page-multiple sizes (as O_DIRECT needs), some adjacent in
        // memory (merged into one iovec), plus more pieces than one readv takes.
        let mut mem = crate::AlignedBuf::new(16 << 20);
        let region = mem.slice_mut(16 << 20);
        let mut sizes: Vec<usize> = vec![4096, 8192, 4096, 65536, 4096];
        sizes.extend(std::iter::repeat_n(4096, 1500));
        for fd in [
            direct.as_ref().map_or(-1, |d| d.as_raw_fd()),
            f.as_file().as_raw_fd(),
        ] {
            if fd < 0 {
                continue;
            }
            region.fill(0);
            // Every other piece skips a page of memory, so the iovecs do not merge.
            let mut bufs: SmallVec<[&mut [u8]; 1]> = SmallVec::new();
            let mut rest = &mut region[..];
            for (k, &len) in sizes.iter().enumerate() {
                let gap = if k % 2 == 0 { 4096 } else { 0 };
                let (_, r) = std::mem::take(&mut rest).split_at_mut(gap);
                let (piece, r) = r.split_at_mut(len);
                bufs.push(piece);
                rest = r;
            }
            let total: usize = sizes.iter().sum();
            let offset = 12 * 4096u64;
            let mut reads = vec![Read { fd, offset, bufs }];
            let results = read_batch(&mut reads).expect("io_uring available");
            assert!(results[0].is_ok(), "{:?}", results[0]);
            let got: Vec<u8> = reads[0]
                .bufs
                .iter()
                .flat_map(|b| b.iter().copied())
                .collect();
            assert_eq!(got.len(), total);
            assert!(
                got == data[offset as usize..offset as usize + total],
                "fd {fd}"
            );
        }
    }
}
