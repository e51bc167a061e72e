//! FUSE export of a block device as one read-only regular file, `DIR/disk.img`: one file
//! system (`fs`) behind two transports.
//!
//! * **/dev/fuse** (classic): [`FuseOptions::dev_threads`] threads, each on its own clone
//!   of the connection (`FUSE_DEV_IOC_CLONE`, so the kernel keeps that many requests in
//!   flight), read a request, answer it on the same thread from a page-aligned buffer
//!   and write the answer back: two system calls per request. Handing each request to a
//!   separate pool cost two thread switches per request, which on a small machine was a
//!   third of the CPU of a random 4 KiB read.
//! * **FUSE-over-io_uring** ([`uring`], Linux 6.14+): per-CPU rings, one SQE commits an
//!   answer and fetches the next request. /dev/fuse stays in use for what the kernel
//!   never sends over the rings (FORGET, INTERRUPT, requests before the rings are
//!   ready), read by one thread.
//!
//! Both: files are opened with `FOPEN_DIRECT_IO` (the FUSE layer keeps no page cache of
//! its own; the loop device or file system above us caches: docs/05-serving.md);
//! sequential streams are read ahead in the engine ([`engine::Readahead`]), so a reader
//! at queue depth 1 overlaps its requests with the engine's work; `max_readahead` and
//! `max_write` are 1 MiB so `max_pages` is 256, the kernel's cap, and `FUSE_ASYNC_DIO`
//! lets the loop driver's direct I/O be split into parallel requests.
//!
//! The protocol is spoken here rather than through the `fuser` crate, which refuses
//! FUSE_OVER_IO_URING: one implementation of the file system answers both transports.

pub(crate) mod fs;
pub(crate) mod proto;
pub mod uring;

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engine::{AlignedBuf, BlockDevice, ReadaheadOptions};

use self::fs::{DiskFs, Outcome};
use self::uring::UringOptions;
use crate::mountpoint::free_mount_dir;
use crate::{Result, ServeError, io_err, readahead_for};

/// Largest request the kernel sends with the default `fs.fuse.max_pages_limit`.
pub const MAX_REQUEST: usize = 1 << 20;

/// `FUSE_DEV_IOC_CLONE`, `_IOR(229, 0, uint32_t)`: attaches a fresh /dev/fuse open to
/// an existing connection, so each thread reads requests from its own file.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// Options of [`FuseExport::mount`].
#[derive(Clone, Debug)]
pub struct FuseOptions {
    /// Name of the exported file inside the mount directory.
    pub file_name: String,
    /// Threads answering requests on /dev/fuse, each on its own clone of the
    /// connection: the requests served at once through the classic transport. With
    /// rings ([`FuseOptions::uring`]) one thread reads /dev/fuse whatever this says.
    pub dev_threads: usize,
    /// Serve over FUSE-over-io_uring with these options; `None`: through /dev/fuse.
    pub uring: Option<UringOptions>,
    /// Read ahead of sequential streams (a loop device above us at queue depth 1 waits
    /// for each request before it sends the next); `None` disables it.
    pub readahead: Option<ReadaheadOptions>,
    /// Where the time of each READ, from its arrival to its answer, is recorded.
    pub latency: Arc<trace::Histogram>,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            file_name: "disk.img".into(),
            dev_threads: 16,
            uring: None,
            readahead: Some(ReadaheadOptions::default()),
            latency: Arc::default(),
        }
    }
}

/// Requests answered through each transport since the mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuseStats {
    /// Through the io_uring queues.
    pub via_ring: u64,
    /// Through /dev/fuse.
    pub via_dev: u64,
    /// READs among `via_ring` answered from a read plan, their file reads issued on
    /// the queue thread's ring (the asynchronous design).
    pub planned: u64,
}

/// Requests answered through each transport, for the stop message and the tests.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) ring: AtomicU64,
    pub(crate) dev: AtomicU64,
    /// READs of the ring answered from a read plan (reads on the queue's own ring).
    pub(crate) planned: AtomicU64,
    /// Time of each READ, from its arrival to its answer, through either transport.
    pub(crate) reads: Arc<trace::Histogram>,
}

/// A mounted FUSE export. Dropping it unmounts.
pub struct FuseExport {
    dir: PathBuf,
    file: PathBuf,
    fuse: Arc<File>,
    mounted: bool,
    /// Threads answering on /dev/fuse (and its clones).
    readers: Vec<JoinHandle<()>>,
    /// io_uring queue threads; empty on the classic transport.
    queues: Vec<JoinHandle<()>>,
    /// The asynchronous queues' worker pool; ends after the queue threads.
    workers: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
    queue_count: usize,
}

impl std::fmt::Debug for FuseExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseExport")
            .field("file", &self.file)
            .field("queues", &self.queue_count)
            .finish()
    }
}

impl FuseExport {
    /// Mounts the export on `dir` (an existing directory, not a mount point) and returns
    /// once the kernel answers a request through the chosen transport.
    pub fn mount(dev: Arc<dyn BlockDevice>, dir: &Path, opts: &FuseOptions) -> Result<FuseExport> {
        if opts.uring.is_some() {
            uring::check_enabled()?;
        }
        let dir = free_mount_dir(dir)?;
        let planned = dev.clone();
        let dev: Arc<dyn BlockDevice> = match readahead_for(&dev, opts.readahead.as_ref(), &dir)? {
            Some(ra) => ra,
            None => dev,
        };
        // SAFETY: getuid/getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let fs = Arc::new(DiskFs {
            size: dev.size(),
            dev,
            name: opts.file_name.as_bytes().to_vec(),
            uid,
            gid,
        });
        let fuse = open_dev_fuse()?;
        mount_fuse(&fuse, &dir, uid, gid)?;
        let mut export = FuseExport {
            file: dir.join(&opts.file_name),
            dir,
            fuse: Arc::new(fuse),
            mounted: true,
            readers: Vec::new(),
            queues: Vec::new(),
            workers: Vec::new(),
            counters: Arc::new(Counters {
                reads: opts.latency.clone(),
                ..Counters::default()
            }),
            queue_count: 0,
        };
        // From here on, dropping `export` unmounts.
        export.init(opts.uring.is_some())?;
        let readers = if opts.uring.is_some() {
            1
        } else {
            opts.dev_threads.max(1)
        };
        for i in 0..readers {
            let fuse = match i {
                0 => export.fuse.clone(),
                _ => Arc::new(clone_dev_fuse(&export.fuse, &export.dir)?),
            };
            let name = format!("vabc-fuse-dev{i}");
            let reader = spawn_reader(fuse, fs.clone(), export.counters.clone(), name)?;
            export.readers.push(reader);
        }
        if let Some(u) = &opts.uring {
            uring::start_queues(&mut export, &fs, &planned, u)?;
        }
        export.probe()?;
        Ok(export)
    }

    /// The INIT handshake on /dev/fuse: 1 MiB requests, async direct I/O and, when
    /// `rings`, FUSE_OVER_IO_URING, without which we do not serve.
    fn init(&mut self, rings: bool) -> Result<()> {
        let fail = |msg: String| ServeError::Invalid {
            path: self.dir.clone(),
            msg,
        };
        let mut buf = vec![0u8; MAX_REQUEST + 4096];
        let n = read_request(&self.fuse, &mut buf)
            .map_err(io_err("read FUSE INIT from /dev/fuse for", &self.dir))?
            .ok_or_else(|| fail("FUSE connection closed before INIT".into()))?;
        let h: proto::InHeader = proto::read(&buf[..n])
            .ok_or_else(|| fail(format!("short FUSE request of {n} bytes")))?;
        let init: proto::InitIn = proto::read(&buf[size_of::<proto::InHeader>()..n])
            .filter(|_| h.opcode == proto::INIT)
            .ok_or_else(|| fail(format!("expected FUSE INIT, got opcode {}", h.opcode)))?;
        if init.major != proto::FUSE_KERNEL_VERSION {
            self.reply(h.unique, -libc::EPROTO, &[]);
            return Err(fail(format!(
                "kernel speaks FUSE {}.{}, we speak 7.x",
                init.major, init.minor
            )));
        }
        let caps = init.capabilities();
        if rings && caps & proto::FUSE_OVER_IO_URING == 0 {
            self.reply(h.unique, -libc::ENOSYS, &[]);
            return Err(fail(format!(
                "the kernel did not offer FUSE_OVER_IO_URING in FUSE_INIT (protocol 7.{}); \
                 check that {} is Y",
                init.minor,
                uring::ENABLE_PARAM
            )));
        }
        let mut want = proto::FUSE_ASYNC_READ
            | proto::FUSE_BIG_WRITES
            | proto::FUSE_ASYNC_DIO
            | proto::FUSE_MAX_PAGES
            | proto::FUSE_INIT_EXT;
        if rings {
            want |= proto::FUSE_OVER_IO_URING;
        }
        let flags = want & caps;
        let page = 4096;
        let out = proto::InitOut {
            major: proto::FUSE_KERNEL_VERSION,
            minor: init.minor.min(proto::FUSE_KERNEL_MINOR),
            max_readahead: init.max_readahead.min(MAX_REQUEST as u32),
            flags: flags as u32,
            flags2: (flags >> 32) as u32,
            max_background: 128,
            congestion_threshold: 96,
            max_write: MAX_REQUEST as u32,
            time_gran: 1,
            max_pages: (MAX_REQUEST / page) as u16,
            ..Default::default()
        };
        // The kernel processes the answer inside this write, so the connection is
        // initialised (and accepts clones and ring registrations) once it returns.
        if !self.reply(h.unique, 0, proto::bytes(&out)) {
            return Err(fail("the kernel refused our FUSE INIT answer".into()));
        }
        Ok(())
    }

    fn reply(&self, unique: u64, error: i32, args: &[u8]) -> bool {
        let mut msg = Vec::with_capacity(16 + args.len());
        let h = proto::OutHeader {
            len: (size_of::<proto::OutHeader>() + args.len()) as u32,
            error,
            unique,
        };
        msg.extend_from_slice(proto::bytes(&h));
        msg.extend_from_slice(args);
        (&*self.fuse).write_all(&msg).is_ok()
    }

    /// Stats the file: that blocks in the kernel until the transport is ready and is
    /// answered through it, so returning proves the export works.
    fn probe(&self) -> Result<()> {
        let file = self.file.clone();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(std::fs::metadata(&file));
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(io_err("stat the exported file", &self.file)(e)),
            Err(_) => {
                self.abort_connection();
                Err(ServeError::Invalid {
                    path: self.dir.clone(),
                    msg: "the FUSE export did not answer within 10 s (see dmesg)".into(),
                })
            }
        }
    }

    /// Ends the connection through the fusectl file system, if mounted; unblocks anything
    /// waiting on a ring that never became ready.
    fn abort_connection(&self) {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(&self.dir) {
            let minor = libc::minor(m.dev());
            let _ = std::fs::write(format!("/sys/fs/fuse/connections/{minor}/abort"), "1");
        }
    }

    /// Path of the exported file.
    pub fn file_path(&self) -> &Path {
        &self.file
    }

    /// Where the export is mounted.
    pub fn mount_dir(&self) -> &Path {
        &self.dir
    }

    /// Requests answered so far through the rings and through /dev/fuse.
    pub fn stats(&self) -> FuseStats {
        FuseStats {
            via_ring: self.counters.ring.load(Ordering::Relaxed),
            via_dev: self.counters.dev.load(Ordering::Relaxed),
            planned: self.counters.planned.load(Ordering::Relaxed),
        }
    }

    /// Whether requests go over io_uring.
    pub fn over_io_uring(&self) -> bool {
        !self.queues.is_empty()
    }

    /// io_uring queues (one per possible CPU) and threads serving them; zero and zero on
    /// the classic transport.
    pub fn queues(&self) -> (usize, usize) {
        (self.queue_count, self.queues.len())
    }

    /// Threads answering on /dev/fuse.
    pub fn dev_threads(&self) -> usize {
        self.readers.len()
    }

    /// False once the connection has ended (e.g. unmounted from outside).
    pub fn is_alive(&self) -> bool {
        self.readers.iter().any(|r| !r.is_finished())
    }

    /// Unmounts and waits for the threads to finish.
    pub fn unmount(mut self) -> Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.mounted) {
            return Ok(());
        }
        let result = umount(&self.dir);
        let rings = self.over_io_uring();
        // Unmounting aborts the connection: every ring entry completes with ENOTCONN
        // and reads of /dev/fuse fail with ENODEV, so the threads end by themselves.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut threads: Vec<JoinHandle<()>> = self.queues.drain(..).collect();
        threads.append(&mut self.readers);
        threads.append(&mut self.workers);
        for t in threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                log::warn!("vabc serve: a FUSE thread did not stop; leaving it");
            }
        }
        let s = self.stats();
        if rings {
            log::info!(
                "vabc serve: FUSE over io_uring: {} requests answered via the rings, {} via /dev/fuse",
                s.via_ring,
                s.via_dev
            );
            if s.planned > 0 {
                log::info!(
                    "vabc serve: FUSE over io_uring: {} reads served from read plans on the queue rings",
                    s.planned
                );
            }
        }
        result
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            log::warn!("vabc serve: {e}");
        }
    }
}

fn open_dev_fuse() -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/fuse")
        .map_err(io_err("open", "/dev/fuse"))
}

/// A new /dev/fuse file attached to `fuse`'s connection.
fn clone_dev_fuse(fuse: &File, dir: &Path) -> Result<File> {
    let clone = open_dev_fuse()?;
    let session = fuse.as_raw_fd() as u32;
    // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the session's fd) from the pointer,
    // which points at a live local for the duration of the call.
    let rc = unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE as _, &session) };
    if rc < 0 {
        return Err(io_err("clone the /dev/fuse connection of", dir)(
            io::Error::last_os_error(),
        ));
    }
    Ok(clone)
}

fn mount_fuse(fuse: &File, dir: &Path, uid: u32, gid: u32) -> Result<()> {
    let cdir = CString::new(dir.as_os_str().as_bytes()).map_err(|_| ServeError::Invalid {
        path: dir.to_path_buf(),
        msg: "path contains a NUL byte".into(),
    })?;
    // Read-only, checked by the kernel against the mode bits, and (without allow_other)
    // only for the owner.
    let data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},default_permissions,max_read={MAX_REQUEST}",
        fuse.as_raw_fd()
    );
    let data = CString::new(data).map_err(|_| ServeError::Invalid {
        path: dir.to_path_buf(),
        msg: "bad mount options".into(),
    })?;
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"vabc".as_ptr(),
            cdir.as_ptr(),
            c"fuse.vabc".as_ptr(),
            libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME,
            data.as_ptr().cast(),
        )
    };
    if rc < 0 {
        return Err(io_err("mount FUSE on", dir)(io::Error::last_os_error()));
    }
    Ok(())
}

fn umount(dir: &Path) -> Result<()> {
    let cdir = CString::new(dir.as_os_str().as_bytes()).map_err(|_| ServeError::Invalid {
        path: dir.to_path_buf(),
        msg: "path contains a NUL byte".into(),
    })?;
    // A reader that just finished can hold the mount busy for a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // SAFETY: `cdir` is a NUL-terminated path valid for the call.
        if unsafe { libc::umount2(cdir.as_ptr(), 0) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EBUSY) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100))
            }
            // Already unmounted from outside.
            Some(libc::EINVAL) | Some(libc::ENOENT) => return Ok(()),
            _ => return Err(io_err("unmount FUSE from", dir)(e)),
        }
    }
}

/// One request from /dev/fuse; `None` once the connection is gone.
fn read_request(fuse: &File, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match (&*fuse).read(buf) {
            Ok(n) => return Ok(Some(n)),
            Err(e) => match e.raw_os_error() {
                // ENOENT: the request was interrupted before we read it.
                Some(libc::EINTR | libc::EAGAIN | libc::ENOENT) => continue,
                Some(libc::ENODEV) => return Ok(None),
                _ => return Err(e),
            },
        }
    }
}

/// One /dev/fuse thread: reads a request, answers it and writes the answer back, until
/// the connection ends. With rings, it gets only FORGET/INTERRUPT (never sent over
/// the ring) and whatever the kernel queued before the ring was ready.
fn spawn_reader(
    fuse: Arc<File>,
    fs: Arc<DiskFs>,
    counters: Arc<Counters>,
    name: String,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            // Must hold the largest request (a 1 MiB WRITE and its headers).
            let mut input = vec![0u8; MAX_REQUEST + 4096];
            // Reply header right before a page boundary, so READ data lands aligned
            // (aligned base reads go straight into it with O_DIRECT, no bounce copy).
            let mut output = AlignedBuf::new(4096 + MAX_REQUEST);
            let hdr_at = 4096 - size_of::<proto::OutHeader>();
            loop {
                let n = match read_request(&fuse, &mut input) {
                    Ok(Some(n)) => n,
                    Ok(None) => break,
                    Err(e) => {
                        log::warn!("vabc serve: read /dev/fuse: {e}");
                        break;
                    }
                };
                let received = Instant::now();
                let Some(h) = proto::read::<proto::InHeader>(&input[..n]) else {
                    continue;
                };
                counters.dev.fetch_add(1, Ordering::Relaxed);
                let body = &input[size_of::<proto::InHeader>()..n];
                let (arg, rest) = body.split_at(proto::fixed_arg_size(h.opcode).min(body.len()));
                let out = output.slice_mut(4096 + MAX_REQUEST);
                let (error, len) = match fs.handle(&h, arg, rest, &mut out[4096..]) {
                    Outcome::Reply(len) => (0, len),
                    Outcome::Error(e) => (-e, 0),
                    Outcome::NoReply => continue,
                };
                let oh = proto::OutHeader {
                    len: (size_of::<proto::OutHeader>() + len) as u32,
                    error,
                    unique: h.unique,
                };
                out[hdr_at..4096].copy_from_slice(proto::bytes(&oh));
                if let Err(e) = (&*fuse).write_all(&out[hdr_at..4096 + len]) {
                    match e.raw_os_error() {
                        // The request was interrupted meanwhile.
                        Some(libc::ENOENT) => {}
                        Some(libc::ENODEV) => break,
                        _ => log::warn!("vabc serve: write /dev/fuse: {e}"),
                    }
                }
                if h.opcode == proto::READ {
                    counters.reads.record_since(received);
                }
            }
        })
        .map_err(io_err("spawn the /dev/fuse reader for", "/dev/fuse"))
}
