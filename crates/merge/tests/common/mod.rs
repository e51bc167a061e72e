//! Test support: a simulated disk that can crash, and COWs whose merge
//! order has overlapping chains.
#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cow::CowReader;
use cow::{Codec, Compression, CowWriter, WriterOptions};
use merge::view::MergingView;
use merge::{Dev, IoStats, Merge, MergeIo, MergeOptions, MergeStatus, SyncIo, UringIo};

pub const BS: usize = 4096;

/// How a crash loses data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crash {
    /// The process stops: everything written so far stays (page cache).
    Stop,
    /// Power loss: every write not covered by a later sync is dropped.
    PowerLoss,
    /// Power loss where each unsynced write independently may or may not
    /// have reached the disk (seeded).
    Torn(u64),
}

#[derive(Clone)]
struct Device {
    current: Vec<u8>,
    durable: Vec<u8>,
    /// Writes since the last sync: (offset, data).
    pending: Vec<(u64, Vec<u8>)>,
}

impl Device {
    fn new(data: Vec<u8>) -> Self {
        Device {
            current: data.clone(),
            durable: data,
            pending: Vec::new(),
        }
    }
}

/// Two devices in memory. The `fail_at`-th write or sync (counting from 0)
/// and every I/O after it fail, as if the process died there.
pub struct SimDisk {
    base: Device,
    cow: Device,
    events: u64,
    fail_at: Option<u64>,
    crashed: bool,
    stats: IoStats,
    /// Kind of each event, for coverage reports: (is_sync, device, offset,
    /// length; 0 for a sync).
    pub trace: Vec<(bool, Dev, u64, usize)>,
}

impl SimDisk {
    pub fn new(base: Vec<u8>, cow: Vec<u8>, fail_at: Option<u64>) -> Self {
        SimDisk {
            base: Device::new(base),
            cow: Device::new(cow),
            events: 0,
            fail_at,
            crashed: false,
            stats: IoStats::default(),
            trace: Vec::new(),
        }
    }

    pub fn events(&self) -> u64 {
        self.events
    }

    fn dev(&mut self, d: Dev) -> &mut Device {
        match d {
            Dev::Base => &mut self.base,
            Dev::Cow => &mut self.cow,
        }
    }

    fn event(&mut self, is_sync: bool, d: Dev, off: u64, len: usize) -> io::Result<()> {
        if self.crashed || self.fail_at == Some(self.events) {
            self.crashed = true;
            return Err(io::Error::other("injected crash"));
        }
        self.trace.push((is_sync, d, off, len));
        self.events += 1;
        Ok(())
    }

    /// The devices' content after the crash, as a restarted system sees it.
    pub fn after_crash(&self, how: Crash) -> (Vec<u8>, Vec<u8>) {
        let one = |d: &Device| -> Vec<u8> {
            match how {
                Crash::Stop => d.current.clone(),
                Crash::PowerLoss => d.durable.clone(),
                Crash::Torn(seed) => {
                    let mut img = d.durable.clone();
                    let mut rng = fastrand::Rng::with_seed(seed);
                    for (off, data) in &d.pending {
                        if rng.bool() {
                            let o = *off as usize;
                            img[o..o + data.len()].copy_from_slice(data);
                        }
                    }
                    img
                }
            }
        };
        (one(&self.base), one(&self.cow))
    }
}

impl MergeIo for SimDisk {
    fn read_many(&mut self, dev: Dev, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        if self.crashed {
            return Err(io::Error::other("injected crash"));
        }
        let d = self.dev(dev);
        for (off, buf) in reqs.iter_mut() {
            let o = *off as usize;
            let end = o + buf.len();
            if end > d.current.len() {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            buf.copy_from_slice(&d.current[o..end]);
        }
        self.stats.reads += reqs.len() as u64;
        Ok(())
    }

    fn write_many(&mut self, dev: Dev, reqs: &[(u64, &[u8])]) -> io::Result<()> {
        for (off, buf) in reqs {
            self.event(false, dev, *off, buf.len())?;
            let d = self.dev(dev);
            let o = *off as usize;
            if o + buf.len() > d.current.len() {
                return Err(io::Error::other("write past the end of the device"));
            }
            d.current[o..o + buf.len()].copy_from_slice(buf);
            d.pending.push((*off, buf.to_vec()));
        }
        self.stats.writes += reqs.len() as u64;
        Ok(())
    }

    fn sync(&mut self, dev: Dev) -> io::Result<()> {
        self.event(true, dev, 0, 0)?;
        let d = self.dev(dev);
        d.durable.clone_from(&d.current);
        d.pending.clear();
        self.stats.fsyncs += 1;
        Ok(())
    }

    fn stats(&self) -> IoStats {
        self.stats
    }
}

/// Deterministic pseudo-random bytes.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fastrand::Rng::with_seed(seed).fill(&mut v);
    v
}

/// An old image and an update whose merge needs every mechanism: a region
/// shifted down by one block (dst < src: ascending order), one shifted up
/// (descending), COPYs that read blocks later overwritten, unaligned XORs,
/// XORs of blocks changed in place, multi-block REPLACE and ZERO. Returns (old, new); writes the COW.
pub fn make_update(
    cow_path: &Path,
    blocks: usize,
    version: u16,
    codec: Codec,
) -> (Vec<u8>, Vec<u8>) {
    make_update_with(cow_path, blocks, version, codec, cow::format::SCRATCH_SIZE)
}

/// [`make_update`] with a scratch area of `scratch_size` bytes instead of
/// AOSP's 2 MiB (shorter windows, smaller files).
pub fn make_update_with(
    cow_path: &Path,
    blocks: usize,
    version: u16,
    codec: Codec,
    scratch_size: u32,
) -> (Vec<u8>, Vec<u8>) {
    let old = noise(1, blocks * BS);
    let mut new = old.clone();
    let q = blocks / 8;
    let mut seq: Vec<u32> = Vec::new();
    let mut copies: Vec<(u64, u64)> = Vec::new();
    // Shift down: new[b] = old[b + 1], b in [q, 2q): ascending is safe.
    for b in q..2 * q {
        new[b * BS..(b + 1) * BS].copy_from_slice(&old[(b + 1) * BS..(b + 2) * BS]);
        copies.push((b as u64, b as u64 + 1));
        seq.push(b as u32);
    }
    // Shift up: new[b] = old[b - 1], b in [3q, 4q): descending is safe.
    for b in (3 * q..4 * q).rev() {
        new[b * BS..(b + 1) * BS].copy_from_slice(&old[(b - 1) * BS..b * BS]);
        copies.push((b as u64, b as u64 - 1));
        seq.push(b as u32);
    }
    // XOR: new[b] = old[src..src+4096] with small edits, src unaligned, in
    // [5q, 6q) reading [q/2 .. ) (untouched by the merge or read before
    // being overwritten: they come first in the sequence).
    let mut xors: Vec<(u64, u64, Vec<u8>)> = Vec::new();
    let off = 333usize;
    for (i, b) in (5 * q..6 * q).enumerate() {
        let src = 6 * q + i; // reads blocks 6q+i and 6q+i+1, which REPLACE rewrites later
        let mut blk = old[src * BS + off..src * BS + off + BS].to_vec();
        blk[i % BS] ^= 0x5a;
        blk[(i * 7) % BS] = blk[(i * 7) % BS].wrapping_add(3);
        let x: Vec<u8> = blk
            .iter()
            .zip(&old[src * BS + off..])
            .map(|(a, b)| a ^ b)
            .collect();
        new[b * BS..(b + 1) * BS].copy_from_slice(&blk);
        xors.push((b as u64, src as u64, x));
        seq.push(b as u32);
    }
    // XOR in place: new[b] = old[b] with small edits, b in [4q, 4q + q/4).
    // Such an op reads its own destination, so replaying it after its write
    // would be wrong: its window needs the scratch copy.
    let mut in_place: Vec<(u64, Vec<u8>)> = Vec::new();
    for b in 4 * q..4 * q + q / 4 {
        let mut blk = old[b * BS..(b + 1) * BS].to_vec();
        blk[(b * 13) % BS] ^= 0x77;
        let x: Vec<u8> = blk.iter().zip(&old[b * BS..]).map(|(a, o)| a ^ o).collect();
        new[b * BS..(b + 1) * BS].copy_from_slice(&blk);
        in_place.push((b as u64, x));
        seq.push(b as u32);
    }
    // REPLACE [6q, 7q + q/2) with compressible data; ZERO the rest of 7q..8q.
    let rs = 6 * q;
    let re = 7 * q + q / 2;
    for b in rs..re {
        let c = ((b * 31) % 251) as u8;
        new[b * BS..(b + 1) * BS].fill(c);
        new[b * BS + (b % 97)] ^= 0xff;
    }
    new[re * BS..8 * q * BS].fill(0);
    let mut w = CowWriter::create(
        cow_path,
        WriterOptions {
            version,
            compression: Compression { codec, level: None },
            compression_factor: 16384,
            cluster_ops: 64,
            op_count_max: blocks as u64 * 2,
            scratch_size,
            ..Default::default()
        },
    )
    .expect("create cow");
    w.add_sequence(&seq).expect("sequence");
    for &(dst, src) in &copies {
        w.add_copy(dst, src, 1).expect("copy");
    }
    w.add_label(1).expect("label");
    for (dst, src, x) in &xors {
        w.add_xor_blocks(*dst, x, *src, off as u16).expect("xor");
    }
    for (b, x) in &in_place {
        w.add_xor_blocks(*b, x, *b, 0).expect("xor in place");
    }
    w.add_raw_blocks(rs as u64, &new[rs * BS..re * BS])
        .expect("replace");
    w.add_zero_blocks(re as u64, (8 * q - re) as u64)
        .expect("zero");
    w.finalize().expect("finalize");
    (old, new)
}

pub fn rw(p: &Path) -> File {
    OpenOptions::new().read(true).write(true).open(p).unwrap()
}

#[derive(Clone, Copy, Debug)]
pub enum Engine {
    Sync,
    Uring,
    /// io_uring with O_DIRECT for aligned transfers (buffered where the
    /// filesystem refuses O_DIRECT).
    UringDirect,
}

pub fn engine(e: Engine, base: &Path, cow: &Path) -> Box<dyn MergeIo> {
    match e {
        Engine::Sync => Box::new(SyncIo::new(rw(base), rw(cow))),
        Engine::Uring => Box::new(UringIo::new(rw(base), rw(cow), 64).unwrap()),
        Engine::UringDirect => Box::new(
            UringIo::new(rw(base), rw(cow), 64)
                .unwrap()
                .with_direct()
                .unwrap(),
        ),
    }
}

/// A fault-free merge of the COW at `cow_path` into `old` on a simulated
/// disk: its report, and the disk (its trace, its events, what it holds).
pub fn fault_free(
    cow_path: &Path,
    old: &[u8],
    opts: MergeOptions,
) -> (merge::MergeReport, SimDisk) {
    let cow_bytes = std::fs::read(cow_path).unwrap();
    let r = CowReader::open(cow_path).unwrap();
    let m = Merge::new(&r, old.len() as u64, PathBuf::from("base"), opts).unwrap();
    let mut sim = SimDisk::new(old.to_vec(), cow_bytes, None);
    let rep = m.run(&mut sim, &|_, _| {}).unwrap();
    (rep, sim)
}

/// Event count of a fault-free simulated merge, and its trace.
pub fn dry_run(
    cow_path: &Path,
    old: &[u8],
    opts: MergeOptions,
) -> (u64, Vec<(bool, Dev, u64, usize)>) {
    let (_, sim) = fault_free(cow_path, old, opts);
    (sim.events(), sim.trace.clone())
}

pub struct Scenario<'a> {
    pub cow_bytes: &'a [u8],
    pub old: &'a [u8],
    pub new: &'a [u8],
    pub opts: MergeOptions,
    /// Options of the resumed run (None: `opts`), e.g. AOSP's windows.
    pub resume_opts: Option<MergeOptions>,
}

pub fn crash_and_resume(sc: &Scenario, k: u64, how: Crash, resume_engine: Engine, dir: &Path) {
    let Scenario {
        cow_bytes,
        old,
        new,
        opts,
        resume_opts,
    } = *sc;
    let cow_path = dir.join("c.cow");
    std::fs::write(&cow_path, cow_bytes).unwrap();
    let r = CowReader::open(&cow_path).unwrap();
    let m = Merge::new(&r, old.len() as u64, PathBuf::from("base"), opts).unwrap();
    let mut sim = SimDisk::new(old.to_vec(), cow_bytes.to_vec(), Some(k));
    assert!(
        m.run(&mut sim, &|_, _| {}).is_err(),
        "no crash at event {k}"
    );
    let (base_after, cow_after) = sim.after_crash(how);
    drop(m);
    drop(r);
    let base_path = dir.join("b.img");
    std::fs::write(&base_path, &base_after).unwrap();
    std::fs::write(&cow_path, &cow_after).unwrap();

    // 1. What a restarted daemon serves before resuming: the new image.
    let r = CowReader::open(&cow_path).unwrap();
    let m = Merge::new(
        &r,
        old.len() as u64,
        base_path.clone(),
        resume_opts.unwrap_or(opts),
    )
    .unwrap();
    let status = Arc::new(MergeStatus::new());
    m.load_status(&mut SyncIo::new(rw(&base_path), rw(&cow_path)), &status)
        .unwrap();
    let base = File::open(&base_path).unwrap();
    let view = MergingView::new(&r, &base, &base_path, status).unwrap();
    let mut blk = vec![0u8; BS];
    for b in 0..(new.len() / BS) as u64 {
        view.read_block(b, &mut blk).unwrap();
        assert!(
            blk == new[b as usize * BS..][..BS],
            "crash at {k} ({how:?}): block {b} wrong before resume"
        );
    }
    // 2. Resume to the end.
    let mut io = engine(resume_engine, &base_path, &cow_path);
    let rep = m.run(io.as_mut(), &|_, _| {}).unwrap();
    assert!(rep.complete());
    assert!(
        std::fs::read(&base_path).unwrap() == new,
        "crash at {k} ({how:?}): wrong image after resume"
    );
}
