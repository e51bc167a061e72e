//! `vabc serve --nbd`: real clients (qemu-img, nbdinfo, nbdcopy) see exactly new.img,
//! and a hand-rolled client checks pipelined out-of-order replies, several connections
//! at once, and the read-only refusals.

mod serve_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;

use serve_common::*;

fn start_nbd(t: &Path, pair: &str) -> (Server, std::path::PathBuf, std::path::PathBuf, u64) {
    let old = corpus_image(pair, "old", "ext4");
    let new = corpus_image(pair, "new", "ext4");
    let cow = t.join("update.cow");
    let size = make_cow(&old, &new, &cow, 3, "lz4");
    let (server, sock) = serve_nbd(t, &old, &cow);
    (server, sock, new, size)
}

/// `vabc serve --nbd unix:T/nbd.sock` of `old` + `cow`; returns the server and socket.
fn serve_nbd(t: &Path, old: &Path, cow: &Path) -> (Server, std::path::PathBuf) {
    let sock = t.join("nbd.sock");
    let addr = format!("unix:{}", sock.display());
    let server = Server::start(&[
        os("--base"),
        old.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--nbd"),
        os(&addr),
    ]);
    (server, sock)
}

#[test]
fn real_clients_see_the_new_image() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (server, sock, new, size) = start_nbd(t, "small");
    let uri = format!("nbd+unix:///?socket={}", sock.display());

    let (ok, out) = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&new)
        .arg(&uri));
    assert!(
        ok && out.contains("Images are identical"),
        "qemu-img compare: {out}"
    );

    let (ok, out) = run(Command::new("qemu-img")
        .args(["info", "--output=json", "-f", "raw"])
        .arg(&uri));
    assert!(
        ok && out.contains(&format!("\"virtual-size\": {size}")),
        "qemu-img info: {out}"
    );

    let (ok, out) = run(Command::new("nbdinfo").arg(&uri));
    assert!(ok, "nbdinfo: {out}");
    assert!(
        out.contains(&format!("export-size: {size}")),
        "nbdinfo: {out}"
    );
    assert!(out.contains("is_read_only: true"), "nbdinfo: {out}");
    assert!(out.contains("can_multi_conn: true"), "nbdinfo: {out}");
    assert!(out.contains("block_size_preferred: 4096"), "nbdinfo: {out}");

    let (ok, out) = run(Command::new("nbdinfo").arg("--list").arg(&uri));
    assert!(
        ok && out.contains("export=\"vabc\""),
        "nbdinfo --list: {out}"
    );

    let copy = t.join("copy.img");
    let (ok, out) = run(Command::new("nbdcopy")
        .args(["--connections=4", "--requests=16"])
        .arg(&uri)
        .arg(&copy));
    assert!(ok, "nbdcopy: {out}");
    let (same, out) = run(Command::new("cmp").arg(&copy).arg(&new));
    assert!(same, "nbdcopy output differs: {out}");

    // Writes are refused by the server (qemu-io opens it writable; the write fails).
    let (ok, out) = run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0xab 0 4k"])
        .arg(&uri));
    assert!(
        !ok || out.to_lowercase().contains("read-only") || out.contains("Operation not permitted"),
        "qemu-io write: {out}"
    );

    assert!(server.stop().success());
    assert!(!sock.exists(), "socket left behind");
}

// --- a minimal client for the protocol corners ---

fn u32be(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn u64be(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// Fixed-newstyle handshake with NBD_OPT_GO for the default export; returns the size.
fn connect(sock: &Path) -> (UnixStream, u64) {
    let s = hello(sock);
    go(s)
}

fn hello(sock: &Path) -> UnixStream {
    greet(UnixStream::connect(sock).unwrap())
}

/// The client's side of the greeting, on any stream.
fn greet<S: Read + Write>(mut s: S) -> S {
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"NBDMAGIC");
    assert_eq!(&hello[8..16], b"IHAVEOPT");
    s.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
    s
}

/// Sends option `opt` with `data`; returns the replies up to the final one, as
/// (kind, payload).
fn option(s: &mut (impl Read + Write), opt: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
    let mut m = Vec::new();
    m.extend_from_slice(b"IHAVEOPT");
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m).unwrap();
    let mut out = Vec::new();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        assert_eq!(u64be(&h), 0x3e889045565a9);
        assert_eq!(u32be(&h[8..]), opt);
        let (kind, len) = (u32be(&h[12..]), u32be(&h[16..]) as usize);
        let mut d = vec![0u8; len];
        s.read_exact(&mut d).unwrap();
        out.push((kind, d));
        if kind == 1 || kind & (1 << 31) != 0 {
            return out;
        }
    }
}

/// OPT_GO for the default export after other options; returns the size.
fn go<S: Read + Write>(mut s: S) -> (S, u64) {
    // OPT_GO, name "", one info request (BLOCK_SIZE).
    let mut opt = Vec::new();
    opt.extend_from_slice(b"IHAVEOPT");
    opt.extend_from_slice(&7u32.to_be_bytes());
    opt.extend_from_slice(&8u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    opt.extend_from_slice(&1u16.to_be_bytes());
    opt.extend_from_slice(&3u16.to_be_bytes());
    s.write_all(&opt).unwrap();
    let mut size = 0;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        assert_eq!(u64be(&h), 0x3e889045565a9);
        let (kind, len) = (u32be(&h[12..]), u32be(&h[16..]) as usize);
        let mut d = vec![0u8; len];
        s.read_exact(&mut d).unwrap();
        match kind {
            1 => break, // ACK
            3 if d[..2] == [0, 0] => {
                size = u64be(&d[2..]);
                let flags = u16::from_be_bytes([d[10], d[11]]);
                assert_eq!(flags & 0b11, 0b11, "HAS_FLAGS | READ_ONLY");
            }
            3 => assert_eq!(&d[..2], &[0, 3]),
            k => panic!("unexpected option reply {k:#x}"),
        }
    }
    (s, size)
}

fn request(s: &mut impl Write, kind: u16, cookie: u64, offset: u64, len: u32) {
    let mut r = Vec::with_capacity(28);
    r.extend_from_slice(&0x25609513u32.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&kind.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    s.write_all(&r).unwrap();
}

fn reply(s: &mut impl Read) -> (u32, u64) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u32be(&h), 0x67446698);
    (u32be(&h[4..]), u64be(&h[8..]))
}

#[test]
fn pipelined_reads_on_several_connections_match_and_writes_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (server, sock, new, size) = start_nbd(t, "tiny");
    let want = std::sync::Arc::new(std::fs::read(&new).unwrap());
    let threads: Vec<_> = (0..8u64)
        .map(|c| {
            let (sock, want) = (sock.clone(), want.clone());
            std::thread::spawn(move || {
                let (mut s, got_size) = connect(&sock);
                assert_eq!(got_size, want.len() as u64);
                let mut rng = fastrand::Rng::with_seed(c * 7919 + 17);
                let mut reqs = std::collections::HashMap::new();
                // 32 reads in flight per connection before reading any reply.
                for cookie in 0..32u64 {
                    let seed = rng.u64(..);
                    let off = seed % got_size;
                    let len = ((seed >> 20) % (256 << 10)).min(got_size - off).max(1) as u32;
                    request(&mut s, 0, cookie, off, len);
                    reqs.insert(cookie, (off, len));
                }
                for _ in 0..32 {
                    let (err, cookie) = reply(&mut s);
                    assert_eq!(err, 0);
                    let (off, len) = reqs.remove(&cookie).expect("reply for a known cookie");
                    let mut data = vec![0u8; len as usize];
                    s.read_exact(&mut data).unwrap();
                    assert!(
                        data[..] == want[off as usize..off as usize + len as usize],
                        "conn {c}: {len} bytes at {off}"
                    );
                }
                s
            })
        })
        .collect();
    let mut conns: Vec<UnixStream> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let s = &mut conns[0];
    // WRITE (with payload), TRIM, out-of-range READ, FLUSH, then DISC.
    request(s, 1, 100, 0, 4096);
    s.write_all(&[0u8; 4096]).unwrap();
    assert_eq!(reply(s), (1, 100)); // EPERM
    request(s, 4, 101, 0, 4096);
    assert_eq!(reply(s), (1, 101));
    request(s, 0, 102, size - 1, 2);
    assert_eq!(reply(s), (22, 102)); // EINVAL
    request(s, 3, 103, 0, 0);
    assert_eq!(reply(s), (0, 103));
    request(s, 2, 104, 0, 0);
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "server sent data after DISC");
    drop(conns);
    assert!(server.stop().success());
}

#[test]
fn tcp_listener_works_too() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let old = corpus_image("tiny", "old", "ext4");
    let new = corpus_image("tiny", "new", "ext4");
    let cow = t.join("update.cow");
    make_cow(&old, &new, &cow, 2, "lz4");
    // Port 0 lets the kernel choose; the ready output names the real port.
    let server = Server::start(&[
        os("--base"),
        old.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--nbd"),
        os("tcp:127.0.0.1:0"),
    ]);
    let uri = format!("nbd://{}/", tcp_address(&server));
    let (ok, out) = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&new)
        .arg(&uri));
    assert!(
        ok && out.contains("Images are identical"),
        "qemu-img compare over TCP: {out}"
    );
    assert!(server.stop().success());
}

/// HOST:PORT of a TCP export, from the server's "NBD export ... at nbd://HOST:PORT/"
/// line (port 0 lets the kernel choose).
fn tcp_address(server: &Server) -> String {
    server
        .stdout
        .iter()
        .find_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("nbd://"))
                .map(|a| a.trim_end_matches('/').to_string())
        })
        .expect("NBD address in the output")
}

/// A LIST/SET_META_CONTEXT payload: export "" and `queries`.
fn meta_request(queries: &[&str]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&0u32.to_be_bytes());
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q.as_bytes());
    }
    d
}

/// A structured reply chunk: (flags, type, cookie, payload).
fn chunk(s: &mut UnixStream) -> (u16, u16, u64, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u32be(&h), 0x668e33ef, "structured reply magic");
    let flags = u16::from_be_bytes([h[4], h[5]]);
    let kind = u16::from_be_bytes([h[6], h[7]]);
    let mut d = vec![0u8; u32be(&h[16..]) as usize];
    s.read_exact(&mut d).unwrap();
    (flags, kind, u64be(&h[8..]), d)
}

/// [`sparse_pair`] served over NBD.
fn sparse_export(t: &Path) -> (Server, std::path::PathBuf, std::path::PathBuf) {
    let (old, new, cow) = sparse_pair(t);
    let (server, sock) = serve_nbd(t, &old, &cow);
    (server, sock, new)
}

/// `base:allocation` through real clients: `nbdinfo --map` reports the ZERO ops and the
/// base's hole as zero runs, every zero run reads as zeros, and `nbdcopy`, which skips
/// them, still copies new.img exactly.
#[test]
fn block_status_maps_zero_runs_that_read_as_zeros() {
    const MIB: u64 = 1 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (server, sock, new) = sparse_export(t);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let (ok, out) = run(Command::new("nbdinfo").arg("--map").arg(&uri));
    assert!(ok, "nbdinfo --map: {out}");
    let want = std::fs::read(&new).unwrap();
    let mut zero = Vec::new();
    let mut end = 0;
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (off, len, kind): (u64, u64, u32) = (
            f[0].parse().unwrap(),
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
        );
        assert_eq!(off, end, "runs are contiguous: {out}");
        end = off + len;
        if kind == 3 {
            assert!(
                want[off as usize..end as usize].iter().all(|&b| b == 0),
                "zero run {off}+{len} holds data: {out}"
            );
            zero.push((off, end));
        } else {
            assert_eq!(kind, 0, "{out}");
        }
    }
    assert_eq!(end, 8 * MIB, "{out}");
    assert_eq!(zero, [(MIB, 2 * MIB), (3 * MIB, 5 * MIB)], "{out}");

    let copy = t.join("copy.img");
    let (ok, out) = run(Command::new("nbdcopy").arg(&uri).arg(&copy));
    assert!(ok, "nbdcopy: {out}");
    assert!(
        std::fs::read(&copy).unwrap() == want,
        "nbdcopy output differs"
    );
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(&copy).unwrap().blocks() * 512;
    assert!(
        allocated <= 5 * MIB,
        "copy not sparse: {allocated} bytes allocated"
    );
    assert!(server.stop().success());
}

/// The protocol corners of structured replies and BLOCK_STATUS with a hand-rolled client.
#[test]
fn structured_replies_and_block_status_follow_the_protocol() {
    const MIB: u64 = 1 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let (server, sock, new) = sparse_export(tmp.path());
    let want = std::fs::read(&new).unwrap();
    let mut s = hello(&sock);
    // SET_META_CONTEXT needs structured replies first; LIST does not.
    let r = option(&mut s, 10, &meta_request(&["base:allocation"]));
    assert_eq!(r.last().unwrap().0, (1 << 31) + 3, "ERR_INVALID");
    let r = option(&mut s, 9, &meta_request(&[]));
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].0, &r[0].1[4..]), (4, &b"base:allocation"[..]));
    let r = option(&mut s, 8, &[1]);
    assert_eq!(
        r.last().unwrap().0,
        (1 << 31) + 3,
        "STRUCTURED_REPLY takes no data"
    );
    assert_eq!(option(&mut s, 8, &[]), [(1, vec![])]);
    // Unknown contexts are not selected; a malformed request is refused.
    assert_eq!(
        option(&mut s, 10, &meta_request(&["qemu:dirty-bitmap:x"])),
        [(1, vec![])]
    );
    let mut bad = meta_request(&["base:allocation"]);
    bad.pop();
    assert_eq!(option(&mut s, 10, &bad).last().unwrap().0, (1 << 31) + 3);
    let r = option(&mut s, 10, &meta_request(&["base:allocation"]));
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].0, 4, "META_CONTEXT");
    let id = u32be(&r[0].1);
    let (mut s, size) = go(s);
    assert_eq!(size, 8 * MIB);

    // READ: one OFFSET_DATA chunk with the offset and the bytes, flagged DONE.
    request(&mut s, 0, 1, 12345, 5000);
    let (flags, kind, cookie, d) = chunk(&mut s);
    assert_eq!((flags, kind, cookie), (1, 1, 1));
    assert_eq!(u64be(&d), 12345);
    assert!(d[8..] == want[12345..17345]);
    // A READ past the end: an ERROR chunk with EINVAL.
    request(&mut s, 0, 2, size - 1, 2);
    let (flags, kind, cookie, d) = chunk(&mut s);
    assert_eq!((flags, kind, cookie), (1, (1 << 15) + 1, 2));
    assert_eq!(u32be(&d), 22);

    // BLOCK_STATUS over 512 KiB of data, the 1 MiB of ZERO ops and 1 MiB of data.
    let status = |s: &mut UnixStream, cookie: u64, flags: u16, off: u64, len: u32| {
        let mut r = Vec::new();
        r.extend_from_slice(&0x25609513u32.to_be_bytes());
        r.extend_from_slice(&flags.to_be_bytes());
        r.extend_from_slice(&7u16.to_be_bytes());
        r.extend_from_slice(&cookie.to_be_bytes());
        r.extend_from_slice(&off.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        s.write_all(&r).unwrap();
        let (flags, kind, got, d) = chunk(s);
        assert_eq!((flags, got), (1, cookie));
        (kind, d)
    };
    let (kind, d) = status(&mut s, 3, 0, MIB / 2, (5 * MIB / 2) as u32);
    assert_eq!(kind, 5, "BLOCK_STATUS");
    assert_eq!(u32be(&d), id);
    let desc: Vec<(u32, u32)> = d[4..]
        .chunks(8)
        .map(|c| (u32be(c), u32be(&c[4..])))
        .collect();
    assert_eq!(
        desc,
        [(MIB as u32 / 2, 0), (MIB as u32, 3), (MIB as u32, 0)]
    );
    // REQ_ONE: the first descriptor only.
    let (_, d) = status(&mut s, 4, 1 << 3, MIB / 2, (5 * MIB / 2) as u32);
    assert_eq!(d.len(), 4 + 8);
    // Past the end, or empty: EINVAL.
    let (kind, d) = status(&mut s, 5, 0, size - 4096, 8192);
    assert_eq!((kind, u32be(&d)), ((1 << 15) + 1, 22));
    let (kind, d) = status(&mut s, 6, 0, 0, 0);
    assert_eq!((kind, u32be(&d)), ((1 << 15) + 1, 22));
    drop(s);

    // Without a selected context, BLOCK_STATUS is refused.
    let mut s = hello(&sock);
    assert_eq!(option(&mut s, 8, &[]), [(1, vec![])]);
    let (mut s, _) = go(s);
    let (kind, d) = status(&mut s, 7, 0, 0, 4096);
    assert_eq!((kind, u32be(&d)), ((1 << 15) + 1, 22));
    drop(s);
    assert!(server.stop().success());
}

/// A self-signed certificate for 127.0.0.1 in `dir` (as `ca-cert.pem`, the name libnbd
/// looks for) and its key.
fn self_signed(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (dir.join("ca-cert.pem"), dir.join("key.pem"));
    let (ok, out) = run(Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        ])
        .args([
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert));
    assert!(ok, "openssl: {out}");
    (cert, key)
}

#[test]
fn tls_is_required_once_configured_and_clients_verify_the_server() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (old, new, cow) = sparse_pair(t);
    let (certs, wrong) = (t.join("certs"), t.join("wrong"));
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::create_dir_all(&wrong).unwrap();
    let (cert, key) = self_signed(&certs);
    self_signed(&wrong);
    let server = Server::start(&[
        os("--base"),
        old.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--nbd"),
        os("tcp:127.0.0.1:0"),
        os("--nbd-tls-cert"),
        cert.as_os_str(),
        os("--nbd-tls-key"),
        key.as_os_str(),
    ]);
    let addr = tcp_address(&server);
    // A client that trusts the certificate reads the new image, over TLS.
    let out = Command::new("nbdcopy")
        .arg(format!(
            "nbds://{addr}/vabc?tls-certificates={}",
            certs.display()
        ))
        .arg(t.join("copy.img"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sha256_file(&t.join("copy.img")), sha256_file(&new));
    // Without TLS: refused. With another certificate trusted: the client refuses us.
    let (ok, out) = run(Command::new("nbdinfo").arg(format!("nbd://{addr}/vabc")));
    assert!(!ok, "a plaintext client was served: {out}");
    let (ok, out) = run(Command::new("nbdinfo").arg(format!(
        "nbds://{addr}/vabc?tls-certificates={}",
        wrong.display()
    )));
    assert!(
        !ok,
        "a client trusting another certificate connected: {out}"
    );
    assert!(server.stop().success());
}

#[test]
fn a_wildcard_listener_without_tls_is_warned_about() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (old, _new, cow) = sparse_pair(t);
    let log = t.join("serve.log");
    let server = Server::start_logged(
        &[
            os("--base"),
            old.as_os_str(),
            os("--cow"),
            cow.as_os_str(),
            os("--nbd"),
            os("tcp:0.0.0.0:0"),
        ],
        &log,
    );
    assert!(
        server.log().contains("every network interface"),
        "{}",
        server.log()
    );
    assert!(server.stop().success());
}

/// Whether the server has closed `s`: its end of the stream, or a reset, within
/// `wait` (what it sent before is read and dropped).
fn closed_by_server(s: &mut std::net::TcpStream, wait: std::time::Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut sink = Vec::new();
    match s.read_to_end(&mut sink) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

/// 100 sockets that never negotiate and a client that asks for 4 GiB and reads none of
/// it do not keep a client that comes after them from reading the right bytes at once;
/// the server closes the idle ones at the handshake deadline and the one that does not
/// read once its socket has taken nothing for the write timeout.
#[test]
fn idle_sockets_and_a_client_that_reads_nothing_do_not_stop_others() {
    use std::net::TcpStream;
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (old, new, cow) = sparse_pair(t);
    let want = std::fs::read(&new).unwrap();
    let server = Server::start(&[
        os("--base"),
        old.as_os_str(),
        os("--cow"),
        cow.as_os_str(),
        os("--nbd"),
        os("tcp:127.0.0.1:0"),
        os("--nbd-handshake-timeout"),
        os("1"),
        os("--nbd-write-timeout"),
        os("1"),
    ]);
    let addr = tcp_address(&server);
    let started = Instant::now();
    let mut idle: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    // 4,000 reads of 1 MiB; the requests (112 KB) fit the sockets' buffers.
    // A regression fails these tests rather than hanging them.
    let bounded = |s: TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    };
    let (mut hog, size) = go(greet(bounded(TcpStream::connect(&addr).unwrap())));
    let mut burst = Vec::new();
    for i in 0..4000u64 {
        request(&mut burst, 0, i, (i % 8) << 20, 1 << 20);
    }
    hog.write_all(&burst).unwrap();
    let hog_sent = Instant::now();
    std::thread::sleep(Duration::from_millis(300));

    let t0 = Instant::now();
    let (mut good, got_size) = go(greet(bounded(TcpStream::connect(&addr).unwrap())));
    assert_eq!((got_size, size), (want.len() as u64, want.len() as u64));
    for i in 0..8u64 {
        let off = i << 20;
        request(&mut good, 0, i, off, 1 << 20);
        assert_eq!(reply(&mut good), (0, i));
        let mut data = vec![0u8; 1 << 20];
        good.read_exact(&mut data).unwrap();
        assert!(
            data[..] == want[off as usize..][..1 << 20],
            "1 MiB at {off}"
        );
    }
    let waited = t0.elapsed();
    eprintln!("beside 100 idle sockets and a client reading nothing: 8 MiB in {waited:?}");
    assert!(
        waited < Duration::from_secs(1),
        "the whole 8 MiB image took {waited:?}"
    );

    // Past the handshake deadline every idle socket is closed; past the write timeout,
    // so is the client that reads nothing.
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(hog_sent.elapsed()));
    for (i, c) in idle.iter_mut().enumerate() {
        assert!(
            closed_by_server(c, Duration::from_secs(2)),
            "idle socket {i} still open after {:?}",
            started.elapsed()
        );
    }
    assert!(
        closed_by_server(&mut hog, Duration::from_secs(3)),
        "a client that reads nothing is still served"
    );
    // The well-behaved client is neither.
    request(&mut good, 0, 99, 12345, 4096);
    assert_eq!(reply(&mut good), (0, 99));
    let mut data = vec![0u8; 4096];
    good.read_exact(&mut data).unwrap();
    assert!(data[..] == want[12345..12345 + 4096]);
    drop(good);
    assert!(server.stop().success());
}

/// `openssl` with `args`, which must succeed.
fn openssl(args: &[&std::ffi::OsStr]) {
    let (ok, out) = run(Command::new("openssl").args(args));
    assert!(ok, "openssl {args:?}: {out}");
}

/// A CA (certificate and key) in `dir` as `name.pem` and `name.key`, whose subject is
/// `/CN=cn`.
fn make_ca(dir: &Path, name: &str, cn: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    openssl(&[
        os("req"),
        os("-x509"),
        os("-newkey"),
        os("ec"),
        os("-pkeyopt"),
        os("ec_paramgen_curve:P-256"),
        os("-nodes"),
        os("-days"),
        os("2"),
        os("-subj"),
        os(&format!("/CN={cn}")),
        os("-keyout"),
        key.as_os_str(),
        os("-out"),
        cert.as_os_str(),
    ]);
    (cert, key)
}

/// A certificate issued by `ca` to `cn` with the extensions `ext` (an openssl
/// extension file's lines), written to `cert` with its key at `key`.
fn issue(
    ca: &(std::path::PathBuf, std::path::PathBuf),
    cn: &str,
    ext: &str,
    cert: &Path,
    key: &Path,
) {
    let csr = cert.with_extension("csr");
    let extfile = cert.with_extension("ext");
    std::fs::write(&extfile, format!("basicConstraints=CA:FALSE\n{ext}\n")).unwrap();
    openssl(&[
        os("req"),
        os("-new"),
        os("-newkey"),
        os("ec"),
        os("-pkeyopt"),
        os("ec_paramgen_curve:P-256"),
        os("-nodes"),
        os("-subj"),
        os(&format!("/CN={cn}")),
        os("-keyout"),
        key.as_os_str(),
        os("-out"),
        csr.as_os_str(),
    ]);
    openssl(&[
        os("x509"),
        os("-req"),
        os("-in"),
        csr.as_os_str(),
        os("-CA"),
        ca.0.as_os_str(),
        os("-CAkey"),
        ca.1.as_os_str(),
        os("-set_serial"),
        os(&fastrand::u32(1..).to_string()),
        os("-days"),
        os("2"),
        os("-extfile"),
        extfile.as_os_str(),
        os("-out"),
        cert.as_os_str(),
    ]);
}

/// With `--nbd-tls-verify-peer CA.pem`, a client with a certificate from that CA reads
/// the new image; one with no certificate, or one from another CA, fails the TLS
/// handshake and learns nothing, not even the size.
#[test]
fn tls_clients_need_a_certificate_from_the_named_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (old, new, cow) = sparse_pair(t);
    let ca = make_ca(t, "ca", "vabc test CA");
    // Named as the real one, so that the client (GnuTLS sends a certificate only to a
    // server asking for its issuer's name) presents its certificate: the signature is
    // what must fail.
    let other_ca = make_ca(t, "other-ca", "vabc test CA");
    let (server_cert, server_key) = (t.join("server.pem"), t.join("server.key"));
    issue(
        &ca,
        "localhost",
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost",
        &server_cert,
        &server_key,
    );
    // libnbd's (GnuTLS') layout: DIR/ca-cert.pem, client-cert.pem, client-key.pem.
    let client_dir = |name: &str, issuer: Option<&(std::path::PathBuf, std::path::PathBuf)>| {
        let d = t.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(&ca.0, d.join("ca-cert.pem")).unwrap();
        if let Some(issuer) = issuer {
            issue(
                issuer,
                name,
                "extendedKeyUsage=clientAuth",
                &d.join("client-cert.pem"),
                &d.join("client-key.pem"),
            );
        }
        d
    };
    let trusted = client_dir("trusted", Some(&ca));
    let foreign = client_dir("foreign", Some(&other_ca));
    let anonymous = client_dir("anonymous", None);
    let log = t.join("serve.log");
    let server = Server::start_logged(
        &[
            os("--base"),
            old.as_os_str(),
            os("--cow"),
            cow.as_os_str(),
            os("--nbd"),
            os("tcp:127.0.0.1:0"),
            os("--nbd-tls-cert"),
            server_cert.as_os_str(),
            os("--nbd-tls-key"),
            server_key.as_os_str(),
            os("--nbd-tls-verify-peer"),
            ca.0.as_os_str(),
        ],
        &log,
    );
    let addr = tcp_address(&server);
    let uri = |dir: &Path| format!("nbds://{addr}/vabc?tls-certificates={}", dir.display());

    let copy = t.join("copy.img");
    let (ok, out) = run(Command::new("nbdcopy").arg(uri(&trusted)).arg(&copy));
    assert!(ok, "nbdcopy with a certificate from the CA: {out}");
    assert_eq!(sha256_file(&copy), sha256_file(&new));

    for (who, dir) in [("no certificate", &anonymous), ("another CA's", &foreign)] {
        let (ok, out) = run(Command::new("nbdinfo").arg(uri(dir)));
        assert!(!ok, "a client with {who} was served: {out}");
        assert!(!out.contains("export-size"), "{who}: {out}");
        let refused = t.join("refused.img");
        let (ok, out) = run(Command::new("nbdcopy").arg(uri(dir)).arg(&refused));
        assert!(!ok, "nbdcopy with {who} copied: {out}");
        assert!(
            std::fs::metadata(&refused).map_or(0, |m| m.len()) == 0,
            "{who}: bytes were copied"
        );
    }
    // Nor, of course, does a client without TLS.
    let (ok, out) = run(Command::new("nbdinfo").arg(format!("nbd://{addr}/vabc")));
    assert!(!ok && !out.contains("export-size"), "plaintext: {out}");
    assert!(server.stop().success());
    // Each refused for its own reason.
    let log = std::fs::read_to_string(&log).unwrap();
    for why in ["peer sent no certificates", "invalid peer certificate"] {
        assert!(log.contains(why), "no {why:?} in the log: {log}");
    }
}
