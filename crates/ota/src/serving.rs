//! Serving an update before it is merged: base + COW checked against what was signed,
//! presented through FUSE, a mount stack, NBD or ublk, optionally checked block by block
//! against a dm-verity tree, with the in-place merge running underneath (started at
//! once, or when a [`MergeTrigger`] says so) while reads stay correct.
//!
//! The steps, in the order a server goes through them:
//! 1. [`prepare`]: the request's options and drivers are checked (a missing driver fails
//!    before any work), the base is checked against the update's manifest (a full proof
//!    of the result when there is no dm-verity tree to check each block), the engine is
//!    opened, a started or armed merge is made ready, and the verifier is attached.
//! 2. [`Prepared::start`]: the frontends start; from here a failure tears down what
//!    started.
//! 3. [`Server::serve_until_stopped`]: serves until the stop flag is set or a frontend
//!    goes away underneath, runs the merge meanwhile and pauses it at the end.
//! 4. [`Server::stop`]: tears everything down in reverse order.
//!
//! ```no_run
//! use std::sync::atomic::AtomicBool;
//! let mut req = ota::serving::ServeRequest::new("/dev/vda".into(), "/data/system.cow".into());
//! req.ublk = true;
//! let server = ota::serving::prepare(&req, None, &mut |m| println!("{m}"))?
//!     .start(&mut |m| println!("{m}"))?;
//! let stop = AtomicBool::new(false); // set it from a signal handler
//! let ended = server.serve_until_stopped(None, &stop, &mut |_| {});
//! let (stopped, _stats) = ended.server.stop();
//! stopped?;
//! # Ok::<(), ota::Error>(())
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use engine::{BlockDevice, CowEngine, CowEngineOptions};
use serve::fuse::{FuseExport, FuseOptions};
use serve::mount::{FsType, MountOptions, MountStack};
use serve::nbd::{NbdAddr, NbdOptions, NbdServer};

use crate::error::{Context, Error, Result, invalid};
use crate::trees::TreeOptions;

/// How the FUSE export talks to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FuseTransport {
    /// FUSE over io_uring where the kernel offers it, else /dev/fuse.
    #[default]
    Auto,
    /// FUSE over io_uring; an error where the kernel does not offer it.
    Uring,
    /// /dev/fuse.
    Classic,
}

/// An NBD export's settings.
#[derive(Debug, Clone)]
pub struct NbdSettings {
    /// The export's name.
    pub export_name: String,
    /// Clients served at once.
    pub max_connections: usize,
    /// Time a client has to finish its handshake.
    pub handshake_timeout: Duration,
    /// A connection with no request for this long is closed (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// Time a reply may take to be written.
    pub write_timeout: Duration,
    /// Mode of a unix socket.
    pub socket_mode: u32,
    /// TLS: the certificate and its key (PEM).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// TLS: only clients with a certificate of this CA (PEM).
    pub tls_verify_peer: Option<PathBuf>,
}

impl Default for NbdSettings {
    fn default() -> Self {
        NbdSettings {
            export_name: "vabc".into(),
            max_connections: 16,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Some(Duration::from_secs(300)),
            write_timeout: Duration::from_secs(30),
            socket_mode: 0o600,
            tls: None,
            tls_verify_peer: None,
        }
    }
}

/// A dm-verity tree every served block is checked against.
#[derive(Debug, Clone)]
pub struct VerityRequest {
    /// The file holding the tree (and its superblock, unless `tree.no_superblock`).
    pub hashfile: PathBuf,
    /// The root hash, hex.
    pub root_hash: String,
    /// Where the tree is in the file and its parameters.
    pub tree: TreeOptions,
}

/// What to serve and how. [`ServeRequest::new`] sets the defaults of `vabc serve`.
#[derive(Debug, Clone)]
pub struct ServeRequest {
    /// The base image (file or block device).
    pub base: PathBuf,
    /// The COW.
    pub cow: PathBuf,
    /// The served size (default: the manifest's new image, else the base's).
    pub size: Option<u64>,
    /// The update's manifest (default: `COW.manifest` when it exists).
    pub manifest: Option<PathBuf>,
    /// Serve without checking the base against the manifest.
    pub no_base_check: bool,
    /// Export a FUSE file in this folder.
    pub fuse: Option<PathBuf>,
    /// How the FUSE export talks to the kernel.
    pub fuse_transport: FuseTransport,
    /// How long a FUSE io_uring queue polls before it sleeps.
    pub fuse_uring_poll: Duration,
    /// Threads reading /dev/fuse.
    pub fuse_threads: usize,
    /// A loop device over the FUSE file.
    pub loop_dev: bool,
    /// Mount the image's file system here (through FUSE and a loop device).
    pub mount: Option<PathBuf>,
    /// The file system to mount (default: detected).
    pub fstype: Option<FsType>,
    /// An NBD server at this address (`unix:PATH` or `tcp:HOST:PORT`).
    pub nbd: Option<String>,
    /// The NBD export's settings.
    pub nbd_settings: NbdSettings,
    /// A ublk block device.
    pub ublk: bool,
    /// ublk queues (0: one per CPU).
    pub ublk_queues: u16,
    /// ublk queue depth.
    pub ublk_depth: u16,
    /// Worker threads of each frontend.
    pub workers: usize,
    /// Decode threads (0: one per CPU).
    pub decode_threads: usize,
    /// How decode work is handed out.
    pub decode_pool: engine::PoolDesign,
    /// Threads reading the base and the COW.
    pub io_threads: usize,
    /// Decoded-unit cache, in bytes.
    pub cache_bytes: usize,
    /// Read the base through the page cache instead of `O_DIRECT`.
    pub buffered: bool,
    /// Record when decode work waited, for a later look.
    pub sample_queue_delays: bool,
    /// Check every block against this dm-verity tree.
    pub verity: Option<VerityRequest>,
    /// Tree options given without a tree: refused (a tree must be named).
    pub tree_options_without_tree: bool,
    /// Merge into the base while serving.
    pub merge: bool,
}

impl ServeRequest {
    /// Serve `cow` over `base` with the defaults of `vabc serve` and no frontend yet.
    pub fn new(base: PathBuf, cow: PathBuf) -> ServeRequest {
        ServeRequest {
            base,
            cow,
            size: None,
            manifest: None,
            no_base_check: false,
            fuse: None,
            fuse_transport: FuseTransport::Auto,
            fuse_uring_poll: serve::fuse::uring::DEFAULT_POLL,
            fuse_threads: 1,
            loop_dev: false,
            mount: None,
            fstype: None,
            nbd: None,
            nbd_settings: NbdSettings::default(),
            ublk: false,
            ublk_queues: 0,
            ublk_depth: 64,
            workers: 16,
            decode_threads: 0,
            decode_pool: engine::PoolDesign::default(),
            io_threads: 8,
            cache_bytes: 64 << 20,
            buffered: false,
            sample_queue_delays: false,
            verity: None,
            tree_options_without_tree: false,
            merge: false,
        }
    }
}

/// Starts a merge that waits for a word from elsewhere (the device's mark-good), and
/// hears when it completed.
pub struct MergeTrigger {
    /// Polled while serving: true once the merge should start.
    pub start: Box<dyn FnMut() -> bool + Send>,
    /// Called once, when the merge has completed.
    pub done: Box<dyn FnMut() -> Result<()> + Send>,
    /// Checks each block of a published scratch window before it is served or
    /// written ([`merge::Merge::with_scratch_check`]).
    pub scratch_check: Option<merge::BlockCheck>,
}

/// A server made ready by [`prepare`]: checked, its engine open, its frontends not
/// started yet.
pub struct Prepared {
    req: ServeRequest,
    pre: Preflight,
    engine: CowEngine,
    merge_job: Option<MergeJob>,
    armed: bool,
}

/// Checks the request and the update, opens the engine and makes a started or armed
/// merge ready (`trigger`: one that starts when it says). `say` hears what is set up,
/// one line each.
pub fn prepare(
    req: &ServeRequest,
    trigger: Option<&MergeTrigger>,
    say: &mut dyn FnMut(&str),
) -> Result<Prepared> {
    let pre = Preflight::check(req)?;
    // Best effort, and nothing a user can act on when it is refused (it needs
    // CAP_SYS_RESOURCE, which containers often drop): no message.
    let _ = serve::set_io_flusher();
    let (progress, manifest) = check_before_serving(req)?;
    let opts = CowEngineOptions {
        size: req.size.or(manifest.as_ref().map(|m| m.new.size)),
        cache_bytes: req.cache_bytes,
        decode_threads: req.decode_threads,
        decode_pool: req.decode_pool,
        direct_io: !req.buffered,
        io_threads: req.io_threads,
    };
    let mut engine = CowEngine::open(&req.base, &req.cow, &opts)
        .map_err(serve::ServeError::from)
        .with_context(|| {
            format!(
                "cannot serve {} + {}",
                req.base.display(),
                req.cow.display()
            )
        })?;
    // Even without a merge asked for, a COW that is partly merged (an interrupted
    // merge) must be served through its merge state: merged sources may be gone.
    let merge_job = MergeJob::prepare(
        req,
        &mut engine,
        progress.started(),
        manifest.as_ref(),
        trigger.is_some(),
        trigger.and_then(|t| t.scratch_check.clone()),
    )?;
    let size = engine.size();
    if let Some(check) = open_verity(req, size, say)? {
        engine.set_verifier(check);
    }
    if req.sample_queue_delays {
        engine.stats().queue_delays.sample();
    }
    Ok(Prepared {
        req: req.clone(),
        pre,
        engine,
        merge_job,
        armed: trigger.is_some(),
    })
}

impl Prepared {
    /// The served size in bytes.
    pub fn size(&self) -> u64 {
        self.engine.size()
    }

    /// Starts the frontends; `say` hears each one, one line each.
    pub fn start(self, say: &mut dyn FnMut(&str)) -> Result<Server> {
        let engine = Arc::new(self.engine);
        let stats = Stats {
            engine: engine.clone(),
            fuse: Arc::default(),
            nbd: Arc::default(),
            ublk: Arc::default(),
            readahead: Arc::default(),
        };
        let size = engine.size();
        let fronts = Frontends::start(&self.req, self.pre, engine, &stats, say)?;
        let merge_job = match self.merge_job {
            Some(job) if self.req.merge => Some(job.start()),
            Some(job) if self.armed => Some(job),
            _ => None,
        };
        Ok(Server {
            fronts,
            stats,
            merge_job,
            size,
        })
    }
}

/// Frontends serving an update.
pub struct Server {
    fronts: Frontends,
    stats: Stats,
    merge_job: Option<MergeJob>,
    size: u64,
}

/// Where a server can be reached (`vabc serve --ready-file`).
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct Ready {
    /// The serving process.
    pub pid: u32,
    /// The served size in bytes.
    pub size: u64,
    /// The block device (ublk, or the loop device over the FUSE file).
    pub block_device: Option<PathBuf>,
    /// The NBD server's address.
    pub nbd_address: Option<String>,
    /// The exported FUSE file.
    pub fuse_file: Option<PathBuf>,
    /// Where the file system is mounted.
    pub mount_target: Option<PathBuf>,
}

/// Which frontend went away underneath a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// The ublk device was stopped from outside.
    Ublk,
    /// The FUSE export was unmounted from outside.
    Fuse,
}

/// How serving ended (besides the stop flag), and the server to stop.
pub struct Ended {
    /// The server, still up.
    pub server: Server,
    /// A frontend that went away underneath.
    pub lost: Option<Lost>,
    /// The merge's failure (serving stayed correct).
    pub merge_failed: Option<Error>,
}

impl Server {
    /// The served size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Where the server can be reached.
    pub fn ready(&self) -> Ready {
        let f = &self.fronts;
        Ready {
            pid: std::process::id(),
            size: self.size,
            block_device: f
                .ublk
                .as_ref()
                .map(|u| u.block_path())
                .or_else(|| f.loop_dev.as_ref().map(|l| l.path().to_path_buf())),
            nbd_address: f.nbd_uri.clone(),
            fuse_file: f.fuse_file(),
            mount_target: f.stack.as_ref().map(|s| s.target().to_path_buf()),
        }
    }

    /// What a killed server would leave in the kernel, for `vabc cleanup`.
    pub fn leftovers(&self) -> Result<serve::leftovers::Record> {
        Ok(self.fronts.leftovers()?)
    }

    /// The layers' latency counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Serves until `stop` is set or a frontend goes away underneath; runs the merge
    /// meanwhile (started by `trigger` when it has not started yet) and stops it at its
    /// next commit at the end. `tick` runs every 100 ms (a caller prints the
    /// [`Stats`] when asked, say).
    pub fn serve_until_stopped(
        mut self,
        mut trigger: Option<MergeTrigger>,
        stop: &AtomicBool,
        tick: &mut dyn FnMut(&Stats),
    ) -> Ended {
        let mut lost = None;
        let mut merge_failed = None;
        let mut merge_job = self.merge_job.take();
        // When the completed merge's record (`trigger.done`) is next tried: it can
        // fail for a while (a full data partition) and is tried again until it holds,
        // so that the space freed is all the device needs.
        let mut record_done_at: Option<std::time::Instant> = None;
        while !stop.load(Ordering::Relaxed) {
            if let Some(t) = trigger.as_mut()
                && merge_job.as_ref().is_some_and(|j| !j.started())
                && (t.start)()
            {
                merge_job = merge_job.map(MergeJob::start);
            }
            if let Some(job) = merge_job.take_if(|j| j.is_finished()) {
                match job.join() {
                    Ok(r) => {
                        log::info!(
                            "vabc serve: merge complete: {} ops ({} this run); the base is now the new image",
                            r.total_ops,
                            r.merged - r.started_at
                        );
                        if trigger.is_some() {
                            record_done_at = Some(std::time::Instant::now());
                        }
                    }
                    Err(e) => {
                        log::warn!("vabc serve: merge failed: {}", crate::error::chain(&e));
                        merge_failed = Some(e);
                    }
                }
            }
            if let Some(t) = trigger.as_mut()
                && record_done_at.is_some_and(|at| at <= std::time::Instant::now())
            {
                match (t.done)() {
                    Ok(()) => {
                        record_done_at = None;
                        merge_failed = None;
                    }
                    Err(e) => {
                        log::warn!(
                            "vabc serve: after the merge: {}; tried again in {} s",
                            crate::error::chain(&e),
                            RECORD_RETRY.as_secs()
                        );
                        record_done_at = Some(std::time::Instant::now() + RECORD_RETRY);
                        merge_failed = Some(e);
                    }
                }
            }
            if let Some(l) = self.fronts.lost() {
                lost = Some(l);
                break;
            }
            tick(&self.stats);
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
                Err(e) => merge_failed = Some(e),
            }
        }
        Ended {
            server: self,
            lost,
            merge_failed,
        }
    }

    /// Tears everything down, in reverse order of the start; the first error wins.
    /// The counters stay readable.
    pub fn stop(self) -> (Result<()>, Stats) {
        (self.fronts.stop(), self.stats)
    }
}

/// How long after a failed record of a completed merge it is tried again.
const RECORD_RETRY: Duration = Duration::from_secs(5);

/// What is checked and opened before anything is read: bad options and a missing
/// driver fail here, before the engine's work.
struct Preflight {
    nbd_addr: Option<NbdAddr>,
    nbd_tls: Option<Arc<serve::nbd::TlsConfig>>,
    ublk_transport: Option<serve::ublk::KernelTransport>,
    fuse_uring: bool,
}

impl Preflight {
    fn check(req: &ServeRequest) -> Result<Preflight> {
        let nbd_addr: Option<NbdAddr> = req.nbd.as_deref().map(str::parse).transpose()?;
        let nbd_tls = match (&req.nbd_settings.tls, &nbd_addr) {
            (Some(_), Some(NbdAddr::Unix(_))) => {
                invalid!(
                    "--nbd-tls-cert is for tcp: addresses (a unix socket is guarded by its mode)"
                )
            }
            (Some((cert, key)), _) => Some(serve::nbd::tls_config(
                cert,
                key,
                req.nbd_settings.tls_verify_peer.as_deref(),
            )?),
            _ => None,
        };
        // Before any work: a missing driver is the likely failure.
        let ublk_transport = match req.ublk {
            true => Some(serve::ublk::KernelTransport::open().map_err(serve::ServeError::from)?),
            false => None,
        };
        if let Some(t) = &req.mount
            && !t.is_dir()
        {
            invalid!(
                "mount point {} does not exist or is not a directory",
                t.display()
            );
        }
        Ok(Preflight {
            nbd_addr,
            nbd_tls,
            ublk_transport,
            fuse_uring: use_fuse_uring(req)?,
        })
    }
}

/// Whether the FUSE export goes over io_uring. Asked for explicitly, the rings must be
/// available; `Auto` falls back to /dev/fuse, saying so when root could switch them on.
fn use_fuse_uring(req: &ServeRequest) -> Result<bool> {
    let wants_fuse = req.fuse.is_some() || req.mount.is_some();
    match req.fuse_transport {
        FuseTransport::Classic => Ok(false),
        FuseTransport::Uring => {
            if !wants_fuse {
                invalid!(
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

/// Before serving a byte: the base must be the one the update was made for (or, once
/// merged, the new image), and the COW's merge state must be sane. Returns the merge's
/// progress and the update's manifest, if it has one.
fn check_before_serving(
    req: &ServeRequest,
) -> Result<(merge::progress::Progress, Option<manifest::Manifest>)> {
    let cow = cow::CowReader::open(&req.cow)
        .with_context(|| format!("cannot read COW {}", req.cow.display()))?;
    let progress = merge::progress::read(&cow)?;
    if progress.started() {
        // A merge records its progress in the COW: say what that means here.
        log::info!(
            "vabc serve: {}: merge {progress}; serving through the merge state",
            req.cow.display()
        );
    }
    let manifest = match req.no_base_check {
        true => None,
        false => crate::trust::load_manifest(req.manifest.as_deref(), &req.cow, &cow)?,
    };
    if let Some(m) = &manifest {
        let base =
            std::fs::File::open(&req.base).map_err(|e| Error::io("open base", &req.base, e))?;
        crate::trust::check_base(m, progress, &cow, &base, &req.base)?;
        // Nothing wrong is served: without a dm-verity tree to check each block as it
        // is read, prove the whole result first (a full decode pass; the base of a
        // started merge is checked above, and its COW was proven before it began).
        if !progress.started() && req.verity.is_none() {
            let t = std::time::Instant::now();
            crate::trust::prove_result(Some(m), &cow, &base, &req.base, req.size)?;
            log::info!(
                "vabc serve: checked: base + COW make the update's new image ({:.2} s; \
                 --verity-hash checks each block as it is read instead)",
                t.elapsed().as_secs_f64()
            );
        }
    }
    Ok((progress, manifest))
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
        req: &ServeRequest,
        pre: Preflight,
        engine: Arc<CowEngine>,
        stats: &Stats,
        say: &mut dyn FnMut(&str),
    ) -> Result<Frontends> {
        let dev: Arc<dyn BlockDevice> = engine;
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
            fronts.start_nbd(req, addr, pre.nbd_tls.clone(), &dev, stats, &readahead, say)?;
        }
        if let Some(t) = pre.ublk_transport {
            let opts = serve::ublk::UblkOptions {
                queues: req.ublk_queues,
                depth: req.ublk_depth,
                workers: req.workers,
                readahead: readahead.clone(),
                latency: stats.ublk.clone(),
                ..Default::default()
            };
            let d = serve::ublk::UblkDevice::start(dev.clone(), t, &opts)
                .map_err(serve::ServeError::from)?;
            let p = d.params();
            say(&format!(
                "block device {} ({} queues of depth {}, read-only)",
                d.block_path().display(),
                p.queues,
                p.depth
            ));
            fronts.ublk = Some(d);
        }
        let fuse_opts = FuseOptions {
            dev_threads: req.fuse_threads.max(req.workers),
            uring: pre.fuse_uring.then(|| serve::fuse::uring::UringOptions {
                poll: req.fuse_uring_poll,
                ..serve::fuse::uring::UringOptions::with_workers(req.workers)
            }),
            latency: stats.fuse.clone(),
            readahead,
            ..FuseOptions::default()
        };
        if let Some(target) = &req.mount {
            fronts.start_mount(req, target, &dev, fuse_opts, pre.fuse_uring, say)?;
        } else if let Some(dir) = &req.fuse {
            let f = FuseExport::mount(dev.clone(), dir, &fuse_opts)?;
            let (queues, threads) = f.queues();
            let how = if f.over_io_uring() {
                format!("over FUSE io_uring ({queues} queues, {threads} threads)")
            } else {
                format!("through /dev/fuse ({} threads)", f.dev_threads())
            };
            say(&format!(
                "exporting {} ({} bytes) {how}",
                f.file_path().display(),
                dev.size()
            ));
            fronts.fuse = Some(f);
        }
        if let (Some(file), true) = (fronts.fuse_file(), req.loop_dev) {
            let lo = serve::mount::LoopDevice::attach(&file, true)?;
            say(&format!(
                "block device {} over {} (direct I/O {})",
                lo.path().display(),
                file.display(),
                if lo.direct_io() { "on" } else { "off" }
            ));
            fronts.loop_dev = Some(lo);
        }
        Ok(fronts)
    }

    #[allow(clippy::too_many_arguments)]
    fn start_nbd(
        &mut self,
        req: &ServeRequest,
        addr: &NbdAddr,
        tls: Option<Arc<serve::nbd::TlsConfig>>,
        dev: &Arc<dyn BlockDevice>,
        stats: &Stats,
        readahead: &Option<engine::ReadaheadOptions>,
        say: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let s = &req.nbd_settings;
        let nbd_opts = NbdOptions {
            export_name: s.export_name.clone(),
            workers: req.workers,
            latency: stats.nbd.clone(),
            readahead: readahead.clone(),
            max_connections: s.max_connections.max(1),
            handshake_timeout: s.handshake_timeout,
            idle_timeout: s.idle_timeout,
            write_timeout: s.write_timeout,
            socket_mode: s.socket_mode,
            tls,
            ..NbdOptions::default()
        };
        let server = NbdServer::bind(addr, dev.clone(), &nbd_opts)?;
        let uri = server.addr().to_string();
        self.nbd = Some(server.spawn()?);
        say(&format!("NBD export {:?} at {uri}", s.export_name));
        self.nbd_uri = Some(uri);
        Ok(())
    }

    fn start_mount(
        &mut self,
        req: &ServeRequest,
        target: &Path,
        dev: &Arc<dyn BlockDevice>,
        fuse: FuseOptions,
        fuse_uring: bool,
        say: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let mopts = MountOptions {
            fstype: req.fstype,
            fuse_dir: req.fuse.clone(),
            fuse,
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
        say(&format!(
            "mounted {} read-only on {} via {via}, FUSE {}",
            s.fstype().name(),
            s.target().display(),
            if fuse_uring {
                "over io_uring"
            } else {
                "through /dev/fuse"
            }
        ));
        self.stack = Some(s);
        Ok(())
    }

    /// The exported FUSE file, under the mount stack or on its own.
    fn fuse_file(&self) -> Option<PathBuf> {
        self.stack
            .as_ref()
            .and_then(|s| s.fuse().map(|f| f.file_path().to_path_buf()))
            .or_else(|| self.fuse.as_ref().map(|f| f.file_path().to_path_buf()))
    }

    /// A frontend that went away underneath.
    fn lost(&self) -> Option<Lost> {
        if self.ublk.as_ref().is_some_and(|u| !u.is_alive()) {
            return Some(Lost::Ublk);
        }
        if !(self.stack.as_ref().is_none_or(MountStack::is_alive)
            && self.fuse.as_ref().is_none_or(FuseExport::is_alive))
        {
            return Some(Lost::Fuse);
        }
        None
    }

    /// What a killed daemon would leave in the kernel, for `vabc cleanup`.
    fn leftovers(&self) -> std::result::Result<serve::leftovers::Record, serve::ServeError> {
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

    /// Tears everything down, in reverse order of the start; the first error wins.
    fn stop(mut self) -> Result<()> {
        let mut result = Ok(());
        if let Some(lo) = self.loop_dev.take() {
            result = lo.detach().context("detach the loop device");
        }
        if let Some(s) = self.stack.take() {
            result = result.and(s.teardown().context("tear down the mount stack"));
        }
        if let Some(f) = self.fuse.take() {
            let r = f.unmount().context("unmount the FUSE export");
            result = result.and(r);
        }
        if let Some(u) = self.ublk.take() {
            let r = u
                .stop()
                .map(drop)
                .map_err(serve::ServeError::from)
                .context("stop the ublk device");
            result = result.and(r);
        }
        if let Some(n) = self.nbd.take() {
            n.stop();
        }
        result
    }
}

/// Where the time of the reads goes, per layer.
pub struct Stats {
    engine: Arc<CowEngine>,
    fuse: Arc<trace::Histogram>,
    nbd: Arc<trace::Histogram>,
    ublk: Arc<trace::Histogram>,
    readahead: Arc<engine::ReadaheadStats>,
}

impl Stats {
    /// The engine, its counters and its recorded queue delays.
    pub fn engine(&self) -> &CowEngine {
        &self.engine
    }

    /// The counters as lines of text, each layer that saw reads.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (what, h) in [
            ("FUSE READs", &self.fuse),
            ("NBD READs", &self.nbd),
            ("ublk READs", &self.ublk),
        ] {
            let s = h.snapshot();
            if s.count > 0 {
                out.push(format!("{what} (arrival to reply): {s}"));
            }
        }
        let e = self.engine.stats();
        out.push(format!(
            "engine reads (read_at, planned reads not included): {}",
            e.reads.snapshot()
        ));
        let checks = e.checks.snapshot();
        if checks.count > 0 {
            out.push(format!("dm-verity checks: {checks}"));
        }
        let waits = e.queue_delays.histogram.snapshot();
        if waits.count > 0 {
            out.push(format!("decode hand-offs (queued to started): {waits}"));
        }
        let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let ra = &self.readahead;
        if n(&ra.hits) + n(&ra.misses) > 0 {
            out.push(format!(
                "read-ahead: {} chunks read ahead ({} failed), {} stream requests answered \
                 from them ({} waited for one), {} read directly",
                n(&ra.chunks),
                n(&ra.failed_chunks),
                n(&ra.hits),
                n(&ra.waits),
                n(&ra.misses)
            ));
        }
        out.push(format!(
            "engine: {} base file reads, {} units decoded, {} unit cache hits, {} requests \
             decoded on the pool, {} MiB read straight into reply buffers",
            n(&e.base_reads),
            n(&e.unit_decodes),
            n(&e.cache_hits),
            n(&e.parallel_requests),
            n(&e.in_place_bytes) >> 20
        ));
        out
    }
}

/// A merge running in the background of the server.
struct MergeJob {
    base: PathBuf,
    cow: PathBuf,
    /// The base and the COW opened for the merge, and its I/O engine, made before
    /// serving starts: a merge started later (after a switch of root has moved the
    /// mounts the paths went through) needs no path.
    files: Option<MergeFiles>,
    status: Arc<merge::MergeStatus>,
    cancel: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<Result<merge::MergeReport>>>,
    /// For a merge not yet started: prove, before its first write, that every op
    /// decodes to the new image (against the manifest when there is one).
    prove: Option<Option<manifest::Manifest>>,
    scratch_check: Option<merge::BlockCheck>,
}

impl MergeJob {
    /// Validate the merge and bring the engine's view of it up to date before the
    /// first read is served (a published scratch window counts). None when there is
    /// nothing to merge-track: no merge asked for or armed, and nothing merged yet.
    fn prepare(
        req: &ServeRequest,
        engine: &mut CowEngine,
        started: bool,
        manifest: Option<&manifest::Manifest>,
        armed: bool,
        scratch_check: Option<merge::BlockCheck>,
    ) -> Result<Option<MergeJob>> {
        if !req.merge && !started && !armed {
            return Ok(None);
        }
        let reader = cow::CowReader::open(&req.cow)?;
        let status = Arc::new(merge::MergeStatus::new());
        let ro = |p: &Path| std::fs::File::open(p).map_err(|e| Error::io("open", p, e));
        let size = cow::view::file_size(&ro(&req.base)?, &req.base)?;
        let m = merge::Merge::new(
            &reader,
            size,
            req.base.clone(),
            merge::MergeOptions::default(),
        )
        .with_context(|| match started {
            true => "the COW is partly merged, but its merge cannot be tracked".to_string(),
            false => format!(
                "cannot merge {} into {}",
                req.cow.display(),
                req.base.display()
            ),
        })?;
        let m = match &scratch_check {
            Some(c) => m.with_scratch_check(c.clone()),
            None => m,
        };
        // Reads only: the device state as the merge left it.
        m.load_status(
            &mut merge::SyncIo::new(ro(&req.base)?, ro(&req.cow)?),
            &status,
        )?;
        engine.set_merge_hook(Arc::new(merge::serving::StatusHook::new(
            &reader,
            status.clone(),
        )?));
        let files = (req.merge || armed)
            .then(|| MergeFiles::open(&req.base, &req.cow))
            .transpose()?;
        Ok(Some(MergeJob {
            base: req.base.clone(),
            cow: req.cow.clone(),
            files,
            status,
            cancel: Arc::new(AtomicBool::new(false)),
            handle: None,
            prove: (!started && !req.no_base_check).then(|| manifest.cloned()),
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
                invalid!("the merge's files were not opened");
            };
            let reader = cow::CowReader::from_file(cow_file, &cow, cow::OpenOptions::default())?;
            if let Some(manifest) = prove {
                crate::trust::prove_result(manifest.as_ref(), &reader, &base_file, &base, None)?;
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

    fn join(mut self) -> Result<merge::MergeReport> {
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| Error::Invalid("the merge thread panicked".into()))?,
            None => invalid!("the merge was never started"),
        }
    }

    fn cancel_and_join(self) -> Result<merge::MergeReport> {
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
    fn open(base: &Path, cow: &Path) -> Result<MergeFiles> {
        let rw = |p: &Path| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .map_err(|e| Error::io("open for the merge", p, e))
        };
        let (b, c) = (rw(base)?, rw(cow)?);
        let clone = |f: &std::fs::File, p: &Path| {
            f.try_clone()
                .map_err(|e| Error::io("duplicate the descriptor of", p, e))
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

/// The verifier for a [`VerityRequest`], checked against the root hash before
/// anything is served.
fn open_verity(
    req: &ServeRequest,
    size: u64,
    say: &mut dyn FnMut(&str),
) -> Result<Option<Arc<dyn engine::BlockVerifier>>> {
    let Some(v) = &req.verity else {
        if req.tree_options_without_tree {
            invalid!("verity tree options need --verity-hash FILE and --root-hash HEX");
        }
        return Ok(None);
    };
    let hashfile = &v.hashfile;
    let root_hex = v.root_hash.trim();
    let root = hex::decode(root_hex)
        .map_err(|e| Error::Invalid(format!("--root-hash {root_hex:?} is not hex: {e}")))?;
    let file = std::fs::File::open(hashfile)
        .map_err(|e| Error::io("open verity hash file", hashfile, e))?;
    let hash_len = cow::view::file_size(&file, hashfile)?;
    let data_name = PathBuf::from(format!("{} + {}", req.base.display(), req.cow.display()));
    let params = v
        .tree
        .resolve(hashfile, &file, hash_len, &data_name, size)?;
    let tree_off = v.tree.tree_offset(&params);
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
    let check = serve::verity::VerityCheck::new(verifier, size).map_err(|e| {
        Error::Invalid(format!("cannot verify against {}: {e}", hashfile.display()))
    })?;
    say(&format!(
        "verifying every block against {} ({} data blocks of {}, {}, root hash {root_hex})",
        hashfile.display(),
        params.data_blocks,
        params.data_block_size,
        params.algorithm,
    ));
    if check.protected_bytes() < size {
        log::warn!(
            "vabc serve: warning: the hash tree covers {} of {size} bytes; reads past it fail with EIO",
            check.protected_bytes()
        );
    }
    Ok(Some(Arc::new(check)))
}
