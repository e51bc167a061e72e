//! Dump a plan as text, one op per line (`dst kind source`), for offline
//! analysis of where a COW's bytes go: `plan_dump OLD NEW > plan.tsv`.
use std::io::Write;
use std::path::Path;

use delta::{BlockOp, ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 3 {
        return Err("usage: plan_dump OLD NEW".into());
    }
    let old = ImageFile::open(Path::new(&a[1]), false)?;
    let new = ImageFile::open(Path::new(&a[2]), false)?;
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for o in &plan.ops {
        match o.op {
            BlockOp::Copy { src_block } => writeln!(out, "{}\tC\t{}", o.dst, src_block)?,
            BlockOp::Xor { src_offset } => writeln!(out, "{}\tX\t{}", o.dst, src_offset)?,
            BlockOp::Zero => writeln!(out, "{}\tZ\t0", o.dst)?,
            BlockOp::Replace => writeln!(out, "{}\tR\t0", o.dst)?,
        }
    }
    eprintln!("{:?}", plan.census);
    Ok(())
}
