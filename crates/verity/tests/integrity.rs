//! Every single-bit flip in data or tree is caught, by the whole-device check
//! and by the block verifier; random parameters build trees that verify and
//! that match a naive reference implementation.

mod common;

use std::fs::File;
use std::path::Path;

use proptest::prelude::*;
use verity::{
    BlockHasher, BlockVerifier, Error, Format, HashAlgorithm, Input, Params, build_tree,
    build_tree_in_memory, verify_in_memory,
};

/// The tree as a straightforward recursive definition (cf. pyverity.py in the notes).
fn reference_tree(data: &[u8], p: &Params) -> (Vec<u8>, Vec<u8>) {
    let h = BlockHasher::new(p);
    let d = p.algorithm.digest_size();
    let stride = match p.format {
        Format::V1 => d.next_power_of_two(),
        Format::ChromeOs => d,
    };
    let hbs = p.hash_block_size as usize;
    let per = 1usize << (hbs / d).ilog2();
    let level = |blocks: Vec<&[u8]>| -> Vec<u8> {
        let mut out = Vec::new();
        for group in blocks.chunks(per) {
            let mut b = vec![0u8; hbs];
            for (i, blk) in group.iter().enumerate() {
                b[i * stride..i * stride + d].copy_from_slice(&h.hash(blk)[..d]);
            }
            out.extend_from_slice(&b);
        }
        out
    };
    let dbs = p.data_block_size as usize;
    let data_blocks: Vec<&[u8]> = data[..p.data_blocks as usize * dbs].chunks(dbs).collect();
    if data_blocks.len() == 1 {
        return (Vec::new(), h.hash(data_blocks[0])[..d].to_vec());
    }
    let mut levels = vec![level(data_blocks)];
    while levels.last().unwrap().len() > hbs {
        let cur = levels.last().unwrap().clone();
        levels.push(level(cur.chunks(hbs).collect()));
    }
    let root = h.hash(levels.last().unwrap())[..d].to_vec();
    levels.reverse();
    (levels.concat(), root)
}

fn params(
    alg: HashAlgorithm,
    format: Format,
    dbs: u32,
    hbs: u32,
    blocks: u64,
    salt: Vec<u8>,
) -> Params {
    Params {
        format,
        algorithm: alg,
        data_block_size: dbs,
        hash_block_size: hbs,
        data_blocks: blocks,
        salt,
    }
}

/// Deterministic positions spread over `len` bytes, plus both ends.
fn positions(len: usize, count: usize, seed: u64) -> Vec<(usize, u8)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v = vec![(0, 0), (len - 1, 7)];
    for _ in 0..count {
        v.push((rng.usize(..len), rng.u8(..8)));
    }
    v
}

fn bit_flip_case(p: &Params) {
    let dbs = p.data_block_size as usize;
    let data = common::pattern(p.data_blocks as usize * dbs);
    let (tree, root) = build_tree_in_memory(
        Input {
            reader: &data,
            name: Path::new("data"),
            len: data.len() as u64,
        },
        p,
    )
    .unwrap();
    verify_in_memory(&data, p, &tree, &root).unwrap();
    let layout = p.layout().unwrap();
    let per = layout.hashes_per_block;

    // Data flips: the whole check names the block; the verifier rejects it.
    let verifier = BlockVerifier::new(tree.clone(), "tree", 0, p.clone(), &root).unwrap();
    for (pos, bit) in positions(data.len(), 300, 0x9e37_79b9) {
        let mut bad = data.clone();
        bad[pos] ^= 1 << bit;
        let block = (pos / dbs) as u64;
        match verify_in_memory(&bad, p, &tree, &root) {
            Err(Error::DataBlockMismatch { block: b, .. }) => assert_eq!(b, block, "flip at {pos}"),
            other => panic!("data flip at byte {pos} bit {bit}: {other:?}"),
        }
        let e = verifier
            .verify(
                block,
                &bad[block as usize * dbs..(block as usize + 1) * dbs],
            )
            .unwrap_err();
        assert!(e.is_integrity_error(), "{e}");
        // Neighbouring good blocks still pass.
        let other = (block + 1) % p.data_blocks;
        if other != block {
            verifier
                .verify(
                    other,
                    &data[other as usize * dbs..(other as usize + 1) * dbs],
                )
                .unwrap();
        }
    }

    // Tree flips, including slot padding and unused block tails.
    let hbs = p.hash_block_size as usize;
    for (pos, bit) in positions(tree.len(), 300, 0x1234_5678_9abc) {
        let mut bad = tree.clone();
        bad[pos] ^= 1 << bit;
        let (level, index) = {
            let blk = (pos / hbs) as u64;
            let l = layout
                .levels
                .iter()
                .position(|l| {
                    blk >= l.offset / hbs as u64 && blk < l.offset / hbs as u64 + l.blocks
                })
                .unwrap();
            (l, blk - layout.levels[l].offset / hbs as u64)
        };
        match verify_in_memory(&data, p, &bad, &root) {
            Err(Error::HashBlockMismatch {
                level: l, index: i, ..
            }) => {
                assert_eq!((l, i), (level, index), "tree flip at {pos}")
            }
            Err(Error::RootHashMismatch { .. }) => assert_eq!(level, layout.levels.len() - 1),
            other => panic!("tree flip at byte {pos} bit {bit}: {other:?}"),
        }
        // A fresh verifier (empty cache) must refuse the first data block under it.
        let v = BlockVerifier::new(bad, "tree", 0, p.clone(), &root).unwrap();
        let first_data = index * per.pow(level as u32 + 1);
        let e = v
            .verify(
                first_data,
                &data[first_data as usize * dbs..(first_data as usize + 1) * dbs],
            )
            .unwrap_err();
        assert!(e.is_integrity_error(), "{e}");
    }
}

#[test]
fn bit_flips_sha256_4k_two_levels() {
    bit_flip_case(&params(
        HashAlgorithm::Sha256,
        Format::V1,
        4096,
        4096,
        300,
        vec![1, 2, 3],
    ));
}

#[test]
fn bit_flips_sha1_512_many_levels() {
    bit_flip_case(&params(
        HashAlgorithm::Sha1,
        Format::V1,
        512,
        512,
        700,
        vec![],
    ));
}

#[test]
fn bit_flips_sha512_format0() {
    bit_flip_case(&params(
        HashAlgorithm::Sha512,
        Format::ChromeOs,
        1024,
        512,
        150,
        vec![0xa5; 256],
    ));
}

#[test]
fn bit_flips_single_block() {
    let p = params(
        HashAlgorithm::Sha256,
        Format::V1,
        4096,
        4096,
        1,
        vec![9; 32],
    );
    let data = common::pattern(4096);
    let (tree, root) = reference_tree(&data, &p);
    assert!(tree.is_empty());
    let v = BlockVerifier::new(Vec::new(), "empty", 0, p.clone(), &root).unwrap();
    v.verify(0, &data).unwrap();
    for (pos, bit) in positions(4096, 100, 77) {
        let mut bad = data.clone();
        bad[pos] ^= 1 << bit;
        assert!(verify_in_memory(&bad, &p, &tree, &root).is_err());
        assert!(v.verify(0, &bad).unwrap_err().is_integrity_error());
    }
}

#[test]
fn verifier_is_shared_across_threads() {
    let p = params(
        HashAlgorithm::Sha256,
        Format::V1,
        512,
        512,
        5000,
        vec![5; 32],
    );
    let data = common::pattern(5000 * 512);
    let (tree, root) = reference_tree(&data, &p);
    let v = std::sync::Arc::new(BlockVerifier::new(tree, "t", 0, p, &root).unwrap());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let v = v.clone();
            let data = &data;
            s.spawn(move || {
                for b in (t..5000).step_by(4) {
                    v.verify(b, &data[b as usize * 512..(b as usize + 1) * 512])
                        .unwrap();
                }
            });
        }
    });
}

#[test]
fn verifier_reports_out_of_range_and_short_buffers() {
    let p = params(HashAlgorithm::Sha256, Format::V1, 4096, 4096, 3, vec![]);
    let data = common::pattern(3 * 4096);
    let (tree, root) = reference_tree(&data, &p);
    let v = BlockVerifier::new(tree, "t", 0, p, &root).unwrap();
    assert!(matches!(
        v.verify(3, &data[..4096]),
        Err(Error::BlockOutOfRange { .. })
    ));
    assert!(matches!(
        v.verify(0, &data[..100]),
        Err(Error::BadBlockLength { .. })
    ));
}

#[test]
fn file_backed_build_and_verifier() {
    let dir = tempfile::tempdir().unwrap();
    // Two 8 MiB chunks and a partial last block: the first chunk is mapped,
    // the last is read and zero-padded (the AVB case).
    let p = params(
        HashAlgorithm::Sha256,
        Format::V1,
        4096,
        4096,
        3001,
        vec![7; 32],
    );
    let mut data = common::pattern(3000 * 4096 + 100);
    let data_path = dir.path().join("data");
    std::fs::write(&data_path, &data).unwrap();
    let data_file = File::open(&data_path).unwrap();
    let path = dir.path().join("tree");
    let mut f = File::options()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let input = Input {
        reader: &data_file,
        name: &data_path,
        len: data.len() as u64,
    };
    let root = build_tree(input, &p, &mut f, &path, 8192, None).unwrap();
    data.resize(3001 * 4096, 0);
    let (tree, want_root) = reference_tree(&data, &p);
    assert_eq!(root, want_root);
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(&on_disk[8192..], &tree[..]);
    let v = BlockVerifier::open(&path, 8192, p.clone(), &root).unwrap();
    for b in [0u64, 1, 2999, 1500, 3000] {
        v.verify(b, &data[b as usize * 4096..(b as usize + 1) * 4096])
            .unwrap();
    }
    // Truncated tree file: opening names the file and sizes.
    f.set_len(8192 + 4096).unwrap();
    let e = BlockVerifier::open(&path, 8192, p, &root)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("truncated") && e.contains(path.to_str().unwrap()),
        "{e}"
    );
}

fn arb_params() -> impl Strategy<Value = Params> {
    (
        prop_oneof![
            Just(HashAlgorithm::Sha1),
            Just(HashAlgorithm::Sha256),
            Just(HashAlgorithm::Sha512)
        ],
        prop_oneof![Just(Format::V1), Just(Format::ChromeOs)],
        prop_oneof![Just(512u32), Just(1024), Just(4096)],
        prop_oneof![Just(512u32), Just(1024), Just(4096)],
        1u64..600,
        prop::collection::vec(any::<u8>(), 0..=256),
    )
        .prop_map(|(a, f, d, h, n, s)| params(a, f, d, h, n, s))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_params_build_verify_and_match_reference(p in arb_params(), tail in 0usize..512) {
        let dbs = p.data_block_size as usize;
        let data = common::pattern(p.data_blocks as usize * dbs + tail.min(dbs - 1));
        let input = Input { reader: &data, name: Path::new("data"), len: data.len() as u64 };
        let (tree, root) = build_tree_in_memory(input, &p).unwrap();
        let (want_tree, want_root) = reference_tree(&data, &p);
        prop_assert_eq!(&root, &want_root);
        prop_assert!(tree == want_tree);
        verify_in_memory(&data, &p, &tree, &root).unwrap();
        let v = BlockVerifier::new(tree, "t", 0, p.clone(), &root).unwrap();
        for b in 0..p.data_blocks as usize {
            v.verify(b as u64, &data[b * dbs..(b + 1) * dbs]).unwrap();
        }
    }
}
