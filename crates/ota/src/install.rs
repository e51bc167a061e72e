//! Installing a bundle: its signature, every base and the free space checked before
//! the first byte is written; then per partition the payload replayed over the base
//! into the COW the signed manifest names (hash checked), the new image proven through
//! it, the manifest sidecar and the dm-verity tree written, and only then the COW
//! renamed into place. A cut install resumes: finished partitions are kept, and a
//! download's saved payload bytes are read back instead of fetched again.

use std::fs::File;
use std::path::{Path, PathBuf};

use bundle::{BundleManifest, BundleReader, Partition, PayloadStream, Trust};
use delta::ImageFile;
use delta::write::{CowOptions, write_cow};
use serde::Serialize;

use crate::create::sha256_file;
use crate::error::{Context, Error, Result, invalid, mismatch};
use crate::progress::{Event, Observer, Phases};

pub use crate::progress::Installed;

/// An install's inputs.
#[derive(Clone, Copy)]
pub struct Request<'a> {
    /// The bundle: a file, `-` for stdin, or an `http://` / `https://` URL (a cut
    /// download resumes with range requests).
    pub bundle: &'a Path,
    /// Each partition's base, by name; every partition of the bundle needs one.
    pub bases: &'a [(String, PathBuf)],
    /// Where the COWs, their manifests and trees go (a folder that exists).
    pub out_dir: &'a Path,
    /// Which signatures are accepted.
    pub trust: Trust<'a>,
    /// Threads of the COW writer (0: one per CPU).
    pub threads: usize,
}

/// What [`install`] calls once everything is checked and before anything is written:
/// the manifest, the bundle's signed head, each partition's base. An error there
/// writes nothing.
pub type OnChecked<'a> = dyn FnMut(&BundleManifest, &[u8], &[PathBuf]) -> Result<()> + 'a;

/// The bundle at `path` as a stream: a file, `-` for stdin, or an `http://` /
/// `https://` URL (fetched with range requests that resume a cut connection).
pub fn open_bundle(path: &Path) -> Result<Box<dyn bundle::Source>> {
    if path == Path::new("-") {
        return Ok(Box::new(std::io::stdin()));
    }
    if is_url(path) {
        let text = path.to_string_lossy();
        // Smaller than a file's buffer: a payload passed over is not fetched.
        return Ok(Box::new(std::io::BufReader::with_capacity(
            256 << 10,
            bundle::http::RangeReader::new(&text),
        )));
    }
    let f = File::open(path).map_err(|e| Error::io("open bundle", path, e))?;
    Ok(Box::new(std::io::BufReader::with_capacity(1 << 20, f)))
}

/// Whether the bundle is fetched over HTTP(S) (see [`open_bundle`]).
pub fn is_url(path: &Path) -> bool {
    let text = path.to_string_lossy();
    text.starts_with("http://") || text.starts_with("https://")
}

/// Each partition's base in the bundle's order; every partition must have one, and
/// every base must name a partition.
pub fn match_bases(named: &[(String, PathBuf)], m: &BundleManifest) -> Result<Vec<PathBuf>> {
    if let Some((name, _)) = named.iter().find(|(n, _)| m.partition(n).is_none()) {
        invalid!(
            "--base {name}: the bundle has no partition {name:?} (it has {})",
            m.partitions
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    m.partitions
        .iter()
        .map(|p| {
            named
                .iter()
                .find(|(n, _)| *n == p.name)
                .map(|(_, path)| path.clone())
                .with_context(|| format!("no --base {}=PATH for the bundle's partition", p.name))
        })
        .collect()
}

/// Installs a bundle into `req.out_dir` and returns what it did per partition;
/// `on_checked` runs once the signature, every base and the free space are checked.
/// Files are written under temporary names and renamed once proven, so an error or
/// an interrupt leaves no partial COW; running it again resumes.
///
/// ```no_run
/// use std::path::{Path, PathBuf};
///
/// let key = bundle::sign::PublicKey::load(Path::new("pub.pem"))?;
/// let bases = [("system".to_string(), PathBuf::from("/dev/vda2"))];
/// let req = ota::install::Request {
///     bundle: Path::new("https://updates.example/system.vabc"),
///     bases: &bases,
///     out_dir: Path::new("/data/ota"),
///     trust: bundle::Trust::Key(&key),
///     threads: 0,
/// };
/// let done = ota::install::install(&req, &mut |_, _, _| Ok(()), &ota::Silent)?;
/// for d in &done {
///     println!("{}: {}", d.name, d.cow.display());
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn install(
    req: &Request<'_>,
    on_checked: &mut OnChecked<'_>,
    observer: &dyn Observer,
) -> Result<Vec<Installed>> {
    let mut r = open_checked(req.bundle, req.trust)?;
    let bases = match_bases(req.bases, r.manifest())?;
    if !req.out_dir.is_dir() {
        invalid!("--out-dir {}: not a directory", req.out_dir.display());
    }
    let _lock = lock_dir(req.out_dir)?;
    // Every base before the first byte is written: a wrong one names its first wrong
    // region, and nothing is written.
    let base_ids = r
        .manifest()
        .partitions
        .iter()
        .zip(&bases)
        .map(|(p, base)| check_bundle_base(p, base))
        .collect::<Result<Vec<_>>>()?;
    let spooling = is_url(req.bundle);
    check_space(r.manifest(), req.out_dir, spooling)?;
    on_checked(r.manifest(), r.head(), &bases)?;
    observer.event(Event::Checked(r.manifest()));
    let count = r.manifest().partitions.len();
    let mut done = Vec::new();
    while let Some((part, stream)) = r.payload() {
        let i = done.len();
        observer.event(Event::Partition {
            name: &part.name,
            index: i,
            count,
        });
        let target = Target {
            req,
            part: &part,
            base: &bases[i],
            base_id: &base_ids[i],
            spool: spooling.then(|| spool_path(req.out_dir, &part)),
        };
        let d = target.install(stream, observer)?;
        observer.event(Event::Installed(&d));
        done.push(d);
    }
    Ok(done)
}

/// The bundle opened with its signature checked; a bundle file too short for its
/// payloads, or with bytes after them, is refused before anything is written (a
/// stream finds out as it reads, and leaves only temporary files).
fn open_checked<'t>(
    path: &Path,
    trust: Trust<'t>,
) -> Result<BundleReader<Box<dyn bundle::Source>>> {
    let r = BundleReader::open(open_bundle(path)?, path, trust)?;
    if let Ok(md) = std::fs::metadata(path)
        && md.is_file()
    {
        let need = r.payload_start() + r.manifest().payload_bytes();
        if md.len() < need {
            invalid!(
                "{}: truncated: {} bytes, its manifest needs {need}; nothing was written",
                path.display(),
                md.len()
            );
        }
        // Nothing unsigned rides along: every byte of a bundle is the signed head or
        // a payload its manifest hashes.
        if md.len() > need {
            invalid!(
                "{}: offset {need}: {} bytes after the last payload, which no signature \
                 covers: not a bundle as vabc writes it; nothing was written",
                path.display(),
                md.len() - need
            );
        }
    }
    Ok(r)
}

/// A partition's payload as the bundle is read.
type Stream<'a> = PayloadStream<'a, Box<dyn bundle::Source>>;

/// One partition of an install.
struct Target<'a> {
    req: &'a Request<'a>,
    part: &'a Partition,
    base: &'a PathBuf,
    base_id: &'a manifest::ImageId,
    /// Where a download saves the payload while it installs it.
    spool: Option<PathBuf>,
}

impl Target<'_> {
    fn cow_path(&self) -> PathBuf {
        self.req.out_dir.join(update::cow_name(&self.part.name))
    }

    fn tree_path(&self) -> PathBuf {
        self.req.out_dir.join(update::verity_name(&self.part.name))
    }

    fn install(&self, mut stream: Stream<'_>, observer: &dyn Observer) -> Result<Installed> {
        let part = self.part;
        let cow_path = self.cow_path();
        remove_stale(self.req.out_dir, &part.name, self.spool.as_deref())?;
        // An earlier run that was interrupted after this partition: keep its COW.
        if sha256_file(&cow_path).ok() == Some((part.cow.size, part.cow.sha256.clone())) {
            stream.skip()?;
            return self.reuse(cow_path);
        }
        let resumed_bytes = match &self.spool {
            Some(sp) => stream.spool(sp)?,
            None => 0,
        };
        if resumed_bytes > 0 {
            log::info!(
                "partition {}: {resumed_bytes} of its {} payload bytes were saved by an \
                 earlier install; downloading the rest",
                part.name,
                part.payload.length
            );
        }
        // This process's own name: a killed install's record names its file, and
        // `vabc cleanup` removes what such a record names; under a shared name it
        // would remove the file a later install is writing.
        let tmp_cow = self.req.out_dir.join(format!(
            ".{}.cow.{}.installing",
            part.name,
            std::process::id()
        ));
        let written = self
            .replay(stream, &tmp_cow, observer)
            .and_then(|()| self.check_cow(&tmp_cow));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp_cow);
            let from_saved = match &self.spool {
                Some(sp) if resumed_bytes > 0 => format!(
                    "; its first {resumed_bytes} payload bytes were read back from {}",
                    sp.display()
                ),
                _ => String::new(),
            };
            return Err(e).with_context(|| {
                format!("install partition {} (nothing kept{from_saved})", part.name)
            });
        }
        // The hash file before the COW's rename: a kept COW always has its tree.
        let proved = self.sidecar(&tmp_cow).and_then(|m| {
            let tree = part
                .verity
                .as_ref()
                .map(|v| {
                    crate::trees::install_hashfile(
                        &part.name,
                        v,
                        part.image.new.size,
                        &tmp_cow,
                        self.base,
                        self.req.out_dir,
                    )
                })
                .transpose()?;
            Ok((m, tree))
        });
        let (sidecar, verity) = match proved {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp_cow);
                return Err(e)
                    .with_context(|| format!("install partition {} (nothing kept)", part.name));
            }
        };
        let manifest_path = manifest::Manifest::path_for(&cow_path);
        crate::output::write_atomic(&manifest_path, sidecar.to_json().as_bytes())?;
        std::fs::rename(&tmp_cow, &cow_path)
            .map_err(|e| Error::io(format!("rename to {}", cow_path.display()), &tmp_cow, e))?;
        crate::output::set_default_mode(&cow_path)?;
        if let Some(sp) = &self.spool {
            remove_if_there(sp)?;
        }
        if let Ok(d) = File::open(self.req.out_dir) {
            let _ = d.sync_all();
        }
        Ok(self.installed(cow_path, verity, true, resumed_bytes))
    }

    fn installed(
        &self,
        cow: PathBuf,
        verity: Option<PathBuf>,
        written: bool,
        resumed_bytes: u64,
    ) -> Installed {
        Installed {
            name: self.part.name.clone(),
            base: self.base.clone(),
            manifest: manifest::Manifest::path_for(&cow),
            cow,
            cow_size: self.part.cow.size,
            verity,
            root_hash: self.part.verity.as_ref().map(|v| v.root_hash.clone()),
            written,
            resumed_bytes,
        }
    }

    /// A COW an earlier, interrupted install finished: its sidecar and tree made
    /// again where they are missing or not whole.
    fn reuse(&self, cow_path: PathBuf) -> Result<Installed> {
        if let Some(sp) = &self.spool {
            remove_if_there(sp)?;
        }
        let sidecar = self.sidecar(&cow_path)?;
        let tree = self.tree_path();
        let verity = match &self.part.verity {
            Some(v) if !crate::trees::has_hashfile(v, &tree) => {
                Some(crate::trees::install_hashfile(
                    &self.part.name,
                    v,
                    self.part.image.new.size,
                    &cow_path,
                    self.base,
                    self.req.out_dir,
                )?)
            }
            Some(_) => Some(tree),
            None => None,
        };
        let manifest_path = manifest::Manifest::path_for(&cow_path);
        crate::output::write_atomic(&manifest_path, sidecar.to_json().as_bytes())?;
        // A run killed right after the rename may not have given it its mode.
        crate::output::set_default_mode(&cow_path)?;
        Ok(self.installed(cow_path, verity, false, 0))
    }

    /// Replays the payload over the base into `tmp_cow`. Saved bytes that turn out
    /// wrong (the plan or a frame does not decode, or the payload does not hash to
    /// the signed sha256) while the source answered are dropped, so that the next run
    /// downloads them afresh instead of failing on them again. A network failure, a
    /// local one (no space, an unreadable base) and anything after the payload's hash
    /// matched keep them for the next run.
    fn replay(
        &self,
        mut stream: Stream<'_>,
        tmp_cow: &Path,
        observer: &dyn Observer,
    ) -> Result<()> {
        let part = self.part;
        let health = stream.source_health();
        // `always`: the error is in the payload's bytes whatever its kind (its plan).
        let drop_saved = |e: Error, always: bool| {
            if let Some(sp) = &self.spool
                && !health.failed()
                && sp.exists()
                && (always || e.is_bad_data())
            {
                log::warn!(
                    "partition {}: the payload read did not decode or hash; its saved \
                     download {} is dropped, the next install fetches it again",
                    part.name,
                    sp.display()
                );
                let _ = std::fs::remove_file(sp);
            }
            e
        };
        let plan =
            read_plan(&mut stream, part, self.req.bundle).map_err(|e| drop_saved(e, true))?;
        let old = ImageFile::open(self.base, false)?;
        let copts = CowOptions {
            version: part.cow.version,
            compression: part.cow.compression.parse().map_err(|e| {
                Error::Invalid(format!(
                    "partition {}: codec {:?}: {e}",
                    part.name, part.cow.compression
                ))
            })?,
            compression_factor: part.cow.compression_factor,
            threads: self.req.threads,
            block_order: part.cow.block_order,
        };
        // Written under a temporary name and renamed only once its hash and the
        // payload's are right.
        crate::output::pending(tmp_cow);
        let pos = stream.position();
        let replayer = bundle::data::Replayer::new(
            &old,
            &plan,
            copts.version >= 3 && !copts.block_order,
            part.payload.frame_blocks,
            &mut stream,
            pos,
            self.req.bundle,
            part.image.new.size,
        )
        .context("start the data stream")
        .map_err(|e| drop_saved(e, false))?;
        let written = write_cow(&plan, &old, &replayer, tmp_cow, &copts, &Phases(observer));
        let rest = replayer.finish().map(drop);
        written
            .map_err(Error::from)
            .and_then(|_| {
                rest.map_err(|m| {
                    Error::Os(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("{}: {m}", self.req.bundle.display()),
                    ))
                })
            })
            .and_then(|_| stream.finish().map_err(Error::from))
            .map_err(|e| drop_saved(e, false))
    }

    /// The COW written must be the one the signed manifest names, byte for byte.
    fn check_cow(&self, tmp_cow: &Path) -> Result<()> {
        let part = self.part;
        let got = sha256_file(tmp_cow)?;
        if got != (part.cow.size, part.cow.sha256.clone()) {
            invalid!(
                "partition {}: the COW written from the bundle is {} bytes with sha256 {}, \
                 the manifest says {} bytes with sha256 {} (a vabc of another version?)",
                part.name,
                got.0,
                got.1,
                part.cow.size,
                part.cow.sha256
            );
        }
        Ok(())
    }

    /// The manifest `vabc diff` would have written beside the COW: the bundle's, with
    /// the base's 4 MiB identity from [`check_bundle_base`], and the new image's region
    /// hashes and per-op hashes computed from the COW over the base (the new image's
    /// sha256 checked against the bundle's).
    fn sidecar(&self, cow_path: &Path) -> Result<manifest::Manifest> {
        let (p, base) = (self.part, self.base.as_path());
        let cow = cow::CowReader::open(cow_path)?;
        let file = File::open(base).map_err(|e| Error::io("open base", base, e))?;
        let view = cow::SnapshotView::new(&cow, &file, base, Some(p.image.new.size))?;
        let read = manifest::ReadFn(|buf: &mut [u8], off: u64| {
            view.read_blocks(off / cow::BLOCK_SIZE as u64, buf)
                .map_err(std::io::Error::other)
        });
        // A full read of the new image through the COW: it proves base + COW make the
        // image the signed manifest names, before the COW is kept.
        let new = manifest::ImageId::compute(&read, cow_path, p.image.new.size)?;
        if new.sha256 != p.image.new.sha256 {
            mismatch!(
                "partition {}: base {} + the installed COW make an image with sha256 {}, the \
                 bundle's new image has {}; nothing was kept",
                p.name,
                base.display(),
                new.sha256,
                p.image.new.sha256
            );
        }
        Ok(manifest::Manifest {
            merged_op_hashes: Some(crate::trust::op_hashes(&cow, &read, cow_path)?),
            new,
            base: self.base_id.clone(),
            ..p.image.clone()
        })
    }
}

/// Reads the plan at the start of partition `part`'s payload.
fn read_plan(stream: &mut Stream<'_>, part: &Partition, bundle_path: &Path) -> Result<delta::Plan> {
    let at = stream.position() + 8;
    let plan_bytes = stream.read_plan()?;
    bundle::plan_wire::decode(&plan_bytes, part.image.new.size).map_err(|msg| {
        Error::Invalid(format!(
            "{}: offset {at}: partition {}: {msg}",
            bundle_path.display(),
            part.name
        ))
    })
}

/// What an install killed while it worked on partition `name` left in `dir`: the COW
/// being written (`.NAME.cow.PID.installing`), the COW writer's temporary file beside it,
/// the manifest sidecar's (`.NAME.cow.manifest.*.tmp`) and the hash file's
/// (`.NAME.verity.*.tmp`); and the saved downloads of this partition other than
/// `keep` (another bundle's, named by its payload hash).
pub fn remove_stale(dir: &Path, name: &str, keep: Option<&Path>) -> Result<()> {
    let installing = format!(".{name}.cow.");
    let writer_temp = format!("..{name}.cow.");
    let sidecar_temp = format!(".{name}.cow.manifest.");
    let tree_temp = format!(".{name}.verity.");
    let spool_prefix = format!(".{name}.payload.");
    let list = |e| Error::io("list", dir, e);
    for e in std::fs::read_dir(dir).map_err(list)? {
        let e = e.map_err(list)?;
        let f = e.file_name().to_string_lossy().into_owned();
        let temp = f.ends_with(".tmp")
            && [&writer_temp, &sidecar_temp, &tree_temp]
                .iter()
                .any(|p| f.starts_with(p.as_str()));
        // Another bundle's saved download of this partition.
        let other_spool = f.starts_with(&spool_prefix)
            && f.ends_with(".part")
            && keep.and_then(Path::file_name) != Some(e.file_name().as_os_str());
        // Any process's (installs into one folder hold its lock: the writer of any
        // such file is dead), and the name before the process's own (`.NAME.cow.installing`).
        let cow = f.starts_with(&installing) && f.ends_with(".installing");
        if cow || temp || other_spool {
            std::fs::remove_file(e.path())
                .map_err(|err| Error::io("remove the stale", e.path(), err))?;
        }
    }
    Ok(())
}

/// Checks `base` against the bundle's identity of partition `p`'s base and returns
/// its identity in 4 MiB regions, which the manifest sidecar records: one computation
/// (one read of the base) compared by sha256; only a base that differs is compared
/// region by region, to name where.
pub fn check_bundle_base(p: &Partition, base: &Path) -> Result<manifest::ImageId> {
    let (size, read) = base_reader(base)?;
    let want = &p.image.base;
    let partition = p.partition_bytes();
    // The identity covers the whole partition: a base of another size (a bundle made
    // from an empty or a shorter image included) is not the one it was made for.
    if size != partition {
        mismatch!(
            "{} is {size} bytes, but partition {} of this bundle is {partition} bytes: not the \
             partition the bundle was made for; nothing was written",
            base.display(),
            p.name
        );
    }
    if p.image.new.size > partition {
        mismatch!(
            "partition {}: the new image ({} bytes) is larger than the partition ({partition} \
             bytes); nothing was written",
            p.name,
            p.image.new.size
        );
    }
    let id = manifest::ImageId::compute(&read, base, want.size)
        .with_context(|| format!("check the base {}", base.display()))?;
    if id.sha256 == want.sha256 {
        return Ok(id);
    }
    let found = want
        .first_mismatch(&read, base, size, |_| true)
        .with_context(|| format!("check the base {}", base.display()))?;
    let what = match found {
        Some(m) => m.to_string(),
        None => format!("its sha256 is not {}", want.sha256),
    };
    mismatch!(
        "{} is not the base partition {} of this bundle was made for: {what}; nothing was written",
        base.display(),
        p.name
    );
}

/// A base's size and a reader of it as the disk holds it: a block device may be
/// mounted (the running old system) with its file system's own view of it in the
/// page cache (`vabc_io::direct`).
pub fn base_reader(base: &Path) -> Result<(u64, vabc_io::Disk)> {
    let disk = vabc_io::Disk::open(base).map_err(|e| Error::io("open base", base, e))?;
    let size = cow::view::file_size(disk.file(), base)?;
    Ok((size, disk))
}

/// Refuses an install whose COWs (and hash files) do not fit in `dir`; a download
/// (`spooling`) also saves one partition's payload at a time beside them.
fn check_space(m: &BundleManifest, dir: &Path, spooling: bool) -> Result<()> {
    let todo: Vec<&Partition> = m
        .partitions
        .iter()
        .filter(|p| {
            let cow = dir.join(update::cow_name(&p.name));
            std::fs::metadata(cow).map(|md| md.len()).ok() != Some(p.cow.size)
        })
        .collect();
    let mut need: u64 = todo
        .iter()
        .map(|p| p.cow.size + crate::trees::hashfile_bytes(p.verity.as_ref()))
        .sum();
    if spooling {
        need += todo
            .iter()
            .map(|p| {
                let saved = std::fs::metadata(spool_path(dir, p)).map_or(0, |md| md.len());
                p.payload.length.saturating_sub(saved)
            })
            .max()
            .unwrap_or(0);
    }
    let free = free_bytes(dir)?;
    if free < need {
        invalid!(
            "{}: {free} bytes free, the bundle's COWs need {need}{}; nothing was written",
            dir.display(),
            if spooling {
                " (with the largest payload, saved while it downloads)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// Holds `dir` for one install at a time (an advisory lock on the folder itself,
/// released when the returned file closes): two installs into one folder would remove
/// each other's temporary files and saved downloads. Where the file system has no
/// locks, the install goes on unlocked.
fn lock_dir(dir: &Path) -> Result<File> {
    use std::os::fd::AsRawFd;
    let f = File::open(dir).map_err(|e| Error::io("open", dir, e))?;
    // SAFETY: flock takes a descriptor `f` owns and keeps open across the call.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            invalid!(
                "{}: another install is writing into this folder; nothing was written",
                dir.display()
            );
        }
        // A file system without locks (some network and FUSE ones) still installs.
        log::debug!("{}: cannot lock ({e}); installing without", dir.display());
    }
    Ok(f)
}

/// Where a download saves partition `p`'s payload while it installs it, named by the
/// payload's signed sha256 so that a resumed install reads back only its own bytes
/// ([`bundle::PayloadStream::spool`]).
fn spool_path(dir: &Path, p: &Partition) -> PathBuf {
    // An unsigned manifest's hash may be anything: only hex digits go into the name.
    let id: String = p
        .payload
        .sha256
        .chars()
        .take(16)
        .map(|c| if c.is_ascii_hexdigit() { c } else { '_' })
        .collect();
    dir.join(format!(".{}.payload.{id}.part", p.name))
}

fn remove_if_there(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("remove", path, e)),
        _ => Ok(()),
    }
}

/// Bytes an unprivileged writer may still use in `dir`'s file system.
fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("{}: path contains a NUL byte", dir.display())))?;
    // SAFETY: statvfs writes only into `st`, which lives across the call; `c` is a
    // NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::io("statvfs", dir, std::io::Error::last_os_error()));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// An image [`apply`] made.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Applied {
    /// The partition.
    pub name: String,
    /// The new image written.
    pub image: PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// Its sha256 (the signed one), hex.
    pub sha256: String,
    /// Its dm-verity hash file (bundles made with verity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verity: Option<PathBuf>,
    /// The tree's root hash, hex.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_hash: Option<String>,
}

/// Makes the new images of a bundle as files `NAME.img` (and `NAME.verity`) in
/// `req.out_dir`: installed into a work folder beside them first, then each image
/// read through its COW, checked against the signed identity and renamed into place.
pub fn apply(req: &Request<'_>, observer: &dyn Observer) -> Result<Vec<Applied>> {
    let out_dir = req.out_dir;
    if !out_dir.is_dir() {
        invalid!("--out-dir {}: not a directory", out_dir.display());
    }
    let work = crate::output::temp_dir_beside(&out_dir.join("x"), "bundle-apply")?;
    let staged = Request {
        out_dir: work.path(),
        ..*req
    };
    let done = install(&staged, &mut |_, _, _| Ok(()), observer)?;
    let mut outputs = Vec::new();
    for d in &done {
        let m = manifest::Manifest::load(&d.manifest)?;
        let cow = cow::CowReader::open(&d.cow)?;
        let base = File::open(&d.base).map_err(|e| Error::io("open base", &d.base, e))?;
        let view = cow::SnapshotView::new(&cow, &base, &d.base, Some(m.new.size))?;
        let out = out_dir.join(format!("{}.img", d.name));
        let tmp = crate::output::temp_beside(&out)?;
        tmp.as_file()
            .set_len(m.new.size)
            .map_err(|e| Error::io("size", tmp.path(), e))?;
        view.write_to(tmp.as_file(), tmp.path(), true, &|_| {})?;
        if let Some(found) = m
            .new
            .first_mismatch(tmp.as_file(), tmp.path(), m.new.size, |_| true)?
        {
            mismatch!(
                "partition {}: the image made from the bundle is not the new image: {found}; \
                 nothing was written",
                d.name
            );
        }
        crate::output::part_of_output(&out, || crate::output::commit(tmp, &out))?;
        let verity = match &d.verity {
            Some(tree) => {
                let dest = out_dir.join(update::verity_name(&d.name));
                std::fs::rename(tree, &dest)
                    .map_err(|e| Error::io(format!("rename to {}", dest.display()), tree, e))?;
                Some(dest)
            }
            None => None,
        };
        outputs.push(Applied {
            name: d.name.clone(),
            image: out,
            size: m.new.size,
            sha256: m.new.sha256.clone(),
            verity,
            root_hash: d.root_hash.clone(),
        });
    }
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    /// What a killed install left is removed, whichever process left it, and nothing
    /// of another partition or any other file.
    #[test]
    fn stale_files_of_any_install_of_the_partition_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let stale = [
            ".system.cow.installing",
            ".system.cow.4242.installing",
            "..system.cow.4242.installing.Ab12Cd.tmp",
            ".system.cow.manifest.Ab12Cd.tmp",
            ".system.verity.Ab12Cd.tmp",
        ];
        let kept = [
            "system.cow",
            "system.cow.manifest",
            ".system_ext.cow.4242.installing",
            ".vendor.cow.4242.installing",
            "state",
        ];
        for f in stale.iter().chain(&kept) {
            std::fs::write(dir.path().join(f), b"x").unwrap();
        }
        super::remove_stale(dir.path(), "system", None).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want: Vec<String> = kept.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(left, want);
    }
}
