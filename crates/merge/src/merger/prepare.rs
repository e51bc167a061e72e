//! The merge's CPU work that does not depend on the base: reading the
//! COW's stored payloads and decompressing them, on worker threads ahead of
//! the I/O thread: one decodes window N+1's XOR payloads while window N is
//! written and synced; another decodes the REPLACE/ZERO batches from the
//! start of the merge, so that they are ready when the ordered windows end. Payloads are never written by a merge,
//! so reading them on another descriptor (the reader's) is safe at any
//! point of the protocol.

use std::sync::mpsc::{Receiver, Sender};

use cow::format::BLOCK_SIZE;
use cow::{Op, OpKind};

use super::{EarlyPlan, Merge};
use crate::error::{MergeError, Result};
use engine::AlignedBuf;

/// Work for the decoder, in the order the merge needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Job {
    /// The XOR payloads of the window order[pos..pos + n], and the
    /// REPLACE/ZERO blocks written early with it.
    Xor { pos: usize, n: usize },
    /// The REPLACE/ZERO batch starting at `pos` (see `Merge::replace_batch`).
    Replace { pos: usize },
}

/// A finished job.
pub(super) struct Prepared {
    /// Xor: one decoded 4 KiB block per XOR op of the window, in op order.
    /// Replace: the new data of the batch's ops not written early, one unit
    /// after the other.
    pub data: AlignedBuf,
    /// Xor: the blocks the plan writes early with the window, in its order.
    pub early: AlignedBuf,
    /// Reads the decoder issued and bytes it read (for the report).
    pub reads: u64,
    pub bytes: u64,
}

/// The worker loop: answers jobs in order until the sender hangs up or the
/// receiver is gone.
pub(super) fn serve(
    m: &Merge<'_>,
    plan: &EarlyPlan,
    jobs: Receiver<Job>,
    done: Sender<Result<Prepared>>,
) {
    for job in jobs {
        if done.send(m.prepare(job, plan)).is_err() {
            break;
        }
    }
}

impl Merge<'_> {
    pub(super) fn prepare(&self, job: Job, plan: &EarlyPlan) -> Result<Prepared> {
        match job {
            Job::Xor { pos, n } => {
                let xors: Vec<&Op> = self.order[pos..pos + n]
                    .iter()
                    .filter(|o| o.kind == OpKind::Xor)
                    .collect();
                let (stored, at, reads) = self.read_payloads(&xors)?;
                let mut data = AlignedBuf::new(xors.len() * BLOCK_SIZE);
                for (k, op) in xors.iter().enumerate() {
                    let s = &stored[at[k]..at[k] + op.data_length as usize];
                    self.cow.decode_payload(
                        op,
                        s,
                        &mut data[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE],
                    )?;
                }
                let (early, early_reads, early_bytes) = self.decode_early(plan.window(pos))?;
                Ok(Prepared {
                    data,
                    early,
                    reads: reads + early_reads,
                    bytes: (stored.len() + early_bytes) as u64,
                })
            }
            Job::Replace { pos } => {
                let (end, bytes) = self.replace_batch(pos, plan);
                let ops: Vec<&Op> = (pos..end)
                    .filter(|&i| !plan.done(i))
                    .map(|i| &self.order[i])
                    .collect();
                let replaces: Vec<&Op> = ops
                    .iter()
                    .copied()
                    .filter(|o| o.kind == OpKind::Replace)
                    .collect();
                let (stored, stored_at, reads) = self.read_payloads(&replaces)?;
                let mut data = AlignedBuf::new(bytes);
                let (mut k, mut at) = (0, 0);
                for op in ops {
                    let len = op.unit_size();
                    match op.kind {
                        OpKind::Replace => {
                            let s = &stored[stored_at[k]..stored_at[k] + op.data_length as usize];
                            self.cow.decode_payload(op, s, &mut data[at..at + len])?;
                            k += 1;
                        }
                        OpKind::Zero => {}
                        OpKind::Copy | OpKind::Xor => {
                            return Err(MergeError::Corrupt {
                                path: self.cow_path.clone(),
                                offset: 0,
                                msg: format!(
                                    "{} op for block {} after REPLACE/ZERO ops",
                                    op.kind, op.new_block
                                ),
                            });
                        }
                    }
                    at += len;
                }
                Ok(Prepared {
                    data,
                    early: AlignedBuf::new(0),
                    reads,
                    bytes: stored.len() as u64,
                })
            }
        }
    }

    /// The data of the blocks written early with a window (see `early`):
    /// each REPLACE unit decoded once, ZERO blocks zero. Returns the data,
    /// the reads issued and the bytes read.
    fn decode_early(&self, blocks: &[(u64, usize)]) -> Result<(AlignedBuf, u64, usize)> {
        let mut data = AlignedBuf::new(blocks.len() * BLOCK_SIZE);
        if blocks.is_empty() {
            return Ok((data, 0, 0));
        }
        let mut units: Vec<usize> = blocks
            .iter()
            .map(|&(_, i)| i)
            .filter(|&i| self.order[i].kind == OpKind::Replace)
            .collect();
        units.sort_unstable();
        units.dedup();
        let ops: Vec<&Op> = units.iter().map(|&i| &self.order[i]).collect();
        let (stored, at, reads) = self.read_payloads(&ops)?;
        let mut unit = vec![0u8; ops.iter().map(|o| o.unit_size()).max().unwrap_or(0)];
        let mut decoded: Option<usize> = None;
        for (k, &(block, i)) in blocks.iter().enumerate() {
            let op = &self.order[i];
            let out = &mut data[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE];
            if op.kind != OpKind::Replace {
                out.fill(0);
                continue;
            }
            // `blocks` is in block order, so a unit's blocks come together.
            if decoded != Some(i) {
                // `units` holds every REPLACE op of `blocks`, sorted.
                let u = units.partition_point(|&x| x < i);
                let s = &stored[at[u]..at[u] + op.data_length as usize];
                self.cow
                    .decode_payload(op, s, &mut unit[..op.unit_size()])?;
                decoded = Some(i);
            }
            let off = (block - op.new_block) as usize * BLOCK_SIZE;
            out.copy_from_slice(&unit[off..off + BLOCK_SIZE]);
        }
        Ok((data, reads, stored.len()))
    }

    /// Read the stored payloads of `ops` in file order (the merge order is
    /// not the order the writer laid them out in), neighbours in one read,
    /// and gaps of up to `GAP` bytes read through rather than split.
    /// Returns the bytes, each op's position in them, and the read count.
    fn read_payloads(&self, ops: &[&Op]) -> Result<(Vec<u8>, Vec<usize>, u64)> {
        const GAP: u64 = 32 << 10;
        let mut by_off: Vec<(u64, usize)> = ops
            .iter()
            .enumerate()
            .map(|(k, o)| (o.data_offset, k))
            .collect();
        by_off.sort_unstable();
        // (file offset, end, position in `stored`)
        let mut runs: Vec<(u64, u64, usize)> = Vec::new();
        let mut at = vec![0usize; ops.len()];
        for &(off, k) in &by_off {
            let end = off + u64::from(ops[k].data_length);
            match runs.last_mut() {
                Some((o, e, p)) if off <= *e + GAP => {
                    *e = (*e).max(end);
                    at[k] = *p + (off - *o) as usize;
                }
                _ => {
                    let p = runs.last().map_or(0, |&(o, e, p)| p + (e - o) as usize);
                    runs.push((off, end, p));
                    at[k] = p;
                }
            }
        }
        let total = runs.last().map_or(0, |&(o, e, p)| p + (e - o) as usize);
        let mut stored = vec![0u8; total];
        for &(off, end, p) in &runs {
            self.cow
                .read_file_at(&mut stored[p..p + (end - off) as usize], off)?;
        }
        Ok((stored, at, runs.len() as u64))
    }
}
