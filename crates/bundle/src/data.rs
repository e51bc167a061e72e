//! The new data of a plan as a stream of frames, each compressed against the old
//! image's bytes its ops start from.
//!
//! The COW writer ([`delta::write::write_cow`]) reads the new image only for the
//! blocks of REPLACE and XOR runs, each once, in the order it writes them. On the host
//! [`record`] stands in for the new image: it reads the real one and cuts what was read
//! into groups of [`GROUP_BLOCKS`], each sorted by block and cut into frames
//! ([`FrameParams`]). On the device [`Replayer`] stands in for the
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
//! several threads and decoded one at a time: a decoder holds one group (16 MiB) and one
//! frame's prefix (at most 36 MiB).
//!
//! A frame is stored as the `u32` length of its zstd frame, then the zstd frame. Which
//! blocks it holds follows from the plan ([`data_order`]) and the frame size in the
//! manifest: both sides compute the
//! order, the device builds each frame's prefix from it before decoding, and both check
//! that the writer reads exactly that order.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc;

use delta::{BlockImage, BlockOp, DeltaError, Plan};

/// Blocks of a *group*: the data blocks in the writer's read order are cut into groups
/// of this many, each sorted ascending and cut into frames. A decoder holds one group
/// (16 MiB) at once. Larger groups give frames of neighbouring blocks where the merge
/// order scatters them: frames of 64 cut from groups of 1024 / 2048 / 4096 blocks
/// made `small` EROFS 59.7 / 55.5 / 55.5 KB and `tiny` ext4 514 / 517 / 506 KB
/// (`examples/params.rs`, `MERGE=1 GROUP=N`).
pub const GROUP_BLOCKS: usize = 4096;
/// Most blocks a frame holds (a reader refuses more): 4 MiB.
pub const MAX_FRAME_BLOCKS: u32 = 1024;
/// log2 of a frame's window: its prefix (at most 1024 × 36 KiB) and content (4 MiB).
const WINDOW_LOG: u32 = 26;

/// Blocks per frame, but for an update whose blocks draw on each other's windows.
pub const FRAME_BLOCKS: u32 = 64;
/// zstd level of [`FrameParams::choose`]'s probe: a tenth of [`Search::Fast`]'s time.
const PROBE_LEVEL: i32 = 12;

/// How the frames are cut and searched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameParams {
    /// Blocks per frame (a group's last frame may hold fewer); written in the manifest.
    pub blocks: u32,
    /// How hard zstd searches (the decoder does not need to know).
    pub search: Search,
}

/// zstd's search for a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Search {
    /// A zstd level's own parameters.
    Level(i32),
    /// btultra's optimal parse with a short search (searchLog 2) and matches from 3
    /// bytes: recompiled code shares many short runs with its old version, which
    /// minMatch 3 finds (`tiny`: 18% fewer bytes than minMatch 4), and a deep search
    /// adds 1-2% to them at twice the time.
    Fast,
}

impl FrameParams {
    /// How to compress the data of `plan` (`new`'s XOR and REPLACE blocks against
    /// `old`). `level`: frames of [`MAX_FRAME_BLOCKS`] at that zstd level. Else frames of
    /// [`FRAME_BLOCKS`] with the [`Search::Fast`] search: a small frame has a small
    /// prefix, so each position's search is short (`small` pair at level 19: 11.7 MB/s
    /// searched in frames of 64 blocks, 4.7 MB/s in one frame of 1024), and the frames
    /// share the CPUs; creation time then stays within `xdelta3 -9`'s on every corpus
    /// pair (`bench/results/bundle.md`). But an update whose data fits
    /// one frame of [`MAX_FRAME_BLOCKS`] is probed first, at zstd level 12 as one frame
    /// and as frames of 64 (reading its data once more, at most 4 MiB): if one frame
    /// takes at most 3/4 of the bytes, its blocks draw on each other's
    /// windows (the `medium` pairs: a rearranged file whose blocks take their bytes
    /// from old places 1.5 MB apart, 0.47-0.49 on ext4 and EROFS, where every other
    /// pair is at 0.89-1.02), and it is one frame at level 19, the deepest search,
    /// which costs little on so few blocks. So is an update of at most one frame's
    /// blocks.
    pub fn choose(
        level: Option<i32>,
        plan: &Plan,
        old: &dyn BlockImage,
        new: &dyn BlockImage,
    ) -> delta::Result<FrameParams> {
        let whole = |search| FrameParams {
            blocks: MAX_FRAME_BLOCKS,
            search,
        };
        if let Some(l) = level {
            return Ok(whole(Search::Level(l)));
        }
        let split = FrameParams {
            blocks: FRAME_BLOCKS,
            search: Search::Fast,
        };
        let blocks = data_order(plan, false);
        if blocks.len() <= FRAME_BLOCKS as usize {
            return Ok(whole(Search::Level(19)));
        }
        if blocks.len() > MAX_FRAME_BLOCKS as usize {
            return Ok(split);
        }
        let mut content = vec![0u8; blocks.len() * BS];
        for (b, c) in blocks.iter().zip(content.chunks_mut(BS)) {
            new.read_at(c, b * BS as u64)?;
        }
        let probe = |n: usize| -> delta::Result<usize> {
            let mut total = 0;
            for (bs, cs) in blocks.chunks(n).zip(content.chunks(n * BS)) {
                let prefix = frame_prefix(plan, old, bs, new.name())?;
                total += compress(&prefix, cs, Search::Level(PROBE_LEVEL))
                    .map_err(|source| {
                        DeltaError::Io(vabc_io::Error::new(
                            "compress a probe of",
                            new.name(),
                            source,
                        ))
                    })?
                    .len();
            }
            Ok(total)
        };
        let (one, frames) = std::thread::scope(|scope| {
            let one = scope.spawn(|| probe(MAX_FRAME_BLOCKS as usize));
            let frames = probe(FRAME_BLOCKS as usize);
            (one.join(), frames)
        });
        let one = one.map_err(|_| DeltaError::Verify {
            path: new.name().to_path_buf(),
            msg: "a probing thread panicked".into(),
        })??;
        let frames = frames?;
        Ok(if one * 4 <= frames * 3 {
            whole(Search::Level(19))
        } else {
            split
        })
    }
}

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
        old.read_at(&mut prefix[at..], a)?;
    }
    Ok(prefix)
}

/// The blocks the COW writer reads, in the order it reads them: the XOR and REPLACE
/// blocks of its op stream, which is the merge order (`merge_ordered`: v3 without
/// `--block-order`) or ascending blocks. Groups cut this sequence every
/// [`GROUP_BLOCKS`], and each sorted group is cut into frames of
/// [`FrameParams::blocks`]; both sides compute it from the plan, and both check that
/// the writer reads exactly it.
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

/// Positions of `blocks` in ascending block order: neighbouring blocks of the image
/// compress better next to each other than in the merge order (`medium` pair: 9.8 KB
/// of frames in merge order), and frames cut from a sorted group hold blocks whose
/// windows overlap.
fn ascending(blocks: &[u64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..blocks.len()).collect();
    idx.sort_unstable_by_key(|&i| blocks[i]);
    idx
}

/// A frame ready to compress: where it goes in the stream, its prefix and its content
/// (its blocks ascending).
struct Frame {
    index: usize,
    prefix: Vec<u8>,
    content: Vec<u8>,
}

/// The blocks of a group as the writer read them, and their content.
#[derive(Default)]
struct Group {
    blocks: Vec<u64>,
    content: Vec<u8>,
}

/// Where the recorder is: the group being read, the groups and frames sent.
#[derive(Default)]
struct RecordState {
    group: Group,
    groups_sent: usize,
    frames_sent: usize,
}

/// `content` as one zstd frame against `prefix`, after its `u32` length.
fn compress(prefix: &[u8], content: &[u8], search: Search) -> std::io::Result<Vec<u8>> {
    use zstd::zstd_safe::{CParameter, Strategy};
    let mut c = match search {
        Search::Level(level) => zstd::bulk::Compressor::new(level)?,
        Search::Fast => {
            let mut c = zstd::bulk::Compressor::new(17)?;
            c.set_parameter(CParameter::Strategy(Strategy::ZSTD_btultra))?;
            c.set_parameter(CParameter::SearchLog(2))?;
            c.set_parameter(CParameter::MinMatch(3))?;
            c
        }
    };
    c.set_parameter(CParameter::WindowLog(WINDOW_LOG))?;
    c.context_mut()
        .ref_prefix(prefix)
        .map_err(|e| std::io::Error::other(zstd::zstd_safe::get_error_name(e)))?;
    let z = c.compress(content)?;
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
    frame_blocks: usize,
    state: Mutex<RecordState>,
    frames: mpsc::SyncSender<Frame>,
    out: PathBuf,
}

impl Recorder<'_> {
    /// Sorts the group read so far and sends it as frames to the compressing threads.
    fn send_group(&self, st: &mut RecordState) -> delta::Result<()> {
        let group = std::mem::take(&mut st.group);
        if group.blocks.is_empty() {
            return Ok(());
        }
        for idx in ascending(&group.blocks).chunks(self.frame_blocks) {
            let blocks: Vec<u64> = idx.iter().map(|&i| group.blocks[i]).collect();
            let mut content = Vec::with_capacity(idx.len() * BS);
            for &i in idx {
                content.extend_from_slice(&group.content[i * BS..(i + 1) * BS]);
            }
            let frame = Frame {
                index: st.frames_sent,
                prefix: frame_prefix(self.plan, self.old, &blocks, self.new.name())?,
                content,
            };
            st.frames_sent += 1;
            self.frames.send(frame).map_err(|_| {
                DeltaError::Io(vabc_io::Error::new(
                    "compress the data stream for",
                    &self.out,
                    std::io::Error::other("a compression thread stopped"),
                ))
            })?;
        }
        st.groups_sent += 1;
        Ok(())
    }
}

impl vabc_io::ReadAt for Recorder<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.record(buf, offset).map_err(delta::image::fail)
    }
}

impl BlockImage for Recorder<'_> {
    fn size(&self) -> u64 {
        self.new.size()
    }

    fn name(&self) -> &Path {
        self.new.name()
    }
}

impl Recorder<'_> {
    /// Reads NEW for the COW writer, recording each block in the order it asks.
    fn record(&self, buf: &mut [u8], offset: u64) -> delta::Result<()> {
        self.new.read_at(buf, offset)?;
        let mut st = self.state.lock().map_err(|_| DeltaError::Verify {
            path: self.out.clone(),
            msg: "a recording thread panicked".into(),
        })?;
        for (i, block) in buf.chunks(BS).enumerate() {
            let b = offset / BS as u64 + i as u64;
            let at = st.groups_sent * GROUP_BLOCKS + st.group.blocks.len();
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
            st.group.blocks.push(b);
            st.group.content.extend_from_slice(block);
            if st.group.blocks.len() == GROUP_BLOCKS {
                self.send_group(&mut st)?;
            }
        }
        Ok(())
    }
}

/// How [`record`] compresses.
#[derive(Clone, Copy, Debug)]
pub struct StreamOptions {
    /// How the frames are cut and searched.
    pub frames: FrameParams,
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
        frames,
        threads,
        merge_ordered,
    } = opts;
    if !(1..=MAX_FRAME_BLOCKS).contains(&frames.blocks) {
        return Err(DeltaError::Verify {
            path: out_name.to_path_buf(),
            msg: format!(
                "frames of {} blocks asked for (1 to {MAX_FRAME_BLOCKS} allowed)",
                frames.blocks
            ),
        });
    }
    let frame_blocks = frames.blocks as usize;
    let out_err = |source: std::io::Error| {
        DeltaError::Io(vabc_io::Error::new(
            "write the data stream to",
            out_name,
            source,
        ))
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
                        let r = compress(&frame.prefix, &frame.content, frames.search)
                            .map(|z| (frame.index, z));
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
            frame_blocks,
            state: Mutex::new(RecordState::default()),
            frames: frame_tx,
            out: out_name.to_path_buf(),
        };
        let result = write(&rec).and_then(|t| {
            let mut st = rec.state.lock().map_err(|_| DeltaError::Verify {
                path: out_name.to_path_buf(),
                msg: "a recording thread panicked".into(),
            })?;
            let read = st.groups_sent * GROUP_BLOCKS + st.group.blocks.len();
            rec.send_group(&mut st)?;
            if read != expected {
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
    frame_blocks: usize,
}

struct ReplayState<R> {
    input: R,
    /// Offset in the bundle of the next byte of `input`.
    pos: u64,
    /// [`data_order`], and how many of its blocks the groups decoded so far hold.
    order: Vec<u64>,
    decoded: usize,
    /// The current group's blocks in the order the writer reads them, and ascending
    /// (the order of `content`).
    blocks: Vec<u64>,
    sorted: Vec<u64>,
    content: Vec<u8>,
    /// Next block of the current group to hand out.
    next: usize,
}

impl<'a, R: Read + Send> Replayer<'a, R> {
    /// Replays the frames of `frame_blocks` blocks read from `input` (the data section
    /// of a payload, starting at offset `pos` of the bundle `name`) for an image of
    /// `size` bytes; `merge_ordered` as for [`data_order`]. An error for frames of 0 or
    /// more than [`MAX_FRAME_BLOCKS`] blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        old: &'a dyn BlockImage,
        plan: &'a Plan,
        merge_ordered: bool,
        frame_blocks: u32,
        input: R,
        pos: u64,
        name: &Path,
        size: u64,
    ) -> std::io::Result<Replayer<'a, R>> {
        if !(1..=MAX_FRAME_BLOCKS).contains(&frame_blocks) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{}: frames of {frame_blocks} blocks (1 to {MAX_FRAME_BLOCKS} allowed)",
                    name.display()
                ),
            ));
        }
        Ok(Replayer {
            frame_blocks: frame_blocks as usize,
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

    /// Reads and decodes the next group's frames into `st`.
    fn next_group(&self, st: &mut ReplayState<R>) -> delta::Result<()> {
        let n = (st.order.len() - st.decoded).min(GROUP_BLOCKS);
        if n == 0 {
            return Err(self.fail(
                st.pos,
                "the COW writer reads more data blocks than the plan has".into(),
            ));
        }
        let blocks = st.order[st.decoded..st.decoded + n].to_vec();
        let mut sorted = blocks.clone();
        sorted.sort_unstable();
        st.content.resize(n * BS, 0);
        let mut content = std::mem::take(&mut st.content);
        for (fb, out) in sorted
            .chunks(self.frame_blocks)
            .zip(content.chunks_mut(self.frame_blocks * BS))
        {
            self.decode_frame(st, fb, out)?;
        }
        st.content = content;
        st.blocks = blocks;
        st.sorted = sorted;
        st.next = 0;
        st.decoded += n;
        Ok(())
    }

    /// Reads the next frame, which holds `blocks`, and decodes it into `out`.
    fn decode_frame(
        &self,
        st: &mut ReplayState<R>,
        blocks: &[u64],
        out: &mut [u8],
    ) -> delta::Result<()> {
        let at = st.pos;
        let mut word = [0u8; 4];
        let read = |st: &mut ReplayState<R>, buf: &mut [u8]| -> delta::Result<()> {
            st.input
                .read_exact(buf)
                .map_err(|e| self.fail(st.pos, format!("the data stream ends early ({e})")))?;
            st.pos += buf.len() as u64;
            Ok(())
        };
        read(st, &mut word)?;
        let zlen = u32::from_le_bytes(word) as usize;
        // zstd's bound for a frame of at most 4 MiB is a few hundred bytes over it.
        if zlen > 2 * out.len() + 1024 {
            return Err(self.fail(at, format!("frame of {zlen} bytes is too large")));
        }
        let mut z = vec![0u8; zlen];
        let zat = st.pos;
        read(st, &mut z)?;
        let prefix = frame_prefix(self.plan, self.old, blocks, &self.name)?;
        // One context per frame: it borrows the frame's prefix.
        let mut dctx = zstd::zstd_safe::DCtx::create();
        dctx.ref_prefix(&prefix)
            .map_err(|e| self.fail(zat, format!("zstd: {}", zstd::zstd_safe::get_error_name(e))))?;
        let got = dctx.decompress(&mut *out, &z).map_err(|e| {
            self.fail(
                zat,
                format!("zstd frame: {}", zstd::zstd_safe::get_error_name(e)),
            )
        })?;
        if got != out.len() {
            return Err(self.fail(
                zat,
                format!("frame decodes to {got} bytes, not {}", out.len()),
            ));
        }
        Ok(())
    }
}

impl<R: Read + Send> vabc_io::ReadAt for Replayer<'_, R> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.replay(buf, offset).map_err(delta::image::fail)
    }
}

impl<R: Read + Send> BlockImage for Replayer<'_, R> {
    fn size(&self) -> u64 {
        self.size
    }

    fn name(&self) -> &Path {
        &self.name
    }
}

impl<R: Read + Send> Replayer<'_, R> {
    /// Gives the COW writer the blocks it asks for from the data stream, which must
    /// hold them in that order.
    fn replay(&self, buf: &mut [u8], offset: u64) -> delta::Result<()> {
        let mut st = self.state.lock().map_err(|_| DeltaError::Verify {
            path: self.name.clone(),
            msg: "a replaying thread panicked".into(),
        })?;
        for (i, out) in buf.chunks_mut(BS).enumerate() {
            let b = offset / BS as u64 + i as u64;
            if st.next == st.blocks.len() {
                self.next_group(&mut st)?;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use delta::{MemImage, NoProgress, PlanOptions};

    /// Bytes that do not repeat (so that a match is where the test put it).
    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..n).map(|_| rng.u8(..)).collect()
    }

    fn choose(old: Vec<u8>, new: Vec<u8>) -> FrameParams {
        let (o, n) = (MemImage::new("old", old), MemImage::new("new", new));
        let plan = delta::plan(&o, &n, &PlanOptions::default(), &NoProgress).unwrap();
        FrameParams::choose(None, &plan, &o, &n).unwrap()
    }

    /// `old` with blocks `from..to` changed: each 1 KiB of block `i` comes from block
    /// `i + 40k` (k = 0..4, wrapping inside the range): its sources lie in windows of
    /// blocks that other frames of 64 hold when `rearranged`; else each block keeps
    /// its own bytes with a few changed.
    fn changed(old: &[u8], from: usize, to: usize, rearranged: bool) -> Vec<u8> {
        let mut new = old.to_vec();
        let span = to - from;
        for i in from..to {
            for k in 0..4 {
                let src = if rearranged {
                    from + (i - from + 40 * k) % span
                } else {
                    i
                };
                let (d, s) = (i * BS + k * 1024, src * BS + k * 1024);
                new[d..d + 1024].copy_from_slice(&old[s..s + 1024]);
            }
            new[i * BS + 7] ^= 0x55;
            new[i * BS + 3000] ^= 0x55;
        }
        new
    }

    #[test]
    fn frames_follow_the_update() {
        let old = noise(1200 * BS, 7);
        let fast = FrameParams {
            blocks: FRAME_BLOCKS,
            search: Search::Fast,
        };
        let whole = FrameParams {
            blocks: MAX_FRAME_BLOCKS,
            search: Search::Level(19),
        };
        // Blocks that draw on each other's windows: one frame, searched deep.
        assert_eq!(choose(old.clone(), changed(&old, 100, 400, true)), whole);
        // Blocks that keep to their own windows: frames of 64.
        assert_eq!(choose(old.clone(), changed(&old, 100, 400, false)), fast);
        // More than a frame of 1024: frames of 64 without a probe; at most 64: one frame.
        assert_eq!(choose(old.clone(), changed(&old, 0, 1100, false)), fast);
        assert_eq!(choose(old.clone(), changed(&old, 100, 140, true)), whole);
        // An explicit level: whole groups at that level.
        let (o, n) = (
            MemImage::new("old", old.clone()),
            MemImage::new("new", changed(&old, 100, 400, false)),
        );
        let plan = delta::plan(&o, &n, &PlanOptions::default(), &NoProgress).unwrap();
        assert_eq!(
            FrameParams::choose(Some(7), &plan, &o, &n).unwrap(),
            FrameParams {
                blocks: MAX_FRAME_BLOCKS,
                search: Search::Level(7),
            }
        );
    }

    #[test]
    fn a_frame_size_out_of_range_is_refused_not_clamped() {
        let old = noise(8 * BS, 3);
        let new = changed(&old, 0, 4, false);
        let (o, n) = (MemImage::new("old", old), MemImage::new("new", new));
        let plan = delta::plan(&o, &n, &PlanOptions::default(), &NoProgress).unwrap();
        for blocks in [0, MAX_FRAME_BLOCKS + 1] {
            let opts = StreamOptions {
                frames: FrameParams {
                    blocks,
                    search: Search::Level(3),
                },
                merge_ordered: true,
                threads: 1,
            };
            let mut out = Vec::new();
            let e = record(&n, &o, &plan, &mut out, Path::new("b.vabc"), opts, |_| {
                Ok(())
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains(&format!("frames of {blocks} blocks")), "{e}");
            assert!(out.is_empty());
        }
    }
}
