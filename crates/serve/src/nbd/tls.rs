//! NBD's TLS (`NBD_OPT_STARTTLS`) over rustls: the server's configuration, with or
//! without client certificates, and a session shared by a connection's reader and the
//! threads writing its replies.
//!
//! With a client CA ([`tls_config`]'s `client_ca`), only clients presenting a certificate
//! that chains to it get past the TLS handshake, as with `nbdkit --tls-verify-peer` or
//! qemu-nbd's `tls-creds-x509,verify-peer=on`; the others get no byte of the export,
//! not even its size, which is never sent before TLS. Pre-shared keys (`nbdkit
//! --tls-psk`) are not offered: rustls has no external-PSK support, and a hand-rolled
//! one is not worth the risk.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{Result, ServeError};

/// The server side of NBD's TLS ([`super::NbdOptions::tls`]).
pub type TlsConfig = rustls::ServerConfig;

/// A TLS server configuration from a PEM certificate chain and its PEM private key
/// (as `openssl req -x509 ...` writes them), for [`super::NbdOptions::tls`]. With
/// `client_ca` (PEM certificates), every client must present a certificate issued by
/// one of them.
pub fn tls_config(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Arc<TlsConfig>> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |path: &Path, msg: String| ServeError::Invalid {
        path: path.to_path_buf(),
        msg,
    };
    let pem_certs = |path: &Path| -> Result<Vec<CertificateDer<'static>>> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect())
            .map_err(|e| bad(path, format!("not PEM certificates: {e}")))?;
        if certs.is_empty() {
            return Err(bad(path, "no certificate in the file".into()));
        }
        Ok(certs)
    };
    let certs = pem_certs(cert)?;
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| bad(key, format!("not a PEM private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(cert, e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in pem_certs(ca)? {
                roots
                    .add(c)
                    .map_err(|e| bad(ca, format!("not a usable CA certificate: {e}")))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| bad(ca, format!("cannot verify clients with it: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(certs, key_der)
        .map_err(|e| bad(key, format!("does not fit the certificate: {e}")))?;
    Ok(Arc::new(config))
}

/// A TLS session over a TCP socket, read by one thread while others write. A reader
/// never holds the session's lock while it waits for the socket, so replies go out
/// while it waits for the next request; and nothing but the option phase's replies
/// ever waits for the socket with the lock held.
pub(super) struct TlsStream {
    conn: Mutex<rustls::ServerConnection>,
    pub(super) sock: TcpStream,
}

impl TlsStream {
    /// The server side of a TLS handshake on `sock` (bounded in time by the handshake
    /// deadline, which shuts the socket down).
    pub(super) fn accept(
        sock: TcpStream,
        config: Arc<rustls::ServerConfig>,
    ) -> io::Result<TlsStream> {
        let mut conn = rustls::ServerConnection::new(config).map_err(io::Error::other)?;
        while conn.is_handshaking() {
            conn.complete_io(&mut &sock)?;
        }
        Ok(TlsStream {
            conn: Mutex::new(conn),
            sock,
        })
    }

    fn lock(&self) -> MutexGuard<'_, rustls::ServerConnection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the buffered TLS records, waiting for the socket: the option phase only.
    fn flush_blocking(&self, c: &mut rustls::ServerConnection) -> io::Result<()> {
        while c.wants_write() {
            c.write_tls(&mut &self.sock)?;
        }
        Ok(())
    }

    /// Writes buffered TLS records until the socket is full; true when all are out.
    fn flush_now(&self, c: &mut rustls::ServerConnection) -> io::Result<bool> {
        let mut sock = NoWait(self.sock.as_raw_fd());
        while c.wants_write() {
            match c.write_tls(&mut sock) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// TLS records wait for the socket.
    pub(super) fn pending(&self) -> bool {
        self.lock().wants_write()
    }

    /// Encrypts and writes as much of `parts` as the socket and the session's buffer
    /// (rustls' limit, 64 KiB of records) take without waiting; returns the bytes of
    /// `parts` taken. With no parts, only flushes what is buffered.
    pub(super) fn write_now(&self, parts: &[&[u8]]) -> io::Result<usize> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut c = self.lock();
        let mut taken = 0;
        // Records first: the session takes more plaintext only as its buffer empties.
        while self.flush_now(&mut c)? && taken < total {
            let n = c.writer().write_vectored(&io_slices(parts, taken))?;
            if n == 0 {
                break;
            }
            taken += n;
        }
        Ok(taken)
    }

    pub(super) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.lock().reader().read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            let mut pfd = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            if unsafe { libc::poll(&mut pfd, 1, -1) } < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut c = self.lock();
            if c.read_tls(&mut &self.sock)? == 0 {
                return Ok(0);
            }
            c.process_new_packets().map_err(io::Error::other)?;
            // An alert or key update to answer: what the socket does not take now goes
            // with the next reply (the caller wakes the connection's writer), since
            // waiting here with the lock held would stop every writer of the session.
            self.flush_now(&mut c)?;
        }
    }

    /// A blocking write: the option phase's replies.
    pub(super) fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut c = self.lock();
        let n = c.writer().write_vectored(bufs)?;
        self.flush_blocking(&mut c)?;
        Ok(n)
    }
}

/// `parts` without their first `skip` bytes.
pub(super) fn skip<'a>(parts: &[&'a [u8]], mut skip: usize) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        out.push(&p[skip..]);
        skip = 0;
    }
    out
}

/// `parts` without their first `n` bytes, as I/O slices.
pub(super) fn io_slices<'a>(parts: &[&'a [u8]], n: usize) -> Vec<IoSlice<'a>> {
    skip(parts, n).into_iter().map(IoSlice::new).collect()
}

/// One `sendmsg` that does not wait: `WouldBlock` when the socket is full. Asked per
/// call (`MSG_DONTWAIT`) rather than set on the socket, whose blocking mode it shares
/// with the connection's reader, which must keep blocking. `MSG_NOSIGNAL`: a client
/// gone is an `EPIPE` error, not a signal.
pub(super) fn send_now(fd: RawFd, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid: no name, no iovecs, no control data.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is guaranteed ABI-compatible with iovec on Unix; sendmsg only reads them.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len().min(1024) as _;
    loop {
        // SAFETY: `msg` points at `bufs`, which outlive the call; `fd` is an open socket
        // owned by the caller.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A socket written without waiting, for rustls' `write_tls`.
struct NoWait(RawFd);

impl Write for NoWait {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        send_now(self.0, &[IoSlice::new(buf)])
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        send_now(self.0, bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
