//! Replays the fuzz corpus of the image target (fuzz/corpus/avb_image) through
//! the target's body in the normal test run, and regenerates its seeds.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use verity::avb::{self, HashtreeFooterOptions};
use verity::{Format, HashAlgorithm, Input, Params, Superblock, build_tree_in_memory};

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 253) as u8).collect()
}

/// Small valid inputs for every path the target takes: AVB images with a
/// footer (two algorithms), a bare vbmeta blob, and a veritysetup hash
/// device with a superblock.
fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let dir = tempfile::tempdir().unwrap();
    for (name, alg, blocks) in [
        ("avb_sha256", HashAlgorithm::Sha256, 16),
        ("avb_sha1", HashAlgorithm::Sha1, 3),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, pattern(blocks * 4096)).unwrap();
        let mut opts = HashtreeFooterOptions::new(0, "system");
        opts.algorithm = alg;
        opts.salt = Some(vec![0x5a; 8]);
        avb::add_hashtree_footer(&p, &opts, None).unwrap();
        let image = std::fs::read(&p).unwrap();
        // The vbmeta blob alone, as `avbtool make_vbmeta_image` would leave it.
        let info = avb::read_image_info(&p).unwrap();
        let footer = info.footer.unwrap();
        let start = footer.vbmeta_offset as usize;
        out.push((
            format!("{name}_vbmeta"),
            image[start..start + footer.vbmeta_size as usize].to_vec(),
        ));
        out.push((name.to_string(), image));
    }
    let data = pattern(8 * 4096);
    let params = Params {
        format: Format::V1,
        algorithm: HashAlgorithm::Sha256,
        data_block_size: 4096,
        hash_block_size: 4096,
        data_blocks: 8,
        salt: vec![1, 2, 3, 4],
    };
    let input = Input {
        reader: &data,
        name: std::path::Path::new("data"),
        len: data.len() as u64,
    };
    let (tree, _root) = build_tree_in_memory(input, &params).unwrap();
    let mut dev = Superblock {
        params,
        uuid: [7; 16],
    }
    .encode()
    .to_vec();
    dev.resize(4096, 0);
    dev.extend_from_slice(&tree);
    out.push(("veritysetup_sb".into(), dev));
    out
}

/// Regenerate the seed corpus: `cargo test -p vabc-verity --test fuzz_corpus -- --ignored`.
#[test]
#[ignore]
fn generate_seed_corpus() {
    replay::write_seeds("avb_image", seeds());
}

#[test]
fn seeds_parse() {
    // The seeds must reach the deep paths, not stop at the first check.
    for (name, data) in seeds() {
        let parsed = avb::read_image_info_at(&data, data.len() as u64, name.as_ref()).is_ok()
            || Superblock::decode(&data[..512], name.as_ref(), 0).is_ok();
        assert!(parsed, "seed {name} does not parse");
        verity::fuzzing::exercise_image(&data);
    }
    // The footed images carry a tree that verifies, so the target's
    // verification path starts from real trees.
    for name in ["avb_sha256", "avb_sha1"] {
        let (_, data) = seeds().into_iter().find(|(n, _)| n == name).unwrap();
        let info = avb::read_image_info_at(&data, data.len() as u64, name.as_ref()).unwrap();
        let Some(avb::Descriptor::Hashtree(h)) = info.descriptors.first() else {
            panic!("{name}: no hashtree descriptor");
        };
        let params = h.verity_params().unwrap();
        let input = Input {
            reader: &data,
            name: name.as_ref(),
            len: data.len() as u64,
        };
        verity::verify_tree(input, &params, input, h.tree_offset, &h.root_digest, None)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

/// Sizes and offsets near `u64::MAX` in a vbmeta header are clean errors
/// naming the file (they once overflowed: found by the fuzz target).
#[test]
fn absurd_vbmeta_sizes_are_errors() {
    let (_, blob) = seeds()
        .into_iter()
        .find(|(n, _)| n == "avb_sha256_vbmeta")
        .unwrap();
    for (field, value) in [(12, u64::MAX), (12, u64::MAX - 200), (96, u64::MAX - 2)] {
        let mut b = blob.clone();
        b[field..field + 8].copy_from_slice(&value.to_be_bytes());
        let err = avb::read_image_info_at(&b, b.len() as u64, "bad.img".as_ref())
            .expect_err("absurd header accepted")
            .to_string();
        assert!(err.contains("bad.img"), "{err}");
        assert!(err.contains("runs past"), "{err}");
    }
}

#[test]
fn replay_fuzz_corpus() {
    let inputs = replay::inputs("avb_image");
    for data in &inputs {
        verity::fuzzing::exercise_image(data);
    }
    let n = inputs.len();
    assert!(n >= 5, "fuzz corpus has only {n} inputs");
}
