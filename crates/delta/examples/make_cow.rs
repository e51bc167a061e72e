//! Write a COW with explicit planner knobs, for tuning on the corpus:
//! `make_cow OLD NEW OUT VERSION CODEC FACTOR [XOR_MAX_PERCENT] [ANCHOR_BITS]`
//! (XOR_MAX_PERCENT 0 = no XOR; env EST=lz4|zstd:LEVEL picks the XOR/REPLACE
//! estimator, VOTED the voted candidates). Prints census, sizes and times.
use std::path::Path;
use std::time::Instant;

use delta::write::{CowOptions, write_cow};
use delta::{ImageFile, NoProgress, PlanOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 7 {
        return Err(
            "usage: make_cow OLD NEW OUT VERSION CODEC FACTOR [XOR_MAX_PERCENT] [ANCHOR_BITS]"
                .into(),
        );
    }
    let old = ImageFile::open(Path::new(&a[1]), false)?;
    let new = ImageFile::open(Path::new(&a[2]), false)?;
    let compression: cow::Compression = a[5].parse()?;
    let mut p = PlanOptions::for_codec(compression.codec);
    if let Some(x) = a.get(7) {
        p.xor_max_percent = x.parse()?;
        p.xor = p.xor_max_percent > 0;
    }
    if let Some(x) = a.get(8) {
        p.anchor_bits = x.parse()?;
    }
    if let Ok(v) = std::env::var("EST") {
        p.estimator = match v.split_once(':') {
            Some(("zstd", l)) => delta::Estimator::Zstd(l.parse()?),
            _ => delta::Estimator::Lz4,
        };
    }
    if let Ok(v) = std::env::var("VOTED") {
        p.voted_candidates = v.parse()?;
    }
    let t = Instant::now();
    let plan = delta::plan(&old, &new, &p, &NoProgress)?;
    let tp = t.elapsed().as_secs_f64();
    let c = CowOptions {
        version: a[4].parse()?,
        compression,
        compression_factor: a[6].parse()?,
        threads: 0,
        block_order: std::env::var_os("BLOCK_ORDER").is_some(),
    };
    let w = write_cow(&plan, &old, &new, Path::new(&a[3]), &c, &NoProgress)?;
    println!(
        "cow={} replace={} xor={} plan={:.2}s write={:.2}s {:?}",
        w.cow_size, w.replace_bytes, w.xor_bytes, tp, w.seconds, plan.census
    );
    Ok(())
}
