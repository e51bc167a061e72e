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
//! * [`sim`]: an in-memory in-place merge, used by the tests.
//! * [`mod@write`]: the plan as a COW file (v2 or v3, any codec), checked
//!   before and after writing.
//!
//! # Memory
//! Peak heap ≈ the OLD index (16 B per non-zero OLD block + 16 B per anchor,
//! about one anchor per 2^`anchor_bits` OLD bytes, i.e. ~6% of OLD at the
//! default of 8, plus a bucket directory of at most 64 MiB) + 24 B per
//! changed NEW block for the plan + a 1 MiB chunk of NEW and of OLD per
//! worker thread + the COW writer's batch buffers. Neither image is ever
//! held whole. Measured on the `system` corpus pair (701 MB ext4 images):
//! index 39.6 MB, peak RSS 108 MB for the whole `vabc diff`.
//!
//! # Defaults, and the measurements behind them
//! `vabc diff` defaults to COW **v3, zstd (level 3), 64 KiB compression
//! units**. Android's own choice is lz4; but Android compresses on the
//! phone while installing, where lz4's speed matters most, and we compress
//! on the build host. `system` ext4 pair, 2 CPUs, everything else default:
//!
//! | codec, factor | COW bytes | wall s |
//! |---|---:|---:|
//! | lz4, 4 KiB | 83 977 032 | 11.3 |
//! | lz4, 16 KiB | 78 815 305 | 9.3 |
//! | lz4, 64 KiB | 75 610 454 | 8.3 |
//! | lz4, 256 KiB | 74 958 868 | 7.4 |
//! | **zstd, 64 KiB** | **53 770 557** | **9.6** |
//! | zstd, 256 KiB | 52 804 746 | 8.7 |
//! | zstd:9, 64 KiB | 50 522 163 | 9.0 |
//! | zstd:19, 256 KiB | 46 942 956 | 77.2 |
//! | gz (9), 64 KiB | 52 198 488 | 22.3 |
//! | brotli (11), 64 KiB | 45 492 602 | 656 |
//! | none | 339 042 102 | 6.0 |
//!
//! zstd costs ~15% more time than lz4 for a 29% smaller COW; 256 KiB units
//! save under 2% more but make every served 4 KiB read decode up to 256
//! KiB, so 64 KiB stays (Android's documented value). For the smallest COW,
//! use `--compression zstd:19 --compression-factor 256k`.
//!
//! Planner knobs ([`PlanOptions`]), measured on the corpus with real COWs:
//! the XOR/REPLACE threshold (`xor_max_percent`, lz4 estimates of one block)
//! at 50/70/85/95% gives tiny.ext4 lz4 COWs of 3 852 656 / 3 737 399 /
//! 3 695 330 / 3 692 045 bytes and small.erofs-lz4hc 2 843 940 / 2 754 568 /
//! 2 739 120 / 2 739 040; on medium.erofs-lz4hc 70% is 0.5% better than 85%.
//! 85% is the default. Anchor density 2^-6 / 2^-8 / 2^-10 changes the
//! tiny.ext4 estimate by -3% / 0 / +7% at 4× / 1× / 0.25× the anchor
//! memory: 2^-8. Evaluating 6 voted offsets instead of 2 changes the
//! `system` COW by 0.2%. On `system` ext4 the data (REPLACE + XOR payload,
//! zstd, 64 KiB) is 49.2 MB, against 51.5 MB estimated by
//! `shared/corpus/census.py` for the same op rules.
//!
//! The fixed costs of the format count on small updates: the 2 MiB merge
//! scratch area (kept: it is what makes the merge crash-safe), 16 B per op
//! and 4 B per ordered op in the sequence.

pub mod error;
pub mod image;
pub mod index;
pub mod order;
pub mod plan;
pub mod sim;
pub mod write;

pub use error::{DeltaError, Result};
pub use image::{BlockImage, ImageFile, MemImage};
pub use plan::{BlockOp, Census, Plan, PlanOptions, PlannedOp, plan};

/// Block size of the COW format.
pub const BLOCK_SIZE: usize = cow::BLOCK_SIZE;

/// Progress of a long phase, reported by blocks. Implementations must be
/// cheap and thread-safe: workers call `advance` concurrently.
pub trait Progress: Sync {
    fn start(&self, _phase: &'static str, _total: u64) {}
    fn advance(&self, _n: u64) {}
    fn finish(&self) {}
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
