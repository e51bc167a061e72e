//! io_uring set-up and submission, for every ring of the project (the serving engine's
//! per-thread read rings, the FUSE and ublk queues, the merge, trace replay).

use std::io;

use io_uring::{IoUring, cqueue, squeue};

/// A ring of `entries` submission entries, for one thread that submits and reaps:
/// the kernel may then run completion work only when that thread waits
/// (`SINGLE_ISSUER` + `DEFER_TASKRUN`), instead of interrupting it. Kernels without
/// those flags (before 6.1) get a plain ring.
pub fn for_one_thread<S, C>(entries: u32) -> io::Result<IoUring<S, C>>
where
    S: squeue::EntryMarker,
    C: cqueue::EntryMarker,
{
    IoUring::<S, C>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::<S, C>::builder().build(entries))
}

/// A plain ring of `entries` submission entries (at least 2).
pub fn new<S, C>(entries: u32) -> io::Result<IoUring<S, C>>
where
    S: squeue::EntryMarker,
    C: cqueue::EntryMarker,
{
    IoUring::<S, C>::builder().build(entries.max(2))
}

/// Whether this process may create io_uring instances at all: io_uring can be switched
/// off (`kernel.io_uring_disabled`) or filtered out by seccomp, as in many containers.
pub fn usable() -> io::Result<()> {
    new::<squeue::Entry, cqueue::Entry>(2).map(drop)
}

/// `io_uring_enter`: submits what is queued and, with `want` above zero, waits for
/// that many completions, again when a signal interrupts the wait.
pub fn enter<S, C>(ring: &mut IoUring<S, C>, want: usize) -> io::Result<usize>
where
    S: squeue::EntryMarker,
    C: cqueue::EntryMarker,
{
    loop {
        let r = match want {
            0 => ring.submit(),
            n => ring.submit_and_wait(n),
        };
        match r {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            r => return r,
        }
    }
}
