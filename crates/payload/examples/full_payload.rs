//! Writes a full payload from partition images, laid out as update_engine's
//! `delta_generator` lays out a full payload: each partition cut into 2 MiB chunks,
//! each chunk a ZERO operation when it is all zeros, else REPLACE_XZ (or REPLACE when
//! xz does not make it smaller), compressed on all CPUs. For the extraction benchmark
//! (`bench/payload.sh`); unsigned.
//!
//! ```text
//! cargo run --release -p vabc-payload --features fuzzing --example full_payload -- \
//!     OUT.bin NAME=IMAGE [NAME=IMAGE ...]
//! ```

use std::io::Write as _;

use payload::fuzzing::Builder;
use payload::proto::{Extent, OpType};
use rayon::prelude::*;

/// delta_generator's default chunk size for full payloads.
const CHUNK: usize = 2 << 20;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((out, parts)) = args.split_first() else {
        return Err("usage: full_payload OUT.bin NAME=IMAGE [NAME=IMAGE ...]".into());
    };
    let mut b = Builder::new(0);
    for spec in parts {
        let (name, path) = spec.split_once('=').ok_or("expected NAME=IMAGE")?;
        let image = std::fs::read(path)?;
        let part = b.partition(name, None, &image);
        let chunks: Vec<(OpType, Vec<u8>)> = image
            .par_chunks(CHUNK)
            .map(|c| {
                let mut c = c.to_vec();
                c.resize(c.len().div_ceil(4096) * 4096, 0);
                if c.iter().all(|&x| x == 0) {
                    return Ok((OpType::Zero, Vec::new()));
                }
                let mut xz = liblzma::write::XzEncoder::new(Vec::new(), 6);
                xz.write_all(&c)?;
                let xz = xz.finish()?;
                Ok(if xz.len() < c.len() {
                    (OpType::ReplaceXz, xz)
                } else {
                    (OpType::Replace, c)
                })
            })
            .collect::<std::io::Result<_>>()?;
        for (i, (t, data)) in chunks.into_iter().enumerate() {
            let start = (i * CHUNK / 4096) as u64;
            let blocks = (image.len() - i * CHUNK).min(CHUNK).div_ceil(4096) as u64;
            let dst = [Extent::new(start, blocks)];
            match t {
                OpType::Zero => b.op(part, t, &[], &dst, None),
                _ => b.op(part, t, &[], &dst, Some(&data)),
            }
        }
        eprintln!(
            "{name}: {} bytes in {} chunks",
            image.len(),
            image.len().div_ceil(CHUNK)
        );
    }
    let bytes = b.finish(None);
    let tmp = format!("{out}.tmp");
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, out)?;
    eprintln!("{out}: {} bytes", bytes.len());
    Ok(())
}
