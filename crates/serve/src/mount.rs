//! The mount stack: FUSE export → (ext4) loop device with direct I/O → `mount -o ro`, or
//! (EROFS) a file-backed mount straight on the FUSE file, with no loop device.
//!
//! Every layer is a guard that undoes itself, and [`MountStack`] drops them in reverse
//! order, so a failure half way leaves nothing mounted or attached. The loop device is
//! also configured with `LO_FLAGS_AUTOCLEAR`, so even if this process dies it detaches as
//! soon as the file system above it is unmounted.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::BlockDevice;

use crate::fuse::{FuseExport, FuseOptions};
use crate::{Result, ServeError, io_err};

/// File systems the stack knows how to mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsType {
    Ext4,
    Erofs,
}

impl FsType {
    pub fn name(self) -> &'static str {
        match self {
            FsType::Ext4 => "ext4",
            FsType::Erofs => "erofs",
        }
    }
}

impl FromStr for FsType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "ext4" => Ok(FsType::Ext4),
            "erofs" => Ok(FsType::Erofs),
            _ => Err(format!(
                "unsupported file system {s:?} (expected ext4 or erofs)"
            )),
        }
    }
}

/// Recognises the file system from its superblock magic (both live in the second KiB).
pub fn detect_fstype(dev: &dyn BlockDevice) -> engine::Result<Option<FsType>> {
    if dev.size() < 2048 {
        return Ok(None);
    }
    let mut sb = [0u8; 2048];
    dev.read_at(&mut sb, 0)?;
    let erofs = u32::from_le_bytes([sb[1024], sb[1025], sb[1026], sb[1027]]);
    let ext = u16::from_le_bytes([sb[1024 + 0x38], sb[1024 + 0x39]]);
    Ok(if erofs == 0xE0F5_E1E2 {
        Some(FsType::Erofs)
    } else if ext == 0xEF53 {
        Some(FsType::Ext4)
    } else {
        None
    })
}

use crate::mountpoint::free_mount_dir;
pub use crate::mountpoint::is_mount_point;

fn cstr(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| ServeError::Invalid {
        path: path.to_path_buf(),
        msg: "path contains a NUL byte".into(),
    })
}

// <linux/loop.h>
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// An attached loop device (`losetup --read-only --direct-io=on`, done with the ioctls).
#[derive(Debug)]
pub struct LoopDevice {
    dev: Option<File>,
    path: PathBuf,
    number: u32,
}

impl LoopDevice {
    /// Attaches `backing` read-only to a free loop device, with direct I/O when `direct`
    /// (falling back to buffered if the backing file refuses it).
    pub fn attach(backing: &Path, direct: bool) -> Result<LoopDevice> {
        let ctl = File::open("/dev/loop-control").map_err(io_err("open", "/dev/loop-control"))?;
        let backing_file =
            File::open(backing).map_err(io_err("open loop backing file", backing))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
            let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
            if n < 0 {
                return Err(io_err("find a free loop device via", "/dev/loop-control")(
                    std::io::Error::last_os_error(),
                ));
            }
            let path = PathBuf::from(format!("/dev/loop{n}"));
            let dev = File::open(&path).map_err(io_err("open", &path))?;
            let mut flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR;
            if direct {
                flags |= LO_FLAGS_DIRECT_IO;
            }
            let mut result = configure(&dev, &backing_file, flags);
            if direct && matches!(&result, Err(e) if e.raw_os_error() == Some(libc::EINVAL)) {
                result = configure(&dev, &backing_file, flags & !LO_FLAGS_DIRECT_IO);
            }
            match result {
                Ok(()) => {
                    return Ok(LoopDevice {
                        dev: Some(dev),
                        path,
                        number: n as u32,
                    });
                }
                // Another process took the device between GET_FREE and CONFIGURE.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                    continue;
                }
                Err(e) => return Err(io_err("attach loop device", &path)(e)),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the kernel actually runs the device in direct-I/O mode.
    pub fn direct_io(&self) -> bool {
        std::fs::read_to_string(format!("/sys/block/loop{}/loop/dio", self.number))
            .is_ok_and(|s| s.trim() == "1")
    }

    /// Whether the device still has a backing file.
    pub fn is_attached(number: u32) -> bool {
        Path::new(&format!("/sys/block/loop{number}/loop/backing_file")).exists()
    }

    pub fn number(&self) -> u32 {
        self.number
    }

    /// Detaches loop device `number` left behind by a killed daemon, if it is still
    /// attached to `backing` (a device since reused for another file is left alone).
    pub fn detach_leftover(number: u32, backing: &Path) -> Result<()> {
        let sys = format!("/sys/block/loop{number}/loop/backing_file");
        let Ok(current) = std::fs::read_to_string(&sys) else {
            return Ok(()); // detached already (autoclear, or someone else)
        };
        // The kernel reports the path it resolved, with " (deleted)" once unlinked.
        let current = current.trim_end_matches('\n');
        let current = current.strip_suffix(" (deleted)").unwrap_or(current);
        if Path::new(current) != backing {
            return Ok(());
        }
        let path = PathBuf::from(format!("/dev/loop{number}"));
        let dev = File::open(&path).map_err(io_err("open", &path))?;
        LoopDevice {
            dev: Some(dev),
            path,
            number,
        }
        .detach()
    }

    /// Detaches the device and waits until the kernel has let go of the backing file.
    pub fn detach(mut self) -> Result<()> {
        self.detach_inner()
    }

    fn detach_inner(&mut self) -> Result<()> {
        let Some(dev) = self.dev.take() else {
            return Ok(());
        };
        // SAFETY: LOOP_CLR_FD takes no argument; the descriptor is open.
        let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD as _) };
        let err = std::io::Error::last_os_error();
        drop(dev);
        // ENXIO: already detached (autoclear ran). While we hold the device open CLR_FD
        // only marks it for removal; the detach completes at the close above.
        if rc < 0 && err.raw_os_error() != Some(libc::ENXIO) {
            return Err(io_err("detach loop device", &self.path)(err));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Self::is_attached(self.number) {
            if Instant::now() > deadline {
                return Err(ServeError::Invalid {
                    path: self.path.clone(),
                    msg: "loop device still attached 5 s after detach".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if let Err(e) = self.detach_inner() {
            log::warn!("vabc serve: {e}");
        }
    }
}

fn configure(dev: &File, backing: &File, flags: u32) -> std::io::Result<()> {
    let mut cfg = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size: 0,
        info: LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: flags,
            lo_file_name: [0; 64],
            lo_crypt_name: [0; 64],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        },
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, whose layout LoopConfig
    // mirrors (repr(C)); the pointer is valid for the call and both fds are open.
    let rc = unsafe {
        libc::ioctl(
            dev.as_raw_fd(),
            LOOP_CONFIGURE as _,
            &mut cfg as *mut LoopConfig,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A read-only mount that is unmounted on drop.
#[derive(Debug)]
pub struct Mounted {
    target: Option<PathBuf>,
}

impl Mounted {
    /// `mount(2)` of `source` on `target` with `MS_RDONLY`.
    pub fn mount(source: &Path, target: &Path, fstype: FsType) -> Result<Mounted> {
        let (src, tgt) = (cstr(source)?, cstr(target)?);
        let fs = CString::new(fstype.name()).map_err(|_| ServeError::Invalid {
            path: target.to_path_buf(),
            msg: "bad fs type".into(),
        })?;
        // SAFETY: all pointers are NUL-terminated strings that outlive the call; data is
        // NULL, which mount(2) accepts.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                tgt.as_ptr(),
                fs.as_ptr(),
                libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID,
                std::ptr::null(),
            )
        };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            return Err(ServeError::Invalid {
                path: target.to_path_buf(),
                msg: format!(
                    "mount -t {} -o ro {} failed: {e}{}",
                    fstype.name(),
                    source.display(),
                    match e.raw_os_error() {
                        Some(libc::EINVAL) => format!(
                            "; the image does not hold a {} file system the kernel accepts: \
                             serve it as a device instead (--fuse, --nbd or --ublk)",
                            fstype.name()
                        ),
                        _ => String::new(),
                    }
                ),
            });
        }
        Ok(Mounted {
            target: Some(target.to_path_buf()),
        })
    }

    pub fn unmount(mut self) -> Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<()> {
        let Some(target) = self.target.take() else {
            return Ok(());
        };
        let t = cstr(&target)?;
        // A reader that just finished (e.g. diff -r) can hold the mount busy for a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // SAFETY: `t` is a NUL-terminated path valid for the call.
            let rc = unsafe { libc::umount2(t.as_ptr(), 0) };
            if rc == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            return Err(io_err("unmount", &target)(e));
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            log::warn!("vabc serve: {e}");
        }
    }
}

/// Options of [`MountStack::mount`].
#[derive(Clone, Debug, Default)]
pub struct MountOptions {
    /// File system; detected from the superblock when `None`.
    pub fstype: Option<FsType>,
    /// Where to mount the FUSE export; a private temporary directory when `None`.
    pub fuse_dir: Option<PathBuf>,
    /// The FUSE export under the stack, with its transport.
    pub fuse: FuseOptions,
}

/// FUSE export + optional loop device + file system mount, torn down in reverse order.
#[derive(Debug)]
pub struct MountStack {
    // Field order is drop order: file system, then loop device, then FUSE, then its dir.
    fs: Option<Mounted>,
    loop_dev: Option<LoopDevice>,
    fuse: Option<FuseExport>,
    temp_dir: Option<PathBuf>,
    fstype: FsType,
    target: PathBuf,
}

impl MountStack {
    pub fn mount(
        dev: Arc<dyn BlockDevice>,
        target: &Path,
        opts: &MountOptions,
    ) -> Result<MountStack> {
        let target = free_mount_dir(target)?;
        let fstype = match opts.fstype {
            Some(f) => f,
            None => detect_fstype(dev.as_ref())?.ok_or_else(|| ServeError::Invalid {
                path: target.clone(),
                msg: "the image holds neither ext4 nor EROFS, the file systems --mount knows; serve it as \
                      a device instead (--fuse, --nbd or --ublk) and mount or read it yourself"
                    .into(),
            })?,
        };
        let mut stack = MountStack {
            fs: None,
            loop_dev: None,
            fuse: None,
            temp_dir: None,
            fstype,
            target: target.clone(),
        };
        let fuse_dir = match &opts.fuse_dir {
            Some(d) => d.clone(),
            None => {
                let d = std::env::temp_dir().join(format!(
                    "vabc-serve-{}-{}",
                    std::process::id(),
                    unique()
                ));
                std::fs::create_dir(&d).map_err(io_err("create", &d))?;
                stack.temp_dir = Some(d.clone());
                d
            }
        };
        let fuse = FuseExport::mount(dev, &fuse_dir, &opts.fuse)?;
        let file = fuse.file_path().to_path_buf();
        stack.fuse = Some(fuse);
        match fstype {
            FsType::Ext4 => {
                let lo = LoopDevice::attach(&file, true)?;
                let lo_path = lo.path().to_path_buf();
                stack.loop_dev = Some(lo);
                stack.fs = Some(Mounted::mount(&lo_path, &target, fstype)?);
            }
            FsType::Erofs => {
                // mount(2) directly: util-linux `mount` would set up a loop device itself.
                stack.fs = Some(Mounted::mount(&file, &target, fstype)?);
            }
        }
        Ok(stack)
    }

    pub fn fstype(&self) -> FsType {
        self.fstype
    }

    pub fn target(&self) -> &Path {
        &self.target
    }

    pub fn loop_device(&self) -> Option<&LoopDevice> {
        self.loop_dev.as_ref()
    }

    /// The FUSE export under the stack.
    pub fn fuse(&self) -> Option<&FuseExport> {
        self.fuse.as_ref()
    }

    /// False once the FUSE session is gone.
    pub fn is_alive(&self) -> bool {
        self.fuse.as_ref().is_some_and(FuseExport::is_alive)
    }

    /// Unmounts everything in reverse order; reports the first failure but still tries
    /// the remaining layers.
    pub fn teardown(mut self) -> Result<()> {
        self.teardown_inner()
    }

    fn teardown_inner(&mut self) -> Result<()> {
        let mut first: Option<ServeError> = None;
        let mut note = |r: Result<()>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        if let Some(fs) = self.fs.take() {
            note(fs.unmount());
        }
        if let Some(lo) = self.loop_dev.take() {
            note(lo.detach());
        }
        if let Some(fuse) = self.fuse.take() {
            note(fuse.unmount());
        }
        if let Some(d) = self.temp_dir.take() {
            note(std::fs::remove_dir(&d).map_err(io_err("remove", &d)));
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for MountStack {
    fn drop(&mut self) {
        if let Err(e) = self.teardown_inner() {
            log::warn!("vabc serve: teardown: {e}");
        }
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_a_mount_point() {
        assert!(is_mount_point(Path::new("/")).unwrap());
        assert!(!is_mount_point(Path::new("/definitely/not/mounted")).unwrap());
    }

    #[test]
    fn loop_config_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
