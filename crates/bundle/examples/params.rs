//! Experiment: zstd parameter sets on a sample of the bundle's frames (every STEP-th
//! frame of 1024 blocks against 16 KiB windows of the old image), bytes and seconds
//! for each. Usage: params OLD NEW (env STEP, default 8; SETS; PER_FRAME; MARGIN, the
//! windows' widening in bytes; FB, blocks per frame; GROUP_PREFIX; GAP, windows this
//! close merged; SHOW, each frame's prefix and content sizes; HIST: see `common` and
//! below; CDICT, ATTACH: below).
mod common;

use delta::{ImageFile, NoProgress, PlanOptions};
use zstd::zstd_safe::{CParameter, Strategy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let old = ImageFile::open(args[1].as_ref(), false)?;
    let new = ImageFile::open(args[2].as_ref(), false)?;
    let step: usize = std::env::var("STEP")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    let mut frames = Vec::new();
    let margin: u64 = std::env::var("MARGIN")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16 << 10);
    common::for_each_frame(&plan, &old, &new, margin, step, |p, c| {
        frames.push((p, c));
        Ok(())
    })?;
    println!("{} frames sampled (every {step})", frames.len());
    // HIST: that many bytes of the content before each frame appended to its prefix.
    let hist: usize = std::env::var("HIST")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if hist > 0 {
        let mut before: Vec<u8> = Vec::new();
        for (p, c) in frames.iter_mut() {
            p.extend_from_slice(&before[before.len().saturating_sub(hist)..]);
            before.extend_from_slice(c);
        }
    }
    let sets = std::env::var("SETS").unwrap_or("19".into());
    for set in sets.split(';') {
        // level[,strategy][,slog][,tlen][,clog][,hlog][,mml]
        let f: Vec<i32> = set.split(',').map(|x| x.parse().unwrap()).collect();
        let t = std::time::Instant::now();
        let mut total = 0;
        // CDICT: each prefix loaded once as a dictionary for all the frames that share
        // it (ATTACH=copy|load|default: how zstd uses it; attached by default).
        let cdict = std::env::var("CDICT").is_ok();
        let attach = match std::env::var("ATTACH").as_deref() {
            Ok("copy") => zstd::zstd_safe::DictAttachPref::ForceCopy,
            Ok("load") => zstd::zstd_safe::DictAttachPref::ForceLoad,
            Ok("default") => zstd::zstd_safe::DictAttachPref::DefaultAttach,
            _ => zstd::zstd_safe::DictAttachPref::ForceAttach,
        };
        let mut cd: Option<(&Vec<u8>, zstd::bulk::Compressor)> = None;
        for (prefix, content) in &frames {
            let mut c = zstd::bulk::Compressor::new(f[0])?;
            c.set_parameter(CParameter::WindowLog(26))?;
            let strat = [
                Strategy::ZSTD_fast,
                Strategy::ZSTD_fast,
                Strategy::ZSTD_dfast,
                Strategy::ZSTD_greedy,
                Strategy::ZSTD_lazy,
                Strategy::ZSTD_lazy2,
                Strategy::ZSTD_btlazy2,
                Strategy::ZSTD_btopt,
                Strategy::ZSTD_btultra,
                Strategy::ZSTD_btultra2,
            ];
            let ps = [
                |v| CParameter::SearchLog(v),
                |v| CParameter::TargetLength(v),
                |v| CParameter::ChainLog(v),
                |v| CParameter::HashLog(v),
                |v| CParameter::MinMatch(v),
            ];
            if let Some(&s) = f.get(1).filter(|&&s| s > 0) {
                c.set_parameter(CParameter::Strategy(strat[s as usize]))?;
            }
            for (i, p) in ps.iter().enumerate() {
                if let Some(&v) = f.get(2 + i).filter(|&&v| v > 0) {
                    c.set_parameter(p(v as u32))?;
                }
            }
            let t1 = std::time::Instant::now();
            let n = if cdict {
                // One digested dictionary per distinct prefix (a group's frames share it
                // with GROUP_PREFIX), attached to each frame's search, not copied.
                if cd.as_ref().is_none_or(|(p, _)| !std::ptr::eq(*p, prefix)) {
                    let cx = c.context_mut();
                    cx.set_parameter(CParameter::ForceAttachDict(attach))
                        .map_err(|e| format!("{e}"))?;
                    cx.load_dictionary(prefix).map_err(|e| format!("{e}"))?;
                    cd = Some((prefix, c));
                }
                let (_, c) = cd.as_mut().ok_or("no compressor")?;
                c.compress(content)?.len()
            } else {
                c.context_mut()
                    .ref_prefix(prefix)
                    .map_err(|e| std::io::Error::other(format!("{e}")))?;
                c.compress(content)?.len()
            };
            if std::env::var("PER_FRAME").is_ok() {
                println!(
                    "  frame prefix {} KiB: {n} bytes {:.2} s",
                    prefix.len() >> 10,
                    t1.elapsed().as_secs_f64()
                );
            }
            total += n;
        }
        println!(
            "{set:>24}: {total:>10} bytes {:>6.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
