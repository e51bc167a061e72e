//! Long crash soak over a real update (run by bench/crash-soak.sh):
//! VABC_SOAK_OLD, VABC_SOAK_NEW, VABC_SOAK_COW name the images and the COW,
//! VABC_SOAK_POINTS how many crash points (spread evenly over the merge's
//! writes and syncs, each tried as process stop, power loss and torn writes),
//! VABC_SOAK_FULL_EVERY how often (in points) a resume runs to the very end
//! and the whole image is compared (default 150), VABC_SOAK_DIR where the
//! working copies of base and COW live (default: the temp directory).
//!
//! A crash point costs a few windows of work, not a whole image:
//! - the crashed run starts from the state a fault-free merge has two commits
//!   before the crash point (built from old/new without running the prefix)
//!   on copy-on-write in-memory devices, so only written pages are stored;
//! - the surviving state goes into one pair of files kept for the whole
//!   soak: the pages the previous point wrote are put back, then this
//!   point's pages are written;
//! - the snapshot view is checked on every page the crash touched, the ops
//!   around the crash and a rotating stripe of the image (each page of the
//!   image is covered every `STRIPE` points);
//! - the resume (real engine, files) runs two commits past the crash and
//!   its result must equal the fault-free state at that commit: header,
//!   every page it or the crash wrote, every destination it merged. The
//!   remaining merge from an equal state is the fault-free run's, checked
//!   to end at the new image once, and every `FULL_EVERY` points a resume
//!   runs to the end against the whole new image anyway.

mod common;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use common::*;
use cow::{CowReader, OpKind};
use merge::view::MergingView;
use merge::{Dev, IoStats, Merge, MergeIo, MergeOptions, MergeStatus, SyncIo};

const STRIPE: u64 = 64;

/// The lower, never-written layer of a device: page `p` is `new`'s if the
/// merge position of the op writing it is below `upto`, else `old`'s.
#[derive(Clone, Copy)]
struct Lower<'a> {
    old: &'a [u8],
    new: &'a [u8],
    owner: &'a [u32],
    upto: u32,
}

impl<'a> Lower<'a> {
    fn page(&self, p: u64) -> &'a [u8] {
        let p = p as usize;
        let src = if self.owner.get(p).is_some_and(|&o| o < self.upto) {
            self.new
        } else {
            self.old
        };
        let s = (p * BS).min(src.len());
        &src[s..(s + BS).min(src.len())]
    }
}

type Pages = HashMap<u64, Vec<u8>>;

/// A device that stores only the pages written since it was created.
struct SparseDev<'a> {
    lower: Lower<'a>,
    current: Pages,
    durable: Pages,
    /// Unsynced writes, page by page: (page, offset in page, bytes).
    pending: Vec<(u64, usize, Vec<u8>)>,
}

impl<'a> SparseDev<'a> {
    fn new(lower: Lower<'a>) -> Self {
        SparseDev {
            lower,
            current: Pages::new(),
            durable: Pages::new(),
            pending: Vec::new(),
        }
    }

    fn len(&self) -> u64 {
        self.lower.old.len() as u64
    }

    fn get<'b>(&'b self, pages: &'b Pages, p: u64) -> &'b [u8] {
        pages.get(&p).map_or_else(|| self.lower.page(p), |v| &v[..])
    }

    fn put(lower: &Lower<'_>, pages: &mut Pages, p: u64, at: usize, data: &[u8]) {
        let page = pages.entry(p).or_insert_with(|| lower.page(p).to_vec());
        page[at..at + data.len()].copy_from_slice(data);
    }

    /// Split [off, off+len) into (page, offset in page, range in buffer).
    fn pieces(off: u64, len: usize) -> Vec<(u64, usize, std::ops::Range<usize>)> {
        let mut out = Vec::new();
        let mut done = 0;
        while done < len {
            let o = off + done as u64;
            let (p, at) = (o / BS as u64, (o % BS as u64) as usize);
            let n = (BS - at).min(len - done);
            out.push((p, at, done..done + n));
            done += n;
        }
        out
    }

    fn read(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        if off + buf.len() as u64 > self.len() {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        for (p, at, r) in Self::pieces(off, buf.len()) {
            buf[r.clone()].copy_from_slice(&self.get(&self.current, p)[at..at + r.len()]);
        }
        Ok(())
    }

    fn write(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        if off + buf.len() as u64 > self.len() {
            return Err(io::Error::other("write past the end of the device"));
        }
        for (p, at, r) in Self::pieces(off, buf.len()) {
            Self::put(&self.lower, &mut self.current, p, at, &buf[r.clone()]);
            self.pending.push((p, at, buf[r].to_vec()));
        }
        Ok(())
    }

    fn sync(&mut self) {
        for (p, at, data) in std::mem::take(&mut self.pending) {
            Self::put(&self.lower, &mut self.durable, p, at, &data);
        }
    }

    /// Pages as a restarted system finds them (only pages that differ from
    /// the lower layer can be in the result). Torn writes: each unsynced
    /// page write independently reached the disk or not.
    fn after_crash(&self, how: Crash) -> Pages {
        match how {
            Crash::Stop => self.current.clone(),
            Crash::PowerLoss => self.durable.clone(),
            Crash::Torn(seed) => {
                let mut pages = self.durable.clone();
                let mut rng = fastrand::Rng::with_seed(seed);
                for (p, at, data) in &self.pending {
                    if rng.bool() {
                        Self::put(&self.lower, &mut pages, *p, *at, data);
                    }
                }
                pages
            }
        }
    }
}

/// Two sparse devices behind the merge's I/O trait; the `fail_at`-th write
/// or sync and everything after it fail. Records where commits happen.
struct SparseDisk<'a> {
    base: SparseDev<'a>,
    cow: SparseDev<'a>,
    events: u64,
    fail_at: Option<u64>,
    crashed: bool,
    /// A header write waiting for its sync: the position it commits.
    commit_pending: Option<u64>,
    /// `num_merge_ops` when the run started.
    started_at: u64,
    /// (events after the commit's sync, committed position).
    commits: Vec<(u64, u64)>,
}

impl<'a> SparseDisk<'a> {
    fn dev(&mut self, d: Dev) -> &mut SparseDev<'a> {
        match d {
            Dev::Base => &mut self.base,
            Dev::Cow => &mut self.cow,
        }
    }

    fn event(&mut self) -> io::Result<()> {
        if self.crashed || self.fail_at == Some(self.events) {
            self.crashed = true;
            return Err(io::Error::other("injected crash"));
        }
        self.events += 1;
        Ok(())
    }
}

impl MergeIo for SparseDisk<'_> {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        if self.crashed {
            return Err(io::Error::other("injected crash"));
        }
        let d = self.dev(dev);
        for (off, buf) in reqs.iter_mut() {
            d.read(*off, buf)?;
        }
        Ok(())
    }

    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        for (off, buf) in reqs {
            self.event()?;
            if dev == Dev::Cow && *off == 0 && buf.len() >= 34 {
                // Scratch saves and the state byte rewrite the header page
                // too, with the position already committed: only a new
                // position is a commit.
                let mut n = [0u8; 8];
                n.copy_from_slice(&buf[26..34]);
                let pos = u64::from_le_bytes(n);
                if pos != self.commits.last().map_or(self.started_at, |c| c.1) {
                    self.commit_pending = Some(pos);
                }
            }
            self.dev(dev).write(*off, buf)?;
        }
        Ok(())
    }

    fn sync(&mut self, dev: Dev) -> io::Result<()> {
        self.event()?;
        self.dev(dev).sync();
        if dev == Dev::Cow
            && let Some(pos) = self.commit_pending.take()
        {
            self.commits.push((self.events, pos));
        }
        Ok(())
    }

    fn stats(&self) -> IoStats {
        IoStats::default()
    }
}

/// Passes I/O to a real engine and remembers what it wrote.
struct Recorder<'a> {
    inner: &'a mut dyn MergeIo,
    writes: Vec<(Dev, u64, usize)>,
}

impl Recorder<'_> {
    fn note(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) {
        self.writes
            .extend(reqs.iter().map(|(o, b)| (dev, *o, b.len())));
    }
}

impl MergeIo for Recorder<'_> {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        self.inner.read_many(dev, reqs)
    }
    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.note(dev, reqs);
        self.inner.write_many(dev, reqs)
    }
    fn sync(&mut self, dev: Dev) -> io::Result<()> {
        self.inner.sync(dev)
    }
    fn write_and_sync(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        self.note(dev, reqs);
        self.inner.write_and_sync(dev, reqs)
    }
    fn stats(&self) -> IoStats {
        self.inner.stats()
    }
    unsafe fn start_reads(&mut self, dev: Dev, reqs: &[(u64, *mut u8, usize)]) -> io::Result<()> {
        // SAFETY: the caller's guarantee, passed on unchanged.
        unsafe { self.inner.start_reads(dev, reqs) }
    }
    fn wait_reads(&mut self) -> io::Result<()> {
        self.inner.wait_reads()
    }
    fn register(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.inner.register(buf)
    }
    fn unregister(&mut self) {
        self.inner.unregister()
    }
}

fn page_range(off: u64, len: usize) -> std::ops::Range<u64> {
    off / BS as u64..(off + len as u64).div_ceil(BS as u64)
}

/// One pair of files reused by every crash point: their content is
/// `lower` (at `upto`) except the pages in `dirty`.
struct Files<'a> {
    base: File,
    cow: File,
    old: &'a [u8],
    new: &'a [u8],
    owner: &'a [u32],
    cow_bytes: &'a [u8],
    upto: u32,
    dirty_base: HashSet<u64>,
    dirty_cow: HashSet<u64>,
}

impl Files<'_> {
    fn lower(&self) -> Lower<'_> {
        Lower {
            old: self.old,
            new: self.new,
            owner: self.owner,
            upto: self.upto,
        }
    }

    /// Bring the files to the fault-free state at commit position `upto`
    /// (≥ the current one) with a pristine COW apart from `cow_page0`.
    fn reset(&mut self, upto: u32, cow_page0: &[u8]) {
        let mut pages: Vec<u64> = self.dirty_base.drain().collect();
        let old_upto = self.upto;
        self.upto = upto;
        pages.extend(
            self.owner
                .iter()
                .enumerate()
                .filter(|&(_, &o)| o >= old_upto && o < upto)
                .map(|(p, _)| p as u64),
        );
        for p in pages {
            self.base
                .write_all_at(self.lower().page(p), p * BS as u64)
                .unwrap();
        }
        for p in self.dirty_cow.drain() {
            let s = (p as usize * BS).min(self.cow_bytes.len());
            let e = (s + BS).min(self.cow_bytes.len());
            self.cow
                .write_all_at(&self.cow_bytes[s..e], s as u64)
                .unwrap();
        }
        self.cow.write_all_at(cow_page0, 0).unwrap();
        self.dirty_cow.insert(0);
    }

    fn apply(&mut self, base: &Pages, cow: &Pages) {
        for (p, data) in base {
            self.base.write_all_at(data, p * BS as u64).unwrap();
            self.dirty_base.insert(*p);
        }
        for (p, data) in cow {
            self.cow.write_all_at(data, p * BS as u64).unwrap();
            self.dirty_cow.insert(*p);
        }
    }

    fn read_page(&self, p: u64) -> Vec<u8> {
        let mut buf = vec![0u8; BS];
        self.base.read_exact_at(&mut buf, p * BS as u64).unwrap();
        buf
    }
}

#[test]
#[ignore]
fn crash_soak() {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("set {k}"));
    let old = std::fs::read(var("VABC_SOAK_OLD")).unwrap();
    let new = std::fs::read(var("VABC_SOAK_NEW")).unwrap();
    let points: u64 = var("VABC_SOAK_POINTS").parse().unwrap();
    let full_every: u64 = std::env::var("VABC_SOAK_FULL_EVERY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    let cow_bytes = std::fs::read(var("VABC_SOAK_COW")).unwrap();
    assert_eq!(old.len(), new.len());
    assert_eq!(old.len() % BS, 0);
    let opts = MergeOptions {
        window_ops: 64,
        commit_ops: 64,
        ..Default::default()
    };
    // The files only carry the real engines' resumes (crashes are
    // simulated), so a RAM-backed directory is as good and much faster.
    let dir = match std::env::var_os("VABC_SOAK_DIR") {
        Some(d) => tempfile::tempdir_in(d).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    let base_path = dir.path().join("b.img");
    let cow_path = dir.path().join("c.cow");
    std::fs::write(&base_path, &old).unwrap();
    std::fs::write(&cow_path, &cow_bytes).unwrap();
    let r = CowReader::open(&cow_path).unwrap();
    let m = Merge::new(&r, old.len() as u64, base_path.clone(), opts).unwrap();
    let m_resume = Merge::new(
        &r,
        old.len() as u64,
        base_path.clone(),
        MergeOptions {
            max_commits: Some(2),
            ..opts
        },
    )
    .unwrap();
    let order = m.order();
    let total = order.len() as u64;
    let header_size = usize::from(r.header().header_size);
    let pages = (old.len() / BS) as u64;
    // Merge position of the op writing each page.
    let mut owner = vec![u32::MAX; pages as usize];
    for (i, op) in order.iter().enumerate() {
        for b in op.new_block..op.end_block() {
            owner[b as usize] = i as u32;
        }
    }
    // Position after which no op reads each page (0: never read). A
    // REPLACE/ZERO page may be written early, with an ordered window, once
    // every op reading it is merged: from then on it may hold either image.
    let mut read_until = vec![0u32; pages as usize];
    for (i, op) in order.iter().enumerate() {
        for b in op.source_blocks() {
            read_until[b as usize] = i as u32 + 1;
        }
    }
    let early_ok = |pg: u64, p: u64| {
        let o = owner[pg as usize];
        o != u32::MAX
            && matches!(order[o as usize].kind, OpKind::Replace | OpKind::Zero)
            && u64::from(read_until[pg as usize]) <= p
    };
    // Pages the merge does not write are already the new image's.
    for p in (0..pages).filter(|&p| owner[p as usize] == u32::MAX) {
        let s = p as usize * BS;
        assert!(
            old[s..s + BS] == new[s..s + BS],
            "page {p} not in the COW differs"
        );
    }

    // Fault-free run: where commits fall, and that it ends at the new image.
    let cow_lower = |page0: &[u8]| -> Vec<u8> {
        let mut c = cow_bytes.clone();
        c[..page0.len()].copy_from_slice(page0);
        c
    };
    let first_page = cow_bytes[..BS.min(cow_bytes.len())].to_vec();
    let pristine_cow = cow_lower(&first_page);
    let (events, commits) = {
        let (lb, lc) = lowers(&old, &new, &owner, 0, &pristine_cow);
        let mut sim = SparseDisk {
            base: SparseDev::new(lb),
            cow: SparseDev::new(lc),
            events: 0,
            fail_at: None,
            crashed: false,
            commit_pending: None,
            started_at: 0,
            commits: Vec::new(),
        };
        let rep = m.run(&mut sim, &|_, _| {}).unwrap();
        assert!(rep.complete());
        for p in 0..pages {
            let s = p as usize * BS;
            assert!(
                sim.base.get(&sim.base.current, p) == &new[s..s + BS],
                "fault-free merge: page {p} is not the new image's"
            );
        }
        (sim.events, sim.commits)
    };
    assert_eq!(commits.last().map(|c| c.1), Some(total));

    let mut files = Files {
        base: rw(&base_path),
        cow: rw(&cow_path),
        old: &old,
        new: &new,
        owner: &owner,
        cow_bytes: &cow_bytes,
        upto: 0,
        dirty_base: HashSet::new(),
        dirty_cow: HashSet::new(),
    };
    let window = opts.window_ops as u64;
    let per_mode = points.div_ceil(3).max(1);
    let step = (events / per_mode).max(1);
    let started = std::time::Instant::now();
    let (mut done, mut full_runs, mut view_checks) = (0u64, 0u64, 0u64);
    let mut k = 0;
    while k < events && done < points {
        // Start two commits before the one after event k.
        let c = commits.partition_point(|&(e, _)| e <= k);
        let (start_event, start_pos) = c.checked_sub(2).map_or((0, 0), |i| commits[i]);
        let mut page0 = first_page.clone();
        if start_pos > 0 {
            page0[26..34].copy_from_slice(&start_pos.to_le_bytes());
            page0[header_size] = merge::merger::STATE_IN_PROGRESS;
        }
        let start_cow = cow_lower(&page0);
        for how in [Crash::Stop, Crash::PowerLoss, Crash::Torn(k + 1)] {
            let (lb, lc) = lowers(&old, &new, &owner, start_pos as u32, &start_cow);
            let mut sim = SparseDisk {
                base: SparseDev::new(lb),
                cow: SparseDev::new(lc),
                events: 0,
                fail_at: Some(k - start_event),
                crashed: false,
                commit_pending: None,
                started_at: start_pos,
                commits: Vec::new(),
            };
            assert!(
                m.run(&mut sim, &|_, _| {}).is_err(),
                "no crash at event {k}"
            );
            let (base_pages, mut cow_pages) = (sim.base.after_crash(how), sim.cow.after_crash(how));
            // The reset below writes page 0 of the start state; keep a crash
            // result for it.
            cow_pages.entry(0).or_insert_with(|| page0.clone());
            files.reset(start_pos as u32, &page0);
            files.apply(&base_pages, &cow_pages);
            let ctx = format!("crash at event {k} ({how:?}, run from op {start_pos})");

            // 1. The snapshot view of what survived is the new image.
            let status = Arc::new(MergeStatus::new());
            m.load_status(&mut SyncIo::new(rw(&base_path), rw(&cow_path)), &status)
                .unwrap();
            let crash_pos = status.merged() as u64;
            let base_file = File::open(&base_path).unwrap();
            let view = MergingView::new(&r, &base_file, &base_path, status).unwrap();
            let near = start_pos.saturating_sub(window)..(crash_pos + 2 * window).min(total);
            let mut check: HashSet<u64> = base_pages.keys().copied().collect();
            for op in &order[near.start as usize..near.end as usize] {
                check.extend(op.new_block..op.end_block());
            }
            check.extend((done % STRIPE..pages).step_by(STRIPE as usize));
            let mut blk = vec![0u8; BS];
            for &b in &check {
                view.read_block(b, &mut blk).unwrap();
                let s = b as usize * BS;
                assert!(
                    blk == new[s..s + BS],
                    "{ctx}: block {b} wrong before resume"
                );
            }
            view_checks += check.len() as u64;
            drop(view);

            // 2. Resume (alternating engines): two commits, or to the end.
            let full = done % full_every == full_every - 1;
            let resume_engine = if done % 2 == 0 {
                Engine::Uring
            } else {
                Engine::Sync
            };
            let mut eng = engine(resume_engine, &base_path, &cow_path);
            let mut rec = Recorder {
                inner: eng.as_mut(),
                writes: Vec::new(),
            };
            let mm = if full { &m } else { &m_resume };
            let rep = mm
                .run(&mut rec, &|_, _| {})
                .unwrap_or_else(|e| panic!("{ctx}: resume failed: {e}"));
            let writes = std::mem::take(&mut rec.writes);
            drop(eng);
            for (dev, off, len) in writes {
                let set = match dev {
                    Dev::Base => &mut files.dirty_base,
                    Dev::Cow => &mut files.dirty_cow,
                };
                set.extend(page_range(off, len));
            }
            let p = rep.merged;
            assert!(p >= crash_pos, "{ctx}: resume went back to {p}");
            let (hp, hs) = m
                .progress(&mut SyncIo::new(rw(&base_path), rw(&cow_path)))
                .unwrap();
            assert_eq!(
                (hp, hs),
                (p, merge::merger::STATE_IN_PROGRESS),
                "{ctx}: header after resume"
            );
            if full {
                assert!(rep.complete(), "{ctx}");
                assert!(
                    file_equals(&base_path, &new),
                    "{ctx}: wrong image after a full resume"
                );
                full_runs += 1;
            } else {
                // Equal to the fault-free state at commit p: pages written
                // so far, and every destination merged since the start.
                let mut pages_to_check: HashSet<u64> = files.dirty_base.clone();
                for op in &order[start_pos as usize..p as usize] {
                    pages_to_check.extend(op.new_block..op.end_block());
                }
                for pg in pages_to_check {
                    let s = pg as usize * BS;
                    let want = if owner[pg as usize] < p as u32 {
                        &new[s..s + BS]
                    } else {
                        &old[s..s + BS]
                    };
                    let got = files.read_page(pg);
                    assert!(
                        got == want || (early_ok(pg, p) && got == new[s..s + BS]),
                        "{ctx}: page {pg} after resuming to op {p}"
                    );
                }
            }
            done += 1;
            if done % 300 == 0 {
                eprintln!(
                    "crash-soak: {done} points ({:.0} s)...",
                    started.elapsed().as_secs_f64()
                );
            }
        }
        k += step;
    }
    println!(
        "crash-soak: {done} crash points over {events} I/O events, all resumed to the new image \
         ({full_runs} full resumes compared whole, {view_checks} view block checks)"
    );
}

fn lowers<'a>(
    old: &'a [u8],
    new: &'a [u8],
    owner: &'a [u32],
    upto: u32,
    cow: &'a [u8],
) -> (Lower<'a>, Lower<'a>) {
    (
        Lower {
            old,
            new,
            owner,
            upto,
        },
        Lower {
            old: cow,
            new: cow,
            owner: &[],
            upto: 0,
        },
    )
}

/// The file is `want`, compared a chunk at a time.
fn file_equals(path: &Path, want: &[u8]) -> bool {
    let f = File::open(path).unwrap();
    if f.metadata().unwrap().len() != want.len() as u64 {
        return false;
    }
    let mut buf = vec![0u8; 8 << 20];
    want.chunks(buf.len()).enumerate().all(|(i, w)| {
        f.read_exact_at(&mut buf[..w.len()], (i * (8 << 20)) as u64)
            .unwrap();
        buf[..w.len()] == *w
    })
}
