//! `vabc serve`: expose the new image (base + COW) before merging, through a FUSE file,
//! a full mount stack, an NBD server, or a ublk block device. Runs in the foreground
//! until SIGINT/SIGTERM and then tears everything down in reverse order.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use engine::{BlockDevice, CowEngine, CowEngineOptions};
use serve::fuse::{FuseExport, FuseOptions};
use serve::mount::{FsType, MountOptions, MountStack};
use serve::nbd::{NbdAddr, NbdOptions, NbdServer};

/// Default of `--fuse-uring-poll`, in the flag's unit.
const DEFAULT_POLL_US: u64 = serve::fuse::uring::DEFAULT_POLL.as_micros() as u64;

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("frontend").required(true).multiple(true).args(["fuse", "mount", "nbd", "ublk"])))]
pub struct Args {
    /// Base (old) image the COW was made against.
    #[arg(long, value_name = "OLD.img")]
    pub base: PathBuf,
    /// COW file of the update.
    #[arg(long, value_name = "UPDATE.cow")]
    pub cow: PathBuf,
    /// Size of the new image in bytes (K/M/G suffixes allowed). Default: the base size,
    /// extended to cover every op.
    #[arg(long, value_parser = crate::args::parse_size)]
    pub size: Option<u64>,
    /// Export the new image as DIR/disk.img through FUSE (with --mount: where to put it).
    #[arg(long, value_name = "DIR")]
    pub fuse: Option<PathBuf>,
    /// How the FUSE export (--fuse or --mount) talks to the kernel. auto: over io_uring
    /// when the kernel allows it (Linux 6.14+ with
    /// /sys/module/fuse/parameters/enable_uring set to Y), else classic.
    #[arg(long, value_enum, default_value_t = FuseTransport::Auto, value_name = "HOW")]
    pub fuse_transport: FuseTransport,
    /// Same as --fuse-transport uring.
    #[arg(long, conflicts_with = "fuse_transport")]
    pub fuse_uring: bool,
    /// Over io_uring: microseconds a queue thread polls its ring for completions
    /// before sleeping, while one of its small reads is in flight (0: never poll).
    /// Trades some CPU for latency: waking a sleeping thread, on a VM a halted vCPU,
    /// takes longer than the completions take to arrive under load.
    #[arg(long, value_name = "US", default_value_t = DEFAULT_POLL_US)]
    pub fuse_uring_poll: u64,
    /// With --fuse: also attach DIR/disk.img to a read-only loop device with direct
    /// I/O (a block device, as --ublk and an NBD client give), detached again on exit.
    /// The loop device auto-clears: if the daemon is killed it goes away once nothing
    /// holds it open.
    #[arg(long = "loop", requires = "fuse", conflicts_with = "mount")]
    pub loop_dev: bool,
    /// Once serving, write a JSON report here (written to a temporary file and renamed,
    /// so a script can wait for the file to appear): schema_version, pid, size, and
    /// whichever of block_device, nbd_address, fuse_file, mount_target applies. Removed
    /// at start (a stale one) and after a clean stop.
    #[arg(long, value_name = "FILE")]
    pub ready_file: Option<PathBuf>,
    /// Mount the new image's file system read-only on TARGET (FUSE + loop for ext4,
    /// file-backed mount for EROFS).
    #[arg(long, value_name = "TARGET")]
    pub mount: Option<PathBuf>,
    /// File system for --mount; detected from the superblock by default.
    #[arg(long, value_parser = parse_fstype, requires = "mount")]
    pub fstype: Option<FsType>,
    /// Serve over NBD at unix:PATH or tcp:IP:PORT.
    #[arg(long, value_name = "ADDR")]
    pub nbd: Option<String>,
    /// Serve as a kernel block device /dev/ublkbN (needs the ublk_drv module).
    #[arg(long)]
    pub ublk: bool,
    /// ublk hardware queues, one thread each (0: one per CPU).
    #[arg(long, default_value_t = 0, requires = "ublk")]
    pub ublk_queues: u16,
    /// ublk queue depth: requests in flight per queue.
    #[arg(long, default_value_t = 64, requires = "ublk")]
    pub ublk_depth: u16,
    /// NBD: connections transmitting at once; more are refused. Connections still
    /// negotiating have 16 slots of their own; a new one closes the one negotiating
    /// longest.
    #[arg(long, default_value_t = 16, value_name = "N", requires = "nbd")]
    pub nbd_max_connections: usize,
    /// NBD: seconds a client has from connecting to the end of its option phase (TLS
    /// handshake included) before it is disconnected.
    #[arg(long, default_value_t = 10, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=3600), requires = "nbd")]
    pub nbd_handshake_timeout: u64,
    /// NBD over TCP: seconds a connection may stay with no request in flight before it
    /// is closed; 0: never (a kernel nbd-client attached over TCP needs 0). Unix-socket
    /// connections are never closed for being idle.
    #[arg(long, default_value_t = 300, value_name = "SECS", requires = "nbd")]
    pub nbd_idle_timeout: u64,
    /// NBD: seconds a client may leave its replies unread (its socket taking nothing)
    /// before it is disconnected.
    #[arg(long, default_value_t = 30, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=3600), requires = "nbd")]
    pub nbd_write_timeout: u64,
    /// NBD: permissions of the unix: socket, octal (default 600: only its owner may
    /// connect, and so read the whole image).
    #[arg(long, value_name = "OCTAL", value_parser = parse_mode, requires = "nbd")]
    pub nbd_socket_mode: Option<u32>,
    /// NBD over TCP: require TLS (STARTTLS), with this PEM certificate chain (for
    /// example from `openssl req -x509 -newkey ed25519 ...`).
    #[arg(long, value_name = "PEM", requires_all = ["nbd", "nbd_tls_key"])]
    pub nbd_tls_cert: Option<PathBuf>,
    /// The PEM private key of --nbd-tls-cert.
    #[arg(long, value_name = "PEM", requires = "nbd_tls_cert")]
    pub nbd_tls_key: Option<PathBuf>,
    /// NBD over TLS: serve only clients presenting a certificate issued by a CA in this
    /// PEM file (as nbdkit --tls-verify-peer, qemu-nbd verify-peer=on); the others fail
    /// the TLS handshake and are sent nothing.
    #[arg(long, value_name = "CA.pem", requires = "nbd_tls_cert")]
    pub nbd_tls_verify_peer: Option<PathBuf>,
    /// NBD export name (clients asking for the default export "" get it too).
    #[arg(long, default_value = "vabc")]
    pub export_name: String,
    /// Requests served at once per frontend (FUSE: threads that each read a
    /// request from /dev/fuse and answer it; NBD: workers; ublk: workers, shared out
    /// over its queues; 0 for ublk answers each request on its queue thread). Over io_uring
    /// the rings' queue threads answer small reads without blocking, and this
    /// sets the pool for large reads and reads while merging or verifying.
    #[arg(long, default_value_t = 16)]
    pub workers: usize,
    /// FUSE threads reading /dev/fuse; only matters above --workers.
    #[arg(long, default_value_t = 1)]
    pub fuse_threads: usize,
    /// Decompression threads (0: one per CPU; the per-CPU pools have one per CPU).
    #[arg(long, default_value_t = 0)]
    pub decode_threads: usize,
    /// How a request's compressed units are handed to the decompression threads: one
    /// shared queue, a worker per CPU (pinned, fed by the requests on its CPU), or the
    /// same at real-time priority (SCHED_FIFO, where permitted). See the decode-pool
    /// study in bench/results/read-path.md.
    #[arg(
        long,
        default_value = "shared",
        value_name = "shared|per-cpu|per-cpu-fifo"
    )]
    pub decode_pool: engine::PoolDesign,
    /// On exit, write how long each hand-off to the decompression threads waited for
    /// one: a line per hand-off, "QUEUED_AT WAITED" in nanoseconds (CLOCK_MONOTONIC):
    /// the decode-pool study's scheduling latency.
    #[arg(long, value_name = "FILE")]
    pub queue_delays: Option<PathBuf>,
    /// Threads issuing the scattered base reads of one large request concurrently.
    #[arg(long, default_value_t = 8)]
    pub io_threads: usize,
    /// Cache for decoded multi-block REPLACE units, in MiB.
    #[arg(long, default_value_t = 64)]
    pub cache_mib: usize,
    /// Read the base through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// On exit, print where the time of the reads went: each frontend's READ latency
    /// (arrival to reply), the engine's share, the dm-verity checks, what the read-ahead
    /// served, and the engine's counters. `kill -USR1` prints the same at any time, with
    /// or without this flag.
    #[arg(long)]
    pub stats: bool,
    /// Record a time line while serving: each read's spans (frontend request, engine
    /// read, decode, verity check, base and COW reads) and every block device's
    /// events (tracefs, as `vabc trace record`), written on exit as PREFIX.json (open
    /// it in ui.perfetto.dev) and PREFIX.blktrace.CPU (`vabc trace report`, blkparse,
    /// btt). Needs root for tracefs.
    #[arg(long, value_name = "PREFIX")]
    pub trace: Option<PathBuf>,
    /// Merge the COW into the base in the background while serving: the base
    /// becomes the new image in place (crash-safe, resumable), and every read
    /// stays correct before, during and after each op's merge.
    #[arg(long)]
    merge: bool,
    /// dm-verity hash file of the new image (as `vabc verity format` or
    /// `veritysetup format` write it): every block served is checked against
    /// it, and a block that fails is answered with EIO, never with its data.
    #[arg(long, value_name = "FILE", requires = "root_hash")]
    pub verity_hash: Option<PathBuf>,
    /// Root hash of the tree in --verity-hash, hex.
    #[arg(long, value_name = "HEX", requires = "verity_hash")]
    pub root_hash: Option<String>,
    /// Tree parameters for --verity-hash (taken from its superblock unless
    /// --no-superblock).
    #[command(flatten)]
    pub verity: super::verity::TreeOpts,
    #[command(flatten)]
    pub check: crate::checks::CheckArgs,
}

/// `--fuse-transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FuseTransport {
    /// io_uring if the kernel allows it, else classic.
    Auto,
    /// FUSE over io_uring: per-CPU rings, small reads answered without blocking a
    /// thread (random 4 KiB reads at depth 32: 1.3-1.4x classic's IOPS in bench/serve.sh).
    Uring,
    /// Requests read from and answered through /dev/fuse by a thread pool.
    Classic,
}

/// Whether the FUSE export goes over io_uring. Asked for explicitly, the rings must be
/// available; `auto` falls back to /dev/fuse, saying so when root could switch them on.
fn use_fuse_uring(args: &Args) -> anyhow::Result<bool> {
    let wants_fuse = args.fuse.is_some() || args.mount.is_some();
    let how = match args.fuse_uring {
        true => FuseTransport::Uring,
        false => args.fuse_transport,
    };
    match how {
        FuseTransport::Classic => Ok(false),
        FuseTransport::Uring => {
            if !wants_fuse {
                bail!(
                    "FUSE over io_uring (--fuse-transport uring, --fuse-uring) needs --fuse DIR or --mount TARGET"
                );
            }
            serve::fuse::uring::check_enabled()?;
            serve::fuse::uring::rings_usable()?;
            Ok(true)
        }
        FuseTransport::Auto if !wants_fuse => Ok(false),
        FuseTransport::Auto => {
            use serve::fuse::uring::UringSupport;
            match serve::fuse::uring::support() {
                Ok(UringSupport::Enabled) => match serve::fuse::uring::rings_usable() {
                    Ok(()) => Ok(true),
                    Err(e) => {
                        log::info!("vabc serve: {e}; the export answers through /dev/fuse");
                        Ok(false)
                    }
                },
                // Off is the kernel's default: say once what it costs and how to change it.
                Ok(UringSupport::Disabled) => {
                    log::info!(
                        "vabc serve: FUSE over io_uring is switched off in the kernel, so \
                         the export answers through /dev/fuse (`echo Y > {}` as root \
                         enables the faster rings)",
                        serve::fuse::uring::ENABLE_PARAM
                    );
                    Ok(false)
                }
                Ok(UringSupport::Absent) => Ok(false),
                Err(e) => {
                    log::info!("vabc serve: {e}; the export answers through /dev/fuse");
                    Ok(false)
                }
            }
        }
    }
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("invalid mode {s:?}: expected octal digits such as 600"))
}

fn parse_fstype(s: &str) -> Result<FsType, String> {
    s.parse()
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    run_with(args, None)
}

/// Starts a merge that waits for a word from elsewhere (`vabc update mark-good`), and
/// hears when it completed.
pub(crate) struct MergeTrigger {
    /// Polled while serving: true once the merge should start.
    pub start: Box<dyn FnMut() -> bool + Send>,
    /// Called once, when the merge has completed.
    pub done: Box<dyn FnMut() -> anyhow::Result<()> + Send>,
    /// Checks each block of a published scratch window before it is served or
    /// written ([`merge::Merge::with_scratch_check`]).
    pub scratch_check: Option<merge::BlockCheck>,
}

/// `vabc serve` with a [`MergeTrigger`] (the update daemon's): the merge is made
/// ready, its files opened, before serving starts, and started when the trigger says.
pub(crate) fn run_with(args: Args, trigger: Option<MergeTrigger>) -> anyhow::Result<ExitCode> {
    // Signals first, so one arriving during set-up still ends in a clean tear-down.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("install signal handler")?;
    }
    let report = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGUSR1, report.clone())
        .context("install signal handler")?;
    let pre = Preflight::check(&args)?;
    // Best effort, and nothing a user can act on when it is refused (it needs
    // CAP_SYS_RESOURCE, which containers often drop): no message.
    let _ = serve::set_io_flusher();

    let (progress, manifest) = check_before_serving(&args)?;
    let opts = CowEngineOptions {
        size: args.size.or(manifest.as_ref().map(|m| m.new.size)),
        cache_bytes: args.cache_mib << 20,
        decode_threads: args.decode_threads,
        decode_pool: args.decode_pool,
        direct_io: !args.buffered,
        io_threads: args.io_threads,
    };
    let mut engine = CowEngine::open(&args.base, &args.cow, &opts).with_context(|| {
        format!(
            "cannot serve {} + {}",
            args.base.display(),
            args.cow.display()
        )
    })?;
    // Even without --merge, a COW that is partly merged (an interrupted merge)
    // must be served through its merge state: merged sources may be gone.
    let merge_job = MergeJob::prepare(
        &args,
        &mut engine,
        progress.started(),
        manifest.as_ref(),
        trigger.is_some(),
        trigger.as_ref().and_then(|t| t.scratch_check.clone()),
    )?;
    let size = engine.size();
    if let Some(check) = open_verity(&args, size)? {
        engine.set_verifier(check);
    }
    if args.queue_delays.is_some() {
        engine.stats().queue_delays.sample();
    }
    let engine = Arc::new(engine);
    let stats = Stats {
        engine: engine.clone(),
        fuse: Arc::default(),
        nbd: Arc::default(),
        ublk: Arc::default(),
        readahead: Arc::default(),
    };
    // Started before the frontends, so the served device's first requests are in it.
    let recorder = match &args.trace {
        Some(prefix) => Some(super::trace::Timeline::start(prefix)?),
        None => None,
    };
    let fronts = Frontends::start(&args, pre, engine, &stats)?;
    if let Some(path) = &args.ready_file {
        fronts.write_ready_report(path, size)?;
    }
    // What `vabc cleanup` removes should this process be killed; deleted (on drop)
    // after the tear-down below.
    let record = fronts.leftovers()?;
    let record_file = match record == serve::leftovers::Record::for_self()? {
        true => None, // NBD only: nothing in the kernel to leave behind
        false => Some(record.write(&serve::leftovers::run_dir())?),
    };
    println!("vabc serve: ready ({size} bytes); stop with Ctrl-C or SIGTERM");
    // A service manager's readiness protocol (systemd Type=notify); nothing without
    // $NOTIFY_SOCKET.
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&format!("serving {size} bytes")),
    ]);
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let merge_job = match (merge_job, &trigger) {
        (Some(job), _) if args.merge => Some(MergeJob::start(job)),
        (Some(job), Some(_)) => Some(job),
        _ => None,
    };
    let ended = fronts.serve_until_stopped(merge_job, trigger, &stop, &report, &stats);

    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let result = fronts.stop();
    if args.stats {
        stats.print();
    }
    if let Some(path) = &args.queue_delays {
        let samples = stats.engine.stats().queue_delays.take_samples();
        let text: String = samples
            .iter()
            .map(|(at, ns)| format!("{at} {ns}\n"))
            .collect();
        ota::output::write_atomic(path, text.as_bytes())?;
    }
    if let Some(r) = recorder {
        let json = r.finish()?;
        eprintln!(
            "vabc serve: time line written to {} (open it in ui.perfetto.dev)",
            json.display()
        );
    }
    if result.is_err() {
        // Something may be left behind: keep the record for `vabc cleanup`.
        std::mem::forget(record_file);
    }
    result?;
    // The report described a device that is gone now.
    if let Some(p) = &args.ready_file {
        let _ = std::fs::remove_file(p);
    }
    match ended.lost {
        Some(Lost::Ublk) => bail!("the ublk device was stopped from outside; stopped serving"),
        Some(Lost::Fuse) => bail!("the FUSE export was unmounted from outside; stopped serving"),
        None => {}
    }
    if let Some(e) = ended.merge_failed {
        return Err(e.context("merge failed (serving stayed correct; run again to resume)"));
    }
    log::info!("vabc serve: stopped, everything unmounted");
    Ok(ExitCode::SUCCESS)
}

/// What is checked and opened before anything is read: bad arguments and a missing
/// driver fail here, before the engine's work.
struct Preflight {
    nbd_addr: Option<NbdAddr>,
    nbd_tls: Option<Arc<serve::nbd::TlsConfig>>,
    ublk_transport: Option<serve::ublk::KernelTransport>,
    fuse_uring: bool,
}

impl Preflight {
    fn check(args: &Args) -> anyhow::Result<Preflight> {
        let nbd_addr: Option<NbdAddr> = args.nbd.as_deref().map(str::parse).transpose()?;
        // A report left by an earlier run must not be taken for this one's readiness.
        if let Some(p) = &args.ready_file {
            match std::fs::remove_file(p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("remove the old ready report {}", p.display()));
                }
            }
            // Its folder must be there before serving starts, not found missing once
            // a device is up (a unit without RuntimeDirectory=, a typo).
            let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
            if let Some(dir) = dir
                && !dir.is_dir()
            {
                bail!(
                    "--ready-file {}: the folder {} does not exist; create it first (a \
                     systemd unit: RuntimeDirectory=)",
                    p.display(),
                    dir.display()
                );
            }
        }
        let nbd_tls = match (&args.nbd_tls_cert, &args.nbd_tls_key, &nbd_addr) {
            (Some(_), _, Some(NbdAddr::Unix(_))) => {
                bail!("--nbd-tls-cert is for tcp: addresses (a unix socket is guarded by its mode)")
            }
            (Some(cert), Some(key), _) => Some(serve::nbd::tls_config(
                cert,
                key,
                args.nbd_tls_verify_peer.as_deref(),
            )?),
            _ => None,
        };
        // Before any work: a missing driver is the likely failure.
        let ublk_transport = match args.ublk {
            true => Some(serve::ublk::KernelTransport::open()?),
            false => None,
        };
        if let Some(t) = &args.mount
            && !t.is_dir()
        {
            bail!(
                "mount point {} does not exist or is not a directory",
                t.display()
            );
        }
        Ok(Preflight {
            nbd_addr,
            nbd_tls,
            ublk_transport,
            fuse_uring: use_fuse_uring(args)?,
        })
    }
}

/// Before serving a byte: the base must be the one the update was made for (or, once
/// merged, the new image), and the COW's merge state must be sane. Returns the merge's
/// progress and the update's manifest, if it has one.
fn check_before_serving(
    args: &Args,
) -> anyhow::Result<(merge::progress::Progress, Option<manifest::Manifest>)> {
    let cow = cow::CowReader::open(&args.cow)
        .with_context(|| format!("cannot read COW {}", args.cow.display()))?;
    let progress = merge::progress::read(&cow)?;
    if progress.started() {
        // A merge records its progress in the COW: say what that means here.
        log::info!(
            "vabc serve: {}: merge {progress}; serving through the merge state",
            args.cow.display()
        );
    }
    let manifest = crate::checks::load_manifest(&args.check, &args.cow, &cow)?;
    if let Some(m) = &manifest {
        let base = std::fs::File::open(&args.base)
            .with_context(|| format!("cannot open base {}", args.base.display()))?;
        ota::trust::check_base(m, progress, &cow, &base, &args.base)?;
        // Nothing wrong is served: without a dm-verity tree to check each block as it
        // is read, prove the whole result first (a full decode pass; the base of a
        // started merge is checked above, and its COW was proven before it began).
        if !progress.started() && args.verity_hash.is_none() {
            let t = std::time::Instant::now();
            ota::trust::prove_result(Some(m), &cow, &base, &args.base, args.size)?;
            log::info!(
                "vabc serve: checked: base + COW make the update's new image ({:.2} s; \
                 --verity-hash checks each block as it is read instead)",
                t.elapsed().as_secs_f64()
            );
        }
    }
    Ok((progress, manifest))
}

/// Which frontend went away underneath us.
enum Lost {
    Ublk,
    Fuse,
}

/// How serving ended (besides a signal).
struct Ended {
    lost: Option<Lost>,
    merge_failed: Option<anyhow::Error>,
}

/// The frontends serving the engine, torn down in reverse order of their start.
struct Frontends {
    // Field order is drop order (a failed start drops what it started): the reverse
    // of the start.
    loop_dev: Option<serve::mount::LoopDevice>,
    stack: Option<MountStack>,
    fuse: Option<FuseExport>,
    ublk: Option<serve::ublk::UblkDevice<serve::ublk::KernelTransport>>,
    nbd: Option<serve::nbd::NbdHandle>,
    nbd_uri: Option<String>,
}

impl Frontends {
    fn start(
        args: &Args,
        pre: Preflight,
        engine: Arc<CowEngine>,
        stats: &Stats,
    ) -> anyhow::Result<Frontends> {
        let dev: Arc<dyn BlockDevice> = engine;
        let size = dev.size();
        // One set of read-ahead counters for every frontend's read-ahead.
        let readahead = Some(engine::ReadaheadOptions {
            stats: stats.readahead.clone(),
            ..Default::default()
        });
        let mut fronts = Frontends {
            loop_dev: None,
            stack: None,
            fuse: None,
            ublk: None,
            nbd: None,
            nbd_uri: None,
        };
        // From here on, an error drops `fronts`, which tears down what was started.
        if let Some(addr) = &pre.nbd_addr {
            let nbd_opts = NbdOptions {
                export_name: args.export_name.clone(),
                workers: args.workers,
                latency: stats.nbd.clone(),
                readahead: readahead.clone(),
                max_connections: args.nbd_max_connections.max(1),
                handshake_timeout: Duration::from_secs(args.nbd_handshake_timeout),
                idle_timeout: (args.nbd_idle_timeout > 0)
                    .then(|| Duration::from_secs(args.nbd_idle_timeout)),
                write_timeout: Duration::from_secs(args.nbd_write_timeout),
                socket_mode: args.nbd_socket_mode.unwrap_or(0o600),
                tls: pre.nbd_tls.clone(),
                ..NbdOptions::default()
            };
            let server = NbdServer::bind(addr, dev.clone(), &nbd_opts)?;
            let uri = server.addr().to_string();
            fronts.nbd = Some(server.spawn()?);
            println!("vabc serve: NBD export {:?} at {uri}", args.export_name);
            fronts.nbd_uri = Some(uri);
        }
        if let Some(t) = pre.ublk_transport {
            let opts = serve::ublk::UblkOptions {
                queues: args.ublk_queues,
                depth: args.ublk_depth,
                workers: args.workers,
                readahead: readahead.clone(),
                latency: stats.ublk.clone(),
                ..Default::default()
            };
            let d = serve::ublk::UblkDevice::start(dev.clone(), t, &opts)?;
            let p = d.params();
            println!(
                "vabc serve: block device {} ({} queues of depth {}, read-only)",
                d.block_path().display(),
                p.queues,
                p.depth
            );
            fronts.ublk = Some(d);
        }
        let fuse_opts = FuseOptions {
            dev_threads: args.fuse_threads.max(args.workers),
            uring: pre.fuse_uring.then(|| serve::fuse::uring::UringOptions {
                poll: std::time::Duration::from_micros(args.fuse_uring_poll),
                ..serve::fuse::uring::UringOptions::with_workers(args.workers)
            }),
            latency: stats.fuse.clone(),
            readahead,
            ..FuseOptions::default()
        };
        if let Some(target) = &args.mount {
            let mopts = MountOptions {
                fstype: args.fstype,
                fuse_dir: args.fuse.clone(),
                fuse: fuse_opts,
            };
            let s = MountStack::mount(dev.clone(), target, &mopts)?;
            let via = match s.loop_device() {
                Some(lo) => format!(
                    "{} (direct I/O {})",
                    lo.path().display(),
                    if lo.direct_io() { "on" } else { "off" }
                ),
                None => "file-backed mount, no loop device".into(),
            };
            println!(
                "vabc serve: mounted {} read-only on {} via {via}, FUSE {}",
                s.fstype().name(),
                s.target().display(),
                if pre.fuse_uring {
                    "over io_uring"
                } else {
                    "through /dev/fuse"
                }
            );
            fronts.stack = Some(s);
        } else if let Some(dir) = &args.fuse {
            let f = FuseExport::mount(dev.clone(), dir, &fuse_opts)?;
            let (queues, threads) = f.queues();
            let how = if f.over_io_uring() {
                format!("over FUSE io_uring ({queues} queues, {threads} threads)")
            } else {
                format!("through /dev/fuse ({} threads)", f.dev_threads())
            };
            println!(
                "vabc serve: exporting {} ({size} bytes) {how}",
                f.file_path().display()
            );
            fronts.fuse = Some(f);
        }
        if let (Some(file), true) = (fronts.fuse_file(), args.loop_dev) {
            let lo = serve::mount::LoopDevice::attach(&file, true)?;
            println!(
                "vabc serve: block device {} over {} (direct I/O {})",
                lo.path().display(),
                file.display(),
                if lo.direct_io() { "on" } else { "off" }
            );
            fronts.loop_dev = Some(lo);
        }
        Ok(fronts)
    }

    /// The exported FUSE file, under the mount stack or on its own.
    fn fuse_file(&self) -> Option<PathBuf> {
        self.stack
            .as_ref()
            .and_then(|s| s.fuse().map(|f| f.file_path().to_path_buf()))
            .or_else(|| self.fuse.as_ref().map(|f| f.file_path().to_path_buf()))
    }

    /// The machine-readable "ready" report of `--ready-file`.
    fn write_ready_report(&self, path: &std::path::Path, size: u64) -> anyhow::Result<()> {
        let block = self
            .ublk
            .as_ref()
            .map(|u| u.block_path())
            .or_else(|| self.loop_dev.as_ref().map(|l| l.path().to_path_buf()));
        let report = crate::report::Report::new(ReadyReport {
            pid: std::process::id(),
            size,
            block_device: block,
            nbd_address: self.nbd_uri.clone(),
            fuse_file: self.fuse_file(),
            mount_target: self.stack.as_ref().map(|s| s.target().to_path_buf()),
        });
        let text = serde_json::to_string_pretty(&report)?;
        ota::output::write_atomic(path, format!("{text}\n").as_bytes())
            .with_context(|| format!("write the ready report {}", path.display()))
    }

    /// What a killed daemon would leave in the kernel, for `vabc cleanup`.
    fn leftovers(&self) -> anyhow::Result<serve::leftovers::Record> {
        let fuse_file = self.fuse_file();
        Ok(serve::leftovers::Record {
            ublk_dev_id: self.ublk.as_ref().map(|u| u.dev_id()),
            fuse_dir: fuse_file
                .as_ref()
                .and_then(|f| f.parent().map(|p| p.to_path_buf())),
            loop_devices: self
                .loop_dev
                .iter()
                .chain(self.stack.as_ref().and_then(MountStack::loop_device))
                .filter_map(|l| Some((l.number(), fuse_file.clone()?)))
                .collect(),
            mount_target: self.stack.as_ref().map(|s| s.target().to_path_buf()),
            ..serve::leftovers::Record::for_self()?
        })
    }

    /// Serves until SIGINT/SIGTERM or until a frontend goes away underneath us; runs
    /// the background merge meanwhile and stops it (at its next commit) at the end.
    fn serve_until_stopped(
        &self,
        mut merge_job: Option<MergeJob>,
        mut trigger: Option<MergeTrigger>,
        stop: &AtomicBool,
        report: &AtomicBool,
        stats: &Stats,
    ) -> Ended {
        let mut ended = Ended {
            lost: None,
            merge_failed: None,
        };
        while !stop.load(Ordering::Relaxed) {
            if let Some(t) = trigger.as_mut()
                && merge_job.as_ref().is_some_and(|j| !j.started())
                && (t.start)()
            {
                merge_job = merge_job.map(MergeJob::start);
            }
            if let Some(job) = merge_job.take_if(|j| j.is_finished()) {
                match job.join() {
                    // stderr: a client may have closed our stdout after "ready".
                    Ok(r) => {
                        log::info!(
                            "vabc serve: merge complete: {} ops ({} this run); the base is now the new image",
                            r.total_ops,
                            r.merged - r.started_at
                        );
                        if let Some(t) = trigger.as_mut()
                            && let Err(e) = (t.done)()
                        {
                            log::warn!("vabc serve: after the merge: {e:#}");
                            ended.merge_failed = Some(e);
                        }
                    }
                    Err(e) => {
                        log::warn!("vabc serve: merge failed: {e:#}");
                        ended.merge_failed = Some(e);
                    }
                }
            }
            if self.ublk.as_ref().is_some_and(|u| !u.is_alive()) {
                ended.lost = Some(Lost::Ublk);
                break;
            }
            if !(self.stack.as_ref().is_none_or(MountStack::is_alive)
                && self.fuse.as_ref().is_none_or(FuseExport::is_alive))
            {
                ended.lost = Some(Lost::Fuse);
                break;
            }
            if report.swap(false, Ordering::Relaxed) {
                stats.print();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // A merge still running stops at its next commit; the next run resumes.
        if let Some(job) = merge_job.filter(MergeJob::started) {
            match job.cancel_and_join() {
                Ok(r) if !r.complete() => log::info!(
                    "vabc serve: merge paused at op {} of {}; serve --merge again to resume",
                    r.merged,
                    r.total_ops
                ),
                Ok(_) => {}
                Err(e) => ended.merge_failed = Some(e),
            }
        }
        ended
    }

    /// Tears everything down, in reverse order of the start; the first error wins.
    fn stop(mut self) -> anyhow::Result<()> {
        let mut result = Ok(());
        if let Some(lo) = self.loop_dev.take() {
            result = lo.detach().context("detach the loop device");
        }
        if let Some(s) = self.stack.take() {
            result = result
                .and(s.teardown().map_err(anyhow::Error::from))
                .context("tear down the mount stack");
        }
        if let Some(f) = self.fuse.take() {
            let r = f.unmount().context("unmount the FUSE export");
            result = result.and(r);
        }
        if let Some(u) = self.ublk.take() {
            let r = u.stop().map(drop).context("stop the ublk device");
            result = result.and(r);
        }
        if let Some(n) = self.nbd.take() {
            n.stop();
        }
        result
    }
}

/// Where the time of the reads goes, per layer (see `--stats`).
struct Stats {
    engine: Arc<CowEngine>,
    fuse: Arc<trace::Histogram>,
    nbd: Arc<trace::Histogram>,
    ublk: Arc<trace::Histogram>,
    readahead: Arc<engine::ReadaheadStats>,
}

impl Stats {
    /// To stderr: a client may have closed our stdout after "ready".
    fn print(&self) {
        for (what, h) in [
            ("FUSE READs", &self.fuse),
            ("NBD READs", &self.nbd),
            ("ublk READs", &self.ublk),
        ] {
            let s = h.snapshot();
            if s.count > 0 {
                eprintln!("vabc serve: stats: {what} (arrival to reply): {s}");
            }
        }
        let e = self.engine.stats();
        eprintln!(
            "vabc serve: stats: engine reads (read_at, planned reads not included): {}",
            e.reads.snapshot()
        );
        let checks = e.checks.snapshot();
        if checks.count > 0 {
            eprintln!("vabc serve: stats: dm-verity checks: {checks}");
        }
        let waits = e.queue_delays.histogram.snapshot();
        if waits.count > 0 {
            eprintln!("vabc serve: stats: decode hand-offs (queued to started): {waits}");
        }
        let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let ra = &self.readahead;
        if n(&ra.hits) + n(&ra.misses) > 0 {
            eprintln!(
                "vabc serve: stats: read-ahead: {} chunks read ahead ({} failed), {} stream \
                 requests answered from them ({} waited for one), {} read directly",
                n(&ra.chunks),
                n(&ra.failed_chunks),
                n(&ra.hits),
                n(&ra.waits),
                n(&ra.misses)
            );
        }
        eprintln!(
            "vabc serve: stats: engine: {} base file reads, {} units decoded, {} unit cache hits, \
             {} requests decoded on the pool, {} MiB read straight into reply buffers",
            n(&e.base_reads),
            n(&e.unit_decodes),
            n(&e.cache_hits),
            n(&e.parallel_requests),
            n(&e.in_place_bytes) >> 20
        );
    }
}

/// A merge running in the background of the server.
struct MergeJob {
    base: std::path::PathBuf,
    cow: std::path::PathBuf,
    /// The base and the COW opened for the merge, and its I/O engine, made before
    /// serving starts: a merge started later (after a switch of root has moved the
    /// mounts the paths went through) needs no path.
    files: Option<MergeFiles>,
    status: Arc<merge::MergeStatus>,
    cancel: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<anyhow::Result<merge::MergeReport>>>,
    /// For a merge not yet started: prove, before its first write, that every op
    /// decodes to the new image (against the manifest when there is one).
    prove: Option<Option<manifest::Manifest>>,
    scratch_check: Option<merge::BlockCheck>,
}

impl MergeJob {
    /// Validate the merge and bring the engine's view of it up to date
    /// before the first read is served (a published scratch window counts).
    /// None when there is nothing to merge-track: no --merge and nothing
    /// merged yet.
    fn prepare(
        args: &Args,
        engine: &mut CowEngine,
        started: bool,
        manifest: Option<&manifest::Manifest>,
        armed: bool,
        scratch_check: Option<merge::BlockCheck>,
    ) -> anyhow::Result<Option<MergeJob>> {
        if !args.merge && !started && !armed {
            return Ok(None);
        }
        let reader = cow::CowReader::open(&args.cow)?;
        let status = Arc::new(merge::MergeStatus::new());
        let ro = |p: &std::path::Path| {
            std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))
        };
        let size = cow::view::file_size(&ro(&args.base)?, &args.base)?;
        let m = merge::Merge::new(
            &reader,
            size,
            args.base.clone(),
            merge::MergeOptions::default(),
        )
        .with_context(|| match started {
            true => "the COW is partly merged, but its merge cannot be tracked".to_string(),
            false => format!(
                "cannot merge {} into {}",
                args.cow.display(),
                args.base.display()
            ),
        })?;
        let m = match &scratch_check {
            Some(c) => m.with_scratch_check(c.clone()),
            None => m,
        };
        // Reads only: the device state as the merge left it.
        m.load_status(
            &mut merge::SyncIo::new(ro(&args.base)?, ro(&args.cow)?),
            &status,
        )?;
        engine.set_merge_hook(Arc::new(merge::serving::StatusHook::new(
            &reader,
            status.clone(),
        )?));
        let files = (args.merge || armed)
            .then(|| MergeFiles::open(&args.base, &args.cow))
            .transpose()?;
        Ok(Some(MergeJob {
            base: args.base.clone(),
            cow: args.cow.clone(),
            files,
            status,
            cancel: Arc::new(AtomicBool::new(false)),
            handle: None,
            prove: (!started && !args.check.no_base_check).then(|| manifest.cloned()),
            scratch_check,
        }))
    }

    fn start(mut self) -> MergeJob {
        let (base, cow, status, cancel, prove, scratch_check) = (
            self.base.clone(),
            self.cow.clone(),
            self.status.clone(),
            self.cancel.clone(),
            self.prove.take(),
            self.scratch_check.clone(),
        );
        let files = self.files.take();
        log::info!(
            "vabc serve: merging {} into {} in the background",
            cow.display(),
            base.display()
        );
        self.handle = Some(std::thread::spawn(move || {
            let Some(MergeFiles {
                base: base_file,
                cow: cow_file,
                mut io,
            }) = files
            else {
                anyhow::bail!("the merge's files were not opened");
            };
            let reader = cow::CowReader::from_file(cow_file, &cow, cow::OpenOptions::default())?;
            if let Some(manifest) = prove {
                ota::trust::prove_result(manifest.as_ref(), &reader, &base_file, &base, None)?;
            }
            let size = cow::view::file_size(&base_file, &base)?;
            let m = merge::Merge::new(&reader, size, base, merge::MergeOptions::default())?;
            let m = m.with_status(status).with_cancel(cancel);
            let m = match scratch_check {
                Some(c) => m.with_scratch_check(c),
                None => m,
            };
            Ok(m.run(io.as_mut(), &|_, _| {})?)
        }));
        self
    }

    fn started(&self) -> bool {
        self.handle.is_some()
    }

    fn is_finished(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| h.is_finished())
    }

    fn join(mut self) -> anyhow::Result<merge::MergeReport> {
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("the merge thread panicked"))?,
            None => anyhow::bail!("the merge was never started"),
        }
    }

    fn cancel_and_join(self) -> anyhow::Result<merge::MergeReport> {
        self.cancel.store(true, Ordering::Relaxed);
        self.join()
    }
}

/// What a merge writes through, opened before it starts.
struct MergeFiles {
    base: std::fs::File,
    cow: std::fs::File,
    io: Box<dyn merge::MergeIo + Send>,
}

impl MergeFiles {
    fn open(base: &std::path::Path, cow: &std::path::Path) -> anyhow::Result<MergeFiles> {
        let rw = |p: &std::path::Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .with_context(|| format!("cannot open {} for the merge", p.display()))
        };
        let (b, c) = (rw(base)?, rw(cow)?);
        let clone = |f: &std::fs::File, p: &std::path::Path| {
            f.try_clone()
                .with_context(|| format!("duplicate the descriptor of {}", p.display()))
        };
        let (io, _) = merge::io::open(
            merge::Engine::Auto,
            clone(&b, base)?,
            clone(&c, cow)?,
            64,
            false,
        )?;
        Ok(MergeFiles {
            base: b,
            cow: c,
            io,
        })
    }
}

/// The verifier for `--verity-hash`, checked against the root hash before
/// anything is served.
fn open_verity(args: &Args, size: u64) -> anyhow::Result<Option<Arc<dyn engine::BlockVerifier>>> {
    let Some(hashfile) = &args.verity_hash else {
        if args.verity.any_given() {
            bail!("verity tree options need --verity-hash FILE and --root-hash HEX");
        }
        return Ok(None);
    };
    let root_hex = args.root_hash.as_deref().unwrap_or_default().trim();
    let root =
        hex::decode(root_hex).with_context(|| format!("--root-hash {root_hex:?} is not hex"))?;
    let file = std::fs::File::open(hashfile)
        .with_context(|| format!("open verity hash file {}", hashfile.display()))?;
    let hash_len = super::verity::device_or_file_len(&file, hashfile)?;
    let data_name = PathBuf::from(format!("{} + {}", args.base.display(), args.cow.display()));
    let params =
        super::verity::resolve_params(&args.verity, hashfile, &file, hash_len, &data_name, size)?;
    let tree_off = args.verity.tree_offset(&params);
    let verifier = verity::BlockVerifier::new(file, hashfile, tree_off, params.clone(), &root)?
        .with_data_name(&data_name);
    let needed = tree_off + verifier.layout().tree_size();
    if hash_len < needed {
        return Err(verity::Error::Truncated {
            path: hashfile.clone(),
            what: format!(
                "a {}-block hash tree at offset {tree_off}",
                verifier.layout().hash_blocks
            ),
            needed,
            actual: hash_len,
        }
        .into());
    }
    let check = serve::verity::VerityCheck::new(verifier, size)
        .with_context(|| format!("cannot verify against {}", hashfile.display()))?;
    println!(
        "vabc serve: verifying every block against {} ({} data blocks of {}, {}, root hash {root_hex})",
        hashfile.display(),
        params.data_blocks,
        params.data_block_size,
        params.algorithm,
    );
    if check.protected_bytes() < size {
        log::warn!(
            "vabc serve: warning: the hash tree covers {} of {size} bytes; reads past it fail with EIO",
            check.protected_bytes()
        );
    }
    Ok(Some(Arc::new(check)))
}

/// `vabc serve --ready-file`: what is served, and where.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct ReadyReport {
    pid: u32,
    size: u64,
    block_device: Option<PathBuf>,
    nbd_address: Option<String>,
    fuse_file: Option<PathBuf>,
    mount_target: Option<PathBuf>,
}
