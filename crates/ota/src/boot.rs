//! The boot step (an initramfs runs it before it mounts a root): what the update's
//! state says this boot runs, made durable before it is acted on, and, when that is the
//! update, each partition served from base + COW by a daemon, with the kernel's
//! dm-verity or the daemon itself checking every block against the signed root hash.
//!
//! A half-merged base that cannot be served is [`Error::HalfMerged`]: no root may be
//! mounted at all. An update that cannot be served before its merge began boots the
//! base (the old system), and the attempt counts.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use update::{BootAction, PartitionState, State, Store, Update};

use crate::device::Keyring;
use crate::error::{Context, Error, Result, invalid, mismatch};

/// How a served partition reaches the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frontend {
    /// A ublk block device.
    Ublk,
    /// A FUSE file under a loop device.
    Fuse,
}

impl Frontend {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Frontend::Ublk => "ublk",
            Frontend::Fuse => "fuse",
        }
    }
}

/// Who checks served blocks against the signed root hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerityMode {
    /// The kernel where device-mapper and veritysetup are there, else the daemon.
    Auto,
    /// The kernel's dm-verity over the served device (veritysetup open).
    Kernel,
    /// The serving daemon checks every block it serves.
    Userspace,
}

/// How this boot serves an update.
#[derive(Debug, Clone)]
pub struct BootOptions {
    /// The bases this boot's own configuration names (NAME, device): where given,
    /// they are what runs, and a state that names another device is refused.
    pub bases: Vec<(String, PathBuf)>,
    /// How a served partition reaches the kernel.
    pub frontend: Frontend,
    /// Who checks served blocks.
    pub verity: VerityMode,
    /// Where the daemons' ready reports, logs (NAME.log) and FUSE folders go; it must
    /// stay reachable from the real root (a tmpfs moved along with it, as /run is).
    pub run_dir: PathBuf,
    /// How long to wait for a daemon to be serving.
    pub timeout: Duration,
}

/// The serving daemon of one partition, for the caller to make into a command.
#[derive(Debug, Clone)]
pub struct DaemonSpec<'a> {
    /// The store (absolute).
    pub store: &'a Path,
    /// The partition it serves.
    pub partition: &'a str,
    /// How it reaches the kernel.
    pub frontend: Frontend,
    /// The run folder.
    pub run_dir: &'a Path,
    /// Whether it checks every block it serves.
    pub userspace_verity: bool,
}

/// One partition's device, as the boot step reports it.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct BootDevice {
    /// The partition.
    pub name: String,
    /// The device to mount.
    pub device: PathBuf,
    /// Served from base + COW (else the base itself).
    pub served: bool,
    /// Who checks blocks against the root hash: "kernel", "userspace" or none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verity: Option<&'static str>,
}

/// What a boot decided.
#[derive(Debug, Clone)]
pub struct BootOutcome {
    /// The state after the decision.
    pub state: State,
    /// What to mount, one device per partition.
    pub devices: Vec<BootDevice>,
    /// Why this boot runs the base, when an update was there (a rollback, a failure
    /// to serve it), or what it cleaned.
    pub note: Option<String>,
}

/// Decides what this boot runs, records it (`run_dir`'s `booted.json`, for
/// mark-good), and serves the update when that is it. `daemon` makes the command that
/// runs one partition's serving daemon (`vabc update daemon ...`, say).
pub fn boot(
    store_path: &Path,
    keys: &Keyring,
    opts: &BootOptions,
    daemon: &dyn Fn(&DaemonSpec) -> Result<Command>,
) -> Result<BootOutcome> {
    let store = Store::open(store_path)?;
    let state = store.load_and_repair()?;
    let (action, next) = state.on_boot();
    let update = state.update();
    let bases = |u: Option<&Update>| base_devices(&opts.bases, u);
    // The decision is durable before it is acted on: a power cut during this boot
    // counts its attempt. Each decision that must be saved (an attempt counted, a
    // roll-back, the clean-up after a merge) is one whose bases hold a whole system
    // (untouched, or merged), so when it cannot be saved (a full data partition)
    // this boot runs the bases and decides again next time: a device never stops
    // booting over a record it could not write.
    if next != state
        && let Err(e) = store.save(&next)
    {
        let devices = bases(update);
        record_booted(opts, &state, &devices)?;
        return Ok(BootOutcome {
            note: Some(format!(
                "the update's next step could not be recorded ({}); booting the bases as they \
                 are ({} image); the next boot decides again",
                crate::error::chain(&e),
                if matches!(state, State::Merged { .. }) {
                    "the new, merged"
                } else {
                    "the old, untouched"
                },
            )),
            state,
            devices,
        });
    }
    let (devices, note) = match (action, update) {
        (BootAction::Base, _) => (bases(update), None),
        (BootAction::RollBack, Some(u)) => {
            store.remove_update_files(u)?;
            (
                bases(update),
                Some(format!(
                    "the update failed to be marked good in {} boots: rolled back",
                    u.max_boot_attempts
                )),
            )
        }
        (BootAction::CleanUp, Some(u)) => {
            store.remove_update_files(u)?;
            (
                bases(update),
                Some("the merged update's COWs removed".into()),
            )
        }
        (BootAction::Snapshot { merge }, Some(u)) => {
            match serve_update(opts, &store, keys, u, daemon) {
                Ok(v) => (v, None),
                // The merge has overwritten part of the base: neither the old system
                // nor the new one is there, so nothing may be mounted from it.
                Err(e) if merge => {
                    return Err(Error::HalfMerged {
                        msg: format!(
                            "{}: the merge is under way (part of the base is already the new \
                             image) and the update cannot be served: no root to mount",
                            store.path().display()
                        ),
                        source: Box::new(e),
                    });
                }
                // The base is untouched: the old system boots, this attempt counted.
                Err(e) => (
                    bases(update),
                    Some(format!(
                        "the update cannot be served ({}); booting the base (the old system); \
                         this was boot attempt {} of {}",
                        crate::error::chain(&e),
                        match &next {
                            State::Installed { boot_attempts, .. } => *boot_attempts,
                            _ => 0,
                        },
                        u.max_boot_attempts
                    )),
                ),
            }
        }
        (_, None) => (bases(None), None),
    };
    record_booted(opts, &next, &devices)?;
    Ok(BootOutcome {
        state: next,
        devices,
        note,
    })
}

/// The bases to run: the partitions the update names, on the devices this boot's
/// configuration pins where it does; without an update, the pinned ones.
fn base_devices(pinned: &[(String, PathBuf)], u: Option<&Update>) -> Vec<BootDevice> {
    let device = |name: &str, path: PathBuf| BootDevice {
        name: name.to_string(),
        device: path,
        served: false,
        verity: None,
    };
    match u {
        Some(u) => u
            .partitions
            .iter()
            .map(|p| {
                let pin = pinned.iter().find(|(n, _)| *n == p.name);
                device(
                    &p.name,
                    pin.map_or_else(|| p.base.clone(), |(_, d)| d.clone()),
                )
            })
            .collect(),
        None => pinned.iter().map(|(n, d)| device(n, d.clone())).collect(),
    }
}

/// What this boot runs, for mark-good (the run folder is a tmpfs: gone at the next
/// boot). Best effort when nothing is served: a missing record refuses mark-good.
fn record_booted(opts: &BootOptions, next: &State, devices: &[BootDevice]) -> Result<()> {
    let snapshot = devices.iter().any(|d| d.served);
    if std::fs::create_dir_all(&opts.run_dir).is_err() {
        return Ok(());
    }
    let record = crate::device::Booted {
        update_id: next.update().map(|u| u.id.clone()),
        snapshot,
    };
    let written = serde_json::to_string_pretty(&record)
        .map_err(Error::from)
        .and_then(|text| {
            crate::output::write_atomic(
                &crate::device::Booted::path(&opts.run_dir),
                format!("{text}\n").as_bytes(),
            )
        });
    match (written, snapshot) {
        (Err(e), true) => Err(e),
        _ => Ok(()),
    }
}

/// Serves every partition of `u` (none if one fails: its daemons are stopped), after
/// checking the stored signature and the bases against this boot's configuration.
fn serve_update(
    opts: &BootOptions,
    store: &Store,
    keys: &Keyring,
    u: &Update,
    daemon: &dyn Fn(&DaemonSpec) -> Result<Command>,
) -> Result<Vec<BootDevice>> {
    let m = crate::device::signed_manifest(store, u, keys)?;
    for p in &u.partitions {
        if let Some((_, device)) = opts.bases.iter().find(|(n, _)| *n == p.name) {
            let same = match (
                std::fs::canonicalize(device),
                std::fs::canonicalize(&p.base),
            ) {
                (Ok(x), Ok(y)) => x == y,
                _ => *device == p.base,
            };
            if !same {
                mismatch!(
                    "partition {}: the state says its base is {}, this boot's configuration \
                     says {}: the store was altered (or the device's layout changed)",
                    p.name,
                    p.base.display(),
                    device.display()
                );
            }
        }
    }
    std::fs::create_dir_all(&opts.run_dir).map_err(|e| Error::io("create", &opts.run_dir, e))?;
    let mut v = Vec::new();
    let mut daemons = Vec::new();
    for p in &u.partitions {
        let signed = m.partition(&p.name).and_then(|s| s.verity.as_ref());
        match serve_partition(opts, store, p, signed, daemon) {
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

/// Stops a daemon the boot started (SIGTERM: it takes its device down) and waits.
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
    opts: &BootOptions,
    store: &Store,
    p: &PartitionState,
    signed: Option<&bundle::VerityInfo>,
    daemon: &dyn Fn(&DaemonSpec) -> Result<Command>,
) -> Result<(BootDevice, std::process::Child)> {
    let verity = match (signed, opts.verity) {
        (None, _) => None,
        (Some(_), VerityMode::Kernel) => Some("kernel"),
        (Some(_), VerityMode::Userspace) => Some("userspace"),
        (Some(_), VerityMode::Auto) => Some(match kernel_verity_available() {
            true => "kernel",
            false => "userspace",
        }),
    };
    let ready = opts.run_dir.join(format!("{}.ready", p.name));
    let _ = std::fs::remove_file(&ready);
    let store_path =
        std::fs::canonicalize(store.path()).map_err(|e| Error::io("resolve", store.path(), e))?;
    let mut cmd = daemon(&DaemonSpec {
        store: &store_path,
        partition: &p.name,
        frontend: opts.frontend,
        run_dir: &opts.run_dir,
        userspace_verity: verity == Some("userspace"),
    })?;
    // Its own process group: the initramfs's job control and the switch of root do
    // not reach it. Its messages go to a log beside its report (holding our stderr
    // would keep whoever reads it waiting for its end).
    let log_path = opts.run_dir.join(format!("{}.log", p.name));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| Error::io("open", &log_path, e))?;
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(
            log.try_clone()
                .map_err(|e| Error::io("duplicate the descriptor of", &log_path, e))?,
        )
        .stderr(log)
        .process_group(0);
    let mut child = cmd.spawn().context("start the serving daemon")?;
    let daemon = Daemon {
        partition: p,
        ready: &ready,
        log: &log_path,
        timeout: opts.timeout,
    };
    let attached = daemon
        .wait_serving(&mut child)
        .and_then(|dev| put_verity(p, signed, &store_path, verity, dev));
    match attached {
        Ok(device) => Ok((
            BootDevice {
                name: p.name.clone(),
                device,
                served: true,
                verity,
            },
            child,
        )),
        Err(e) => {
            stop_daemon(&mut child);
            Err(e)
        }
    }
}

/// A started daemon: where it reports and logs.
struct Daemon<'a> {
    partition: &'a PartitionState,
    ready: &'a Path,
    log: &'a Path,
    timeout: Duration,
}

impl Daemon<'_> {
    /// Waits for `child`'s ready report; returns its block device.
    fn wait_serving(&self, child: &mut std::process::Child) -> Result<PathBuf> {
        let name = &self.partition.name;
        let t0 = Instant::now();
        let report = loop {
            if let Ok(text) = std::fs::read_to_string(self.ready) {
                let v: serde_json::Value = serde_json::from_str(&text).with_context(|| {
                    format!("read the daemon's report {}", self.ready.display())
                })?;
                break v;
            }
            if let Some(st) = child.try_wait().context("wait for the serving daemon")? {
                let log = std::fs::read_to_string(self.log).unwrap_or_default();
                let last = log
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                invalid!(
                    "partition {name}: the serving daemon exited ({st}) before serving: \
                     {last} (its log: {})",
                    self.log.display()
                );
            }
            if t0.elapsed() > self.timeout {
                invalid!(
                    "partition {name}: the serving daemon was not serving after {} s",
                    self.timeout.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        match report["block_device"].as_str() {
            Some(d) => Ok(PathBuf::from(d)),
            None => invalid!("partition {name}: the daemon reported no block device"),
        }
    }
}

/// The kernel's dm-verity over `dev` when `verity` says the kernel checks it, with
/// the signed root hash: the tree in the store is checked against it, block by block,
/// as the kernel reads. Returns the device to mount.
fn put_verity(
    p: &PartitionState,
    signed: Option<&bundle::VerityInfo>,
    store_path: &Path,
    verity: Option<&'static str>,
    dev: PathBuf,
) -> Result<PathBuf> {
    let (Some("kernel"), Some(v)) = (verity, signed) else {
        return Ok(dev);
    };
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
        invalid!(
            "partition {}: veritysetup open {} failed ({}): {}",
            p.name,
            dev.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(PathBuf::from("/dev/mapper").join(name))
}
