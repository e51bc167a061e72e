//! A minimal OTA agent built on `ota`: it downloads an update bundle (a file or an
//! http(s):// URL; a cut download resumes), installs it into the device's update
//! store while the old system runs, and reports progress through a callback: a
//! percentage per phase on stderr and, at the end, one JSON line on stdout that a
//! management server could take.
//!
//! ```text
//! agent --store DIR --key PUB.pem --base NAME=DEVICE [--base ...] BUNDLE
//! ```
//!
//! The next boot then runs the update (`vabc update boot` in the initramfs); the new
//! system confirms it with `vabc update mark-good`, or `ota::device::mark_good`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ota::Event;

/// The agent's command line.
struct Options {
    store: PathBuf,
    keys: Vec<PathBuf>,
    bases: Vec<(String, PathBuf)>,
    bundle: PathBuf,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Options, String> {
    let (mut store, mut keys, mut bases, mut bundle) = (None, Vec::new(), Vec::new(), None);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--store" => store = Some(PathBuf::from(value()?)),
            "--key" => keys.push(PathBuf::from(value()?)),
            "--base" => {
                let v = value()?;
                let (name, path) = v.split_once('=').ok_or(format!("--base {v}: NAME=PATH"))?;
                bases.push((name.to_string(), PathBuf::from(path)));
            }
            _ if bundle.is_none() && !arg.starts_with('-') => bundle = Some(PathBuf::from(arg)),
            _ => return Err(format!("unexpected argument {arg:?}")),
        }
    }
    Ok(Options {
        store: store.ok_or("--store DIR is required")?,
        keys,
        bases,
        bundle: bundle.ok_or("the bundle (a file or a URL) is required")?,
    })
}

/// Turns the library's events into lines a person (or a log collector) reads: one
/// per partition, one per phase at every tenth of its work.
struct Reporter {
    phase: Mutex<(&'static str, u64)>,
    done: AtomicU64,
    last_tenth: AtomicU64,
}

impl Reporter {
    fn on(&self, e: Event<'_>) {
        match e {
            Event::Checked(m) => eprintln!(
                "agent: signature, bases and space checked: {} partition(s), release {}",
                m.partitions.len(),
                m.release.version
            ),
            Event::Partition { name, index, count } => {
                eprintln!("agent: partition {name} ({} of {count})", index + 1)
            }
            Event::Start { phase, total } => {
                *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = (phase, total.max(1));
                self.done.store(0, Ordering::Relaxed);
                self.last_tenth.store(0, Ordering::Relaxed);
            }
            Event::Advance(n) => {
                let (phase, total) = *self.phase.lock().unwrap_or_else(|p| p.into_inner());
                let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
                let tenth = (done * 10 / total).min(10);
                if self.last_tenth.fetch_max(tenth, Ordering::Relaxed) < tenth {
                    eprintln!("agent:   {phase}: {}%", tenth * 10);
                }
            }
            Event::Installed(d) => eprintln!(
                "agent: partition {} installed ({} bytes of COW{})",
                d.name,
                d.cow_size,
                if d.resumed_bytes > 0 {
                    ", download resumed"
                } else {
                    ""
                }
            ),
            _ => {}
        }
    }
}

fn run(o: &Options) -> ota::Result<ota::device::DeviceInstall> {
    let keyring = ota::device::Keyring::from_files(&o.keys, Path::new("/etc/vabc/keys"), false);
    let reporter = Reporter {
        phase: Mutex::new(("", 1)),
        done: AtomicU64::new(0),
        last_tenth: AtomicU64::new(0),
    };
    let observer = |e: Event<'_>| reporter.on(e);
    ota::device::install(
        &o.store,
        &o.bundle,
        &o.bases,
        &keyring,
        &ota::device::InstallOptions::default(),
        &observer,
    )
}

fn main() -> std::process::ExitCode {
    let opts = match parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!(
                "agent: {e}\nusage: agent --store DIR --key PUB.pem --base NAME=DEVICE BUNDLE"
            );
            return std::process::ExitCode::from(2);
        }
    };
    match run(&opts) {
        Ok(done) => {
            let report = serde_json::json!({
                "event": "installed",
                "update": done.update.id,
                "state": done.state,
                "partitions": done.partitions.iter().map(|p| &p.name).collect::<Vec<_>>(),
            });
            println!("{report}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("agent: {}", ota::error::chain(&e));
            // A refused update (wrong base, bad signature, an old release) is the
            // server's to know about, not a reason to retry.
            std::process::ExitCode::from(if e.is_mismatch() { 3 } else { 1 })
        }
    }
}
