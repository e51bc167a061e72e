//! A connection's replies on their way out, so that the shared workers never wait for
//! one client's socket.
//!
//! A worker with a reply writes what the socket takes (`MSG_DONTWAIT`, or rustls'
//! buffer for TLS), for at most [`SLICE`] and only when no earlier reply of the
//! connection waits; the reply goes out straight from the worker's buffer when the
//! client keeps up. What the socket has not taken by then is copied to the
//! connection's queue, after which later replies queue behind it (replies go out
//! whole, one after another), and the connection's own writer thread sends it as the
//! socket drains. So a client that stops reading costs a worker one slice, once; only
//! the writer waits for it longer.
//!
//! The queue is bounded by the connection's budget ([`Outbox::reserve`]): a request
//! charges its reply's size when it is read off the socket and gives it back when the
//! reply is written, so `max_inflight` bounds reads queued, being read and replies
//! waiting together, and a client that reads its replies slowly is slowed down (its
//! reader stops taking requests), not dropped. A client whose socket takes nothing of
//! what waits for `write_timeout` is disconnected: the waiting replies are dropped, the
//! reads not yet started are skipped, and the slot is freed.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Stream;
use super::slots::Watch;
use super::tls::{io_slices, send_now, skip};

/// How long a worker may keep sending a reply itself while the socket takes it, before
/// it leaves the rest to the writer. A client that keeps up gets its reply straight
/// from the worker's buffer (a Unix socket takes 200 KiB at once, a 1 MiB reply takes
/// a few passes); one that does not costs the worker this once, as later replies
/// queue behind the rest. Copying every reply's rest instead cost `nbdcopy` a third
/// more server CPU.
const SLICE: Duration = Duration::from_millis(2);

/// Capacity of the queue kept once it is empty: enough for a few large replies
/// without allocating (fresh pages cost a fault each: a queue per reply made `nbdcopy`
/// fault 70,000 times per GiB), little to keep for an idle connection.
const RETAIN: usize = 16 << 20;

/// The sending half of a connection, shared by its reader, the workers answering its
/// requests, and its writer.
pub(super) struct Outbox {
    /// The socket (a clone of the connection's), or its TLS session.
    sink: Stream,
    state: Mutex<State>,
    /// Wakes the writer: a reply was queued, TLS records wait, or the connection ends.
    work: Condvar,
    /// Wakes the reader waiting for budget: replies went out.
    drained: Condvar,
    /// No more reads are started: the client hung up, or its replies cannot be delivered.
    abandoned: AtomicBool,
    watch: Arc<Watch>,
    max_inflight: u64,
    write_timeout: Duration,
}

struct State {
    /// Bytes charged for requests not answered yet: reads queued or being read, replies
    /// waiting in `queue`.
    inflight: u64,
    /// The bytes of the replies waiting, in order: one ring, reused.
    queue: VecDeque<u8>,
    /// The waiting replies: bytes left of each, and its charge.
    replies: VecDeque<(usize, u64)>,
    /// The reader is done: the writer stops once every answer is out.
    closing: bool,
    /// The socket failed or stalled: nothing more is sent.
    broken: bool,
    /// Since when the socket has taken nothing of what waits: the last bytes it took,
    /// or when something began to wait.
    since: Instant,
}

impl Outbox {
    pub fn new(
        sink: Stream,
        watch: Arc<Watch>,
        max_inflight: u64,
        write_timeout: Duration,
    ) -> Outbox {
        Outbox {
            sink,
            state: Mutex::new(State {
                inflight: 0,
                queue: VecDeque::new(),
                replies: VecDeque::new(),
                closing: false,
                broken: false,
                since: Instant::now(),
            }),
            work: Condvar::new(),
            drained: Condvar::new(),
            abandoned: AtomicBool::new(false),
            watch,
            max_inflight,
            write_timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// No reads should be started for this connection any more.
    pub fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Waits until `charge` more bytes fit the budget (a charge larger than the whole
    /// budget waits until nothing else is in flight), then takes them. A request is
    /// counted as in flight from here until its reply is out.
    pub fn reserve(&self, charge: u64) {
        self.watch.begin();
        let mut st = self.lock();
        while st.inflight > 0 && st.inflight + charge > self.max_inflight && !self.abandoned() {
            st = self.drained.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.inflight += charge;
    }

    /// A request's reply is out, or never will be: its charge is given back.
    fn finish(&self, st: &mut State, charge: u64) {
        st.inflight = st.inflight.saturating_sub(charge);
        self.watch.done();
        self.drained.notify_all();
        if st.closing && st.inflight == 0 {
            // The writer waits for the last answer before it lets the connection close.
            self.work.notify_all();
        }
    }

    /// A request that will get no reply (its client is gone).
    pub fn drop_reply(&self, charge: u64) {
        let mut st = self.lock();
        self.finish(&mut st, charge);
    }

    /// Sends one reply, the concatenation of `parts`, charged `charge` at
    /// [`reserve`](Self::reserve). Waits for the client for at most [`SLICE`], and
    /// only when no reply waits before this one.
    pub fn send(&self, parts: &[&[u8]], charge: u64) {
        let mut st = self.lock();
        if st.broken {
            return self.finish(&mut st, charge);
        }
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut written = 0;
        if st.queue.is_empty() {
            let start = Instant::now();
            st.since = start;
            loop {
                match self.write_now(&skip(parts, written)) {
                    Ok(n) => written += n,
                    Err(e) => {
                        self.fail(&mut st, &e);
                        return self.finish(&mut st, charge);
                    }
                }
                let left = SLICE.saturating_sub(start.elapsed());
                if written == total || left.is_zero() {
                    break;
                }
                // With the lock held, so that no other reply of this connection
                // overtakes this one's rest.
                wait_writable(self.sink.fd(), left);
            }
        }
        if written == total {
            self.finish(&mut st, charge);
            if self.tls_pending() {
                self.work.notify_one();
            }
            return;
        }
        for s in io_slices(parts, written) {
            st.queue.extend(&*s);
        }
        st.replies.push_back((total - written, charge));
        self.work.notify_one();
    }

    /// TLS records were buffered outside [`send`](Self::send) (the reader answering an
    /// alert or a key update): the writer sends them.
    pub fn kick(&self) {
        let _st = self.lock();
        self.work.notify_one();
    }

    /// The connection's reader is done: after DISC (`hung_up` false) every outstanding
    /// request is still answered; after a hang-up, reads not yet started are skipped.
    pub fn end(&self, hung_up: bool) {
        if hung_up {
            self.abandoned.store(true, Ordering::Relaxed);
        }
        let mut st = self.lock();
        st.closing = true;
        self.work.notify_all();
        self.drained.notify_all();
    }

    /// The writer thread: sends what waits as the socket drains, until the connection
    /// ends with nothing left to send, fails, or stalls for `write_timeout`.
    pub fn run_writer(&self) {
        let mut st = self.lock();
        loop {
            if st.broken {
                return;
            }
            if let Err(e) = self.drain(&mut st) {
                return self.fail(&mut st, &e);
            }
            if st.queue.is_empty() && !self.tls_pending() {
                if st.closing && st.inflight == 0 {
                    return;
                }
                st = self.work.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            let stalled = st.since.elapsed();
            if stalled >= self.write_timeout {
                let e = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the client read none of its replies for {:?}; disconnected",
                        self.write_timeout
                    ),
                );
                return self.fail(&mut st, &e);
            }
            drop(st);
            wait_writable(self.sink.fd(), self.write_timeout - stalled);
            st = self.lock();
        }
    }

    /// Writes as much of the queue as the socket takes now.
    fn drain(&self, st: &mut State) -> io::Result<()> {
        if st.queue.is_empty() {
            if let Stream::Tls(t) = &self.sink {
                t.write_now(&[])?;
            }
            return Ok(());
        }
        while !st.queue.is_empty() {
            let n = {
                let (a, b) = st.queue.as_slices();
                self.write_now(&[a, b])?
            };
            if n == 0 {
                break;
            }
            st.since = Instant::now();
            st.queue.drain(..n);
            let mut left = n;
            while left > 0 {
                let Some(front) = st.replies.front_mut() else {
                    break;
                };
                if left < front.0 {
                    front.0 -= left;
                    break;
                }
                left -= front.0;
                if let Some((_, charge)) = st.replies.pop_front() {
                    self.finish(st, charge);
                }
            }
        }
        if st.queue.is_empty() && st.queue.capacity() > RETAIN {
            st.queue.shrink_to(RETAIN);
        }
        Ok(())
    }

    /// Writes what the socket takes of `parts` without waiting; returns the bytes taken.
    fn write_now(&self, parts: &[&[u8]]) -> io::Result<usize> {
        if let Stream::Tls(t) = &self.sink {
            return t.write_now(parts);
        }
        let fd = self.sink.fd();
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut done = 0;
        while done < total {
            match send_now(fd, &io_slices(parts, done)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    fn tls_pending(&self) -> bool {
        match &self.sink {
            Stream::Tls(t) => t.pending(),
            _ => false,
        }
    }

    /// Replies cannot be delivered: drops them, stops the reads not yet started, and
    /// closes the connection, which ends its reader.
    fn fail(&self, st: &mut State, e: &io::Error) {
        if st.broken {
            return;
        }
        if e.kind() == io::ErrorKind::TimedOut {
            log::warn!("vabc serve: NBD connection {}: {e}", self.watch.id);
        } else {
            log::debug!("vabc serve: NBD connection {}: {e}", self.watch.id);
        }
        st.broken = true;
        self.abandoned.store(true, Ordering::Relaxed);
        // Its slot is free from now on, not once its threads are gone.
        self.watch.close();
        st.queue = VecDeque::new();
        while let Some((_, charge)) = st.replies.pop_front() {
            self.finish(st, charge);
        }
        self.work.notify_all();
        self.drained.notify_all();
    }
}

/// Waits until `fd` can be written, or `timeout` passes.
fn wait_writable(fd: std::os::fd::RawFd, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // Rounded up, so that the deadline has passed when it times out.
    let ms = timeout.as_millis().saturating_add(1).min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call. An error (EINTR) just
    // sends the caller round its loop again.
    unsafe { libc::poll(&mut pfd, 1, ms) };
}
