//! The index of OLD: what the planner keeps in memory instead of the image.
//!
//! * Block index: `(xxh3-64 of the 4 KiB block, block number)` for every
//!   non-zero OLD block, sorted: 16 bytes per block. A hash hit is only a
//!   candidate; the planner compares the bytes before emitting a COPY.
//! * Anchor index: content-defined anchors sampled from OLD with a gear
//!   rolling hash over an 11-byte window, on average one per
//!   `2^anchor_bits` bytes, as `(hash, byte position)`: 16 bytes per anchor.
//!   An anchor found in a NEW block votes for the OLD byte offset that would
//!   line the block up with the same content, which finds "same file,
//!   shifted by any number of bytes" in O(anchors of the block).
//!   Hashes occurring more than [`MAX_ANCHOR_DUP`] times in OLD (runs,
//!   padding, repeated tables) are dropped: they vote for nothing useful.
//!
//! Memory: 16 B × non-zero OLD blocks + 16 B × OLD bytes / 2^anchor_bits,
//! i.e. about 0.4% + 25% of OLD at the default `anchor_bits` = 6 before
//! the duplicate filter. OLD itself is read with positioned reads and never
//! held.

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::Result;
use crate::image::BlockImage;
use crate::{BLOCK_SIZE, Progress};

/// Bytes of the gear hash window: older bytes are shifted out of the u64.
pub const GEAR_WINDOW: usize = 64usize.div_ceil(GEAR_SHIFT as usize);
/// Anchor hashes seen more often than this in OLD are not indexed. A short
/// window repeats more (common instruction sequences), and a repeated
/// anchor still votes usefully when the other anchors of the block vote
/// for the same alignment: 4 / 16 / 64 / 256 / 1024 gave zstd:3 COWs of
/// 51.50 / 51.20 / 50.61 / 50.38 / 50.36 MB on `system` with a 16-byte
/// window; 1024 costs 50% more planning time for 0.03%.
pub const MAX_ANCHOR_DUP: usize = 256;
/// Blocks per unit of parallel work when scanning an image. Fixed, so the
/// result does not depend on the number of threads.
pub const SCAN_CHUNK_BLOCKS: u64 = 256;

const fn splitmix64(state: u64) -> (u64, u64) {
    let s = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (s, z ^ (z >> 31))
}

/// Bits the gear hash shifts per byte: a byte's contribution leaves the
/// 64-bit hash after `ceil(64 / GEAR_SHIFT)` = 11 bytes, so an anchor depends
/// on the last 11 bytes only. Recompiled code rarely keeps 64 bytes intact
/// (every relocated address changes), but 11-byte runs between changes are
/// common: on the `system` ext4 pair the 11-byte window (with
/// [`MAX_ANCHOR_DUP`] raised to match) finds XOR sources for 3 700 blocks
/// that a 64-byte window leaves as REPLACE, 4.3% off the zstd:3 COW.
pub const GEAR_SHIFT: u32 = 6;

/// `(2^GEAR_SHIFT - 1)^-1 mod 2^64`, by Newton's iteration (each step
/// doubles the correct low bits; an odd number is its own inverse mod 8).
const INV_GEAR_MUL: u64 = {
    let m = (1u64 << GEAR_SHIFT) - 1;
    let mut x = m;
    let mut i = 0;
    while i < 6 {
        x = x.wrapping_mul(2u64.wrapping_sub(m.wrapping_mul(x)));
        i += 1;
    }
    x
};

/// Gear table. A run of one byte value `b` drives the hash to the fixed
/// point `x = -GEAR[b] / (2^GEAR_SHIFT - 1)` (mod 2^64), reached exactly
/// once the window is full of `b`; each entry is adjusted so that fixed
/// point has its top bit set, so runs of any single byte (zero fill, 0xff
/// padding) never produce anchors.
static GEAR: [u64; 256] = {
    let m = (1u64 << GEAR_SHIFT) - 1;
    let mut t = [0u64; 256];
    let mut state = 0x005E_ED0F_A1C0_FFEE_u64;
    let mut i = 0;
    while i < 256 {
        let (s, v) = splitmix64(state);
        state = s;
        let mut fixed = v.wrapping_neg().wrapping_mul(INV_GEAR_MUL);
        if fixed >> 63 == 0 {
            fixed ^= 1 << 63;
        }
        // x = (x << GEAR_SHIFT) + g  ⇔  g = -(2^GEAR_SHIFT - 1)·x
        t[i] = m.wrapping_mul(fixed).wrapping_neg();
        i += 1;
    }
    t
};

#[inline]
fn gear_step(h: u64, b: u8) -> u64 {
    (h << GEAR_SHIFT).wrapping_add(GEAR[b as usize])
}

/// Run the gear hash over `data`, feeding the first `warmup` bytes without
/// emitting, and call `emit(hash, index_in_data)` at every anchor.
#[inline]
pub(crate) fn anchors(data: &[u8], warmup: usize, bits: u32, mut emit: impl FnMut(u64, usize)) {
    let mut h = 0u64;
    let shift = 64 - bits;
    for &b in &data[..warmup.min(data.len())] {
        h = gear_step(h, b);
    }
    for (i, &b) in data.iter().enumerate().skip(warmup) {
        h = gear_step(h, b);
        if h >> shift == 0 {
            emit(h, i);
        }
    }
}

#[inline]
pub(crate) fn block_hash(block: &[u8]) -> u64 {
    xxh3_64(block)
}

#[inline]
pub(crate) fn is_zero(block: &[u8]) -> bool {
    // OR-folding 64-byte pieces vectorises; the early exit per piece keeps
    // the common non-zero case cheap.
    block
        .chunks(64)
        .all(|c| c.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// A sorted `(hash, value)` table with a direct-mapped bucket directory on
/// the hash's leading bits: a lookup is two cache misses instead of the ~20
/// of a binary search, which dominated planning time.
#[derive(Debug, Default)]
struct Table<V> {
    entries: Vec<(u64, V)>,
    /// `start[k]..start[k + 1]` holds the entries whose key bucket is k.
    start: Vec<u32>,
    /// Leading bits of the hash known to be zero (anchors are selected by
    /// them), skipped when forming the bucket number.
    zero_bits: u32,
    bucket_bits: u32,
}

impl<V: Copy> Table<V> {
    fn new(entries: Vec<(u64, V)>, zero_bits: u32) -> Table<V> {
        // About one entry per bucket; at most 2^24 buckets (64 MiB would be
        // wasteful for an index whose entries are far fewer).
        let bucket_bits = (usize::BITS - entries.len().leading_zeros()).clamp(1, 24);
        let mut t = Table {
            entries,
            start: Vec::new(),
            zero_bits,
            bucket_bits,
        };
        let n = 1usize << bucket_bits;
        let mut start = vec![0u32; n + 1];
        for &(h, _) in &t.entries {
            start[t.bucket(h) + 1] += 1;
        }
        for k in 0..n {
            start[k + 1] += start[k];
        }
        t.start = start;
        t
    }

    #[inline]
    fn bucket(&self, h: u64) -> usize {
        ((h << self.zero_bits) >> (64 - self.bucket_bits)) as usize
    }

    #[inline]
    fn get(&self, h: u64) -> impl Iterator<Item = V> + '_ {
        let k = self.bucket(h);
        let (lo, hi) = match (self.start.get(k), self.start.get(k + 1)) {
            (Some(&lo), Some(&hi)) => (lo as usize, hi as usize),
            _ => (0, 0),
        };
        self.entries[lo..hi]
            .iter()
            .filter(move |e| e.0 == h)
            .map(|e| e.1)
    }

    fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<(u64, V)>() + self.start.capacity() * 4
    }
}

/// Block hashes and anchors of one scan chunk.
type ChunkIndex = (Vec<(u64, u32)>, Vec<(u64, u64)>);

/// In-memory index of OLD.
#[derive(Debug, Default)]
pub struct OldIndex {
    blocks: Table<u32>,
    anchors: Table<u64>,
    anchor_bits: u32,
    old_size: u64,
}

impl OldIndex {
    /// Scan OLD once, in parallel over fixed chunks, and build the index.
    pub fn build(
        old: &dyn BlockImage,
        anchor_bits: u32,
        progress: &dyn Progress,
    ) -> Result<OldIndex> {
        let size = old.size();
        let nblocks = size / BLOCK_SIZE as u64;
        let chunks = nblocks.div_ceil(SCAN_CHUNK_BLOCKS);
        progress.start("indexing old", nblocks);
        let parts: Vec<ChunkIndex> = (0..chunks)
            .into_par_iter()
            .map(|c| {
                let first = c * SCAN_CHUNK_BLOCKS;
                let n = SCAN_CHUNK_BLOCKS.min(nblocks - first) as usize;
                let start = first * BLOCK_SIZE as u64;
                let pre = if first == 0 { 0 } else { GEAR_WINDOW };
                let mut buf = vec![0u8; pre + n * BLOCK_SIZE];
                old.read_at(&mut buf, start - pre as u64)?;
                let mut blocks = Vec::with_capacity(n);
                for (k, b) in buf[pre..].chunks_exact(BLOCK_SIZE).enumerate() {
                    if !is_zero(b) {
                        blocks.push((block_hash(b), (first + k as u64) as u32));
                    }
                }
                let mut anc = Vec::new();
                if anchor_bits > 0 {
                    let base = start - pre as u64;
                    anchors(&buf, pre, anchor_bits, |h, i| {
                        anc.push((h, base + i as u64))
                    });
                }
                progress.advance(n as u64);
                Ok((blocks, anc))
            })
            .collect::<Result<_>>()?;
        let mut blocks = Vec::with_capacity(parts.iter().map(|p| p.0.len()).sum());
        let mut anc = Vec::with_capacity(parts.iter().map(|p| p.1.len()).sum());
        for (b, a) in parts {
            blocks.extend(b);
            anc.extend(a);
        }
        blocks.par_sort_unstable();
        anc.par_sort_unstable();
        // Drop anchors whose hash is too common to point anywhere useful.
        // Compacted in place: a second vector would double the peak.
        let mut kept = 0;
        let mut i = 0;
        while i < anc.len() {
            let h = anc[i].0;
            let mut j = i + 1;
            while j < anc.len() && anc[j].0 == h {
                j += 1;
            }
            if j - i <= MAX_ANCHOR_DUP {
                anc.copy_within(i..j, kept);
                kept += j - i;
            }
            i = j;
        }
        anc.truncate(kept);
        anc.shrink_to_fit();
        let kept = anc;
        progress.finish();
        Ok(OldIndex {
            blocks: Table::new(blocks, 0),
            anchors: Table::new(kept, anchor_bits),
            anchor_bits,
            old_size: size,
        })
    }

    /// OLD blocks whose hash equals `hash`, ascending (bytes not verified).
    pub fn blocks_with_hash(&self, hash: u64) -> impl Iterator<Item = u64> + '_ {
        self.blocks.get(hash).map(u64::from)
    }

    /// OLD byte positions of anchors with this hash, ascending.
    pub fn anchor_positions(&self, hash: u64) -> impl Iterator<Item = u64> + '_ {
        self.anchors.get(hash)
    }

    pub fn anchor_bits(&self) -> u32 {
        self.anchor_bits
    }

    pub fn old_size(&self) -> u64 {
        self.old_size
    }

    /// Bytes of heap this index holds.
    pub fn memory_bytes(&self) -> usize {
        self.blocks.bytes() + self.anchors.bytes()
    }

    pub fn anchor_count(&self) -> usize {
        self.anchors.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_byte_runs_never_anchor() {
        for b in 0..=255u8 {
            let data = vec![b; 8192];
            let mut n = 0;
            anchors(&data, 0, 1, |_, i| {
                if i >= GEAR_WINDOW {
                    n += 1
                }
            });
            assert_eq!(n, 0, "byte {b:#x}");
        }
    }

    #[test]
    fn anchors_depend_only_on_the_window() {
        // The same 64+ bytes at two different places give the same anchors
        // at the same relative positions: what makes byte shifts findable.
        let mut rng = fastrand::Rng::with_seed(12345);
        let payload: Vec<u8> = (0..20000).map(|_| rng.u8(..)).collect();
        let mut a = vec![7u8; 100];
        a.extend_from_slice(&payload);
        let mut b = vec![9u8; 333];
        b.extend_from_slice(&payload);
        let mut pa = Vec::new();
        anchors(&a, 0, 6, |h, i| {
            if i >= 100 + GEAR_WINDOW {
                pa.push((h, i - 100))
            }
        });
        let mut pb = Vec::new();
        anchors(&b, 0, 6, |h, i| {
            if i >= 333 + GEAR_WINDOW {
                pb.push((h, i - 333))
            }
        });
        assert!(pa.len() > 100);
        assert_eq!(pa, pb);
    }
}
