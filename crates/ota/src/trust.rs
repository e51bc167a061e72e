//! Before a base is read through a COW: is it the base the update was made for
//! (`manifest` crate), and, before the first block of a merge or an apply is written,
//! does every op decode to exactly the new image. One reading of the merge state
//! (`merge::progress`) decides what the base must be:
//!
//! * merge not started: the old image, every region;
//! * merge complete: the new image, every region (so a COW merged into one device is
//!   refused for another device's old image instead of "merging" nothing);
//! * merge in progress: a region no op writes must match (old and new agree there), a
//!   region written only by ops the counter says are merged must be the new image's,
//!   and so must the first block of every op the counter says is merged (per-op hashes
//!   in the manifest): a progress record damaged into "half merged" on an unmerged base
//!   is caught before anything is written.

use std::fs::File;
use std::path::Path;

use crate::error::{Context, Result, invalid, mismatch};
use cow::{CowReader, SnapshotView};
use manifest::{ImageId, Manifest};
use merge::Progress;

/// The manifest that applies to `cow`, if there is one: `explicit`, which must exist,
/// or the default one beside the COW (`COW.manifest`), which may be missing (a COW
/// made by another tool has none).
pub fn load_manifest(
    explicit: Option<&Path>,
    cow_path: &Path,
    cow: &CowReader,
) -> Result<Option<Manifest>> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let p = Manifest::path_for(cow_path);
            if !p.exists() {
                log::warn!(
                    "vabc: note: {} has no manifest ({} missing), so the base cannot be \
                     checked; `vabc diff` writes one",
                    cow_path.display(),
                    p.display()
                );
                return Ok(None);
            }
            p
        }
    };
    let m = Manifest::load(&path)?;
    let ops = cow.ops().len() as u64;
    if m.cow_ops != ops {
        invalid!(
            "{}: made for a COW of {} ops, but {} has {ops}: not this update's manifest",
            path.display(),
            m.cow_ops,
            cow_path.display()
        );
    }
    Ok(Some(m))
}

/// Checks that `base` is what the update needs given how far its merge has gone.
pub fn check_base(
    m: &Manifest,
    progress: Progress,
    cow: &CowReader,
    base: &File,
    base_path: &Path,
) -> Result<()> {
    let size = cow::view::file_size(base, base_path)?;
    let (want, what): (&ImageId, &str) = match progress {
        Progress::Complete { .. } => (&m.new, "the new image (this COW's merge is complete)"),
        _ => (&m.base, "the image this update was made for"),
    };
    let (regions, merged) = match progress {
        Progress::InProgress { merged, .. } => (written_regions(cow, want.region_size)?, merged),
        _ => (Vec::new(), 0),
    };
    let state = |r: usize| regions.get(r).copied().unwrap_or_default();
    // Untouched regions, against the old image (every region unless mid-merge).
    let found = want
        .first_mismatch(base, base_path, size, |r| state(r).first.is_none())
        .with_context(|| format!("check the base {}", base_path.display()))?;
    // Mid-merge: regions whose every writer is merged, against the new image.
    let found = match found {
        Some(f) => Some(f),
        None if merged > 0 => m
            .new
            .first_mismatch(base, base_path, size, |r| {
                state(r).last.is_some_and(|last| last < merged)
            })
            .with_context(|| format!("check the base {}", base_path.display()))?,
        None => None,
    };
    if found.is_none()
        && merged > 0
        && let Some((pos, block)) = first_unmerged(m, cow, merged, base, base_path)?
    {
        mismatch!(
            "{}: the COW {} says {merged} ops are merged, but block {block} (written by op \
             {pos} in merge order) is not the new image's: the progress record does not \
             match this base (nothing was written)",
            base_path.display(),
            cow.path().display()
        );
    }
    if let Some(mismatch) = found {
        let hint = match progress {
            Progress::Complete { .. } => {
                "; a merged COW is used up: it cannot be applied to another device's old image"
            }
            _ => {
                "; is it the right base? Merging or applying this update to another image \
                 makes one that is neither (--no-base-check would skip this check and do \
                 exactly that)"
            }
        };
        mismatch!("{} is not {what}: {mismatch}{hint}", base_path.display());
    }
    Ok(())
}

/// Refuses a view whose ops reach past the base when nothing (no manifest, no
/// `--size`) says how large the new image is: such an op is more likely a damaged
/// block number (a v3 op can name block 2^32-1, 16 TiB out) than an image that
/// large, and reading the view up to it would take hours, not a clear error.
pub fn bound_without_size(view: &SnapshotView, cow_path: &Path) -> Result<()> {
    if view.size() > view.base_size() {
        invalid!(
            "{}: its ops reach byte {}, past the end of the base ({} bytes), and no manifest \
             gives the new image's size; give --size if the new image is that large",
            cow_path.display(),
            view.size(),
            view.base_size()
        );
    }
    Ok(())
}

/// Decodes the payload of every REPLACE and XOR op of `cow`, discarding the result: a
/// payload that is cut short, does not decompress or decompresses to the wrong size is
/// found before anything is written.
pub fn decode_every_op(cow: &CowReader) -> Result<()> {
    let mut buf = Vec::new();
    for (i, op) in cow.ops().iter().enumerate() {
        if !matches!(op.kind, cow::OpKind::Replace | cow::OpKind::Xor) {
            continue;
        }
        buf.resize(op.unit_size(), 0);
        cow.read_payload(op, &mut buf).with_context(|| {
            format!(
                "{}: op {i} (block {}, data at offset {}) does not decode; nothing was written",
                cow.path().display(),
                op.new_block,
                op.data_offset
            )
        })?;
    }
    Ok(())
}

/// [`Manifest::merged_op_hashes`] for `cow`, from the new image.
pub fn op_hashes(cow: &CowReader, new: &dyn manifest::ReadAt, new_path: &Path) -> Result<String> {
    use std::fmt::Write;
    let mut out = String::new();
    let mut block = vec![0u8; 4096];
    for i in cow.merge_order()? {
        let b = cow.ops()[i].new_block;
        new.read_exact_at(&mut block, b * 4096)
            .with_context(|| format!("read block {b} of {}", new_path.display()))?;
        let _ = write!(out, "{:016x}", manifest::block_hash(&block));
    }
    Ok(out)
}

/// For a merge the COW says is `merged` ops along: the first block of every op before
/// that must already be the new image's. Returns the first op (merge position, block)
/// that is not.
fn first_unmerged(
    m: &Manifest,
    cow: &CowReader,
    merged: u64,
    base: &File,
    base_path: &Path,
) -> Result<Option<(u64, u64)>> {
    use std::os::unix::fs::FileExt;
    if m.merged_op_hashes.is_none() {
        return Ok(None);
    }
    let mut block = vec![0u8; 4096];
    for (pos, i) in cow
        .merge_order()?
        .into_iter()
        .enumerate()
        .take(merged as usize)
    {
        let b = cow.ops()[i].new_block;
        base.read_exact_at(&mut block, b * 4096)
            .with_context(|| format!("read block {b} of {}", base_path.display()))?;
        if m.merged_op_hash(pos as u64) != Some(manifest::block_hash(&block)) {
            return Ok(Some((pos as u64, b)));
        }
    }
    Ok(None)
}

/// Per region: whether some op writes a block in it.
pub fn written_region_mask(cow: &CowReader, region_size: u64) -> Result<Vec<bool>> {
    Ok(written_regions(cow, region_size)?
        .iter()
        .map(|w| w.first.is_some())
        .collect())
}

/// Which ops (by merge position) write a region: the first and the last.
#[derive(Clone, Copy, Default)]
struct Writers {
    first: Option<u64>,
    last: Option<u64>,
}

fn written_regions(cow: &CowReader, region_size: u64) -> Result<Vec<Writers>> {
    let mut out: Vec<Writers> = Vec::new();
    for (pos, i) in cow.merge_order()?.into_iter().enumerate() {
        let op = &cow.ops()[i];
        let (a, b) = (op.new_block * 4096, op.end_block() * 4096);
        let (ra, rb) = (a / region_size, b.saturating_sub(1) / region_size);
        for r in ra..=rb {
            let r = r as usize;
            if out.len() <= r {
                out.resize(r + 1, Writers::default());
            }
            let w = &mut out[r];
            let pos = pos as u64;
            w.first = Some(w.first.map_or(pos, |f| f.min(pos)));
            w.last = Some(w.last.map_or(pos, |l| l.max(pos)));
        }
    }
    Ok(out)
}

/// Decodes every op through the snapshot view (base + COW) and, with a manifest,
/// checks that the result is the new image, region by region; names the first region
/// that differs. Reads the base and the whole COW once; writes nothing. Only for a
/// base whose merge has not started (the view reads the base as the old image).
pub fn prove_result(
    m: Option<&Manifest>,
    cow: &CowReader,
    base: &File,
    base_path: &Path,
    size: Option<u64>,
) -> Result<u64> {
    let size = size.or(m.map(|m| m.new.size));
    let view = SnapshotView::new(cow, base, base_path, size)?;
    if size.is_none() {
        bound_without_size(&view, cow.path())?;
    }
    let size = view.size();
    let cow_path = cow.path().to_path_buf();
    let read = manifest::ReadFn(|buf: &mut [u8], off: u64| -> std::io::Result<()> {
        if off.is_multiple_of(4096) && buf.len().is_multiple_of(4096) {
            // Every read but a last partial block's: straight into the caller's buffer.
            return view
                .read_blocks(off / 4096, buf)
                .map_err(std::io::Error::other);
        }
        // The view reads whole blocks; the image may end inside one.
        let start = off / 4096;
        let end = (off + buf.len() as u64).div_ceil(4096);
        let mut blocks = vec![0u8; ((end - start) * 4096) as usize];
        view.read_blocks(start, &mut blocks)
            .map_err(std::io::Error::other)?;
        let skip = (off - start * 4096) as usize;
        buf.copy_from_slice(&blocks[skip..skip + buf.len()]);
        Ok(())
    });
    match m {
        Some(m) => {
            // The view stops at the image's end; a merge would not. An op past it (a
            // damaged block number) would write outside the new image.
            let end = cow.end_block() * 4096;
            if end > m.new.size.next_multiple_of(4096) {
                mismatch!(
                    "{}: an op writes up to byte {end}, past the end of the new image ({} \
                     bytes) the update promises: the COW is corrupt (nothing was written)",
                    cow_path.display(),
                    m.new.size
                );
            }
            if size != m.new.size {
                invalid!(
                    "{}: the update makes an image of {} bytes, but {size} were asked for",
                    cow_path.display(),
                    m.new.size
                );
            }
            let found = m
                .new
                .first_mismatch(&read, &cow_path, size, |_| true)
                .with_context(|| format!("decode every op of {}", cow_path.display()))?;
            if let Some(mismatch) = found {
                mismatch!(
                    "{} + {} does not make the new image the update promises: {mismatch}; \
                     the COW is corrupt (nothing was written)",
                    base_path.display(),
                    cow_path.display()
                );
            }
        }
        None => {
            // No hashes to compare with: at least every op must decode.
            use rayon::prelude::*;
            const CHUNK: u64 = 1 << 20;
            (0..size.div_ceil(CHUNK))
                .into_par_iter()
                .try_for_each_init(
                    || vec![0u8; CHUNK as usize],
                    |buf, c| {
                        let off = c * CHUNK;
                        let n = (size - off).min(CHUNK) as usize;
                        manifest::ReadAt::read_exact_at(&read, &mut buf[..n], off)
                    },
                )
                .with_context(|| format!("decode every op of {}", cow_path.display()))?;
        }
    }
    Ok(size)
}
