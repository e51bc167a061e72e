//! A read-only NBD server (NetworkBlockDevice `doc/proto.md`): fixed newstyle handshake,
//! `OPT_EXPORT_NAME`/`ABORT`/`LIST`/`INFO`/`GO`, `OPT_STRUCTURED_REPLY` and
//! `OPT_LIST`/`SET_META_CONTEXT` for the `base:allocation` context (others answered
//! `ERR_UNSUP`), transmission with `READ`, `BLOCK_STATUS`, `FLUSH`, `DISC`; writes, trims
//! and write-zeroes fail with `EPERM`.
//!
//! With structured replies, a READ is answered with one `OFFSET_DATA` chunk (or an
//! `ERROR` chunk). `BLOCK_STATUS` reports [`BlockDevice::allocation`]: ZERO ops and the
//! base's holes where no op writes come out as `HOLE | ZERO`, which `nbdcopy` and
//! `qemu-img convert` skip reading and `nbdinfo --map` shows. A verified export reports
//! all of it as data, since a client skipping a run would skip its check.
//!
//! One thread per connection parses requests and hands reads to a shared [`Workers`]
//! pool, which answers each as soon as it is ready (replies may be out of order;
//! clients match them by cookie), so one connection keeps many reads in flight. A client
//! that reads sequentially with few requests in flight is read ahead of, as the FUSE
//! export is ([`engine::Readahead`], shared by all connections): `nbdcopy` with one
//! 1 MiB request at a time copied a cold 1 GiB image in 0.59-0.67 s instead of 1.64 s.
//! Requests waiting for a worker are counted into it, so that it steps aside for
//! clients that keep many requests outstanding.
//!
//! # What a hostile network can do
//!
//! NBD has no authentication of its own, so the server assumes a client may be an
//! attacker that wants to stop the others or read what it should not.
//!
//! * **Holding slots.** A connection must finish its option phase (TLS handshake
//!   included) within [`NbdOptions::handshake_timeout`]; negotiating connections have
//!   their own slots ([`NbdOptions::max_handshakes`]), and when those are full a new
//!   connection closes the one negotiating longest, so a flood of idle sockets delays a
//!   prompt client by no more than its own handshake (`slots` says why a timeout alone
//!   would not do). At most [`NbdOptions::max_connections`] connections transmit; one over
//!   TCP with no request in flight for [`NbdOptions::idle_timeout`] is closed.
//! * **Not reading.** No worker waits on a client's socket for more than a short slice
//!   (2 ms, and only when no earlier reply of that connection waits): what the socket
//!   does not take by then waits in that connection's queue for its own writer thread
//!   (`outbox`). The queue is bounded by the connection's budget,
//!   [`NbdOptions::max_inflight_bytes`] of reads queued, being read or waiting to be
//!   sent (the connection's reader stops taking requests until replies drain, which
//!   pushes back on the client through the socket), so a slow client is slowed, not
//!   dropped; a client whose socket takes nothing for [`NbdOptions::write_timeout`] is
//!   disconnected, its queued replies and unstarted reads dropped. A client that hangs
//!   up has its queued reads dropped unread.
//! * **Reading what it should not.** A Unix socket is created with mode 0600 (owner
//!   only) unless asked otherwise. Over TCP, TLS ([`NbdOptions::tls`], rustls) is
//!   required of every client once configured (`NBD_OPT_STARTTLS`, as `qemu-nbd
//!   --tls-creds` does; nothing, not even the export size, is sent in the clear), and
//!   with a client CA ([`tls_config`]) only clients holding a certificate it issued get
//!   past the TLS handshake. A TCP listener on a wildcard address without TLS is warned
//!   about.

mod outbox;
mod slots;
mod tls;
mod wire;

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use engine::{BlockDevice, HUGE_PAGE, ReadaheadOptions};
use zerocopy::big_endian::{U16, U32, U64};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::workers::Workers;
use crate::{DevReadahead, Result, ServeError, io_err, read_then, readahead_for};
use outbox::Outbox;
use slots::{Limits, Slots, Watch};
use tls::TlsStream;
pub use tls::{TlsConfig, tls_config};
use wire::{
    BlockDescriptor, ErrorPayload, ExportNameReply, Greeting, InfoBlockSize, InfoExport,
    OptionReply, OptionRequest, Request, SimpleReply, StructuredReply,
};

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const IHAVEOPT: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
const FLAG_C_NO_ZEROES: u32 = 2;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_STARTTLS: u32 = 5;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;

const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

const TFLAG_HAS_FLAGS: u16 = 1 << 0;
const TFLAG_READ_ONLY: u16 = 1 << 1;
const TFLAG_SEND_FLUSH: u16 = 1 << 2;
const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;
const CMD_BLOCK_STATUS: u16 = 7;
/// BLOCK_STATUS: one descriptor is enough.
const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

const REPLY_FLAG_DONE: u16 = 1;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// The one metadata context: which runs read as zeros with nothing stored
/// ([`BlockDevice::allocation`]).
const BASE_ALLOCATION: &[u8] = b"base:allocation";
/// Its id on every connection.
const BASE_ALLOCATION_ID: u32 = 1;
const STATE_HOLE: u32 = 1;
const STATE_ZERO: u32 = 2;
/// Most descriptors in one BLOCK_STATUS reply; a client asks again for the rest.
const MAX_DESCRIPTORS: usize = 1 << 16;

/// Largest option payload we accept before dropping the client.
const MAX_OPTION_LEN: u32 = 64 << 10;
/// Largest read request; advertised as the maximum block size.
pub const MAX_REQUEST: u32 = 32 << 20;
/// The engine serves any alignment, so the minimum block size is 1.
const PREFERRED_BLOCK: u32 = 4096;

/// Where the server listens: `unix:PATH` or `tcp:HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NbdAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl FromStr for NbdAddr {
    type Err = ServeError;
    fn from_str(s: &str) -> Result<NbdAddr> {
        let bad = |msg: &str| ServeError::Address {
            addr: s.to_string(),
            msg: msg.to_string(),
        };
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(bad("empty socket path"));
            }
            Ok(NbdAddr::Unix(PathBuf::from(p)))
        } else if let Some(a) = s.strip_prefix("tcp:") {
            a.parse()
                .map(NbdAddr::Tcp)
                .map_err(|_| bad("expected tcp:IP:PORT, e.g. tcp:127.0.0.1:10809"))
        } else {
            Err(bad("expected unix:PATH or tcp:IP:PORT"))
        }
    }
}

impl std::fmt::Display for NbdAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NbdAddr::Unix(p) => write!(f, "nbd+unix:///?socket={}", p.display()),
            NbdAddr::Tcp(a) => write!(f, "nbd://{a}/"),
        }
    }
}

/// Options of [`NbdServer::bind`].
/// Options of [`NbdServer::bind`].
#[derive(Clone, Debug)]
pub struct NbdOptions {
    /// Export name; clients asking for "" get it too.
    pub export_name: String,
    /// Request threads shared by all connections.
    pub workers: usize,
    /// Read ahead of sequential streams, shared by all connections (a client reading
    /// one request at a time waits for each before it sends the next); `None`
    /// disables it.
    pub readahead: Option<ReadaheadOptions>,
    /// Where the time of each READ, from its arrival to its reply (handed to the socket
    /// or queued for it), is recorded.
    pub latency: Arc<trace::Histogram>,
    /// Connections transmitting at once; more are closed as they arrive, or as they
    /// finish negotiating.
    pub max_connections: usize,
    /// Connections negotiating at once; a new one closes the one negotiating longest.
    pub max_handshakes: usize,
    /// Time from accept to the end of the option phase (TLS handshake included).
    pub handshake_timeout: Duration,
    /// A TCP connection with no request in flight for this long is closed; `None`:
    /// never. Unix sockets are exempt (the kernel's `nbd-client` holds an idle device
    /// through one for as long as it is attached).
    pub idle_timeout: Option<Duration>,
    /// A connection whose socket takes none of its waiting replies for this long is
    /// closed.
    pub write_timeout: Duration,
    /// Bytes one connection may have in flight: reads queued or being read and replies
    /// not yet taken by its socket, each reply charged its size plus [`REPLY_COST`] (a
    /// single larger request is still served, alone).
    pub max_inflight_bytes: u64,
    /// Permissions of a Unix socket.
    pub socket_mode: u32,
    /// TLS for TCP clients (`NBD_OPT_STARTTLS`), required of every client when set.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            export_name: "vabc".into(),
            workers: 16,
            readahead: Some(ReadaheadOptions::default()),
            latency: Arc::default(),
            max_connections: 16,
            max_handshakes: 16,
            // Negotiation is a few round trips; 10 s leaves room for a slow link.
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Some(Duration::from_secs(300)),
            write_timeout: Duration::from_secs(30),
            // Replies waiting for a slow client count here, so this is also the memory
            // one connection can hold. 16 reads of 1 MiB per connection keep the 16
            // workers busy (nbdcopy at its defaults copied a 1 GiB image as fast as
            // with 128 MiB); a request of MAX_REQUEST is served alone.
            max_inflight_bytes: 16 << 20,
            socket_mode: 0o600,
            tls: None,
        }
    }
}

/// Charged to a connection's budget for each reply on top of its payload: its header
/// and what queueing it costs, so that many tiny replies are bounded too.
pub const REPLY_COST: u64 = 128;

enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
    /// After STARTTLS. Shared by the connection's reader and the threads writing its
    /// replies: one TLS session, whose state a mutex guards.
    Tls(Arc<TlsStream>),
}

impl Stream {
    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Tls(t) => Stream::Tls(t.clone()),
        })
    }
    fn fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Tls(t) => t.sock.as_raw_fd(),
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Tls(t) => t.sock.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

/// Blocking writes: the option phase, whose time the handshake deadline bounds.
impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Tls(t) => t.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The transmission phase's reads, which wake the connection's writer when reading left
/// TLS records to send (an alert, a key update).
struct Incoming<'a> {
    s: &'a mut Stream,
    out: &'a Outbox,
}

impl Read for Incoming<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.s.read(buf)?;
        if let Stream::Tls(t) = &*self.s
            && t.pending()
        {
            self.out.kick();
        }
        Ok(n)
    }
}

/// A transmitting connection as its workers see it.
struct Conn {
    out: Outbox,
    /// The client asked for structured replies: READs must get them.
    structured: bool,
}

impl Conn {
    /// A simple reply.
    fn reply(&self, cookie: u64, error: u32, data: &[u8], charge: u64) {
        let hdr = SimpleReply {
            magic: U32::new(SIMPLE_REPLY_MAGIC),
            error: U32::new(error),
            cookie: U64::new(cookie),
        };
        self.out.send(&[hdr.as_bytes(), data], charge);
    }

    /// The one (final) chunk of a structured reply, of payload `a` then `b`.
    fn chunk(&self, cookie: u64, kind: u16, a: &[u8], b: &[u8], charge: u64) {
        let len = a.len() + b.len();
        let hdr = StructuredReply {
            magic: U32::new(STRUCTURED_REPLY_MAGIC),
            flags: U16::new(REPLY_FLAG_DONE),
            kind: U16::new(kind),
            cookie: U64::new(cookie),
            // Payloads are at most MAX_REQUEST plus a header, or MAX_DESCRIPTORS * 8.
            length: U32::new(len as u32),
        };
        self.out.send(&[hdr.as_bytes(), a, b], charge);
    }

    /// An error, structured if the client asked for structured replies.
    fn error(&self, cookie: u64, error: u32, charge: u64) {
        if self.structured {
            let p = ErrorPayload {
                error: U32::new(error),
                message_length: U16::new(0),
            };
            self.chunk(cookie, REPLY_TYPE_ERROR, p.as_bytes(), &[], charge);
        } else {
            self.reply(cookie, error, &[], charge);
        }
    }

    /// The reply to a READ of `data.len()` bytes at `offset`, or its error.
    fn read_reply(&self, cookie: u64, offset: u64, error: u32, data: &[u8], charge: u64) {
        match (self.structured, error) {
            (false, _) => self.reply(cookie, error, if error == 0 { data } else { &[] }, charge),
            (true, 0) if data.is_empty() => self.chunk(cookie, REPLY_TYPE_NONE, &[], &[], charge),
            (true, 0) => self.chunk(
                cookie,
                REPLY_TYPE_OFFSET_DATA,
                U64::new(offset).as_bytes(),
                data,
                charge,
            ),
            (true, e) => self.error(cookie, e, charge),
        }
    }

    /// A simple reply without data from the connection's reader, which may wait for
    /// budget.
    fn answer(&self, cookie: u64, error: u32) {
        self.out.reserve(REPLY_COST);
        self.reply(cookie, error, &[], REPLY_COST);
    }
}

struct ReadJob {
    conn: Arc<Conn>,
    cookie: u64,
    offset: u64,
    len: u32,
    /// What the request took of the connection's budget, given back with its reply.
    charge: u64,
    received: std::time::Instant,
}

struct Shared {
    dev: Arc<dyn BlockDevice>,
    /// The read-ahead the workers read through, told how many reads wait for a worker.
    readahead: Option<Arc<DevReadahead>>,
    opts: NbdOptions,
    workers: Workers<ReadJob>,
    stop: AtomicBool,
    /// Live connections: their slots, deadlines, and sockets to shut down on stop.
    slots: Slots,
}

impl Shared {
    /// The state every connection of a server shares, with its read workers
    /// (`what` names the server in errors).
    fn new(dev: Arc<dyn BlockDevice>, opts: &NbdOptions, what: &str) -> Result<Shared> {
        let readahead = readahead_for(&dev, opts.readahead.as_ref(), what)?;
        let workers = {
            let dev = dev.clone();
            let latency = opts.latency.clone();
            let readahead = readahead.clone();
            // A huge page per worker, not 1 MiB of heap: base reads land in it straight
            // (O_DIRECT), and a physically contiguous buffer takes a few of the virtio
            // disk's ring descriptors instead of one per 4 KiB page. `nbdcopy` with 1 MiB
            // requests (4 connections × 64) copied a cold 1 GiB ~25% faster.
            Workers::spawn(
                "vabc-nbd",
                opts.workers,
                HUGE_PAGE,
                move |buf, job: ReadJob| {
                    if let Some(ra) = &readahead {
                        ra.queued().fetch_sub(1, Ordering::Relaxed);
                    }
                    if job.conn.out.abandoned() {
                        // Nobody to answer: do not read for a client that is gone.
                        return job.conn.out.drop_reply(job.charge);
                    }
                    let out = buf.slice_mut(job.len as usize);
                    let _span = trace::spans::span("nbd read", job.offset, u64::from(job.len));
                    let result = read_then(&*dev, readahead.as_deref(), out, job.offset, |data| {
                        job.conn
                            .read_reply(job.cookie, job.offset, 0, data, job.charge)
                    });
                    if let Err(e) = result {
                        log::warn!(
                            "vabc serve: NBD read of {} bytes at offset {}: {e}",
                            job.len,
                            job.offset
                        );
                        job.conn.read_reply(
                            job.cookie,
                            job.offset,
                            e.errno() as u32,
                            &[],
                            job.charge,
                        );
                    }
                    latency.record_since(job.received);
                },
            )
            .map_err(io_err("spawn NBD workers for", what))?
        };
        let slots = Slots::new(Limits {
            max_connections: opts.max_connections,
            max_handshakes: opts.max_handshakes,
            handshake_timeout: opts.handshake_timeout,
            idle_timeout: opts.idle_timeout,
        });
        Ok(Shared {
            dev,
            readahead,
            opts: opts.clone(),
            workers,
            stop: AtomicBool::new(false),
            slots,
        })
    }
}

/// A bound NBD server; [`spawn`](Self::spawn) starts accepting.
pub struct NbdServer {
    listener: Listener,
    addr: NbdAddr,
    shared: Arc<Shared>,
}

/// A running server; dropping it stops accepting, closes connections and joins threads.
pub struct NbdHandle {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    wake: RawFd,
    socket_path: Option<PathBuf>,
}

impl NbdServer {
    /// Binds the listening socket. A Unix socket path must not exist, unless it is a
    /// stale socket nobody listens on any more (left by a killed server): that is removed.
    pub fn bind(addr: &NbdAddr, dev: Arc<dyn BlockDevice>, opts: &NbdOptions) -> Result<NbdServer> {
        let listener = match addr {
            NbdAddr::Unix(path) => {
                remove_stale_socket(path)?;
                // Created owner-only whatever the umask, so that no other user can
                // connect between bind and chmod; then given the mode asked for.
                // SAFETY: umask has no preconditions; it is restored right after.
                let old = unsafe { libc::umask(0o177) };
                let bound = UnixListener::bind(path);
                // SAFETY: as above.
                unsafe { libc::umask(old) };
                let l = bound.map_err(io_err("bind NBD socket", path))?;
                if opts.socket_mode != 0o600 {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(
                        path,
                        std::fs::Permissions::from_mode(opts.socket_mode),
                    )
                    .map_err(io_err("set the mode of NBD socket", path))?;
                }
                Listener::Unix(l, path.clone())
            }
            NbdAddr::Tcp(a) => {
                if a.ip().is_unspecified() && opts.tls.is_none() {
                    log::warn!(
                        "vabc serve: warning: NBD on {a} accepts connections on every \
                         network interface, without authentication or encryption: anyone \
                         who can reach this host can read the image"
                    );
                }
                Listener::Tcp(
                    TcpListener::bind(a).map_err(io_err("bind NBD address", a.to_string()))?,
                )
            }
        };
        let addr = match &listener {
            Listener::Tcp(l) => {
                NbdAddr::Tcp(l.local_addr().map_err(io_err("query", "NBD socket"))?)
            }
            Listener::Unix(..) => addr.clone(),
        };
        let shared = Shared::new(dev, opts, &addr.to_string())?;
        Ok(NbdServer {
            listener,
            addr,
            shared: Arc::new(shared),
        })
    }

    /// The bound address (with the real port for `tcp:…:0`).
    pub fn addr(&self) -> &NbdAddr {
        &self.addr
    }

    /// Starts the accept loop on a background thread.
    pub fn spawn(self) -> Result<NbdHandle> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the 2-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
            return Err(io_err("create wake pipe for", self.addr.to_string())(
                io::Error::last_os_error(),
            ));
        }
        let shared = self.shared.clone();
        let socket_path = match &self.listener {
            Listener::Unix(_, p) => Some(p.clone()),
            Listener::Tcp(_) => None,
        };
        let wake_read = fds[0];
        let thread = std::thread::Builder::new()
            .name("vabc-nbd-accept".into())
            .spawn(move || accept_loop(self.listener, self.shared, wake_read))
            .map_err(io_err("spawn NBD accept thread for", "socket"))?;
        Ok(NbdHandle {
            shared,
            thread: Some(thread),
            wake: fds[1],
            socket_path,
        })
    }
}

/// Asks for a Unix socket send buffer that takes a whole large reply (the default,
/// 208 KiB, takes a fifth of a 1 MiB one), so that a worker sends it in one go rather
/// than leaving the rest to be copied to the connection's queue: with 1 MiB requests,
/// that copy was a quarter of the server's CPU time. The kernel caps it at
/// `net.core.wmem_max`; TCP sockets size theirs themselves.
fn widen_send_buffer(s: &UnixStream) {
    let size: libc::c_int = 4 << 20;
    // SAFETY: setsockopt reads `size`, a live c_int, for the length given; the fd is
    // an open socket that `s` owns.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&raw const size).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

fn remove_stale_socket(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(ServeError::Invalid {
            path: path.to_path_buf(),
            msg: "exists and is not a socket; refusing to replace it".into(),
        });
    }
    if UnixStream::connect(path).is_ok() {
        return Err(ServeError::Busy {
            path: path.to_path_buf(),
        });
    }
    std::fs::remove_file(path).map_err(io_err("remove stale socket", path))
}

fn accept_loop(listener: Listener, shared: Arc<Shared>, wake: RawFd) {
    let lfd = match &listener {
        Listener::Unix(l, _) => l.as_raw_fd(),
        Listener::Tcp(l) => l.as_raw_fd(),
    };
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    while !shared.stop.load(Ordering::Acquire) {
        // Deadlines are enforced here, between accepts: sleep no longer than to the next.
        let timeout = shared.slots.reap().map_or(-1, |d| {
            // Rounded up, so that the deadline has passed when it times out.
            d.as_millis().saturating_add(1).min(i32::MAX as u128) as i32
        });
        let mut pfd = [
            libc::pollfd {
                fd: lfd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: pfd is a valid array of 2 pollfd structs for the duration of the call.
        let rc = unsafe { libc::poll(pfd.as_mut_ptr(), 2, timeout) };
        if rc <= 0 || pfd[1].revents != 0 {
            continue; // a deadline, EINTR, or woken to stop: the loop decides
        }
        let stream = match &listener {
            Listener::Unix(l, _) => l.accept().map(|(s, _)| {
                widen_send_buffer(&s);
                Stream::Unix(s)
            }),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }),
        };
        let Ok(stream) = stream else { continue };
        threads.retain(|t| !t.is_finished());
        let id = next_id;
        next_id += 1;
        let Ok(sock) = stream.try_clone() else {
            stream.shutdown();
            continue;
        };
        let watch = Arc::new(Watch::new(id, sock, shared.slots.epoch));
        if !shared.slots.admit(watch.clone()) {
            log::warn!(
                "vabc serve: NBD: {} connections already; refusing another",
                shared.opts.max_connections
            );
            stream.shutdown();
            continue;
        }
        let sh = shared.clone();
        match std::thread::Builder::new()
            .name(format!("vabc-nbd-conn-{id}"))
            .spawn(move || {
                // Clients that hang up mid-handshake (probes, `nbdinfo --list`) are normal,
                // and so are connections the server closed (timed out, evicted).
                if let Err(e) = serve_connection(&sh, stream, &watch)
                    && !sh.stop.load(Ordering::Relaxed)
                    && !matches!(
                        e.kind(),
                        io::ErrorKind::BrokenPipe
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::UnexpectedEof
                            | io::ErrorKind::NotConnected
                    )
                {
                    log::warn!("vabc serve: NBD connection {id}: {e}");
                }
                sh.slots.remove(id);
            }) {
            Ok(t) => threads.push(t),
            Err(e) => {
                log::warn!("vabc serve: cannot start NBD connection thread: {e}");
                shared.slots.remove(id);
            }
        }
    }
    shared.slots.close_all();
    for t in threads {
        let _ = t.join();
    }
    // SAFETY: closing the read end of our own pipe, which nothing else uses.
    unsafe { libc::close(wake) };
    if let Listener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
}

impl NbdHandle {
    /// Stops accepting, disconnects clients and waits for all threads.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(t) = self.thread.take() else { return };
        self.shared.stop.store(true, Ordering::Release);
        // SAFETY: writing one byte from a live buffer to our pipe's write end.
        unsafe {
            libc::write(self.wake, [1u8].as_ptr().cast(), 1);
        }
        let _ = t.join();
        // SAFETY: closing our own pipe write end once; `thread` is None from now on.
        unsafe { libc::close(self.wake) };
        if let Some(p) = &self.socket_path {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for NbdHandle {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

/// Reads one wire struct or value.
fn read_wire<T: FromBytes + IntoBytes>(r: &mut impl Read) -> io::Result<T> {
    let mut t = T::new_zeroed();
    r.read_exact(t.as_mut_bytes())?;
    Ok(t)
}

fn protocol(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn option_reply(w: &mut impl Write, opt: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let hdr = OptionReply {
        magic: U64::new(OPT_REPLY_MAGIC),
        option: U32::new(opt),
        reply_type: U32::new(kind),
        length: U32::new(data.len() as u32),
    };
    let mut m = Vec::with_capacity(size_of::<OptionReply>() + data.len());
    m.extend_from_slice(hdr.as_bytes());
    m.extend_from_slice(data);
    w.write_all(&m)
}

fn transmission_flags() -> u16 {
    TFLAG_HAS_FLAGS | TFLAG_READ_ONLY | TFLAG_SEND_FLUSH | TFLAG_CAN_MULTI_CONN
}

/// What a client chose in the option phase.
#[derive(Clone, Copy, Debug, Default)]
struct Session {
    structured: bool,
    /// `base:allocation` selected: BLOCK_STATUS answers.
    allocation: bool,
}

/// Outcome of the option phase.
enum Negotiated {
    Transmit(Session),
    Closed,
}

/// The export name and the queries of a LIST/SET_META_CONTEXT request, if well formed.
fn parse_meta_request(data: &[u8]) -> Option<(&[u8], Vec<&[u8]>)> {
    let u32_at = |at: usize| -> Option<usize> {
        let (v, _) = U32::read_from_prefix(data.get(at..)?).ok()?;
        Some(v.get() as usize)
    };
    let nlen = u32_at(0)?;
    let name = data.get(4..4usize.checked_add(nlen)?)?;
    let mut at = 4 + nlen;
    let n = u32_at(at)?;
    at += 4;
    let mut queries = Vec::new();
    for _ in 0..n {
        let qlen = u32_at(at)?;
        queries.push(data.get(at + 4..(at + 4).checked_add(qlen)?)?);
        at += 4 + qlen;
    }
    (at == data.len()).then_some((name, queries))
}

/// Takes a transmission slot for a client ending its option phase; false (logged) when
/// every slot is taken or the connection was closed meanwhile.
fn take_slot(sh: &Shared, watch: &Watch) -> bool {
    let ok = sh.slots.transmit(watch);
    if !ok {
        log::warn!(
            "vabc serve: NBD connection {}: {} connections transmit already; refused",
            watch.id,
            sh.opts.max_connections
        );
    }
    ok
}

fn handshake(sh: &Shared, s: &mut Stream, watch: &Watch) -> io::Result<Negotiated> {
    s.write_all(&greeting())?;
    let cflags = read_wire::<U32>(s)?.get();
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(protocol(format!("unknown client flags {cflags:#x}")));
    }
    let mut h = Handshake {
        sh,
        watch,
        size: sh.dev.size(),
        no_zeroes: cflags & FLAG_C_NO_ZEROES != 0,
        session: Session::default(),
        // With TLS configured, nothing but STARTTLS (or ABORT) before the session is
        // encrypted: not even the export's size.
        need_tls: sh.opts.tls.is_some(),
    };
    loop {
        let (opt, data) = read_option(s)?;
        if h.need_tls && !matches!(opt, OPT_STARTTLS | OPT_ABORT) {
            if opt == OPT_EXPORT_NAME {
                return Err(protocol(
                    "EXPORT_NAME before STARTTLS; TLS is required".into(),
                ));
            }
            option_reply(s, opt, REP_ERR_TLS_REQD, b"TLS is required: STARTTLS first")?;
            continue;
        }
        let step = match opt {
            OPT_STARTTLS => h.starttls(s, &data)?,
            OPT_EXPORT_NAME => h.export_name(s, &data)?,
            OPT_ABORT => {
                let _ = option_reply(s, opt, REP_ACK, &[]);
                Some(Negotiated::Closed)
            }
            OPT_LIST => h.list(s, &data)?,
            OPT_INFO | OPT_GO => h.info_or_go(s, opt, &data)?,
            OPT_STRUCTURED_REPLY => {
                if data.is_empty() {
                    h.session.structured = true;
                    option_reply(s, opt, REP_ACK, &[])?;
                } else {
                    option_reply(s, opt, REP_ERR_INVALID, b"STRUCTURED_REPLY takes no data")?;
                }
                None
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => h.meta_context(s, opt, &data)?,
            _ => {
                option_reply(s, opt, REP_ERR_UNSUP, &[])?;
                None
            }
        };
        if let Some(done) = step {
            return Ok(done);
        }
    }
}

/// One option request: its number and data. The magic is checked before the rest is
/// waited for: a client speaking something else is dropped at once.
fn read_option(s: &mut Stream) -> io::Result<(u32, Vec<u8>)> {
    let mut req = OptionRequest::new_zeroed();
    let rest = std::mem::offset_of!(OptionRequest, option);
    s.read_exact(&mut req.as_mut_bytes()[..rest])?;
    let magic = req.magic.get();
    if magic != IHAVEOPT {
        return Err(protocol(format!("bad option magic {magic:#x}")));
    }
    s.read_exact(&mut req.as_mut_bytes()[rest..])?;
    let (opt, len) = (req.option.get(), req.length.get());
    if len > MAX_OPTION_LEN {
        return Err(protocol(format!("option {opt} of {len} bytes is too long")));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((opt, data))
}

/// The option haggling of one connection. Each option's handler answers it and
/// returns how the handshake ended, or `None` to go on.
struct Handshake<'a> {
    sh: &'a Shared,
    watch: &'a Watch,
    size: u64,
    no_zeroes: bool,
    session: Session,
    need_tls: bool,
}

impl Handshake<'_> {
    fn name_ok(&self, n: &[u8]) -> bool {
        n.is_empty() || n == self.sh.opts.export_name.as_bytes()
    }

    fn starttls(&mut self, s: &mut Stream, data: &[u8]) -> io::Result<Option<Negotiated>> {
        let opt = OPT_STARTTLS;
        let config = match (&self.sh.opts.tls, &*s) {
            (Some(c), Stream::Tcp(_)) if data.is_empty() => c.clone(),
            (Some(_), Stream::Tcp(_)) => {
                option_reply(s, opt, REP_ERR_INVALID, b"STARTTLS takes no data")?;
                return Ok(None);
            }
            (Some(_), _) => {
                option_reply(s, opt, REP_ERR_INVALID, b"TLS is already on")?;
                return Ok(None);
            }
            (None, _) => {
                option_reply(s, opt, REP_ERR_UNSUP, b"this server has no TLS")?;
                return Ok(None);
            }
        };
        option_reply(s, opt, REP_ACK, &[])?;
        let Stream::Tcp(tcp) = &*s else {
            return Err(protocol("STARTTLS on a stream that is not TCP".into()));
        };
        let tls = TlsStream::accept(tcp.try_clone()?, config)?;
        *s = Stream::Tls(Arc::new(tls));
        self.need_tls = false;
        Ok(None)
    }

    fn export_name(&mut self, s: &mut Stream, data: &[u8]) -> io::Result<Option<Negotiated>> {
        if !self.name_ok(data) {
            return Err(protocol(format!(
                "unknown export {:?}",
                String::from_utf8_lossy(data)
            )));
        }
        if !take_slot(self.sh, self.watch) {
            return Ok(Some(Negotiated::Closed));
        }
        let reply = ExportNameReply {
            size: U64::new(self.size),
            transmission_flags: U16::new(transmission_flags()),
        };
        let mut m = Vec::with_capacity(size_of::<ExportNameReply>() + 124);
        m.extend_from_slice(reply.as_bytes());
        if !self.no_zeroes {
            m.extend_from_slice(&[0u8; 124]);
        }
        s.write_all(&m)?;
        Ok(Some(Negotiated::Transmit(std::mem::take(
            &mut self.session,
        ))))
    }

    fn list(&mut self, s: &mut Stream, data: &[u8]) -> io::Result<Option<Negotiated>> {
        let opt = OPT_LIST;
        if !data.is_empty() {
            option_reply(s, opt, REP_ERR_INVALID, b"LIST takes no data")?;
            return Ok(None);
        }
        let name = self.sh.opts.export_name.as_bytes();
        let mut d = Vec::with_capacity(4 + name.len());
        d.extend_from_slice(U32::new(name.len() as u32).as_bytes());
        d.extend_from_slice(name);
        option_reply(s, opt, REP_SERVER, &d)?;
        option_reply(s, opt, REP_ACK, &[])?;
        Ok(None)
    }

    fn info_or_go(
        &mut self,
        s: &mut Stream,
        opt: u32,
        data: &[u8],
    ) -> io::Result<Option<Negotiated>> {
        // Name length, name, count of info types, the info types.
        let parsed = (|| {
            let (nlen, rest) = U32::read_from_prefix(data).ok()?;
            let nlen = nlen.get() as usize;
            let name = rest.get(..nlen)?;
            let (n, infos) = U16::read_from_prefix(rest.get(nlen..)?).ok()?;
            (infos.len() == 2 * usize::from(n.get())).then_some(name)
        })();
        let Some(name) = parsed else {
            option_reply(s, opt, REP_ERR_INVALID, b"malformed INFO/GO request")?;
            return Ok(None);
        };
        if !self.name_ok(name) {
            option_reply(s, opt, REP_ERR_UNKNOWN, b"no such export")?;
            return Ok(None);
        }
        if opt == OPT_GO && !take_slot(self.sh, self.watch) {
            return Ok(Some(Negotiated::Closed));
        }
        let export = InfoExport {
            info_type: U16::new(INFO_EXPORT),
            size: U64::new(self.size),
            transmission_flags: U16::new(transmission_flags()),
        };
        option_reply(s, opt, REP_INFO, export.as_bytes())?;
        let bs = InfoBlockSize {
            info_type: U16::new(INFO_BLOCK_SIZE),
            minimum: U32::new(1),
            preferred: U32::new(PREFERRED_BLOCK),
            maximum: U32::new(MAX_REQUEST),
        };
        option_reply(s, opt, REP_INFO, bs.as_bytes())?;
        option_reply(s, opt, REP_ACK, &[])?;
        Ok((opt == OPT_GO).then(|| Negotiated::Transmit(std::mem::take(&mut self.session))))
    }

    fn meta_context(
        &mut self,
        s: &mut Stream,
        opt: u32,
        data: &[u8],
    ) -> io::Result<Option<Negotiated>> {
        let list = opt == OPT_LIST_META_CONTEXT;
        if !list && !self.session.structured {
            option_reply(
                s,
                opt,
                REP_ERR_INVALID,
                b"negotiate structured replies first",
            )?;
            return Ok(None);
        }
        let Some((name, queries)) = parse_meta_request(data) else {
            option_reply(s, opt, REP_ERR_INVALID, b"malformed META_CONTEXT request")?;
            return Ok(None);
        };
        if !self.name_ok(name) {
            option_reply(s, opt, REP_ERR_UNKNOWN, b"no such export")?;
            return Ok(None);
        }
        // LIST with no query lists everything, "base:" every base context; SET
        // selects exactly what it names, anew each time.
        let chosen = if queries.is_empty() {
            list
        } else {
            queries
                .iter()
                .any(|q| *q == BASE_ALLOCATION || (list && *q == b"base:"))
        };
        if chosen {
            let mut d = Vec::with_capacity(4 + BASE_ALLOCATION.len());
            d.extend_from_slice(U32::new(BASE_ALLOCATION_ID).as_bytes());
            d.extend_from_slice(BASE_ALLOCATION);
            option_reply(s, opt, REP_META_CONTEXT, &d)?;
        }
        if !list {
            self.session.allocation = chosen;
        }
        option_reply(s, opt, REP_ACK, &[])?;
        Ok(None)
    }
}

fn serve_connection(sh: &Arc<Shared>, mut s: Stream, watch: &Arc<Watch>) -> io::Result<()> {
    let session = match handshake(sh, &mut s, watch)? {
        Negotiated::Transmit(session) => session,
        Negotiated::Closed => return Ok(()),
    };
    watch.negotiated();
    let conn = Arc::new(Conn {
        out: Outbox::new(
            s.try_clone()?,
            watch.clone(),
            sh.opts.max_inflight_bytes,
            sh.opts.write_timeout,
        ),
        structured: session.structured,
    });
    let writer = {
        let conn = conn.clone();
        std::thread::Builder::new()
            .name(format!("vabc-nbd-out-{}", watch.id))
            .spawn(move || conn.out.run_writer())?
    };
    let r = transmission(sh, &mut s, &conn, session);
    // Hung up or failed (not DISC, which returns Ok after the last request): whatever
    // it still has queued is read for nobody.
    conn.out.end(!matches!(r, Ok(true)));
    // Until every reply is out, or the writer gives up on the client.
    let _ = writer.join();
    r.map(|_| ())
}

/// The transmission phase: requests until DISC (`Ok(true)`), EOF (`Ok(false)`) or an
/// error.
fn transmission(
    sh: &Arc<Shared>,
    s: &mut Stream,
    conn: &Arc<Conn>,
    session: Session,
) -> io::Result<bool> {
    let size = sh.dev.size();
    let mut hdr = Request::new_zeroed();
    let mut sink = vec![0u8; 64 << 10];
    loop {
        let mut incoming = Incoming {
            s: &mut *s,
            out: &conn.out,
        };
        if let Err(e) = incoming.read_exact(hdr.as_mut_bytes()) {
            // EOF without DISC is how many clients hang up; not worth an error, nor is
            // the end of a connection the server closed.
            return if e.kind() == io::ErrorKind::UnexpectedEof || conn.out.abandoned() {
                Ok(false)
            } else {
                Err(e)
            };
        }
        let magic = hdr.magic.get();
        if magic != REQUEST_MAGIC {
            return Err(protocol(format!("bad request magic {magic:#x}")));
        }
        let (flags, kind, cookie) = (hdr.flags.get(), hdr.kind.get(), hdr.cookie.get());
        let (offset, len) = (hdr.offset.get(), hdr.length.get());
        let in_range = offset
            .checked_add(u64::from(len))
            .is_some_and(|e| e <= size);
        match kind {
            CMD_READ => {
                if !in_range || len > MAX_REQUEST || len == 0 {
                    conn.out.reserve(REPLY_COST);
                    let err = if in_range && len == 0 {
                        0
                    } else {
                        libc::EINVAL as u32
                    };
                    conn.read_reply(cookie, offset, err, &[], REPLY_COST);
                    continue;
                }
                let charge = u64::from(len) + REPLY_COST;
                conn.out.reserve(charge);
                let job = ReadJob {
                    conn: conn.clone(),
                    cookie,
                    offset,
                    len,
                    charge,
                    received: std::time::Instant::now(),
                };
                let queued = sh.readahead.as_ref().map(|ra| ra.queued());
                if let Some(q) = queued {
                    q.fetch_add(1, Ordering::Relaxed);
                }
                if sh.workers.submit(job).is_err() {
                    if let Some(q) = queued {
                        q.fetch_sub(1, Ordering::Relaxed);
                    }
                    conn.read_reply(cookie, offset, libc::ESHUTDOWN as u32, &[], charge);
                }
            }
            CMD_WRITE => {
                // Refused whatever its size, but its payload must be read past; a
                // payload larger than any request we accept is not worth reading.
                if len > MAX_REQUEST {
                    return Err(protocol(format!("WRITE of {len} bytes")));
                }
                let mut left = len as usize;
                while left > 0 {
                    let n = left.min(sink.len());
                    incoming.read_exact(&mut sink[..n])?;
                    left -= n;
                }
                conn.answer(cookie, libc::EPERM as u32);
            }
            CMD_TRIM | CMD_WRITE_ZEROES => conn.answer(cookie, libc::EPERM as u32),
            CMD_FLUSH => {
                let err = sh.dev.flush().err().map_or(0, |e| e.errno() as u32);
                conn.answer(cookie, err);
            }
            CMD_BLOCK_STATUS => block_status(sh, conn, session, cookie, flags, offset, len),
            // Outstanding requests are answered before the connection closes.
            CMD_DISC => return Ok(true),
            _ => conn.answer(cookie, libc::EINVAL as u32),
        }
    }
}

/// Answers BLOCK_STATUS for `base:allocation`: zero runs as holes that read as zeros.
fn block_status(
    sh: &Shared,
    conn: &Conn,
    session: Session,
    cookie: u64,
    flags: u16,
    offset: u64,
    len: u32,
) {
    let fail = |err: u32| {
        conn.out.reserve(REPLY_COST);
        conn.error(cookie, err, REPLY_COST);
    };
    if !session.allocation || len == 0 {
        return fail(libc::EINVAL as u32);
    }
    let runs = match sh.dev.allocation(offset, u64::from(len)) {
        Ok(r) => r,
        Err(e) => return fail(e.errno() as u32),
    };
    let most = if flags & CMD_FLAG_REQ_ONE != 0 {
        1
    } else {
        MAX_DESCRIPTORS
    };
    let context = U32::new(BASE_ALLOCATION_ID);
    let descriptors: Vec<BlockDescriptor> = runs
        .iter()
        .take(most)
        .map(|r| BlockDescriptor {
            // A run lies inside the request, whose length is a u32.
            length: U32::new(r.len as u32),
            status_flags: U32::new(if r.zero { STATE_HOLE | STATE_ZERO } else { 0 }),
        })
        .collect();
    let (a, b) = (context.as_bytes(), descriptors.as_bytes());
    let charge = (a.len() + b.len()) as u64 + REPLY_COST;
    conn.out.reserve(charge);
    conn.chunk(cookie, REPLY_TYPE_BLOCK_STATUS, a, b, charge);
}

/// The body of the NBD fuzz target (`fuzzing::exercise_nbd`): the server side of
/// one connection over a socket pair, fed `input` as everything the client
/// sends, then end of stream. Returns every byte the server sent back.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn exercise_connection(input: &[u8]) -> Vec<u8> {
    use std::sync::OnceLock;
    static SHARED: OnceLock<Option<Arc<Shared>>> = OnceLock::new();
    let shared = SHARED.get_or_init(|| {
        // The feeder below may write after the server hung up; that must be
        // an EPIPE error, not a signal killing the fuzzer.
        // SAFETY: setting a signal's disposition to SIG_IGN has no
        // preconditions and installs no handler code.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        // No read-ahead threads: spawning them for every input would cost more than
        // the input (the read-ahead has its own tests).
        let opts = NbdOptions {
            workers: 2,
            readahead: None,
            ..NbdOptions::default()
        };
        // Not a multiple of 512, so that reads ending at the device's end are
        // partial blocks.
        Shared::new(
            Arc::new(crate::pattern::Pattern((1 << 20) + 1000)),
            &opts,
            "fuzz",
        )
        .ok()
        .map(Arc::new)
    });
    let Some(shared) = shared else {
        return Vec::new();
    };
    let Ok((server, client)) = UnixStream::pair() else {
        return Vec::new();
    };
    let Ok(mut feeder) = client.try_clone() else {
        return Vec::new();
    };
    std::thread::scope(|scope| {
        let feed = scope.spawn(move || {
            let _ = feeder.write_all(input);
            let _ = feeder.shutdown(std::net::Shutdown::Write);
        });
        let conn = scope.spawn(move || {
            let Ok(sock) = server.try_clone() else { return };
            let watch = Arc::new(Watch::new(0, Stream::Unix(sock), shared.slots.epoch));
            let _ = serve_connection(shared, Stream::Unix(server), &watch);
        });
        // Ends once the server and its workers dropped every copy of their end.
        let mut out = Vec::new();
        let _ = (&client).read_to_end(&mut out);
        // Joined rather than left to the scope, so that the threads have
        // fully exited (leak checkers look right after this returns).
        let _ = feed.join();
        let _ = conn.join();
        out
    })
}

/// The server's greeting: every connection starts with it.
pub(crate) fn greeting() -> [u8; 18] {
    zerocopy::transmute!(Greeting {
        nbd_magic: U64::new(NBDMAGIC),
        ihaveopt: U64::new(IHAVEOPT),
        handshake_flags: U16::new(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::time::{Duration, Instant};

    /// A device that takes 10 ms per MiB read (at least 1 ms a read) and counts bytes.
    struct Slow {
        read: AtomicU64,
    }

    impl BlockDevice for Slow {
        fn size(&self) -> u64 {
            1 << 30
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> engine::Result<()> {
            std::thread::sleep(Duration::from_millis(1 + 10 * (buf.len() as u64 >> 20)));
            self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
            buf.fill(7);
            Ok(())
        }
    }

    /// Fixed-newstyle handshake with OPT_EXPORT_NAME; the client is then transmitting.
    fn connect(path: &Path) -> UnixStream {
        let mut c = UnixStream::connect(path).unwrap();
        // A regression fails the tests rather than hanging them.
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        negotiate(&mut c);
        c
    }

    fn negotiate(c: &mut (impl Read + Write)) {
        let mut greet = [0u8; 18];
        c.read_exact(&mut greet).unwrap();
        c.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
            .unwrap();
        let mut opt = Vec::new();
        opt.extend_from_slice(&IHAVEOPT.to_be_bytes());
        opt.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
        opt.extend_from_slice(&0u32.to_be_bytes());
        c.write_all(&opt).unwrap();
        let mut export = [0u8; 10];
        c.read_exact(&mut export).unwrap();
    }

    /// Reads `len` bytes at `offset` (a simple reply) and checks them against the
    /// [`crate::pattern::Pattern`] device.
    fn read_pattern(c: &mut (impl Read + Write), cookie: u64, offset: u64, len: u32) {
        c.write_all(&read_request(cookie, offset, len)).unwrap();
        let mut reply = vec![0u8; 16 + len as usize];
        c.read_exact(&mut reply).unwrap();
        assert_eq!(
            &reply[4..16],
            &[&0u32.to_be_bytes()[..], &cookie.to_be_bytes()].concat()
        );
        let mut want = vec![0u8; len as usize];
        crate::pattern::Pattern(u64::MAX)
            .read_at(&mut want, offset)
            .unwrap();
        assert!(reply[16..] == want[..], "{len} bytes at {offset}");
    }

    /// The server closed `fd`'s connection (it sees the peer's shutdown), waiting up to
    /// `wait` for it.
    fn closed_by_server(fd: RawFd, wait: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, wait.as_millis() as i32) };
        rc == 1 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP) != 0
    }

    fn read_request(cookie: u64, offset: u64, len: u32) -> [u8; 28] {
        let mut r = [0u8; 28];
        r[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        r[6..8].copy_from_slice(&CMD_READ.to_be_bytes());
        r[8..16].copy_from_slice(&cookie.to_be_bytes());
        r[16..24].copy_from_slice(&offset.to_be_bytes());
        r[24..28].copy_from_slice(&len.to_be_bytes());
        r
    }

    fn server(dir: &Path, dev: Arc<dyn BlockDevice>, opts: NbdOptions) -> (PathBuf, NbdHandle) {
        let path = dir.join("nbd.sock");
        let s = NbdServer::bind(&NbdAddr::Unix(path.clone()), dev, &opts).unwrap();
        (path, s.spawn().unwrap())
    }

    #[test]
    fn a_client_that_queues_huge_reads_and_hangs_up_costs_others_little() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Arc::new(Slow {
            read: AtomicU64::new(0),
        });
        let opts = NbdOptions {
            readahead: None,
            ..NbdOptions::default()
        };
        let (path, h) = server(dir.path(), dev.clone(), opts);
        // 2,000 reads of 32 MiB (64 GiB, 20 s of this device's time on 16 workers),
        // sent from a thread: the server stops reading them once the connection's
        // budget is queued, so the writes block until the hang-up.
        let bad = connect(&path);
        let mut w = bad.try_clone().unwrap();
        let sender = std::thread::spawn(move || {
            for i in 0..2000u64 {
                if w.write_all(&read_request(i, 0, MAX_REQUEST)).is_err() {
                    break;
                }
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        bad.shutdown(std::net::Shutdown::Both).unwrap();
        drop(bad);
        sender.join().unwrap();
        let mut good = connect(&path);
        let t = Instant::now();
        good.write_all(&read_request(1, 4096, 4096)).unwrap();
        let mut reply = vec![0u8; 16 + 4096];
        good.read_exact(&mut reply).unwrap();
        let waited = t.elapsed();
        assert_eq!(&reply[16..], &[7u8; 4096][..]);
        assert!(
            waited < Duration::from_secs(2),
            "a 4 KiB read took {waited:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
        let read = dev.read.load(Ordering::Relaxed);
        assert!(
            read <= 8 * u64::from(MAX_REQUEST),
            "read {read} bytes for a client that hung up"
        );
        h.stop();
    }

    #[test]
    fn idle_sockets_lock_nobody_out_and_are_closed_at_the_handshake_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let opts = NbdOptions {
            readahead: None,
            max_connections: 2,
            max_handshakes: 4,
            handshake_timeout: Duration::from_millis(500),
            ..NbdOptions::default()
        };
        let dev = Arc::new(crate::pattern::Pattern(1 << 20));
        let (path, h) = server(dir.path(), dev, opts);
        let started = Instant::now();
        // Connected, never a byte sent: five times the negotiation slots.
        let idle: Vec<UnixStream> = (0..20)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        let t = Instant::now();
        let mut good = connect(&path);
        read_pattern(&mut good, 1, 12345, 4096);
        let waited = t.elapsed();
        assert!(waited < Duration::from_secs(1), "served after {waited:?}");
        // Evicted by newer ones, or closed at the deadline.
        for (i, c) in idle.iter().enumerate() {
            assert!(
                closed_by_server(c.as_raw_fd(), Duration::from_secs(3)),
                "idle connection {i} still open after {:?}",
                started.elapsed()
            );
        }
        assert!(started.elapsed() < Duration::from_secs(3));
        // The transmitting client is not subject to the handshake deadline.
        read_pattern(&mut good, 2, 0, 4096);
        h.stop();
    }

    #[test]
    fn a_client_that_stops_reading_is_dropped_without_stalling_others() {
        let dir = tempfile::tempdir().unwrap();
        let opts = NbdOptions {
            readahead: None,
            max_connections: 2,
            write_timeout: Duration::from_secs(1),
            ..NbdOptions::default()
        };
        let dev = Arc::new(crate::pattern::Pattern(64 << 20));
        let (path, h) = server(dir.path(), dev, opts);
        // 2,000 reads of 1 MiB (2 GiB), none of whose replies is read; the requests
        // (56 KB) fit the socket's buffer, so sending them does not block.
        let mut bad = connect(&path);
        let mut burst = Vec::new();
        for i in 0..2000u64 {
            burst.extend_from_slice(&read_request(i, (i % 63) << 20, 1 << 20));
        }
        bad.write_all(&burst).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let mut good = connect(&path);
        for i in 0..16u64 {
            read_pattern(&mut good, i, i * 3_000_017, 256 << 10);
        }
        let waited = t.elapsed();
        assert!(waited < Duration::from_secs(1), "4 MiB took {waited:?}");
        // Disconnected once its socket took nothing for the write timeout, and its
        // slot is free again.
        assert!(
            closed_by_server(bad.as_raw_fd(), Duration::from_secs(4)),
            "a client reading nothing is still connected"
        );
        drop(good);
        let mut third = connect(&path);
        read_pattern(&mut third, 1, 777, 4096);
        h.stop();
    }

    #[test]
    fn idle_tcp_connections_are_closed_and_busy_ones_are_not() {
        let opts = NbdOptions {
            readahead: None,
            idle_timeout: Some(Duration::from_millis(400)),
            ..NbdOptions::default()
        };
        let s = NbdServer::bind(
            &"tcp:127.0.0.1:0".parse().unwrap(),
            Arc::new(crate::pattern::Pattern(1 << 20)),
            &opts,
        )
        .unwrap();
        let NbdAddr::Tcp(addr) = s.addr().clone() else {
            unreachable!()
        };
        let h = s.spawn().unwrap();
        let mut quiet = TcpStream::connect(addr).unwrap();
        negotiate(&mut quiet);
        let mut busy = TcpStream::connect(addr).unwrap();
        busy.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        negotiate(&mut busy);
        // A request every 100 ms for three times the idle timeout.
        for i in 0..12u64 {
            read_pattern(&mut busy, i, i * 4096, 4096);
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(closed_by_server(quiet.as_raw_fd(), Duration::ZERO));
        assert!(!closed_by_server(busy.as_raw_fd(), Duration::ZERO));
        read_pattern(&mut busy, 99, 0, 4096);
        h.stop();
    }

    #[test]
    fn connections_are_limited_and_the_socket_is_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let opts = NbdOptions {
            readahead: None,
            max_connections: 2,
            ..NbdOptions::default()
        };
        // Under the most permissive umask.
        // SAFETY: umask has no preconditions; restored below.
        let old = unsafe { libc::umask(0) };
        let (path, h) = server(dir.path(), Arc::new(crate::pattern::Pattern(1 << 20)), opts);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let _a = connect(&path);
        let _b = connect(&path);
        let mut c = UnixStream::connect(&path).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 18];
        let n = c.read(&mut buf).unwrap_or(0);
        assert_eq!(n, 0, "a third connection was served");
        h.stop();
    }

    use super::*;

    #[test]
    fn greeting_is_fixed_newstyle_without_zeroes() {
        assert_eq!(&greeting(), b"NBDMAGICIHAVEOPT\x00\x03");
    }

    #[test]
    fn parses_addresses() {
        assert_eq!(
            "unix:/tmp/x.sock".parse::<NbdAddr>().unwrap(),
            NbdAddr::Unix("/tmp/x.sock".into())
        );
        assert_eq!(
            "tcp:127.0.0.1:10809".parse::<NbdAddr>().unwrap(),
            NbdAddr::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert!("tcp:localhost".parse::<NbdAddr>().is_err());
        assert!("udp:1".parse::<NbdAddr>().is_err());
        assert!("unix:".parse::<NbdAddr>().is_err());
    }
}
