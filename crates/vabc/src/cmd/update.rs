//! `vabc update`: vabc as a device updater. An update bundle is installed into a store
//! (a folder on a data partition) while the old system runs; the initramfs asks `boot`
//! what to mount as root (the base, or base + COW served by a daemon, dm-verity on
//! top); the new system says `mark-good`, and the serving daemon merges; `rollback`
//! drops an update until its merge starts. The state machine is in the `update`
//! crate; docs/08-device-updates.md tells the whole story.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use update::{State, Store};

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
    /// Follow the merge the serving daemons run until it is done, its progress on
    /// stdout and to systemd (sd_notify STATUS=); at once when no merge is under way.
    WaitMerge(WaitMergeArgs),
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
    /// Succeed without marking anything when there is nothing to mark: the update is
    /// not installed, or this boot runs the base (for a unit that runs every boot).
    #[arg(long)]
    if_pending: bool,
}

#[derive(clap::Args)]
struct WaitMergeArgs {
    /// The update store.
    #[arg(long, value_name = "DIR")]
    store: PathBuf,
    /// Fail when the merge has not moved for this many seconds (its daemon gone: the
    /// next boot resumes it).
    #[arg(long, default_value_t = 600, value_name = "SECS")]
    stall_timeout: u64,
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
        Sub::WaitMerge(a) => wait_merge(a),
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

fn bases_of(specs: &[String]) -> Result<Vec<(String, PathBuf)>> {
    specs
        .iter()
        .map(|s| {
            let (name, path) = s
                .split_once('=')
                .with_context(|| format!("--base {s:?}: expected NAME=PATH"))?;
            Ok((name.to_string(), PathBuf::from(path)))
        })
        .collect()
}

fn boot(a: BootArgs) -> Result<ExitCode> {
    let opts = ota::boot::BootOptions {
        bases: bases_of(&a.bases)?,
        frontend: match a.frontend {
            Frontend::Ublk => ota::boot::Frontend::Ublk,
            Frontend::Fuse => ota::boot::Frontend::Fuse,
        },
        verity: match a.verity {
            VerityMode::Auto => ota::boot::VerityMode::Auto,
            VerityMode::Kernel => ota::boot::VerityMode::Kernel,
            VerityMode::Userspace => ota::boot::VerityMode::Userspace,
        },
        run_dir: a.run_dir.clone(),
        timeout: Duration::from_secs(a.timeout),
    };
    // Each partition's daemon is this program's `update daemon`.
    let daemon = |d: &ota::boot::DaemonSpec| -> ota::Result<Command> {
        let exe = std::env::current_exe()
            .map_err(|e| ota::Error::io("find the vabc binary", "/proc/self/exe", e))?;
        let mut cmd = Command::new(exe);
        // systemd's final killing spree at shutdown spares a process whose argv[0]
        // begins with '@' (its root-storage daemon convention): this one serves the
        // root, which is unmounted after that spree.
        use std::os::unix::process::CommandExt;
        cmd.arg0("@vabc");
        cmd.args(["update", "daemon", "--store"])
            .arg(d.store)
            .args(["--partition", d.partition, "--frontend", d.frontend.name()])
            .arg("--run-dir")
            .arg(d.run_dir);
        if d.userspace_verity {
            cmd.arg("--userspace-verity");
        }
        cmd.args(a.keys.to_args());
        Ok(cmd)
    };
    let done = ota::boot::boot(&a.store.store, &a.keys.load(), &opts, &daemon)?;
    if let Some(n) = &done.note {
        eprintln!("vabc update boot: {n}");
    }
    if a.store.json {
        report::print(BootReport {
            state: done.state.name(),
            boot_attempts: match &done.state {
                State::Installed { boot_attempts, .. } => Some(*boot_attempts),
                _ => None,
            },
            note: &done.note,
            partitions: &done.devices,
        })?;
    } else {
        for d in &done.devices {
            println!("{} {}", d.name, d.device.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A descriptor the process keeps open, as a path any later open reaches it by:
/// what was proven is what is served, whatever happens to the store's names since.
fn held(file: std::fs::File) -> PathBuf {
    use std::os::fd::IntoRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", file.into_raw_fd()))
}

fn daemon(a: DaemonArgs) -> Result<ExitCode> {
    // The root is served from here: the OOM killer choosing this process would take
    // every process's file system along. Best effort: only root may lower it.
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        eprintln!("vabc update daemon: cannot set oom_score_adj -1000: {e}");
    }
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
    if m.if_pending
        && let Some(why) = ota::device::nothing_to_mark(&a.store, &m.run_dir)?
    {
        if a.json {
            report::print(StoreReport {
                store: &a.store,
                state: ota::device::status(&a.store)?.state,
            })?;
        } else {
            println!("{}: nothing to mark good: {why}", a.store.display());
        }
        return Ok(ExitCode::SUCCESS);
    }
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

/// Merged and total ops over every partition, when the merge has begun for all.
fn merge_sum(st: &ota::device::Status) -> (u64, Option<u64>) {
    st.partitions
        .iter()
        .fold((0, Some(0)), |(m, t), p| match p.merge {
            Some(s) => (m + s.merged, t.zip(s.total).map(|(a, b)| a + b)),
            None => (m, None),
        })
}

fn wait_merge(a: WaitMergeArgs) -> Result<ExitCode> {
    let notify = |status: &str| {
        // Outside systemd there is no socket to tell: nothing is lost.
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(status)]);
    };
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    let stall = Duration::from_secs(a.stall_timeout);
    let (mut last, mut moved, mut said) = (None, Instant::now(), None);
    loop {
        let st = ota::device::status(&a.store)?;
        if st.state != "merging" {
            // A merge that ended while this waited leaves merged; none is the next
            // boot's clean-up of it, or no update at all.
            let msg = match (st.state, last) {
                ("merged", _) | ("none", Some(_)) => format!("merged (state {})", st.state),
                (s, _) => format!("no merge under way (state {s})"),
            };
            println!("{}: {msg}", a.store.display());
            notify(&msg);
            return Ok(ExitCode::SUCCESS);
        }
        let (merged, total) = merge_sum(&st);
        if last != Some(merged) {
            last = Some(merged);
            moved = Instant::now();
            let msg = match total {
                Some(t) if t > 0 => format!(
                    "merging: {merged} of {t} ops ({}%)",
                    merged.saturating_mul(100) / t
                ),
                _ => format!("merging: {merged} ops (not every partition has begun)"),
            };
            notify(&msg);
            // The journal gets a line per tenth, not one per poll.
            let tenth = total
                .filter(|&t| t > 0)
                .map(|t| merged.saturating_mul(10) / t);
            if said.is_none() || tenth != said.flatten() {
                said = Some(tenth);
                println!("{}: {msg}", a.store.display());
            }
        } else if moved.elapsed() > stall {
            anyhow::bail!(
                "{}: the merge has not moved for {} s ({merged} ops merged): is its serving \
                 daemon running? The next boot resumes it",
                a.store.display(),
                stall.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
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
    partitions: &'a [ota::boot::BootDevice],
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
