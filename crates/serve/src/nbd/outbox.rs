//! A connection's replies on their way out, so that the shared workers never wait for
//! one client's socket.
//!
//! A worker with a reply writes what the socket takes at once, without waiting
//! (`MSG_DONTWAIT`, or rustls' buffer for TLS); the reply goes out straight from the
//! worker's buffer when the client keeps up. What the socket does not take is copied to
//! the connection's queue, after any reply already waiting (replies go out whole, one
//! after another), and the connection's own writer thread sends it as the socket
//! drains. Only the writer ever waits for the client.
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
use super::tls::{io_slices, send_now};

/// Most replies handed to one `sendmsg`.
const BATCH: usize = 64;

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
    queue: VecDeque<Pending>,
    /// The reader is done: the writer stops once every answer is out.
    closing: bool,
    /// The socket failed or stalled: nothing more is sent.
    broken: bool,
    /// Since when the socket has taken nothing of what waits: the last bytes it took,
    /// or when something began to wait.
    since: Instant,
}

/// One reply, of which the socket has taken the first `at` bytes.
struct Pending {
    bytes: Vec<u8>,
    at: usize,
    charge: u64,
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
    /// [`reserve`](Self::reserve). Never waits for the client.
    pub fn send(&self, parts: &[&[u8]], charge: u64) {
        let mut st = self.lock();
        if st.broken {
            return self.finish(&mut st, charge);
        }
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut written = 0;
        if st.queue.is_empty() {
            st.since = Instant::now();
            match self.write_now(parts) {
                Ok(n) => written = n,
                Err(e) => {
                    self.fail(&mut st, &e);
                    return self.finish(&mut st, charge);
                }
            }
        }
        if written == total {
            self.finish(&mut st, charge);
            if self.tls_pending() {
                self.work.notify_one();
            }
            return;
        }
        let mut bytes = Vec::with_capacity(total - written);
        for s in io_slices(parts, written) {
            bytes.extend_from_slice(&s);
        }
        st.queue.push_back(Pending {
            bytes,
            at: 0,
            charge,
        });
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
                let parts: Vec<&[u8]> = st
                    .queue
                    .iter()
                    .take(BATCH)
                    .map(|p| &p.bytes[p.at..])
                    .collect();
                self.write_now(&parts)?
            };
            if n == 0 {
                break;
            }
            st.since = Instant::now();
            let mut left = n;
            while left > 0 {
                let Some(front) = st.queue.front_mut() else {
                    break;
                };
                let rest = front.bytes.len() - front.at;
                if left < rest {
                    front.at += left;
                    break;
                }
                left -= rest;
                if let Some(done) = st.queue.pop_front() {
                    self.finish(st, done.charge);
                }
            }
        }
        if st.queue.is_empty() && st.queue.capacity() > BATCH {
            st.queue.shrink_to(BATCH);
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
        while let Some(p) = st.queue.pop_front() {
            self.finish(st, p.charge);
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
