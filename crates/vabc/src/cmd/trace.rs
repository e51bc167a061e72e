//! `vabc trace`: block-layer tracing without blktrace (record), btt's breakdown of
//! a trace, ours or blktrace's (report).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use blocktrace::Dev;
use blocktrace::btt::{Analysis, Breakdown, STAGES, Summary};
use blocktrace::tracefs::{RecordOptions, Recorder};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Record the block layer's events (as blktrace does, through tracefs) while a
    /// command runs, for a duration, or until interrupted; write them as blktrace
    /// files (OUTPUT.blktrace.CPU, readable by blkparse and btt) and print the
    /// breakdown.
    Record(RecordArgs),
    /// The breakdown of a trace: ours, or blktrace's files (NAME.blktrace.CPU, or a
    /// `blkparse -d` dump): per device and direction, btt's stages (Q2Q, Q2G, G2I,
    /// Q2M, I2D, M2D, D2C, Q2C), merges, request sizes, seek distances.
    Report(ReportArgs),
    /// What if: issue a trace's requests to one device again, against TARGET, with
    /// one thing changed (--no-sync, --sequential, or the target itself: another
    /// disk, a RAM file system, a served image), and report the time. The requests
    /// keep their recorded queue depth and sync flags; think time is left out.
    /// Writes destroy TARGET's data.
    Replay(ReplayArgs),
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// The trace (as for `report`).
    input: PathBuf,
    /// Where the requests go: a file (created or extended) or a block device not in
    /// use. Its data is overwritten.
    #[arg(long, value_name = "FILE|DEVICE")]
    target: PathBuf,
    /// Which traced device's requests (default: the one with the most).
    #[arg(short, long, value_name = "DEVICE")]
    device: Option<String>,
    /// Leave out cache flushes, pre-flushes and FUA (what do the syncs cost?).
    #[arg(long)]
    no_sync: bool,
    /// Issue the requests in sector order (what does their randomness cost?).
    #[arg(long)]
    sequential: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct RecordArgs {
    /// A block device to trace (a path such as /dev/loop0, or MAJOR:MINOR); repeat
    /// for several. Without one, every device is traced.
    #[arg(short, long = "device", value_name = "DEVICE")]
    devices: Vec<String>,
    /// Where the trace goes: OUTPUT.blktrace.0, OUTPUT.blktrace.1, ... (one per CPU).
    #[arg(short, long, default_value = "trace")]
    output: PathBuf,
    /// Stop after this many seconds (without a command and without this: on Ctrl-C).
    #[arg(long, value_name = "SECONDS")]
    duration: Option<f64>,
    /// Ring buffer per CPU, KiB: raise it when events are reported lost.
    #[arg(long, default_value_t = 8192, value_name = "KIB")]
    buffer_size: u32,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// The command to trace (after `--`); its exit status becomes ours.
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

#[derive(clap::Args)]
struct ReportArgs {
    /// The trace: DIR/NAME for NAME.blktrace.*, a folder holding one trace, or one file.
    input: PathBuf,
    /// Only these devices (paths or MAJOR:MINOR).
    #[arg(short, long = "device", value_name = "DEVICE")]
    devices: Vec<String>,
    /// Also write the trace's bios as a time line (Chrome JSON trace: open it in
    /// ui.perfetto.dev): each a slice from Q to C holding Q2D and D2C.
    #[arg(long, value_name = "FILE.json")]
    perfetto: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    match args.cmd {
        Sub::Record(a) => record(a),
        Sub::Report(a) => report(a),
        Sub::Replay(a) => replay(a),
    }
}

fn replay(a: ReplayArgs) -> Result<ExitCode> {
    use blocktrace::replay;
    let (events, _) = blocktrace::blktrace::read_trace(&a.input)?;
    let dev = match &a.device {
        Some(d) => parse_device(d)?,
        None => replay::busiest_device(&events).with_context(|| {
            format!(
                "{}: no requests were issued in this trace",
                a.input.display()
            )
        })?,
    };
    let items = replay::requests(&events, dev);
    if items.is_empty() {
        bail!(
            "{}: device {dev} issued no requests in this trace",
            a.input.display()
        );
    }
    let opts = replay::Options {
        no_sync: a.no_sync,
        sequential: a.sequential,
    };
    let bar = crate::progress::Progress::new(
        items.len() as u64,
        "replay",
        crate::progress::Unit::Items("requests"),
    );
    let out = replay::replay(&items, &a.target, &opts, |n| bar.set_position(n))?;
    bar.finish();
    if a.json {
        crate::report::print(ReplayReport {
            trace: &a.input,
            device: dev.to_string(),
            target: &a.target,
            no_sync: a.no_sync,
            sequential: a.sequential,
            requests: items.len(),
            outcome: out,
        })?;
    } else {
        println!(
            "replayed {} requests of device {dev} against {}{}{}: {} reads, {} writes, {:.1} MiB, {} cache flushes, {} FUA writes{}: {:.3} s",
            items.len(),
            a.target.display(),
            if a.no_sync { ", without syncs" } else { "" },
            if a.sequential {
                ", in sector order"
            } else {
                ""
            },
            out.reads,
            out.writes,
            out.bytes as f64 / 1048576.0,
            out.syncs,
            out.fua_writes,
            if out.syncs_dropped > 0 {
                format!(" ({} syncs left out)", out.syncs_dropped)
            } else {
                String::new()
            },
            out.seconds
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A device named by path (its device number) or as MAJOR:MINOR.
fn parse_device(s: &str) -> Result<Dev> {
    if let Some((ma, mi)) = s.split_once(':')
        && let (Ok(major), Ok(minor)) = (ma.parse(), mi.parse())
    {
        return Ok(Dev { major, minor });
    }
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let md = std::fs::metadata(s).with_context(|| format!("{s}: no such device"))?;
    if !md.file_type().is_block_device() {
        bail!("{s}: not a block device");
    }
    Ok(Dev::from_rdev(md.rdev()))
}

/// The kernel's name of a device (`loop0`), when it still exists.
fn dev_name(dev: Dev) -> Option<String> {
    let text =
        std::fs::read_to_string(format!("/sys/dev/block/{}:{}/uevent", dev.major, dev.minor))
            .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .map(str::to_string)
}

fn record(a: RecordArgs) -> Result<ExitCode> {
    let devices = a
        .devices
        .iter()
        .map(|d| parse_device(d))
        .collect::<Result<Vec<_>>>()?;
    let (dir, name) = split_output(&a.output)?;
    if let Some(d) = a.duration
        && !(d.is_finite() && d > 0.0)
    {
        bail!("--duration {d}: must be a positive number of seconds");
    }
    // Ctrl-C (or a TERM) ends the recording, not the process: what was recorded is
    // written and reported.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("install signal handler")?;
    }
    let rec = Recorder::start(&RecordOptions {
        devices: devices.clone(),
        buffer_kb: a.buffer_size,
    })?;
    let started = Instant::now();
    let spinner = Spinner::new();
    let mut code = ExitCode::SUCCESS;
    let mut failure = None;
    let mut ended = None;
    if let Some((prog, rest)) = a.command.split_first() {
        match std::process::Command::new(prog).args(rest).spawn() {
            Ok(mut child) => {
                // A thread waits for the command, so that its end is timed exactly
                // (not to a polling interval) while this one keeps the spinner going.
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    let status = child.wait();
                    let _ = tx.send((status, Instant::now()));
                });
                let (status, at) = loop {
                    match rx.recv_timeout(Duration::from_millis(100)) {
                        Ok(done) => break done,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                            spinner.tick(&rec, started)
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                            bail!("lost the wait for {}", prog.to_string_lossy())
                        }
                    }
                };
                ended = Some(at);
                let status = status.context("wait for the command")?;
                if !status.success() {
                    log::warn!("{}: {status}", prog.to_string_lossy());
                    code = ExitCode::from(status.code().map_or(1, |c| c.clamp(1, 255) as u8));
                }
            }
            Err(e) => failure = Some(anyhow::anyhow!("{}: {e}", prog.to_string_lossy())),
        }
    } else {
        let until = a.duration.map(|d| started + Duration::from_secs_f64(d));
        while !stop.load(Ordering::Relaxed) && until.is_none_or(|u| Instant::now() < u) {
            spinner.tick(&rec, started);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let elapsed = ended.unwrap_or_else(Instant::now).duration_since(started);
    spinner.done();
    let recording = rec.stop()?;
    if let Some(e) = failure {
        return Err(e);
    }
    let (files, lost) = save_recording(&dir, &name, &recording)?;
    let events = recording.merged();
    let analysis = Analysis::new(&events);
    let facts = Facts {
        files,
        seconds: Some(elapsed.as_secs_f64()),
        events: events.len(),
        lost_events: Some(lost),
        skipped_records: None,
    };
    print_report(&analysis, &devices, facts, a.json)?;
    Ok(code)
}

/// Writes a recording as DIR/NAME.blktrace.CPU and says what it lost; returns the
/// files and the number of events known lost.
fn save_recording(
    dir: &Path,
    name: &str,
    recording: &blocktrace::tracefs::Recording,
) -> Result<(Vec<PathBuf>, u64)> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut files = Vec::new();
    for (cpu, events) in &recording.per_cpu {
        files.push(blocktrace::blktrace::write_cpu_file(
            dir, name, *cpu, events,
        )?);
    }
    if recording.dropped_pages > 0 {
        log::warn!(
            "the recording kept its first 512 MiB of events per CPU: {} later pages were left out",
            recording.dropped_pages
        );
    }
    let lost = recording.overrun + recording.stats.lost;
    if lost > 0 || recording.stats.lossy_pages > 0 {
        log::warn!(
            "the kernel's trace buffer overflowed: {lost} events lost ({} pages); raise --buffer-size",
            recording.stats.lossy_pages
        );
    }
    Ok((files, lost))
}

/// Writes the time line of `spans` and the analysed bios to `out` (temp file, rename).
fn write_timeline(
    out: &Path,
    spans: &[trace::spans::ThreadSpans],
    analysis: &Analysis,
) -> Result<()> {
    let names = analysis
        .ios
        .iter()
        .map(|io| io.dev)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter_map(|d| dev_name(d).map(|n| (d, n)))
        .collect();
    let trace = blocktrace::timeline::chrome_trace(spans, &analysis.ios, &names);
    Ok(ota::output::write_atomic(
        out,
        &serde_json::to_vec(&trace)?,
    )?)
}

/// A recording of every block device and of vabc's own spans, for `serve --trace`.
pub(crate) struct Timeline {
    recorder: Recorder,
    prefix: PathBuf,
}

impl Timeline {
    pub(crate) fn start(prefix: &Path) -> Result<Timeline> {
        split_output(prefix)?;
        let recorder = Recorder::start(&RecordOptions::default())
            .context("--trace records the block layer through tracefs")?;
        trace::spans::enable();
        Ok(Timeline {
            recorder,
            prefix: prefix.to_path_buf(),
        })
    }

    /// Stops, writes PREFIX.blktrace.CPU and PREFIX.json; returns the latter's path.
    pub(crate) fn finish(self) -> Result<PathBuf> {
        trace::spans::disable();
        let recording = self.recorder.stop()?;
        let spans = trace::spans::take();
        let dropped: u64 = spans.iter().map(|t| t.dropped).sum();
        if dropped > 0 {
            log::warn!(
                "the time line keeps each thread's first 262,144 spans: {dropped} later ones were left out"
            );
        }
        let (dir, name) = split_output(&self.prefix)?;
        save_recording(&dir, &name, &recording)?;
        let analysis = Analysis::with_ios(&recording.merged());
        let out = dir.join(format!("{name}.json"));
        write_timeline(&out, &spans, &analysis)?;
        Ok(out)
    }
}

/// OUTPUT as the folder and the trace's name.
fn split_output(output: &Path) -> Result<(PathBuf, String)> {
    let name = output
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty())
        .with_context(|| format!("{}: not a usable trace name", output.display()))?
        .to_string();
    let dir = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((dir, name))
}

/// Elapsed time and bytes recorded, on a terminal.
struct Spinner(Option<indicatif::ProgressBar>);

impl Spinner {
    fn new() -> Spinner {
        if crate::progress::mode() != crate::progress::Mode::Bar {
            return Spinner(None);
        }
        let bar = indicatif::ProgressBar::new_spinner();
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} recording {elapsed}: {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        Spinner(Some(bar))
    }

    fn tick(&self, rec: &Recorder, _started: Instant) {
        if let Some(bar) = &self.0 {
            bar.set_message(format!("{} KiB of events", rec.bytes_read() / 1024));
            bar.tick();
        }
    }

    fn done(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

fn report(a: ReportArgs) -> Result<ExitCode> {
    let devices = a
        .devices
        .iter()
        .map(|d| parse_device(d))
        .collect::<Result<Vec<_>>>()?;
    let (events, stats) = blocktrace::blktrace::read_trace(&a.input)?;
    let analysis = Analysis::with_ios(&events);
    if let Some(out) = &a.perfetto {
        write_timeline(out, &[], &analysis)?;
    }
    let facts = Facts {
        files: stats.files,
        seconds: None,
        events: events.len(),
        lost_events: None,
        skipped_records: Some(stats.skipped),
    };
    print_report(&analysis, &devices, facts, a.json)?;
    Ok(ExitCode::SUCCESS)
}

fn secs(ns: f64) -> String {
    format!("{:.9}", ns / 1e9)
}

/// Seek distances: how many, mean, median, and the share that were sequential.
fn seek_facts(b: &Breakdown) -> (u64, f64, u64, f64) {
    let mut v = b.seeks.clone();
    v.sort_unstable();
    let n = v.len() as u64;
    if n == 0 {
        return (0, 0.0, 0, 0.0);
    }
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    let seq = v.iter().filter(|&&x| x == 0).count() as f64 / n as f64 * 100.0;
    (n, mean, v[v.len() / 2], seq)
}

/// Stage shares of Q2C's total time (btt's "Device Overhead").
fn shares(sums: &BTreeMap<&str, Summary>) -> Vec<(&'static str, f64)> {
    let q2c = sums.get("Q2C").map_or(0, |s| s.total_ns) as f64;
    ["Q2G", "G2I", "Q2M", "I2D", "D2C"]
        .into_iter()
        .map(|s| {
            (
                s,
                if q2c > 0.0 {
                    sums.get(s).map_or(0, |x| x.total_ns) as f64 / q2c * 100.0
                } else {
                    0.0
                },
            )
        })
        .collect()
}

fn print_report(a: &Analysis, only: &[Dev], facts: Facts, as_json: bool) -> Result<()> {
    let mut devs = Vec::new();
    let mut text = String::new();
    use std::fmt::Write as _;
    let mut current = None;
    for ((dev, dir), b) in &a.parts {
        if !only.is_empty() && !only.contains(dev) {
            continue;
        }
        let sums: BTreeMap<&str, Summary> = STAGES
            .iter()
            .zip(&b.stages)
            .map(|(n, s)| (*n, s.summary()))
            .collect();
        let (seeks, seek_mean, seek_median, sequential) = seek_facts(b);
        let merged_pct = if b.merged + b.issued > 0 {
            b.merged as f64 / (b.merged + b.issued) as f64 * 100.0
        } else {
            0.0
        };
        let share = shares(&sums);
        let secs_span = b.last_ns.saturating_sub(b.first_ns) as f64 / 1e9;
        devs.push(DeviceReport {
            device: dev.to_string(),
            name: dev_name(*dev),
            direction: dir.to_string(),
            stages: sums.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            stage_share_of_q2c_pct: share.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            queued: b.queued,
            issued: b.issued,
            merged: b.merged,
            merged_pct,
            completed: b.completed,
            bytes_completed: b.bytes_completed,
            seconds: secs_span,
            request_sectors: b.sizes.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            seeks: Seeks {
                n: seeks,
                mean_sectors: seek_mean,
                median_sectors: seek_median,
                sequential_pct: sequential,
            },
        });
        if current != Some(*dev) {
            current = Some(*dev);
            let name = dev_name(*dev)
                .map(|n| format!(" ({n})"))
                .unwrap_or_default();
            let _ = writeln!(
                text,
                "==================== device {dev}{name} ===================="
            );
        }
        // A device that only read (or only wrote): its "all" is that direction again.
        if *dir == "all" && a.parts.keys().filter(|(d, _)| d == dev).count() == 2 {
            continue;
        }
        let _ = writeln!(
            text,
            "\n{dir}: {} bios queued, {} requests issued, {} completed ({:.1} MiB in {secs_span:.3} s)",
            b.queued,
            b.issued,
            b.completed,
            b.bytes_completed as f64 / 1048576.0
        );
        let _ = writeln!(
            text,
            "{:>5} {:>13} {:>13} {:>13} {:>13} {:>13} {:>9}",
            "", "MIN", "AVG", "MAX", "p50", "p99", "N"
        );
        for (name, s) in STAGES.iter().map(|n| (*n, &sums[n])) {
            if s.n == 0 {
                continue;
            }
            let _ = writeln!(
                text,
                "{name:>5} {:>13} {:>13} {:>13} {:>13} {:>13} {:>9}",
                secs(s.min_ns as f64),
                secs(s.avg_ns),
                secs(s.max_ns as f64),
                secs(s.p50_ns as f64),
                secs(s.p99_ns as f64),
                s.n
            );
        }
        let _ = writeln!(
            text,
            "share of Q2C: {}",
            share
                .iter()
                .map(|(k, v)| format!("{k} {v:.1}%"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let m = if *dir == "write" {
            "wrqm"
        } else if *dir == "read" {
            "rrqm"
        } else {
            "merged"
        };
        let _ = writeln!(text, "merges: {m} {} ({merged_pct:.1}% of bios)", b.merged);
        let _ = writeln!(text, "request sizes: {}", size_histogram(b));
        let _ = writeln!(
            text,
            "seeks: {seeks} (mean {seek_mean:.1} sectors, median {seek_median}), {sequential:.1}% sequential"
        );
    }
    if as_json {
        crate::report::print(TraceReport {
            unmatched_events: a.unmatched,
            devices: devs,
            facts,
        })?;
    } else {
        let mut stdout = std::io::stdout().lock();
        if devs.is_empty() {
            writeln!(
                stdout,
                "no block events{}",
                if only.is_empty() {
                    ""
                } else {
                    " for the devices asked for"
                }
            )?;
        }
        write!(stdout, "{text}")?;
        if a.unmatched > 0 {
            writeln!(
                stdout,
                "\n{} events matched nothing before them (the trace began while they were in flight)",
                a.unmatched
            )?;
        }
    }
    Ok(())
}

/// Issued request sizes in power-of-two KiB buckets.
fn size_histogram(b: &Breakdown) -> String {
    let mut buckets: BTreeMap<u64, u64> = BTreeMap::new();
    for (&sectors, &n) in &b.sizes {
        let kib = (sectors / 2).max(1).next_power_of_two();
        *buckets.entry(kib).or_default() += n;
    }
    if buckets.is_empty() {
        return "none".into();
    }
    buckets
        .iter()
        .map(|(k, n)| format!("≤{k}K {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `vabc trace replay --json`.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct ReplayReport<'a> {
    trace: &'a Path,
    device: String,
    target: &'a Path,
    no_sync: bool,
    sequential: bool,
    requests: usize,
    outcome: blocktrace::replay::Outcome,
}

/// What a trace's events came from.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct Facts {
    /// The blktrace files written (record) or read (report).
    files: Vec<PathBuf>,
    /// How long the recording ran (record).
    #[serde(skip_serializing_if = "Option::is_none")]
    seconds: Option<f64>,
    events: usize,
    /// Events the kernel's buffers dropped (record).
    #[serde(skip_serializing_if = "Option::is_none")]
    lost_events: Option<u64>,
    /// Records of the files that were not block events (report).
    #[serde(skip_serializing_if = "Option::is_none")]
    skipped_records: Option<u64>,
}

/// `vabc trace record --json` and `vabc trace report --json`: btt's breakdown per
/// device and direction.
#[derive(serde::Serialize, schemars::JsonSchema)]
pub(crate) struct TraceReport {
    unmatched_events: u64,
    devices: Vec<DeviceReport>,
    #[serde(flatten)]
    facts: Facts,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
struct DeviceReport {
    device: String,
    name: Option<String>,
    /// "read", "write" or "all".
    direction: String,
    /// Latency per stage (Q2G, G2I, I2D, D2C, Q2C, ...).
    stages: BTreeMap<String, Summary>,
    stage_share_of_q2c_pct: BTreeMap<String, f64>,
    queued: u64,
    issued: u64,
    merged: u64,
    merged_pct: f64,
    completed: u64,
    bytes_completed: u64,
    seconds: f64,
    /// Issued request sizes: sectors to count.
    request_sectors: BTreeMap<String, u64>,
    seeks: Seeks,
}

#[derive(serde::Serialize, schemars::JsonSchema)]
struct Seeks {
    n: u64,
    mean_sectors: f64,
    median_sectors: u64,
    sequential_pct: f64,
}
