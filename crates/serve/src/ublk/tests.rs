//! The ublk frontend against fake transports: a scripted single queue for the core and
//! the queue loop, and a channel-driven multi-queue transport for the device life cycle.
//! Data is checked byte for byte against the AOSP vectors' `expected.img`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{Receiver, Sender, unbounded};
use engine::{AlignedBuf, BlockDevice, CowEngine, CowEngineOptions, EngineError, FileDevice};

use super::*;

const MIB: usize = 1 << 20;

fn vectors() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/aosp-cow-vectors")
}

fn expected() -> Vec<u8> {
    std::fs::read(vectors().join("expected.img")).unwrap()
}

fn cow_engine(cow: &str) -> Arc<dyn BlockDevice> {
    Arc::new(
        CowEngine::open(
            &vectors().join("base.img"),
            &vectors().join(cow),
            &CowEngineOptions::default(),
        )
        .unwrap(),
    )
}

fn read(start_sector: u64, nr_sectors: u32) -> IoDesc {
    IoDesc::new(IoOp::Read, 0, start_sector, nr_sectors)
}

/// A device wrapper that counts calls and can be made to fail.
struct Probe {
    inner: Arc<dyn BlockDevice>,
    fail_reads: bool,
    fail_flush: bool,
    writable: bool,
    reads: AtomicUsize,
    writes: AtomicUsize,
    flushes: AtomicUsize,
}

impl Probe {
    fn new(inner: Arc<dyn BlockDevice>) -> Probe {
        Probe {
            inner,
            fail_reads: false,
            fail_flush: false,
            writable: false,
            reads: AtomicUsize::new(0),
            writes: AtomicUsize::new(0),
            flushes: AtomicUsize::new(0),
        }
    }
}

impl BlockDevice for Probe {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> engine::Result<()> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if self.fail_reads {
            return Err(EngineError::Io(
                vabc_io::Error::new(
                    "read",
                    "probe.img",
                    std::io::Error::from_raw_os_error(libc::EIO),
                )
                .at(offset),
            ));
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> engine::Result<()> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        if self.writable {
            return Ok(());
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> engine::Result<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        if self.fail_flush {
            return Err(EngineError::Verify {
                block: 0,
                msg: "flush failed".into(),
            });
        }
        Ok(())
    }
    fn is_read_only(&self) -> bool {
        !self.writable
    }
}

fn core_for(dev: &dyn BlockDevice) -> QueueCore<'_> {
    QueueCore::new(dev, 0, dev.size().div_ceil(512), MIB)
}

#[test]
fn reads_at_any_sector_match_the_image() {
    let want = expected();
    for cow in ["v3_lz4_65536.cow", "v2_zstd_4096.cow", "v3_none_4096.cow"] {
        let dev = cow_engine(cow);
        let core = core_for(&*dev);
        let mut buf = AlignedBuf::new(MIB);
        let buf = buf.slice_mut(MIB);
        let sectors = (want.len() / 512) as u64;
        let mut cases: Vec<(u64, u32)> = vec![
            (0, 8),
            (1, 1),
            (7, 2),
            (3, 2048),
            (sectors - 2048, 2048),
            (sectors - 1, 1),
            (sectors - 9, 9),
            (0, 2048),
        ];
        let mut rng = fastrand::Rng::with_seed(0x5eed ^ cow.len() as u64);
        for _ in 0..300 {
            let n = 1 + rng.u64(..2048) as u32;
            cases.push((rng.u64(..sectors - u64::from(n) + 1), n));
        }
        for (start, n) in cases {
            buf.fill(0xa5);
            let r = core.handle(&read(start, n), buf);
            let (off, len) = (start as usize * 512, n as usize * 512);
            assert_eq!(r, len as i32, "{cow}: read {n} sectors at {start}");
            assert!(
                buf[..len] == want[off..off + len],
                "{cow}: {n} sectors at sector {start} differ"
            );
        }
        let s = core.stats();
        assert_eq!(s.reads, 308);
        assert_eq!(s.errors, 0);
    }
}

#[test]
fn last_partial_block_reads_with_zero_padding() {
    let want = expected();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("odd.img");
    let size = want.len() - 3000;
    std::fs::write(&path, &want[..size]).unwrap();
    let dev = FileDevice::open(&path, false).unwrap();
    let params = DeviceParams::new(size as u64, true, &UblkOptions::default(), 2).unwrap();
    assert_eq!(params.dev_sectors, (size as u64).div_ceil(512));
    assert_eq!(params.logical_bs_shift, 9, "4K blocks would hide the tail");
    let core = QueueCore::new(&dev, 0, params.dev_sectors, MIB);
    let mut buf = vec![0xa5u8; MIB];
    let last = params.dev_sectors - 1;
    for (start, n) in [(last, 1), (last - 7, 8), (params.dev_sectors - 2048, 2048)] {
        let r = core.handle(&read(start, n), &mut buf);
        let off = start as usize * 512;
        let len = n as usize * 512;
        assert_eq!(r, len as i32);
        let real = size - off;
        assert_eq!(&buf[..real], &want[off..size]);
        assert!(buf[real..len].iter().all(|&b| b == 0), "tail not zeroed");
    }
    // One sector further is outside the device.
    assert_eq!(
        core.handle(&read(params.dev_sectors, 1), &mut buf),
        -libc::EINVAL
    );
    assert_eq!(
        core.handle(&read(last, 2), &mut buf),
        -libc::EINVAL,
        "a request crossing the end"
    );
}

#[test]
fn writes_are_refused_and_nothing_is_written() {
    let want = expected();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("dev.img");
    std::fs::write(&path, &want).unwrap();
    let probe = Probe::new(Arc::new(FileDevice::open(&path, false).unwrap()));
    let core = core_for(&probe);
    let mut buf = vec![0x5au8; MIB];
    for op in [
        IoOp::Write,
        IoOp::Discard,
        IoOp::WriteZeroes,
        IoOp::WriteSame,
    ] {
        assert_eq!(
            core.handle(&IoDesc::new(op, 0, 8, 16), &mut buf),
            -libc::EROFS,
            "{op:?}"
        );
    }
    assert_eq!(probe.writes.load(Ordering::SeqCst), 0);
    assert_eq!(std::fs::read(&path).unwrap(), want, "the image changed");
    assert_eq!(core.stats().errors, 4);

    // A device that claims to be writable but refuses anyway: still EROFS, via the
    // engine's error.
    let refusing = RefusingWritable(Arc::new(FileDevice::open(&path, false).unwrap()));
    let core = core_for(&refusing);
    assert_eq!(
        core.handle(&IoDesc::new(IoOp::Write, 0, 0, 8), &mut buf),
        -libc::EROFS
    );
    // A writable device gets the write, with the full length reported.
    let mut w = Probe::new(Arc::new(FileDevice::open(&path, false).unwrap()));
    w.writable = true;
    let core = core_for(&w);
    assert_eq!(
        core.handle(&IoDesc::new(IoOp::Write, 0, 0, 8), &mut buf),
        4096
    );
    assert_eq!(w.writes.load(Ordering::SeqCst), 1);
    assert_eq!(
        core.handle(&IoDesc::new(IoOp::Discard, 0, 0, 8), &mut buf),
        -libc::EOPNOTSUPP
    );
}

struct RefusingWritable(Arc<dyn BlockDevice>);
impl BlockDevice for RefusingWritable {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> engine::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn is_read_only(&self) -> bool {
        false
    }
}

#[test]
fn out_of_range_and_unknown_ops_are_einval() {
    let dev = cow_engine("v3_lz4_65536.cow");
    let probe = Probe::new(dev);
    let sectors = probe.size() / 512;
    let core = core_for(&probe);
    let mut buf = vec![0u8; MIB];
    for desc in [
        read(sectors, 1),
        read(sectors - 1, 2),
        read(u64::MAX, 1),
        read(u64::MAX / 512 + 1, 8),
        read(0, 2049), // more than max_sectors
        IoDesc::new(IoOp::Other(10), 0, 0, 8),
        IoDesc::new(IoOp::Other(0xff), 0, 0, 0),
    ] {
        assert_eq!(core.handle(&desc, &mut buf), -libc::EINVAL, "{desc:?}");
    }
    // A buffer smaller than the request (a transport bug) is refused, not overrun.
    assert_eq!(core.handle(&read(0, 16), &mut buf[..4096]), -libc::EINVAL);
    assert_eq!(probe.reads.load(Ordering::SeqCst), 0);
    assert_eq!(core.stats().errors, 8);
    // Zero-length reads are fine.
    assert_eq!(core.handle(&read(5, 0), &mut buf), 0);
}

#[test]
fn engine_errors_are_eio_and_flush_reaches_the_device() {
    let mut probe = Probe::new(cow_engine("v3_lz4_65536.cow"));
    probe.fail_reads = true;
    let core = core_for(&probe);
    let mut buf = vec![0u8; MIB];
    assert_eq!(core.handle(&read(8, 8), &mut buf), -libc::EIO);
    assert_eq!(core.handle(&IoDesc::new(IoOp::Flush, 0, 0, 0), &mut buf), 0);
    assert_eq!(probe.flushes.load(Ordering::SeqCst), 1);
    let s = core.stats();
    assert_eq!((s.errors, s.flushes, s.reads), (1, 1, 0));

    probe.fail_flush = true;
    let core = core_for(&probe);
    assert_eq!(
        core.handle(&IoDesc::new(IoOp::Flush, 0, 0, 0), &mut buf),
        -libc::EIO
    );
    // Many failures: answered and counted, logging is throttled.
    for i in 0..100 {
        assert_eq!(core.handle(&read(i * 8, 8), &mut buf), -libc::EIO);
    }
    assert_eq!(core.stats().errors, 101);
}

/// A single queue fed from a script: each `wait` returns the next batch; when the script
/// is done every armed tag is aborted, as the driver does on STOP_DEV.
///
/// With workers, a batch is delivered only once its tags are committed (as the driver
/// reuses a tag only after its commit); until then `wait` blocks for a wake-up.
struct ScriptQueue {
    batches: VecDeque<Vec<QueueEvent>>,
    fetched: Vec<bool>,
    busy: Vec<bool>,
    addrs: Vec<usize>,
    commits: Vec<(u16, i32, Vec<u8>)>,
    stopped: bool,
    wake_tx: Sender<()>,
    wake_rx: Receiver<()>,
}

impl ScriptQueue {
    fn new(depth: usize, batches: Vec<Vec<QueueEvent>>) -> ScriptQueue {
        ScriptQueue {
            batches: batches.into(),
            fetched: vec![false; depth],
            busy: vec![false; depth],
            addrs: vec![0; depth],
            commits: Vec::new(),
            stopped: false,
            wake_tx: unbounded().0,
            wake_rx: unbounded().1,
        }
    }

    /// Blocks until a worker wakes the queue thread.
    fn wait_for_wake(&self) {
        self.wake_rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("no wake-up: a finished request was never reported");
    }
}

impl QueueTransport for ScriptQueue {
    fn fetch(&mut self, tag: u16, buf: &mut [u8]) -> Result<(), UblkError> {
        let t = tag as usize;
        assert!(!self.fetched[t], "tag {tag} fetched twice");
        self.fetched[t] = true;
        self.addrs[t] = buf.as_ptr() as usize;
        Ok(())
    }
    fn commit_and_fetch(&mut self, tag: u16, result: i32, buf: &mut [u8]) -> Result<(), UblkError> {
        let t = tag as usize;
        assert!(self.busy[t], "commit of idle tag {tag}");
        assert_eq!(self.addrs[t], buf.as_ptr() as usize, "tag buffer moved");
        self.busy[t] = false;
        let n = result.max(0) as usize;
        self.commits.push((tag, result, buf[..n].to_vec()));
        Ok(())
    }
    fn waker(&mut self) -> Result<Waker, UblkError> {
        let (tx, rx) = unbounded();
        (self.wake_tx, self.wake_rx) = (tx.clone(), rx);
        Ok(Arc::new(move || {
            let _ = tx.send(());
        }))
    }
    fn wait(&mut self, out: &mut Vec<QueueEvent>) -> Result<(), UblkError> {
        assert!(
            self.fetched.iter().all(|&f| f),
            "waited before arming all tags"
        );
        let next_free = self.batches.front().map(|b| {
            b.iter().all(|ev| match ev {
                QueueEvent::Request { tag, .. } => {
                    !self.busy.get(*tag as usize).copied().unwrap_or(false)
                }
                QueueEvent::Aborted { .. } => true,
            })
        });
        if next_free == Some(false) || (next_free.is_none() && self.busy.contains(&true)) {
            self.wait_for_wake();
            return Ok(());
        }
        match self.batches.pop_front() {
            Some(batch) => {
                for ev in &batch {
                    match ev {
                        QueueEvent::Request { tag, .. } => {
                            assert!(!self.busy[*tag as usize], "tag {tag} reused in flight");
                            self.busy[*tag as usize] = true;
                        }
                        // A stop delivered with requests still running (the fake
                        // multi-queue transport does the same).
                        QueueEvent::Aborted { .. } => self.stopped = true,
                    }
                }
                out.extend(batch);
            }
            None => {
                assert!(!self.stopped, "waited after every tag was aborted");
                assert!(
                    self.busy.iter().all(|&b| !b),
                    "stop with requests in flight"
                );
                self.stopped = true;
                out.extend((0..self.fetched.len() as u16).map(|tag| QueueEvent::Aborted { tag }));
            }
        }
        Ok(())
    }
}

#[test]
fn queue_loop_with_every_tag_in_flight() {
    let want = expected();
    let dev = cow_engine("v3_zstd_16384.cow");
    let depth = 64;
    for workers in [0, 1, 8] {
        let mut rng = fastrand::Rng::with_seed(99);
        let sectors = want.len() as u64 / 512;
        let mut batches = Vec::new();
        let mut reqs = Vec::new();
        for round in 0..4 {
            let mut batch = Vec::new();
            for tag in 0..depth as u16 {
                let n = match tag % 4 {
                    0 => 2048,
                    1 => 8,
                    _ => 1 + rng.u64(..300) as u32,
                };
                let start = rng.u64(..sectors - u64::from(n) + 1);
                let desc = if round == 3 && tag == 5 {
                    IoDesc::new(IoOp::Write, 0, start, n)
                } else if round == 3 && tag == 6 {
                    IoDesc::new(IoOp::Flush, 0, 0, 0)
                } else {
                    read(start, n)
                };
                batch.push(QueueEvent::Request { tag, desc });
                reqs.push((tag, desc));
            }
            batches.push(batch);
        }
        let mut q = ScriptQueue::new(depth, batches);
        let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::new(MIB)).collect();
        let latency = Arc::new(trace::Histogram::default());
        let core = QueueCore::new(&*dev, 0, sectors, MIB).with_latency(latency.clone());
        let mut armed = false;
        let stats = run_queue(&core, &mut q, &mut bufs, workers, || armed = true).unwrap();
        assert!(armed);
        assert!(q.stopped);
        assert_eq!(q.commits.len(), reqs.len());
        // Without workers, commits come in request order; with them, each round's in
        // any order (a round's tags are all reused by the next).
        let mut commits = q.commits.clone();
        if workers > 0 {
            for round in commits.chunks_mut(depth) {
                round.sort_by_key(|c| c.0);
            }
        }
        for ((tag, desc), (ctag, res, data)) in reqs.iter().zip(&commits) {
            assert_eq!(tag, ctag, "workers {workers}");
            match desc.op() {
                IoOp::Write => assert_eq!(*res, -libc::EROFS),
                IoOp::Flush => assert_eq!(*res, 0),
                _ => {
                    let (off, len) = desc.byte_range().unwrap();
                    assert_eq!(*res, len as i32);
                    let off = off as usize;
                    assert!(data[..] == want[off..off + len], "tag {tag} {desc:?}");
                }
            }
        }
        assert_eq!(stats.reads, 4 * 64 - 2);
        assert_eq!(stats.flushes, 1);
        assert_eq!(stats.errors, 1);
        assert_eq!(latency.snapshot().count, 4 * 64 - 2, "one time per READ");
        // Every buffer came back to its tag.
        assert!(bufs.iter().all(|b| b.capacity() >= MIB));
    }
}

#[test]
fn request_on_an_unarmed_tag_is_a_protocol_error() {
    let dev = cow_engine("v3_lz4_65536.cow");
    let mut q = ScriptQueue::new(
        4,
        vec![vec![QueueEvent::Request {
            tag: 9,
            desc: read(0, 8),
        }]],
    );
    q.busy.resize(10, false);
    let mut bufs: Vec<AlignedBuf> = (0..4).map(|_| AlignedBuf::new(MIB)).collect();
    let core = core_for(&*dev);
    let err = run_queue(&core, &mut q, &mut bufs, 2, || {}).unwrap_err();
    assert!(err.to_string().contains("tag 9"), "{err}");
}

// ---- Multi-queue device with a channel-driven fake transport ----

enum Cmd {
    Req(u16, IoDesc),
    Stop,
    Wake,
}

struct Completion {
    q_id: u16,
    tag: u16,
    result: i32,
    data: Vec<u8>,
}

struct FakeTransport {
    log: Mutex<Vec<&'static str>>,
    queue_rx: Mutex<Vec<Option<Receiver<Cmd>>>>,
    queue_tx: Vec<Sender<Cmd>>,
    done_tx: Sender<Completion>,
    fail_queue: Option<u16>,
    params: Mutex<Option<DeviceParams>>,
}

impl FakeTransport {
    fn new(queues: u16) -> (FakeTransport, Vec<Sender<Cmd>>, Receiver<Completion>) {
        let (mut txs, mut rxs) = (Vec::new(), Vec::new());
        for _ in 0..queues {
            let (tx, rx) = unbounded();
            txs.push(tx);
            rxs.push(Some(rx));
        }
        let (done_tx, done_rx) = unbounded();
        let t = FakeTransport {
            log: Mutex::new(Vec::new()),
            queue_rx: Mutex::new(rxs),
            queue_tx: txs.clone(),
            done_tx,
            fail_queue: None,
            params: Mutex::new(None),
        };
        (t, txs, done_rx)
    }
    fn log(&self, s: &'static str) {
        self.log.lock().unwrap().push(s);
    }
}

struct FakeQueue {
    q_id: u16,
    rx: Receiver<Cmd>,
    /// Into `rx`, for the waker.
    tx: Sender<Cmd>,
    done: Sender<Completion>,
    fetched: Vec<bool>,
    busy: Vec<bool>,
    stopping: bool,
}

impl UblkTransport for FakeTransport {
    type Queue = FakeQueue;
    fn add_device(&self, params: &DeviceParams) -> Result<u32, UblkError> {
        self.log("add");
        *self.params.lock().unwrap() = Some(*params);
        Ok(7)
    }
    fn set_params(&self, _: &DeviceParams) -> Result<(), UblkError> {
        self.log("set_params");
        Ok(())
    }
    fn open_queue(&self, q_id: u16) -> Result<FakeQueue, UblkError> {
        if self.fail_queue == Some(q_id) {
            return Err(UblkError::Queue {
                q_id,
                msg: "cannot open the fake queue".into(),
            });
        }
        let rx = self.queue_rx.lock().unwrap()[q_id as usize].take().unwrap();
        let depth = self.params.lock().unwrap().unwrap().depth as usize;
        Ok(FakeQueue {
            q_id,
            rx,
            tx: self.queue_tx[q_id as usize].clone(),
            done: self.done_tx.clone(),
            fetched: vec![false; depth],
            busy: vec![false; depth],
            stopping: false,
        })
    }
    fn start_device(&self) -> Result<(), UblkError> {
        self.log("start");
        Ok(())
    }
    fn stop_device(&self) -> Result<(), UblkError> {
        self.log("stop");
        for tx in &self.queue_tx {
            let _ = tx.send(Cmd::Stop);
        }
        Ok(())
    }
    fn delete_device(&self) -> Result<(), UblkError> {
        self.log("delete");
        Ok(())
    }
}

impl QueueTransport for FakeQueue {
    fn fetch(&mut self, tag: u16, _buf: &mut [u8]) -> Result<(), UblkError> {
        assert!(!std::mem::replace(&mut self.fetched[tag as usize], true));
        Ok(())
    }
    fn commit_and_fetch(&mut self, tag: u16, result: i32, buf: &mut [u8]) -> Result<(), UblkError> {
        assert!(std::mem::replace(&mut self.busy[tag as usize], false));
        let n = result.max(0) as usize;
        self.done
            .send(Completion {
                q_id: self.q_id,
                tag,
                result,
                data: buf[..n].to_vec(),
            })
            .unwrap();
        Ok(())
    }
    fn waker(&mut self) -> Result<Waker, UblkError> {
        let tx = self.tx.clone();
        Ok(Arc::new(move || {
            let _ = tx.send(Cmd::Wake);
        }))
    }
    fn wait(&mut self, out: &mut Vec<QueueEvent>) -> Result<(), UblkError> {
        // After the abort, only requests still running may be waited for.
        assert!(
            !self.stopping || self.busy.contains(&true),
            "waited after all tags were aborted"
        );
        // Everything queued so far, at least one: the driver completes many tags per
        // io_uring_enter.
        let first = self.rx.recv().unwrap();
        let more: Vec<Cmd> = self.rx.try_iter().collect();
        for cmd in std::iter::once(first).chain(more) {
            match cmd {
                Cmd::Req(tag, desc) => {
                    assert!(self.fetched[tag as usize], "request on an unarmed tag");
                    assert!(!std::mem::replace(&mut self.busy[tag as usize], true));
                    out.push(QueueEvent::Request { tag, desc });
                }
                Cmd::Wake => {}
                Cmd::Stop => {
                    // Requests already dispatched are answered before the idle tags are
                    // aborted; busy tags are aborted after their commit.
                    self.stopping = true;
                    out.extend(
                        (0..self.fetched.len() as u16).map(|tag| QueueEvent::Aborted { tag }),
                    );
                }
            }
        }
        Ok(())
    }
}

#[test]
fn several_queues_on_threads_serve_the_image() {
    let want = expected();
    let dev = cow_engine("v3_lz4_262144.cow");
    let queues = 4u16;
    let depth = 16u16;
    let (t, txs, done) = FakeTransport::new(queues);
    let opts = UblkOptions {
        queues,
        depth,
        ..UblkOptions::default()
    };
    let d = UblkDevice::start(dev.clone(), t, &opts).unwrap();
    assert_eq!(d.dev_id(), 7);
    assert_eq!(d.block_path(), PathBuf::from("/dev/ublkb7"));
    assert!(d.is_alive());
    let sectors = want.len() as u64 / 512;
    // One driver thread per queue keeps all its tags busy.
    let expected_reads = std::thread::scope(|s| {
        let mut feeders = Vec::new();
        for (q, tx) in txs.iter().enumerate() {
            let tx = tx.clone();
            feeders.push(s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(1 + q as u64);
                let mut sent = Vec::new();
                for i in 0..192u32 {
                    let tag = (i % u32::from(depth)) as u16;
                    let n = if i % 7 == 0 {
                        2048
                    } else {
                        1 + rng.u64(..256) as u32
                    };
                    let start = rng.u64(..sectors - u64::from(n) + 1);
                    sent.push(((q as u16, tag), read(start, n)));
                    if i % u32::from(depth) == u32::from(depth) - 1 {
                        // Every tag in use: send them as one burst.
                        for ((_, tag), desc) in &sent[sent.len() - depth as usize..] {
                            tx.send(Cmd::Req(*tag, *desc)).unwrap();
                        }
                        // Wait until they are done before reusing the tags, as the
                        // driver would; the main thread counts completions.
                        while !sent_done(q, sent.len()) {
                            std::thread::yield_now();
                        }
                    }
                }
                sent
            }));
        }
        // Collect completions while feeders run.
        let total: usize = 4 * 192;
        let mut got = Vec::new();
        while got.len() < total {
            let c = done.recv().unwrap();
            DONE[c.q_id as usize].fetch_add(1, Ordering::SeqCst);
            got.push(c);
        }
        let sent: Vec<_> = feeders
            .into_iter()
            .flat_map(|f| f.join().unwrap())
            .collect();
        (sent, got)
    });
    let (sent, got) = expected_reads;
    // Match completions to requests by (queue, tag) in order.
    let mut by_key: std::collections::HashMap<(u16, u16), VecDeque<IoDesc>> = Default::default();
    for (key, desc) in &sent {
        by_key.entry(*key).or_default().push_back(*desc);
    }
    for c in &got {
        let desc = by_key
            .get_mut(&(c.q_id, c.tag))
            .and_then(|q| q.pop_front())
            .unwrap();
        let (off, len) = desc.byte_range().unwrap();
        assert_eq!(c.result, len as i32);
        let off = off as usize;
        assert!(c.data == want[off..off + len], "q{} tag {}", c.q_id, c.tag);
    }
    let stats = d.stop().unwrap();
    assert_eq!(stats.reads, got.len() as u64);
    assert_eq!(stats.errors, 0);
}

/// Completions per queue, for the feeders of the test above (only that test uses it).
static DONE: [AtomicUsize; 4] = [const { AtomicUsize::new(0) }; 4];
fn sent_done(q: usize, n: usize) -> bool {
    DONE[q].load(Ordering::SeqCst) >= n
}

#[test]
fn stop_drains_requests_in_flight() {
    let want = expected();
    let dev = cow_engine("v3_gz_4096.cow");
    let (t, txs, done) = FakeTransport::new(2);
    let opts = UblkOptions {
        queues: 2,
        depth: 32,
        ..UblkOptions::default()
    };
    let d = UblkDevice::start(dev, t, &opts).unwrap();
    // Every tag of both queues busy, then stop at once.
    for tx in &txs {
        for tag in 0..32u16 {
            tx.send(Cmd::Req(tag, read(u64::from(tag % 4) * 2048, 2048)))
                .unwrap();
        }
    }
    let stats = d.stop().unwrap();
    let got: Vec<Completion> = done.try_iter().collect();
    assert_eq!(got.len(), 64, "every in-flight request was answered");
    for c in &got {
        let off = (c.tag % 4) as usize * MIB;
        assert_eq!(c.result, MIB as i32);
        assert!(c.data == want[off..off + MIB]);
    }
    assert_eq!(stats.reads, 64);
}

#[test]
fn lifecycle_order_and_failed_queue_tear_down() {
    let dev = cow_engine("v3_lz4_65536.cow");
    let (t, _txs, _done) = FakeTransport::new(3);
    let opts = UblkOptions {
        queues: 3,
        depth: 4,
        ..UblkOptions::default()
    };
    let d = UblkDevice::start(dev.clone(), t, &opts).unwrap();
    let log = d.transport.clone();
    d.stop().unwrap();
    assert_eq!(
        *log.log.lock().unwrap(),
        ["add", "set_params", "start", "stop", "delete"]
    );

    let (mut t, _txs, _done) = FakeTransport::new(3);
    t.fail_queue = Some(1);
    let err = match UblkDevice::start(dev, t, &opts) {
        Ok(_) => panic!("started with a failing queue"),
        Err(e) => e,
    };
    assert!(
        err.to_string().contains("queue 1") && err.to_string().contains("fake queue"),
        "{err}"
    );
}

#[test]
fn failed_start_deletes_the_device() {
    struct NoStart(FakeTransport);
    impl UblkTransport for NoStart {
        type Queue = FakeQueue;
        fn add_device(&self, p: &DeviceParams) -> Result<u32, UblkError> {
            self.0.add_device(p)
        }
        fn set_params(&self, p: &DeviceParams) -> Result<(), UblkError> {
            self.0.set_params(p)
        }
        fn open_queue(&self, q: u16) -> Result<FakeQueue, UblkError> {
            self.0.open_queue(q)
        }
        fn start_device(&self) -> Result<(), UblkError> {
            Err(UblkError::Command {
                cmd: "START_DEV",
                dev_id: 7,
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            })
        }
        fn stop_device(&self) -> Result<(), UblkError> {
            self.0.stop_device()
        }
        fn delete_device(&self) -> Result<(), UblkError> {
            self.0.delete_device()
        }
    }
    let (t, _txs, _done) = FakeTransport::new(2);
    let opts = UblkOptions {
        queues: 2,
        depth: 4,
        ..UblkOptions::default()
    };
    let t = Arc::new(NoStart(t));
    let err = match UblkDevice::start(cow_engine("v3_lz4_65536.cow"), ArcT(t.clone()), &opts) {
        Ok(_) => panic!("started"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("START_DEV"), "{err}");
    assert_eq!(
        *t.0.log.lock().unwrap(),
        ["add", "set_params", "stop", "delete"]
    );
}

/// Lets a test keep a handle on a transport it gave away.
struct ArcT<T>(Arc<T>);
impl<T: UblkTransport> UblkTransport for ArcT<T> {
    type Queue = T::Queue;
    fn add_device(&self, p: &DeviceParams) -> Result<u32, UblkError> {
        self.0.add_device(p)
    }
    fn set_params(&self, p: &DeviceParams) -> Result<(), UblkError> {
        self.0.set_params(p)
    }
    fn open_queue(&self, q: u16) -> Result<T::Queue, UblkError> {
        self.0.open_queue(q)
    }
    fn start_device(&self) -> Result<(), UblkError> {
        self.0.start_device()
    }
    fn stop_device(&self) -> Result<(), UblkError> {
        self.0.stop_device()
    }
    fn delete_device(&self) -> Result<(), UblkError> {
        self.0.delete_device()
    }
}

#[test]
fn params_for_odd_sizes_and_options() {
    let o = UblkOptions::default();
    let p = DeviceParams::new(4 << 20, true, &o, 8).unwrap();
    assert_eq!(p.dev_sectors, 8192);
    assert_eq!(p.logical_bs_shift, 12);
    assert_eq!(p.physical_bs_shift, 12);
    assert_eq!(p.max_sectors, 2048, "1 MiB requests");
    assert_eq!(p.queues, 8, "one queue per CPU");
    assert_eq!(p.depth, 64);
    let b = p.basic();
    assert_eq!(b.attrs, sys::ATTR_READ_ONLY);
    assert_eq!(b.dev_sectors, 8192);
    assert_eq!(b.max_sectors, 2048);
    let info = p.dev_info();
    assert_eq!(info.max_io_buf_bytes, 1 << 20);
    assert_eq!(info.dev_id, u32::MAX, "let the driver pick the id");
    assert_eq!((info.nr_hw_queues, info.queue_depth), (8, 64));
    assert_ne!(info.flags & sys::F_CMD_IOCTL_ENCODE, 0);

    // Not a multiple of 4096: 512-byte blocks, sectors rounded up.
    for (size, sectors, shift) in [
        (4096 * 3 + 512, 25, 9),
        (4096 * 3 + 1, 25, 9),
        (1000, 2, 9),
        (1, 1, 9),
        (4096 * 1000 + 4095, 8008, 9),
        (1u64 << 40, 1 << 31, 12),
    ] {
        let p = DeviceParams::new(size, false, &o, 1).unwrap();
        assert_eq!(
            (p.dev_sectors, p.logical_bs_shift),
            (sectors, shift),
            "{size}"
        );
        assert_eq!(p.physical_bs_shift, 12);
        assert_eq!(p.basic().attrs, 0);
    }
    let p = DeviceParams::new(
        8192,
        true,
        &UblkOptions {
            logical_block_size: 512,
            queues: 3,
            depth: 128,
            max_io_bytes: 256 << 10,
            ..UblkOptions::default()
        },
        64,
    )
    .unwrap();
    assert_eq!((p.logical_bs_shift, p.queues, p.depth), (9, 3, 128));
    assert_eq!(p.max_sectors, 512);
    assert_eq!(DeviceParams::new(1, true, &o, 1000).unwrap().queues, 64);
    assert_eq!(DeviceParams::new(1, true, &o, 0).unwrap().queues, 1);

    for (bad, what) in [
        (
            UblkOptions {
                depth: 0,
                ..o.clone()
            },
            "queue depth 0",
        ),
        (
            UblkOptions {
                depth: 4097,
                ..o.clone()
            },
            "queue depth 4097",
        ),
        (
            UblkOptions {
                logical_block_size: 1024,
                ..o.clone()
            },
            "logical block size 1024",
        ),
        (
            UblkOptions {
                max_io_bytes: 1000,
                ..o.clone()
            },
            "maximum request size 1000",
        ),
        (
            UblkOptions {
                max_io_bytes: 64 << 20,
                ..o.clone()
            },
            "maximum request size",
        ),
    ] {
        let err = DeviceParams::new(4096, true, &bad, 1).unwrap_err();
        assert!(err.to_string().contains(what), "{err}");
    }
    let err = DeviceParams::new(0, true, &o, 1).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
}

#[test]
fn descriptor_op_and_flags_round_trip() {
    let d = IoDesc::new(IoOp::Read, 1 << 5, 123, 8);
    assert_eq!(d.op(), IoOp::Read);
    assert_eq!(d.flags(), 1 << 5);
    assert_eq!(d.op_flags, 1 << 13);
    for raw in 0..=255u8 {
        assert_eq!(IoOp::from_raw(raw).to_raw(), raw);
    }
    assert_eq!(d.byte_range(), Some((123 * 512, 4096)));
    assert_eq!(read(u64::MAX, 1).byte_range(), None);
}

#[test]
fn missing_driver_is_a_clear_error() {
    if Path::new(sys::CONTROL_PATH).exists() {
        // Only meaningful where the driver is absent (this machine and CI).
        return;
    }
    let err = match KernelTransport::open() {
        Ok(_) => panic!("opened {}", sys::CONTROL_PATH),
        Err(e) => e,
    };
    let e = err.to_string();
    assert!(
        e.starts_with("ublk: /dev/ublk-control not found: kernel module ublk_drv not loaded")
            && e.contains("modprobe ublk_drv")
            && e.contains("--nbd or --fuse"),
        "{e}"
    );
}

#[test]
fn dropping_a_running_device_tears_it_down() {
    let (t, _txs, _done) = FakeTransport::new(2);
    let opts = UblkOptions {
        queues: 2,
        depth: 8,
        ..UblkOptions::default()
    };
    let t = Arc::new(t);
    let d = UblkDevice::start(cow_engine("v3_lz4_65536.cow"), ArcT(t.clone()), &opts).unwrap();
    drop(d);
    assert_eq!(
        *t.log.lock().unwrap(),
        ["add", "set_params", "start", "stop", "delete"]
    );
}

/// A device whose reads each wait, up to `patience`, until `want` reads have been
/// inside it at once; it records the most it saw.
struct Rendezvous {
    inner: Arc<dyn BlockDevice>,
    want: usize,
    patience: std::time::Duration,
    /// (reads inside now, most inside at once)
    inside: Mutex<(usize, usize)>,
    cv: std::sync::Condvar,
}

impl BlockDevice for Rendezvous {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> engine::Result<()> {
        let mut g = self.inside.lock().unwrap();
        g.0 += 1;
        g.1 = g.1.max(g.0);
        self.cv.notify_all();
        let (mut g, _) = self
            .cv
            .wait_timeout_while(g, self.patience, |g| g.1 < self.want)
            .unwrap();
        g.0 -= 1;
        drop(g);
        self.inner.read_at(buf, offset)
    }
    fn is_read_only(&self) -> bool {
        true
    }
}

/// The requests of one queue are served at once by its workers, not one after another:
/// eight requests on eight tags are all inside the device together. Without workers
/// (the old one-at-a-time queue loop) only one ever is.
#[test]
fn a_queue_serves_its_requests_concurrently() {
    let want = expected();
    for (workers, patience_ms, expect_inside) in [(8, 10_000, 8), (0, 30, 1)] {
        let dev = Arc::new(Rendezvous {
            inner: cow_engine("v3_lz4_65536.cow"),
            want: 8,
            patience: std::time::Duration::from_millis(patience_ms),
            inside: Mutex::new((0, 0)),
            cv: std::sync::Condvar::new(),
        });
        let (t, txs, done) = FakeTransport::new(1);
        let opts = UblkOptions {
            queues: 1,
            depth: 8,
            workers,
            readahead: None,
            ..UblkOptions::default()
        };
        let d = UblkDevice::start(dev.clone(), t, &opts).unwrap();
        for tag in 0..8u16 {
            txs[0]
                .send(Cmd::Req(tag, read(u64::from(tag) * 1000, 8)))
                .unwrap();
        }
        for _ in 0..8 {
            let c = done
                .recv_timeout(std::time::Duration::from_secs(30))
                .unwrap();
            let off = usize::from(c.tag) * 1000 * 512;
            assert_eq!(c.result, 4096);
            assert!(c.data == want[off..off + 4096], "tag {}", c.tag);
        }
        assert_eq!(d.stop().unwrap().reads, 8);
        assert_eq!(
            dev.inside.lock().unwrap().1,
            expect_inside,
            "workers {workers}"
        );
    }
}

/// A stream of direct reads at queue depth 1 (what `dd iflag=direct` sends to the block
/// device) goes through the read-ahead: most requests are answered from chunks read
/// ahead. Every READ's time is recorded.
#[test]
fn a_sequential_stream_is_read_ahead_and_every_read_is_timed() {
    let want = expected();
    let (t, txs, done) = FakeTransport::new(1);
    let ra = Arc::new(engine::ReadaheadStats::default());
    let latency = Arc::new(trace::Histogram::default());
    let opts = UblkOptions {
        queues: 1,
        depth: 4,
        readahead: Some(engine::ReadaheadOptions {
            depth: 1 << 20,
            chunk: 256 << 10,
            stats: ra.clone(),
            ..engine::ReadaheadOptions::default()
        }),
        latency: latency.clone(),
        ..UblkOptions::default()
    };
    let d = UblkDevice::start(cow_engine("v3_lz4_65536.cow"), t, &opts).unwrap();
    let n = 128u32; // 64 KiB
    let mut reqs = 0u64;
    for start in (0..want.len() as u64 / 512).step_by(n as usize) {
        txs[0]
            .send(Cmd::Req((reqs % 4) as u16, read(start, n)))
            .unwrap();
        let c = done
            .recv_timeout(std::time::Duration::from_secs(30))
            .unwrap();
        let off = start as usize * 512;
        assert_eq!(c.result, 65536);
        assert!(c.data == want[off..off + 65536], "sector {start}");
        reqs += 1;
    }
    let s = d.stop().unwrap();
    assert_eq!(s.reads, reqs);
    assert_eq!(latency.snapshot().count, reqs);
    let hits = ra.hits.load(Ordering::Relaxed);
    assert!(
        ra.chunks.load(Ordering::Relaxed) > 0 && hits > reqs / 2,
        "{hits} of {reqs} requests from read-ahead chunks"
    );
}

mod prop {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        /// Any script of request batches, with or without workers, and with the stop
        /// arriving while requests run or after: the loop ends, and each tag's commits
        /// are its requests' results in order (a tag is reused only once committed), with
        /// the image's bytes for every read.
        #[test]
        fn every_request_is_committed_once_with_its_result(
            depth in 1usize..6,
            workers in 0usize..4,
            script in vec(vec((0u16..6, any::<u64>(), 1u32..300, 0u8..12), 0..7), 0..6),
            stop_while_busy in any::<bool>(),
        ) {
            let want = expected();
            let dev = cow_engine("v3_lz4_65536.cow");
            let sectors = want.len() as u64 / 512;
            let mut batches = Vec::new();
            let mut per_tag: Vec<Vec<IoDesc>> = vec![Vec::new(); depth];
            for raw in &script {
                let mut batch = Vec::new();
                for &(tag, start, n, kind) in raw {
                    if usize::from(tag) >= depth
                        || batch.iter().any(|e| matches!(e, QueueEvent::Request { tag: t, .. } if *t == tag))
                    {
                        continue;
                    }
                    let desc = match kind {
                        0 => IoDesc::new(IoOp::Flush, 0, 0, 0),
                        1 => IoDesc::new(IoOp::Write, 0, start % sectors, 1),
                        2 => read(sectors - u64::from(n) / 2, n), // crosses the end
                        _ => read(start % (sectors - u64::from(n) + 1), n),
                    };
                    batch.push(QueueEvent::Request { tag, desc });
                    per_tag[usize::from(tag)].push(desc);
                }
                batches.push(batch);
            }
            if stop_while_busy && let Some(last) = batches.last_mut() {
                last.extend((0..depth as u16).map(|tag| QueueEvent::Aborted { tag }));
            }
            let mut q = ScriptQueue::new(depth, batches);
            let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::new(MIB)).collect();
            let core = QueueCore::new(&*dev, 0, sectors, MIB);
            run_queue(&core, &mut q, &mut bufs, workers, || {}).unwrap();
            prop_assert!(q.stopped);
            prop_assert!(!q.busy.contains(&true));
            let mut reads = 0;
            for (tag, descs) in per_tag.iter().enumerate() {
                let commits: Vec<_> = q.commits.iter().filter(|c| usize::from(c.0) == tag).collect();
                prop_assert_eq!(commits.len(), descs.len(), "tag {}", tag);
                for (desc, (_, res, data)) in descs.iter().zip(commits) {
                    let (off, len) = desc.byte_range().unwrap();
                    let expect = match desc.op() {
                        IoOp::Flush => 0,
                        IoOp::Write => -libc::EROFS,
                        _ if off + len as u64 > sectors * 512 => -libc::EINVAL,
                        _ => {
                            let off = off as usize;
                            prop_assert!(data[..] == want[off..off + len], "tag {} {:?}", tag, desc);
                            reads += 1;
                            len as i32
                        }
                    };
                    prop_assert_eq!(*res, expect, "tag {} {:?}", tag, desc);
                }
            }
            prop_assert_eq!(core.stats().reads, reads);
        }
    }
}
