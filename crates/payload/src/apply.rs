//! A partition's operations applied: the new partition written from the payload's
//! data and, for an incremental payload, the old partition.
//!
//! Every operation is checked before any is applied (its type, its extents inside
//! the partitions, no destination block written twice), so the operations are then
//! independent and run on all CPUs. Each holds only its own data, source and output
//! in memory: memory grows with the largest operation and the thread count, never
//! with the partition. Each operation's data is checked against its hash before use,
//! each source against its hash, and the whole new partition against its hash at the
//! end.

use std::fs::File;
use std::io::Read as _;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;
use vabc_io::ReadAt;

use crate::error::{Error, Result};
use crate::format::{Payload, sha256};
use crate::proto::{Extent, InstallOperation, OpType, PartitionUpdate};

/// What an extraction trusts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust {
    /// The metadata signature verified: every operation must carry its data's hash and
    /// the partition its new hash, so that nothing unchecked is written.
    Verified,
    /// No signature checked (`--no-verify`): hashes that are present are still
    /// checked, missing ones are not asked for.
    Unverified,
}

/// The old partition of an incremental payload.
pub struct Old<'a> {
    /// Its bytes.
    pub image: &'a (dyn ReadAt + Send),
    /// Its size in bytes.
    pub size: u64,
}

/// Writes partition `part` of `p` into `out` (a new, empty file, which is sized
/// here); `old` is the old partition (incremental payloads); `progress` hears of
/// every block written. Checks the result's hash before returning.
pub fn apply_partition(
    p: &Payload,
    part: &PartitionUpdate,
    old: Option<Old<'_>>,
    out: &File,
    out_name: &std::path::Path,
    trust: Trust,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<()> {
    let name = part.partition_name.as_str();
    let bs = u64::from(p.block_size());
    let new = part
        .new_partition_info
        .as_ref()
        .and_then(|i| i.size)
        .ok_or_else(|| Error::partition(name, "the manifest gives no new size"))?;
    let new_hash = part
        .new_partition_info
        .as_ref()
        .and_then(|i| i.hash.clone());
    if trust == Trust::Verified && new_hash.is_none() {
        return Err(Error::partition(
            name,
            "the manifest gives no hash of the new partition, so the result cannot be checked",
        ));
    }
    let needs_old = part
        .operations
        .iter()
        .any(|o| OpType::try_from(o.r#type).is_ok_and(OpType::reads_source));
    let old_size = match (&old, needs_old) {
        (Some(o), _) => o.size,
        (None, true) => {
            return Err(Error::partition(
                name,
                "the payload is incremental: the old partition is needed",
            ));
        }
        (None, false) => 0,
    };
    if let Some(want) = part.old_partition_info.as_ref().and_then(|i| i.size)
        && old.is_some()
        && old_size < want
    {
        return Err(Error::partition(
            name,
            format!("the old partition has {old_size} bytes, the payload was made against {want}"),
        ));
    }
    check_ops(p, part, new.div_ceil(bs), old_size.div_ceil(bs), trust)?;
    out.set_len(new)
        .map_err(vabc_io::error::on("size", out_name))?;

    // Operations are made on all CPUs and written by one thread: buffered writes to
    // one file take its inode lock, and writers on several CPUs spent more time
    // waiting for it than writing. The image is hashed while it is made: a thread
    // follows the end of the written prefix (operations finish out of order), so
    // hashing overlaps the decompression instead of rereading the image after it.
    let mark = Watermark::default();
    let failed = AtomicBool::new(false);
    let (applied, written, hashed) = std::thread::scope(|sc| {
        // Whatever ends this scope, a panic included, ends the hasher's wait.
        struct Ends<'a>(&'a Watermark);
        impl Drop for Ends<'_> {
            fn drop(&mut self) {
                if self.0.lock().ended.is_none() {
                    self.0.finish(false);
                }
            }
        }
        let _ends = Ends(&mark);
        let hasher = new_hash
            .as_ref()
            .map(|_| sc.spawn(|| mark.hash(out, out_name, new, bs)));
        let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, Vec<u8>)>(1);
        let writer = sc.spawn(|| -> Result<()> {
            for (index, data) in rx {
                let runs = &part.operations[index].dst_extents;
                if let Err(e) = write_runs(out, out_name, runs, &data, bs, new) {
                    failed.store(true, Ordering::Relaxed);
                    return Err(e);
                }
                mark.written(runs);
                progress(blocks(runs));
            }
            Ok(())
        });
        let applied =
            part.operations
                .par_iter()
                .enumerate()
                .try_for_each_with(tx, |tx, (index, op)| {
                    if failed.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    match make_op(p, name, index, op, old.as_ref(), bs) {
                        Ok(Some(data)) => {
                            // A closed channel: the writer failed, and says why.
                            let _ = tx.send((index, data));
                            Ok(())
                        }
                        Ok(None) => {
                            mark.written(&op.dst_extents);
                            progress(blocks(&op.dst_extents));
                            Ok(())
                        }
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            Err(e)
                        }
                    }
                });
        // Every sender is gone once the loop returns: the writer drains and ends.
        let written = writer
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        mark.finish(applied.is_ok() && written.is_ok());
        let hashed = hasher.map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        (applied, written, hashed)
    });
    applied?;
    written?;
    if let (Some(want), Some(got)) = (new_hash, hashed.transpose()?.flatten())
        && got.as_slice() != want.as_slice()
    {
        return Err(Error::partition(
            name,
            format!(
                "the new partition's SHA-256 is {}, the manifest says {}",
                hex::encode(got),
                hex::encode(want)
            ),
        ));
    }
    Ok(())
}

/// The written prefix of the new partition, for the hashing thread: operations
/// report their destination runs as they finish, in any order.
#[derive(Default)]
struct Watermark {
    state: std::sync::Mutex<MarkState>,
    moved: std::sync::Condvar,
}

#[derive(Default)]
struct MarkState {
    /// Blocks `[0, mark)` are written.
    mark: u64,
    /// Written runs past the mark: start -> end.
    ahead: std::collections::BTreeMap<u64, u64>,
    /// Every operation ended: `Some(true)` all applied, `Some(false)` one failed.
    ended: Option<bool>,
}

impl Watermark {
    fn lock(&self) -> std::sync::MutexGuard<'_, MarkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn written(&self, extents: &[Extent]) {
        let mut guard = self.lock();
        let s = &mut *guard;
        for e in extents {
            s.ahead.insert(e.start(), e.start() + e.len());
        }
        let before = s.mark;
        while let Some(end) = s.ahead.remove(&s.mark) {
            s.mark = end;
        }
        if s.mark != before {
            self.moved.notify_all();
        }
    }

    fn finish(&self, ok: bool) {
        self.lock().ended = Some(ok);
        self.moved.notify_all();
    }

    /// SHA-256 of the first `size` bytes of `f`, read as they are written; `None`
    /// when an operation failed.
    fn hash(
        &self,
        f: &File,
        path: &std::path::Path,
        size: u64,
        bs: u64,
    ) -> Result<Option<[u8; 32]>> {
        use sha2::Digest as _;
        use std::os::fd::AsRawFd as _;
        // Reads of the written prefix must not read ahead into blocks not written yet
        // (holes the kernel would fill with zero pages, then the writes replace).
        // SAFETY: posix_fadvise only takes the descriptor and advice; no memory is
        // passed.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0u64;
        while at < size {
            // Wait for bytes past `at`; once every operation ended, the rest (blocks
            // no operation writes) are whatever the file holds.
            let upto = {
                let mut s = self.lock();
                loop {
                    match s.ended {
                        Some(false) => return Ok(None),
                        Some(true) => break size,
                        None if s.mark * bs > at => break (s.mark * bs).min(size),
                        None => s = self.moved.wait(s).unwrap_or_else(|p| p.into_inner()),
                    }
                }
            };
            while at < upto {
                let n = (upto - at).min(buf.len() as u64) as usize;
                FileExt::read_exact_at(f, &mut buf[..n], at)
                    .map_err(|e| vabc_io::Error::new("read", path, e).at(at))?;
                h.update(&buf[..n]);
                at += n as u64;
            }
        }
        Ok(Some(h.finalize().into()))
    }
}

/// The most one operation may write: each is made whole in memory (update_engine's
/// generator cuts REPLACE data into 2 MiB chunks and diffs files of at most a few
/// hundred MiB).
pub const MAX_OP_BYTES: u64 = 1 << 30;

/// Total blocks of `extents`.
pub fn blocks(extents: &[Extent]) -> u64 {
    // Saturating: a crafted manifest's counts are summed before they are checked.
    extents.iter().fold(0u64, |n, e| n.saturating_add(e.len()))
}

/// Every run of `extents` non-empty and inside a partition of `blocks` blocks.
fn inside(extents: &[Extent], blocks: u64, what: &str, which: &str) -> Result<(), String> {
    for e in extents {
        let end = e.start().checked_add(e.len());
        if e.is_empty() || end.is_none_or(|end| end > blocks) {
            return Err(format!(
                "{what} blocks {}+{} are outside the {which} partition ({blocks} blocks)",
                e.start(),
                e.len()
            ));
        }
    }
    Ok(())
}

/// Every operation's type supported, extents in bounds and destinations disjoint;
/// the hashes a verified extraction needs present.
fn check_ops(
    p: &Payload,
    part: &PartitionUpdate,
    new_blocks: u64,
    old_blocks: u64,
    trust: Trust,
) -> Result<()> {
    let bs = u64::from(p.block_size());
    let name = part.partition_name.as_str();
    // Every destination run with its operation, sorted below to find overlaps: memory
    // in the manifest's size, never in the partition's (a crafted size is any number).
    let mut runs: Vec<(u64, u64, usize)> = Vec::new();
    for (index, op) in part.operations.iter().enumerate() {
        let bad = |what: String| Error::op(name, index, op, what);
        let t = OpType::try_from(op.r#type).map_err(|_| Error::Unsupported {
            partition: name.to_string(),
            index,
            op: format!("operation type {}", op.r#type),
        })?;
        match t {
            OpType::Replace
            | OpType::ReplaceBz
            | OpType::ReplaceXz
            | OpType::ReplaceZstd
            | OpType::Zero
            | OpType::Discard
            | OpType::SourceCopy
            | OpType::SourceBsdiff
            | OpType::BrotliBsdiff
            | OpType::Puffdiff
            | OpType::Lz4diffBsdiff
            | OpType::Lz4diffPuffdiff
            | OpType::Zucchini => {}
            OpType::Move | OpType::Bsdiff => {
                return Err(Error::Unsupported {
                    partition: name.to_string(),
                    index,
                    op: t.name().to_string(),
                });
            }
        }
        if t.reads_source() && !p.is_incremental() {
            return Err(bad(
                "a full payload (minor version 0) reads no old partition".into(),
            ));
        }
        let has_data = matches!(
            t,
            OpType::Replace
                | OpType::ReplaceBz
                | OpType::ReplaceXz
                | OpType::ReplaceZstd
                | OpType::SourceBsdiff
                | OpType::BrotliBsdiff
                | OpType::Puffdiff
                | OpType::Lz4diffBsdiff
                | OpType::Lz4diffPuffdiff
                | OpType::Zucchini
        );
        if has_data {
            if op.data_offset.is_none() || op.data_length.is_none() {
                return Err(bad("it gives no data offset and length".into()));
            }
            if trust == Trust::Verified && op.data_sha256_hash.is_none() {
                return Err(bad(
                    "its data has no hash in the signed manifest, so it cannot be checked".into(),
                ));
            }
            // Data is read whole: no encoding of the destination is much larger than
            // it, so a length past this is a crafted one, refused before it is
            // allocated.
            let out = blocks(&op.dst_extents).saturating_mul(bs);
            let most = out.saturating_mul(2).saturating_add(1 << 20);
            if op.data_length.is_some_and(|n| n > most) {
                return Err(bad(format!(
                    "its {} bytes of data are more than any encoding of its {out} bytes",
                    op.data_length.unwrap_or(0)
                )));
            }
        }
        if op.dst_extents.is_empty() {
            return Err(bad("it writes no block".into()));
        }
        inside(&op.dst_extents, new_blocks, "destination", "new").map_err(bad)?;
        // Each operation is made in memory: a bound on it is the bound on memory.
        let out = blocks(&op.dst_extents).saturating_mul(bs);
        if out > MAX_OP_BYTES {
            return Err(bad(format!(
                "it writes {out} bytes; vabc applies operations of at most {MAX_OP_BYTES} \
                 (update_engine's generator makes them of 2 MiB to a few hundred MiB)"
            )));
        }
        runs.extend(
            op.dst_extents
                .iter()
                .map(|e| (e.start(), e.start() + e.len(), index)),
        );
        if t.reads_source() {
            if op.src_extents.is_empty() {
                return Err(bad("it reads no source block".into()));
            }
            inside(&op.src_extents, old_blocks, "source", "old").map_err(bad)?;
            // Runs may repeat: the source read is bounded by the old partition's
            // size, and a copy reads exactly what it writes.
            let src_blocks = blocks(&op.src_extents);
            if src_blocks > old_blocks
                || (t == OpType::SourceCopy && src_blocks != blocks(&op.dst_extents))
            {
                return Err(bad(format!(
                    "it reads {src_blocks} source blocks for {} destination blocks",
                    blocks(&op.dst_extents)
                )));
            }
        } else if !op.src_extents.is_empty() {
            return Err(bad("it names source blocks but reads none".into()));
        }
    }
    runs.sort_unstable();
    for w in runs.windows(2) {
        let ((_, end, first), (start, _, index)) = (w[0], w[1]);
        if start < end {
            let (first, later) = (first.min(index), first.max(index));
            return Err(Error::op(
                name,
                later,
                &part.operations[later],
                format!("destination block {start} is written by operation {first} too"),
            ));
        }
    }
    Ok(())
}

/// The bytes operation `index` writes to its destination runs, in order (`None`: zeros,
/// which a new file holds already).
fn make_op(
    p: &Payload,
    name: &str,
    index: usize,
    op: &InstallOperation,
    old: Option<&Old<'_>>,
    bs: u64,
) -> Result<Option<Vec<u8>>> {
    let bad = |what: String| Error::op(name, index, op, what);
    let t = OpType::try_from(op.r#type).map_err(|_| bad("unknown type".into()))?;
    let dst_len = blocks(&op.dst_extents) * bs;
    let data = p.op_data(name, index, op)?;
    let limited = |r: &mut dyn std::io::Read, what: &str| -> Result<Vec<u8>> {
        // The whole output at once: no regrowth, no copy.
        let mut v = Vec::with_capacity(usize::try_from(dst_len + 1).unwrap_or(0).min(64 << 20));
        r.take(dst_len + 1)
            .read_to_end(&mut v)
            .map_err(|e| bad(format!("its {what} data does not decompress: {e}")))?;
        Ok(v)
    };
    let new: Vec<u8> = match t {
        OpType::Zero | OpType::Discard => return Ok(None),
        OpType::Replace => data,
        OpType::ReplaceBz => limited(&mut bzip2::read::BzDecoder::new(&data[..]), "bzip2")?,
        OpType::ReplaceXz => {
            // xz's own check (CRC64, a tenth of the decoding time) is skipped when the
            // data's SHA-256 was checked above; without one it is what checks.
            let flags = match op.data_sha256_hash {
                Some(_) => liblzma::stream::IGNORE_CHECK,
                None => 0,
            };
            let stream = liblzma::stream::Stream::new_stream_decoder(u64::MAX, flags)
                .map_err(|e| bad(format!("cannot start xz: {e}")))?;
            limited(
                &mut liblzma::read::XzDecoder::new_stream(&data[..], stream),
                "xz",
            )?
        }
        OpType::ReplaceZstd => limited(
            &mut zstd::stream::read::Decoder::new(&data[..])
                .map_err(|e| bad(format!("its zstd data does not open: {e}")))?,
            "zstd",
        )?,
        OpType::SourceCopy
        | OpType::SourceBsdiff
        | OpType::BrotliBsdiff
        | OpType::Puffdiff
        | OpType::Lz4diffBsdiff
        | OpType::Lz4diffPuffdiff
        | OpType::Zucchini => {
            let Some(old) = old else {
                return Err(bad("the old partition is needed".into()));
            };
            let src = read_extents(old, &op.src_extents, bs)
                .map_err(|e| bad(format!("cannot read its source blocks: {e}")))?;
            if let Some(want) = &op.src_sha256_hash {
                let got = sha256(&src);
                if got.as_slice() != want.as_slice() {
                    return Err(bad(format!(
                        "its source blocks have SHA-256 {}, the manifest says {}: the old \
                         partition is not the one the payload was made against",
                        hex::encode(got),
                        hex::encode(want)
                    )));
                }
            }
            if t == OpType::SourceCopy {
                src
            } else if t == OpType::Puffdiff {
                crate::puffin::apply(&src, &data, dst_len)
                    .map_err(|e| bad(format!("its puffin patch does not apply: {e}")))?
            } else if t == OpType::Zucchini {
                crate::zucchini::apply(&src, &data, dst_len)
                    .map_err(|e| bad(format!("its zucchini patch does not apply: {e}")))?
            } else if matches!(t, OpType::Lz4diffBsdiff | OpType::Lz4diffPuffdiff) {
                // The inner patch's type is the header's, as update_engine reads it.
                crate::lz4diff::apply(&src, &data, dst_len)
                    .map_err(|e| bad(format!("its lz4diff patch does not apply: {e}")))?
            } else {
                // update_engine patches all the source runs' bytes; `src_length`
                // only has to be whole blocks.
                crate::bspatch::apply(&src, &data, dst_len)
                    .map_err(|e| bad(format!("its patch does not apply: {e}")))?
            }
        }
        _ => return Err(bad("not supported".into())),
    };
    // A patch may make fewer bytes than its blocks hold (`dst_length`); a REPLACE
    // must fill them.
    let short_ok = matches!(
        t,
        OpType::SourceBsdiff
            | OpType::BrotliBsdiff
            | OpType::Puffdiff
            | OpType::Lz4diffBsdiff
            | OpType::Lz4diffPuffdiff
    );
    if new.len() as u64 > dst_len || (!short_ok && new.len() as u64 != dst_len) {
        return Err(bad(format!(
            "it makes {} bytes for {} destination blocks ({dst_len} bytes)",
            new.len(),
            blocks(&op.dst_extents)
        )));
    }
    Ok(Some(new))
}

/// Writes `new` to `extents` of `out`; the last block may lie past the partition's
/// end (a size not a multiple of the block size): only what is inside is written.
fn write_runs(
    out: &File,
    out_name: &std::path::Path,
    extents: &[Extent],
    new: &[u8],
    bs: u64,
    new_size: u64,
) -> Result<()> {
    let mut at = 0usize;
    for e in extents {
        if at >= new.len() {
            break;
        }
        let off = e.start() * bs;
        let n = ((e.len() * bs) as usize)
            .min(new.len() - at)
            .min(new_size.saturating_sub(off) as usize);
        out.write_all_at(&new[at..at + n], off)
            .map_err(|err| vabc_io::Error::new("write", out_name, err).at(off))?;
        at += (e.len() * bs) as usize;
    }
    Ok(())
}

/// The bytes of `extents` of the old partition, in order.
fn read_extents(old: &Old<'_>, extents: &[Extent], bs: u64) -> std::io::Result<Vec<u8>> {
    let total = blocks(extents) * bs;
    let mut v = vec![0u8; usize::try_from(total).map_err(std::io::Error::other)?];
    let mut at = 0usize;
    for e in extents {
        let off = e.start() * bs;
        let n = (e.len() * bs) as usize;
        // A last block past the old partition's end reads as zeros.
        let inside = (old.size.saturating_sub(off) as usize).min(n);
        old.image.read_exact_at(&mut v[at..at + inside], off)?;
        at += n;
    }
    Ok(v)
}
