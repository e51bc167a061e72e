//! `vabc serve`: expose the new image (base + COW) before merging, through a FUSE file,
//! a full mount stack, or an NBD server. Runs in the foreground until SIGINT/SIGTERM and
//! then tears everything down in reverse order.

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

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("frontend").required(true).multiple(true).args(["fuse", "mount", "nbd"])))]
pub struct Args {
    /// Base (old) image the COW was made against.
    #[arg(long, value_name = "OLD.img")]
    pub base: PathBuf,
    /// COW file of the update.
    #[arg(long, value_name = "UPDATE.cow")]
    pub cow: PathBuf,
    /// Size of the new image in bytes (K/M/G suffixes allowed). Default: the base size,
    /// extended to cover every op.
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Export the new image as DIR/disk.img through FUSE (with --mount: where to put it).
    #[arg(long, value_name = "DIR")]
    pub fuse: Option<PathBuf>,
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
    /// NBD export name (clients asking for the default export "" get it too).
    #[arg(long, default_value = "vabc")]
    pub export_name: String,
    /// Request threads per frontend.
    #[arg(long, default_value_t = 16)]
    pub workers: usize,
    /// Threads reading /dev/fuse.
    #[arg(long, default_value_t = 1)]
    pub fuse_threads: usize,
    /// Decompression threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    pub decode_threads: usize,
    /// Threads issuing the scattered base reads of one large request concurrently.
    #[arg(long, default_value_t = 8)]
    pub io_threads: usize,
    /// Cache for decoded multi-block REPLACE units, in MiB.
    #[arg(long, default_value_t = 64)]
    pub cache_mib: usize,
    /// Read the base through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("invalid size {s:?}"))
}

fn parse_fstype(s: &str) -> Result<FsType, String> {
    s.parse()
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    // Signals first, so one arriving during set-up still ends in a clean tear-down.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("install signal handler")?;
    }
    let nbd_addr: Option<NbdAddr> = args.nbd.as_deref().map(str::parse).transpose()?;
    if let Some(t) = &args.mount
        && !t.is_dir()
    {
        bail!(
            "mount point {} does not exist or is not a directory",
            t.display()
        );
    }
    if let Err(e) = serve::set_io_flusher() {
        eprintln!("vabc serve: warning: PR_SET_IO_FLUSHER: {e} (needs CAP_SYS_RESOURCE)");
    }

    let opts = CowEngineOptions {
        size: args.size,
        cache_bytes: args.cache_mib << 20,
        decode_threads: args.decode_threads,
        direct_io: !args.buffered,
        io_threads: args.io_threads,
    };
    let engine = CowEngine::open(&args.base, &args.cow, &opts).with_context(|| {
        format!(
            "cannot serve {} + {}",
            args.base.display(),
            args.cow.display()
        )
    })?;
    let size = engine.size();
    let dev: Arc<dyn BlockDevice> = Arc::new(engine);

    let fuse_opts = FuseOptions {
        channel_threads: args.fuse_threads,
        workers: args.workers,
        ..FuseOptions::default()
    };
    let nbd = match &nbd_addr {
        Some(addr) => {
            let nbd_opts = NbdOptions {
                export_name: args.export_name.clone(),
                workers: args.workers,
            };
            let server = NbdServer::bind(addr, dev.clone(), &nbd_opts)?;
            let uri = server.addr().to_string();
            let handle = server.spawn()?;
            println!("vabc serve: NBD export {:?} at {uri}", args.export_name);
            Some(handle)
        }
        None => None,
    };
    let mut stack = None;
    let mut fuse = None;
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
            "vabc serve: mounted {} read-only on {} via {via}",
            s.fstype().name(),
            s.target().display()
        );
        stack = Some(s);
    } else if let Some(dir) = &args.fuse {
        let f = FuseExport::mount(dev.clone(), dir, &fuse_opts)?;
        println!(
            "vabc serve: exporting {} ({size} bytes)",
            f.file_path().display()
        );
        fuse = Some(f);
    }
    println!("vabc serve: ready ({size} bytes); stop with Ctrl-C or SIGTERM");
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let mut lost = false;
    while !stop.load(Ordering::Relaxed) {
        let alive = stack.as_ref().is_none_or(MountStack::is_alive)
            && fuse.as_ref().is_none_or(FuseExport::is_alive);
        if !alive {
            lost = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let mut result = Ok(());
    if let Some(s) = stack {
        result = s.teardown().context("tear down the mount stack");
    }
    if let Some(f) = fuse {
        let r = f.unmount().context("unmount the FUSE export");
        result = result.and(r);
    }
    if let Some(n) = nbd {
        n.stop();
    }
    result?;
    if lost {
        bail!("the FUSE export was unmounted from outside; stopped serving");
    }
    eprintln!("vabc serve: stopped, everything unmounted");
    Ok(ExitCode::SUCCESS)
}
