//! Print the plan census of an OLD/NEW pair and an estimate of the payload
//! (lz4 per 4 KiB block), for tuning the planner on the corpus:
//! `cargo run --release -p vabc-delta --example plan_stats -- OLD NEW [anchor_bits] [xor_max_percent] [threads]`
use std::path::Path;
use std::time::Instant;

use delta::{BLOCK_SIZE, BlockImage, BlockOp, ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: plan_stats OLD NEW [anchor_bits] [xor_max_percent] [threads]".into());
    }
    let old = ImageFile::open(Path::new(&args[1]), false)?;
    let new = ImageFile::open(Path::new(&args[2]), false)?;
    let mut opts = PlanOptions::default();
    if let Some(a) = args.get(3) {
        opts.anchor_bits = a.parse()?;
    }
    if let Some(p) = args.get(4) {
        opts.xor_max_percent = p.parse()?;
        if opts.xor_max_percent == 0 {
            opts.xor = false;
        }
    }
    if let Some(t) = args.get(5) {
        opts.threads = t.parse()?;
    }
    if std::env::var_os("INDEX_ONLY").is_some() {
        let t = Instant::now();
        let idx = delta::index::OldIndex::build(&old, opts.anchor_bits, &NoProgress)?;
        println!(
            "index: {:.2}s {} anchors",
            t.elapsed().as_secs_f64(),
            idx.anchor_count()
        );
        return Ok(());
    }
    let t0 = Instant::now();
    let plan = delta::plan(&old, &new, &opts, &NoProgress)?;
    let dt = t0.elapsed();
    let mut rep = 0usize;
    let mut xor = 0usize;
    let mut a = vec![0u8; BLOCK_SIZE];
    let mut b = vec![0u8; BLOCK_SIZE];
    for op in &plan.ops {
        match op.op {
            BlockOp::Replace => {
                new.read_at(&mut a, op.dst * BLOCK_SIZE as u64)?;
                rep += lz4::block::compress(&a, None, false)
                    .map_or(BLOCK_SIZE, |c| c.len())
                    .min(BLOCK_SIZE);
            }
            BlockOp::Xor { src_offset } => {
                new.read_at(&mut a, op.dst * BLOCK_SIZE as u64)?;
                old.read_at(&mut b, src_offset)?;
                for (x, y) in a.iter_mut().zip(&b) {
                    *x ^= y;
                }
                xor += lz4::block::compress(&a, None, false)
                    .map_or(BLOCK_SIZE, |c| c.len())
                    .min(BLOCK_SIZE);
            }
            _ => {}
        }
    }
    println!(
        "{:?} cycle_breaks={} index={}KiB time={:.2}s est_lz4: replace={}KB xor={}KB total={}KB",
        plan.census,
        plan.census.cycle_breaks,
        plan.index_bytes / 1024,
        dt.as_secs_f64(),
        rep / 1000,
        xor / 1000,
        (rep + xor) / 1000
    );
    Ok(())
}
