//! Merge order at Android's scale: the merge operations of real partitions
//! (update_engine's `testdata/cycle_nodes_*.bin`, each a serialized `PartitionUpdate`)
//! ordered by vabc's `delta::order` and by update_engine's generator as
//! `shared/spec/aosp-cow.md` §6.3 describes it (Kahn's sort on the operations, free
//! ones by destination, a cycle broken by turning the operation with the most
//! remaining successors into REPLACE, XOR first, then the smaller). Prints, per set,
//! the blocks each sends to REPLACE to break cycles and the time each takes, and
//! checks both orders op by op.
//!
//! With `--cow DIR`, also writes the set's COW (v3, lz4) over a synthetic base (each
//! block a distinct pattern; XOR destinations their source with a byte changed) as
//! `DIR/NAME.{base,new}.img` and `DIR/NAME.cow` with its manifest, for `vabc merge`
//! (bench/merge-order.sh).
//!
//! ```text
//! cargo run --release -p vabc-payload --features fuzzing --example merge_order -- \
//!     [--cow DIR] cycle_nodes_product.bin ...
//! ```

use std::collections::BTreeSet;
use std::time::Instant;

use delta::{BlockOp, PlannedOp};
use payload::proto::{CowMergeOperation, CowMergeType, PartitionUpdate};
use prost::Message as _;

const BS: u64 = 4096;

/// One merge operation as the generator sees it: its destination and source runs.
#[derive(Clone, Copy)]
struct Node {
    xor: bool,
    dst: (u64, u64),
    /// Source run, one block longer for an XOR at a byte offset.
    src: (u64, u64),
}

fn nodes(ops: &[CowMergeOperation]) -> Vec<Node> {
    ops.iter()
        .filter_map(|m| {
            let t = CowMergeType::try_from(m.r#type.unwrap_or(0)).ok()?;
            if t == CowMergeType::CowReplace {
                return None;
            }
            let (s, d) = (m.src_extent.as_ref()?, m.dst_extent.as_ref()?);
            let offset = u64::from(m.src_offset.unwrap_or(0));
            Some(Node {
                xor: t == CowMergeType::CowXor,
                dst: (d.start(), d.len()),
                src: (s.start(), d.len() + u64::from(offset != 0)),
            })
        })
        .collect()
}

/// update_engine's ordering as the spec describes it; returns the order (node
/// indices) and the blocks turned into REPLACE.
fn update_engine_order(n: &[Node]) -> (Vec<usize>, u64) {
    // A before B when A's source overlaps B's destination (A reads what B writes).
    let mut by_dst: Vec<usize> = (0..n.len()).collect();
    by_dst.sort_by_key(|&i| n[i].dst.0);
    let starts: Vec<u64> = by_dst.iter().map(|&i| n[i].dst.0).collect();
    let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n.len()];
    let mut indeg = vec![0usize; n.len()];
    for (a, na) in n.iter().enumerate() {
        let (s0, s1) = (na.src.0, na.src.0 + na.src.1);
        // Destinations are disjoint: the ones overlapping [s0, s1) are contiguous in
        // start order, beginning at most one before the first start >= s0.
        let mut k = starts.partition_point(|&st| st < s0).saturating_sub(1);
        while k < by_dst.len() && starts[k] < s1 {
            let b = by_dst[k];
            let (d0, d1) = (n[b].dst.0, n[b].dst.0 + n[b].dst.1);
            if b != a && d0 < s1 && s0 < d1 {
                succ[a].push(b);
                indeg[b] += 1;
            }
            k += 1;
        }
    }
    let mut outdeg: Vec<usize> = succ.iter().map(Vec::len).collect();
    let mut pred: Vec<Vec<usize>> = vec![Vec::new(); n.len()];
    for (a, s) in succ.iter().enumerate() {
        for &b in s {
            pred[b].push(a);
        }
    }
    let mut gone = vec![false; n.len()];
    let mut free: BTreeSet<(u64, usize)> = (0..n.len())
        .filter(|&i| indeg[i] == 0)
        .map(|i| (n[i].dst.0, i))
        .collect();
    let mut order = Vec::new();
    let mut replaced = 0u64;
    let mut left = n.len();
    let remove = |i: usize,
                  gone: &mut Vec<bool>,
                  indeg: &mut Vec<usize>,
                  outdeg: &mut Vec<usize>,
                  free: &mut BTreeSet<(u64, usize)>| {
        gone[i] = true;
        for &b in &succ[i] {
            if !gone[b] {
                indeg[b] -= 1;
                if indeg[b] == 0 {
                    free.insert((n[b].dst.0, b));
                }
            }
        }
        for &a in &pred[i] {
            if !gone[a] {
                outdeg[a] -= 1;
            }
        }
    };
    while left > 0 {
        if let Some((_, i)) = free.pop_first() {
            order.push(i);
            remove(i, &mut gone, &mut indeg, &mut outdeg, &mut free);
            left -= 1;
            continue;
        }
        // A cycle: the pending node with the most remaining successors, XOR first,
        // then the smaller.
        let pick = (0..n.len())
            .filter(|&i| !gone[i])
            .max_by_key(|&i| (outdeg[i], n[i].xor, std::cmp::Reverse(n[i].dst.1)))
            .unwrap_or(0);
        replaced += n[pick].dst.1;
        remove(pick, &mut gone, &mut indeg, &mut outdeg, &mut free);
        left -= 1;
    }
    (order, replaced)
}

/// The merge operations as one op per destination block, ascending.
fn block_ops(name: &str, part: &PartitionUpdate) -> Result<Vec<PlannedOp>, payload::Error> {
    let all = u64::MAX / 8192;
    let mut ops: Vec<PlannedOp> =
        payload::cow::claimed_blocks(name, &part.merge_operations, all, all)?
            .into_iter()
            .map(|(_, dst, op)| PlannedOp { dst, op })
            .collect();
    ops.sort_by_key(|o| o.dst);
    Ok(ops)
}

/// Whether merging `seq` (destination blocks) in order reads no block an earlier
/// op wrote.
fn safe(ops: &[PlannedOp], seq: &[u64]) -> bool {
    let mut written = std::collections::HashSet::new();
    let find = |b: u64| ops.binary_search_by_key(&b, |o| o.dst).ok();
    for &d in seq {
        let Some(i) = find(d) else { return false };
        if delta::ops::source_blocks(&ops[i].op).any(|s| written.contains(&s)) {
            return false;
        }
        written.insert(d);
    }
    true
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let cow_dir = match args.iter().position(|a| a == "--cow") {
        Some(i) => {
            let d = args.get(i + 1).cloned().ok_or("--cow DIR")?;
            args.drain(i..=i + 1);
            Some(std::path::PathBuf::from(d))
        }
        None => None,
    };
    println!(
        "| set | merge ops (COPY / XOR) | blocks (COPY / XOR) | vabc: blocks to REPLACE, ms | update_engine (§6.3): blocks to REPLACE, ms |"
    );
    println!("|---|---|---|---|---|");
    for path in &args {
        let bytes = std::fs::read(path)?;
        let part = PartitionUpdate::decode(&bytes[..])?;
        let n = nodes(&part.merge_operations);
        let name = std::path::Path::new(path)
            .file_stem()
            .map(|s| s.to_string_lossy().replace("cycle_nodes_", ""))
            .unwrap_or_default();
        let (copies, xors) = (
            n.iter().filter(|x| !x.xor).count(),
            n.iter().filter(|x| x.xor).count(),
        );
        let copy_blocks: u64 = n.iter().filter(|x| !x.xor).map(|x| x.dst.1).sum();
        let xor_blocks: u64 = n.iter().filter(|x| x.xor).map(|x| x.dst.1).sum();

        let t = Instant::now();
        let (ue_order, ue_replaced) = update_engine_order(&n);
        let ue_ms = t.elapsed().as_secs_f64() * 1e3;
        let ue_ops = block_ops(&name, &part)?;
        let ue_seq: Vec<u64> = ue_order
            .iter()
            .flat_map(|&i| {
                let x = n[i];
                // A forward shift over itself merges from its end.
                let r: Box<dyn Iterator<Item = u64>> = if x.src.0 < x.dst.0 {
                    Box::new((x.dst.0..x.dst.0 + x.dst.1).rev())
                } else {
                    Box::new(x.dst.0..x.dst.0 + x.dst.1)
                };
                r
            })
            .collect();
        let ue_safe = safe(&ue_ops, &ue_seq);

        let mut ops = block_ops(&name, &part)?;
        let t = Instant::now();
        let ours = delta::order::order_merge(&mut ops);
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let our_safe = safe(&ops, &ours.sequence);
        println!(
            "| {name} | {} ({copies} / {xors}) | {} ({copy_blocks} / {xor_blocks}) | {} ({:.2}%), {ms:.0}{} | {ue_replaced} ({:.2}%), {ue_ms:.0}{} |",
            n.len(),
            copy_blocks + xor_blocks,
            ours.converted,
            ours.converted as f64 * 100.0 / (copy_blocks + xor_blocks).max(1) as f64,
            if our_safe { "" } else { " UNSAFE" },
            ue_replaced as f64 * 100.0 / (copy_blocks + xor_blocks).max(1) as f64,
            if ue_safe { "" } else { " UNSAFE" },
        );
        if let Some(dir) = &cow_dir {
            write_cow(dir, &name, ops, ours.sequence)?;
        }
    }
    Ok(())
}

/// The set's COW over a synthetic base: `DIR/NAME.base.img`, `NAME.new.img`,
/// `NAME.cow` (v3, lz4, 64 KiB units) and its manifest.
fn write_cow(
    dir: &std::path::Path,
    name: &str,
    ops: Vec<PlannedOp>,
    sequence: Vec<u64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let top = ops
        .iter()
        .flat_map(|o| std::iter::once(o.dst).chain(delta::ops::source_blocks(&o.op)))
        .max()
        .unwrap_or(0)
        + 1;
    let size = (top * BS) as usize;
    // Each block a distinct, compressible pattern.
    let mut old = vec![0u8; size];
    for (b, chunk) in old.chunks_mut(BS as usize).enumerate() {
        for (i, w) in chunk.chunks_mut(8).enumerate() {
            w.copy_from_slice(&((b as u64) << 20 | (i as u64 & 0xff)).to_le_bytes());
        }
    }
    let mut new = old.clone();
    let mut census = delta::Census::default();
    for o in &ops {
        let d = (o.dst * BS) as usize;
        match o.op {
            BlockOp::Copy { src_block } => {
                census.copy += 1;
                let s = (src_block * BS) as usize;
                new[d..d + BS as usize].copy_from_slice(&old[s..s + BS as usize]);
            }
            BlockOp::Xor { src_offset } => {
                census.xor += 1;
                let s = src_offset as usize;
                let mut blk = old[s..s + BS as usize].to_vec();
                blk[(o.dst % 4096) as usize] ^= 0x5a;
                new[d..d + BS as usize].copy_from_slice(&blk);
            }
            _ => {
                census.replace += 1;
                new[d..d + BS as usize]
                    .iter_mut()
                    .for_each(|x| *x = x.wrapping_add(1));
            }
        }
    }
    let plan = delta::Plan {
        old_size: size as u64,
        new_size: size as u64,
        ops,
        sequence,
        census,
        index_bytes: 0,
        hints: Vec::new(),
    };
    std::fs::create_dir_all(dir)?;
    let (base, newp) = (
        dir.join(format!("{name}.base.img")),
        dir.join(format!("{name}.new.img")),
    );
    std::fs::write(&base, &old)?;
    std::fs::write(&newp, &new)?;
    let (oi, ni) = (
        delta::MemImage::new("base", old),
        delta::MemImage::new("new", new),
    );
    let opts = delta::write::CowOptions {
        version: 3,
        compression: "lz4".parse()?,
        compression_factor: 65536,
        threads: 0,
        block_order: false,
    };
    let cow = dir.join(format!("{name}.cow"));
    let r = delta::write::write_cow(&plan, &oi, &ni, &cow, &opts, &delta::NoProgress)?;
    eprintln!(
        "{name}: {} blocks, {} ops, COW {} bytes",
        top, r.ops, r.cow_size
    );
    Ok(())
}
