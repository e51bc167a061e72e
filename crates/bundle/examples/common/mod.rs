//! Shared by the experiments: the bundle's frames as `data::record` cuts them (the XOR
//! and REPLACE blocks in plan order, 1024 a frame, or FB), each with the old image's
//! windows around its blocks' contexts (`data::context_offset`) widened by `margin`
//! bytes (env GAP: windows at most that many bytes apart merged, the gap included;
//! SHOW: print each frame's prefix and content sizes).
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
    let mut data: Vec<_> = plan
        .ops
        .iter()
        .filter(|p| matches!(p.op, BlockOp::Xor { .. } | BlockOp::Replace))
        .collect();
    // MERGE: groups cut from the merge order (as a v3 COW's writer reads), each sorted.
    if std::env::var("MERGE").is_ok() {
        let at = |b: u64| data.binary_search_by_key(&b, |p| p.dst).ok();
        let mut merged: Vec<_> = bundle::data::data_order(plan, true)
            .into_iter()
            .filter_map(|b| at(b).map(|i| data[i]))
            .collect();
        let group: usize = std::env::var("GROUP")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1024);
        for g in merged.chunks_mut(group) {
            g.sort_by_key(|p| p.dst);
        }
        data = merged;
    }
    // Every `step`-th group of 1024 blocks, cut into frames of FB blocks (env; 1024).
    // With GROUP_PREFIX set, each frame's prefix has the windows of its whole group.
    let fb: usize = std::env::var("FB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let group_prefix = std::env::var("GROUP_PREFIX").is_ok();
    let sampled = data
        .chunks(1024)
        .step_by(step)
        .flat_map(|g| g.chunks(fb).map(move |c| (g, c)));
    for (group, chunk) in sampled {
        let around = if group_prefix { group } else { chunk };
        let mut wins: Vec<(u64, u64)> = around
            .iter()
            .map(|p| {
                let c = bundle::data::context_offset(plan, p.dst).unwrap_or(0);
                (c.saturating_sub(margin), (c + bs + margin).min(old.size()))
            })
            .collect();
        wins.sort();
        let gap: u64 = std::env::var("GAP")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (a, b) in wins {
            match merged.last_mut() {
                Some(l) if a <= l.1 + gap => l.1 = l.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        let mut prefix = Vec::new();
        let merged_n = merged.len();
        for (a, b) in merged {
            let at = prefix.len();
            prefix.resize(at + (b - a) as usize, 0);
            old.read_at(&mut prefix[at..], a)?;
        }
        let mut content = vec![0u8; chunk.len() * 4096];
        for (i, p) in chunk.iter().enumerate() {
            new.read_at(&mut content[i * 4096..(i + 1) * 4096], p.dst * bs)?;
        }
        if std::env::var("SHOW").is_ok() {
            println!(
                "  prefix {} KiB in {} windows, content {} KiB",
                prefix.len() >> 10,
                merged_n,
                content.len() >> 10
            );
        }
        each(prefix, content)?;
    }
    Ok(())
}
