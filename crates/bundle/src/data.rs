//! The new data of a plan as a stream of frames, each compressed against the old
//! image's bytes its ops start from.
//!
//! The COW writer ([`delta::write::write_cow`]) reads the new image only for the
//! blocks of REPLACE and XOR runs, each once, in the order it writes them. On the host
//! [`record`] stands in for the new image: it reads the real one and cuts what was read
//! into frames of [`FRAME_BLOCKS`] blocks. On the device [`Replayer`] stands in for the
//! new image the device does not have: it answers the same reads, in the same order,
//! from the frames and the base. Both sides run the same writer on the same plan, so
//! the device's COW is the host's byte for byte; the signed manifest's sha256 of the COW
//! checks it.
//!
//! Each frame is one zstd frame whose *prefix* (`ZSTD_refPrefix`: bytes both sides have
//! and that are never stored) is made of the old image around each block's *context*:
//! its XOR source; for a REPLACE, the source the planner gave up (`Plan::hints`), the
//! continuation of the changed blocks before it, or the same place. zstd then finds
//! what a block shares with the old image at any byte offset and length, where an XOR
//! only helps for bytes at the same position. Measured on the corpus ext4 pairs
//! (`examples/framing.rs`, `examples/windows.rs`): on `small` one XOR stream took
//! 85.6 KB, frames against the sources alone 35.5 KB (xdelta3 -9: 58 KB, `zstd -19
//! --long=31 --patch-from`: 46 KB); on `medium` the contexts alone left 76 KB, and
//! windows of 16 KiB around them 8.6 KB (xdelta3: 10.8 KB), since a changed file's
//! blocks sit a few KiB from where their op's source says. Frames are compressed on
//! several threads and decoded one at a time: a decoder holds one frame (4 MiB) and
//! its prefix (at most 36 MiB).
//!
//! A frame is stored as the `u32` length of its zstd frame, then the zstd frame. Which
//! blocks it holds follows from the plan ([`data_order`]): both sides compute the
//! order, the device builds each frame's prefix from it before decoding, and both check
//! that the writer reads exactly that order.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc;

use delta::{BlockImage, BlockOp, DeltaError, Plan};

/// Blocks per frame.
pub const FRAME_BLOCKS: usize = 1024;
/// log2 of a frame's window: its prefix (at most 1024 × 36 KiB) and content (4 MiB).
const WINDOW_LOG: u32 = 26;

const BS: usize = delta::BLOCK_SIZE;

/// How far back [`replace_context`] looks for a block with a source to continue.
const CONTINUE_BLOCKS: u64 = 64;

/// Old bytes on each side of a block's context that go into its frame's prefix: a
/// block's content often sits a few KiB away from where its op's source says (a line
/// inserted earlier in the file). `medium` ext4 pair, frames of 1024 blocks: margin 0
/// 76.0 KB, 16 KiB 8.6 KB (xdelta3 -9: 10.8 KB), 64 KiB 8.6 KB; `small` 35.5 / 36.3 /
/// 36.5 KB; `tiny` 502.9 / 501.1 / 500.8 KB.
const MARGIN: u64 = 16 << 10;

/// The old bytes a REPLACE block is compressed against: where the planner found it
/// before giving its source up ([`Plan::hints`]); else, in a run of changed blocks, the
/// continuation of the nearest one before it that has a source (a file's changed block
/// sits where that file's old version continues); else the same place in the old
/// image.
fn replace_context(plan: &Plan, b: u64) -> u64 {
    let bs = BS as u64;
    if let Ok(i) = plan.hints.binary_search_by_key(&b, |h| h.0) {
        return plan.hints[i].1;
    }
    let at = plan.ops.partition_point(|o| o.dst < b);
    // Back over the changed blocks right before `b`; an unchanged block (no op) sits
    // at its own place, and so, probably, does `b`.
    for (k, o) in plan.ops[..at].iter().rev().enumerate() {
        if o.dst + 1 + k as u64 != b || k as u64 >= CONTINUE_BLOCKS {
            break;
        }
        let src = match o.op {
            BlockOp::Copy { src_block } => src_block * bs,
            BlockOp::Xor { src_offset } => src_offset,
            BlockOp::Zero | BlockOp::Replace => continue,
        };
        if let Some(s) = src.checked_add((b - o.dst) * bs) {
            return s;
        }
    }
    b * bs
}

fn op_at(plan: &Plan, block: u64) -> Option<BlockOp> {
    plan.ops
        .binary_search_by_key(&block, |o| o.dst)
        .ok()
        .map(|i| plan.ops[i].op)
}

/// Appends to `prefix` the old bytes block `b` is compressed against: its XOR source,
/// or for a REPLACE the source the planner gave up ([`Plan::hints`]) or else the old
/// block at the same place (if the old image has one). An
/// error for blocks the writer never reads (neither XOR nor REPLACE).
/// Where the old bytes block `b` is compressed against start (`None` for blocks the
/// writer never reads).
pub fn context_offset(plan: &Plan, b: u64) -> Option<u64> {
    match op_at(plan, b)? {
        BlockOp::Xor { src_offset } => Some(src_offset),
        BlockOp::Replace => Some(replace_context(plan, b)),
        _ => None,
    }
}

/// The old bytes a frame of `blocks` is compressed against: the context of each block
/// ([`context_offset`]) widened by [`MARGIN`] on both sides, overlapping windows
/// merged, in ascending order of the old image. An error for blocks the writer never
/// reads (neither XOR nor REPLACE).
fn frame_prefix(
    plan: &Plan,
    old: &dyn BlockImage,
    blocks: &[u64],
    name: &Path,
) -> delta::Result<Vec<u8>> {
    let mut wins = Vec::with_capacity(blocks.len());
    for &b in blocks {
        let c = context_offset(plan, b).ok_or_else(|| DeltaError::Verify {
            path: name.to_path_buf(),
            msg: format!(
                "the COW writer read block {b}, which the plan makes by {:?}",
                op_at(plan, b)
            ),
        })?;
        let start = c.saturating_sub(MARGIN);
        let end = c.saturating_add(BS as u64 + MARGIN).min(old.size());
        if start < end {
            wins.push((start, end));
        }
    }
    wins.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(wins.len());
    for (a, b) in wins {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    let mut prefix = Vec::new();
    for (a, b) in merged {
        let at = prefix.len();
        prefix.resize(at + (b - a) as usize, 0);
        old.read_exact_at(&mut prefix[at..], a)?;
    }
    Ok(prefix)
}

/// The blocks the COW writer reads, in the order it reads them: the XOR and REPLACE
/// blocks of its op stream, which is the merge order (`merge_ordered`: v3 without
/// `--block-order`) or ascending blocks. Frames cut this sequence every
/// [`FRAME_BLOCKS`]; both sides compute it from the plan, and both check that the
/// writer reads exactly it.
pub fn data_order(plan: &Plan, merge_ordered: bool) -> Vec<u64> {
    if merge_ordered {
        delta::write::merge_ops(plan)
            .iter()
            .filter(|o| matches!(o.kind, cow::OpKind::Xor | cow::OpKind::Replace))
            .map(|o| o.new_block)
            .collect()
    } else {
        plan.ops
            .iter()
            .filter(|p| matches!(p.op, BlockOp::Xor { .. } | BlockOp::Replace))
            .map(|p| p.dst)
            .collect()
    }
}

/// `content` (one 4 KiB block per entry of `blocks`, in that order) rearranged in
/// ascending block order: inside a frame, neighbouring blocks of the image compress
/// better next to each other than in the merge order (`medium` pair: 9.8 KB of frames
/// in merge order).
fn by_block(blocks: &[u64], content: &[u8]) -> Vec<u8> {
    let mut idx: Vec<usize> = (0..blocks.len()).collect();
    idx.sort_unstable_by_key(|&i| blocks[i]);
    let mut out = Vec::with_capacity(content.len());
    for i in idx {
        out.extend_from_slice(&content[i * BS..(i + 1) * BS]);
    }
    out
}

/// A frame ready to compress: its blocks, its prefix and its content.
struct Frame {
    index: usize,
    blocks: Vec<u64>,
    prefix: Vec<u8>,
    content: Vec<u8>,
}

fn compress(frame: &Frame, level: i32) -> std::io::Result<Vec<u8>> {
    let mut c = zstd::bulk::Compressor::new(level)?;
    c.set_parameter(zstd::zstd_safe::CParameter::WindowLog(WINDOW_LOG))?;
    c.context_mut()
        .ref_prefix(&frame.prefix)
        .map_err(|e| std::io::Error::other(zstd::zstd_safe::get_error_name(e)))?;
    let z = c.compress(&frame.content)?;
    let mut out = Vec::with_capacity(4 + z.len());
    out.extend_from_slice(&(z.len() as u32).to_le_bytes());
    out.extend_from_slice(&z);
    Ok(out)
}

/// The new image as the host's COW writer reads it, cutting what it reads into frames.
pub struct Recorder<'a> {
    new: &'a dyn BlockImage,
    old: &'a dyn BlockImage,
    plan: &'a Plan,
    /// [`data_order`]: what the writer must read.
    order: Vec<u64>,
    current: Mutex<(Option<Frame>, usize)>,
    frames: mpsc::SyncSender<Frame>,
    out: PathBuf,
}

impl Recorder<'_> {
    fn send(&self, mut frame: Frame) -> delta::Result<()> {
        frame.prefix = frame_prefix(self.plan, self.old, &frame.blocks, self.new.name())?;
        frame.content = by_block(&frame.blocks, &frame.content);
        self.frames.send(frame).map_err(|_| DeltaError::Output {
            path: self.out.clone(),
            op: "compress the data stream for",
            source: std::io::Error::other("a compression thread stopped"),
        })
    }
}

impl BlockImage for Recorder<'_> {
    fn size(&self) -> u64 {
        self.new.size()
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> delta::Result<()> {
        self.new.read_exact_at(buf, offset)?;
        let mut guard = self.current.lock().map_err(|_| DeltaError::Verify {
            path: self.out.clone(),
            msg: "a recording thread panicked".into(),
        })?;
        for (i, block) in buf.chunks(BS).enumerate() {
            let b = offset / BS as u64 + i as u64;
            let (current, next_index) = &mut *guard;
            let at = *next_index * FRAME_BLOCKS + current.as_ref().map_or(0, |f| f.blocks.len());
            if self.order.get(at) != Some(&b) {
                return Err(DeltaError::Verify {
                    path: self.out.clone(),
                    msg: format!(
                        "the COW writer read block {b} as its data block {at}, where the \
                         bundle's order has {:?}",
                        self.order.get(at)
                    ),
                });
            }
            let frame = current.get_or_insert_with(|| Frame {
                index: *next_index,
                blocks: Vec::with_capacity(FRAME_BLOCKS),
                prefix: Vec::new(),
                content: Vec::with_capacity(FRAME_BLOCKS * BS),
            });
            frame.blocks.push(b);
            frame.content.extend_from_slice(block);
            if frame.blocks.len() == FRAME_BLOCKS
                && let Some(full) = current.take()
            {
                *next_index += 1;
                self.send(full)?;
            }
        }
        Ok(())
    }

    fn name(&self) -> &Path {
        self.new.name()
    }
}

/// How [`record`] compresses.
#[derive(Clone, Copy, Debug)]
pub struct StreamOptions {
    /// zstd level of the frames.
    pub level: i32,
    /// The COW writer's op stream is in merge order (see [`data_order`]).
    pub merge_ordered: bool,
    /// Threads compressing frames (at least one).
    pub threads: usize,
}

/// Runs `write` (the COW writer) with a [`Recorder`] for the new image, compressing
/// its frames into `out` (`out_name` in errors); `merge_ordered` as for
/// [`data_order`]. Returns what `write` returned and the bytes recorded
/// (uncompressed).
pub fn record<T>(
    new: &dyn BlockImage,
    old: &dyn BlockImage,
    plan: &Plan,
    out: &mut (dyn Write + Send),
    out_name: &Path,
    opts: StreamOptions,
    write: impl FnOnce(&Recorder<'_>) -> delta::Result<T>,
) -> delta::Result<(T, u64)> {
    let StreamOptions {
        level,
        threads,
        merge_ordered,
    } = opts;
    let out_err = |source: std::io::Error| DeltaError::Output {
        path: out_name.to_path_buf(),
        op: "write the data stream to",
        source,
    };
    let threads = threads.max(1);
    // Bounded: the writer waits rather than holding many frames in memory.
    let (frame_tx, frame_rx) = mpsc::sync_channel::<Frame>(threads);
    let frame_rx = Mutex::new(frame_rx);
    std::thread::scope(|scope| {
        let (done_tx, done_rx) = mpsc::channel::<std::io::Result<(usize, Vec<u8>)>>();
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let done_tx = done_tx.clone();
                let frame_rx = &frame_rx;
                scope.spawn(move || {
                    loop {
                        let next = frame_rx.lock().ok().and_then(|rx| rx.recv().ok());
                        let Some(frame) = next else { break };
                        let r = compress(&frame, level).map(|z| (frame.index, z));
                        // Frames are taken until the recorder stops sending, even after
                        // a failure, so that it never waits on a full channel.
                        let _ = done_tx.send(r);
                    }
                })
            })
            .collect();
        drop(done_tx);
        // Frames come back in any order; they are written in order.
        let collector = scope.spawn(move || -> std::io::Result<u64> {
            let mut pending = BTreeMap::new();
            let mut next = 0;
            let mut written = 0u64;
            for r in done_rx {
                let (i, bytes) = r?;
                pending.insert(i, bytes);
                while let Some(bytes) = pending.remove(&next) {
                    out.write_all(&bytes)?;
                    written += bytes.len() as u64;
                    next += 1;
                }
            }
            Ok(written)
        });
        let order = data_order(plan, merge_ordered);
        let expected = order.len();
        let rec = Recorder {
            new,
            old,
            plan,
            order,
            current: Mutex::new((None, 0)),
            frames: frame_tx,
            out: out_name.to_path_buf(),
        };
        let result = write(&rec).and_then(|t| {
            let last = rec
                .current
                .lock()
                .map_err(|_| DeltaError::Verify {
                    path: out_name.to_path_buf(),
                    msg: "a recording thread panicked".into(),
                })?
                .0
                .take();
            let read = rec.current.lock().map_or(0, |g| g.1 * FRAME_BLOCKS);
            if let Some(f) = last {
                let n = read + f.blocks.len();
                rec.send(f)?;
                if n != expected {
                    return Err(DeltaError::Verify {
                        path: out_name.to_path_buf(),
                        msg: format!(
                            "the COW writer read {n} data blocks, the plan has {expected}"
                        ),
                    });
                }
            } else if read != expected {
                return Err(DeltaError::Verify {
                    path: out_name.to_path_buf(),
                    msg: format!("the COW writer read {read} data blocks, the plan has {expected}"),
                });
            }
            Ok(t)
        });
        drop(rec);
        for w in workers {
            let _ = w.join();
        }
        collector
            .join()
            .map_err(|_| out_err(std::io::Error::other("the frame writer panicked")))?
            .map_err(out_err)?;
        result.map(|t| (t, (expected * BS) as u64))
    })
}

/// The new image as the device's COW writer reads it, answered from the frames and the
/// base.
pub struct Replayer<'a, R: Read> {
    old: &'a dyn BlockImage,
    plan: &'a Plan,
    state: Mutex<ReplayState<R>>,
    /// The bundle, for errors.
    name: PathBuf,
    size: u64,
}

struct ReplayState<R> {
    input: R,
    /// Offset in the bundle of the next byte of `input`.
    pos: u64,
    /// [`data_order`], and how many of its blocks the frames decoded so far hold.
    order: Vec<u64>,
    decoded: usize,
    /// The current frame's blocks in the order the writer reads them, and ascending
    /// (the order of `content`).
    blocks: Vec<u64>,
    sorted: Vec<u64>,
    content: Vec<u8>,
    /// Next block of the current frame to hand out.
    next: usize,
}

impl<'a, R: Read + Send> Replayer<'a, R> {
    /// Replays the frames read from `input` (the data section of a payload, starting at
    /// offset `pos` of the bundle `name`) for an image of `size` bytes; `merge_ordered`
    /// as for [`data_order`].
    pub fn new(
        old: &'a dyn BlockImage,
        plan: &'a Plan,
        merge_ordered: bool,
        input: R,
        pos: u64,
        name: &Path,
        size: u64,
    ) -> std::io::Result<Replayer<'a, R>> {
        Ok(Replayer {
            old,
            plan,
            state: Mutex::new(ReplayState {
                input,
                pos,
                order: data_order(plan, merge_ordered),
                decoded: 0,
                sorted: Vec::new(),
                blocks: Vec::new(),
                content: Vec::new(),
                next: 0,
            }),
            name: name.to_path_buf(),
            size,
        })
    }

    /// Checks that the writer took every block of the last frame, and returns the
    /// input (to be hashed to its end).
    pub fn finish(self) -> Result<R, String> {
        let st = self
            .state
            .into_inner()
            .map_err(|_| "a replaying thread panicked".to_string())?;
        if st.next != st.blocks.len() || st.decoded != st.order.len() {
            return Err(format!(
                "offset {}: the COW writer read {} of the plan's {} data blocks",
                st.pos,
                st.decoded - (st.blocks.len() - st.next),
                st.order.len()
            ));
        }
        Ok(st.input)
    }

    fn fail(&self, pos: u64, msg: String) -> DeltaError {
        DeltaError::Read {
            path: self.name.clone(),
            offset: pos,
            len: 0,
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, msg),
        }
    }

    /// Reads and decodes the next frame into `st`.
    fn next_frame(&self, st: &mut ReplayState<R>) -> delta::Result<()> {
        let at = st.pos;
        let mut word = [0u8; 4];
        let read = |st: &mut ReplayState<R>, buf: &mut [u8]| -> delta::Result<()> {
            st.input
                .read_exact(buf)
                .map_err(|e| self.fail(st.pos, format!("the data stream ends early ({e})")))?;
            st.pos += buf.len() as u64;
            Ok(())
        };
        let n = (st.order.len() - st.decoded).min(FRAME_BLOCKS);
        if n == 0 {
            return Err(self.fail(
                at,
                "the COW writer reads more data blocks than the plan has".into(),
            ));
        }
        let blocks = st.order[st.decoded..st.decoded + n].to_vec();
        read(st, &mut word)?;
        let zlen = u32::from_le_bytes(word) as usize;
        if zlen > 2 * FRAME_BLOCKS * BS {
            return Err(self.fail(at, format!("frame of {zlen} bytes is too large")));
        }
        let mut z = vec![0u8; zlen];
        let zat = st.pos;
        read(st, &mut z)?;
        let prefix = frame_prefix(self.plan, self.old, &blocks, &self.name)?;
        // One context per frame: it borrows the frame's prefix.
        let mut dctx = zstd::zstd_safe::DCtx::create();
        dctx.ref_prefix(&prefix)
            .map_err(|e| self.fail(zat, format!("zstd: {}", zstd::zstd_safe::get_error_name(e))))?;
        st.content.resize(n * BS, 0);
        let got = dctx.decompress(&mut st.content[..], &z).map_err(|e| {
            self.fail(
                zat,
                format!("zstd frame: {}", zstd::zstd_safe::get_error_name(e)),
            )
        })?;
        if got != n * BS {
            return Err(self.fail(zat, format!("frame decodes to {got} bytes, not {}", n * BS)));
        }
        let mut sorted = blocks.clone();
        sorted.sort_unstable();
        st.blocks = blocks;
        st.sorted = sorted;
        st.next = 0;
        st.decoded += n;
        Ok(())
    }
}

impl<R: Read + Send> BlockImage for Replayer<'_, R> {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> delta::Result<()> {
        let mut st = self.state.lock().map_err(|_| DeltaError::Verify {
            path: self.name.clone(),
            msg: "a replaying thread panicked".into(),
        })?;
        for (i, out) in buf.chunks_mut(BS).enumerate() {
            let b = offset / BS as u64 + i as u64;
            if st.next == st.blocks.len() {
                self.next_frame(&mut st)?;
            }
            if st.blocks[st.next] != b {
                return Err(self.fail(
                    st.pos,
                    format!(
                        "the COW writer asks for block {b}, the data stream holds block {} next",
                        st.blocks[st.next]
                    ),
                ));
            }
            let at = st.sorted.binary_search(&b).unwrap_or_default() * BS;
            out.copy_from_slice(&st.content[at..at + out.len()]);
            st.next += 1;
        }
        Ok(())
    }

    fn name(&self) -> &Path {
        &self.name
    }
}
