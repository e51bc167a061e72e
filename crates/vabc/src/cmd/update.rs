//! `vabc update`: vabc as a device updater. An update bundle is installed into a store
//! (a folder on a data partition) while the old system runs; the initramfs asks `boot`
//! what to mount as root (the base, or base + COW served by a daemon, dm-verity on
//! top); the new system says `mark-good`, and the serving daemon merges; `rollback`
//! drops an update until its merge starts. The state machine is in the `update`
//! crate; docs/09-device-updates.md tells the whole story.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bundle::sign::PublicKey;
use bundle::{BundleManifest, Trust};
use serde::Serialize;
use sha2::{Digest, Sha256};
use update::{
    BootAction, HEAD_FILE, PartitionState, State, Store, Update, VERSION_FILE, VerityRef,
};

use crate::checks::mismatch;

/// Where a device keeps the public keys it trusts: outside the store, which whoever
/// writes the data partition could change (and in the initramfs, for `boot`).
const DEFAULT_KEYRING: &str = "/etc/vabc/keys";

/// The version of the running image, inside that (verified) image: a floor for the
/// next install that no writer of the data partition can lower.
const DEFAULT_VERSION_FILE: &str = "/etc/vabc/version";

/// Exit status of a boot that must not mount anything: the merge has overwritten
/// part of the base and the update cannot be served (docs/cli.md).
pub const EXIT_HALF_MERGED: u8 = 4;

/// A boot that must not go on: the base is half merged and the update cannot be
/// served. Exit status [`EXIT_HALF_MERGED`].
#[derive(Debug)]
pub struct HalfMerged(pub String);

impl std::fmt::Display for HalfMerged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HalfMerged {}

/// The keys the device trusts.
#[derive(clap::Args, Clone, Debug)]
pub(crate) struct DeviceKeys {
    /// A trusted public key (PEM, `openssl pkey -pubout`); repeat for more. Default:
    /// every *.pem in --keyring.
    #[arg(long = "key", value_name = "PUB.pem")]
    keys: Vec<PathBuf>,
    /// Folder of the trusted public keys (*.pem), read when no --key is given. It
    /// must not be in the store: whoever can write the store must not choose them.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_KEYRING)]
    keyring: PathBuf,
    /// Accept an unsigned update (a development device): nothing then vouches for
    /// what is installed, booted and merged.
    #[arg(long)]
    allow_unsigned: bool,
}

impl DeviceKeys {
    fn load(&self) -> Result<Vec<PublicKey>> {
        if !self.keys.is_empty() {
            return self
                .keys
                .iter()
                .map(|k| PublicKey::load(k).map_err(Into::into))
                .collect();
        }
        let mut paths = match std::fs::read_dir(&self.keyring) {
            Ok(rd) => rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "pem"))
                .collect::<Vec<_>>(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("read the keyring {}", self.keyring.display()));
            }
        };
        paths.sort();
        if paths.is_empty() && !self.allow_unsigned {
            bail!(
                "no trusted public key: {} holds no *.pem; put the update signer's public key \
                 there or name it with --key (--allow-unsigned accepts unsigned updates, on a \
                 development device only)",
                self.keyring.display()
            );
        }
        paths
            .iter()
            .map(|k| PublicKey::load(k).map_err(Into::into))
            .collect()
    }

    fn trust<'k>(&self, keys: &'k [PublicKey]) -> Trust<'k> {
        Trust::AnyOf {
            keys,
            unsigned_ok: self.allow_unsigned,
        }
    }

    /// The same options, for a process `boot` starts.
    fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = Vec::new();
        for k in &self.keys {
            v.push("--key".into());
            v.push(k.clone().into());
        }
        v.push("--keyring".into());
        v.push(self.keyring.clone().into());
        if self.allow_unsigned {
            v.push("--allow-unsigned".into());
        }
        v
    }
}

/// Largest signed head read back from a store.
const MAX_HEAD: u64 = bundle::HEADER_SIZE as u64 + bundle::format::MAX_MANIFEST as u64 + 64;

/// The installed update's signed manifest: the stored head's signature checked
/// again with the device's keys, the head being the one the state names, and the
/// update's partitions the manifest's. Every identity a boot or a merge uses comes
/// from here, not from the state file.
fn signed_manifest(store: &Store, update: &Update, keys: &DeviceKeys) -> Result<BundleManifest> {
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
    let trusted = keys.load()?;
    let (m, _) = bundle::read_head(&head, &path, keys.trust(&trusted))
        .map_err(|e| anyhow::Error::new(crate::checks::Mismatch(e.to_string())))?;
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
fn sealed_sha256(file: &std::fs::File, path: &Path) -> Result<(u64, String)> {
    use std::os::unix::fs::FileExt;
    let size = file
        .metadata()
        .with_context(|| format!("stat {}", path.display()))?
        .len();
    let mut raw = [0u8; cow::format::HEADER_SIZE_V3 as usize];
    let n = (raw.len() as u64).min(size) as usize;
    file.read_exact_at(&mut raw[..n], 0)
        .with_context(|| format!("{}: read the header at offset 0", path.display()))?;
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
            .with_context(|| format!("{}: read at offset {at}", path.display()))?;
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

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Make DIR an update store (state none).
    Init(StoreArgs),
    /// Install an update bundle into the store while the old system runs (resumable:
    /// run it again after an interruption).
    Install(InstallArgs),
    /// The initramfs's step: decide what to mount as root, start serving it if that is
    /// the update, and print `NAME DEVICE` per partition.
    Boot(BootArgs),
    /// The running new system works: merge the update into the bases (in the serving
    /// daemon, while it keeps serving). Refused unless this boot runs the update.
    MarkGood(MarkGoodArgs),
    /// Drop the update (allowed until its merge starts); the next boot runs the old
    /// system.
    Rollback(StoreArgs),
    /// Show the update's state and its merge's progress.
    Status(StoreArgs),
    /// The serving daemon `boot` starts (not for direct use).
    #[command(hide = true)]
    Daemon(DaemonArgs),
}

#[derive(clap::Args)]
struct StoreArgs {
    /// The update store: a folder on a partition that survives the update.
    #[arg(long, value_name = "DIR")]
    store: PathBuf,
    /// Print JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct MarkGoodArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The run folder `boot` used (it records there what this boot runs).
    #[arg(long, default_value = "/run/vabc", value_name = "DIR")]
    run_dir: PathBuf,
    #[command(flatten)]
    keys: DeviceKeys,
}

#[derive(clap::Args)]
struct InstallArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The bundle: a file, `-` for stdin, or an http(s):// URL.
    bundle: PathBuf,
    /// Each partition's base device (or image): NAME=PATH, once per partition.
    #[arg(short = 'b', long = "base", value_name = "NAME=PATH", required = true, value_parser = crate::args::name_eq)]
    bases: Vec<String>,
    #[command(flatten)]
    keys: DeviceKeys,
    /// Install a bundle whose version is not newer than the one the device runs (a
    /// deliberate downgrade); refused when the bundle forbids it.
    #[arg(long)]
    allow_downgrade: bool,
    /// The running image's version file (a decimal number; absent: none): with the
    /// store's record of the last merged version, the floor an update's version must
    /// pass.
    #[arg(long, value_name = "FILE", default_value = DEFAULT_VERSION_FILE)]
    version_file: PathBuf,
    /// Boots of the new system allowed without mark-good before it is rolled back.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    max_boot_attempts: u32,
    /// Threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

/// How the daemon presents base + COW to the kernel.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Frontend {
    /// A ublk block device (`ublk_drv`).
    Ublk,
    /// A FUSE file under a read-only loop device (when ublk is missing).
    Fuse,
}

/// Who checks the served blocks against the update's dm-verity root hash.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum VerityMode {
    /// The kernel when device-mapper and veritysetup are there, else the daemon.
    Auto,
    /// The kernel's dm-verity over the served device (veritysetup open).
    Kernel,
    /// The serving daemon checks every block it serves.
    Userspace,
}

#[derive(clap::Args)]
struct BootArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Base devices to print when no update is to be booted: NAME=PATH.
    #[arg(short = 'b', long = "base", value_name = "NAME=PATH", value_parser = crate::args::name_eq)]
    bases: Vec<String>,
    #[arg(long, value_enum, default_value = "ublk")]
    frontend: Frontend,
    #[arg(long, value_enum, default_value = "auto")]
    verity: VerityMode,
    /// Where the daemons' ready reports, logs (NAME.log) and FUSE folders go; it must stay reachable
    /// from the real root (a tmpfs moved along with it, as /run is).
    #[arg(long, default_value = "/run/vabc", value_name = "DIR")]
    run_dir: PathBuf,
    /// Seconds to wait for a daemon to be serving.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    #[command(flatten)]
    keys: DeviceKeys,
}

#[derive(clap::Args)]
struct DaemonArgs {
    #[arg(long)]
    store: PathBuf,
    #[arg(long)]
    partition: String,
    #[arg(long, value_enum)]
    frontend: Frontend,
    #[arg(long)]
    run_dir: PathBuf,
    /// Check every served block against the update's dm-verity tree.
    #[arg(long)]
    userspace_verity: bool,
    #[command(flatten)]
    keys: DeviceKeys,
}

impl Args {
    /// The serving daemon, which handles its own signals as `vabc serve` does.
    pub fn is_daemon(&self) -> bool {
        matches!(self.command, Sub::Daemon(_))
    }
}

pub fn run(a: Args) -> Result<ExitCode> {
    match a.command {
        Sub::Init(a) => init(a),
        Sub::Install(a) => install(a),
        Sub::Boot(a) => boot(a),
        Sub::MarkGood(a) => mark_good(a),
        Sub::Rollback(a) => rollback(a),
        Sub::Status(a) => status(a),
        Sub::Daemon(a) => daemon(a),
    }
}

fn print_json(v: &serde_json::Value) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{v:#}").context("write to stdout")
}

fn init(a: StoreArgs) -> Result<ExitCode> {
    Store::init(&a.store)?;
    if a.json {
        print_json(&serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "store": a.store,
            "state": "none",
        }))?;
    } else {
        println!("{}: update store made (state none)", a.store.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// The update a bundle makes, its partitions on `bases`: named by the sha256 of its
/// signed head, which the store keeps.
fn update_of(m: &BundleManifest, head: &[u8], bases: &[PathBuf], max_boot_attempts: u32) -> Update {
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
    text.trim().parse::<u64>().map(Some).with_context(|| {
        format!(
            "{}: not a version number: {:?}",
            path.display(),
            text.trim()
        )
    })
}

/// The version this device runs, and where that was read: the highest of the
/// running image's version file and the store's record of the last merged update.
fn running_version(store: &Store, version_file: &Path) -> Result<Option<(u64, PathBuf)>> {
    let image = match std::fs::read(version_file) {
        Ok(b) => read_version(version_file, Some(b))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("read {}", version_file.display())),
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
fn check_release(
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

fn install(a: InstallArgs) -> Result<ExitCode> {
    let store = Store::open(&a.store.store)?;
    let before = store.load()?;
    let keys = a.keys.load()?;
    let running = running_version(&store, &a.version_file)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Bases by absolute path: a later boot, from another folder, reads them.
    let mut specs = Vec::new();
    for s in &a.bases {
        let (name, path) = s
            .split_once('=')
            .with_context(|| format!("--base {s:?}: expected NAME=PATH"))?;
        let abs = std::fs::canonicalize(path)
            .with_context(|| format!("--base {name}={path}: cannot resolve the path"))?;
        specs.push(format!("{name}={}", abs.display()));
    }
    let mut begun: Option<Update> = None;
    let result = super::bundle::install_into(
        &a.bundle,
        &specs,
        &a.store.store,
        a.keys.trust(&keys),
        a.threads,
        &mut |m, head, bases| {
            if let Some(p) = m.partitions.iter().find(|p| p.verity.is_none()) {
                mismatch!(
                    "partition {}: the bundle has no dm-verity root hash, which a device \
                     update needs to check every block it boots and merges (make it with \
                     `vabc bundle create --verity`); nothing was written",
                    p.name
                );
            }
            check_release(m, running.as_ref(), a.allow_downgrade, now)?;
            let u = update_of(m, head, bases, a.max_boot_attempts);
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
    );
    let done = match result {
        Ok(done) => done,
        Err(e) => {
            // Bad data found while streaming (a truncated or altered download): the
            // device as it was, when this run began the install; a download cut by
            // the network keeps what it saved, for the next run (`install_into` drops
            // saved bytes that did not decode or hash). A resumed install keeps
            // its state, to resume again.
            if let (State::None, Some(u)) = (&before, &begun) {
                store.save(&State::None)?;
                store.remove_update_files(u)?;
            }
            return Err(e);
        }
    };
    let now = store.load()?;
    let installed = now.finish_install().map_err(|msg| store.refused(msg))?;
    store.save(&installed)?;
    let Some(u) = installed.update().cloned() else {
        bail!(
            "{}: the installed state names no update",
            a.store.store.display()
        );
    };
    if a.store.json {
        print_json(&serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "store": a.store.store,
            "state": installed.name(),
            "update": u,
            "partitions": done,
        }))?;
    } else {
        for d in &done {
            println!(
                "{}: {} ({} bytes){}",
                d.name,
                d.cow.display(),
                d.cow_size,
                if d.written { "" } else { ", already installed" }
            );
        }
        println!(
            "{}: update installed; the next boot runs it ({} boots allowed before `vabc update \
             mark-good`)",
            a.store.store.display(),
            u.max_boot_attempts
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// One partition's device, as `boot` prints it.
#[derive(Serialize)]
struct Booted {
    name: String,
    device: PathBuf,
    /// Served from base + COW (else the base itself).
    served: bool,
    /// Who checks blocks against the root hash: "kernel", "userspace" or none.
    #[serde(skip_serializing_if = "Option::is_none")]
    verity: Option<&'static str>,
}

fn bases_of(specs: &[String]) -> Result<Vec<Booted>> {
    specs
        .iter()
        .map(|s| {
            let (name, path) = s
                .split_once('=')
                .with_context(|| format!("--base {s:?}: expected NAME=PATH"))?;
            Ok(Booted {
                name: name.to_string(),
                device: PathBuf::from(path),
                served: false,
                verity: None,
            })
        })
        .collect()
}

fn boot(a: BootArgs) -> Result<ExitCode> {
    let store = Store::open(&a.store.store)?;
    let state = store.load()?;
    let (action, next) = state.on_boot();
    // The decision is durable before it is acted on: a power cut during this boot
    // counts its attempt.
    if next != state {
        store.save(&next)?;
    }
    let update = state.update();
    // The bases this boot's own configuration names (the initramfs's): where given,
    // they are what is printed, and a state that names another device is refused.
    let pinned = bases_of(&a.bases)?;
    let base_devices = |u: Option<&Update>| -> Vec<Booted> {
        match u {
            Some(u) => u
                .partitions
                .iter()
                .map(|p| Booted {
                    name: p.name.clone(),
                    device: pinned
                        .iter()
                        .find(|b| b.name == p.name)
                        .map_or_else(|| p.base.clone(), |b| b.device.clone()),
                    served: false,
                    verity: None,
                })
                .collect(),
            None => pinned
                .iter()
                .map(|b| Booted {
                    name: b.name.clone(),
                    device: b.device.clone(),
                    served: false,
                    verity: None,
                })
                .collect(),
        }
    };
    let (devices, note) = match (action, update) {
        (BootAction::Base, _) => (base_devices(update), None),
        (BootAction::RollBack, Some(u)) => {
            store.remove_update_files(u)?;
            (
                base_devices(update),
                Some(format!(
                    "the update failed to be marked good in {} boots: rolled back",
                    u.max_boot_attempts
                )),
            )
        }
        (BootAction::CleanUp, Some(u)) => {
            store.remove_update_files(u)?;
            (
                base_devices(update),
                Some("the merged update's COWs removed".into()),
            )
        }
        (BootAction::Snapshot { merge }, Some(u)) => match serve_update(&a, &store, u, &pinned) {
            Ok(v) => (v, None),
            // The merge has overwritten part of the base: neither the old system nor
            // the new one is there, so nothing may be mounted from it.
            Err(e) if merge => {
                return Err(e.context(HalfMerged(format!(
                    "{}: the merge is under way (part of the base is already the new image) \
                     and the update cannot be served: no root to mount",
                    store.path().display()
                ))));
            }
            // The base is untouched: the old system boots, this attempt counted.
            Err(e) => (
                base_devices(update),
                Some(format!(
                    "the update cannot be served ({:#}); booting the base (the old system); \
                     this was boot attempt {} of {}",
                    e,
                    match &next {
                        State::Installed { boot_attempts, .. } => *boot_attempts,
                        _ => 0,
                    },
                    u.max_boot_attempts
                )),
            ),
        },
        (_, None) => (base_devices(None), None),
    };
    // What this boot runs, for mark-good (the run folder is a tmpfs: gone at the next
    // boot). Best effort when nothing is served: a missing record refuses mark-good.
    let snapshot = devices.iter().any(|d| d.served);
    if std::fs::create_dir_all(&a.run_dir).is_ok() {
        let record = serde_json::json!({
            "update_id": next.update().map(|u| u.id.clone()),
            "snapshot": snapshot,
        });
        let written = crate::output::write_atomic(
            &a.run_dir.join("booted.json"),
            format!("{record:#}\n").as_bytes(),
        );
        if let (Err(e), true) = (written, snapshot) {
            return Err(e);
        }
    }
    if let Some(n) = &note {
        eprintln!("vabc update boot: {n}");
    }
    if a.store.json {
        print_json(&serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "state": next.name(),
            "boot_attempts": match &next { State::Installed { boot_attempts, .. } => Some(*boot_attempts), _ => None },
            "note": note,
            "partitions": devices,
        }))?;
    } else {
        for d in &devices {
            println!("{} {}", d.name, d.device.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Serves every partition of `u` (none if one fails: its daemons are stopped), after
/// checking the stored signature and the bases against this boot's configuration.
fn serve_update(a: &BootArgs, store: &Store, u: &Update, pinned: &[Booted]) -> Result<Vec<Booted>> {
    let m = signed_manifest(store, u, &a.keys)?;
    for p in &u.partitions {
        if let Some(b) = pinned.iter().find(|b| b.name == p.name) {
            let same = match (
                std::fs::canonicalize(&b.device),
                std::fs::canonicalize(&p.base),
            ) {
                (Ok(x), Ok(y)) => x == y,
                _ => b.device == p.base,
            };
            if !same {
                mismatch!(
                    "partition {}: the state says its base is {}, this boot's configuration \
                     says {}: the store was altered (or the device's layout changed)",
                    p.name,
                    p.base.display(),
                    b.device.display()
                );
            }
        }
    }
    std::fs::create_dir_all(&a.run_dir)
        .with_context(|| format!("create {}", a.run_dir.display()))?;
    let mut v = Vec::new();
    let mut daemons = Vec::new();
    for p in &u.partitions {
        let signed = m.partition(&p.name).and_then(|s| s.verity.as_ref());
        match serve_partition(a, store, p, signed) {
            Ok((b, child)) => {
                v.push(b);
                daemons.push(child);
            }
            Err(e) => {
                // Nothing of the update may run when the base is booted instead: a
                // daemon left serving could merge under it.
                for mut d in daemons {
                    stop_daemon(&mut d);
                }
                return Err(e);
            }
        }
    }
    Ok(v)
}

/// Whether the kernel's dm-verity can be set up here.
fn kernel_verity_available() -> bool {
    Path::new("/dev/mapper/control").exists()
        && Command::new("veritysetup")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

/// Stops a daemon `boot` started (SIGTERM: it takes its device down) and waits.
fn stop_daemon(child: &mut std::process::Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) with a pid we spawned and have not reaped; no memory involved.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let t0 = Instant::now();
    while matches!(child.try_wait(), Ok(None)) {
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts the daemon serving partition `p` and waits for its device; dm-verity on
/// top when the update carries a root hash. On an error the daemon is stopped.
fn serve_partition(
    a: &BootArgs,
    store: &Store,
    p: &PartitionState,
    signed: Option<&bundle::VerityInfo>,
) -> Result<(Booted, std::process::Child)> {
    let verity = match (signed, a.verity) {
        (None, _) => None,
        (Some(_), VerityMode::Kernel) => Some("kernel"),
        (Some(_), VerityMode::Userspace) => Some("userspace"),
        (Some(_), VerityMode::Auto) => Some(match kernel_verity_available() {
            true => "kernel",
            false => "userspace",
        }),
    };
    let ready = a.run_dir.join(format!("{}.ready", p.name));
    let _ = std::fs::remove_file(&ready);
    let exe = std::env::current_exe().context("find the vabc binary")?;
    let store_path = std::fs::canonicalize(store.path())
        .with_context(|| format!("resolve {}", store.path().display()))?;
    let mut cmd = Command::new(exe);
    cmd.args(["update", "daemon", "--store"])
        .arg(&store_path)
        .args(["--partition", &p.name, "--frontend"])
        .arg(match a.frontend {
            Frontend::Ublk => "ublk",
            Frontend::Fuse => "fuse",
        })
        .arg("--run-dir")
        .arg(&a.run_dir);
    if verity == Some("userspace") {
        cmd.arg("--userspace-verity");
    }
    cmd.args(a.keys.to_args());
    // Its own process group: the initramfs's job control and the switch of root do
    // not reach it. Its messages go to a log beside its report (holding our stderr
    // would keep whoever reads it waiting for its end).
    let log_path = a.run_dir.join(format!("{}.log", p.name));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone().context("duplicate the log's descriptor")?)
        .stderr(log)
        .process_group(0);
    let mut child = cmd.spawn().context("start the serving daemon")?;
    match attach(
        a,
        p,
        signed,
        &store_path,
        &ready,
        &log_path,
        verity,
        &mut child,
    ) {
        Ok(b) => Ok((b, child)),
        Err(e) => {
            stop_daemon(&mut child);
            Err(e)
        }
    }
}

/// Waits for `child` to serve partition `p` and puts dm-verity over its device when
/// `verity` says the kernel checks it.
#[allow(clippy::too_many_arguments)]
fn attach(
    a: &BootArgs,
    p: &PartitionState,
    signed: Option<&bundle::VerityInfo>,
    store_path: &Path,
    ready: &Path,
    log_path: &Path,
    verity: Option<&'static str>,
    child: &mut std::process::Child,
) -> Result<Booted> {
    let t0 = Instant::now();
    let report = loop {
        if let Ok(text) = std::fs::read_to_string(ready) {
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("read the daemon's report {}", ready.display()))?;
            break v;
        }
        if let Some(st) = child.try_wait().context("wait for the serving daemon")? {
            let log = std::fs::read_to_string(log_path).unwrap_or_default();
            let last = log
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            bail!(
                "partition {}: the serving daemon exited ({st}) before serving: {last} (its \
                 log: {})",
                p.name,
                log_path.display()
            );
        }
        if t0.elapsed() > Duration::from_secs(a.timeout) {
            bail!(
                "partition {}: the serving daemon was not serving after {} s",
                p.name,
                a.timeout
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let dev = report["block_device"]
        .as_str()
        .map(PathBuf::from)
        .with_context(|| format!("partition {}: the daemon reported no block device", p.name))?;
    // The signed root hash: the tree in the store is checked against it, block by
    // block, as the kernel reads.
    let device = match (verity, signed) {
        (Some("kernel"), Some(v)) => {
            let name = format!("vabc-{}", p.name);
            let out = Command::new("veritysetup")
                .arg("open")
                .arg(&dev)
                .arg(&name)
                .arg(store_path.join(update::verity_name(&p.name)))
                .arg(&v.root_hash)
                .output()
                .context("run veritysetup")?;
            if !out.status.success() {
                bail!(
                    "partition {}: veritysetup open {} failed ({}): {}",
                    p.name,
                    dev.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            PathBuf::from("/dev/mapper").join(name)
        }
        _ => dev,
    };
    Ok(Booted {
        name: p.name.clone(),
        device,
        served: true,
        verity,
    })
}

/// A descriptor the process keeps open, as a path any later open reaches it by:
/// what was proven is what is served, whatever happens to the store's names since.
fn held(file: std::fs::File) -> PathBuf {
    use std::os::fd::IntoRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", file.into_raw_fd()))
}

/// The signed tree of a partition, proven: its superblock has the signed parameters
/// and its levels hash up to the signed root hash. Returns the checker of new-image
/// blocks the merge's scratch copies go through.
fn prove_tree(
    tree: &std::fs::File,
    tree_path: &Path,
    v: &bundle::VerityInfo,
) -> Result<merge::BlockCheck> {
    use std::os::unix::fs::FileExt;
    let (params, uuid) = super::bundle::verity_params(v)?;
    let mut sb = vec![0u8; verity::SUPERBLOCK_SIZE as usize];
    tree.read_exact_at(&mut sb, 0)
        .with_context(|| format!("{}: read the superblock", tree_path.display()))?;
    let found = verity::Superblock::decode(&sb, tree_path, 0)?;
    if found.params != params || found.uuid != uuid {
        mismatch!(
            "{}: the tree's superblock is not the signed one (parameters or UUID differ)",
            tree_path.display()
        );
    }
    let root = hex::decode(&v.root_hash).context("the signed root hash is not hex")?;
    let len = tree
        .metadata()
        .with_context(|| format!("stat {}", tree_path.display()))?
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
    .map_err(|e| anyhow::Error::new(crate::checks::Mismatch(e.to_string())))?;
    let file = tree
        .try_clone()
        .with_context(|| format!("duplicate {}", tree_path.display()))?;
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

fn daemon(a: DaemonArgs) -> Result<ExitCode> {
    let store = Store::open(&a.store)?;
    let state = store.load()?;
    let Some(update) = state.update().cloned() else {
        bail!("{}: no update to serve", a.store.display());
    };
    let Some(p) = update.partitions.iter().find(|p| p.name == a.partition) else {
        bail!(
            "{}: the update has no partition {}",
            a.store.display(),
            a.partition
        );
    };
    // Everything below is proven against the signed manifest before it is served,
    // and served from the descriptors that were proven.
    let m = signed_manifest(&store, &update, &a.keys)?;
    let Some(sp) = m.partition(&p.name) else {
        bail!("partition {}: not in the signed manifest", p.name);
    };
    let cow_path = store.path().join(&p.cow);
    let cow_file = store.open_file(&p.cow)?;
    let t = Instant::now();
    let (size, sha) = sealed_sha256(&cow_file, &cow_path)?;
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
        .with_context(|| format!("open the base {}", p.base.display()))?;
    if base_size != sp.partition_bytes() {
        mismatch!(
            "the base {} is {base_size} bytes, partition {} of the signed update is {}",
            p.base.display(),
            p.name,
            sp.partition_bytes()
        );
    }
    let t = Instant::now();
    let (tree_check, tree_path) = match &sp.verity {
        Some(v) => {
            let name = update::verity_name(&p.name);
            let tree_path = store.path().join(&name);
            let tree = store.open_file(&name)?;
            let check = prove_tree(&tree, &tree_path, v)?;
            (Some(check), Some((held(tree), v.root_hash.clone())))
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
    let sidecar_path = store.path().join(format!("{}.manifest", p.cow));
    let sidecar = manifest::Manifest::parse(
        &String::from_utf8_lossy(&store.read_file(&format!("{}.manifest", p.cow), 64 << 20)?),
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
    let trusted_path = a.run_dir.join(format!("{}.manifest", p.name));
    crate::output::write_atomic(&trusted_path, trusted.to_json().as_bytes())?;

    let mut argv: Vec<std::ffi::OsString> = vec!["serve".into(), "--base".into()];
    argv.push(p.base.clone().into());
    argv.push("--cow".into());
    argv.push(held(cow_file).into());
    argv.push("--manifest".into());
    argv.push(trusted_path.into());
    argv.push("--ready-file".into());
    argv.push(a.run_dir.join(format!("{}.ready", p.name)).into());
    match a.frontend {
        Frontend::Ublk => argv.push("--ublk".into()),
        Frontend::Fuse => {
            let dir = a.run_dir.join(format!("{}.fuse", p.name));
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            argv.extend(["--fuse".into(), dir.into(), "--loop".into()]);
        }
    }
    if let (true, Some((tree, root))) = (a.userspace_verity, tree_path) {
        argv.push("--verity-hash".into());
        argv.push(tree.into());
        argv.push("--root-hash".into());
        argv.push(root.into());
    }
    if matches!(state, State::Merging { .. }) {
        argv.push("--merge".into());
    }
    #[derive(clap::Parser)]
    struct ServeCli {
        #[command(flatten)]
        args: super::serve::Args,
    }
    let args = <ServeCli as clap::Parser>::try_parse_from(argv)
        .context("the daemon's serve options")?
        .args;
    let mut polled = Instant::now() - Duration::from_secs(1);
    let watch = Store::open(&a.store)?;
    let version = m.release.version;
    let trigger = super::serve::MergeTrigger {
        // The store through its descriptor: it is reached after a switch of root.
        start: Box::new(move || {
            if polled.elapsed() < Duration::from_secs(1) {
                return false;
            }
            polled = Instant::now();
            matches!(watch.load(), Ok(State::Merging { .. }))
        }),
        done: Box::new(move || merge_done(&store, version)),
        scratch_check: tree_check,
    };
    super::serve::run_with(args, Some(trigger))
}

/// After one partition's merge: once every partition of the update is merged, the
/// state becomes merged.
fn merge_done(store: &Store, version: u64) -> Result<()> {
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

fn merge_progress(store: &Store, p: &PartitionState) -> Result<merge::progress::Progress> {
    let file = store.open_file(&p.cow)?;
    let cow = cow::CowReader::from_file(
        file,
        &store.path().join(&p.cow),
        cow::OpenOptions::default(),
    )?;
    Ok(merge::progress::read(&cow)?)
}

fn mark_good(m: MarkGoodArgs) -> Result<ExitCode> {
    let a = m.store;
    let store = Store::open(&a.store)?;
    let state = store.load()?;
    let next = state.mark_good().map_err(|msg| store.refused(msg))?;
    // The merge writes the base in place: what it merges must still be what was
    // signed (the daemon proves the COW and its tree again before it merges).
    if let Some(u) = state.update() {
        signed_manifest(&store, u, &m.keys)
            .context("nothing was changed; the update keeps running until it is rolled back")?;
    }
    // Only the new system may say it works: a boot that fell back to the base (the
    // update failed to start) runs the old one.
    let record = m.run_dir.join("booted.json");
    let booted: Option<serde_json::Value> = std::fs::read_to_string(&record)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let runs_update = booted.as_ref().is_some_and(|b| {
        b["snapshot"] == true && b["update_id"].as_str() == state.update().map(|u| u.id.as_str())
    });
    if !runs_update {
        return Err(store
            .refused(format!(
                "this boot does not run the update ({} says {}): {}; nothing was changed",
                record.display(),
                match &booted {
                    Some(b) if b["snapshot"] == false => "the base was booted".to_string(),
                    Some(_) => "another update".to_string(),
                    None => "nothing".to_string(),
                },
                match &booted {
                    // No record where this command looked: the boot may have written it
                    // elsewhere.
                    None => format!(
                        "if `vabc update boot` ran with another --run-dir than {}, give \
                         that one here; else reboot to try the update again, or roll it back",
                        m.run_dir.display()
                    ),
                    Some(_) => "reboot to try the update again, or roll it back".to_string(),
                }
            ))
            .into());
    }
    store.save(&next)?;
    if a.json {
        print_json(&serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "store": a.store,
            "state": next.name(),
        }))?;
    } else {
        println!(
            "{}: marked good; the serving daemon merges the update (or the next boot does); \
             `vabc update status` shows the progress",
            a.store.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn rollback(a: StoreArgs) -> Result<ExitCode> {
    let store = Store::open(&a.store)?;
    let state = store.load()?;
    let next = state.roll_back().map_err(|msg| store.refused(msg))?;
    store.save(&next)?;
    if let Some(u) = state.update() {
        store.remove_update_files(u)?;
        // What an interrupted install left: the COW it was writing, its saved download.
        for p in &u.partitions {
            super::bundle::remove_stale(&a.store, &p.name, None)?;
        }
    }
    let was = state.name();
    if a.json {
        print_json(&serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "store": a.store,
            "state": next.name(),
            "rolled_back_from": was,
        }))?;
    } else {
        println!(
            "{}: the {was} update is rolled back; the old system runs{}",
            a.store.display(),
            if matches!(state, State::Installed { .. }) {
                " from the next boot"
            } else {
                ""
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn status(a: StoreArgs) -> Result<ExitCode> {
    let store = Store::open(&a.store)?;
    let state = store.load()?;
    let mut parts = Vec::new();
    if let Some(u) = state.update() {
        for p in &u.partitions {
            let present = store.exists(&p.cow)?;
            // A damaged COW is reported, not a reason to fail: status is how one
            // finds out.
            let (merge, damage) = match present.then(|| merge_progress(&store, p)) {
                Some(Ok(m)) => (Some(m), None),
                Some(Err(e)) => (None, Some(format!("{e:#}"))),
                None => (None, None),
            };
            parts.push(serde_json::json!({
                "name": p.name,
                "base": p.base,
                "cow": p.cow,
                "cow_present": present,
                "cow_error": damage,
                "merge": merge.map(|m| match m {
                    merge::progress::Progress::NotStarted => serde_json::json!({"merged": 0, "done": false}),
                    merge::progress::Progress::InProgress { merged, total } => serde_json::json!({"merged": merged, "total": total, "done": false}),
                    merge::progress::Progress::Complete { total } => serde_json::json!({"merged": total, "total": total, "done": true}),
                }),
                "merge_text": merge.map(|m| m.to_string()),
                "root_hash": p.verity.as_ref().map(|v| v.root_hash.clone()),
            }));
        }
    }
    if a.json {
        print_json(&serde_json::json!({
            "schema_version": crate::SCHEMA_VERSION,
            "store": a.store,
            "state": state.name(),
            "update_id": state.update().map(|u| u.id.clone()),
            "boot_attempts": match &state { State::Installed { boot_attempts, .. } => Some(*boot_attempts), _ => None },
            "max_boot_attempts": state.update().map(|u| u.max_boot_attempts),
            "partitions": parts,
        }))?;
    } else {
        print!("{}: {}", a.store.display(), state.name());
        if let State::Installed {
            update,
            boot_attempts,
        } = &state
        {
            print!(
                " ({boot_attempts} of {} boots used before mark-good)",
                update.max_boot_attempts
            );
        }
        println!();
        for p in &parts {
            println!(
                "  {}: base {}, merge {}",
                p["name"].as_str().unwrap_or_default(),
                p["base"].as_str().unwrap_or_default(),
                match (p["merge_text"].as_str(), p["cow_error"].as_str()) {
                    (Some(m), _) => m.to_string(),
                    (None, Some(e)) => format!("unknown: the COW is damaged: {e}"),
                    (None, None) => "(no COW)".to_string(),
                }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
