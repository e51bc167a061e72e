//! Byte-for-byte comparison with the hash files veritysetup wrote and the AVB
//! images avbtool wrote (`shared/verity-vectors`).

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use common::*;
use verity::avb::{self, HashtreeFooterOptions};
use verity::{
    BlockVerifier, Format, HashAlgorithm, Input, Params, Superblock, build_tree, parse_uuid,
    tree_offset, verify_tree,
};

/// Parameters encoded in a vector file name `<input>__<variant>__<sb|nosb>.hash`.
fn params_from_name(name: &str, data_len: u64) -> (Params, bool) {
    let stem = name.strip_suffix(".hash").expect("hash file");
    let parts: Vec<&str> = stem.split("__").collect();
    assert_eq!(parts.len(), 3, "{name}");
    let (input, variant, sb) = (parts[0], parts[1], parts[2]);
    let (dbs, hbs) = match input {
        "1MiB-bs512" => (512, 512),
        "1MiB-d4096-h512" => (4096, 512),
        _ => (4096, 4096),
    };
    let (format, rest) = match variant.strip_prefix("v0-") {
        Some(r) => (Format::ChromeOs, r),
        None => (Format::V1, variant),
    };
    let (alg, salt) = rest.split_once('-').expect("variant");
    let salt = match salt {
        "nosalt" => vec![],
        "salt1" => vec![0xa5],
        "salt32" => hex::decode(SALT32).unwrap(),
        "salt256" => salt256(),
        s => panic!("unknown salt {s} in {name}"),
    };
    let params = Params {
        format,
        algorithm: alg.parse().unwrap(),
        data_block_size: dbs,
        hash_block_size: hbs,
        // veritysetup covers whole blocks only and leaves a partial tail unprotected.
        data_blocks: data_len / u64::from(dbs),
        salt,
    };
    let superblock = match sb {
        "sb" => true,
        "nosb" => false,
        s => panic!("bad sb tag {s}"),
    };
    (params, superblock)
}

/// file name -> root hash, from index.tsv.
fn index_roots() -> HashMap<String, String> {
    let text = fs::read_to_string(vectors_dir().join("veritysetup/index.tsv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split('\t').collect();
    let col = |n: &str| header.iter().position(|h| *h == n).unwrap();
    let (fcol, rcol) = (col("file"), col("root_hash"));
    lines
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f[fcol].to_string(), f[rcol].to_string())
        })
        .collect()
}

#[test]
fn every_veritysetup_vector_is_reproduced_byte_for_byte() {
    let roots = index_roots();
    let mut data_cache: HashMap<String, Vec<u8>> = HashMap::new();
    let mut names: Vec<String> = fs::read_dir(vectors_dir().join("veritysetup"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".hash"))
        .collect();
    names.sort();
    assert_eq!(names.len(), 84, "expected all 84 veritysetup vectors");
    for name in &names {
        let expected = fs::read(vectors_dir().join("veritysetup").join(name)).unwrap();
        let tag = name.split("__").next().unwrap().to_string();
        let data = data_cache
            .entry(tag.clone())
            .or_insert_with(|| data_for_tag(&tag));
        let (params, sb) = params_from_name(name, data.len() as u64);
        let input = Input {
            reader: &*data,
            name: Path::new(&tag),
            len: data.len() as u64,
        };
        let mut out = Vec::new();
        let toff = tree_offset(0, sb, params.hash_block_size);
        if sb {
            let sblock = Superblock {
                params: params.clone(),
                uuid: parse_uuid(UUID).unwrap(),
            };
            out.extend_from_slice(&sblock.encode());
            out.resize(toff as usize, 0);
        }
        let root = build_tree(input, &params, &mut out, Path::new(name), toff, None).unwrap();
        assert_eq!(hex::encode(&root), roots[name], "root hash of {name}");
        assert!(
            out == expected,
            "{name}: {} bytes differ from veritysetup's {}",
            out.len(),
            expected.len()
        );

        // The stored file verifies with its root, and the superblock reads back.
        if sb {
            let parsed = Superblock::decode(&expected, Path::new(name), 0).unwrap();
            assert_eq!(parsed.params, params, "{name}");
        }
        let h = Input {
            reader: &expected,
            name: Path::new(name),
            len: expected.len() as u64,
        };
        verify_tree(input, &params, h, toff, &root, None).unwrap();
        let v = BlockVerifier::new(expected.clone(), name.as_str(), toff, params.clone(), &root)
            .unwrap();
        let dbs = params.data_block_size as usize;
        for b in 0..params.data_blocks as usize {
            v.verify(b as u64, &data[b * dbs..(b + 1) * dbs]).unwrap();
        }
    }
}

fn avb_vectors() -> Vec<(String, u64, HashAlgorithm, &'static str)> {
    vec![
        (
            "avb_128blk_sha256_p1MiB".into(),
            1 << 20,
            HashAlgorithm::Sha256,
            "128blk",
        ),
        (
            "avb_129blk_sha256_p1MiB".into(),
            1 << 20,
            HashAlgorithm::Sha256,
            "129blk",
        ),
        (
            "avb_1000blk+1234_sha256_p8MiB".into(),
            8 << 20,
            HashAlgorithm::Sha256,
            "1000blk+1234",
        ),
        (
            "avb_129blk_sha1_p1MiB".into(),
            1 << 20,
            HashAlgorithm::Sha1,
            "129blk",
        ),
    ]
}

#[test]
fn avb_footer_matches_avbtool_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    for (name, psize, alg, tag) in avb_vectors() {
        let expected = gunzip(&vectors_dir().join("avb").join(format!("{name}.img.gz")));
        let img = dir.path().join(format!("{name}.img"));
        fs::write(&img, data_for_tag(tag)).unwrap();
        let mut opts = HashtreeFooterOptions::new(psize, "system");
        opts.algorithm = alg;
        opts.salt = Some(hex::decode(SALT32).unwrap());
        let info = avb::add_hashtree_footer(&img, &opts, None).unwrap();
        let ours = fs::read(&img).unwrap();
        assert_eq!(ours.len(), expected.len(), "{name}: size");
        if let Some(i) = ours.iter().zip(&expected).position(|(a, b)| a != b) {
            panic!("{name}: first difference at byte {i}");
        }
        assert_eq!(info.footer.vbmeta_size, 512);

        // info prints exactly what avbtool info_image printed, for ours and theirs.
        let want = fs::read_to_string(
            vectors_dir()
                .join("avb")
                .join(format!("{name}.img.info.txt")),
        )
        .unwrap();
        let got = avb::format_image_info(&avb::read_image_info(&img).unwrap());
        assert_eq!(got, want, "{name}: info");

        // The descriptor's tree verifies the image.
        let parsed = avb::read_image_info(&img).unwrap();
        let avb::Descriptor::Hashtree(d) = &parsed.descriptors[0] else {
            panic!("no hashtree descriptor")
        };
        let params = d.verity_params().unwrap();
        let input = Input {
            reader: &ours,
            name: &img,
            len: ours.len() as u64,
        };
        verify_tree(input, &params, input, d.tree_offset, &d.root_digest, None).unwrap();
    }
}

#[test]
fn avb_refuses_existing_footer_and_small_partition_without_touching_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("system.img");
    let data = data_for_tag("129blk");
    fs::write(&img, &data).unwrap();

    // 129 blocks need more than a 560 KiB partition once the reserve is counted.
    let e = avb::add_hashtree_footer(
        &img,
        &HashtreeFooterOptions::new(560 * 1024, "system"),
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("exceeds the maximum image size"),
        "{e}"
    );
    assert_eq!(fs::read(&img).unwrap(), data);

    let e = avb::add_hashtree_footer(&img, &HashtreeFooterOptions::new(1_000_000, "system"), None)
        .unwrap_err();
    assert!(e.to_string().contains("not a multiple"), "{e}");
    assert_eq!(fs::read(&img).unwrap(), data);

    avb::add_hashtree_footer(&img, &HashtreeFooterOptions::new(1 << 20, "system"), None).unwrap();
    let once = fs::read(&img).unwrap();
    let e = avb::add_hashtree_footer(&img, &HashtreeFooterOptions::new(1 << 20, "system"), None)
        .unwrap_err();
    assert!(e.to_string().contains("already has an AVB footer"), "{e}");
    assert_eq!(fs::read(&img).unwrap(), once);
}

#[test]
fn avb_info_rejects_garbage_with_offset() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("junk.img");
    fs::write(&img, vec![7u8; 8192]).unwrap();
    let e = avb::read_image_info(&img).unwrap_err().to_string();
    assert!(e.contains("junk.img") && e.contains("offset 0"), "{e}");

    // A footer pointing past the end of the file.
    let mut b = vec![0u8; 8192];
    let f = avb::Footer {
        version_major: 1,
        version_minor: 0,
        original_image_size: 4096,
        vbmeta_offset: 1 << 30,
        vbmeta_size: 512,
    };
    b[8192 - 64..].copy_from_slice(&f.encode());
    fs::write(&img, &b).unwrap();
    let e = avb::read_image_info(&img).unwrap_err().to_string();
    assert!(e.contains(&format!("offset {}", 1u64 << 30)), "{e}");
}
