//! Making updates on the host. A bundle ([`create`]): per partition, the plan of the
//! new image against the old one, the data stream the device replays it from, and
//! the COW the device will write, whose hash (with the images' identities and the
//! release) the signed manifest fixes. A COW update ([`cow_update`]): the COW itself,
//! with its manifest sidecar and, if asked, the new image's dm-verity tree.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bundle::sign::SecretKey;
use bundle::{BundleManifest, BundleWriter, CowParams, Partition, PayloadInfo, VerityInfo};
use delta::write::{CowOptions, write_cow};
use delta::{BlockImage, ImageFile, PlanOptions};
use sha2::{Digest, Sha256};

use crate::error::{Context, Result, invalid};
use crate::progress::{Observer, Phases};

/// What a partition's update is made against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Base {
    /// A delta from this old image, which is the whole partition: the device's base
    /// must be exactly as large.
    Image(PathBuf),
    /// A full image, without a base: its COW writes every block (ZERO and REPLACE
    /// only), so it installs over whatever a partition of this size holds (`None`:
    /// the new image's size).
    Full(Option<u64>),
}

/// One partition of a bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionSpec {
    /// Its name (1 to 64 letters, digits, `_` and `-`).
    pub name: String,
    /// What its update is made against.
    pub base: Base,
    /// The new image.
    pub new: PathBuf,
}

/// How a bundle is made.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    /// The COWs the device writes (version, codec, unit, block order).
    pub cow: CowOptions,
    /// Whether XOR ops are planned.
    pub xor: bool,
    /// XORs in source runs shorter than this are stored as REPLACE.
    pub min_xor_run: u64,
    /// zstd level of the payloads' data frames, in frames of 1024 blocks; `None`:
    /// the default (frames of 64 blocks, or one frame at level 19 for a small update).
    pub level: Option<i32>,
    /// Threads (0: one per CPU).
    pub threads: usize,
    /// Record each new image's dm-verity tree parameters and root hash, with this
    /// salt (hex, `-` for none; `None` inside: 32 random bytes).
    pub verity: Option<Option<String>>,
    /// The release the bundle states, signed.
    pub release: bundle::Release,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            cow: CowOptions {
                version: 3,
                compression: cow::Compression::default(),
                compression_factor: 64 << 10,
                threads: 0,
                block_order: false,
            },
            xor: true,
            min_xor_run: 0,
            level: None,
            threads: 0,
            verity: None,
            release: bundle::Release::default(),
        }
    }
}

/// Makes the bundle `output` of `parts`, signed with `key` (unsigned without), and
/// returns its manifest. Every temporary file goes into one work folder beside
/// `output`, removed on an error, on a signal ([`crate::output`]) and by `vabc
/// cleanup`; `output` appears only once complete.
///
/// ```no_run
/// use ota::create::{Base, CreateOptions, PartitionSpec, create};
///
/// let parts = [PartitionSpec {
///     name: "system".into(),
///     base: Base::Image("old.img".into()),
///     new: "new.img".into(),
/// }];
/// let key = bundle::sign::SecretKey::load(std::path::Path::new("key.pem"))?;
/// let manifest = create(
///     "update.vabc".as_ref(),
///     Some(&key),
///     &parts,
///     &CreateOptions::default(),
///     &ota::Silent,
/// )?;
/// println!("{} partition(s)", manifest.partitions.len());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn create(
    output: &Path,
    key: Option<&SecretKey>,
    parts: &[PartitionSpec],
    opts: &CreateOptions,
    observer: &dyn Observer,
) -> Result<BundleManifest> {
    for (i, p) in parts.iter().enumerate() {
        if !bundle::format::is_partition_name(&p.name) {
            invalid!(
                "partition {:?}: a partition name is 1 to 64 letters, digits, '_' and '-'",
                p.name
            );
        }
        if parts[..i].iter().any(|q| q.name == p.name) {
            invalid!("partition {}: named twice", p.name);
        }
    }
    let c = &opts.cow;
    if !(2..=3).contains(&c.version) {
        invalid!("--cow-version {}: 2 or 3", c.version);
    }
    let factor = c.compression_factor;
    if !(factor.is_power_of_two() && (4096..=256 << 10).contains(&factor)) {
        invalid!("--cow-compression-factor {factor}: a power of two from 4k to 256k");
    }
    crate::output::check_dest(output, "-o")?;
    let work = crate::output::temp_dir_beside(output, "bundle")?;
    let mut writer = BundleWriter::new_in(output, work.path())?;
    writer.set_release(opts.release.clone());
    for p in parts {
        let part = create_partition(opts, &mut writer, output, work.path(), p, observer)
            .with_context(|| format!("partition {}", p.name))?;
        writer.add_partition(part)?;
    }
    let created_by = format!("vabc {}", env!("CARGO_PKG_VERSION"));
    crate::output::part_of_output(output, || {
        let m = writer.finish(key, &created_by)?;
        crate::output::set_default_mode(output)?;
        Ok(m)
    })
}

/// The size and sha256 (hex) of a file's bytes.
pub(crate) fn sha256_file(path: &Path) -> Result<(u64, String)> {
    let mut f = File::open(path).map_err(|e| crate::Error::io("open", path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let got = f
            .read(&mut buf)
            .map_err(|e| crate::Error::io(format!("read at offset {n} of"), path, e))?;
        if got == 0 {
            return Ok((n, hex::encode(h.finalize())));
        }
        h.update(&buf[..got]);
        n += got as u64;
    }
}

/// The old image a partition is planned against, and the partition size a full
/// image states.
fn old_of(p: &PartitionSpec, work: &Path, new: &ImageFile) -> Result<(PathBuf, Option<u64>)> {
    let name = &p.name;
    let (old_path, full_size) = match &p.base {
        Base::Image(path) => (path.clone(), None),
        // A full image is planned against an empty base: every block is then ZERO or
        // REPLACE, and nothing is read from the device's partition.
        Base::Full(size) => {
            let empty = work.join(format!("{name}.no-base"));
            File::create(&empty).map_err(|e| crate::Error::io("create", &empty, e))?;
            let size = size.unwrap_or(new.size());
            if size < new.size() || size % 4096 != 0 {
                invalid!(
                    "--partition-size {name}={size}: a multiple of 4096 of at least NEW's {} bytes",
                    new.size()
                );
            }
            (empty, Some(size))
        }
    };
    Ok((old_path, full_size))
}

/// Refuses a delta whose OLD cannot be the whole partition the new image goes to.
fn check_delta_sizes(
    p: &PartitionSpec,
    old_path: &Path,
    old: &ImageFile,
    new: &ImageFile,
) -> Result<()> {
    if old.size() == 0 {
        invalid!(
            "{}: OLD is empty; an update without a base is a full image: --full {}=NEW",
            old_path.display(),
            p.name
        );
    }
    if new.size() > old.size() {
        invalid!(
            "{}: NEW is {} bytes, larger than OLD {} ({} bytes), which the bundle takes as \
             the whole partition (the device's base must be exactly as large); give OLD as \
             the partition it will be, padded to its size (`truncate -s SIZE` on a copy)",
            p.new.display(),
            new.size(),
            old_path.display(),
            old.size()
        );
    }
    Ok(())
}

fn create_partition(
    opts: &CreateOptions,
    writer: &mut BundleWriter,
    output: &Path,
    work: &Path,
    p: &PartitionSpec,
    observer: &dyn Observer,
) -> Result<Partition> {
    let name = p.name.as_str();
    let new = ImageFile::open(&p.new, false)?;
    let (old_path, full_size) = old_of(p, work, &new)?;
    let old = ImageFile::open(&old_path, false)?;
    if full_size.is_none() {
        check_delta_sizes(p, &old_path, &old, &new)?;
    }
    let phases = Phases(observer);
    let copts = &opts.cow;
    let popts = PlanOptions {
        xor: opts.xor,
        threads: opts.threads,
        min_xor_run: opts.min_xor_run,
        ..PlanOptions::for_codec(copts.compression.codec)
    };
    let plan = delta::plan(&old, &new, &popts, &phases)?;
    let plan_bytes = bundle::plan_wire::encode(&plan, opts.level.unwrap_or(19))
        .with_context(|| format!("encode the plan of {name}"))?;
    let out = writer.payload_file();
    out.write_all(&(plan_bytes.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&plan_bytes))
        .context("write the bundle's payload")?;
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // The COW the device will write, written here first: its hash goes into the
    // manifest, and its ops give the per-op hashes.
    let cow_path = work.join(update::cow_name(name));
    let frames = bundle::data::FrameParams::choose(opts.level, &plan, &old, &new)?;
    let sopts = bundle::data::StreamOptions {
        frames,
        threads,
        merge_ordered: copts.version >= 3 && !copts.block_order,
    };
    let (_, data_bytes) = bundle::data::record(&new, &old, &plan, out, output, sopts, |rec| {
        write_cow(&plan, &old, rec, &cow_path, copts, &phases)
    })?;
    let (cow_size, cow_sha) = sha256_file(&cow_path)?;
    let written = cow::CowReader::open(&cow_path)?;
    let image = image_manifest(
        &plan,
        &old,
        &old_path,
        &new,
        &p.new,
        written.ops().len() as u64,
    )?;
    let verity = match &opts.verity {
        Some(salt) => Some(verity_info(work, name, &p.new, salt.as_deref())?),
        None => None,
    };
    let c = plan.census;
    Ok(Partition {
        // OLD is the whole partition: the device's base must be as large, so that
        // the base identity covers every byte of it.
        partition_size: full_size.unwrap_or(image.base.size),
        full: full_size.is_some(),
        name: name.to_string(),
        image,
        cow: CowParams {
            version: copts.version,
            compression: copts.compression.to_string(),
            compression_factor: copts.compression_factor,
            block_order: copts.block_order,
            size: cow_size,
            sha256: cow_sha,
        },
        plan: bundle::PlanCounts {
            unchanged: c.unchanged,
            copy: c.copy,
            xor: c.xor,
            zero: c.zero,
            replace: c.replace,
        },
        payload: PayloadInfo::unplaced(8 + plan_bytes.len() as u64, data_bytes, frames.blocks),
        verity,
    })
}

/// The images' identities as the bundle ships them.
fn image_manifest(
    plan: &delta::Plan,
    old: &ImageFile,
    old_path: &Path,
    new: &ImageFile,
    new_path: &Path,
    cow_ops: u64,
) -> Result<manifest::Manifest> {
    // The per-op hashes (16 hex digits per op: 2 MB on the `system` pair) are not
    // shipped: the device computes them from the COW it wrote, whose sha256 the
    // manifest fixes.
    let mut image = manifest::Manifest {
        schema_version: manifest::SCHEMA_VERSION,
        base: image_id(
            old,
            old_path,
            plan.old_size,
            bundle_region_size(plan.old_size),
        )?,
        new: image_id(new, new_path, plan.new_size, manifest::REGION_SIZE)?,
        cow_ops,
        merged_op_hashes: None,
    };
    // Nor the new image's region hashes (32 bytes of entropy per 4 MiB): the device
    // reads the new image through its COW once installed, computes them and checks the
    // whole image's sha256, which stays. The base's are coarse (bundle_region_size).
    image.new.regions.clear();
    Ok(image)
}

/// The dm-verity parameters and root hash of `new_path`'s tree (made in `work` and
/// dropped: the device rebuilds it).
fn verity_info(work: &Path, name: &str, new_path: &Path, salt: Option<&str>) -> Result<VerityInfo> {
    let tree = work.join(update::verity_name(name));
    let f = crate::trees::format_default(new_path, &tree, salt)
        .with_context(|| format!("verity tree of {}", new_path.display()))?;
    std::fs::remove_file(&tree).map_err(|e| crate::Error::io("remove", &tree, e))?;
    Ok(VerityInfo {
        format: f.params.format.as_u32(),
        hash_algorithm: f.params.algorithm.name().to_string(),
        data_block_size: f.params.data_block_size,
        hash_block_size: f.params.hash_block_size,
        data_blocks: f.params.data_blocks,
        salt: hex::encode(&f.params.salt),
        uuid: verity::format_uuid(&f.uuid),
        root_hash: hex::encode(&f.root),
    })
}

/// Region size of a base's identity in a bundle: at most 16 regions (and at least
/// 4 MiB each), enough to say which part of a wrong base is wrong; the device computes
/// the 4 MiB regions of its manifest sidecar once the whole base matched.
fn bundle_region_size(size: u64) -> u64 {
    (size.div_ceil(16))
        .next_power_of_two()
        .max(manifest::REGION_SIZE)
}

/// How [`cow_update`] makes a COW update (what `vabc diff` does).
#[derive(Debug, Clone)]
pub struct CowUpdateOptions {
    /// The COW's version, codec, unit and order.
    pub cow: CowOptions,
    /// How ops are chosen.
    pub plan: PlanOptions,
    /// Pad a last partial block of either image with zeros.
    pub pad: bool,
    /// Also write the new image's dm-verity tree to this file, with this salt (hex,
    /// `-` for none; `None`: 32 random bytes).
    pub verity: Option<(PathBuf, Option<String>)>,
}

/// What [`cow_update`] wrote.
#[derive(Debug)]
pub struct CowUpdate {
    /// The plan the COW was written from (its census says what each block became).
    pub plan: delta::Plan,
    /// The COW writer's report.
    pub written: delta::write::WriteReport,
    /// The manifest sidecar: the base the update needs and the image it makes.
    pub manifest: manifest::Manifest,
    /// Where the sidecar was written (`COW.manifest`).
    pub manifest_path: PathBuf,
    /// The dm-verity tree, if asked for, and where it was written.
    pub tree: Option<(PathBuf, crate::trees::Formatted)>,
    /// The new image's bytes on disk (a sparse image holds fewer).
    pub new_physical_size: u64,
    /// Seconds spent planning.
    pub plan_seconds: f64,
}

/// Writes the COW that turns `old_path` into `new_path` at `output`, its manifest
/// sidecar and, if asked, the new image's dm-verity tree. The three are one output:
/// an error or an interrupt before the last is written removes those written already
/// ([`crate::output::part_of_output`]).
pub fn cow_update(
    old_path: &Path,
    new_path: &Path,
    output: &Path,
    opts: &CowUpdateOptions,
    observer: &dyn Observer,
) -> Result<CowUpdate> {
    for input in [old_path, new_path] {
        if same_file(input, output) {
            invalid!(
                "output {} is the same file as input {}",
                output.display(),
                input.display()
            );
        }
    }
    crate::output::check_dest(output, "-o")?;
    let t0 = std::time::Instant::now();
    let old = ImageFile::open(old_path, opts.pad)?;
    let new = ImageFile::open(new_path, opts.pad)?;
    let phases = Phases(observer);
    let plan = delta::plan(&old, &new, &opts.plan, &phases)?;
    let plan_seconds = t0.elapsed().as_secs_f64();
    let (written, manifest, manifest_path, tree) = write_planned(
        &plan,
        (&old, old_path),
        (&new, new_path),
        output,
        &opts.cow,
        opts.verity.as_ref(),
        observer,
    )?;
    Ok(CowUpdate {
        new_physical_size: new.physical_size(),
        plan,
        written,
        manifest,
        manifest_path,
        tree,
        plan_seconds,
    })
}

/// Whether two paths name the same file.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Writes `plan` (from OLD to NEW) as the COW at `output`, its manifest sidecar and,
/// if asked, NEW's dm-verity tree: one output, removed whole by an error or an
/// interrupt ([`crate::output::part_of_output`]). Returns the writer's report, the
/// manifest, where it went and the tree.
pub fn write_planned(
    plan: &delta::Plan,
    (old, old_path): (&ImageFile, &Path),
    (new, new_path): (&ImageFile, &Path),
    output: &Path,
    cow: &CowOptions,
    verity: Option<&(PathBuf, Option<String>)>,
    observer: &dyn Observer,
) -> Result<Planned> {
    let phases = Phases(observer);
    let written = crate::output::part_of_output(output, || {
        write_cow(plan, old, new, output, cow, &phases)
            .with_context(|| format!("writing {}", output.display()))
    })?;
    // The COW writer's temporary file was created 0600; give the COW the mode any new
    // file gets.
    crate::output::set_default_mode(output)?;
    // What the update is for: the base it needs and the image it makes, checked by
    // apply, merge and serve before they read a base through this COW.
    let reader =
        cow::CowReader::open(output).with_context(|| format!("read back {}", output.display()))?;
    let manifest = manifest::Manifest {
        schema_version: manifest::SCHEMA_VERSION,
        base: image_id(old, old_path, plan.old_size, manifest::REGION_SIZE)?,
        new: image_id(new, new_path, plan.new_size, manifest::REGION_SIZE)?,
        cow_ops: reader.ops().len() as u64,
        merged_op_hashes: Some(crate::trust::op_hashes(&reader, new, new_path)?),
    };
    let manifest_path = manifest::Manifest::path_for(output);
    crate::output::part_of_output(&manifest_path, || {
        crate::output::write_atomic(&manifest_path, manifest.to_json().as_bytes())
    })?;
    let tree = match verity {
        Some((hashfile, salt)) => {
            let f = crate::output::part_of_output(hashfile, || {
                crate::trees::format_default(new_path, hashfile, salt.as_deref())
                    .with_context(|| format!("verity tree of {}", new_path.display()))
            })?;
            Some((hashfile.clone(), f))
        }
        None => None,
    };
    Ok((written, manifest, manifest_path, tree))
}

/// What [`write_planned`] wrote: the writer's report, the manifest, its path, the tree.
pub type Planned = (
    delta::write::WriteReport,
    manifest::Manifest,
    PathBuf,
    Option<(PathBuf, crate::trees::Formatted)>,
);

/// An image's identity (size, sha256, hashes of `region_size` regions).
fn image_id(
    img: &ImageFile,
    path: &Path,
    size: u64,
    region_size: u64,
) -> Result<manifest::ImageId> {
    Ok(manifest::ImageId::compute_in(img, path, size, region_size)?)
}
