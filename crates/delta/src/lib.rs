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
//! about one anchor per 2^`anchor_bits` OLD bytes, i.e. ~25% of OLD at the
//! default of 6, plus a bucket directory of at most 64 MiB) + 24 B per
//! changed NEW block for the plan + a 1 MiB chunk of NEW and of OLD per
//! worker thread + the COW writer's batch buffers. Neither image is ever
//! held whole. Measured on the `system` corpus pair (701 MB ext4 images):
//! peak RSS 246 MiB for the whole `vabc diff` (108 MiB with
//! `anchor_bits` = 8).
//!
//! # Defaults, and the measurements behind them
//! `vabc diff` defaults to COW **v3, zstd level 19, 64 KiB compression
//! units**. Android's own choice is lz4; but Android compresses on the
//! phone while installing, where lz4's speed matters most, and we compress
//! on the build host, where the budget is xdelta3 -9's time (190 s
//! on the `system` pair). `system` ext4 pair, 2 busy CPUs (load 8-10),
//! everything else default:
//!
//! | codec, factor | COW bytes | × xdelta3 -9 | wall s |
//! |---|---:|---:|---:|
//! | lz4, 64 KiB | 74 318 234 | 2.17 | 17 |
//! | zstd:3, 64 KiB | 52 825 210 | 1.54 | 17 |
//! | zstd:9, 64 KiB | 49 588 297 | 1.45 | 23 |
//! | **zstd:19, 64 KiB** | **47 124 465** | **1.37** | **154-225** |
//! | zstd:19, 256 KiB (old planner) | 46 942 956 | 1.37 | 77-136 |
//! | gz (9), 64 KiB (old planner) | 52 198 488 | 1.52 | 22 |
//! | brotli (11), 64 KiB (old planner) | 45 492 602 | 1.33 | 656 |
//!
//! zstd's decode speed does not drop with the level (measured on this
//! pair's REPLACE data in 64 KiB units: ~480 MiB/s at levels 3 and 19, and
//! its 4 KiB XOR payloads decode faster at 19), so the level costs the
//! build host time, never the device: 19 is the smallest COW within the
//! time budget. brotli 11 is 3.5% smaller but 3-6× over the budget. 256
//! KiB units save another ~1.5% but make every served 4 KiB read decode up
//! to 256 KiB, so 64 KiB stays (Android's value). For speed use
//! `--compression zstd:3` (1.12× the bytes, ~8× faster).
//!
//! Planner knobs ([`PlanOptions`]), measured on the corpus with real COWs:
//! the XOR/REPLACE threshold (`xor_max_percent`) at 60/72/85/100% gives
//! `system` ext4 zstd:3 COWs of 54.08 / 53.79 / 53.65 / 53.69 MB (zstd:1
//! estimator); on tiny.ext4 with lz4 estimates 50/70/85/95% gave 3 852 656
//! / 3 737 399 / 3 695 330 / 3 692 045 bytes. 85% is the default. The
//! size estimate ([`Estimator`]) follows the codec: zstd level 1 for the
//! entropy coders (0.2% smaller than lz4 estimates on `system`), lz4 for
//! lz4. Anchor density 2^-8 / 2^-7 / 2^-6 gives 53.65 / 53.33 / 52.99 MB
//! on `system` (zstd:3) at index RSS of 108 / 198 / 246 MiB: 2^-6, within
//! the 1 GiB budget. Voted candidates 2 / 4 / 8 at 2^-6: 52.99 / 52.83 /
//! 52.78 MB: 4.
//!
//! Where the bytes go on `system` ext4 (zstd:19): REPLACE 29.9 MB (26 367
//! blocks, of which 4 are merge-cycle breaks: the rest had no candidate
//! that XORs well, mostly recompiled `.so` code), XOR 12.6 MB (55 290
//! blocks, 80% of them under 512 bytes), and the fixed costs of the format:
//! the 2 MiB merge scratch area (kept: it is what makes the merge
//! crash-safe) and 16 B per op (2.0 MB). v3 COWs carry no sequence data
//! (the ops are written in merge order instead, see [`mod@write`]), which
//! saved 4 B per ordered op: 47 124 465 → 46 647 057 bytes. The REPLACE data is what keeps the COW above xdelta3
//! -9: alone it compresses to 18.9 MB with `zstd -19 --long` as one
//! stream, but the format compresses each REPLACE op (≤ 256 KiB of
//! consecutive blocks) on its own, and half the REPLACE runs are 1-4
//! blocks long.

pub mod error;
pub mod image;
pub mod index;
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
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
