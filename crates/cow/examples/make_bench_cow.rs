//! Build a large synthetic update for benchmarks: `base.img`, `new.img` and
//! one COW per codec, with a realistic op mix (half the blocks unchanged,
//! COPY, unaligned XOR, multi-block REPLACE of compressible data, ZERO).
//!
//! `cargo run --release -p vabc-cow --example make_bench_cow -- DIR SIZE_MIB [CODEC...]`

use std::path::PathBuf;

use cow::{Compression, CowWriter, WriterOptions};

const BS: usize = 4096;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Text-like content that compresses about 3:1, or random bytes.
fn fill_block(rng: &mut Rng, out: &mut [u8]) {
    const WORDS: &[&[u8]] = &[
        b"android ",
        b"system ",
        b"vendor ",
        b"lib64/",
        b".so\0",
        b"\x7fELF",
        b"\0\0\0\0",
        b"partition ",
        b"update ",
        b"snapshot ",
        b"merge ",
        b"0123456789",
        b"\x48\x89\xe5",
        b"\xff\xff\xff\xff",
        b"config=",
        b"true\n",
    ];
    match rng.next() % 10 {
        0 | 1 => out.iter_mut().for_each(|b| *b = rng.next() as u8),
        2 => out.fill(0),
        _ => {
            let mut i = 0;
            while i < out.len() {
                let w = WORDS[(rng.next() % WORDS.len() as u64) as usize];
                let n = w.len().min(out.len() - i);
                out[i..i + n].copy_from_slice(&w[..n]);
                i += n;
            }
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(args.first().ok_or("usage: DIR SIZE_MIB [CODEC...]")?);
    let mib: usize = args
        .get(1)
        .ok_or("usage: DIR SIZE_MIB [CODEC...]")?
        .parse()?;
    let codecs: Vec<String> = if args.len() > 2 {
        args[2..].to_vec()
    } else {
        vec!["lz4".into(), "zstd".into()]
    };
    std::fs::create_dir_all(&dir)?;
    let blocks = mib * 256;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut base = vec![0u8; blocks * BS];
    for b in base.chunks_mut(BS) {
        fill_block(&mut rng, b);
    }
    // Decide every new block: runs of one kind, like real updates.
    #[derive(Clone, Copy, PartialEq)]
    enum K {
        Same,
        Copy(usize),
        Xor(usize),
        Replace,
        Zero,
    }
    let mut kinds = vec![K::Same; blocks];
    let mut b = 0;
    while b < blocks {
        let run = (1 + rng.next() % 64) as usize;
        let end = (b + run).min(blocks);
        let pick = rng.next() % 100;
        let src = (rng.next() as usize) % (blocks - run - 1);
        for (i, k) in kinds[b..end].iter_mut().enumerate() {
            *k = match pick {
                0..50 => K::Same,
                50..62 => K::Copy(src + i),
                62..70 => K::Xor(src + i),
                70..95 => K::Replace,
                _ => K::Zero,
            };
        }
        b = end;
    }
    let mut new = base.clone();
    let off = 123usize;
    for (i, k) in kinds.iter().enumerate() {
        let d = i * BS;
        match *k {
            K::Same => {}
            K::Copy(s) => new[d..d + BS].copy_from_slice(&base[s * BS..(s + 1) * BS]),
            K::Xor(s) => {
                // A slightly edited copy of base data at an unaligned offset.
                let mut blk = base[s * BS + off..s * BS + off + BS].to_vec();
                for _ in 0..8 {
                    let at = (rng.next() % BS as u64) as usize;
                    blk[at] = blk[at].wrapping_add(1);
                }
                new[d..d + BS].copy_from_slice(&blk);
            }
            K::Replace => fill_block(&mut rng, &mut new[d..d + BS]),
            K::Zero => new[d..d + BS].fill(0),
        }
    }
    std::fs::write(dir.join("base.img"), &base)?;
    std::fs::write(dir.join("new.img"), &new)?;
    for codec in codecs {
        let path = dir.join(format!("update-{codec}.cow"));
        let mut w = CowWriter::create(
            &path,
            WriterOptions {
                compression: codec.parse::<Compression>()?,
                op_count_max: blocks as u64,
                ..Default::default()
            },
        )?;
        // Ordered ops first (v3 without sequence merges in stream order).
        for (i, k) in kinds.iter().enumerate() {
            match *k {
                K::Copy(s) => w.add_copy(i as u64, s as u64, 1)?,
                K::Xor(s) => {
                    let x: Vec<u8> = new[i * BS..(i + 1) * BS]
                        .iter()
                        .zip(&base[s * BS + off..])
                        .map(|(a, b)| a ^ b)
                        .collect();
                    w.add_xor_blocks(i as u64, &x, s as u64, off as u16)?;
                }
                _ => {}
            }
        }
        let mut i = 0;
        while i < blocks {
            let k = kinds[i];
            let mut j = i + 1;
            while j < blocks && kinds[j] == k && matches!(k, K::Replace | K::Zero) {
                j += 1;
            }
            match k {
                K::Replace => w.add_raw_blocks(i as u64, &new[i * BS..j * BS])?,
                K::Zero => w.add_zero_blocks(i as u64, (j - i) as u64)?,
                _ => {}
            }
            i = j;
        }
        let info = w.finalize()?;
        println!(
            "{}: {} bytes, {} ops",
            path.display(),
            info.cow_size,
            info.op_count
        );
    }
    Ok(())
}
