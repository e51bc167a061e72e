//! List the REPLACE runs of a plan with, per run, how many bytes the
//! same-offset OLD block shares and how well lz4 compresses the blocks:
//! `replace_runs OLD NEW`. A diagnostic for planner work.
use std::path::Path;

use delta::{BLOCK_SIZE, BlockImage, BlockOp, ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 3 {
        return Err("usage: replace_runs OLD NEW".into());
    }
    let old = ImageFile::open(Path::new(&a[1]), false)?;
    let new = ImageFile::open(Path::new(&a[2]), false)?;
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    let mut nb = vec![0u8; BLOCK_SIZE];
    let mut ob = vec![0u8; BLOCK_SIZE];
    let reps: Vec<u64> = plan
        .ops
        .iter()
        .filter(|o| o.op == BlockOp::Replace)
        .map(|o| o.dst)
        .collect();
    let mut i = 0;
    while i < reps.len() {
        let mut j = i + 1;
        while j < reps.len() && reps[j] == reps[j - 1] + 1 {
            j += 1;
        }
        let (mut eq, mut c) = (0usize, 0usize);
        for &b in &reps[i..j] {
            new.read_at(&mut nb, b * BLOCK_SIZE as u64)?;
            c += lz4::block::compress(&nb, None, false).map_or(BLOCK_SIZE, |c| c.len());
            if (b + 1) * (BLOCK_SIZE as u64) <= old.size() {
                old.read_at(&mut ob, b * BLOCK_SIZE as u64)?;
                eq += nb.iter().zip(&ob).filter(|(x, y)| x == y).count();
            }
        }
        println!(
            "blocks {}..{} ({}): same-offset equal {}%, lz4 {} B",
            reps[i],
            reps[j - 1] + 1,
            j - i,
            eq * 100 / ((j - i) * BLOCK_SIZE),
            c
        );
        i = j;
    }
    Ok(())
}
