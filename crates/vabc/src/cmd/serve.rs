//! `vabc serve`: expose the new image (base + COW) before merging, through a FUSE file,
//! a full mount stack, an NBD server, or a ublk block device. Runs in the foreground
//! until SIGINT/SIGTERM and then tears everything down in reverse order.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use serve::mount::FsType;

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
    run_with(Run::from_args(&args)?, None)
}

/// One run of `vabc serve`: what to serve, and what the command does around it.
pub(crate) struct Run {
    pub req: ota::serving::ServeRequest,
    pub ready_file: Option<PathBuf>,
    pub stats: bool,
    pub queue_delays: Option<PathBuf>,
    pub trace: Option<PathBuf>,
}

impl Run {
    fn from_args(args: &Args) -> anyhow::Result<Run> {
        use ota::serving::{FuseTransport as T, NbdSettings, ServeRequest, VerityRequest};
        let mut req = ServeRequest::new(args.base.clone(), args.cow.clone());
        req.size = args.size;
        req.manifest = args.check.manifest.clone();
        req.no_base_check = args.check.no_base_check;
        req.fuse = args.fuse.clone();
        req.fuse_transport = match (args.fuse_uring, args.fuse_transport) {
            (true, _) | (false, FuseTransport::Uring) => T::Uring,
            (false, FuseTransport::Auto) => T::Auto,
            (false, FuseTransport::Classic) => T::Classic,
        };
        req.fuse_uring_poll = Duration::from_micros(args.fuse_uring_poll);
        req.fuse_threads = args.fuse_threads;
        req.loop_dev = args.loop_dev;
        req.mount = args.mount.clone();
        req.fstype = args.fstype;
        req.nbd = args.nbd.clone();
        req.nbd_settings = NbdSettings {
            export_name: args.export_name.clone(),
            max_connections: args.nbd_max_connections,
            handshake_timeout: Duration::from_secs(args.nbd_handshake_timeout),
            idle_timeout: (args.nbd_idle_timeout > 0)
                .then(|| Duration::from_secs(args.nbd_idle_timeout)),
            write_timeout: Duration::from_secs(args.nbd_write_timeout),
            socket_mode: args.nbd_socket_mode.unwrap_or(0o600),
            tls: args.nbd_tls_cert.clone().zip(args.nbd_tls_key.clone()),
            tls_verify_peer: args.nbd_tls_verify_peer.clone(),
        };
        req.ublk = args.ublk;
        req.ublk_queues = args.ublk_queues;
        req.ublk_depth = args.ublk_depth;
        req.workers = args.workers;
        req.decode_threads = args.decode_threads;
        req.decode_pool = args.decode_pool;
        req.io_threads = args.io_threads;
        req.cache_bytes = args.cache_mib << 20;
        req.buffered = args.buffered;
        req.sample_queue_delays = args.queue_delays.is_some();
        req.verity = args.verity_hash.clone().map(|hashfile| VerityRequest {
            hashfile,
            root_hash: args.root_hash.clone().unwrap_or_default(),
            tree: (&args.verity).into(),
        });
        req.tree_options_without_tree = ota::trees::TreeOptions::from(&args.verity).any_given();
        req.merge = args.merge;
        Ok(Run {
            req,
            ready_file: args.ready_file.clone(),
            stats: args.stats,
            queue_delays: args.queue_delays.clone(),
            trace: args.trace.clone(),
        })
    }
}

/// A report left by an earlier run must not be taken for this one's readiness, and
/// its folder must be there before serving starts, not found missing once a device
/// is up (a unit without RuntimeDirectory=, a typo).
fn clear_ready_file(p: &std::path::Path) -> anyhow::Result<()> {
    match std::fs::remove_file(p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(e).with_context(|| format!("remove the old ready report {}", p.display()));
        }
    }
    let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir
        && !dir.is_dir()
    {
        bail!(
            "--ready-file {}: the folder {} does not exist; create it first (a systemd \
             unit: RuntimeDirectory=)",
            p.display(),
            dir.display()
        );
    }
    Ok(())
}

/// `vabc serve` with a merge `trigger` (the update daemon's): the merge is made ready,
/// its files opened, before serving starts, and started when the trigger says.
pub(crate) fn run_with(
    run: Run,
    trigger: Option<ota::serving::MergeTrigger>,
) -> anyhow::Result<ExitCode> {
    // Signals first, so one arriving during set-up still ends in a clean tear-down.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("install signal handler")?;
    }
    let report = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGUSR1, report.clone())
        .context("install signal handler")?;
    if let Some(p) = &run.ready_file {
        clear_ready_file(p)?;
    }
    let mut say = |m: &str| println!("vabc serve: {m}");
    let prepared = ota::serving::prepare(&run.req, trigger.as_ref(), &mut say)?;
    let size = prepared.size();
    // Started before the frontends, so the served device's first requests are in it.
    let recorder = match &run.trace {
        Some(prefix) => Some(super::trace::Timeline::start(prefix)?),
        None => None,
    };
    let server = prepared.start(&mut say)?;
    if let Some(path) = &run.ready_file {
        let text = serde_json::to_string_pretty(&crate::report::Report::new(server.ready()))?;
        ota::output::write_atomic(path, format!("{text}\n").as_bytes())
            .with_context(|| format!("write the ready report {}", path.display()))?;
    }
    // What `vabc cleanup` removes should this process be killed; deleted (on drop)
    // after the tear-down below.
    let record = server.leftovers()?;
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

    let ended = server.serve_until_stopped(trigger, &stop, &mut |stats| {
        if report.swap(false, Ordering::Relaxed) {
            print_stats(stats);
        }
    });
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    let (result, stats) = ended.server.stop();
    if run.stats {
        print_stats(&stats);
    }
    if let Some(path) = &run.queue_delays {
        let samples = stats.engine().stats().queue_delays.take_samples();
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
    if let Some(p) = &run.ready_file {
        let _ = std::fs::remove_file(p);
    }
    match ended.lost {
        Some(ota::serving::Lost::Ublk) => {
            bail!("the ublk device was stopped from outside; stopped serving")
        }
        Some(ota::serving::Lost::Fuse) => {
            bail!("the FUSE export was unmounted from outside; stopped serving")
        }
        None => {}
    }
    if let Some(e) = ended.merge_failed {
        return Err(anyhow::Error::new(e)
            .context("merge failed (serving stayed correct; run again to resume)"));
    }
    log::info!("vabc serve: stopped, everything unmounted");
    Ok(ExitCode::SUCCESS)
}

/// To stderr: a client may have closed our stdout after "ready".
fn print_stats(stats: &ota::serving::Stats) {
    for line in stats.lines() {
        eprintln!("vabc serve: stats: {line}");
    }
}
