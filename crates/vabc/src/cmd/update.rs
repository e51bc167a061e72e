//! `vabc update`: vabc as a device updater. An update bundle is installed into a store
//! (a folder on a data partition) while the old system runs; the initramfs asks `boot`
//! what to mount as root (the base, or base + COW served by a daemon, dm-verity on
//! top); the new system says `mark-good`, and the serving daemon merges; `rollback`
//! drops an update until its merge starts. The state machine is in the `update`
//! crate; docs/08-device-updates.md tells the whole story.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use update::{BootAction, PartitionState, State, Store, Update};

use crate::checks::mismatch;
use crate::report;
use ota::device::Keyring;

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
    fn load(&self) -> Keyring {
        Keyring::from_files(&self.keys, &self.keyring, self.allow_unsigned)
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

/// `vabc update init --json` and `vabc update mark-good --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct StoreReport<'a> {
    store: &'a Path,
    state: &'static str,
}

fn init(a: StoreArgs) -> Result<ExitCode> {
    Store::init(&a.store)?;
    if a.json {
        report::print(StoreReport {
            store: &a.store,
            state: "none",
        })?;
    } else {
        println!("{}: update store made (state none)", a.store.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `vabc update install --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct InstallReport<'a> {
    store: &'a Path,
    #[serde(flatten)]
    done: &'a ota::device::DeviceInstall,
}

fn install(a: InstallArgs) -> Result<ExitCode> {
    let keys = a.keys.load();
    let opts = ota::device::InstallOptions {
        allow_downgrade: a.allow_downgrade,
        version_file: a.version_file.clone(),
        max_boot_attempts: a.max_boot_attempts,
        threads: a.threads,
    };
    let bases = super::bundle::named_bases(&a.bases)?;
    let done = ota::device::install(
        &a.store.store,
        &a.bundle,
        &bases,
        &keys,
        &opts,
        &crate::progress::Bar::new(),
    )?;
    if a.store.json {
        report::print(InstallReport {
            store: &a.store.store,
            done: &done,
        })?;
    } else {
        for d in &done.partitions {
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
            done.update.max_boot_attempts
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// One partition's device, as `boot` prints it.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct Booted {
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
        let record = ota::device::Booted {
            update_id: next.update().map(|u| u.id.clone()),
            snapshot,
        };
        let written = serde_json::to_string_pretty(&record)
            .map_err(anyhow::Error::from)
            .and_then(|text| {
                ota::output::write_atomic(
                    &ota::device::Booted::path(&a.run_dir),
                    format!("{text}\n").as_bytes(),
                )
                .map_err(anyhow::Error::from)
            });
        if let (Err(e), true) = (written, snapshot) {
            return Err(e);
        }
    }
    if let Some(n) = &note {
        eprintln!("vabc update boot: {n}");
    }
    if a.store.json {
        report::print(BootReport {
            state: next.name(),
            boot_attempts: match &next {
                State::Installed { boot_attempts, .. } => Some(*boot_attempts),
                _ => None,
            },
            note: &note,
            partitions: &devices,
        })?;
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
    let m = ota::device::signed_manifest(store, u, &a.keys.load())?;
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

fn daemon(a: DaemonArgs) -> Result<ExitCode> {
    let store = Store::open(&a.store)?;
    // Everything below is proven against the signed manifest before it is served,
    // and served from the descriptors that were proven.
    let proven = ota::device::prove_partition(&store, &a.keys.load(), &a.partition)?;
    let (p, m, trusted) = (&proven.partition, &proven.manifest, &proven.trusted);
    let tree_check = proven.tree_check.clone();
    let cow_file = proven.cow;
    let tree_path = proven.tree.map(|(tree, root)| (held(tree), root));
    let trusted_path = a.run_dir.join(format!("{}.manifest", p.name));
    ota::output::write_atomic(&trusted_path, trusted.to_json().as_bytes())?;

    let mut req = ota::serving::ServeRequest::new(p.base.clone(), held(cow_file));
    req.manifest = Some(trusted_path);
    match a.frontend {
        Frontend::Ublk => req.ublk = true,
        Frontend::Fuse => {
            let dir = a.run_dir.join(format!("{}.fuse", p.name));
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            req.fuse = Some(dir);
            req.loop_dev = true;
        }
    }
    if let (true, Some((tree, root))) = (a.userspace_verity, tree_path) {
        req.verity = Some(ota::serving::VerityRequest {
            hashfile: tree,
            root_hash: root,
            tree: ota::trees::TreeOptions::default(),
        });
    }
    req.merge = proven.merging;
    let run = super::serve::Run {
        req,
        ready_file: Some(a.run_dir.join(format!("{}.ready", p.name))),
        stats: false,
        queue_delays: None,
        trace: None,
    };
    let mut polled = Instant::now() - Duration::from_secs(1);
    let watch = Store::open(&a.store)?;
    let version = m.release.version;
    let trigger = ota::serving::MergeTrigger {
        // The store through its descriptor: it is reached after a switch of root.
        start: Box::new(move || {
            if polled.elapsed() < Duration::from_secs(1) {
                return false;
            }
            polled = Instant::now();
            matches!(watch.load(), Ok(State::Merging { .. }))
        }),
        done: Box::new(move || ota::device::merge_done(&store, version)),
        scratch_check: tree_check,
    };
    super::serve::run_with(run, Some(trigger))
}

fn mark_good(m: MarkGoodArgs) -> Result<ExitCode> {
    let a = m.store;
    let state = ota::device::mark_good(&a.store, &m.run_dir, &m.keys.load())?;
    if a.json {
        report::print(StoreReport {
            store: &a.store,
            state,
        })?;
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
    let done = ota::device::rollback(&a.store)?;
    if a.json {
        report::print(RollbackReport {
            store: &a.store,
            state: done.state,
            rolled_back_from: done.rolled_back_from,
        })?;
    } else {
        println!(
            "{}: the {} update is rolled back; the old system runs{}",
            a.store.display(),
            done.rolled_back_from,
            if done.from_next_boot {
                " from the next boot"
            } else {
                ""
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn status(a: StoreArgs) -> Result<ExitCode> {
    let st = ota::device::status(&a.store)?;
    if a.json {
        report::print(StatusReport {
            store: &a.store,
            status: &st,
        })?;
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}: {}", a.store.display(), st.state);
    if let (Some(used), Some(max)) = (st.boot_attempts, st.max_boot_attempts) {
        print!(" ({used} of {max} boots used before mark-good)");
    }
    println!();
    for p in &st.partitions {
        println!(
            "  {}: base {}, merge {}",
            p.name,
            p.base.display(),
            match (&p.merge_text, &p.cow_error) {
                (Some(m), _) => m.to_string(),
                (None, Some(e)) => format!("unknown: the COW is damaged: {e}"),
                (None, None) => "(no COW)".to_string(),
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `vabc update boot --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct BootReport<'a> {
    state: &'static str,
    boot_attempts: Option<u32>,
    note: &'a Option<String>,
    partitions: &'a [Booted],
}

/// `vabc update rollback --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct RollbackReport<'a> {
    store: &'a Path,
    state: &'static str,
    rolled_back_from: &'static str,
}

/// `vabc update status --json`.
#[derive(Serialize, schemars::JsonSchema)]
pub(crate) struct StatusReport<'a> {
    store: &'a Path,
    #[serde(flatten)]
    status: &'a ota::device::Status,
}
