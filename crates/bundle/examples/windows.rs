//! Experiment: frames compressed against windows of the old image around each block's
//! context (merged), for several window margins. Usage: windows OLD NEW
use delta::{BlockImage, BlockOp, ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let old = ImageFile::open(args[1].as_ref(), false)?;
    let new = ImageFile::open(args[2].as_ref(), false)?;
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    let bs = 4096u64;
    let data: Vec<_> = plan
        .ops
        .iter()
        .filter(|p| matches!(p.op, BlockOp::Xor { .. } | BlockOp::Replace))
        .collect();
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
        for chunk in data.chunks(1024) {
            let mut wins: Vec<(u64, u64)> = chunk
                .iter()
                .map(|p| {
                    let c = bundle::data::context_offset(&plan, p.dst).unwrap_or(0);
                    (c.saturating_sub(margin), (c + bs + margin).min(old.size()))
                })
                .collect();
            wins.sort();
            let mut merged: Vec<(u64, u64)> = Vec::new();
            for (a, b) in wins {
                match merged.last_mut() {
                    Some(l) if a <= l.1 => l.1 = l.1.max(b),
                    _ => merged.push((a, b)),
                }
            }
            let mut prefix = Vec::new();
            for (a, b) in merged {
                let at = prefix.len();
                prefix.resize(at + (b - a) as usize, 0);
                old.read_exact_at(&mut prefix[at..], a)?;
            }
            prefix_total += prefix.len() as u64;
            let mut content = vec![0u8; chunk.len() * 4096];
            for (i, p) in chunk.iter().enumerate() {
                new.read_exact_at(&mut content[i * 4096..(i + 1) * 4096], p.dst * bs)?;
            }
            let mut c = zstd::bulk::Compressor::new(19)?;
            c.set_parameter(zstd::zstd_safe::CParameter::WindowLog(27))?;
            c.context_mut()
                .ref_prefix(&prefix)
                .map_err(|e| std::io::Error::other(format!("{e}")))?;
            total += c.compress(&content)?.len();
        }
        println!(
            "margin {:>4} KiB: {total} bytes, prefix {} MiB, {:.1} s",
            margin >> 10,
            prefix_total >> 20,
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
