//! What an update is for: the identity of the base image it must be applied to and of
//! the image it makes.
//!
//! A COW file does not say which base it was made against: applied to another base, or
//! after a payload byte flipped, it produces a wrong image without any error. `vabc
//! diff` therefore writes a [`Manifest`] beside the COW (`UPDATE.cow.manifest`, JSON),
//! and every command that reads a base through a COW checks it first:
//!
//! * the base's [`ImageId`] (size, sha256, and one sha256 per [`REGION_SIZE`] region,
//!   so that a mismatch names the first region that differs rather than just "wrong");
//! * the new image's [`ImageId`], which the result of decoding every op must equal
//!   before a merge writes its first block.
//!
//! Region hashes are computed in parallel and compared one by one; two images with the
//! same size and the same region hashes are the same image, so the whole-image sha256
//! is carried for people (`sha256sum` prints it) and is not recomputed by the checks.
//! A sidecar file rather than bytes inside the COW: AOSP's readers must read our COWs
//! unchanged, and the update bundle carries the same identities in its own manifest.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Whether `name` can name a partition: it becomes a file name on the device
/// (`NAME.cow`), so 1 to 64 ASCII letters, digits, `_` and `-` (Android's partition
/// names are of these). Bundles, the device's update state and the store all hold
/// partition names to this one rule.
pub fn is_partition_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The body of the `manifest_parse` fuzz target, replayed over its corpus by
/// `cargo test`.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing {
    /// Parses `data` as manifest text: an error is fine, a panic or an accepted
    /// manifest that does not survive a round trip is not.
    pub fn exercise_parse(data: &[u8]) {
        let path = std::path::Path::new("fuzz.manifest");
        let Ok(text) = std::str::from_utf8(data) else {
            return;
        };
        if let Ok(m) = super::Manifest::parse(text, path) {
            let again = super::Manifest::parse(&m.to_json(), path);
            assert_eq!(again.ok().as_ref(), Some(&m), "round trip");
            for pos in 0..m.cow_ops.min(4) {
                let _ = m.merged_op_hash(pos);
            }
        }
    }
}

/// Bytes hashed per region.
pub const REGION_SIZE: u64 = 4 << 20;
/// The manifest format this build writes; it reads this and older ones.
pub const SCHEMA_VERSION: u32 = 1;

/// Errors, each naming the file it concerns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    #[error("{path}: not a vabc update manifest: {msg}")]
    Invalid { path: PathBuf, msg: String },
    #[error(
        "{path}: manifest format {found} is newer than this vabc understands ({SCHEMA_VERSION}); upgrade vabc"
    )]
    TooNew { path: PathBuf, found: u32 },
}

pub type Result<T> = std::result::Result<T, ManifestError>;

/// Size and hashes of one image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ImageId {
    pub size: u64,
    /// sha256 of the whole image, hex.
    pub sha256: String,
    /// Bytes per region (the last one may be shorter).
    pub region_size: u64,
    /// sha256 of each region, hex.
    pub regions: Vec<String>,
}

/// The first place two images differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// The image has fewer bytes than the identity says.
    TooSmall { size: u64, want: u64 },
    /// Region `index` (bytes `start..end`) differs.
    Region { index: usize, start: u64, end: u64 },
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mismatch::TooSmall { size, want } => {
                write!(f, "it has {size} bytes, {want} expected")
            }
            // The range says the region's size: a bundle's regions are coarser than a
            // COW manifest's.
            Mismatch::Region { index, start, end } => {
                write!(f, "bytes {start}..{end} (region {index}) differ")
            }
        }
    }
}

/// Reads of an image at an offset (the caller's file, device or view).
pub use vabc_io::{ReadAt, ReadFn};

/// Hashes of the regions `which` of the first `size` bytes of an image, in parallel.
/// `path` names the image in errors.
fn region_hashes(
    src: &dyn ReadAt,
    path: &Path,
    size: u64,
    region_size: u64,
    which: &[usize],
) -> Result<Vec<[u8; 32]>> {
    const CHUNK: usize = 1 << 20;
    which
        .par_iter()
        .map_init(
            || vec![0u8; CHUNK],
            |buf, &r| {
                let start = r as u64 * region_size;
                let mut h = Sha256::new();
                hash_range(
                    src,
                    path,
                    start,
                    (start + region_size).min(size),
                    buf,
                    &mut h,
                )?;
                Ok(h.finalize().into())
            },
        )
        .collect()
}

/// Feeds bytes `start..end` of an image to `h`, read in `buf`-sized pieces.
fn hash_range(
    src: &dyn ReadAt,
    path: &Path,
    start: u64,
    end: u64,
    buf: &mut [u8],
    h: &mut Sha256,
) -> Result<()> {
    let mut off = start;
    while off < end {
        let n = ((end - off) as usize).min(buf.len());
        src.read_exact_at(&mut buf[..n], off).map_err(|source| {
            ManifestError::Io(vabc_io::Error::new("read", path, source).at(off))
        })?;
        h.update(&buf[..n]);
        off += n as u64;
    }
    Ok(())
}

/// Largest piece [`one_pass`] reads at once; a larger region is read in pieces.
const ONE_PASS_CHUNK: u64 = REGION_SIZE;
/// Bytes read at once in [`one_pass`]: it holds twice this (the stripe being read
/// and the one being hashed), plus what the reader buffers. Four 4 MiB pieces keep two
/// cores busy; the whole-image hash, on one, sets the pace anyway.
const ONE_PASS_STRIPE: u64 = 16 << 20;

/// Region hashes and the whole-image hash from one read of the image (`vabc diff`
/// reads two images, an install its base and the new image through its COW, a bundle
/// its bases in coarse regions). Each stripe of pieces is read in parallel while this
/// thread feeds the stripe before it, in order, to the whole-image hash. Regions of at
/// most a piece are hashed as they are read, in parallel; larger ones are fed piece by
/// piece beside the whole-image hash.
fn one_pass(
    src: &dyn ReadAt,
    path: &Path,
    size: u64,
    region_size: u64,
) -> Result<(Vec<[u8; 32]>, Sha256)> {
    let chunk = region_size.min(ONE_PASS_CHUNK);
    let per_piece = region_size <= ONE_PASS_CHUNK;
    let n = size.div_ceil(chunk) as usize;
    let width = (ONE_PASS_STRIPE / chunk).max(1) as usize;
    let mut whole = Sha256::new();
    let mut regions = Vec::with_capacity(size.div_ceil(region_size) as usize);
    // Large regions: the one being fed, and where the bytes fed so far end.
    let mut region = Sha256::new();
    let mut fed = 0u64;
    let mut hashed: Vec<Vec<u8>> = Vec::new();
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let mut feed = |bufs: &[Vec<u8>], whole: &mut Sha256, regions: &mut Vec<[u8; 32]>| {
        rayon::join(
            || bufs.iter().for_each(|b| whole.update(b)),
            || {
                if per_piece {
                    return;
                }
                for mut b in bufs.iter().map(|b| &b[..]) {
                    while !b.is_empty() {
                        let end = ((fed / region_size + 1) * region_size).min(size);
                        let take = b.len().min((end - fed) as usize);
                        region.update(&b[..take]);
                        (fed, b) = (fed + take as u64, &b[take..]);
                        if fed == end {
                            regions.push(region.finalize_reset().into());
                        }
                    }
                }
            },
        );
    };
    for first in (0..n).step_by(width) {
        let stripe = first..n.min(first + width);
        let mut bufs: Vec<Vec<u8>> = stripe
            .clone()
            .map(|_| spare.pop().unwrap_or_default())
            .collect();
        let (read, ()) = rayon::join(
            || {
                bufs.par_iter_mut()
                    .zip(stripe.clone())
                    .map(|(buf, k)| {
                        let start = k as u64 * chunk;
                        buf.resize(((start + chunk).min(size) - start) as usize, 0);
                        src.read_exact_at(buf, start).map_err(|source| {
                            ManifestError::Io(vabc_io::Error::new("read", path, source).at(start))
                        })?;
                        Ok(per_piece.then(|| Sha256::digest(&buf[..]).into()))
                    })
                    .collect::<Result<Vec<Option<[u8; 32]>>>>()
            },
            || feed(&hashed, &mut whole, &mut regions),
        );
        // Pieces' own hashes come in order, ahead of `feed`'s (which are none then).
        regions.extend(read?.into_iter().flatten());
        spare.append(&mut hashed);
        hashed = bufs;
    }
    feed(&hashed, &mut whole, &mut regions);
    Ok((regions, whole))
}

fn regions_of(size: u64, region_size: u64) -> usize {
    size.div_ceil(region_size) as usize
}

impl ImageId {
    /// The identity of the first `size` bytes of an image. Reads the whole image once,
    /// so use it where the image is made, not on every check.
    pub fn compute(src: &dyn ReadAt, path: &Path, size: u64) -> Result<ImageId> {
        ImageId::compute_in(src, path, size, REGION_SIZE)
    }

    /// [`ImageId::compute`] with regions of `region_size` bytes (a power of two of at
    /// least 4 KiB). A manifest beside a COW uses [`REGION_SIZE`]; an update bundle names
    /// its bases more coarsely (fewer hashes to ship) and the device computes the fine
    /// ones once the whole base matched.
    pub fn compute_in(
        src: &dyn ReadAt,
        path: &Path,
        size: u64,
        region_size: u64,
    ) -> Result<ImageId> {
        let region_size = region_size.max(4096);
        let (regions, whole) = one_pass(src, path, size, region_size)?;
        Ok(ImageId {
            size,
            sha256: hex::encode(whole.finalize()),
            region_size,
            regions: regions.iter().map(hex::encode).collect(),
        })
    }

    /// Compares an image of `actual_size` bytes with this identity, region by region
    /// (only the regions for which `check(index)` is true), and returns the first
    /// difference. Bytes past `self.size` are not looked at: a partition may be larger
    /// than the image in it.
    pub fn first_mismatch(
        &self,
        src: &dyn ReadAt,
        path: &Path,
        actual_size: u64,
        check: impl Fn(usize) -> bool,
    ) -> Result<Option<Mismatch>> {
        if actual_size < self.size {
            return Ok(Some(Mismatch::TooSmall {
                size: actual_size,
                want: self.size,
            }));
        }
        let which: Vec<usize> = (0..self.regions.len()).filter(|&r| check(r)).collect();
        let got = region_hashes(src, path, self.size, self.region_size.max(4096), &which)?;
        Ok(which
            .iter()
            .zip(&got)
            .find(|(r, h)| self.regions[**r] != hex::encode(h))
            .map(|(&index, _)| {
                let start = index as u64 * self.region_size;
                Mismatch::Region {
                    index,
                    start,
                    end: (start + self.region_size).min(self.size),
                }
            }))
    }

    fn validate(&self, path: &Path, what: &str) -> Result<()> {
        let bad = |msg: String| {
            Err(ManifestError::Invalid {
                path: path.to_path_buf(),
                msg: format!("{what}: {msg}"),
            })
        };
        // REGION_SIZE, or the coarser regions an update bundle names a base by (a
        // power of two, so that a partition of any size has at most 16): never finer,
        // so that a crafted manifest cannot ask for a hash per block.
        if self.region_size < REGION_SIZE || !self.region_size.is_power_of_two() {
            return bad(format!(
                "region size {} (this vabc uses {REGION_SIZE}, or a larger power of two)",
                self.region_size
            ));
        }
        if self.regions.len() != regions_of(self.size, self.region_size) {
            return bad(format!(
                "{} region hashes for {} bytes",
                self.regions.len(),
                self.size
            ));
        }
        let is_hash = |s: &str| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !is_hash(&self.sha256) || !self.regions.iter().all(|r| is_hash(r)) {
            return bad("a hash is not 64 hex digits".into());
        }
        Ok(())
    }
}

/// What `vabc diff` records about an update.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Manifest {
    pub schema_version: u32,
    /// The image the COW must be applied to.
    pub base: ImageId,
    /// The image it makes.
    pub new: ImageId,
    /// The COW's op count, which ties the manifest to its COW.
    pub cow_ops: u64,
    /// For each op in merge order, [`block_hash`] of the first block it writes, as it
    /// is in the new image (16 hex digits each). A merge that resumes checks the ops
    /// its COW says are merged against it, so a damaged progress record is caught
    /// before anything is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_op_hashes: Option<String>,
}

/// The hash of one 4 KiB block in [`Manifest::merged_op_hashes`] (xxh3-64: a check
/// against damage, not against an adversary; the image hashes are sha256).
pub fn block_hash(block: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(block)
}

impl Manifest {
    /// The entry of op `position` (in merge order) in `merged_op_hashes`.
    pub fn merged_op_hash(&self, position: u64) -> Option<u64> {
        let s = self.merged_op_hashes.as_deref()?;
        let i = usize::try_from(position).ok()?.checked_mul(16)?;
        u64::from_str_radix(s.get(i..i + 16)?, 16).ok()
    }
}

impl Manifest {
    /// Where the manifest of `cow` lives by default: `COW.manifest`.
    pub fn path_for(cow: &Path) -> PathBuf {
        let mut p = cow.as_os_str().to_owned();
        p.push(".manifest");
        PathBuf::from(p)
    }

    pub fn to_json(&self) -> String {
        // Serialising plain strings and integers cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    /// Reads and validates a manifest.
    pub fn load(path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ManifestError::Io(vabc_io::Error::new("read", path, source).at(0)))?;
        Manifest::parse(&text, path)
    }

    /// Parses and validates manifest text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Manifest> {
        #[derive(Deserialize)]
        struct Version {
            schema_version: u32,
        }
        let v: Version = serde_json::from_str(text).map_err(|e| ManifestError::Invalid {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        if v.schema_version > SCHEMA_VERSION {
            return Err(ManifestError::TooNew {
                path: path.to_path_buf(),
                found: v.schema_version,
            });
        }
        let m: Manifest = serde_json::from_str(text).map_err(|e| ManifestError::Invalid {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        m.base.validate(path, "base")?;
        m.new.validate(path, "new")?;
        if let Some(h) = &m.merged_op_hashes
            && (h.len() as u64 != m.cow_ops.saturating_mul(16)
                || !h.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(ManifestError::Invalid {
                path: path.to_path_buf(),
                msg: format!(
                    "merged_op_hashes: {} hex digits for {} ops",
                    h.len(),
                    m.cow_ops
                ),
            });
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(len: usize, seed: u64) -> Vec<u8> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..len).map(|_| rng.u8(..)).collect()
    }

    fn reader(data: &[u8]) -> &[u8] {
        data
    }

    #[test]
    fn identity_matches_sha256_and_names_the_first_differing_region() {
        let a = image((REGION_SIZE * 2 + 12345) as usize, 1);
        let id = ImageId::compute(&reader(&a), Path::new("a"), a.len() as u64).unwrap();
        assert_eq!(id.sha256, hex::encode(Sha256::digest(&a)));
        assert_eq!(id.regions.len(), 3);
        let same = id.first_mismatch(&reader(&a), Path::new("a"), a.len() as u64, |_| true);
        assert_eq!(same.unwrap(), None);
        let mut b = a.clone();
        b[(REGION_SIZE + 7) as usize] ^= 1;
        b[(REGION_SIZE * 2 + 7) as usize] ^= 1;
        let diff = id
            .first_mismatch(&reader(&b), Path::new("b"), b.len() as u64, |_| true)
            .unwrap();
        assert_eq!(
            diff,
            Some(Mismatch::Region {
                index: 1,
                start: REGION_SIZE,
                end: REGION_SIZE * 2
            })
        );
        // Regions left out are not compared.
        let skipped = id
            .first_mismatch(&reader(&b), Path::new("b"), b.len() as u64, |r| r == 0)
            .unwrap();
        assert_eq!(skipped, None);
        let short = id
            .first_mismatch(&reader(&b), Path::new("b"), 100, |_| true)
            .unwrap();
        assert!(matches!(short, Some(Mismatch::TooSmall { .. })));
    }

    #[test]
    fn one_read_gives_the_sha256_of_the_image_and_of_each_region() {
        // Two full stripes and a short end, one short piece, nothing; on 8 threads;
        // regions of a piece or less (hashed as read), of two pieces, and of a size
        // whose boundaries fall inside pieces.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(8)
            .build()
            .unwrap();
        for (i, len) in [ONE_PASS_STRIPE * 2 + 1000, 1000, 0]
            .into_iter()
            .enumerate()
        {
            let a = image(len as usize, 7 + i as u64);
            for region in [1 << 20, ONE_PASS_CHUNK * 2, (5 << 20) + 4096] {
                let id = pool
                    .install(|| ImageId::compute_in(&reader(&a), Path::new("a"), len, region))
                    .unwrap();
                assert_eq!(id.sha256, hex::encode(Sha256::digest(&a)), "{len} {region}");
                let want: Vec<String> = a
                    .chunks(region as usize)
                    .map(|c| hex::encode(Sha256::digest(c)))
                    .collect();
                assert_eq!(id.regions, want, "{len} {region}");
            }
        }
        // A read error names the region's offset.
        let failing = ReadFn(|_: &mut [u8], off: u64| {
            if off == 32 << 10 {
                Err(std::io::Error::other("gone"))
            } else {
                Ok(())
            }
        });
        let e = ImageId::compute_in(&failing, Path::new("f"), 100 << 10, 16 << 10).unwrap_err();
        assert!(e.to_string().contains("32768"), "{e}");
    }

    #[test]
    fn manifest_round_trips_and_rejects_bad_or_newer_files() {
        let a = image(10_000, 2);
        let b = image(9_000, 3);
        let m = Manifest {
            schema_version: SCHEMA_VERSION,
            base: ImageId::compute(&reader(&a), Path::new("a"), a.len() as u64).unwrap(),
            new: ImageId::compute(&reader(&b), Path::new("b"), b.len() as u64).unwrap(),
            cow_ops: 2,
            merged_op_hashes: Some(format!("{:016x}{:016x}", 1, block_hash(&a[..4096]))),
        };
        assert_eq!(m.merged_op_hash(1), Some(block_hash(&a[..4096])));
        assert_eq!(m.merged_op_hash(2), None);
        let p = Path::new("u.cow.manifest");
        assert_eq!(Manifest::parse(&m.to_json(), p).unwrap(), m);
        let newer = m
            .to_json()
            .replace("\"schema_version\": 1", "\"schema_version\": 99");
        assert!(matches!(
            Manifest::parse(&newer, p),
            Err(ManifestError::TooNew { found: 99, .. })
        ));
        let bad = m.to_json().replace(&m.base.regions[0], "xyz");
        let e = Manifest::parse(&bad, p).unwrap_err().to_string();
        assert!(e.contains("u.cow.manifest") && e.contains("base"), "{e}");
        assert!(Manifest::parse("{", p).is_err());
        assert_eq!(
            Manifest::path_for(Path::new("/x/u.cow")),
            Path::new("/x/u.cow.manifest")
        );
    }

    #[test]
    fn a_base_named_by_a_bundles_coarse_regions_parses_and_finer_or_odd_ones_do_not() {
        // A bundle names a base of more than 16 regions by at most 16 of a larger
        // power of two (8 MiB for a 100 MiB partition): what a device serves from.
        let id = |size: u64, region_size: u64| ImageId {
            size,
            sha256: "0".repeat(64),
            region_size,
            regions: vec!["1".repeat(64); size.div_ceil(region_size) as usize],
        };
        let with_base = |base: ImageId| Manifest {
            schema_version: SCHEMA_VERSION,
            base,
            new: id(100 << 20, REGION_SIZE),
            cow_ops: 1,
            merged_op_hashes: None,
        };
        let p = Path::new("system.manifest");
        let coarse = with_base(id(100 << 20, 8 << 20));
        assert_eq!(Manifest::parse(&coarse.to_json(), p).unwrap(), coarse);
        for bad in [4096, 3 << 20, 12 << 20] {
            let e = Manifest::parse(&with_base(id(100 << 20, bad)).to_json(), p).unwrap_err();
            assert!(e.to_string().contains("region size"), "{bad}: {e}");
        }
        // The count follows the region size.
        let mut short = coarse.clone();
        short.base.regions.pop();
        let e = Manifest::parse(&short.to_json(), p).unwrap_err();
        assert!(e.to_string().contains("12 region hashes"), "{e}");
    }
}
