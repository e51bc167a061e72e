//! Experiment: the data stream as frames compressed against their sources (old blocks
//! near each op's source) instead of one XOR stream. Prints sizes for several frame
//! sizes and context widths. Usage: framing OLD NEW
use std::io::Write;

use delta::{BlockImage, BlockOp, ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let old = ImageFile::open(args[1].as_ref(), false)?;
    let new = ImageFile::open(args[2].as_ref(), false)?;
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    let bs = 4096u64;
    let data_ops: Vec<_> = plan
        .ops
        .iter()
        .filter(|p| matches!(p.op, BlockOp::Xor { .. } | BlockOp::Replace))
        .collect();
    let read = |img: &ImageFile, off: u64, n: u64| -> Vec<u8> {
        let end = (off + n).min(img.size());
        let mut v = vec![0u8; (end.saturating_sub(off)) as usize];
        if !v.is_empty() {
            img.read_exact_at(&mut v, off).unwrap();
        }
        v
    };
    // Baseline: one XOR stream.
    let mut e = zstd::stream::write::Encoder::new(Vec::new(), 19)?;
    e.long_distance_matching(true)?;
    e.window_log(27)?;
    for p in &data_ops {
        let mut b = read(&new, p.dst * bs, bs);
        if let BlockOp::Xor { src_offset } = p.op {
            let s = read(&old, src_offset, bs);
            for (d, s) in b.iter_mut().zip(&s) {
                *d ^= s;
            }
        }
        e.write_all(&b)?;
    }
    println!(
        "xor stream: {} bytes ({} blocks)",
        e.finish()?.len(),
        data_ops.len()
    );
    let level: i32 = std::env::var("LEVEL")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(19);
    for &frame in &[256usize, 1024] {
        for &xor_delta in &[false, true] {
            let t = std::time::Instant::now();
            let mut total = 0;
            for chunk in data_ops.chunks(frame) {
                let mut prefix = Vec::new();
                let mut content = Vec::new();
                for p in chunk {
                    let mut b = read(&new, p.dst * bs, bs);
                    match p.op {
                        BlockOp::Xor { src_offset } if xor_delta => {
                            let s = read(&old, src_offset, bs);
                            for (d, s) in b.iter_mut().zip(&s) {
                                *d ^= s;
                            }
                        }
                        BlockOp::Xor { src_offset } => prefix.extend(read(&old, src_offset, bs)),
                        _ => prefix.extend(read(&old, p.dst * bs, bs)),
                    }
                    content.extend(b);
                }
                let mut c = zstd::bulk::Compressor::new(level)?;
                c.set_parameter(zstd::zstd_safe::CParameter::WindowLog(27))?;
                c.context_mut()
                    .ref_prefix(&prefix)
                    .map_err(|e| std::io::Error::other(format!("{e}")))?;
                total += c.compress(&content)?.len();
            }
            println!(
                "level {level} frames of {frame} blocks, xor as delta {xor_delta}: {total} bytes, {:.1} s",
                t.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}
