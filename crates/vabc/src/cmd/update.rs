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
use serde::Serialize;
use sha2::{Digest, Sha256};
use update::{BootAction, PartitionState, State, Store, Update, VerityRef};

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
}

#[derive(clap::Args)]
struct InstallArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The bundle: a file, `-` for stdin, or an http(s):// URL.
    bundle: PathBuf,
    /// Each partition's base device (or image): NAME=PATH, once per partition.
    #[arg(short = 'b', long = "base", value_name = "NAME=PATH", required = true)]
    bases: Vec<String>,
    #[command(flatten)]
    key: super::bundle::KeyArgs,
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
    #[arg(short = 'b', long = "base", value_name = "NAME=PATH")]
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

/// The update a bundle makes, its partitions on `bases`.
fn update_of(m: &bundle::BundleManifest, bases: &[PathBuf], max_boot_attempts: u32) -> Update {
    let id = hex::encode(Sha256::digest(serde_json::to_vec(m).unwrap_or_default()));
    Update {
        id,
        max_boot_attempts,
        partitions: m
            .partitions
            .iter()
            .zip(bases)
            .map(|(p, base)| PartitionState {
                name: p.name.clone(),
                base: base.clone(),
                cow: format!("{}.cow", p.name),
                verity: p.verity.as_ref().map(|v| VerityRef {
                    file: format!("{}.verity", p.name),
                    root_hash: v.root_hash.clone(),
                }),
                new_size: p.image.new.size,
                new_sha256: p.image.new.sha256.clone(),
            })
            .collect(),
    }
}

fn install(a: InstallArgs) -> Result<ExitCode> {
    let store = Store::open(&a.store.store)?;
    let before = store.load()?;
    let key = a.key.load()?;
    let mut begun: Option<Update> = None;
    let result = super::bundle::install_into(
        &a.bundle,
        &a.bases,
        &a.store.store,
        &key,
        a.threads,
        &mut |m, bases| {
            let u = update_of(m, bases, a.max_boot_attempts);
            let next = before
                .begin_install(&u)
                .map_err(|msg| store.refused(format!("{msg}; nothing was changed")))?;
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
    let u = installed.update().cloned();
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
            a.max_boot_attempts
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
    let base_devices = |u: Option<&Update>| -> Result<Vec<Booted>> {
        match u {
            Some(u) => Ok(u
                .partitions
                .iter()
                .map(|p| Booted {
                    name: p.name.clone(),
                    device: p.base.clone(),
                    served: false,
                    verity: None,
                })
                .collect()),
            None => bases_of(&a.bases),
        }
    };
    let (devices, note) = match (action, update) {
        (BootAction::Base, _) => (base_devices(update)?, None),
        (BootAction::RollBack, Some(u)) => {
            store.remove_update_files(u)?;
            (
                base_devices(update)?,
                Some(format!(
                    "the update failed to be marked good in {} boots: rolled back",
                    u.max_boot_attempts
                )),
            )
        }
        (BootAction::CleanUp, Some(u)) => {
            store.remove_update_files(u)?;
            (
                base_devices(update)?,
                Some("the merged update's COWs removed".into()),
            )
        }
        (BootAction::Snapshot { .. }, Some(u)) => {
            std::fs::create_dir_all(&a.run_dir)
                .with_context(|| format!("create {}", a.run_dir.display()))?;
            let mut v = Vec::new();
            let mut daemons = Vec::new();
            for p in &u.partitions {
                match serve_partition(&a, &store, p) {
                    Ok((b, child)) => {
                        v.push(b);
                        daemons.push(child);
                    }
                    Err(e) => {
                        // Nothing of the update may run when the base is booted
                        // instead: a daemon left serving could merge under it.
                        for mut d in daemons {
                            stop_daemon(&mut d);
                        }
                        return Err(e);
                    }
                }
            }
            (v, None)
        }
        (_, None) => (base_devices(None)?, None),
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
) -> Result<(Booted, std::process::Child)> {
    let verity = match (&p.verity, a.verity) {
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
    match attach(a, p, &store_path, &ready, &log_path, verity, &mut child) {
        Ok(b) => Ok((b, child)),
        Err(e) => {
            stop_daemon(&mut child);
            Err(e)
        }
    }
}

/// Waits for `child` to serve partition `p` and puts dm-verity over its device when
/// `verity` says the kernel checks it.
fn attach(
    a: &BootArgs,
    p: &PartitionState,
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
    let device = match (verity, &p.verity) {
        (Some("kernel"), Some(v)) => {
            let name = format!("vabc-{}", p.name);
            let out = Command::new("veritysetup")
                .arg("open")
                .arg(&dev)
                .arg(&name)
                .arg(store_path.join(&v.file))
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
    let mut argv: Vec<std::ffi::OsString> = vec!["serve".into(), "--base".into()];
    argv.push(p.base.clone().into());
    argv.push("--cow".into());
    argv.push(a.store.join(&p.cow).into());
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
    if let (true, Some(v)) = (a.userspace_verity, &p.verity) {
        argv.push("--verity-hash".into());
        argv.push(a.store.join(&v.file).into());
        argv.push("--root-hash".into());
        argv.push(v.root_hash.clone().into());
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
    let trigger = super::serve::MergeTrigger {
        // The store through its descriptor: it is reached after a switch of root.
        start: Box::new(move || {
            if polled.elapsed() < Duration::from_secs(1) {
                return false;
            }
            polled = Instant::now();
            matches!(watch.load(), Ok(State::Merging { .. }))
        }),
        done: Box::new(move || merge_done(&store)),
    };
    super::serve::run_with(args, Some(trigger))
}

/// After one partition's merge: once every partition of the update is merged, the
/// state becomes merged.
fn merge_done(store: &Store) -> Result<()> {
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
                "this boot does not run the update ({} says {}): reboot to try it again, or \
                 roll it back; nothing was changed",
                record.display(),
                match &booted {
                    Some(b) if b["snapshot"] == false => "the base was booted".to_string(),
                    Some(_) => "another update".to_string(),
                    None => "nothing".to_string(),
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
