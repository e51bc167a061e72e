//! Block-level OTA deltas in the AOSP COW format.
//!
//! Given OLD (the image on the device) and NEW (the image to ship), plan one
//! op per changed 4 KiB block of NEW — COPY of an identical OLD block, XOR
//! against a similar OLD region at any byte offset, ZERO, or REPLACE — and a
//! merge order that stays correct when the device merges op by op in place.
//!
//! * [`index`]: what is kept of OLD in memory (hashes and anchors, not data).
//! * [`mod@plan`]: the per-block op selection, parallel and deterministic.
//! * [`order`]: the merge sequence and its op-by-op validity check.
//! * [`lone`]: optionally, XORs whose source is an isolated read of OLD
//!   stored as REPLACE (fewer small reads when serving and merging).
//! * [`sim`]: an in-memory in-place merge, used by the tests.
//! * [`mod@write`]: the plan as a COW file (v2 or v3, any codec), checked
//!   before and after writing.
//!
//! # Memory
//! Peak heap ≈ the OLD index (16 B per non-zero OLD block + 16 B per anchor,
//! about one anchor per 2^`anchor_bits` OLD bytes, i.e. ~25% of OLD at the
//! default of 6, plus a bucket directory of at most 64 MiB) + 24 B per
//! changed NEW block for the plan + a 1 MiB chunk of NEW and of OLD per
//! worker thread + the COW writer's batch buffers. Neither image is ever
//! held whole. Measured on the `system` corpus pair (701 MB ext4 images):
//! peak RSS 251 MiB for the whole `vabc diff` (index 140 MiB; 487 MiB
//! with `anchor_bits` = 5).
//!
//! # Defaults, and the measurements behind them
//! `vabc diff` defaults to COW **v3, zstd level 19, 128 KiB compression
//! units**. Android's own choice is lz4 in 64 KiB units; but Android
//! compresses on the phone while installing, where lz4's speed matters
//! most, and we compress on the build host, where the budget is
//! xdelta3 -9's time (99-190 s on the `system` pair, depending on the
//! machine's load). `system` ext4 pair, everything else default (xdelta3
//! -9: 34 287 481 bytes, 99 s in the same run as the bold row):
//!
//! | codec, factor | COW bytes | × xdelta3 -9 | wall s |
//! |---|---:|---:|---:|
//! | lz4, 64 KiB (old planner) | 74 318 234 | 2.17 | 17 |
//! | zstd:3, 64 KiB | 50 097 155 | 1.46 | 12-34 |
//! | zstd:19, 64 KiB | 44 712 354 | 1.304 | 79 |
//! | **zstd:19, 128 KiB** | **44 123 179** | **1.287** | **84** |
//! | zstd:19, 128 KiB, XOR payloads at 19 too | 44 058 240 | 1.285 | 117-134 |
//! | zstd:22, 64 KiB | 44 583 885 | 1.300 | 184 |
//! | gz (9), 64 KiB (old planner) | 52 198 488 | 1.52 | 22 |
//! | brotli (11), 64 KiB (old planner) | 45 492 602 | 1.33 | 656 |
//!
//! zstd's decode speed does not drop with the level (measured on this
//! pair's REPLACE data in 64 KiB units: ~480 MiB/s at levels 3 and 19, and
//! its 4 KiB XOR payloads decode faster at 19), so the level costs the
//! build host time, never the device: 19 is the smallest COW within the
//! time budget (22 saves 0.15% for 1.5× the time). XOR payloads, 4 KiB
//! each, are compressed at level 15 at most
//! ([`write::XOR_MAX_ZSTD_LEVEL`]): levels above cost 30% of the diff's
//! CPU time for 0.15%. The writer cuts each REPLACE run into the largest
//! power-of-two units that fit, so 128 KiB units appear only in runs of
//! 32+ blocks (new files, read sequentially at boot): 1.3% smaller than
//! 64 KiB, and random 4 KiB O_DIRECT reads of the image served from each
//! COW ran at the same speed (8.6k / 10.6k IOPS at QD1 for 64 KiB, 8.8k /
//! 11.1k for 128 KiB, alternating runs). 256 KiB
//! saves about 1% more but doubles again what a read inside a long run
//! decodes. For speed use `--compression zstd:3` (1.14× the bytes, ~7×
//! faster); for Android's configuration `--compression lz4
//! --compression-factor 64k`.
//!
//! Planner knobs ([`PlanOptions`]), measured on the corpus with real COWs:
//! * Anchors: an 11-byte gear window ([`index::GEAR_SHIFT`]) with hashes
//!   kept up to 256 times in OLD ([`index::MAX_ANCHOR_DUP`]). Recompiled
//!   code keeps few 64-byte runs intact but many 11-byte ones. `system`
//!   ext4, zstd:3 COW: 64-byte window and 4 duplicates 52.35 MB; 16-byte
//!   window 51.50 MB; 16 bytes and 64 / 256 duplicates 50.61 / 50.38 MB;
//!   13 / 11 / 8-byte windows at 256 duplicates 50.11 / 50.08 / 50.12 MB.
//!   Votes are counted by sorting, so common anchors cost O(n log n).
//! * Candidates: the top 8 voted offsets (4 / 8 / 16: 50.06 / 50.01 /
//!   49.98 MB), the continuation of the previous block's match and the
//!   same offset; each sharing ≥ 1 KiB is scored by its estimated XOR
//!   size, not by equal bytes (-0.04%).
//! * The XOR/REPLACE threshold (`xor_max_percent`): 78% with zstd
//!   estimates ([`plan::ZSTD_XOR_MAX_PERCENT`], measured on zstd:19 COWs),
//!   85% with lz4's ([`plan::LZ4_XOR_MAX_PERCENT`]). The estimator
//!   ([`Estimator`]) is zstd level 1 for the entropy coders (level 3 gave
//!   the same COW within 0.002%), lz4 for lz4.
//! * Anchor density 2^-6: 2^-5 saves another 0.06% for twice the index
//!   (peak RSS 487 instead of 251 MiB).
//!
//! Where the bytes go on `system` ext4 (zstd:19, 128 KiB): REPLACE 26.3 MB
//! (23 495 blocks, 18 of them merge-cycle breaks: the rest had no
//! candidate that XORs well, mostly recompiled `.so` code), XOR 13.6 MB
//! (58 162 blocks, 0.23 KB each), and the fixed costs of the format: the
//! 2 MiB merge scratch area (kept: it is what makes the merge crash-safe)
//! and 16 B per op (2.0 MB). v3 COWs carry no sequence data (the ops are
//! written in merge order instead, see [`mod@write`]). What still separates the COW
//! from a stream delta is compression context: the format compresses each
//! op on its own (XOR payloads 4 KiB each, REPLACE units ≤ 256 KiB), where
//! `zstd -19 --long` compresses all REPLACE data as one stream to 18.9 MB.

pub mod error;
pub mod image;
pub mod index;
pub mod lone;
pub mod ops;
pub mod order;
pub mod plan;
pub mod sim;
pub mod write;

pub use error::{DeltaError, Result};
pub use image::{BlockImage, ImageFile, MemImage};
pub use plan::{BlockOp, Census, Estimator, Plan, PlanOptions, PlannedOp, plan};

/// Block size of the COW format.
pub const BLOCK_SIZE: usize = cow::BLOCK_SIZE;

/// Progress of a long phase, reported by blocks. Implementations must be
/// cheap and thread-safe: workers call `advance` concurrently.
pub trait Progress: Sync {
    fn start(&self, _phase: &'static str, _total: u64) {}
    fn advance(&self, _n: u64) {}
    fn finish(&self) {}
    /// Makes the temporary file the output is written to until it is complete,
    /// `.NAME.XXXXXX.tmp` in `dir` after the output's NAME. A caller that handles
    /// signals makes and registers it in one step, so that an interrupt never leaves
    /// one behind.
    fn make_temp(
        &self,
        dir: &std::path::Path,
        name: &str,
    ) -> std::io::Result<tempfile::NamedTempFile> {
        vabc_io::temp::temp_in(dir, name)
    }
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
