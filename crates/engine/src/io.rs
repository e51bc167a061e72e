//! Positional reads of a backing image, optionally with `O_DIRECT`.
//!
//! With FUSE `direct_io` and a loop device in direct-I/O mode above us, the daemon's own
//! page cache of the base image is the last duplicate copy of the data
//! (docs/05-serving.md). Opening the base `O_DIRECT` removes it. `O_DIRECT` needs aligned offsets,
//! lengths and memory, so a second, buffered descriptor serves the rare unaligned reads
//! (XOR sources at a byte offset, partial head/tail blocks).

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};

/// Alignment required of `O_DIRECT` transfers. 4 KiB satisfies every logical block size
/// a Linux block device reports, so it is safe without querying `STATX_DIOALIGN`.
pub const DIRECT_ALIGN: usize = 4096;

/// A read-only image file read with `pread`.
#[derive(Debug)]
pub struct ImageFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    size: u64,
}

impl ImageFile {
    /// Opens `path` read-only. With `direct`, aligned reads bypass the page cache; if the
    /// file system refuses `O_DIRECT` (tmpfs), the buffered descriptor is used for all.
    pub fn open(path: &Path, direct: bool) -> Result<ImageFile> {
        let io_err = |op, source| EngineError::Io {
            op,
            path: path.to_path_buf(),
            offset: 0,
            source,
        };
        let buffered = File::open(path).map_err(|e| io_err("open", e))?;
        let meta = buffered.metadata().map_err(|e| io_err("stat", e))?;
        let size = if meta.file_type().is_file() {
            meta.len()
        } else {
            block_device_size(&buffered).map_err(|e| io_err("query size of", e))?
        };
        let direct = if direct {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        } else {
            None
        };
        Ok(ImageFile {
            path: path.to_path_buf(),
            buffered,
            direct,
            size,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Appends `[pos, end)` of the file (inside it) to `runs`: holes as zeros, the rest
    /// as data (see [`crate::BlockDevice::allocation`]).
    pub fn push_allocation(&self, mut pos: u64, end: u64, runs: &mut Vec<crate::Allocation>) {
        while pos < end {
            let data = self.next_data(pos, end).unwrap_or(end);
            crate::push_allocation(runs, data - pos, true);
            let data_end = self.data_end(data, end);
            crate::push_allocation(runs, data_end - data, false);
            pos = data_end.max(data);
        }
    }

    /// The first byte at or after `pos` and before `end` that the file stores (not a
    /// hole), or `None`; `lseek(SEEK_DATA)`. Where the file system cannot tell, all of
    /// it is data.
    fn next_data(&self, pos: u64, end: u64) -> Option<u64> {
        match self.seek(pos, libc::SEEK_DATA) {
            Ok(Some(d)) if d < end => Some(d),
            Ok(_) => None,
            Err(_) => Some(pos),
        }
    }

    /// The end of the data at `pos` (the next hole, or the end of the file), at most
    /// `end`; `lseek(SEEK_HOLE)`.
    fn data_end(&self, pos: u64, end: u64) -> u64 {
        match self.seek(pos, libc::SEEK_HOLE) {
            Ok(Some(h)) if h > pos => h.min(end),
            _ => end,
        }
    }

    /// `lseek` from `pos`: `None` for ENXIO (nothing of that kind past `pos`).
    fn seek(&self, pos: u64, whence: libc::c_int) -> std::io::Result<Option<u64>> {
        use std::os::fd::AsRawFd;
        let pos = libc::off_t::try_from(pos).map_err(std::io::Error::other)?;
        // SAFETY: lseek takes no pointers. It moves the descriptor's offset, which
        // nothing here uses: every read is positioned (pread, io_uring).
        let r = unsafe { libc::lseek(self.buffered.as_raw_fd(), pos, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        }
    }

    /// Whether aligned reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The descriptor a vectored read filling `parts` in turn from `offset` can go to as
    /// is (e.g. through io_uring), or `None` when it needs
    /// [`read_exact_at`](Self::read_exact_at) part by part: past the end, or not aligned
    /// for `O_DIRECT` (every part must be).
    pub(crate) fn fd_for_parts(
        &self,
        parts: &[&mut [u8]],
        offset: u64,
    ) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if offset.checked_add(len)? > self.size {
            return None;
        }
        match &self.direct {
            None => Some(self.buffered.as_raw_fd()),
            Some(d) => {
                let mut at = offset;
                for p in parts {
                    if !is_direct_aligned(p, at) {
                        return None;
                    }
                    at += p.len() as u64;
                }
                Some(d.as_raw_fd())
            }
        }
    }

    /// Fills `buf` from `offset`. The range must lie inside the file.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = offset + buf.len() as u64;
        if end > self.size {
            return Err(EngineError::Io {
                op: "read",
                path: self.path.clone(),
                offset,
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "{} bytes past the end of the file ({} bytes)",
                        end - self.size,
                        self.size
                    ),
                ),
            });
        }
        let io = |source| EngineError::Io {
            op: "read",
            path: self.path.clone(),
            offset,
            source,
        };
        let Some(direct) = &self.direct else {
            return self.buffered.read_exact_at(buf, offset).map_err(io);
        };
        if is_direct_aligned(buf, offset) {
            return direct.read_exact_at(buf, offset).map_err(io);
        }
        // Unaligned (XOR sources at a byte offset, partial blocks): read the aligned
        // superset through a bounce buffer so these reads do not fill the page cache
        // either. Past the last whole block of the file O_DIRECT would come up short.
        let start = offset / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64;
        let end = end.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64;
        if end > self.size || end - start > BOUNCE_MAX as u64 {
            return self.buffered.read_exact_at(buf, offset).map_err(io);
        }
        BOUNCE.with(|b| {
            let mut b = b.borrow_mut();
            let tmp = b.slice_mut((end - start) as usize);
            direct.read_exact_at(tmp, start).map_err(io)?;
            let skip = (offset - start) as usize;
            buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
            Ok(())
        })
    }
}

const BOUNCE_MAX: usize = 1 << 20;

thread_local! {
    static BOUNCE: std::cell::RefCell<AlignedBuf> =
        std::cell::RefCell::new(AlignedBuf::new(2 * DIRECT_ALIGN));
}

fn is_direct_aligned(buf: &[u8], offset: u64) -> bool {
    (buf.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
        && buf.len().is_multiple_of(DIRECT_ALIGN)
        && offset.is_multiple_of(DIRECT_ALIGN as u64)
}

fn block_device_size(file: &File) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live,
    // properly aligned u64; the descriptor is valid for the duration of the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

// _IOR(0x12, 114, size_t)
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// A buffer whose usable part starts at a `DIRECT_ALIGN` boundary, so frontends can hand
/// it to the engine and have base reads go straight to `O_DIRECT`. Buffers of at least
/// a huge page (2 MiB) are backed by transparent huge pages where the kernel allows it;
/// smaller ones live on the heap.
#[derive(Debug, Default)]
pub struct AlignedBuf {
    mem: Mem,
    start: usize,
    len: usize,
}

/// Buffers of at least this size get their own anonymous mapping, used from a boundary
/// of this size for a multiple of it and advised `MADV_HUGEPAGE`, so that each 2 MiB is
/// physically contiguous. Why: a request to a virtio disk without indirect descriptors
/// (the Firecracker VM these numbers come from) takes one ring descriptor per
/// physically contiguous piece of its buffer. Read into scattered 4 KiB pages, a 100 KiB
/// base read takes ~26 of the ring's 256, so about ten requests fit in flight and the
/// rest queue in the guest; from a huge page it takes three. Measured (bench/results/serve.md):
/// sequential serving +25% (readahead chunks), `vabc merge` 9%
/// faster (its arena). Smaller buffers stay on the heap: rounding 1 MiB FUSE reply
/// buffers and ring payloads up to 2 MiB would double their memory (64 MiB of ring
/// payloads) for 6% at sequential QD8.
pub const HUGE_PAGE: usize = 2 << 20;

#[derive(Debug)]
enum Mem {
    Heap(Vec<u8>),
    /// A mapping one huge page longer than `huge`, of which `huge` bytes from the first
    /// `HUGE_PAGE` boundary are used; the slack around them is never touched, so it
    /// costs address space, not memory.
    Huge {
        map: memmap2::MmapMut,
        huge: usize,
    },
}

impl Default for Mem {
    fn default() -> Self {
        Mem::Heap(Vec::new())
    }
}

impl Mem {
    /// Room for `len` bytes and the offset where the aligned part starts.
    fn new(len: usize) -> (Mem, usize) {
        if len >= HUGE_PAGE
            && let Some(huge) = len.checked_next_multiple_of(HUGE_PAGE)
            && let Some(span) = huge.checked_add(HUGE_PAGE)
            && let Ok(map) = memmap2::MmapMut::map_anon(span)
        {
            let start = map.as_ptr().align_offset(HUGE_PAGE);
            // Advice only: without transparent huge pages the mapping works with small
            // pages.
            let _ = map.advise_range(memmap2::Advice::HugePage, start, huge);
            return (Mem::Huge { map, huge }, start);
        }
        let raw = vec![0u8; len + DIRECT_ALIGN];
        let start = raw.as_ptr().align_offset(DIRECT_ALIGN);
        (Mem::Heap(raw), start)
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Mem::Heap(raw) => raw,
            Mem::Huge { map, .. } => map,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Mem::Heap(raw) => raw,
            Mem::Huge { map, .. } => map,
        }
    }
}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::default();
        b.ensure(len);
        b
    }

    /// Makes room for `len` bytes, reallocating only when it grows.
    pub fn ensure(&mut self, len: usize) {
        let room = match &self.mem {
            Mem::Heap(raw) if raw.is_empty() => None,
            Mem::Heap(raw) => Some(raw.len() - self.start),
            Mem::Huge { huge, .. } => Some(*huge),
        };
        if room.is_none_or(|r| r < len) {
            (self.mem, self.start) = Mem::new(len);
        }
        self.len = len;
    }

    /// The first `len` bytes of the aligned region.
    pub fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        self.ensure(len);
        let start = self.start;
        &mut self.mem.bytes_mut()[start..start + len]
    }

    /// Bytes allocated, alignment slack included (for a huge-page buffer, the part that
    /// may take memory).
    pub fn capacity(&self) -> usize {
        match &self.mem {
            Mem::Heap(raw) => raw.len(),
            Mem::Huge { huge, .. } => *huge,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.mem.bytes()[self.start..self.start + self.len]
    }
}

/// The aligned region of the length last asked for.
impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let (start, len) = (self.start, self.len);
        &mut self.mem.bytes_mut()[start..start + len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_are_aligned_heap_memory() {
        let mut b = AlignedBuf::new(12_345);
        assert!(matches!(b.mem, Mem::Heap(_)));
        assert_eq!(b.len(), 12_345);
        assert!((b.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN));
        assert!(b.iter().all(|&x| x == 0));
        b[12_344] = 7;
        assert_eq!(b.as_slice()[12_344], 7);
    }

    #[test]
    fn large_buffers_are_whole_aligned_huge_pages() {
        let mut b = AlignedBuf::new(HUGE_PAGE + 1);
        assert!(
            matches!(b.mem, Mem::Huge { huge, .. } if huge == 2 * HUGE_PAGE),
            "no 4 MiB mapping for a {} byte buffer",
            HUGE_PAGE + 1
        );
        assert!((b.as_ptr() as usize).is_multiple_of(HUGE_PAGE));
        assert_eq!(b.capacity(), 2 * HUGE_PAGE);
        assert_eq!(b.len(), HUGE_PAGE + 1);
        assert!(b.iter().all(|&x| x == 0));
        b.fill(0xa5);
        // Shrinking keeps the mapping and its bytes; growing past it maps afresh.
        let p = b.as_ptr();
        assert_eq!(b.slice_mut(4096).as_ptr(), p);
        assert!(b.as_slice().iter().all(|&x| x == 0xa5));
        let grown = b.slice_mut(3 * HUGE_PAGE);
        assert_eq!(grown.len(), 3 * HUGE_PAGE);
        assert!(grown.iter().all(|&x| x == 0));
        assert_eq!(b.capacity(), 3 * HUGE_PAGE);
    }

    #[test]
    fn buffers_move_between_threads() {
        let mut b = AlignedBuf::new(HUGE_PAGE);
        b[0] = 1;
        let b = std::thread::spawn(move || {
            let mut b = b;
            b[1] = 2;
            b
        })
        .join()
        .expect("thread");
        assert_eq!(&b[..3], &[1, 2, 0]);
    }
}
