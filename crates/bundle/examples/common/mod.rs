//! Shared by the experiments: the bundle's frames as `data::record` cuts them (the XOR
//! and REPLACE blocks in plan order, 1024 a frame), each with the old image's windows
//! around its blocks' contexts (`data::context_offset`) widened by `margin` bytes.
use delta::{BlockImage, BlockOp, ImageFile, Plan};

/// Calls `each` with (prefix, content) of every `step`-th frame, one at a time.
pub fn for_each_frame(
    plan: &Plan,
    old: &ImageFile,
    new: &ImageFile,
    margin: u64,
    step: usize,
    mut each: impl FnMut(Vec<u8>, Vec<u8>) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<(), Box<dyn std::error::Error>> {
    let bs = 4096u64;
    let data: Vec<_> = plan
        .ops
        .iter()
        .filter(|p| matches!(p.op, BlockOp::Xor { .. } | BlockOp::Replace))
        .collect();
    for chunk in data.chunks(1024).step_by(step) {
        let mut wins: Vec<(u64, u64)> = chunk
            .iter()
            .map(|p| {
                let c = bundle::data::context_offset(plan, p.dst).unwrap_or(0);
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
        let mut content = vec![0u8; chunk.len() * 4096];
        for (i, p) in chunk.iter().enumerate() {
            new.read_exact_at(&mut content[i * 4096..(i + 1) * 4096], p.dst * bs)?;
        }
        each(prefix, content)?;
    }
    Ok(())
}
