//! Plans written as COW files and read back through the `cow` crate's
//! snapshot view (base = OLD): the view equals NEW, for v2 and v3, every
//! codec and several compression factors; the reader's merge order passes
//! its validator; the bytes do not depend on the thread count; failures
//! leave no file behind.

use std::fs::File;
use std::path::Path;

use cow::{Compression, CowReader, SnapshotView};
use delta::write::{CowOptions, write_cow};
use delta::{BLOCK_SIZE, MemImage, NoProgress, PlanOptions};

const BS: usize = BLOCK_SIZE;

fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let x = rng.u64(..);
        if x.is_multiple_of(3) {
            out.extend_from_slice(&x.to_le_bytes());
        } else {
            out.extend_from_slice(b"lib/python3.11/site-packages/");
        }
    }
    out.truncate(len);
    out
}

/// A pair with every kind of op: unchanged, zero, moved (with a cycle),
/// byte-shifted, edited, new data, and NEW longer than OLD.
fn pair() -> (Vec<u8>, Vec<u8>) {
    let old = content(1, 300 * BS);
    let mut new = old.clone();
    new[10 * BS..14 * BS].fill(0);
    let (a, b) = new.split_at_mut(60 * BS);
    a[40 * BS..50 * BS].swap_with_slice(&mut b[..10 * BS]);
    new.splice(100 * BS + 17..100 * BS + 17, content(9, 333));
    new.truncate(300 * BS);
    new[200 * BS + 5] ^= 1;
    new[220 * BS..230 * BS].copy_from_slice(&content(77, 10 * BS));
    new.extend_from_slice(&content(5, 20 * BS));
    new.extend_from_slice(&old[0..3 * BS]);
    (old, new)
}

/// Plan and write the update; check the COW reads back as NEW. A v3 COW
/// gets its ops in block order or in merge order.
#[allow(clippy::too_many_arguments)]
fn write(
    dir: &Path,
    old: &[u8],
    new: &[u8],
    version: u16,
    comp: &str,
    factor: u32,
    threads: usize,
    block_order: bool,
) -> Vec<u8> {
    let o = MemImage::new("old", old.to_vec());
    let n = MemImage::new("new", new.to_vec());
    let plan = delta::plan(
        &o,
        &n,
        &PlanOptions {
            threads,
            ..PlanOptions::default()
        },
        &NoProgress,
    )
    .unwrap();
    let out = dir.join("u.cow");
    let opts = CowOptions {
        version,
        compression: comp.parse::<Compression>().unwrap(),
        compression_factor: factor,
        threads,
        block_order,
    };
    let rep = write_cow(&plan, &o, &n, &out, &opts, &NoProgress).unwrap();
    assert_eq!(rep.cow_size, std::fs::metadata(&out).unwrap().len());

    let base_path = dir.join("old.img");
    std::fs::write(&base_path, old).unwrap();
    let base = File::open(&base_path).unwrap();
    let reader = CowReader::open(&out).unwrap();
    reader.verify_merge().unwrap();
    let view = SnapshotView::new(&reader, &base, &base_path, Some(new.len() as u64)).unwrap();
    let mut got = vec![0u8; new.len()];
    view.read_blocks(0, &mut got).unwrap();
    assert!(
        got == new,
        "v{version} {comp} {factor}: view differs from NEW"
    );
    // Only the temporary-free result is left in the directory.
    let names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    std::fs::read(&out).unwrap()
}

#[test]
fn every_format_and_codec() {
    let (old, new) = pair();
    let dir = tempfile::tempdir().unwrap();
    for version in [2u16, 3] {
        for comp in ["none", "gz", "lz4", "zstd", "brotli:5", "zstd:-3"] {
            write(dir.path(), &old, &new, version, comp, 65536, 2, false);
        }
    }
    for factor in [4096, 16384, 262144] {
        write(dir.path(), &old, &new, 3, "lz4", factor, 2, false);
    }
}

/// The merge order as (kind, block, source), whatever the stream order
/// (a REPLACE's source is where its data is, so it is left out).
fn merge_order_of(path: &Path) -> Vec<(cow::OpKind, u64, u64)> {
    let r = CowReader::open(path).unwrap();
    let ops = r.ops();
    r.merge_order()
        .unwrap()
        .iter()
        .map(|&i| {
            let o = &ops[i];
            let source = if o.kind == cow::OpKind::Replace {
                0
            } else {
                o.source
            };
            (o.kind, o.new_block, source)
        })
        .collect()
}

#[test]
fn block_order_keeps_the_merge_order() {
    let (old, new) = pair();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("u.cow");
    for comp in ["lz4", "zstd"] {
        write(dir.path(), &old, &new, 3, comp, 65536, 2, false);
        let merge_ordered = merge_order_of(&path);
        assert!(CowReader::open(&path).unwrap().sequence().is_empty());
        let size = std::fs::metadata(&path).unwrap().len();
        // `write_as` checks that the snapshot view reads NEW.
        write(dir.path(), &old, &new, 3, comp, 65536, 2, true);
        assert_eq!(merge_order_of(&path), merge_ordered, "{comp}");
        let r = CowReader::open(&path).unwrap();
        let blocks: Vec<u64> = r.ops().iter().map(|o| o.new_block).collect();
        assert!(blocks.windows(2).all(|w| w[0] < w[1]), "{comp}: {blocks:?}");
        // The sequence lists every COPY/XOR op: 4 bytes each.
        let ordered = r
            .ops()
            .iter()
            .filter(|o| matches!(o.kind, cow::OpKind::Copy | cow::OpKind::Xor))
            .count();
        assert!(ordered > 0);
        assert_eq!(r.sequence().len(), ordered);
        let grown = std::fs::metadata(&path).unwrap().len() - size;
        assert_eq!(grown, 4 * ordered as u64, "{comp}");
    }
}

#[test]
fn same_bytes_for_any_thread_count() {
    let (old, new) = pair();
    let dir = tempfile::tempdir().unwrap();
    for (v, c) in [(3, "zstd"), (2, "lz4")] {
        let one = write(dir.path(), &old, &new, v, c, 65536, 1, false);
        let two = write(dir.path(), &old, &new, v, c, 65536, 2, false);
        let four = write(dir.path(), &old, &new, v, c, 65536, 4, false);
        assert!(one == two && two == four, "v{v} {c}");
    }
}

#[test]
fn multi_block_replace_units_are_counted_exactly() {
    // 19 new blocks in one run: 16 + 2 + 1 units at 64 KiB (spec §2.6).
    let old = vec![0u8; 0];
    let new = content(3, 19 * BS);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &old, &new, 3, "lz4", 65536, 1, false);
    let r = CowReader::open(dir.path().join("u.cow")).unwrap();
    let blocks: Vec<u32> = r.ops().iter().map(|o| o.blocks).collect();
    assert_eq!(blocks, vec![16, 2, 1]);
    assert_eq!(r.header().op_count_max, 3);
}

#[test]
fn unwritable_output_leaves_nothing() {
    let (old, new) = pair();
    let o = MemImage::new("old", old);
    let n = MemImage::new("new", new);
    let plan = delta::plan(&o, &n, &PlanOptions::default(), &NoProgress).unwrap();
    let opts = CowOptions {
        version: 3,
        compression: Compression::default(),
        compression_factor: 65536,
        threads: 1,
        block_order: false,
    };
    let err = write_cow(
        &plan,
        &o,
        &n,
        Path::new("/nonexistent-dir/u.cow"),
        &opts,
        &NoProgress,
    )
    .unwrap_err();
    assert!(err.to_string().contains("nonexistent-dir"), "{err}");
}
