//! FUSE export of a block device as one read-only file, `DIR/disk.img`, served through
//! FUSE-over-io_uring (Linux 6.14+, `CONFIG_FUSE_IO_URING`, module parameter
//! `fuse.enable_uring=Y`).
//!
//! The classic frontend ([`crate::fuse`]) pays two system calls and a hand-over to a
//! worker thread per request, which bounds random 4 KiB reads on a small machine
//! (notes/serving.md). Here the kernel hands each request to a ring entry of the
//! issuing CPU's queue; the queue's thread answers it straight into the entry's payload
//! buffer, and commits the answer and fetches the next request in one SQE.
//!
//! By default the queue threads are asynchronous (`async_queue`): one thread per
//! queue holds many entries, issues the base-image and COW reads of small READs on its
//! own ring and never blocks on them; large READs go to a worker pool. Measured on the
//! corpus `system` pair through a loop device (2 vCPUs, bench/serve.sh, machine shared
//! with other jobs): rand 4K QD32 costs the daemon 13-14 µs of CPU per request against
//! 28-31 µs with the synchronous threads (8 per queue, one entry each), for 1.4x the
//! IOPS in the same runs; sequential 1 MiB reads showed no difference beyond the noise.
//! The synchronous design stays selectable ([`UringOptions::synchronous`]).
//!
//! The `fuser` crate refuses FUSE_OVER_IO_URING, so this speaks the protocol on
//! /dev/fuse itself (`proto`): mount(2) with `fd=N`, INIT, then one ring per queue
//! thread (`ring`). /dev/fuse stays in use for what the kernel never sends over the
//! ring (FORGET, INTERRUPT, requests before the ring is ready), read by one thread.
//! The file system (`fs`) answers like the classic frontend.

mod async_queue;
pub(crate) mod fs;
pub(crate) mod proto;
mod ring;
#[cfg(test)]
mod tests_async;

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engine::{AlignedBuf, BlockDevice, ReadaheadOptions};

use self::fs::{DiskFs, Outcome};
use self::ring::{Counters, QueueThread};
use crate::fuse::MAX_REQUEST;
use crate::mount::free_mount_dir;
use crate::{Result, ServeError, io_err, readahead_for};

/// Where the kernel's switch lives.
pub const ENABLE_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Options of [`FuseUringExport::mount`].
#[derive(Clone, Debug)]
pub struct UringOptions {
    /// Name of the exported file inside the mount directory.
    pub file_name: String,
    /// Asynchronous queue threads (the default): each thread keeps many requests in
    /// flight, issuing their base-image and COW reads on its own ring
    /// (`async_queue`); large READs and devices that cannot plan reads go to
    /// `sync_workers` threads. Off: every thread answers one request at a time,
    /// blocking in the engine, so each queue needs many threads.
    pub async_reads: bool,
    /// Threads per queue (one queue per possible CPU), each with its own ring. In the
    /// synchronous design the engine blocks while it reads, so this is the number of
    /// requests of one CPU served at once; asynchronous threads need only one.
    pub threads_per_queue: usize,
    /// Ring entries per thread (each with a 1 MiB payload buffer): the requests a
    /// thread holds at once. Synchronous threads want one: the kernel hands a request
    /// to any available entry of the queue, and a second entry of a busy thread would
    /// make it wait for that thread although others are idle. Requests beyond the
    /// entries wait in the kernel and go to the next entry that commits.
    pub entries_per_thread: usize,
    /// Asynchronous design: threads that serve the READs the queue threads do not plan
    /// (large ones, through the readahead, and those of devices without a planner).
    pub sync_workers: usize,
    /// Read ahead of sequential streams, as in [`crate::fuse::FuseOptions`].
    pub readahead: Option<ReadaheadOptions>,
    /// Pin each queue's threads to the queue's CPU (the kernel queues a request on the
    /// queue of the CPU that issued it). Off by default: under a loop device nearly all
    /// requests come from its one worker, so from one CPU at a time, and pinned threads
    /// leave the other CPUs idle (2 vCPUs, bench/serve.sh, synchronous design: rand 4K
    /// QD32 24.7k pinned vs 32-35k unpinned, seq 1M QD8 810-900 vs 880-1050 MiB/s; not
    /// measured with the asynchronous threads, which also leave the readahead and the
    /// workers unpinned).
    pub pin: bool,
    /// How long an asynchronous queue thread polls its ring before sleeping while
    /// one of its small reads is in flight (zero: never). See `async_queue` for why.
    pub poll: Duration,
    /// Where the time of each READ, from its arrival to its answer, is recorded.
    pub latency: Arc<trace::Histogram>,
}

/// Default of [`UringOptions::poll`], chosen by measurement (bench/RESULTS.md, fifteenth
/// session).
pub const DEFAULT_POLL: Duration = Duration::from_micros(50);

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            file_name: "disk.img".into(),
            async_reads: true,
            threads_per_queue: 1,
            entries_per_thread: 32,
            sync_workers: 8,
            readahead: Some(ReadaheadOptions::default()),
            pin: false,
            poll: DEFAULT_POLL,
            latency: Arc::default(),
        }
    }
}

impl UringOptions {
    /// `workers` threads that may block in the device: the worker pool of the
    /// asynchronous design.
    pub fn with_workers(workers: usize) -> UringOptions {
        UringOptions {
            sync_workers: workers.max(1),
            ..UringOptions::default()
        }
    }

    /// The synchronous design with `workers` request threads in all, spread over the
    /// queues (one per possible CPU), one entry each.
    pub fn synchronous(workers: usize) -> UringOptions {
        let queues = possible_cpus().unwrap_or(1).max(1);
        UringOptions {
            async_reads: false,
            threads_per_queue: workers.div_ceil(queues).max(1),
            entries_per_thread: 1,
            ..UringOptions::default()
        }
    }
}

/// Requests answered through each transport since the mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UringStats {
    pub via_ring: u64,
    pub via_dev: u64,
    /// READs among `via_ring` answered from a read plan, their file reads issued on
    /// the queue thread's ring (the asynchronous design).
    pub planned: u64,
}

/// Whether this kernel lets a FUSE server use io_uring (see [`support`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UringSupport {
    /// [`ENABLE_PARAM`] is on: servers that ask for rings get them.
    Enabled,
    /// Built in but switched off (the kernel's default): root can turn it on.
    Disabled,
    /// The kernel has no FUSE over io_uring (before 6.14, or built without
    /// CONFIG_FUSE_IO_URING).
    Absent,
}

/// Whether this process can create io_uring instances at all (they can be disabled by
/// `kernel.io_uring_disabled` or a seccomp filter); the error says why not.
pub fn rings_usable() -> Result<()> {
    engine::io_uring_usable().map_err(|e| ServeError::Invalid {
        path: "/proc/sys/kernel/io_uring_disabled".into(),
        msg: format!(
            "cannot create an io_uring instance ({e}): io_uring is disabled for this \
             process, by that setting or by a seccomp filter"
        ),
    })
}

/// What [`ENABLE_PARAM`] says right now; an error only when it exists and cannot be read.
pub fn support() -> Result<UringSupport> {
    match std::fs::read_to_string(ENABLE_PARAM) {
        Ok(v) if matches!(v.trim(), "Y" | "1") => Ok(UringSupport::Enabled),
        Ok(_) => Ok(UringSupport::Disabled),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(UringSupport::Absent),
        Err(e) => Err(io_err("read", ENABLE_PARAM)(e)),
    }
}

/// Whether the kernel accepts FUSE-over-io_uring servers right now; an error when it
/// cannot (parameter absent or off), saying how to turn it on.
pub fn check_enabled() -> Result<()> {
    let path = Path::new(ENABLE_PARAM);
    match support()? {
        UringSupport::Enabled => Ok(()),
        UringSupport::Disabled => Err(ServeError::Invalid {
            path: path.into(),
            msg: "FUSE over io_uring is disabled in the kernel; enable it with \
                  `echo Y > /sys/module/fuse/parameters/enable_uring` (as root), \
                  or let `vabc serve` choose (`--fuse-transport auto`, the default)"
                .into(),
        }),
        UringSupport::Absent => Err(ServeError::Invalid {
            path: path.into(),
            msg: "this kernel has no FUSE over io_uring (needs Linux 6.14+ built with \
                  CONFIG_FUSE_IO_URING); serve with `--fuse-transport classic` or `auto`"
                .into(),
        }),
    }
}

/// Queue ids the kernel expects: one per possible CPU (`num_possible_cpus()`), and the
/// ring is ready only when every one of them has an entry.
fn possible_cpus() -> Result<usize> {
    let path = "/sys/devices/system/cpu/possible";
    let s = std::fs::read_to_string(path).map_err(io_err("read", path))?;
    parse_cpu_list(s.trim()).ok_or_else(|| ServeError::Invalid {
        path: path.into(),
        msg: format!("cannot parse CPU list {:?}", s.trim()),
    })
}

/// Counts the CPUs of a list like `0-3,5,7-8`.
fn parse_cpu_list(s: &str) -> Option<usize> {
    let mut n = 0;
    for part in s.split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => {
                b.parse::<usize>()
                    .ok()?
                    .checked_sub(a.parse::<usize>().ok()?)?
                    + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    Some(n)
}

/// A mounted FUSE-over-io_uring export. Dropping it unmounts.
pub struct FuseUringExport {
    dir: PathBuf,
    file: PathBuf,
    fuse: Arc<File>,
    mounted: bool,
    reader: Option<JoinHandle<()>>,
    queues: Vec<JoinHandle<()>>,
    /// The asynchronous design's worker pool; ends after the queue threads.
    workers: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
    queue_count: usize,
}

impl std::fmt::Debug for FuseUringExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseUringExport")
            .field("file", &self.file)
            .field("queues", &self.queue_count)
            .finish()
    }
}

impl FuseUringExport {
    /// Mounts the export on `dir` (an existing directory, not a mount point) and returns
    /// once the kernel serves requests over the rings.
    pub fn mount(
        dev: Arc<dyn BlockDevice>,
        dir: &Path,
        opts: &UringOptions,
    ) -> Result<FuseUringExport> {
        check_enabled()?;
        let dir = free_mount_dir(dir)?;
        let queue_count = possible_cpus()?;
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
        let fuse = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/fuse")
            .map_err(io_err("open", "/dev/fuse"))?;
        mount_fuse(&fuse, &dir, uid, gid)?;
        let mut export = FuseUringExport {
            file: dir.join(&opts.file_name),
            dir,
            fuse: Arc::new(fuse),
            mounted: true,
            reader: None,
            queues: Vec::new(),
            workers: Vec::new(),
            counters: Arc::new(Counters {
                reads: opts.latency.clone(),
                ..Counters::default()
            }),
            queue_count,
        };
        // From here on, dropping `export` unmounts.
        export.init()?;
        export.reader = Some(spawn_reader(
            export.fuse.clone(),
            fs.clone(),
            export.counters.clone(),
        )?);
        export.start_queues(&fs, &planned, opts)?;
        export.probe()?;
        Ok(export)
    }

    /// The INIT handshake on /dev/fuse: 1 MiB requests, async direct I/O, and
    /// FUSE_OVER_IO_URING, without which we do not serve.
    fn init(&mut self) -> Result<()> {
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
        if caps & proto::FUSE_OVER_IO_URING == 0 {
            self.reply(h.unique, -libc::ENOSYS, &[]);
            return Err(fail(format!(
                "the kernel did not offer FUSE_OVER_IO_URING in FUSE_INIT (protocol 7.{}); \
                 check that {ENABLE_PARAM} is Y",
                init.minor
            )));
        }
        let want = proto::FUSE_ASYNC_READ
            | proto::FUSE_BIG_WRITES
            | proto::FUSE_ASYNC_DIO
            | proto::FUSE_MAX_PAGES
            | proto::FUSE_INIT_EXT
            | proto::FUSE_OVER_IO_URING;
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
        // initialised (and accepts ring registrations) once it returns.
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

    fn start_queues(
        &mut self,
        fs: &Arc<DiskFs>,
        planned: &Arc<dyn BlockDevice>,
        opts: &UringOptions,
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        let threads = opts.threads_per_queue.max(1);
        // Only the queue threads hold senders, so the workers end after them.
        let jobs = if opts.async_reads {
            let (jobs, queue) = crossbeam_channel::unbounded();
            self.workers = async_queue::spawn_workers(opts.sync_workers, fs, &queue)
                .map_err(io_err("spawn FUSE worker threads for", &self.dir))?;
            Some(jobs)
        } else {
            None
        };
        for qid in 0..self.queue_count {
            for t in 0..threads {
                let q = QueueThread {
                    fuse: self.fuse.clone(),
                    fs: fs.clone(),
                    counters: self.counters.clone(),
                    qid: qid as u16,
                    cpu: opts.pin.then_some(qid),
                    entries: opts.entries_per_thread.max(1),
                    payload_size: MAX_REQUEST,
                    async_mode: jobs.as_ref().map(|jobs| async_queue::AsyncParts {
                        planned: planned.clone(),
                        jobs: jobs.clone(),
                        poll: opts.poll,
                    }),
                };
                let tx = tx.clone();
                let h = std::thread::Builder::new()
                    .name(format!("vabc-fuse-q{qid}-{t}"))
                    .spawn(move || q.run(tx))
                    .map_err(io_err("spawn FUSE io_uring queue threads for", &self.dir))?;
                self.queues.push(h);
            }
        }
        drop(tx);
        drop(jobs);
        for _ in 0..self.queues.len() {
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(ServeError::Invalid {
                        path: self.dir.clone(),
                        msg: format!(
                            "the kernel refused the FUSE io_uring registration: {e} (see dmesg)"
                        ),
                    });
                }
                Err(_) => {
                    return Err(ServeError::Invalid {
                        path: self.dir.clone(),
                        msg: "FUSE io_uring queue threads did not start".into(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Stats the file: that blocks in the kernel until the ring is ready and is answered
    /// through it, so returning proves the export works.
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
                    msg: "the FUSE io_uring queues did not become ready within 10 s (see dmesg)"
                        .into(),
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

    pub fn mount_dir(&self) -> &Path {
        &self.dir
    }

    /// Requests answered so far through the rings and through /dev/fuse.
    pub fn stats(&self) -> UringStats {
        UringStats {
            via_ring: self.counters.ring.load(Ordering::Relaxed),
            via_dev: self.counters.dev.load(Ordering::Relaxed),
            planned: self.counters.planned.load(Ordering::Relaxed),
        }
    }

    /// Queues (one per possible CPU) and threads serving them.
    pub fn queues(&self) -> (usize, usize) {
        (self.queue_count, self.queues.len())
    }

    /// False once the connection has ended (e.g. unmounted from outside).
    pub fn is_alive(&self) -> bool {
        self.reader.as_ref().is_some_and(|r| !r.is_finished())
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
        let served = !self.queues.is_empty();
        // Unmounting aborts the connection: every ring entry completes with ENOTCONN
        // and reads of /dev/fuse fail with ENODEV, so the threads end by themselves.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut threads: Vec<JoinHandle<()>> = self.queues.drain(..).collect();
        threads.extend(self.reader.take());
        threads.append(&mut self.workers);
        for t in threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                log::warn!("vabc serve: a FUSE io_uring thread did not stop; leaving it");
            }
        }
        let s = self.stats();
        if served {
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

impl Drop for FuseUringExport {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            log::warn!("vabc serve: {e}");
        }
    }
}

fn mount_fuse(fuse: &File, dir: &Path, uid: u32, gid: u32) -> Result<()> {
    let cdir = CString::new(dir.as_os_str().as_bytes()).map_err(|_| ServeError::Invalid {
        path: dir.to_path_buf(),
        msg: "path contains a NUL byte".into(),
    })?;
    // Same options as the classic frontend: read-only, default_permissions, owner only.
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

/// The /dev/fuse side: FORGET/INTERRUPT (never sent over the ring) and whatever the
/// kernel queued before the ring was ready. Ends when the connection does.
fn spawn_reader(
    fuse: Arc<File>,
    fs: Arc<DiskFs>,
    counters: Arc<Counters>,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vabc-fuse-dev".into())
        .spawn(move || {
            // Must hold the largest request (a 1 MiB WRITE and its headers).
            let mut input = vec![0u8; MAX_REQUEST + 4096];
            // Reply header right before a page boundary, so READ data lands aligned.
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
                let Some(h) = proto::read::<proto::InHeader>(&input[..n]) else {
                    continue;
                };
                counters.dev.fetch_add(1, Ordering::Relaxed);
                let body = &input[size_of::<proto::InHeader>()..n];
                let (arg, rest) = body.split_at(proto::fixed_arg_size(h.opcode).min(body.len()));
                let out = output.slice_mut(4096 + MAX_REQUEST);
                let received = std::time::Instant::now();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0-3,5,7-8"), Some(7));
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("3-1"), None);
    }

    #[test]
    fn possible_cpus_covers_the_online_ones() {
        let n = possible_cpus().unwrap();
        assert!(n >= std::thread::available_parallelism().map_or(1, |p| p.get()));
    }
}
