//! Diagnostics of the data stream's compression: which blocks cost the most when each
//! is compressed alone against its context (`bundle::data::context_offset`), by op
//! kind. Usage: framing OLD NEW
use delta::{BlockImage, BlockOp, ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let old = ImageFile::open(args[1].as_ref(), false)?;
    let new = ImageFile::open(args[2].as_ref(), false)?;
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    println!("census {:?}, hints {}", plan.census, plan.hints.len());
    let bs = 4096u64;
    let mut costs = Vec::new();
    for p in &plan.ops {
        if !matches!(p.op, BlockOp::Xor { .. } | BlockOp::Replace) {
            continue;
        }
        let mut blk = vec![0u8; 4096];
        new.read_at(&mut blk, p.dst * bs)?;
        let src = bundle::data::context_offset(&plan, p.dst).unwrap_or(0);
        let mut ctx = vec![0u8; 4096.min(old.size().saturating_sub(src)) as usize];
        if !ctx.is_empty() {
            old.read_at(&mut ctx, src)?;
        }
        let mut c = zstd::bulk::Compressor::new(19)?;
        c.context_mut()
            .ref_prefix(&ctx)
            .map_err(|e| std::io::Error::other(format!("{e}")))?;
        let z = c.compress(&blk)?.len();
        let hinted = plan.hints.binary_search_by_key(&p.dst, |h| h.0).is_ok();
        costs.push((z, p.dst, p.op, src, hinted));
    }
    let total: usize = costs.iter().map(|c| c.0).sum();
    costs.sort_by_key(|c| std::cmp::Reverse(c.0));
    println!("{} data blocks, {total} bytes alone", costs.len());
    for c in costs.iter().take(25) {
        println!(
            "{:6} bytes  block {:7} {:?} context {} hinted {}",
            c.0, c.1, c.2, c.3, c.4
        );
    }
    Ok(())
}
