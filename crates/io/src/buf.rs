//! Buffers that `O_DIRECT` can fill: their usable part starts at a [`DIRECT_ALIGN`]
//! boundary, and large ones are whole transparent huge pages.

/// Alignment of `O_DIRECT` transfers: a page, which covers every logical block size a
/// Linux block device reports, so it is safe without querying `STATX_DIOALIGN`.
pub const DIRECT_ALIGN: usize = 4096;

/// A buffer whose usable part starts at a `DIRECT_ALIGN` boundary, so a caller can hand
/// it to a reader and have base reads go straight to `O_DIRECT`. Buffers of at least
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
    /// A zeroed buffer of `len` bytes.
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

    /// The aligned region of the length last asked for.
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
