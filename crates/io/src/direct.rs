//! `O_DIRECT`: reading the storage, not the page cache.
//!
//! Two reasons to go around the page cache. A mounted file system may keep its own
//! view of its blocks in the device's cache (a mounted ext4 fills its lazily
//! initialised block bitmaps there, in memory only), so a base partition read through
//! it is not the base on the disk, and a check or a delta computed from it is wrong.
//! And a daemon serving an image under FUSE or a loop device in direct-I/O mode would
//! otherwise keep the last duplicate copy of the data (docs/05-serving.md).
//! `O_DIRECT` transfers must be aligned, so reads of any offset and length go through
//! an aligned bounce buffer.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::buf::AlignedBuf;
use crate::read::ReadAt;

pub use crate::buf::DIRECT_ALIGN;

/// Whether a transfer of `buf` at `offset` meets `O_DIRECT`'s alignment (memory,
/// length and offset).
pub fn is_aligned(buf: &[u8], offset: u64) -> bool {
    (buf.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
        && buf.len().is_multiple_of(DIRECT_ALIGN)
        && offset.is_multiple_of(DIRECT_ALIGN as u64)
}

/// `path` opened with `O_DIRECT` (read-only, or read-write with `write`); `None` when
/// its file system refuses `O_DIRECT` (tmpfs: `EINVAL`).
pub fn open(path: &Path, write: bool) -> io::Result<Option<File>> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A second descriptor of `file`'s inode (through `/proc/self/fd`), opened `O_DIRECT`
/// with the same access mode; `None` where its file system refuses `O_DIRECT`.
pub fn reopen(file: &File) -> io::Result<Option<File>> {
    // SAFETY: F_GETFL on a descriptor we own reads its flags, nothing else.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
    open(
        Path::new(&format!("/proc/self/fd/{}", file.as_raw_fd())),
        writable,
    )
}

/// `path` opened read-only with `O_DIRECT` when it is a block device; `None` for
/// anything else (files are read through the page cache as usual), or when the device
/// refuses `O_DIRECT`.
pub fn open_if_block_device(path: &Path) -> io::Result<Option<File>> {
    if !std::fs::metadata(path)?.file_type().is_block_device() {
        return Ok(None);
    }
    open(path, false)
}

/// Unaligned reads up to this size use the thread's bounce buffer; larger ones get
/// their own.
const BOUNCE_MAX: usize = 1 << 20;

thread_local! {
    static BOUNCE: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::new(2 * DIRECT_ALIGN));
}

/// Fills `buf` from `offset` of `file`, opened with `O_DIRECT`: the aligned range
/// covering it is read into an aligned buffer and the bytes asked for copied out.
/// Fails with `UnexpectedEof` past the end of the file or device.
pub fn read_bounced(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let a = DIRECT_ALIGN as u64;
    let start = offset / a * a;
    let end = (offset + buf.len() as u64).div_ceil(a) * a;
    let len = (end - start) as usize;
    let mut fill = |aligned: &mut [u8]| -> io::Result<()> {
        let mut got = 0;
        // The covering range may run past a device or file whose size is not a multiple
        // of the alignment: a short read there is fine as long as the bytes asked for
        // came.
        let want = (offset - start) as usize + buf.len();
        while got < want {
            match file.read_at(&mut aligned[got..], start + got as u64) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("the data ends before byte {}", offset + buf.len() as u64),
                    ));
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let skip = (offset - start) as usize;
        buf.copy_from_slice(&aligned[skip..skip + buf.len()]);
        Ok(())
    };
    if len > BOUNCE_MAX {
        return fill(&mut AlignedBuf::new(len));
    }
    BOUNCE.with(|b| match b.try_borrow_mut() {
        Ok(mut b) => fill(b.slice_mut(len)),
        Err(_) => fill(&mut AlignedBuf::new(len)),
    })
}

/// When an [`Image`] goes around the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direct {
    /// Never: every read goes through the page cache.
    Never,
    /// Where the file system allows it: aligned reads go straight to the storage,
    /// unaligned ones through a bounce buffer.
    Always,
    /// Only a block device (which a mounted file system may cache its own way).
    BlockDevices,
}

/// A read-only image file or block device, its size, and (with [`Direct`]) a second
/// descriptor opened `O_DIRECT` that every read goes through.
#[derive(Debug)]
pub struct Image {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    size: u64,
}

impl Image {
    /// Opens `path` read-only. A folder is refused (`EISDIR`): it opens for reading
    /// and then reads as a size no image has.
    pub fn open(path: &Path, direct: Direct) -> crate::Result<Image> {
        let err = |op| crate::error::on(op, path);
        let buffered = File::open(path).map_err(err("open"))?;
        let meta = buffered.metadata().map_err(err("stat"))?;
        if meta.is_dir() {
            return Err(err("read")(io::Error::from_raw_os_error(libc::EISDIR)));
        }
        let size = crate::size_of(&buffered).map_err(err("find the size of"))?;
        let direct = match direct {
            Direct::Never => None,
            Direct::Always => open(path, false).ok().flatten(),
            Direct::BlockDevices if meta.file_type().is_block_device() => {
                open(path, false).map_err(err("open"))?
            }
            Direct::BlockDevices => None,
        };
        Ok(Image {
            path: path.to_path_buf(),
            buffered,
            direct,
            size,
        })
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether reads go around the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The descriptor opened through the page cache (for `lseek`, say).
    pub fn buffered(&self) -> &File {
        &self.buffered
    }

    /// The `O_DIRECT` descriptor, when there is one.
    pub fn direct(&self) -> Option<&File> {
        self.direct.as_ref()
    }

    /// The descriptor a read of `parts`, filled in turn from `offset`, can go to as is
    /// (through io_uring, say), or `None` when it needs [`ReadAt::read_exact_at`] part
    /// by part: past the end, or not aligned for `O_DIRECT` (every part must be).
    pub fn fd_for_parts(&self, parts: &[&mut [u8]], offset: u64) -> Option<RawFd> {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if offset.checked_add(len)? > self.size {
            return None;
        }
        match &self.direct {
            None => Some(self.buffered.as_raw_fd()),
            Some(d) => {
                let mut at = offset;
                for p in parts {
                    if !is_aligned(p, at) {
                        return None;
                    }
                    at += p.len() as u64;
                }
                Some(d.as_raw_fd())
            }
        }
    }

    /// The first byte at or after `pos` and before `end` that the file stores (not a
    /// hole), or `None`; `lseek(SEEK_DATA)`. Where the file system cannot tell, all of
    /// it is data.
    pub fn next_data(&self, pos: u64, end: u64) -> Option<u64> {
        match self.seek(pos, libc::SEEK_DATA) {
            Ok(Some(d)) if d < end => Some(d),
            Ok(_) => None,
            Err(_) => Some(pos),
        }
    }

    /// The end of the data at `pos` (the next hole, or the end of the file), at most
    /// `end`; `lseek(SEEK_HOLE)`.
    pub fn data_end(&self, pos: u64, end: u64) -> u64 {
        match self.seek(pos, libc::SEEK_HOLE) {
            Ok(Some(h)) if h > pos => h.min(end),
            _ => end,
        }
    }

    /// `lseek` from `pos`: `None` for ENXIO (nothing of that kind past `pos`).
    fn seek(&self, pos: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
        let pos = libc::off_t::try_from(pos).map_err(io::Error::other)?;
        // SAFETY: lseek takes no pointers. It moves the descriptor's offset, which
        // nothing here uses: every read is positioned.
        let r = unsafe { libc::lseek(self.buffered.as_raw_fd(), pos, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        }
    }
}

impl ReadAt for Image {
    /// Past the end is `UnexpectedEof`, saying by how much.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset.saturating_add(buf.len() as u64);
        if end > self.size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{} bytes past the end of the file ({} bytes)",
                    end - self.size,
                    self.size
                ),
            ));
        }
        match &self.direct {
            None => FileExt::read_exact_at(&self.buffered, buf, offset),
            Some(d) if is_aligned(buf, offset) => FileExt::read_exact_at(d, buf, offset),
            Some(d) => read_bounced(d, buf, offset),
        }
    }
}

/// A file or block device read as its storage holds it: a block device through its
/// `O_DIRECT` twin, anything else through the page cache. Its size is not fixed at
/// open (a test may grow the file).
#[derive(Debug)]
pub struct Disk {
    file: File,
    direct: Option<File>,
}

impl Disk {
    /// Opens `path` read-only (and its `O_DIRECT` twin when it is a block device).
    pub fn open(path: &Path) -> io::Result<Disk> {
        let file = File::open(path)?;
        if file.metadata()?.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::EISDIR));
        }
        Ok(Disk {
            file,
            direct: open_if_block_device(path)?,
        })
    }

    /// The descriptor opened through the page cache (for its size, say).
    pub fn file(&self) -> &File {
        &self.file
    }
}

impl ReadAt for Disk {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match &self.direct {
            Some(d) => read_bounced(d, buf, offset),
            None => FileExt::read_exact_at(&self.file, buf, offset),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: u32) -> Vec<u8> {
        (0..n).map(|i| (i * 13 % 251) as u8).collect()
    }

    #[test]
    fn files_are_not_opened_direct_and_odd_ranges_read_right() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data = pattern(40_000);
        std::io::Write::write_all(&mut f, &data).unwrap();
        assert!(open_if_block_device(f.path()).unwrap().is_none());
        // The bounce path works on any descriptor; O_DIRECT only adds the alignment
        // rule, which it keeps.
        let file = f.reopen().unwrap();
        for (off, len) in [(0, 1), (4095, 2), (100, 9000), (36_000, 4000), (8192, 4096)] {
            let mut b = vec![0u8; len];
            read_bounced(&file, &mut b, off as u64).unwrap();
            assert_eq!(b, data[off..off + len], "{off}+{len}");
        }
        let mut b = vec![0u8; 10];
        let e = read_bounced(&file, &mut b, 39_995).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn an_image_reads_every_range_the_same_direct_or_not() {
        let dir =
            tempfile::tempdir_in(std::env::var_os("CARGO_TARGET_TMPDIR").unwrap_or(".".into()))
                .unwrap();
        let path = dir.path().join("img");
        let data = pattern(3 * (1 << 20) + 1234);
        std::fs::write(&path, &data).unwrap();
        for mode in [Direct::Never, Direct::Always, Direct::BlockDevices] {
            let img = Image::open(&path, mode).unwrap();
            assert_eq!(img.size(), data.len() as u64);
            let mut aligned = AlignedBuf::new(8192);
            img.read_exact_at(&mut aligned, 4096).unwrap();
            assert_eq!(&aligned[..], &data[4096..12288], "{mode:?}");
            for (off, len) in [(1, 5000), (1 << 20, (1 << 20) + 3), (data.len() - 7, 7)] {
                let mut b = vec![0u8; len];
                img.read_exact_at(&mut b, off as u64).unwrap();
                assert_eq!(b, data[off..off + len], "{mode:?} {off}+{len}");
            }
            let mut b = [0u8; 8];
            let e = img
                .read_exact_at(&mut b, data.len() as u64 - 4)
                .unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        }
        let e = Image::open(dir.path(), Direct::Never).unwrap_err();
        assert_eq!(e.errno(), Some(libc::EISDIR));
    }
}
