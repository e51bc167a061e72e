//! The I/O a merge needs, behind one small trait so that the same merge
//! protocol runs over plain syscalls, io_uring, or (in tests) a simulated
//! disk that can crash at any write or fsync.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// Which device an I/O goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dev {
    /// The base image: merge target and source of COPY/XOR.
    Base,
    /// The COW file: only its header and scratch area are written.
    Cow,
}

/// Counters every engine keeps (what the benchmarks compare).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// System calls issued for data and syncs (io_uring_enter counts as one).
    pub syscalls: u64,
    pub reads: u64,
    pub writes: u64,
    pub fsyncs: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Time the merge spent blocked on reads, on writes and on syncs: where
    /// a run's wall time goes, beyond the CPU work between them.
    pub read_wait: Duration,
    pub write_wait: Duration,
    pub sync_wait: Duration,
}

/// Batched I/O primitives. A batch may be executed in any way and order as
/// long as: reads complete before `read_many` returns; the writes of one
/// `write_many` (which never overlap) complete before it returns; `sync`
/// makes every completed write of that device durable.
pub trait MergeIo {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()>;
    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()>;
    fn sync(&mut self, dev: Dev) -> io::Result<()>;
    /// `write_many` then `sync`; an engine may chain them in one submission.
    fn write_and_sync(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.write_many(dev, reqs)?;
        self.sync(dev)
    }
    fn stats(&self) -> IoStats;
    /// Start reads that may still run while later calls (writes, syncs) do;
    /// [`MergeIo::wait_reads`] returns once they completed. The default
    /// reads at once.
    ///
    /// # Safety
    /// Each `(offset, ptr, len)` names memory that stays valid and that
    /// nobody reads, writes or moves until `wait_reads` has returned (or the
    /// engine is dropped).
    unsafe fn start_reads(&mut self, dev: Dev, reqs: &[(u64, *mut u8, usize)]) -> io::Result<()> {
        let mut bufs: Vec<(u64, &mut [u8])> = reqs
            .iter()
            // SAFETY: the caller guarantees the memory is valid and unshared
            // until `wait_reads`; it is used only during this call.
            .map(|&(off, ptr, len)| (off, unsafe { std::slice::from_raw_parts_mut(ptr, len) }))
            .collect();
        self.read_many(dev, &mut bufs)
    }
    /// Wait for the reads of `start_reads`.
    fn wait_reads(&mut self) -> io::Result<()> {
        Ok(())
    }
    /// Start writes (which never overlap each other or any transfer in
    /// flight) that may still run while later calls (reads, CPU work) do;
    /// [`MergeIo::wait_writes`] returns once they completed, and `sync`
    /// covers them. The default writes at once.
    ///
    /// # Safety
    /// Each `(offset, ptr, len)` names memory that stays valid and unchanged
    /// until `wait_writes` or `sync` has returned (or the engine is dropped).
    unsafe fn start_writes(
        &mut self,
        dev: Dev,
        reqs: &[(u64, *const u8, usize)],
    ) -> io::Result<()> {
        let bufs: Vec<(u64, &[u8])> = reqs
            .iter()
            // SAFETY: the caller guarantees the memory is valid and unchanged
            // until `wait_writes`; it is used only during this call.
            .map(|&(off, ptr, len)| (off, unsafe { std::slice::from_raw_parts(ptr, len) }))
            .collect();
        self.write_many(dev, &bufs)
    }
    /// Wait for the writes of `start_writes`.
    fn wait_writes(&mut self) -> io::Result<()> {
        Ok(())
    }
    /// Hint: this buffer will carry most data; an engine may register it
    /// with the kernel. It stays alive and unmoved until `unregister`.
    fn register(&mut self, _buf: &mut [u8]) -> io::Result<()> {
        Ok(())
    }
    fn unregister(&mut self) {}
}

/// The baseline of Android's measurement: one `pread` per source, one
/// `pwrite` **and one `fsync`** per destination block written to the base,
/// as the pre-io_uring merge did.
pub struct SyncIo {
    base: File,
    cow: File,
    stats: IoStats,
}

impl SyncIo {
    pub fn new(base: File, cow: File) -> Self {
        SyncIo {
            base,
            cow,
            stats: IoStats::default(),
        }
    }

    fn file(&self, dev: Dev) -> &File {
        match dev {
            Dev::Base => &self.base,
            Dev::Cow => &self.cow,
        }
    }
}

impl MergeIo for SyncIo {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let t = Instant::now();
        let r = self.read_blocks(dev, reqs);
        self.stats.read_wait += t.elapsed();
        r
    }

    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        let t = Instant::now();
        let r = self.write_blocks(dev, reqs);
        // The per-block fsyncs of the base are counted as writing time.
        self.stats.write_wait += t.elapsed();
        r
    }

    fn sync(&mut self, dev: Dev) -> io::Result<()> {
        let t = Instant::now();
        self.file(dev).sync_data()?;
        self.stats.sync_wait += t.elapsed();
        self.stats.syscalls += 1;
        self.stats.fsyncs += 1;
        Ok(())
    }

    fn stats(&self) -> IoStats {
        self.stats
    }
}

impl SyncIo {
    fn read_blocks(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (off, buf) in reqs.iter_mut() {
            // Per block, like the per-op baseline.
            for (i, chunk) in buf.chunks_mut(cow::BLOCK_SIZE).enumerate() {
                self.file(dev)
                    .read_exact_at(chunk, *off + (i * cow::BLOCK_SIZE) as u64)?;
                self.stats.syscalls += 1;
                self.stats.reads += 1;
                self.stats.bytes_read += chunk.len() as u64;
            }
        }
        Ok(())
    }

    fn write_blocks(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        for (off, buf) in reqs {
            if dev == Dev::Base {
                for (i, chunk) in buf.chunks(cow::BLOCK_SIZE).enumerate() {
                    self.base
                        .write_all_at(chunk, *off + (i * cow::BLOCK_SIZE) as u64)?;
                    self.base.sync_data()?;
                    self.stats.syscalls += 2;
                    self.stats.writes += 1;
                    self.stats.fsyncs += 1;
                    self.stats.bytes_written += chunk.len() as u64;
                }
            } else {
                self.cow.write_all_at(buf, *off)?;
                self.stats.syscalls += 1;
                self.stats.writes += 1;
                self.stats.bytes_written += buf.len() as u64;
            }
        }
        Ok(())
    }
}

/// Which [`MergeIo`] a merge uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Engine {
    /// io_uring where this process may use it (a sysctl or a container's seccomp
    /// filter can forbid it), else [`SyncIo`].
    #[default]
    Auto,
    /// [`crate::UringIo`].
    Uring,
    /// [`SyncIo`].
    Sync,
}

/// The merge's I/O for `engine` on the opened base and COW, and the engine's name
/// ("uring" or "sync"). `Auto` falls back to the sync engine when io_uring is
/// unavailable, with a warning; the uring engine moves aligned transfers with
/// `O_DIRECT` unless `buffered`.
pub fn open(
    engine: Engine,
    base: File,
    cow: File,
    queue_depth: u32,
    buffered: bool,
) -> std::io::Result<(Box<dyn MergeIo + Send>, &'static str)> {
    let uring = match engine {
        Engine::Uring => true,
        Engine::Sync => false,
        Engine::Auto => match engine::io_uring_usable() {
            Ok(()) => true,
            Err(e) => {
                log::warn!(
                    "vabc: io_uring is unavailable to this process ({e}); merging with the \
                     sync engine (one read, write and fsync per op: much slower)"
                );
                false
            }
        },
    };
    if !uring {
        return Ok((Box::new(SyncIo::new(base, cow)), "sync"));
    }
    fn context(what: &'static str) -> impl Fn(std::io::Error) -> std::io::Error {
        move |e| std::io::Error::new(e.kind(), format!("{what}: {e}"))
    }
    let io =
        crate::UringIo::new(base, cow, queue_depth).map_err(context("cannot set up io_uring"))?;
    if buffered {
        return Ok((Box::new(io), "uring"));
    }
    let io = io
        .with_direct()
        .map_err(context("cannot open the base or COW with O_DIRECT"))?;
    Ok((Box::new(io), "uring"))
}
