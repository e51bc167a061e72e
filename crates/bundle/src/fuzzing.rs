//! The body of the `bundle_read` fuzz target, replayed over its corpus by `cargo test`,
//! and a small bundle made through the library for seeds and tests.

use std::io::Read;
use std::path::Path;

use delta::write::{CowOptions, write_cow};
use delta::{BlockImage, MemImage, NoProgress, PlanOptions};

use crate::data::{FrameParams, Replayer, Search, StreamOptions, record};
use crate::format::Trust;
use crate::sign::SecretKey;
use crate::{BundleReader, BundleWriter, CowParams, Partition, PayloadInfo, PlanCounts, plan_wire};

/// Blocks per frame of [`sample`]'s bundles: small, so that its images of a few
/// hundred blocks make several frames and a short last one.
const SAMPLE_FRAME_BLOCKS: u32 = 16;

/// Largest image the fuzz body replays (bigger manifests are cut to it).
const MAX_IMAGE: u64 = 4 << 20;

/// Reads `data` as a bundle, signature unchecked, and replays every payload's plan and
/// frames against a zero base: errors are fine; panics, hangs and allocations beyond
/// the input's own scale are not.
pub fn exercise_read(data: &[u8]) {
    let path = Path::new("fuzz.vabc");
    let Ok(mut r) = BundleReader::open(data, path, Trust::Unchecked) else {
        return;
    };
    while let Some((part, mut stream)) = r.payload() {
        let new_size = part.image.new.size.min(MAX_IMAGE);
        let old = MemImage::new("old", vec![0; part.image.base.size.min(MAX_IMAGE) as usize]);
        let mut len = [0u8; 8];
        if stream.read_exact(&mut len).is_err() {
            return;
        }
        let mut plan_bytes = vec![0u8; u64::from_le_bytes(len).min(1 << 20) as usize];
        if stream.read_exact(&mut plan_bytes).is_err() {
            return;
        }
        let Ok(plan) = plan_wire::decode(&plan_bytes, new_size) else {
            return;
        };
        let pos = stream.position();
        let merge_ordered = part.cow.version >= 3 && !part.cow.block_order;
        let Ok(rep) = Replayer::new(
            &old,
            &plan,
            merge_ordered,
            part.payload.frame_blocks,
            &mut stream,
            pos,
            path,
            new_size,
        ) else {
            return;
        };
        let mut buf = [0u8; delta::BLOCK_SIZE];
        for b in crate::data::data_order(&plan, merge_ordered) {
            if rep.read_at(&mut buf, b * delta::BLOCK_SIZE as u64).is_err() {
                return;
            }
        }
        if rep.finish().is_err() || stream.finish().is_err() {
            return;
        }
    }
}

/// Two images of `blocks` blocks, the second an edit of the first (moved, changed,
/// shifted, zeroed and new blocks), from `seed`.
pub fn image_pair(seed: u64, blocks: usize) -> (Vec<u8>, Vec<u8>) {
    let bs = delta::BLOCK_SIZE;
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut old = vec![0u8; blocks * bs];
    for (i, b) in old.chunks_mut(bs).enumerate() {
        // Text-like blocks, so that compression and matching have something to find.
        let word = rng.u64(..);
        for (j, x) in b.iter_mut().enumerate() {
            *x = b'a' + ((word.rotate_left((j % 64) as u32) as usize + i + j / 7) % 26) as u8;
        }
    }
    let mut new = old.clone();
    for _ in 0..blocks / 4 {
        let b = rng.usize(..blocks);
        match rng.u8(..5) {
            0 => {
                let src = rng.usize(..blocks);
                new.copy_within(src * bs..(src + 1) * bs, b * bs);
            }
            1 => {
                for _ in 0..rng.usize(1..40) {
                    new[b * bs + rng.usize(..bs)] = rng.u8(..);
                }
            }
            2 => {
                let shift = rng.usize(1..bs);
                let src = rng.usize(..blocks - 1);
                new.copy_within(src * bs + shift..src * bs + shift + bs, b * bs);
            }
            3 => new[b * bs..(b + 1) * bs].fill(0),
            _ => rng.fill(&mut new[b * bs..(b + 1) * bs]),
        }
    }
    (old, new)
}

/// A one-partition bundle of `old` -> `new`, written in `dir`, and the COW the host
/// wrote (which an install must reproduce).
pub fn sample(
    dir: &Path,
    old: Vec<u8>,
    new: Vec<u8>,
    key: Option<&SecretKey>,
) -> crate::Result<(Vec<u8>, Vec<u8>)> {
    let (o, n) = (MemImage::new("old", old), MemImage::new("new", new));
    let plan = delta::plan(&o, &n, &PlanOptions::default(), &NoProgress)?;
    let out = dir.join("sample.vabc");
    let mut w = BundleWriter::new(&out)?;
    let plan_bytes =
        plan_wire::encode(&plan, 3).map_err(crate::io_err(&out, "encode a plan", 0))?;
    let file = w.payload_file();
    std::io::Write::write_all(file, &(plan_bytes.len() as u64).to_le_bytes())
        .and_then(|()| std::io::Write::write_all(file, &plan_bytes))
        .map_err(crate::io_err(&out, "write", 0))?;
    let cow_path = dir.join("sample.cow");
    let copts = CowOptions {
        version: 3,
        compression: cow::Compression::new(cow::Codec::Lz4),
        compression_factor: 65536,
        threads: 1,
        block_order: false,
    };
    let sopts = StreamOptions {
        frames: FrameParams {
            blocks: SAMPLE_FRAME_BLOCKS,
            search: Search::Level(3),
        },
        threads: 2,
        merge_ordered: true,
    };
    let (_, data_bytes) = record(&n, &o, &plan, file, &out, sopts, |rec| {
        write_cow(&plan, &o, rec, &cow_path, &copts, &NoProgress)
    })?;
    let cow = std::fs::read(&cow_path).map_err(crate::io_err(&cow_path, "read", 0))?;
    let id = |img: &MemImage| manifest::ImageId::compute(&img.bytes(), img.name(), img.size());
    let image = manifest::Manifest {
        schema_version: manifest::SCHEMA_VERSION,
        base: id(&o).map_err(|e| crate::io_err(&out, "hash", 0)(std::io::Error::other(e)))?,
        new: id(&n).map_err(|e| crate::io_err(&out, "hash", 0)(std::io::Error::other(e)))?,
        cow_ops: cow::CowReader::open(&cow_path)
            .map_err(|e| crate::io_err(&cow_path, "read", 0)(std::io::Error::other(e)))?
            .ops()
            .len() as u64,
        merged_op_hashes: None,
    };
    use sha2::Digest;
    w.add_partition(Partition {
        partition_size: 0,
        full: false,
        name: "system".into(),
        image,
        cow: CowParams {
            version: 3,
            compression: "lz4".into(),
            compression_factor: 65536,
            block_order: false,
            size: cow.len() as u64,
            sha256: hex::encode(sha2::Sha256::digest(&cow)),
        },
        plan: PlanCounts::default(),
        payload: PayloadInfo::unplaced(
            8 + plan_bytes.len() as u64,
            data_bytes,
            SAMPLE_FRAME_BLOCKS,
        ),
        verity: None,
    })?;
    w.finish(key, "vabc fuzz sample")?;
    let bytes = std::fs::read(&out).map_err(crate::io_err(&out, "read", 0))?;
    Ok((bytes, cow))
}
