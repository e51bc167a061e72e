//! Experiment: frames compressed against windows of the old image around each block's
//! context (merged), for several window margins. Usage: windows OLD NEW
mod common;

use delta::{ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let old = ImageFile::open(args[1].as_ref(), false)?;
    let new = ImageFile::open(args[2].as_ref(), false)?;
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    for margin in std::env::var("MARGINS")
        .map(|m| {
            m.split(',')
                .map(|x| x.parse::<u64>().unwrap() << 10)
                .collect::<Vec<_>>()
        })
        .unwrap_or(vec![0, 16 << 10, 64 << 10, 256 << 10])
    {
        let t = std::time::Instant::now();
        let mut total = 0;
        let mut prefix_total = 0u64;
        common::for_each_frame(&plan, &old, &new, margin, 1, |prefix, content| {
            prefix_total += prefix.len() as u64;
            let mut c = zstd::bulk::Compressor::new(19)?;
            c.set_parameter(zstd::zstd_safe::CParameter::WindowLog(27))?;
            c.context_mut()
                .ref_prefix(&prefix)
                .map_err(|e| std::io::Error::other(format!("{e}")))?;
            total += c.compress(&content)?.len();
            Ok(())
        })?;
        println!(
            "margin {:>4} KiB: {total} bytes, prefix {} MiB, {:.1} s",
            margin >> 10,
            prefix_total >> 20,
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
