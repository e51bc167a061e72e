//! Who holds the server's connection slots, and for how long.
//!
//! A connection is *negotiating* from accept until the reply that ends its option
//! phase is written, then *transmitting*. The two are counted apart: at most
//! `max_connections` transmit (more are refused at accept, or at the end of their
//! negotiation), at most `max_handshakes` negotiate, and a connection arriving when
//! every negotiation slot is taken closes the one that has been negotiating longest.
//! So idle sockets cannot lock anyone out: a client that negotiates promptly (a few
//! round trips) loses its slot only if `max_handshakes` newer connections arrive in
//! that time, and each idle socket is closed anyway once `handshake_timeout` has
//! passed since it was accepted (the TLS handshake included). A timeout alone would
//! not do: a flood of idle sockets would hold every slot for as long as the timeout,
//! again and again.
//!
//! A transmitting TCP connection with no request in flight (every reply written) for
//! `idle_timeout` is closed. Unix sockets are exempt: only who the socket's mode lets
//! in can reach them, and the kernel's `nbd-client` holds a device through one for as
//! long as it is attached, sending nothing while the device is idle.
//!
//! The accept loop enforces the deadlines between accepts ([`Slots::reap`]): a
//! connection past one has its socket shut down, which ends whatever its threads were
//! waiting for.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Stream;

const NEGOTIATING: u8 = 0;
const TRANSMITTING: u8 = 1;
/// Closed by the server (evicted or timed out); its threads are on their way out.
const CLOSED: u8 = 2;

/// The limits [`Slots`] enforces (from [`super::NbdOptions`]).
#[derive(Clone, Debug)]
pub(super) struct Limits {
    pub max_connections: usize,
    pub max_handshakes: usize,
    pub handshake_timeout: Duration,
    pub idle_timeout: Option<Duration>,
}

/// One connection as the accept loop sees it.
pub(super) struct Watch {
    pub id: u64,
    /// A clone of the socket: shutting it down ends the connection's threads.
    sock: Stream,
    tcp: bool,
    accepted: Instant,
    phase: AtomicU8,
    /// The handshake deadline applies: the option phase's last reply is not yet out.
    negotiating: AtomicBool,
    /// Requests received whose reply is not yet written (or dropped).
    busy: AtomicU64,
    /// When `busy` last changed, in ms since the server's epoch.
    last: AtomicU64,
    epoch: Instant,
}

impl Watch {
    /// A connection accepted just now; `sock` is a clone of its socket.
    pub fn new(id: u64, sock: Stream, epoch: Instant) -> Watch {
        Watch {
            id,
            tcp: matches!(sock, Stream::Tcp(_)),
            sock,
            accepted: Instant::now(),
            phase: AtomicU8::new(NEGOTIATING),
            negotiating: AtomicBool::new(true),
            busy: AtomicU64::new(0),
            last: AtomicU64::new(0),
            epoch,
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A request arrived.
    pub fn begin(&self) {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self.last.store(self.now_ms(), Ordering::Relaxed);
    }

    /// A request's reply is written (or will never be).
    pub fn done(&self) {
        self.last.store(self.now_ms(), Ordering::Relaxed);
        self.busy.fetch_sub(1, Ordering::Relaxed);
    }

    /// The option phase's last reply is written: the handshake deadline no longer applies.
    pub fn negotiated(&self) {
        self.negotiating.store(false, Ordering::Relaxed);
    }

    fn phase(&self) -> u8 {
        self.phase.load(Ordering::Relaxed)
    }

    /// Shuts the connection down from outside.
    pub fn close(&self) {
        self.phase.store(CLOSED, Ordering::Relaxed);
        self.sock.shutdown();
    }
}

/// The live connections of a server and their limits.
pub(super) struct Slots {
    limits: Limits,
    pub epoch: Instant,
    conns: Mutex<Vec<Arc<Watch>>>,
}

impl Slots {
    pub fn new(limits: Limits) -> Slots {
        Slots {
            limits,
            epoch: Instant::now(),
            conns: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Arc<Watch>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count(conns: &[Arc<Watch>], phase: u8) -> usize {
        conns.iter().filter(|w| w.phase() == phase).count()
    }

    /// Takes in a connection just accepted, unless every transmission slot is taken;
    /// makes room among the negotiating ones if needed.
    pub fn admit(&self, w: Arc<Watch>) -> bool {
        let mut conns = self.lock();
        if Self::count(&conns, TRANSMITTING) >= self.limits.max_connections {
            return false;
        }
        if Self::count(&conns, NEGOTIATING) >= self.limits.max_handshakes.max(1)
            && let Some(oldest) = conns
                .iter()
                .filter(|w| w.phase() == NEGOTIATING)
                .min_by_key(|w| w.accepted)
        {
            log::debug!(
                "vabc serve: NBD connection {}: still negotiating after {:?}, closed for a newer one",
                oldest.id,
                oldest.accepted.elapsed()
            );
            oldest.close();
        }
        conns.push(w);
        true
    }

    /// A connection at the end of its option phase takes a transmission slot: false
    /// when none is free, or when it was closed meanwhile.
    pub fn transmit(&self, w: &Watch) -> bool {
        let conns = self.lock();
        if w.phase() != NEGOTIATING
            || Self::count(&conns, TRANSMITTING) >= self.limits.max_connections
        {
            return false;
        }
        w.last.store(w.now_ms(), Ordering::Relaxed);
        w.phase.store(TRANSMITTING, Ordering::Relaxed);
        true
    }

    /// The connection's threads are done.
    pub fn remove(&self, id: u64) {
        self.lock().retain(|w| w.id != id);
    }

    /// Shuts down every connection (the server stops).
    pub fn close_all(&self) {
        for w in self.lock().iter() {
            w.close();
        }
    }

    /// Closes the connections past their handshake deadline and the TCP connections
    /// idle for too long; returns how long until the next deadline may pass.
    pub fn reap(&self) -> Option<Duration> {
        let mut next: Option<Duration> = None;
        let mut sooner = |d: Duration| next = Some(next.map_or(d, |n| n.min(d)));
        for w in self.lock().iter() {
            let phase = w.phase();
            if phase == CLOSED {
                continue;
            }
            if w.negotiating.load(Ordering::Relaxed) {
                let left = self
                    .limits
                    .handshake_timeout
                    .saturating_sub(w.accepted.elapsed());
                if left.is_zero() {
                    log::debug!(
                        "vabc serve: NBD connection {}: no handshake within {:?}; closed",
                        w.id,
                        self.limits.handshake_timeout
                    );
                    w.close();
                    continue;
                }
                sooner(left);
            }
            let Some(idle) = self.limits.idle_timeout else {
                continue;
            };
            if phase != TRANSMITTING || !w.tcp {
                continue;
            }
            if w.busy.load(Ordering::Relaxed) > 0 {
                // Idle from its last reply at the earliest, so not before `idle` from now.
                sooner(idle);
                continue;
            }
            let quiet =
                Duration::from_millis(w.now_ms().saturating_sub(w.last.load(Ordering::Relaxed)));
            let left = idle.saturating_sub(quiet);
            if left.is_zero() {
                log::info!(
                    "vabc serve: NBD connection {}: no request for {idle:?}; closed",
                    w.id
                );
                w.close();
            } else {
                sooner(left);
            }
        }
        next
    }
}
