//! The device's update driver: an update bundle installed into a store (a folder on
//! a data partition) while the old system runs, its signed head kept beside it; at
//! every boot and before every merge the stored COWs and trees proven against that
//! head with the device's own keys; mark-good, rollback and the merge's end moving
//! the store's state machine (the `update` crate) one durable step at a time.
//!
//! Whatever is in the store is input, not truth: only what a trusted key signed is.

use std::path::{Path, PathBuf};

use bundle::sign::PublicKey;
use bundle::{BundleManifest, Trust};
use serde::Serialize;
use sha2::{Digest, Sha256};
use update::{HEAD_FILE, PartitionState, State, Store, Update, VERSION_FILE, VerityRef};

use crate::error::{Context, Error, Result, invalid, mismatch};
use crate::install::Installed;
use crate::progress::Observer;

/// The public keys a device trusts, kept outside the store (which whoever writes the
/// data partition could change), and whether it accepts unsigned updates. Keys named
/// by file are read when a signature is first checked, so that a command that stops
/// earlier (a store in the wrong state) says why without needing them.
#[derive(Debug)]
pub struct Keyring {
    files: Vec<PathBuf>,
    dir: PathBuf,
    allow_unsigned: bool,
    loaded: std::sync::OnceLock<Vec<PublicKey>>,
}

impl Keyring {
    /// These keys.
    pub fn new(keys: Vec<PublicKey>, allow_unsigned: bool) -> Keyring {
        Keyring {
            files: Vec::new(),
            dir: PathBuf::new(),
            allow_unsigned,
            loaded: std::sync::OnceLock::from(keys),
        }
    }

    /// The keys in the files `keys` or, when there are none, every `*.pem` in the
    /// folder `dir`. No key at all is refused unless `allow_unsigned` (a development
    /// device).
    pub fn from_files(keys: &[PathBuf], dir: &Path, allow_unsigned: bool) -> Keyring {
        Keyring {
            files: keys.to_vec(),
            dir: dir.to_path_buf(),
            allow_unsigned,
            loaded: std::sync::OnceLock::new(),
        }
    }

    /// The keys, read on first use.
    pub fn keys(&self) -> Result<&[PublicKey]> {
        if let Some(k) = self.loaded.get() {
            return Ok(k);
        }
        let keys = self.read()?;
        Ok(self.loaded.get_or_init(|| keys))
    }

    fn read(&self) -> Result<Vec<PublicKey>> {
        let paths = if self.files.is_empty() {
            let mut paths = match std::fs::read_dir(&self.dir) {
                Ok(rd) => rd
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "pem"))
                    .collect::<Vec<_>>(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(Error::io("read the keyring", &self.dir, e)),
            };
            paths.sort();
            if paths.is_empty() && !self.allow_unsigned {
                invalid!(
                    "no trusted public key: {} holds no *.pem; put the update signer's public \
                     key there or name it with --key (--allow-unsigned accepts unsigned \
                     updates, on a development device only)",
                    self.dir.display()
                );
            }
            paths
        } else {
            self.files.clone()
        };
        paths
            .iter()
            .map(|k| PublicKey::load(k).map_err(Error::from))
            .collect()
    }

    /// The signatures these keys accept.
    pub fn trust(&self) -> Result<Trust<'_>> {
        Ok(Trust::AnyOf {
            keys: self.keys()?,
            unsigned_ok: self.allow_unsigned,
        })
    }
}

/// How [`install`] installs.
#[derive(Debug, Clone)]
pub struct InstallOptions {
    /// Install a bundle whose version is not newer than the one the device runs (a
    /// deliberate downgrade); refused when the bundle forbids it.
    pub allow_downgrade: bool,
    /// The running image's version file (a decimal number; absent: none).
    pub version_file: PathBuf,
    /// Boots of the new system allowed without mark-good before it is rolled back.
    pub max_boot_attempts: u32,
    /// Threads of the COW writer (0: one per CPU).
    pub threads: usize,
}

impl Default for InstallOptions {
    fn default() -> Self {
        InstallOptions {
            allow_downgrade: false,
            version_file: PathBuf::from("/etc/vabc/version"),
            max_boot_attempts: 3,
            threads: 0,
        }
    }
}

/// What [`install`] did.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct DeviceInstall {
    /// The store's state now (`installed`).
    pub state: &'static str,
    /// The update installed.
    pub update: Update,
    /// Per partition.
    pub partitions: Vec<Installed>,
}

/// Installs the bundle `bundle` (a file, `-`, or an HTTP(S) URL) into the store at
/// `store_path`, for the partitions on `bases` (resolved to absolute paths: a later
/// boot reads them from elsewhere). Refused, with nothing written: a bundle no
/// trusted key signed, without dm-verity, expired, or not newer than the running
/// version; a wrong base; a store in another state. Resumable: run it again after an
/// interruption.
///
/// ```no_run
/// use std::path::{Path, PathBuf};
///
/// let keys = ota::device::Keyring::from_files(&[], Path::new("/etc/vabc/keys"), false);
/// let bases = [("system".to_string(), PathBuf::from("/dev/vda2"))];
/// let done = ota::device::install(
///     Path::new("/data/vabc"),
///     Path::new("https://updates.example/2.vabc"),
///     &bases,
///     &keys,
///     &ota::device::InstallOptions::default(),
///     &ota::Silent,
/// )?;
/// println!("installed update {}", done.update.id);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn install(
    store_path: &Path,
    bundle: &Path,
    bases: &[(String, PathBuf)],
    keys: &Keyring,
    opts: &InstallOptions,
    observer: &dyn Observer,
) -> Result<DeviceInstall> {
    let store = Store::open(store_path)?;
    let before = store.load()?;
    before
        .may_install()
        .map_err(|msg| store.refused(format!("{msg}; nothing was changed")))?;
    let trust = keys.trust()?;
    let running = running_version(&store, &opts.version_file)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut specs = Vec::new();
    for (name, path) in bases {
        let abs = std::fs::canonicalize(path)
            .map_err(|e| Error::io(format!("resolve partition {name}'s base"), path, e))?;
        specs.push((name.clone(), abs));
    }
    let mut begun: Option<Update> = None;
    let req = crate::install::Request {
        bundle,
        bases: &specs,
        out_dir: store_path,
        trust,
        threads: opts.threads,
    };
    let result = crate::install::install(
        &req,
        &mut |m, head, bases| {
            if let Some(p) = m.partitions.iter().find(|p| p.verity.is_none()) {
                mismatch!(
                    "partition {}: the bundle has no dm-verity root hash, which a device \
                     update needs to check every block it boots and merges (make it with \
                     `vabc bundle create --verity`); nothing was written",
                    p.name
                );
            }
            check_release(m, running.as_ref(), opts.allow_downgrade, now)?;
            let u = update_of(m, head, bases, opts.max_boot_attempts);
            let next = before
                .begin_install(&u)
                .map_err(|msg| store.refused(format!("{msg}; nothing was changed")))?;
            // The signed head before the state that names it (again on a resume:
            // the state names it by its hash, so the bytes are the same).
            store.write_file(HEAD_FILE, head)?;
            if next != before {
                store.save(&next)?;
            }
            begun = Some(u);
            Ok(())
        },
        observer,
    );
    let partitions = match result {
        Ok(done) => done,
        Err(e) => {
            // Bad data found while streaming (a truncated or altered download): the
            // device as it was, when this run began the install; a download cut by
            // the network keeps what it saved, for the next run (the install drops
            // saved bytes that did not decode or hash). A resumed install keeps its
            // state, to resume again.
            if let (State::None, Some(u)) = (&before, &begun)
                && let Err(undo) = store
                    .save(&State::None)
                    .and_then(|()| store.remove_update_files(u))
            {
                // Said, not returned: the install's own error is the one to report.
                // The state stays installing, which boots the base and which the next
                // install resumes or `rollback` drops.
                log::warn!(
                    "vabc update: the install's start could not be undone ({undo}); the \
                     update stays installing"
                );
            }
            return Err(e);
        }
    };
    let now = store.load()?;
    let installed = now.finish_install().map_err(|msg| store.refused(msg))?;
    store.save(&installed)?;
    let Some(update) = installed.update().cloned() else {
        invalid!(
            "{}: the installed state names no update",
            store_path.display()
        );
    };
    Ok(DeviceInstall {
        state: installed.name(),
        update,
        partitions,
    })
}

/// What this boot runs, as `vabc update boot` records it in its run folder
/// (`booted.json`): the update's id and whether base + COW is served.
#[derive(Debug, Clone, Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Booted {
    /// The update the state named at boot.
    pub update_id: Option<String>,
    /// Whether the update (base + COW) is what was mounted.
    pub snapshot: bool,
}

impl Booted {
    /// The record's file in `run_dir`.
    pub fn path(run_dir: &Path) -> PathBuf {
        run_dir.join("booted.json")
    }

    /// This boot's record, if `run_dir` holds a readable one.
    pub fn read(run_dir: &Path) -> Option<Booted> {
        std::fs::read_to_string(Self::path(run_dir))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
    }
}

/// Whether the record says this boot serves the update `state` names.
fn runs_update(booted: Option<&Booted>, state: &State) -> bool {
    booted.is_some_and(|b| {
        b.snapshot && b.update_id.as_deref() == state.update().map(|u| u.id.as_str())
    })
}

/// Why there is nothing for [`mark_good`] to do on this boot, or `None` when there
/// is: the update is installed and this boot serves it. A unit that runs on every
/// boot (after `boot-complete.target`) asks this first, so that a boot of the base,
/// or one after the merge began, succeeds without marking anything.
pub fn nothing_to_mark(store_path: &Path, run_dir: &Path) -> Result<Option<String>> {
    let store = Store::open(store_path)?;
    let state = store.load()?;
    if !matches!(state, State::Installed { .. }) {
        return Ok(Some(format!("the update's state is {}", state.name())));
    }
    if !runs_update(Booted::read(run_dir).as_ref(), &state) {
        return Ok(Some(format!(
            "this boot runs the base, not the installed update ({})",
            Booted::path(run_dir).display()
        )));
    }
    Ok(None)
}

/// The running new system works: the state becomes merging (the serving daemon
/// merges, or the next boot does). Refused, with nothing changed, unless this boot
/// runs the update (`run_dir`'s record) and the stored update still proves against
/// its signed head. Returns the new state's name.
pub fn mark_good(store_path: &Path, run_dir: &Path, keys: &Keyring) -> Result<&'static str> {
    let store = Store::open(store_path)?;
    let state = store.load()?;
    let next = state.mark_good().map_err(|msg| store.refused(msg))?;
    // The merge writes the base in place: what it merges must still be what was
    // signed (the daemon proves the COW and its tree again before it merges).
    if let Some(u) = state.update() {
        signed_manifest(&store, u, keys)
            .context("nothing was changed; the update keeps running until it is rolled back")?;
    }
    // Only the new system may say it works: a boot that fell back to the base (the
    // update failed to start) runs the old one.
    let record = Booted::path(run_dir);
    let booted = Booted::read(run_dir);
    if !runs_update(booted.as_ref(), &state) {
        return Err(store
            .refused(format!(
                "this boot does not run the update ({} says {}): {}; nothing was changed",
                record.display(),
                match &booted {
                    Some(b) if !b.snapshot => "the base was booted",
                    Some(_) => "another update",
                    None => "nothing",
                },
                match &booted {
                    // No record where this command looked: the boot may have written it
                    // elsewhere.
                    None => format!(
                        "if `vabc update boot` ran with another --run-dir than {}, give \
                         that one here; else reboot to try the update again, or roll it back",
                        run_dir.display()
                    ),
                    Some(_) => "reboot to try the update again, or roll it back".to_string(),
                }
            ))
            .into());
    }
    store.save(&next)?;
    Ok(next.name())
}

/// What [`rollback`] did.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct RolledBack {
    /// The state now (`none`).
    pub state: &'static str,
    /// The state the update was in.
    pub rolled_back_from: &'static str,
    /// Whether the old system runs only from the next boot (the update was booted).
    pub from_next_boot: bool,
}

/// Drops the update (allowed until its merge starts) and removes its files, with
/// what an interrupted install left.
pub fn rollback(store_path: &Path) -> Result<RolledBack> {
    let store = Store::open(store_path)?;
    let state = store.load()?;
    let next = state.roll_back().map_err(|msg| store.refused(msg))?;
    store.save(&next)?;
    if let Some(u) = state.update() {
        store.remove_update_files(u)?;
        // What an interrupted install left: the COW it was writing, its saved download.
        for p in &u.partitions {
            crate::install::remove_stale(store_path, &p.name, None)?;
        }
    }
    Ok(RolledBack {
        state: next.name(),
        rolled_back_from: state.name(),
        from_next_boot: matches!(state, State::Installed { .. }),
    })
}

/// A merge's progress as a report gives it.
#[derive(Debug, Clone, Copy, Serialize, schemars::JsonSchema)]
pub struct MergeStatus {
    /// Ops merged.
    pub merged: u64,
    /// Ops in all (absent before the merge starts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    /// Whether the merge is complete.
    pub done: bool,
}

impl From<merge::progress::Progress> for MergeStatus {
    fn from(p: merge::progress::Progress) -> Self {
        use merge::progress::Progress;
        match p {
            Progress::NotStarted => MergeStatus {
                merged: 0,
                total: None,
                done: false,
            },
            Progress::InProgress { merged, total } => MergeStatus {
                merged,
                total: Some(total),
                done: false,
            },
            Progress::Complete { total } => MergeStatus {
                merged: total,
                total: Some(total),
                done: true,
            },
        }
    }
}

/// One partition in a [`Status`].
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct PartitionStatus {
    /// The partition.
    pub name: String,
    /// Its base.
    pub base: PathBuf,
    /// Its COW's name in the store.
    pub cow: String,
    /// Whether the COW is there.
    pub cow_present: bool,
    /// Why its merge progress cannot be read (a damaged COW).
    pub cow_error: Option<String>,
    /// The merge's progress.
    pub merge: Option<MergeStatus>,
    /// The same, in words.
    pub merge_text: Option<String>,
    /// The signed dm-verity root hash.
    pub root_hash: Option<String>,
}

/// The update's state and its merge's progress.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Status {
    /// The state's name.
    pub state: &'static str,
    /// The update, if any.
    pub update_id: Option<String>,
    /// Boots of the installed update so far.
    pub boot_attempts: Option<u32>,
    /// Boots allowed before it is rolled back.
    pub max_boot_attempts: Option<u32>,
    /// Per partition.
    pub partitions: Vec<PartitionStatus>,
}

/// The store's state; a damaged COW is reported in it, not an error (status is how
/// one finds out).
pub fn status(store_path: &Path) -> Result<Status> {
    let store = Store::open(store_path)?;
    let state = store.load()?;
    let mut partitions = Vec::new();
    if let Some(u) = state.update() {
        for p in &u.partitions {
            let present = store.exists(&p.cow)?;
            let (merge, cow_error) = match present.then(|| merge_progress(&store, p)) {
                Some(Ok(m)) => (Some(m), None),
                Some(Err(e)) => (None, Some(crate::error::chain(&e))),
                None => (None, None),
            };
            partitions.push(PartitionStatus {
                name: p.name.clone(),
                base: p.base.clone(),
                cow: p.cow.clone(),
                cow_present: present,
                cow_error,
                merge: merge.map(MergeStatus::from),
                merge_text: merge.map(|m| m.to_string()),
                root_hash: p.verity.as_ref().map(|v| v.root_hash.clone()),
            });
        }
    }
    Ok(Status {
        state: state.name(),
        update_id: state.update().map(|u| u.id.clone()),
        boot_attempts: match &state {
            State::Installed { boot_attempts, .. } => Some(*boot_attempts),
            _ => None,
        },
        max_boot_attempts: state.update().map(|u| u.max_boot_attempts),
        partitions,
    })
}

/// Largest signed head read back from a store.
const MAX_HEAD: u64 = bundle::HEADER_SIZE as u64 + bundle::format::MAX_MANIFEST as u64 + 64;

/// The installed update's signed manifest: the stored head's signature checked
/// again with the device's keys, the head being the one the state names, and the
/// update's partitions the manifest's. Every identity a boot or a merge uses comes
/// from here, not from the state file.
pub fn signed_manifest(store: &Store, update: &Update, keys: &Keyring) -> Result<BundleManifest> {
    let path = store.path().join(HEAD_FILE);
    let head = store.read_file(HEAD_FILE, MAX_HEAD)?;
    let id = hex::encode(Sha256::digest(&head));
    if id != update.id {
        mismatch!(
            "{}: the stored head is update {id}, the state names update {}: the store was \
             altered",
            path.display(),
            update.id
        );
    }
    let (m, _) = bundle::read_head(&head, &path, keys.trust()?)
        .map_err(|e| Error::Mismatch(e.to_string()))?;
    let names = |v: Vec<&str>| v.join(", ");
    let want: Vec<&str> = m.partitions.iter().map(|p| p.name.as_str()).collect();
    let have: Vec<&str> = update.partitions.iter().map(|p| p.name.as_str()).collect();
    if want != have {
        mismatch!(
            "{}: the state names partitions {}, the signed manifest {}: the store was altered",
            store.path().display(),
            names(have),
            names(want)
        );
    }
    Ok(m)
}

/// sha256 of a COW file as it was installed: the bytes a merge rewrites (its counter
/// and scratch area, [`cow::Header::merge_written_ranges`]) taken as the zeros the
/// writer left there, so that a COW is proven against its signed hash before and
/// during its merge alike. Returns the file's size and the hex digest.
pub fn sealed_sha256(file: &std::fs::File, path: &Path) -> Result<(u64, String)> {
    use std::os::unix::fs::FileExt;
    let size = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    let mut raw = [0u8; cow::format::HEADER_SIZE_V3 as usize];
    let n = (raw.len() as u64).min(size) as usize;
    file.read_exact_at(&mut raw[..n], 0)
        .map_err(|e| Error::io("read the header at offset 0 of", path, e))?;
    let (_, header) = cow::Header::decode(&raw);
    // A header too short to hold the counter is no COW vabc wrote; hash it as is.
    let ranges = if usize::from(header.header_size) >= 38 && n >= 38 {
        header.merge_written_ranges().to_vec()
    } else {
        Vec::new()
    };
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < size {
        let len = (size - at).min(buf.len() as u64) as usize;
        let chunk = &mut buf[..len];
        file.read_exact_at(chunk, at)
            .map_err(|e| Error::io(format!("read at offset {at} of"), path, e))?;
        for r in &ranges {
            let (lo, hi) = (r.start.max(at), r.end.min(at + len as u64));
            if lo < hi {
                chunk[(lo - at) as usize..(hi - at) as usize].fill(0);
            }
        }
        h.update(&chunk[..]);
        at += len as u64;
    }
    Ok((size, hex::encode(h.finalize())))
}

/// The update a bundle makes, its partitions on `bases`: named by the sha256 of its
/// signed head, which the store keeps.
pub fn update_of(
    m: &BundleManifest,
    head: &[u8],
    bases: &[PathBuf],
    max_boot_attempts: u32,
) -> Update {
    Update {
        id: hex::encode(Sha256::digest(head)),
        max_boot_attempts,
        partitions: m
            .partitions
            .iter()
            .zip(bases)
            .map(|(p, base)| PartitionState {
                name: p.name.clone(),
                base: base.clone(),
                cow: update::cow_name(&p.name),
                verity: p.verity.as_ref().map(|v| VerityRef {
                    file: update::verity_name(&p.name),
                    root_hash: v.root_hash.clone(),
                }),
                new_size: p.image.new.size,
                new_sha256: p.image.new.sha256.clone(),
            })
            .collect(),
    }
}

/// Reads a version record (a decimal number); a missing file is none.
fn read_version(path: &Path, bytes: Option<Vec<u8>>) -> Result<Option<u64>> {
    let Some(bytes) = bytes else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(&bytes);
    match text.trim().parse::<u64>() {
        Ok(v) => Ok(Some(v)),
        Err(e) => invalid!(
            "{}: not a version number: {:?}: {e}",
            path.display(),
            text.trim()
        ),
    }
}

/// The version this device runs, and where that was read: the highest of the
/// running image's version file and the store's record of the last merged update.
pub fn running_version(store: &Store, version_file: &Path) -> Result<Option<(u64, PathBuf)>> {
    let image = match std::fs::read(version_file) {
        Ok(b) => read_version(version_file, Some(b))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io("read", version_file, e)),
    };
    let recorded_path = store.path().join(VERSION_FILE);
    let recorded = match store.exists(VERSION_FILE)? {
        true => read_version(&recorded_path, Some(store.read_file(VERSION_FILE, 64)?))?,
        false => None,
    };
    Ok(match (image, recorded) {
        (Some(i), Some(r)) if r > i => Some((r, recorded_path)),
        (Some(i), _) => Some((i, version_file.to_path_buf())),
        (None, Some(r)) => Some((r, recorded_path)),
        (None, None) => None,
    })
}

/// Refuses a bundle that has expired or does not go forward from `running`.
pub fn check_release(
    m: &BundleManifest,
    running: Option<&(u64, PathBuf)>,
    allow_downgrade: bool,
    now: u64,
) -> Result<()> {
    let r = &m.release;
    if let Some(t) = r.expires
        && now >= t
    {
        mismatch!(
            "the bundle expired at {t} (seconds since 1970; now {now}): a newer release should \
             have replaced it; nothing was written"
        );
    }
    if let Some((v, from)) = running
        && r.version <= *v
    {
        if allow_downgrade && !r.no_downgrade {
            log::warn!(
                "installing version {} over version {v} ({}): a downgrade, as asked",
                r.version,
                from.display()
            );
            return Ok(());
        }
        mismatch!(
            "the bundle is version {}, not newer than version {v}, which this device runs ({}){}; \
             nothing was written",
            r.version,
            from.display(),
            if r.no_downgrade {
                ": the bundle forbids installing it over a newer version"
            } else if r.version == *v {
                ": it is installed already"
            } else {
                ": `--allow-downgrade` installs an older release on purpose"
            }
        );
    }
    Ok(())
}

/// The signed tree of a partition, proven: its superblock has the signed parameters
/// and its levels hash up to the signed root hash. Returns the checker of new-image
/// blocks the merge's scratch copies go through.
pub fn prove_tree(
    tree: &std::fs::File,
    tree_path: &Path,
    v: &bundle::VerityInfo,
) -> Result<merge::BlockCheck> {
    use std::os::unix::fs::FileExt;
    let (params, uuid) = crate::trees::signed_params(v)?;
    let mut sb = vec![0u8; verity::SUPERBLOCK_SIZE as usize];
    tree.read_exact_at(&mut sb, 0)
        .map_err(|e| Error::io("read the superblock of", tree_path, e))?;
    let found = verity::Superblock::decode(&sb, tree_path, 0)?;
    if found.params != params || found.uuid != uuid {
        mismatch!(
            "{}: the tree's superblock is not the signed one (parameters or UUID differ)",
            tree_path.display()
        );
    }
    let root = hex::decode(&v.root_hash)
        .map_err(|e| Error::Invalid(format!("the signed root hash is not hex: {e}")))?;
    let len = tree
        .metadata()
        .map_err(|e| Error::io("stat", tree_path, e))?
        .len();
    let offset = verity::tree_offset(0, true, params.hash_block_size);
    verity::verify_levels(
        &params,
        verity::Input {
            reader: tree,
            name: tree_path,
            len,
        },
        offset,
        &root,
    )
    .map_err(|e| Error::Mismatch(e.to_string()))?;
    let file = tree
        .try_clone()
        .map_err(|e| Error::io("duplicate", tree_path, e))?;
    let verifier = verity::BlockVerifier::new(file, tree_path, offset, params.clone(), &root)?;
    let dbs = u64::from(params.data_block_size);
    Ok(std::sync::Arc::new(move |block: u64, data: &[u8]| {
        // Verity blocks of at most 4 KiB each (the signed trees vabc makes are 4 KiB).
        for (i, part) in data.chunks(dbs as usize).enumerate() {
            let first = block * (cow::BLOCK_SIZE as u64 / dbs) + i as u64;
            verifier.verify(first, part).map_err(|e| e.to_string())?;
        }
        Ok(())
    }))
}

/// After one partition's merge: once every partition of the update is merged, the
/// state becomes merged.
pub fn merge_done(store: &Store, version: u64) -> Result<()> {
    let state = store.load()?;
    let Some(u) = state.update() else {
        return Ok(());
    };
    for p in &u.partitions {
        if !matches!(
            merge_progress(store, p)?,
            merge::progress::Progress::Complete { .. }
        ) {
            return Ok(());
        }
    }
    if let Ok(next) = state.merged() {
        // The version this device now runs, before the state says so: the floor of
        // the next install.
        store.write_file(VERSION_FILE, format!("{version}\n").as_bytes())?;
        store.save(&next)?;
        log::info!("vabc update: every partition merged; state merged");
    }
    Ok(())
}

/// The merge progress recorded in partition `p`'s COW in `store`.
pub fn merge_progress(store: &Store, p: &PartitionState) -> Result<merge::progress::Progress> {
    let file = store.open_file(&p.cow)?;
    let cow = cow::CowReader::from_file(
        file,
        &store.path().join(&p.cow),
        cow::OpenOptions::default(),
    )?;
    Ok(merge::progress::read(&cow)?)
}

/// A partition of the installed update, proven against its signed head and ready to
/// serve: everything is checked through the descriptors kept here, so that what was
/// proven is what is served, whatever happens to the store's names since.
pub struct Proven {
    /// The update's signed manifest.
    pub manifest: BundleManifest,
    /// The partition as the state names it.
    pub partition: PartitionState,
    /// The COW, proven against its signed hash (its merge record aside).
    pub cow: std::fs::File,
    /// The dm-verity tree, proven against the signed root hash, and that hash (hex).
    pub tree: Option<(std::fs::File, String)>,
    /// The checker of new-image blocks the merge's scratch copies go through.
    pub tree_check: Option<merge::BlockCheck>,
    /// The identities to serve against: the signed base, and the new image's region
    /// hashes the install computed.
    pub trusted: manifest::Manifest,
    /// Whether the state is merging (the daemon merges at once).
    pub merging: bool,
}

impl std::fmt::Debug for Proven {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proven")
            .field("partition", &self.partition.name)
            .field("merging", &self.merging)
            .finish_non_exhaustive()
    }
}

/// Proves partition `name` of the update in `store` before it is served or merged:
/// the stored head signed by a trusted key and named by the state, the COW's hash,
/// the base's size, the tree's superblock and levels, and the manifest sidecar's
/// new image, each against the signed manifest.
pub fn prove_partition(store: &Store, keys: &Keyring, name: &str) -> Result<Proven> {
    let state = store.load()?;
    let Some(update) = state.update().cloned() else {
        invalid!("{}: no update to serve", store.path().display());
    };
    let Some(p) = update.partitions.iter().find(|p| p.name == name) else {
        invalid!(
            "{}: the update has no partition {name}",
            store.path().display()
        );
    };
    let m = signed_manifest(store, &update, keys)?;
    let Some(sp) = m.partition(&p.name) else {
        invalid!("partition {}: not in the signed manifest", p.name);
    };
    let cow_path = store.path().join(&p.cow);
    let cow = store.open_file(&p.cow)?;
    let t = std::time::Instant::now();
    let (size, sha) = sealed_sha256(&cow, &cow_path)?;
    if (size, &sha) != (sp.cow.size, &sp.cow.sha256) {
        mismatch!(
            "{}: {size} bytes with sha256 {sha} (its merge record aside), the signed manifest \
             says {} bytes with sha256 {}: the COW was altered after it was installed",
            cow_path.display(),
            sp.cow.size,
            sp.cow.sha256
        );
    }
    let cow_secs = t.elapsed().as_secs_f64();
    let base_size = std::fs::File::open(&p.base)
        .and_then(|f| cow::view::file_size(&f, &p.base).map_err(std::io::Error::other))
        .map_err(|e| Error::io("open the base", &p.base, e))?;
    if base_size != sp.partition_bytes() {
        mismatch!(
            "the base {} is {base_size} bytes, partition {} of the signed update is {}",
            p.base.display(),
            p.name,
            sp.partition_bytes()
        );
    }
    let t = std::time::Instant::now();
    let (tree_check, tree) = match &sp.verity {
        Some(v) => {
            let name = update::verity_name(&p.name);
            let tree_path = store.path().join(&name);
            let tree = store.open_file(&name)?;
            let check = prove_tree(&tree, &tree_path, v)?;
            (Some(check), Some((tree, v.root_hash.clone())))
        }
        None => (None, None),
    };
    log::info!(
        "vabc update: partition {}: COW proven against the signed manifest in {cow_secs:.3} s, \
         tree in {:.3} s",
        p.name,
        t.elapsed().as_secs_f64()
    );
    // The identities serve checks the base and the result against: the signed base,
    // and the new image's region hashes the install computed (the bundle signs only
    // its sha256). A sidecar altered to other regions can only make serve refuse: base
    // + the proven COW make the signed image, whatever the sidecar says.
    let sidecar_name = format!("{}.manifest", p.cow);
    let sidecar_path = store.path().join(&sidecar_name);
    let sidecar = manifest::Manifest::parse(
        &String::from_utf8_lossy(&store.read_file(&sidecar_name, 64 << 20)?),
        &sidecar_path,
    )?;
    if sidecar.cow_ops != sp.image.cow_ops
        || sidecar.new.sha256 != sp.image.new.sha256
        || sidecar.new.size != sp.image.new.size
    {
        mismatch!(
            "{}: not the manifest of the signed update (its new image or op count differ)",
            sidecar_path.display()
        );
    }
    let trusted = manifest::Manifest {
        base: sp.image.base.clone(),
        ..sidecar
    };
    Ok(Proven {
        partition: p.clone(),
        manifest: m,
        cow,
        tree,
        tree_check,
        trusted,
        merging: matches!(state, State::Merging { .. }),
    })
}
