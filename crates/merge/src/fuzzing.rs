//! The body of the merge fuzz target, shared with the test that replays the
//! fuzz corpus in the normal test run. Not part of the stable API.

use std::io;
use std::path::Path;

use cow::format::BLOCK_SIZE;
use cow::fuzzing::memfile;
use cow::reader::{CowReader, OpenOptions};
use cow::view::SnapshotView;

use crate::io::{Dev, IoStats, MergeIo};
use crate::merger::{Merge, MergeOptions, STATE_DONE};

/// Both files in memory. A write past the end of either is a bug in the
/// merger (a device cannot grow, and the COW must not), so it panics.
struct MemIo {
    base: Vec<u8>,
    cow: Vec<u8>,
    stats: IoStats,
}

impl MemIo {
    fn file(&mut self, dev: Dev) -> &mut Vec<u8> {
        match dev {
            Dev::Base => &mut self.base,
            Dev::Cow => &mut self.cow,
        }
    }
}

impl MergeIo for MemIo {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let f = self.file(dev);
        for (off, buf) in reqs.iter_mut() {
            let src = usize::try_from(*off)
                .ok()
                .and_then(|o| f.get(o..o.checked_add(buf.len())?))
                .ok_or(io::ErrorKind::UnexpectedEof)?;
            buf.copy_from_slice(src);
        }
        self.stats.reads += reqs.len() as u64;
        Ok(())
    }

    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        let f = self.file(dev);
        for (off, buf) in reqs {
            let len = f.len();
            let dst = usize::try_from(*off)
                .ok()
                .and_then(|o| f.get_mut(o..o.checked_add(buf.len())?));
            let Some(dst) = dst else {
                panic!(
                    "the merge wrote {} bytes at {off} of {dev:?}, which has {len}",
                    buf.len()
                );
            };
            dst.copy_from_slice(buf);
        }
        self.stats.writes += reqs.len() as u64;
        Ok(())
    }

    fn sync(&mut self, _dev: Dev) -> io::Result<()> {
        self.stats.fsyncs += 1;
        Ok(())
    }

    fn stats(&self) -> IoStats {
        self.stats
    }
}

/// A disk whose background writes (`start_writes`) land only when waited
/// for or synced, the latest an engine may let them land, while reads are
/// served at once. A merge that read a block whose write it had started but
/// not waited for would see the old bytes there and end away from the new
/// image. Used by the merge fuzz target and the merge tests.
pub struct LateWrites<I> {
    pub inner: I,
    /// Started writes not landed yet: (device, offset, data, length).
    pending: Vec<(Dev, u64, *const u8, usize)>,
}

impl<I: MergeIo> LateWrites<I> {
    pub fn new(inner: I) -> Self {
        LateWrites {
            inner,
            pending: Vec::new(),
        }
    }

    /// Writes started and not waited for. A merge run waits for all of its
    /// own before it returns (its buffers are freed then).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    fn land(&mut self) -> io::Result<()> {
        for (dev, off, ptr, len) in std::mem::take(&mut self.pending) {
            // SAFETY: `start_writes`' caller keeps the memory valid and
            // unchanged until `wait_writes` or `sync` returned; this runs
            // inside those calls.
            let data = unsafe { std::slice::from_raw_parts(ptr, len) };
            self.inner.write_many(dev, &[(off, data)])?;
        }
        Ok(())
    }
}

impl<I: MergeIo> MergeIo for LateWrites<I> {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        self.inner.read_many(dev, reqs)
    }

    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.inner.write_many(dev, reqs)
    }

    fn sync(&mut self, dev: Dev) -> io::Result<()> {
        self.land()?;
        self.inner.sync(dev)
    }

    fn stats(&self) -> IoStats {
        self.inner.stats()
    }

    unsafe fn start_writes(
        &mut self,
        dev: Dev,
        reqs: &[(u64, *const u8, usize)],
    ) -> io::Result<()> {
        self.pending
            .extend(reqs.iter().map(|&(off, ptr, len)| (dev, off, ptr, len)));
        Ok(())
    }

    fn wait_writes(&mut self) -> io::Result<()> {
        self.land()
    }
}

/// How far [`exercise_merge`] got with an input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checked {
    /// Not a COW this merge accepts (or too large for a fuzz iteration).
    Refused,
    /// Merged (or refused mid-way) without breaking a rule.
    Merged,
    /// Merged from the start and compared with the snapshot: equal.
    Snapshot,
}

/// Open `data` as a COW and merge it into a patterned base held in memory.
/// Whatever the header's merge progress and scratch area say, the merge must
/// not panic, write past either file's end, or run away. A merge that starts
/// from scratch must end at exactly the snapshot the COW describes, and
/// running it again must change nothing.
pub fn exercise_merge(data: &[u8]) -> Checked {
    let Some(file) = memfile("fuzz.cow", data) else {
        return Checked::Refused;
    };
    let path = Path::new("fuzz.cow");
    let Ok(r) = CowReader::from_file(file, path, OpenOptions::default()) else {
        return Checked::Refused;
    };
    // Bound the work per input.
    const MAX_BASE: u64 = 4 << 20;
    let needed = (r.end_block() * BLOCK_SIZE as u64).max(r.source_extent());
    if needed > MAX_BASE || r.ops().len() > 4096 {
        return Checked::Refused;
    }
    let base_size = needed
        .max(64 * BLOCK_SIZE as u64)
        .next_multiple_of(BLOCK_SIZE as u64);
    let base: Vec<u8> = (0..base_size).map(|i| (i * 31 % 251) as u8).collect();
    // The snapshot, read before the merge through the reader-side code.
    let expected = (|| {
        let f = memfile("base.img", &base)?;
        let view = SnapshotView::new(&r, &f, Path::new("base.img"), Some(base_size)).ok()?;
        let mut img = vec![0u8; usize::try_from(view.size()).ok()?];
        view.read_blocks(0, &mut img).ok()?;
        Some(img)
    })();
    let base_path = Path::new("base.img").to_path_buf();
    let Ok(m) = Merge::new(&r, base_size, base_path, MergeOptions::default()) else {
        return Checked::Refused;
    };
    let mut io = LateWrites::new(MemIo {
        base,
        cow: data.to_vec(),
        stats: IoStats::default(),
    });
    let Ok((pos, state)) = m.progress(&mut io) else {
        return Checked::Refused;
    };
    let fresh = pos == 0 && state != STATE_DONE;
    let run = m.run(&mut io, &|_, _| {});
    // Every write a run starts is waited for before it returns (its buffers
    // are freed then), whether it ends well or not.
    assert!(
        io.in_flight() == 0,
        "a merge run returned with writes in flight"
    );
    let Ok(report) = run else {
        return Checked::Merged;
    };
    if !report.complete() {
        return Checked::Merged;
    }
    let merged = io.inner.base.clone();
    let again = m.run(&mut io, &|_, _| {});
    assert!(
        io.in_flight() == 0,
        "a merge run returned with writes in flight"
    );
    assert!(again.is_ok(), "a finished merge failed when run again");
    assert!(
        io.inner.base == merged,
        "a finished merge changed the base when run again"
    );
    match expected {
        Some(img) if fresh => {
            assert!(
                merged[..img.len()] == img[..],
                "a merge from the start did not produce the snapshot"
            );
            Checked::Snapshot
        }
        _ => Checked::Merged,
    }
}
