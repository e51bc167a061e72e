//! `vabc-crashreplay`: the disk states a power cut could leave during a run logged by
//! the kernel's dm-log-writes target, listed and made one by one, so that a recovery
//! check (tests/vm/crash.sh) can boot and resume from each.
//!
//! - `info LOG`: the log's entries, flushes, FUA writes and marks.
//! - `plan LOG [--points N|all] [--random N] [--seed S] [--atomic BYTES]`: the
//!   states to check, one JSON object per line: every point where all acknowledged
//!   writes were durable (after each flush and FUA write; or N of them, evenly
//!   spread), and N random cuts in between where the writes a volatile cache held
//!   were lost, kept or torn (between units of `--atomic` bytes, 4 KiB unless told).
//! - `make LOG --device ORIG --state ID -o OUT`: OUT is ORIG (the device as it was
//!   when logging began) with what state ID left on the media; written to a
//!   temporary file, then renamed.
//!
//! A state's id (with the same `--atomic`) is enough to make it again: `p<N>` is the
//! clean cut after the first N entries, `r<SEED>.<I>` the I-th random cut drawn with
//! SEED.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use serde::Serialize;
use writelog::{CrashState, Log, Op};

#[derive(Parser)]
#[command(
    version,
    about = "Power-cut states of a dm-log-writes log, listed and made"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// What the log holds: entries, writes, flushes, FUA writes and marks (JSON).
    Info { log: PathBuf },
    /// The states to check, one JSON object per line.
    Plan {
        log: PathBuf,
        /// The clean cuts at durable points: `all`, or this many evenly spread
        /// (always the first and the last).
        #[arg(long, default_value = "all")]
        points: String,
        /// Random cuts between the durable points.
        #[arg(long, default_value_t = 0)]
        random: usize,
        /// The random cuts' seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Bytes the disk writes all or nothing (torn writes tear between these).
        #[arg(long, default_value_t = writelog::ATOMIC_UNIT)]
        atomic: u64,
    },
    /// Makes one state's device image.
    Make {
        log: PathBuf,
        /// The device as it was when logging began.
        #[arg(long)]
        device: PathBuf,
        /// A state id from `plan`.
        #[arg(long)]
        state: String,
        /// Where the image goes (replaced whole).
        #[arg(short, long)]
        output: PathBuf,
        /// Bytes the disk writes all or nothing: as `plan` was given.
        #[arg(long, default_value_t = writelog::ATOMIC_UNIT)]
        atomic: u64,
    },
}

/// One planned state, as `plan` prints it.
#[derive(Serialize)]
struct Planned<'a> {
    id: String,
    /// Entries the device had completed.
    acknowledged: usize,
    /// Entries a flush had made durable.
    durable: usize,
    /// Unflushed writes lost whole, and torn.
    dropped: usize,
    torn: usize,
    /// The last mark logged before the cut (the phase of the run), or "".
    phase: &'a str,
}

#[derive(Serialize)]
struct Info<'a> {
    entries: usize,
    writes: usize,
    written_bytes: u64,
    discards: usize,
    flushes: usize,
    fua: usize,
    durable_points: usize,
    device_len: u64,
    sector_size: u32,
    /// Each mark and the entry it is at.
    marks: Vec<(&'a str, usize)>,
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Info { log } => info(&Log::open(&log)?),
        Cmd::Plan {
            log,
            points,
            random,
            seed,
            atomic,
        } => plan(&Log::open(&log)?, &points, random, seed, atomic),
        Cmd::Make {
            log,
            device,
            state,
            output,
            atomic,
        } => make(&Log::open(&log)?, &log, &device, &state, &output, atomic),
    }
}

fn info(log: &Log) -> Result<()> {
    let e = log.entries();
    let mut info = Info {
        entries: e.len(),
        writes: 0,
        written_bytes: 0,
        discards: 0,
        flushes: e.iter().filter(|e| e.flush).count(),
        fua: e.iter().filter(|e| e.fua).count(),
        durable_points: log.durable_points().len(),
        device_len: log.device_len(),
        sector_size: log.sector_size(),
        marks: Vec::new(),
    };
    for (i, entry) in e.iter().enumerate() {
        match &entry.op {
            Op::Write { len, .. } => {
                info.writes += 1;
                info.written_bytes += len;
            }
            Op::Discard { .. } => info.discards += 1,
            Op::Mark(name) => info.marks.push((name, i)),
            Op::Flush => {}
        }
    }
    println!("{}", serde_json::to_string_pretty(&info)?);
    Ok(())
}

fn plan(log: &Log, points: &str, random: usize, seed: u64, atomic: u64) -> Result<()> {
    let all = log.durable_points();
    let chosen: Vec<usize> = match points {
        "all" => all,
        n => {
            let n: usize = n
                .parse()
                .with_context(|| format!("--points {n:?}: `all` or a count"))?;
            spread(&all, n)
        }
    };
    let mut out = std::io::stdout().lock();
    let mut say = |id: String, s: &CrashState| -> Result<()> {
        let p = Planned {
            id,
            acknowledged: s.acknowledged,
            durable: s.durable,
            dropped: s.dropped,
            torn: s.torn,
            phase: phase(log, s.acknowledged),
        };
        writeln!(out, "{}", serde_json::to_string(&p)?)?;
        Ok(())
    };
    for ack in chosen {
        say(format!("p{ack}"), &log.clean_state(ack))?;
    }
    for i in 0..random {
        let id = format!("r{seed}.{i}");
        say(id.clone(), &state_of(log, &id, atomic)?)?;
    }
    Ok(())
}

/// `n` of `points`, evenly spread, the first and the last among them.
fn spread(points: &[usize], n: usize) -> Vec<usize> {
    if n >= points.len() {
        return points.to_vec();
    }
    if n == 0 {
        return Vec::new();
    }
    if n == 1 {
        return points.last().copied().into_iter().collect();
    }
    let mut v: Vec<usize> = (0..n)
        .map(|k| points[k * (points.len() - 1) / (n - 1)])
        .collect();
    v.dedup();
    v
}

/// The last mark logged before the first `acknowledged` entries end.
fn phase(log: &Log, acknowledged: usize) -> &str {
    log.entries()[..acknowledged]
        .iter()
        .rev()
        .find_map(|e| match &e.op {
            Op::Mark(name) => Some(name.as_str()),
            _ => None,
        })
        .unwrap_or("")
}

/// The state a `plan` id names.
fn state_of(log: &Log, id: &str, unit: u64) -> Result<CrashState> {
    if let Some(ack) = id.strip_prefix('p') {
        let ack: usize = ack.parse().with_context(|| format!("state {id:?}"))?;
        if ack > log.entries().len() {
            bail!("state {id:?}: the log has {} entries", log.entries().len());
        }
        return Ok(log.clean_state(ack));
    }
    let Some((seed, i)) = id.strip_prefix('r').and_then(|r| r.split_once('.')) else {
        bail!("state {id:?}: not p<N> or r<SEED>.<I>");
    };
    let (seed, i): (u64, u64) = (
        seed.parse().with_context(|| format!("state {id:?}"))?,
        i.parse().with_context(|| format!("state {id:?}"))?,
    );
    // One generator per state, so that any state is made again from its id alone.
    let mut rng = fastrand::Rng::with_seed(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i);
    Ok(log.random_state(unit, &mut rng))
}

fn make(
    log: &Log,
    log_path: &Path,
    device: &Path,
    id: &str,
    output: &Path,
    atomic: u64,
) -> Result<()> {
    let state = state_of(log, id, atomic)?;
    let len = std::fs::metadata(device)
        .with_context(|| format!("{}", device.display()))?
        .len();
    if log.device_len() > len {
        bail!(
            "{}: {len} bytes, but the log {} writes up to byte {}: not the device it logged",
            device.display(),
            log_path.display(),
            log.device_len()
        );
    }
    let name = output
        .file_name()
        .with_context(|| format!("{}: no file name", output.display()))?;
    let tmp = output.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::copy(device, &tmp)
        .with_context(|| format!("copy {} to {}", device.display(), tmp.display()))?;
    let made = (|| -> Result<()> {
        let src = File::open(log_path).with_context(|| format!("{}", log_path.display()))?;
        let mut dst = OpenOptions::new()
            .write(true)
            .open(&tmp)
            .with_context(|| format!("{}", tmp.display()))?;
        log.apply(&state, &src, &mut dst, &tmp)?;
        Ok(())
    })();
    if let Err(e) = made.and_then(|()| {
        std::fs::rename(&tmp, output)
            .with_context(|| format!("rename {} to {}", tmp.display(), output.display()))
    }) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_keeps_the_ends() {
        let p: Vec<usize> = (1..=10).collect();
        assert_eq!(spread(&p, 3), [1, 5, 10]);
        assert_eq!(spread(&p, 20), p);
        assert_eq!(spread(&p, 1), [10]);
        assert!(spread(&p, 0).is_empty());
    }

    #[test]
    fn ids_make_the_same_state_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, writelog::fuzzing::sample_log()).unwrap();
        let log = Log::open(&path).unwrap();
        for id in ["r1.0", "r1.1", "r9.4"] {
            let a = state_of(&log, id, 512).unwrap();
            assert_eq!(a, state_of(&log, id, 512).unwrap());
        }
        let last = log.entries().len();
        assert_eq!(
            state_of(&log, &format!("p{last}"), 512).unwrap(),
            log.clean_state(last)
        );
        for bad in ["x", "p", "r1", "r.1", &format!("p{}", last + 1)] {
            assert!(state_of(&log, bad, 512).is_err(), "{bad}");
        }
    }

    #[test]
    fn make_refuses_a_device_smaller_than_the_log_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        std::fs::write(&path, writelog::fuzzing::sample_log()).unwrap();
        let log = Log::open(&path).unwrap();
        let small = dir.path().join("small");
        std::fs::write(&small, [0u8; 512]).unwrap();
        let out = dir.path().join("out");
        let id = format!("p{}", log.entries().len());
        let e = make(&log, &path, &small, &id, &out, 4096).unwrap_err();
        assert!(e.to_string().contains("not the device it logged"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);

        let dev = dir.path().join("dev");
        std::fs::write(&dev, vec![0u8; log.device_len() as usize]).unwrap();
        make(&log, &path, &dev, &id, &out, 4096).unwrap();
        let mut want = vec![0u8; log.device_len() as usize];
        log.apply(
            &log.clean_state(log.entries().len()),
            &File::open(&path).unwrap(),
            &mut want,
            &out,
        )
        .unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), want);
    }
}
