//! Bounded readahead for sequential streams over a [`BlockDevice`].
//!
//! A sequential reader at queue depth 1 (a loop device under `dd` or a file copy) waits
//! for each request before sending the next, so the engine's per-request cost (source
//! reads, then decompression, then the reply) adds up serially. Once a stream is seen,
//! the next [`ReadaheadOptions::depth`] bytes are read by background threads in chunks,
//! and requests that fall inside them are served from memory; the device then works on
//! request N+1 while request N is copied out. [`Readahead::read_with`] does without the
//! copy: a request inside one chunk is handed the chunk's bytes (a FUSE reply is written
//! from them). Random reads do not trigger it (two requests of at least 32 KiB in a row
//! must continue the stream); small ones bypass it.
//!
//! Memory stays bounded (chunks more than `depth` behind or ahead of the stream are
//! dropped), data comes from the inner device's own `read_at` (verified, merge-aware),
//! and the device is read-only, so a chunk can never be stale. A chunk whose read failed
//! is not used: the request reads the device itself and reports that error.
//!
//! A verified device is read and checked in two stages (see
//! [`BlockDevice::separate_check`]): the reader threads only read, and checker threads
//! (one per CPU, up to 8) hash what they read; a chunk is served only once checked.
//! When each reader hashed its own chunk, reads and hashing took turns on it, and a
//! cold verified stream left a third of the CPU time idle waiting for the disk.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::io::{AlignedBuf, HUGE_PAGE};
use crate::{BlockDevice, Result, check_range};

/// Requests smaller than this are random reads (sequential readers above us send
/// readahead-sized requests): they bypass the readahead entirely.
const MIN_STREAM_REQUEST: u64 = 32 << 10;
/// With more requests than this in flight the reader already keeps the device busy, and
/// reading ahead would only add a copy: a loop device at queue depth 1 sends a 1 MiB read
/// as two 512 KiB requests.
const SHALLOW_QUEUE: usize = 4;
/// Chunk buffers kept for reuse (16 MiB of the default 2 MiB chunks).
const FREE_KEEP: usize = 8;

/// What a [`Readahead`] did, for diagnostics (`vabc serve --stats`).
#[derive(Debug, Default)]
pub struct ReadaheadStats {
    /// Chunks read ahead (and checked, for a device with a separate check).
    pub chunks: AtomicU64,
    /// Chunks whose read or check failed.
    pub failed_chunks: AtomicU64,
    /// Stream requests answered from chunks.
    pub hits: AtomicU64,
    /// Of those, requests that waited for a chunk still being read or checked.
    pub waits: AtomicU64,
    /// Stream requests read from the device themselves (not read ahead, or failed).
    pub misses: AtomicU64,
}

/// Options of [`Readahead::new`].
#[derive(Clone, Debug)]
pub struct ReadaheadOptions {
    /// Bytes read ahead of a sequential stream (twice this for a device with a separate
    /// check).
    pub depth: u64,
    /// Unit of background reads (a power of two; requests are not required to align).
    pub chunk: usize,
    /// Background reader threads (chunks in flight at once).
    pub threads: usize,
    /// Threads that check read-ahead chunks of a device with a separate check (see
    /// [`BlockDevice::separate_check`]); 0 means one per CPU, at most 8.
    pub check_threads: usize,
    /// Counted into; shared with whoever reports them.
    pub stats: Arc<ReadaheadStats>,
}

impl Default for ReadaheadOptions {
    fn default() -> Self {
        ReadaheadOptions {
            // 16 MiB: sequential 1 MiB reads at queue depth 1 through FUSE + loop on
            // the corpus `system` pair ran 3-60% faster than with 4 MiB in six of six
            // alternating runs (2 vCPUs); 32 MiB was no steadier. Memory: up to
            // `depth` of chunks on either side of the stream.
            depth: 16 << 20,
            // A 1 MiB request (FUSE's largest) aligned to it lies in one chunk, so
            // `read_with` serves it without a copy. 2 MiB fills one huge page (see
            // `HUGE_PAGE`): a 1 MiB chunk would be rounded up to one.
            chunk: HUGE_PAGE,
            threads: 4,
            check_threads: 0,
            stats: Arc::default(),
        }
    }
}

enum Slot {
    Pending,
    Ready(Arc<Chunk>),
    Failed,
}

/// Free chunk buffers, shared with the chunks so that the last user of a chunk (the
/// stream moving past it, or a FUSE reply written from it) hands its buffer back: a
/// fresh chunk buffer costs a mapping and the zeroing of a huge page.
type FreeList = Arc<Mutex<Vec<AlignedBuf>>>;

/// A read-ahead chunk's bytes; its buffer goes back to the free list when dropped.
struct Chunk {
    buf: AlignedBuf,
    free: FreeList,
}

impl Chunk {
    fn as_slice(&self) -> &[u8] {
        self.buf.as_slice()
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < FREE_KEEP {
            free.push(buf);
        }
    }
}

struct State {
    /// End of the stream: the highest end of the requests that continued it.
    hi: u64,
    /// Consecutive requests that continued the stream.
    streak: u32,
    /// Chunks by offset (few: depth / chunk ahead plus as many behind).
    slots: Vec<(u64, Slot)>,
    queue: VecDeque<u64>,
    /// Chunks read but not yet checked (separate-check devices only).
    unchecked: VecDeque<(u64, Chunk)>,
    shutdown: bool,
}

struct Shared<D> {
    inner: D,
    /// `inner.separate_check()`: chunks go through the checker threads.
    separate: bool,
    opts: ReadaheadOptions,
    state: Mutex<State>,
    /// Not under `state`: chunks are dropped with and without that lock held.
    free: FreeList,
    /// Requests currently inside `read_at`.
    in_flight: AtomicUsize,
    /// Requests a frontend holds queued for this device (see [`Readahead::queued`]).
    queued: AtomicUsize,
    /// Signalled when a chunk is queued or on shutdown.
    work: Condvar,
    /// Signalled when a chunk leaves `Pending`.
    done: Condvar,
    /// Signalled when a chunk awaits its check or on shutdown.
    check_work: Condvar,
}

/// A [`BlockDevice`] that reads ahead of sequential streams; see the module comment.
pub struct Readahead<D: BlockDevice + 'static> {
    shared: Arc<Shared<D>>,
    threads: Vec<JoinHandle<()>>,
}

impl<D: BlockDevice + 'static> std::fmt::Debug for Readahead<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readahead")
            .field("opts", &self.shared.opts)
            .finish()
    }
}

impl<D: BlockDevice + 'static> Readahead<D> {
    /// Wraps `inner`; spawns the background readers.
    pub fn new(inner: D, opts: ReadaheadOptions) -> std::io::Result<Readahead<D>> {
        // A checked chunk is ready only once hashed, so part of the lead is chunks
        // waiting for a checker: twice the depth keeps as many ready ahead. Cold verified
        // 1 GiB reads through FUSE: 0.58-0.64 s against 0.61-0.71 s, faster in five of
        // five alternating bench/verity.sh runs (bench/results/verity.md).
        let separate = inner.separate_check();
        let depth = match separate {
            true => opts.depth.saturating_mul(2),
            false => opts.depth,
        };
        let opts = ReadaheadOptions {
            chunk: opts.chunk.max(4096).next_power_of_two(),
            threads: opts.threads.max(1),
            depth,
            ..opts
        };
        let shared = Arc::new(Shared {
            inner,
            separate,
            opts,
            state: Mutex::new(State {
                hi: 0,
                streak: 0,
                slots: Vec::new(),
                queue: VecDeque::new(),
                unchecked: VecDeque::new(),
                shutdown: false,
            }),
            free: FreeList::default(),
            in_flight: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            work: Condvar::new(),
            done: Condvar::new(),
            check_work: Condvar::new(),
        });
        let checkers = match separate {
            false => 0,
            true if shared.opts.check_threads > 0 => shared.opts.check_threads,
            // More checkers than this could only hash faster than the readers read.
            true => std::thread::available_parallelism().map_or(2, |n| n.get().min(8)),
        };
        let mut threads = Vec::new();
        for i in 0..shared.opts.threads + checkers {
            let s = shared.clone();
            let reader = i < s.opts.threads;
            let spawned = std::thread::Builder::new()
                .name(match reader {
                    true => format!("vabc-readahead-{i}"),
                    false => format!("vabc-check-{}", i - s.opts.threads),
                })
                .spawn(move || if reader { s.run() } else { s.run_checks() });
            match spawned {
                Ok(h) => threads.push(h),
                Err(e) => {
                    // Stop the ones already running before reporting.
                    drop(Readahead { shared, threads });
                    return Err(e);
                }
            }
        }
        Ok(Readahead { shared, threads })
    }

    pub fn inner(&self) -> &D {
        &self.shared.inner
    }

    /// Requests the frontend has accepted for this device but not yet started: one that
    /// queues requests for a pool of workers (the NBD server) counts them here, so the
    /// read-ahead steps aside under a deep queue as it does when many reads run at once.
    /// Without it, a client with hundreds of requests outstanding that the workers take
    /// a few at a time looks shallow, and chunks are read ahead for nothing (`nbdcopy`'s
    /// defaults: 600 MiB read ahead for 136 MiB used, before this count).
    pub fn queued(&self) -> &AtomicUsize {
        &self.shared.queued
    }

    /// Serves `[offset, offset + buf.len())` to `f`: straight from a read-ahead chunk
    /// when one holds the whole range (no copy: a FUSE reply is written from the chunk
    /// itself), otherwise after filling `buf` as [`BlockDevice::read_at`] does.
    pub fn read_with<R>(
        &self,
        buf: &mut [u8],
        offset: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        Ok(match self.read_or_share(buf, offset)? {
            Some((c, data)) => {
                let from = (offset - c) as usize;
                f(&data.as_slice()[from..from + buf.len()])
            }
            None => f(buf),
        })
    }

    /// Fills `buf` from `offset`, or returns the one ready chunk `(offset, bytes)` that
    /// holds all of it (then `buf` is left as it was).
    fn read_or_share(&self, buf: &mut [u8], offset: u64) -> Result<Option<(u64, Arc<Chunk>)>> {
        check_range(offset, buf.len(), self.size())?;
        let s = &self.shared;
        if buf.is_empty() || (buf.len() as u64) < MIN_STREAM_REQUEST {
            // Random reads: straight through, without touching the shared state (a
            // stream they interleave with keeps going).
            s.inner.read_at(buf, offset)?;
            return Ok(None);
        }
        let end = offset + buf.len() as u64;
        s.in_flight.fetch_add(1, Ordering::Relaxed);
        let r = self.read_tracked(buf, offset, end);
        s.in_flight.fetch_sub(1, Ordering::Relaxed);
        r
    }

    /// Fills `buf`, or returns the one chunk (offset, bytes) that holds all of it.
    fn read_tracked(
        &self,
        buf: &mut [u8],
        offset: u64,
        end: u64,
    ) -> Result<Option<(u64, Arc<Chunk>)>> {
        let s = &self.shared;
        let mut st = s.lock();
        s.track(&mut st, offset, end);
        let Some(mut chunks) = s.covering(st, offset, end) else {
            s.opts.stats.misses.fetch_add(1, Ordering::Relaxed);
            s.inner.read_at(buf, offset)?;
            return Ok(None);
        };
        s.opts.stats.hits.fetch_add(1, Ordering::Relaxed);
        if chunks.len() == 1 {
            return Ok(chunks.pop());
        }
        for (c, data) in chunks {
            let from = offset.max(c);
            let to = end.min(c + data.as_slice().len() as u64);
            buf[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&data.as_slice()[(from - c) as usize..(to - c) as usize]);
        }
        Ok(None)
    }
}

impl<D: BlockDevice + 'static> Drop for Readahead<D> {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        self.shared.check_work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl<D: BlockDevice> Shared<D> {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Poisoning means a reader panicked while holding plain bookkeeping; the slots
        // are still consistent enough to serve or drop.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Background reader: takes queued chunks and reads them from the device.
    fn run(&self) {
        let mut st = self.lock();
        loop {
            if st.shutdown {
                return;
            }
            let Some(off) = st.queue.pop_front() else {
                st = self.work.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            let mut buf = (self.free.lock().unwrap_or_else(|p| p.into_inner()))
                .pop()
                .unwrap_or_default();
            drop(st);
            let len = (self.opts.chunk as u64).min(self.inner.size() - off) as usize;
            let separate = self.separate;
            let ok = match separate {
                true => self.inner.read_unchecked(buf.slice_mut(len), off),
                false => self.inner.read_at(buf.slice_mut(len), off),
            }
            .is_ok();
            // Unused (failed, or dropped meanwhile), the buffer returns to the free list.
            let chunk = Chunk {
                buf,
                free: self.free.clone(),
            };
            st = self.lock();
            if ok && separate {
                // Hashing on other threads while this one reads on: the disk keeps
                // working while the CPUs hash, instead of each thread alternating.
                st.unchecked.push_back((off, chunk));
                self.check_work.notify_one();
            } else {
                self.settle(&mut st, off, ok.then_some(chunk));
            }
        }
    }

    /// Checker thread: checks read chunks and makes them ready (or failed).
    fn run_checks(&self) {
        let mut st = self.lock();
        loop {
            if st.shutdown {
                return;
            }
            let Some((off, chunk)) = st.unchecked.pop_front() else {
                st = self.check_work.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            drop(st);
            let ok = self.inner.check(chunk.as_slice(), off).is_ok();
            st = self.lock();
            self.settle(&mut st, off, ok.then_some(chunk));
        }
    }

    /// Ends the read of the chunk at `off`: ready with its bytes, or failed.
    fn settle(&self, st: &mut State, off: u64, chunk: Option<Chunk>) {
        let counter = match chunk {
            Some(_) => &self.opts.stats.chunks,
            None => &self.opts.stats.failed_chunks,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some((_, slot)) = st.slots.iter_mut().find(|(o, _)| *o == off) {
            *slot = match chunk {
                Some(c) => Slot::Ready(Arc::new(c)),
                None => Slot::Failed,
            };
        }
        self.done.notify_all();
    }

    /// Updates the stream state for a request `[off, end)` and queues chunks ahead.
    fn track(&self, st: &mut State, off: u64, end: u64) {
        let depth = self.opts.depth;
        let chunk = self.opts.chunk as u64;
        // A request that lands past the stream's end or far behind it starts a new one.
        let continues = off <= st.hi && off + depth.max(chunk) >= st.hi;
        if continues {
            st.streak = st.streak.saturating_add(1);
            st.hi = st.hi.max(end);
        } else {
            st.streak = 0;
            st.hi = end;
        }
        // Drop chunks the stream has left behind (or never reached, after a jump);
        // pending ones go once their read completes.
        let (lo, hi) = (st.hi.saturating_sub(depth), st.hi + depth);
        st.slots
            .retain(|(o, slot)| matches!(slot, Slot::Pending) || (*o + chunk > lo && *o < hi));
        let queue = self.in_flight.load(Ordering::Relaxed) + self.queued.load(Ordering::Relaxed);
        if st.streak < 2 || queue > SHALLOW_QUEUE {
            return;
        }
        let size = self.inner.size();
        let mut c = st.hi.div_ceil(chunk) * chunk;
        let mut queued = false;
        while c < size && c < st.hi + depth {
            if !st.slots.iter().any(|(o, _)| *o == c) {
                st.slots.push((c, Slot::Pending));
                st.queue.push_back(c);
                queued = true;
            }
            c += chunk;
        }
        if queued {
            self.work.notify_all();
        }
    }

    /// The chunks covering `[off, end)` once none is pending, or `None` if some part is
    /// not read ahead (or failed).
    fn covering(
        &self,
        mut st: MutexGuard<'_, State>,
        off: u64,
        end: u64,
    ) -> Option<Vec<(u64, Arc<Chunk>)>> {
        let chunk = self.opts.chunk as u64;
        let mut waited = false;
        loop {
            let mut out = Vec::new();
            let mut c = off / chunk * chunk;
            let mut pending = false;
            while c < end {
                match st.slots.iter().find(|(o, _)| *o == c) {
                    Some((_, Slot::Ready(buf))) => out.push((c, buf.clone())),
                    Some((_, Slot::Pending)) => pending = true,
                    Some((_, Slot::Failed)) | None => return None,
                }
                c += chunk;
            }
            if !pending {
                return Some(out);
            }
            if !waited {
                waited = true;
                self.opts.stats.waits.fetch_add(1, Ordering::Relaxed);
            }
            st = self.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl<D: BlockDevice + 'static> BlockDevice for Readahead<D> {
    fn size(&self) -> u64 {
        self.shared.inner.size()
    }

    fn block_size(&self) -> u32 {
        self.shared.inner.block_size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        if let Some((c, data)) = self.read_or_share(buf, offset)? {
            let from = (offset - c) as usize;
            buf.copy_from_slice(&data.as_slice()[from..from + buf.len()]);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        // Chunks may hold the old bytes: forget them all before writing.
        self.shared
            .lock()
            .slots
            .retain(|(_, slot)| matches!(slot, Slot::Pending));
        self.shared.inner.write_at(buf, offset)
    }

    fn flush(&self) -> Result<()> {
        self.shared.inner.flush()
    }

    fn is_read_only(&self) -> bool {
        self.shared.inner.is_read_only()
    }

    fn allocation(&self, offset: u64, len: u64) -> Result<Vec<crate::Allocation>> {
        self.shared.inner.allocation(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A device whose byte at `i` is a function of `i`, counting the bytes it serves.
    /// The byte at `fail_at` fails its read (or, with `separate`, its check).
    struct Pattern {
        size: u64,
        served: AtomicU64,
        fail_at: Option<u64>,
        separate: bool,
    }

    fn byte(i: u64) -> u8 {
        (i.wrapping_mul(2_654_435_761) >> 7) as u8
    }

    impl Pattern {
        fn bad(&self, offset: u64, len: usize) -> Result<()> {
            match self.fail_at {
                Some(f) if (offset..offset + len as u64).contains(&f) => {
                    Err(crate::EngineError::Verify {
                        block: f / 4096,
                        msg: "bad block".into(),
                    })
                }
                _ => Ok(()),
            }
        }
    }

    impl BlockDevice for Pattern {
        fn size(&self) -> u64 {
            self.size
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            if !self.separate {
                check_range(offset, buf.len(), self.size)?;
                self.bad(offset, buf.len())?;
            }
            self.read_unchecked(buf, offset)?;
            self.check(buf, offset)
        }
        fn separate_check(&self) -> bool {
            self.separate
        }
        fn read_unchecked(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            check_range(offset, buf.len(), self.size)?;
            for (i, b) in buf.iter_mut().enumerate() {
                *b = byte(offset + i as u64);
            }
            self.served.fetch_add(buf.len() as u64, Ordering::Relaxed);
            Ok(())
        }
        fn check(&self, data: &[u8], offset: u64) -> Result<()> {
            match self.separate {
                true => self.bad(offset, data.len()),
                false => Ok(()),
            }
        }
    }

    fn dev(size: u64, fail_at: Option<u64>) -> Readahead<Pattern> {
        dev_checked(size, fail_at, false)
    }

    fn dev_checked(size: u64, fail_at: Option<u64>, separate: bool) -> Readahead<Pattern> {
        Readahead::new(
            Pattern {
                size,
                served: AtomicU64::new(0),
                fail_at,
                separate,
            },
            ReadaheadOptions {
                depth: 1 << 20,
                chunk: 128 << 10,
                threads: 2,
                ..ReadaheadOptions::default()
            },
        )
        .unwrap()
    }

    fn check(d: &Readahead<Pattern>, off: u64, len: usize) {
        let mut buf = vec![0u8; len];
        d.read_at(&mut buf, off).unwrap();
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(*b, byte(off + i as u64), "byte {} of {len} at {off}", i);
        }
    }

    #[test]
    fn sequential_streams_are_served_ahead_and_exact() {
        // Size not a multiple of the chunk: the last chunk is short.
        let size = (5 << 20) + 12_345;
        let d = dev(size, None);
        let mut off = 0u64;
        // Unaligned request sizes, crossing chunk boundaries.
        while off < size {
            let len = (100_000u64).min(size - off) as usize;
            check(&d, off, len);
            off += len as u64;
        }
        // Read ahead at most `depth` past the end of the stream, i.e. never more than
        // the image here, and the requests hit the chunks (not twice the bytes).
        let served = d.inner().served.load(Ordering::Relaxed);
        assert!(served <= size + (1 << 20), "{served}");
        assert!(served >= size, "{served}");
    }

    #[test]
    fn a_deep_queue_in_the_frontend_turns_read_ahead_off() {
        let size = 4 << 20;
        let d = dev(size, None);
        // Many requests wait in the frontend: a stream is not read ahead.
        d.queued().store(SHALLOW_QUEUE + 1, Ordering::Relaxed);
        for off in (0..size / 2).step_by(64 << 10) {
            check(&d, off, 64 << 10);
        }
        assert_eq!(d.inner().served.load(Ordering::Relaxed), size / 2);
        // The queue drains: the same stream is read ahead again.
        d.queued().store(0, Ordering::Relaxed);
        for off in (size / 2..size).step_by(64 << 10) {
            check(&d, off, 64 << 10);
        }
        let stats = &d.shared.opts.stats;
        assert!(stats.chunks.load(Ordering::Relaxed) > 0);
        assert!(stats.hits.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn random_reads_do_not_read_ahead() {
        let d = dev(64 << 20, None);
        let mut rng = fastrand::Rng::with_seed(12345);
        for _ in 0..200 {
            check(&d, rng.u64(..63 << 20) / 4096 * 4096, 4096);
        }
        assert_eq!(d.inner().served.load(Ordering::Relaxed), 200 * 4096);
    }

    #[test]
    fn concurrent_sequential_readers_and_failures() {
        let size = 8 << 20;
        // A bad byte inside the stream: the failed chunk is not used, the request that
        // covers the byte reads the device and reports its error; the others succeed.
        let d = Arc::new(dev(size, Some(3 << 20)));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    let mut errors = 0;
                    for i in 0..16u64 {
                        // Two interleaved halves per MiB, as a loop device splits them.
                        let off = i * (512 << 10) + t % 2 * 4096;
                        let mut buf = vec![0u8; 256 << 10];
                        match d.read_at(&mut buf, off) {
                            Ok(()) => {
                                for (k, b) in buf.iter().enumerate() {
                                    assert_eq!(*b, byte(off + k as u64));
                                }
                            }
                            Err(_) => {
                                assert!((off..off + (256 << 10)).contains(&(3 << 20)));
                                errors += 1;
                            }
                        }
                    }
                    errors
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().unwrap() <= 1);
        }
        check(&d, size - 10, 10);
        let mut past = [0u8; 2];
        assert!(d.read_at(&mut past, size - 1).is_err());
    }

    #[test]
    fn read_with_shares_whole_chunks_and_matches_read_at() {
        let size = (6 << 20) + 4096;
        let d = dev(size, None);
        let chunk = 128 << 10;
        let mut shared = 0;
        let mut buf = vec![0u8; chunk];
        let mut off = 0u64;
        // Chunk-sized, chunk-aligned requests (as FUSE sends 1 MiB ones), then a short
        // last one and one that straddles two chunks.
        while off < size {
            let len = (chunk as u64).min(size - off) as usize;
            let copied_into = buf.as_ptr();
            let (same, ok) = d
                .read_with(&mut buf[..len], off, |data| {
                    let ok = data.len() == len
                        && data
                            .iter()
                            .enumerate()
                            .all(|(i, b)| *b == byte(off + i as u64));
                    (std::ptr::eq(data.as_ptr(), copied_into), ok)
                })
                .unwrap();
            assert!(ok, "{len} bytes at {off}");
            shared += usize::from(!same);
            off += len as u64;
        }
        assert!(shared > 10, "{shared} requests served from chunks");
        let straddle = (2 * chunk - 4096) as u64;
        let ok = d
            .read_with(&mut buf, straddle, |data| {
                data.iter()
                    .enumerate()
                    .all(|(i, b)| *b == byte(straddle + i as u64))
            })
            .unwrap();
        assert!(ok, "straddling two chunks");
        // Errors reach the caller, and `f` is not called.
        let mut called = false;
        let mut past = vec![0u8; 64 << 10];
        assert!(
            d.read_with(&mut past, size - 4096, |_| called = true)
                .is_err()
        );
        assert!(!called);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Streams of requests (mostly continuing, sometimes jumping), with or without a
        /// separate check stage and one bad byte: a read succeeds with the exact bytes
        /// exactly when it does not cover the bad byte.
        #[test]
        fn any_request_sequence_reads_exact_bytes_or_fails_on_the_bad_byte(
            separate in proptest::bool::ANY,
            fail_at in proptest::option::of(0u64..(3 << 20)),
            steps in proptest::collection::vec((0u8..5, 1u64..(300 << 10), 0u64..(3 << 20)), 1..80),
        ) {
            let size = (3 << 20) + 777;
            let d = dev_checked(size, fail_at, separate);
            let mut pos = 0u64;
            for (kind, len, at) in steps {
                // One step in five jumps; the others continue the stream.
                let off = if kind == 0 || pos >= size { at } else { pos };
                let len = len.min(size - off) as usize;
                let mut buf = vec![0u8; len];
                let covers_bad = fail_at.is_some_and(|f| (off..off + len as u64).contains(&f));
                match d.read_at(&mut buf, off) {
                    Ok(()) => {
                        proptest::prop_assert!(!covers_bad, "{len} bytes at {off} hide the bad byte");
                        for (i, b) in buf.iter().enumerate() {
                            proptest::prop_assert_eq!(*b, byte(off + i as u64), "byte {} of {} at {}", i, len, off);
                        }
                    }
                    Err(e) => proptest::prop_assert!(covers_bad, "{len} bytes at {off}: {e}"),
                }
                pos = off + len as u64;
            }
        }
    }
}
