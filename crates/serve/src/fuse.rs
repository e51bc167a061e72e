//! FUSE export of a block device as one read-only regular file, `DIR/disk.img`.
//!
//! * Reads are served on the thread that took them from /dev/fuse: [`FuseOptions::workers`]
//!   threads each read requests from their own clone of the FUSE fd (so the kernel keeps
//!   that many in flight) and reply from a reusable page-aligned buffer. Handing each
//!   request to a separate pool cost two thread switches per request, which on a small
//!   machine was a third of the CPU of a random 4 KiB read.
//! * Files are opened with `FOPEN_DIRECT_IO`: the FUSE layer keeps no page cache of its
//!   own (the loop device or file system above us caches; notes/serving.md §5.5).
//! * Sequential streams are read ahead in the engine ([`engine::Readahead`]), so a
//!   reader at queue depth 1 overlaps its requests with the engine's work.
//! * `max_readahead`/`max_write` are 1 MiB so `max_pages` is 256, the kernel's cap, and
//!   `FUSE_ASYNC_DIO` lets the loop driver's direct I/O be split into parallel requests.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use engine::{BlockDevice, ReadaheadOptions};
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, InitFlags,
    KernelConfig, LockOwner, MountOption, OpenAccMode, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, Request, SessionACL,
};

use crate::mount::free_mount_dir;
use crate::{DevReadahead, Result, io_err, read_then, readahead_for};

/// Largest request the kernel sends with the default `fs.fuse.max_pages_limit`.
pub const MAX_REQUEST: usize = 1 << 20;

const FILE_INO: INodeNo = INodeNo(2);
// Attributes never change while mounted.
const TTL: Duration = Duration::from_secs(3600);

/// Options of [`FuseExport::mount`].
#[derive(Clone, Debug)]
pub struct FuseOptions {
    /// Name of the exported file inside the mount directory.
    pub file_name: String,
    /// Threads reading requests from /dev/fuse (each with a cloned fd); at least
    /// `workers` are started.
    pub channel_threads: usize,
    /// Requests served at once: each on its own thread, which reads it from /dev/fuse,
    /// serves it and replies.
    pub workers: usize,
    /// Read ahead of sequential streams (a loop device above us at queue depth 1 waits
    /// for each request before it sends the next); `None` disables it.
    pub readahead: Option<ReadaheadOptions>,
    /// Where the time of each READ, from its arrival to its reply, is recorded.
    pub latency: Arc<trace::Histogram>,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions {
            file_name: "disk.img".into(),
            channel_threads: 1,
            workers: 16,
            readahead: Some(ReadaheadOptions::default()),
            latency: Arc::default(),
        }
    }
}

struct DiskFs {
    dev: Arc<dyn BlockDevice>,
    /// `dev` itself when reading ahead: replies come straight from its chunks.
    readahead: Option<Arc<DevReadahead>>,
    size: u64,
    name: String,
    uid: u32,
    gid: u32,
    latency: Arc<trace::Histogram>,
}

impl DiskFs {
    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, size, nlink) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o555, 0, 2),
            FILE_INO => (FileType::RegularFile, 0o444, self.size, 1),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            flags: 0,
            blksize: self.dev.block_size(),
        })
    }
}

thread_local! {
    // One reply buffer per FUSE thread, page-aligned so aligned base reads land in it
    // directly (O_DIRECT, no bounce copy), allocated on the thread's first read.
    static REPLY_BUF: std::cell::RefCell<engine::AlignedBuf> =
        std::cell::RefCell::new(engine::AlignedBuf::default());
}

fn serve_read(fs: &DiskFs, reply: ReplyData, offset: u64, want: u32) {
    if offset >= fs.size {
        reply.data(&[]);
        return;
    }
    let n = (u64::from(want)).min(fs.size - offset) as usize;
    REPLY_BUF.with(|cell| {
        // A re-entrant call cannot happen (nothing below calls back into FUSE); use a
        // fresh buffer rather than panic if it ever did.
        let mut fresh;
        let mut guard;
        let buf: &mut engine::AlignedBuf = match cell.try_borrow_mut() {
            Ok(g) => {
                guard = g;
                &mut guard
            }
            Err(_) => {
                fresh = engine::AlignedBuf::default();
                &mut fresh
            }
        };
        // Sized for the largest request once, so it is never reallocated.
        let out = &mut buf.slice_mut(n.max(MAX_REQUEST))[..n];
        let mut reply = Some(reply);
        let result = read_then(&*fs.dev, fs.readahead.as_deref(), out, offset, |data| {
            if let Some(r) = reply.take() {
                r.data(data)
            }
        });
        if let Err(e) = result {
            log::warn!("vabc serve: FUSE read of {n} bytes at offset {offset}: {e}");
            if let Some(r) = reply.take() {
                r.error(Errno::from_i32(e.errno()));
            }
        }
    });
}

impl Filesystem for DiskFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let want = MAX_REQUEST as u32;
        let _ = config
            .set_max_readahead(want)
            .or_else(|max| config.set_max_readahead(max));
        let _ = config.set_max_write(want);
        let _ = config.set_max_background(128);
        let _ = config.set_congestion_threshold(96);
        if config.capabilities().contains(InitFlags::FUSE_ASYNC_DIO) {
            let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (parent, self.attr(FILE_INO)) {
            (INodeNo::ROOT, Some(attr)) if name == OsStr::new(&self.name) => {
                reply.entry(&TTL, &attr, fuser::Generation(0))
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            reply.error(Errno::EISDIR);
        } else if flags.acc_mode() != OpenAccMode::O_RDONLY {
            reply.error(Errno::EROFS);
        } else {
            reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE_INO {
            reply.error(Errno::EISDIR);
            return;
        }
        let start = std::time::Instant::now();
        serve_read(self, reply, offset, size);
        self.latency.record_since(start);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lo: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.dev.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e.errno())),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let found = match u64::try_from(offset) {
            Ok(o) if ino == FILE_INO => crate::fuse_uring::fs::seek_whence(&*self.dev, o, whence),
            _ => Err(libc::EINVAL),
        };
        match found {
            // Below the device size, which is an i64 file size.
            Ok(o) => reply.offset(o as i64),
            Err(e) => reply.error(Errno::from_i32(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            reply.error(Errno::ENOTDIR);
            return;
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (FILE_INO, FileType::RegularFile, self.name.as_str()),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// A mounted FUSE export. Dropping it unmounts.
pub struct FuseExport {
    session: Option<fuser::BackgroundSession>,
    dir: PathBuf,
    file: PathBuf,
}

impl std::fmt::Debug for FuseExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseExport")
            .field("file", &self.file)
            .finish()
    }
}

impl FuseExport {
    /// Mounts the export on `dir`, which must be an existing directory and not already a
    /// mount point. Returns once the kernel has completed the FUSE handshake.
    pub fn mount(dev: Arc<dyn BlockDevice>, dir: &Path, opts: &FuseOptions) -> Result<FuseExport> {
        let dir = free_mount_dir(dir)?;
        let readahead = readahead_for(&dev, opts.readahead.as_ref(), &dir)?;
        let dev: Arc<dyn BlockDevice> = match &readahead {
            Some(ra) => ra.clone(),
            None => dev,
        };
        let size = dev.size();
        // SAFETY: getuid/getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let fs = DiskFs {
            dev,
            readahead,
            size,
            name: opts.file_name.clone(),
            uid,
            gid,
            latency: opts.latency.clone(),
        };
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::RO,
            MountOption::FSName("vabc".into()),
            MountOption::Subtype("vabc".into()),
            MountOption::NoAtime,
            MountOption::DefaultPermissions,
        ];
        config.acl = SessionACL::Owner;
        let threads = opts.channel_threads.max(opts.workers).max(1);
        config.n_threads = Some(threads);
        config.clone_fd = threads > 1;
        let session = fuser::Session::new(fs, &dir, &config)
            .and_then(|s| s.spawn())
            .map_err(io_err("mount FUSE on", &dir))?;
        let file = dir.join(&opts.file_name);
        Ok(FuseExport {
            session: Some(session),
            dir,
            file,
        })
    }

    /// Path of the exported file.
    pub fn file_path(&self) -> &Path {
        &self.file
    }

    pub fn mount_dir(&self) -> &Path {
        &self.dir
    }

    /// False once the session has ended (e.g. unmounted from outside).
    pub fn is_alive(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|s| !s.guard.is_finished())
    }

    /// Unmounts and waits for the session threads to finish.
    pub fn unmount(mut self) -> Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        session
            .umount_and_join()
            .map_err(io_err("unmount FUSE from", &self.dir))
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            log::warn!("vabc serve: {e}");
        }
    }
}
