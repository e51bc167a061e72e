//! Experiment: what the parts of a bundle's plan cost (the merge sequence, the hints),
//! and whether the sequence could be recomputed on the device from the final ops
//! (`delta::order::order_merge` run again). Usage: planparts OLD NEW
use delta::{ImageFile, NoProgress, PlanOptions};
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let old = ImageFile::open(a[1].as_ref(), false)?;
    let new = ImageFile::open(a[2].as_ref(), false)?;
    let plan = delta::plan(&old, &new, &PlanOptions::default(), &NoProgress)?;
    let full = bundle::plan_wire::encode(&plan, 19)?.len();
    let mut p = plan.clone();
    p.sequence.clear();
    let noseq = bundle::plan_wire::encode(&p, 19)?.len();
    p.hints.clear();
    let nohints = bundle::plan_wire::encode(&p, 19)?.len();
    let mut ops = plan.ops.clone();
    let again = delta::order::order_merge(&mut ops);
    println!(
        "plan {full} bytes; without sequence {noseq}; without hints too {nohints}; ops {} seq {} hints {}; recomputed sequence equal: {} converted {}",
        plan.ops.len(),
        plan.sequence.len(),
        plan.hints.len(),
        again.sequence == plan.sequence,
        again.converted
    );
    Ok(())
}
