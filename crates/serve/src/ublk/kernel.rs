//! The real kernel side: control commands on `/dev/ublk-control` and per-queue
//! fetch/commit commands on `/dev/ublkcN`, all as io_uring `IORING_OP_URING_CMD`s.
//!
//! Tested on a real kernel in the VM tier only; see the module documentation of
//! [`super`].

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use io_uring::{IoUring, cqueue, opcode, squeue, types};

use super::queue::{IoDesc, QueueEvent, QueueTransport, Waker};
use super::{DeviceParams, UblkError, UblkTransport, sys};

/// A device on the kernel's ublk driver.
pub struct KernelTransport {
    ctrl: File,
    /// `None` once a command could not be submitted: its SQE may still sit in the ring,
    /// pointing at a buffer that is gone, so the ring must not be entered again.
    ring: Mutex<Option<IoUring<squeue::Entry128, cqueue::Entry>>>,
    added: OnceLock<(u32, DeviceParams)>,
    /// `/dev/ublkcN`, opened by the first queue and shared by all: the driver allows
    /// one open of a device's char node at a time (a second gets `EBUSY`), and every
    /// queue's commands and descriptor mapping go through that one file.
    cdev: Mutex<Option<Arc<File>>>,
}

impl KernelTransport {
    /// Opens the control device. Fails with [`UblkError::NoDriver`] when the driver is
    /// not loaded, before anything else is set up.
    pub fn open() -> Result<KernelTransport, UblkError> {
        let path = Path::new(sys::CONTROL_PATH);
        let ctrl = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| match source.kind() {
                io::ErrorKind::NotFound => UblkError::NoDriver { path: path.into() },
                _ => UblkError::Io(vabc_io::Error::new("open", path, source)),
            })?;
        // 128-byte SQEs: a control command is 32 bytes, more than the 16 of a plain SQE.
        let ring = vabc_io::ring::new::<squeue::Entry128, cqueue::Entry>(4).map_err(|source| {
            UblkError::Io(vabc_io::Error::new("set up io_uring for", path, source))
        })?;
        Ok(KernelTransport {
            ctrl,
            ring: Mutex::new(Some(ring)),
            added: OnceLock::new(),
            cdev: Mutex::new(None),
        })
    }

    fn dev_id(&self) -> u32 {
        self.added.get().map_or(u32::MAX, |a| a.0)
    }

    /// Issues one control command and waits for its completion. `buf` is the command's
    /// in/out buffer.
    fn ctrl_cmd(
        &self,
        cmd: &'static str,
        nr: u8,
        dev_id: u32,
        buf: Option<&mut [u8]>,
        data: u64,
    ) -> Result<i32, UblkError> {
        let fail = |source: io::Error| UblkError::Command {
            cmd,
            dev_id,
            source,
        };
        let (addr, len) = match buf {
            Some(b) => (b.as_mut_ptr() as u64, b.len() as u16),
            None => (0, 0),
        };
        let payload = sys::CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            len,
            addr,
            data,
        }
        .to_sqe_cmd();
        let sqe = opcode::UringCmd80::new(types::Fd(self.ctrl.as_raw_fd()), sys::ctrl_op(nr))
            .cmd(payload)
            .build()
            .user_data(nr as u64);
        let mut guard = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let Some(ring) = guard.as_mut() else {
            return Err(fail(io::Error::other(
                "the control ring is unusable after an earlier failure",
            )));
        };
        // SAFETY: the SQE points at `buf`, which the caller keeps borrowed until this
        // function returns; we return only after its completion has been reaped, or after
        // dropping the ring (below) when the SQE could not be submitted.
        let pushed = unsafe { ring.submission().push(&sqe) };
        if pushed.is_err() {
            return Err(fail(io::Error::other("control ring full")));
        }
        loop {
            if let Err(e) = engine::io_uring_enter(ring, 1) {
                *guard = None;
                return Err(fail(e));
            }
            if let Some(cqe) = ring.completion().next() {
                let res = cqe.result();
                if res < 0 {
                    return Err(fail(io::Error::from_raw_os_error(-res)));
                }
                return Ok(res);
            }
        }
    }
}

impl KernelTransport {
    /// Removes device `dev_id` that a killed daemon left behind: `STOP_DEV` (which
    /// fails harmlessly when the driver already stopped it), then `DEL_DEV`.
    pub fn delete_leftover(&self, dev_id: u32) -> Result<(), UblkError> {
        if !Path::new(&format!("/sys/class/ublk-char/ublkc{dev_id}")).exists() {
            return Ok(());
        }
        let _ = self.ctrl_cmd("STOP_DEV", sys::CMD_STOP_DEV, dev_id, None, 0);
        self.ctrl_cmd("DEL_DEV", sys::CMD_DEL_DEV, dev_id, None, 0)?;
        Ok(())
    }
}

impl UblkTransport for KernelTransport {
    type Queue = KernelQueue;

    fn add_device(&self, params: &DeviceParams) -> Result<u32, UblkError> {
        let mut info = params.dev_info().to_bytes();
        self.ctrl_cmd("ADD_DEV", sys::CMD_ADD_DEV, u32::MAX, Some(&mut info), 0)?;
        let info = sys::DevInfo::from_bytes(&info);
        let _ = self.added.set((info.dev_id, *params));
        Ok(info.dev_id)
    }

    fn set_params(&self, params: &DeviceParams) -> Result<(), UblkError> {
        let mut p = params.basic().to_params_bytes();
        self.ctrl_cmd(
            "SET_PARAMS",
            sys::CMD_SET_PARAMS,
            self.dev_id(),
            Some(&mut p),
            0,
        )?;
        Ok(())
    }

    fn open_queue(&self, q_id: u16) -> Result<KernelQueue, UblkError> {
        let Some(&(dev_id, params)) = self.added.get() else {
            return Err(UblkError::Queue {
                q_id,
                msg: "the device was not added".into(),
            });
        };
        let path = PathBuf::from(format!("/dev/ublkc{dev_id}"));
        let cdev = {
            let mut shared = self.cdev.lock().unwrap_or_else(|p| p.into_inner());
            match &*shared {
                Some(f) => f.clone(),
                None => {
                    let f = Arc::new(open_cdev(&path)?);
                    *shared = Some(f.clone());
                    f
                }
            }
        };
        KernelQueue::open(cdev, path, q_id, params.depth)
    }

    fn start_device(&self) -> Result<(), UblkError> {
        let pid = u64::from(std::process::id());
        self.ctrl_cmd("START_DEV", sys::CMD_START_DEV, self.dev_id(), None, pid)?;
        Ok(())
    }

    fn stop_device(&self) -> Result<(), UblkError> {
        self.ctrl_cmd("STOP_DEV", sys::CMD_STOP_DEV, self.dev_id(), None, 0)?;
        Ok(())
    }

    fn delete_device(&self) -> Result<(), UblkError> {
        // DEL_DEV waits until the char node is released; the queues dropped their
        // handles when they ended, this is the last one.
        self.cdev.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.ctrl_cmd("DEL_DEV", sys::CMD_DEL_DEV, self.dev_id(), None, 0)?;
        Ok(())
    }
}

/// `user_data` of the wake-up poll's completions; a tag's commands carry the tag (< 2^16).
const WAKE: u64 = u64::MAX;

/// Lets other threads wake a thread blocked in `io_uring_enter`: an eventfd that the
/// ring polls (multishot, so one poll serves every wake-up), as libublksrv's queues do.
pub(crate) struct RingWake {
    fd: Arc<File>,
}

impl RingWake {
    pub(crate) fn new() -> io::Result<RingWake> {
        // SAFETY: eventfd takes no pointers; the result is checked before use.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(RingWake {
            fd: Arc::new(File::from(fd)),
        })
    }

    /// The poll to push (again whenever a completion of it lacks `IORING_CQE_F_MORE`).
    pub(crate) fn poll(&self) -> squeue::Entry {
        opcode::PollAdd::new(types::Fd(self.fd.as_raw_fd()), libc::POLLIN as u32)
            .multi(true)
            .build()
            .user_data(WAKE)
    }

    /// Resets the eventfd after the poll fired, so the next wake-up fires it again.
    pub(crate) fn drain(&self) {
        let mut n = [0u8; 8];
        // Nonblocking: EAGAIN when another drain got there first, which is fine.
        let _ = (&*self.fd).read(&mut n);
    }

    pub(crate) fn waker(&self) -> Waker {
        let fd = self.fd.clone();
        Arc::new(move || {
            // Fails only when the counter would overflow, i.e. a wake-up is pending.
            let _ = (&*fd).write(&1u64.to_ne_bytes());
        })
    }
}

/// Opens `/dev/ublkcN`, which appears when udev (or devtmpfs) catches up with ADD_DEV.
fn open_cdev(path: &Path) -> Result<File, UblkError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(UblkError::Io(vabc_io::Error::new("open", path, source)));
            }
        }
    }
}

/// One queue: its share of `/dev/ublkcN`, its descriptor array mapped read-only, and
/// an io_uring.
pub struct KernelQueue {
    cdev: Arc<File>,
    path: PathBuf,
    q_id: u16,
    depth: u16,
    ring: IoUring,
    descs: *const u8,
    map_len: usize,
    /// Buffer address of each tag, given again with each commit.
    addrs: Vec<u64>,
    /// Set by the first [`QueueTransport::waker`] call.
    wake: Option<RingWake>,
}

fn page_size() -> usize {
    // SAFETY: sysconf takes no pointers and has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as usize } else { 4096 }
}

impl KernelQueue {
    fn open(
        cdev: Arc<File>,
        path: PathBuf,
        q_id: u16,
        depth: u16,
    ) -> Result<KernelQueue, UblkError> {
        let page = page_size();
        let map_len = sys::desc_mmap_len(depth, page);
        let offset = sys::desc_mmap_offset(q_id, page);
        // SAFETY: a fresh shared read-only mapping of the driver's descriptor array; we
        // pass no address hint, so no existing memory is affected. The result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                cdev.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(UblkError::Io(vabc_io::Error::new(
                "map the I/O descriptors of",
                path,
                io::Error::last_os_error(),
            )));
        }
        let ring: io::Result<IoUring> = vabc_io::ring::new(u32::from(depth).next_power_of_two());
        let ring = match ring {
            Ok(r) => r,
            Err(source) => {
                // SAFETY: unmapping the mapping made just above, not used anywhere else.
                unsafe { libc::munmap(ptr, map_len) };
                return Err(UblkError::Io(vabc_io::Error::new(
                    "set up io_uring for",
                    path,
                    source,
                )));
            }
        };
        Ok(KernelQueue {
            cdev,
            path,
            q_id,
            depth,
            ring,
            descs: ptr as *const u8,
            map_len,
            addrs: vec![0; depth as usize],
            wake: None,
        })
    }

    fn push(&mut self, nr: u8, tag: u16, result: i32) -> Result<(), UblkError> {
        let cmd = sys::IoCmd {
            q_id: self.q_id,
            tag,
            result,
            addr: self.addrs[tag as usize],
        };
        let sqe = opcode::UringCmd16::new(types::Fd(self.cdev.as_raw_fd()), sys::io_op(nr))
            .cmd(cmd.to_bytes())
            .build()
            .user_data(u64::from(tag));
        self.push_entry(&sqe)
    }

    fn push_entry(&mut self, sqe: &squeue::Entry) -> Result<(), UblkError> {
        loop {
            // SAFETY: a tag's command carries its buffer address, which the queue loop
            // keeps alive and in place until this queue is dropped (see `serve_queue`);
            // the wake-up poll points at the eventfd, which `self.wake` keeps open.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            self.submit(false)?;
        }
    }

    fn submit(&mut self, wait: bool) -> Result<(), UblkError> {
        engine::io_uring_enter(&mut self.ring, usize::from(wait))
            .map(drop)
            .map_err(|source| {
                UblkError::Io(vabc_io::Error::new(
                    "submit queue commands to",
                    &self.path,
                    source,
                ))
            })
    }

    fn desc(&self, tag: u16) -> IoDesc {
        // SAFETY: tag < depth (checked by the caller), so the 24 bytes lie inside the
        // mapping of `depth` descriptors; the driver wrote this one before completing
        // the tag's fetch and leaves it alone until we commit. Volatile: it is shared
        // memory written by the kernel. `[u8; N]` has no alignment requirement.
        let raw: [u8; sys::IO_DESC_SIZE] = unsafe {
            std::ptr::read_volatile(
                self.descs
                    .add(tag as usize * sys::IO_DESC_SIZE)
                    .cast::<[u8; sys::IO_DESC_SIZE]>(),
            )
        };
        let (op_flags, nr_sectors, start_sector) = sys::parse_io_desc(&raw);
        IoDesc {
            op_flags,
            nr_sectors,
            start_sector,
        }
    }
}

impl QueueTransport for KernelQueue {
    fn fetch(&mut self, tag: u16, buf: &mut [u8]) -> Result<(), UblkError> {
        self.addrs[tag as usize] = buf.as_mut_ptr() as u64;
        self.push(sys::IO_FETCH_REQ, tag, -1)?;
        // Submitted now, not at the first wait: START_DEV waits for every tag's fetch.
        self.submit(false)
    }

    fn commit_and_fetch(&mut self, tag: u16, result: i32, buf: &mut [u8]) -> Result<(), UblkError> {
        self.addrs[tag as usize] = buf.as_mut_ptr() as u64;
        self.push(sys::IO_COMMIT_AND_FETCH_REQ, tag, result)
    }

    fn waker(&mut self) -> Result<Waker, UblkError> {
        if let Some(w) = &self.wake {
            return Ok(w.waker());
        }
        let wake = RingWake::new().map_err(|source| {
            UblkError::Io(vabc_io::Error::new(
                "create the wake-up eventfd of",
                &self.path,
                source,
            ))
        })?;
        let (poll, waker) = (wake.poll(), wake.waker());
        self.wake = Some(wake);
        self.push_entry(&poll)?;
        Ok(waker)
    }

    fn wait(&mut self, out: &mut Vec<QueueEvent>) -> Result<(), UblkError> {
        self.submit(true)?;
        let done: Vec<(u64, i32, u32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result(), c.flags()))
            .collect();
        for (data, res, flags) in done {
            if data == WAKE {
                if res < 0 {
                    return Err(UblkError::Queue {
                        q_id: self.q_id,
                        msg: format!(
                            "wake-up poll failed: {}",
                            io::Error::from_raw_os_error(-res)
                        ),
                    });
                }
                if let Some(w) = &self.wake {
                    w.drain();
                    if !cqueue::more(flags) {
                        let poll = w.poll();
                        self.push_entry(&poll)?;
                    }
                }
                continue;
            }
            let tag = data as u16;
            if data >= u64::from(self.depth) {
                return Err(UblkError::Queue {
                    q_id: self.q_id,
                    msg: format!("completion for tag {tag} beyond depth {}", self.depth),
                });
            }
            match res {
                sys::IO_RES_OK => out.push(QueueEvent::Request {
                    tag,
                    desc: self.desc(tag),
                }),
                sys::IO_RES_ABORT => out.push(QueueEvent::Aborted { tag }),
                other => {
                    return Err(UblkError::Queue {
                        q_id: self.q_id,
                        msg: format!(
                            "command for tag {tag} failed: {}",
                            io::Error::from_raw_os_error(-other)
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

impl Drop for KernelQueue {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `open` with this length and is referenced
        // only through `self.descs`, which dies with `self`.
        unsafe { libc::munmap(self.descs as *mut libc::c_void, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wake-up path of a queue without a ublk driver: a plain ring blocked in
    /// `submit_and_wait` returns when another thread wakes it, and the multishot poll
    /// keeps serving later wake-ups after a drain.
    #[test]
    fn ring_wake_ends_a_blocked_wait_and_stays_armed() {
        let mut ring = IoUring::new(4).unwrap();
        let wake = RingWake::new().unwrap();
        // SAFETY: the poll points at the eventfd, which `wake` keeps open past the ring.
        unsafe { ring.submission().push(&wake.poll()).unwrap() };
        ring.submit().unwrap();
        assert!(ring.completion().next().is_none(), "fired with no wake-up");
        for round in 0..3 {
            let waker = wake.waker();
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                waker();
                waker();
            });
            ring.submit_and_wait(1).unwrap();
            let cqes: Vec<_> = ring.completion().collect();
            assert!(!cqes.is_empty(), "round {round}");
            for c in &cqes {
                assert_eq!(c.user_data(), WAKE);
                assert!(c.result() > 0, "round {round}: {}", c.result());
                assert!(
                    cqueue::more(c.flags()),
                    "round {round}: the poll was disarmed"
                );
            }
            t.join().unwrap();
            wake.drain();
            // Drained: nothing more until the next wake-up (a late second one may still
            // have posted; reap it).
            ring.submit().unwrap();
            let _ = ring.completion().count();
        }
    }
}
