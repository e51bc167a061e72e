//! `vabc verity` and `vabc avb` through the built binary, checked against the
//! real `veritysetup` (Debian cryptsetup-bin) and the avbtool-written vectors.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const UUID: &str = "01234567-89ab-4cde-8f01-23456789abcd";
const SALT32: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

fn vabc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vabc"))
        .args(args)
        .output()
        .expect("run vabc")
}

fn veritysetup(args: &[&str]) -> Output {
    // Not skipped when missing: the compatibility checks are the point of these tests.
    Command::new("veritysetup")
        .args(args)
        .env("LC_ALL", "C")
        .output()
        .expect("veritysetup not found: install the Debian package cryptsetup-bin")
}

fn ok(o: &Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what} failed ({}):\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn failed(o: &Output, what: &str) -> String {
    assert!(
        !o.status.success(),
        "{what} unexpectedly succeeded:\nstdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn root_from(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|| panic!("no root hash in:\n{stdout}"))
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 7 + i / 4096) % 251) as u8).collect()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn vectors() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/verity-vectors")
}

fn gunzip(path: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(fs::File::open(path).unwrap())
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// Options for one combination, in veritysetup's syntax (which we share).
fn param_args(alg: &str, salt: &str, bs: u32, sb: bool) -> Vec<String> {
    let mut v = vec![
        format!("--hash={alg}"),
        format!("--salt={salt}"),
        format!("--data-block-size={bs}"),
        format!("--hash-block-size={bs}"),
    ];
    if !sb {
        v.push("--no-superblock".into());
    }
    v
}

#[test]
fn compatible_with_veritysetup_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let salt256: String = (0..=255u8).rev().map(|b| format!("{b:02x}")).collect();
    let salts = [
        "-".to_string(),
        "a5".to_string(),
        SALT32.to_string(),
        salt256,
    ];
    let mut cases = 0;
    for bs in [512u32, 4096] {
        for tail in [0usize, 1234 % bs as usize] {
            let data = dir.path().join(format!("data-{bs}-{tail}"));
            fs::write(&data, pattern(300 * bs as usize + tail)).unwrap();
            for alg in ["sha1", "sha256", "sha512"] {
                for salt in &salts {
                    for sb in [true, false] {
                        let opts = param_args(alg, salt, bs, sb);
                        let mut opts: Vec<&str> = opts.iter().map(String::as_str).collect();
                        if sb {
                            opts.push("--uuid=01234567-89ab-4cde-8f01-23456789abcd");
                        }
                        let tag = format!("{bs}-{tail}-{alg}-{}-{sb}", salt.len());
                        let ours = dir.path().join(format!("ours-{tag}"));
                        let theirs = dir.path().join(format!("theirs-{tag}"));

                        let mut a = vec!["verity", "format", p(&data), p(&ours)];
                        a.extend(&opts);
                        let our_out = ok(&vabc(&a), &format!("vabc verity format {tag}"));
                        let our_root = root_from(&our_out);
                        let mut a = vec!["format", p(&data), p(&theirs)];
                        a.extend(&opts);
                        let their_out = ok(&veritysetup(&a), &format!("veritysetup format {tag}"));
                        let their_root = root_from(&their_out);
                        assert_eq!(our_root, their_root, "{tag}");
                        // Same bytes, and the same printout apart from the file name.
                        assert!(
                            fs::read(&ours).unwrap() == fs::read(&theirs).unwrap(),
                            "{tag}: bytes differ"
                        );
                        let strip = |s: &str| s.lines().skip(1).collect::<Vec<_>>().join("\n");
                        assert_eq!(strip(&our_out), strip(&their_out), "{tag}: printout");

                        // veritysetup verify accepts ours; we accept theirs.
                        let verify_opts: Vec<&str> = opts
                            .iter()
                            .copied()
                            .filter(|o| !o.starts_with("--uuid"))
                            .collect();
                        let mut a = vec!["verify", p(&data), p(&ours), &our_root];
                        if !sb {
                            a.extend(&verify_opts);
                        }
                        ok(&veritysetup(&a), &format!("veritysetup verify ours {tag}"));
                        let mut a = vec!["verity", "verify", p(&data), p(&theirs), &their_root];
                        if !sb {
                            a.extend(&verify_opts);
                        }
                        ok(&vabc(&a), &format!("vabc verity verify theirs {tag}"));
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 96);
}

#[test]
fn format0_and_mixed_block_sizes_match_veritysetup() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    fs::write(&data, pattern(1 << 20)).unwrap();
    for extra in [
        vec!["--format=0", "--hash=sha1"],
        vec![
            "--format=0",
            "--hash=sha256",
            "--data-block-size=512",
            "--hash-block-size=512",
        ],
        vec!["--data-block-size=4096", "--hash-block-size=512"],
        vec![
            "--data-block-size=1024",
            "--hash-block-size=65536",
            "--hash=sha512",
        ],
    ]
    .into_iter()
    .enumerate()
    {
        // Fresh names: veritysetup does not truncate an existing, longer file.
        let (i, extra) = extra;
        let ours = dir.path().join(format!("ours{i}"));
        let theirs = dir.path().join(format!("theirs{i}"));
        let mut base = vec!["--salt", SALT32, "--uuid", UUID];
        base.extend(&extra);
        let mut a = vec!["verity", "format", p(&data), p(&ours)];
        a.extend(&base);
        let r1 = root_from(&ok(&vabc(&a), "vabc format"));
        let mut a = vec!["format", p(&data), p(&theirs)];
        a.extend(&base);
        let r2 = root_from(&ok(&veritysetup(&a), "veritysetup format"));
        assert_eq!(r1, r2, "{extra:?}");
        assert!(
            fs::read(&ours).unwrap() == fs::read(&theirs).unwrap(),
            "{extra:?}"
        );
        ok(
            &veritysetup(&["verify", p(&data), p(&ours), &r1]),
            "veritysetup verify",
        );
    }
}

#[test]
fn hash_offset_appends_tree_to_the_image_itself() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let data = pattern(256 * 4096);
    fs::write(&img, &data).unwrap();
    let off = (256 * 4096).to_string();
    let out = ok(
        &vabc(&[
            "verity",
            "format",
            p(&img),
            p(&img),
            "--hash-offset",
            &off,
            "--salt",
            SALT32,
            "--data-blocks",
            "256",
        ]),
        "format with hash offset",
    );
    let root = root_from(&out);
    assert!(
        !out.contains("Hash device size"),
        "veritysetup omits it with an offset"
    );
    let after = fs::read(&img).unwrap();
    assert_eq!(&after[..data.len()], &data[..], "data untouched");
    assert_eq!(&after[data.len()..data.len() + 6], b"verity");
    ok(
        &veritysetup(&[
            "verify",
            p(&img),
            p(&img),
            &root,
            "--hash-offset",
            &off,
            "--data-blocks",
            "256",
        ]),
        "veritysetup verify with offset",
    );
    ok(
        &vabc(&[
            "verity",
            "verify",
            p(&img),
            p(&img),
            &root,
            "--hash-offset",
            &off,
        ]),
        "vabc verify with offset",
    );
    // Without --data-blocks the tree would cover itself: refused, file unchanged.
    let e = failed(
        &vabc(&[
            "verity",
            "format",
            p(&img),
            p(&img),
            "--hash-offset",
            "4096",
        ]),
        "overlapping hash offset",
    );
    assert!(e.contains("inside the"), "{e}");
    assert_eq!(fs::read(&img).unwrap(), after);
    let e = failed(
        &vabc(&[
            "verity",
            "format",
            p(&img),
            p(&img),
            "--hash-offset",
            "1000",
        ]),
        "odd offset",
    );
    assert!(e.contains("multiple of 512"), "{e}");
}

#[test]
fn json_output_has_the_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    fs::write(&data, pattern(129 * 4096)).unwrap();
    let hash = dir.path().join("hash");
    let out = ok(
        &vabc(&[
            "verity",
            "format",
            p(&data),
            p(&hash),
            "--json",
            "--salt",
            SALT32,
        ]),
        "format --json",
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["root_hash"],
        "9e1e479bc82edaa0688c38a182d02a59f8df6c84255706ac0e3fadf51eba22c1"
    );
    assert_eq!(v["salt"], SALT32);
    assert_eq!(v["hash_algorithm"], "sha256");
    assert_eq!(v["data_blocks"], 129);
    assert_eq!(v["data_block_size"], 4096);
    assert_eq!(v["hash_block_size"], 4096);
    assert_eq!(v["hash_blocks"], 3);
}

#[test]
fn bit_flips_are_reported_with_the_block_number() {
    let dir = tempfile::tempdir().unwrap();
    let data_path = dir.path().join("data");
    let data = pattern(300 * 4096);
    fs::write(&data_path, &data).unwrap();
    let hash_path = dir.path().join("hash");
    let root = root_from(&ok(
        &vabc(&[
            "verity",
            "format",
            p(&data_path),
            p(&hash_path),
            "--salt",
            SALT32,
        ]),
        "format",
    ));
    let tree = fs::read(&hash_path).unwrap();
    for (i, pos) in [0usize, 4095, 4096, 123_457, 600_000, 300 * 4096 - 1]
        .into_iter()
        .enumerate()
    {
        let mut bad = data.clone();
        bad[pos] ^= 1 << (i % 8);
        fs::write(&data_path, &bad).unwrap();
        let e = failed(
            &vabc(&["verity", "verify", p(&data_path), p(&hash_path), &root]),
            "verify flipped data",
        );
        assert!(
            e.contains(&format!("data block {} ", pos / 4096)),
            "flip at {pos}: {e}"
        );
        assert!(e.contains(p(&data_path)), "{e}");
        // veritysetup agrees.
        failed(
            &veritysetup(&["verify", p(&data_path), p(&hash_path), &root]),
            "veritysetup",
        );
    }
    fs::write(&data_path, &data).unwrap();
    // Tree: superblock at 0, top level block at 4096, leaves at 8192 and 12288, 16384.
    for (i, pos) in [
        4096usize,
        4096 + 31,
        8191,
        8192,
        9000,
        12288 + 4095,
        16384 + 100,
    ]
    .into_iter()
    .enumerate()
    {
        let mut bad = tree.clone();
        bad[pos] ^= 1 << (i % 8);
        fs::write(&hash_path, &bad).unwrap();
        let e = failed(
            &vabc(&["verity", "verify", p(&data_path), p(&hash_path), &root]),
            "verify flipped tree",
        );
        assert!(
            e.contains("Verification of hash area failed"),
            "flip at {pos}: {e}"
        );
        assert!(
            e.contains(&format!("offset {}", pos / 4096 * 4096)),
            "flip at {pos}: {e}"
        );
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    fs::write(&data, pattern(300 * 4096)).unwrap();
    let hash = dir.path().join("hash");
    let root = root_from(&ok(
        &vabc(&["verity", "format", p(&data), p(&hash), "--salt", SALT32]),
        "format",
    ));

    // Wrong root hash.
    let wrong = format!(
        "{}{}",
        &root[..63],
        if root.ends_with('0') { '1' } else { '0' }
    );
    let e = failed(
        &vabc(&["verity", "verify", p(&data), p(&hash), &wrong]),
        "wrong root",
    );
    assert!(
        e.contains("root hash mismatch") && e.contains(p(&hash)),
        "{e}"
    );

    // Truncated hash file, with and without superblock.
    let full = fs::read(&hash).unwrap();
    fs::write(&hash, &full[..full.len() - 4096]).unwrap();
    let e = failed(
        &vabc(&["verity", "verify", p(&data), p(&hash), &root]),
        "truncated",
    );
    assert!(e.contains("truncated") && e.contains(p(&hash)), "{e}");
    fs::write(&hash, &full[..100]).unwrap();
    let e = failed(
        &vabc(&["verity", "verify", p(&data), p(&hash), &root]),
        "truncated superblock",
    );
    assert!(e.contains("truncated") && e.contains("superblock"), "{e}");
    fs::write(&hash, &full[4096..8192]).unwrap();
    let e = failed(
        &vabc(&[
            "verity",
            "verify",
            p(&data),
            p(&hash),
            &root,
            "--no-superblock",
            "--salt",
            SALT32,
        ]),
        "truncated nosb",
    );
    assert!(e.contains("truncated") && e.contains(p(&hash)), "{e}");
    // A file that is not a hash file at all.
    let e = failed(
        &vabc(&["verity", "verify", p(&data), p(&data), &root]),
        "no superblock",
    );
    assert!(
        e.contains("bad verity superblock") && e.contains("offset 0"),
        "{e}"
    );

    // Unknown algorithm: error, and no output file is created.
    let out = dir.path().join("never");
    let e = failed(
        &vabc(&["verity", "format", p(&data), p(&out), "--hash", "md5"]),
        "md5",
    );
    assert!(e.contains("unknown hash algorithm \"md5\""), "{e}");
    assert!(!out.exists());
    let e = failed(
        &vabc(&[
            "verity",
            "verify",
            p(&data),
            p(&hash),
            &root,
            "--no-superblock",
            "--salt",
            "-",
            "--hash",
            "whirlpool",
        ]),
        "verify alg",
    );
    assert!(e.contains("unknown hash algorithm"), "{e}");
    let e = failed(
        &vabc(&[
            "avb",
            "add-hashtree-footer",
            p(&data),
            "--partition-size",
            "4194304",
            "--partition-name",
            "x",
            "--hash-algorithm",
            "md5",
        ]),
        "avb alg",
    );
    assert!(e.contains("unknown hash algorithm"), "{e}");

    // Other parameter errors.
    let e = failed(
        &vabc(&[
            "verity",
            "format",
            p(&data),
            p(&out),
            "--data-block-size",
            "1000",
        ]),
        "bs",
    );
    assert!(e.contains("power of two"), "{e}");
    let long = "00".repeat(257);
    let e = failed(
        &vabc(&["verity", "format", p(&data), p(&out), "--salt", &long]),
        "salt",
    );
    assert!(e.contains("at most 256"), "{e}");
    let e = failed(
        &vabc(&["verity", "format", p(&dir.path().join("missing")), p(&out)]),
        "missing",
    );
    assert!(e.contains("missing"), "{e}");
    assert!(!out.exists());

    // A failed format leaves an existing hash file as it was, and no temporary files.
    fs::write(&hash, &full).unwrap();
    let e = failed(
        &vabc(&[
            "verity",
            "format",
            p(&data),
            p(&hash),
            "--data-blocks",
            "301",
        ]),
        "too many blocks",
    );
    assert!(e.contains("fewer than the 301"), "{e}");
    assert_eq!(fs::read(&hash).unwrap(), full);
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn avb_cli_matches_avbtool_and_refuses_unsafe_writes() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "avb_129blk_sha256_p1MiB",
            "data_129blk.bin.gz",
            "1048576",
            "sha256",
        ),
        (
            "avb_1000blk+1234_sha256_p8MiB",
            "data_1000blk_plus1234.bin.gz",
            "8388608",
            "sha256",
        ),
        (
            "avb_129blk_sha1_p1MiB",
            "data_129blk.bin.gz",
            "1048576",
            "sha1",
        ),
    ];
    for (name, input, psize, alg) in cases {
        let img = dir.path().join(format!("{name}.img"));
        let original = gunzip(&vectors().join("data").join(input));
        fs::write(&img, &original).unwrap();
        let out = ok(
            &vabc(&[
                "avb",
                "add-hashtree-footer",
                p(&img),
                "--partition-size",
                psize,
                "--partition-name",
                "system",
                "--hash-algorithm",
                alg,
                "--salt",
                SALT32,
            ]),
            name,
        );
        let expected = gunzip(&vectors().join("avb").join(format!("{name}.img.gz")));
        assert!(
            fs::read(&img).unwrap() == expected,
            "{name}: bytes differ from avbtool's"
        );
        let info_txt =
            fs::read_to_string(vectors().join("avb").join(format!("{name}.img.info.txt"))).unwrap();
        assert_eq!(out, info_txt);
        assert_eq!(ok(&vabc(&["avb", "info", p(&img)]), "info"), info_txt);

        // Second footer: refused, image unchanged.
        let e = failed(
            &vabc(&[
                "avb",
                "add-hashtree-footer",
                p(&img),
                "--partition-size",
                psize,
                "--partition-name",
                "system",
            ]),
            "second footer",
        );
        assert!(e.contains("already has an AVB footer"), "{e}");
        assert!(fs::read(&img).unwrap() == expected);

        // Partition too small: refused before writing anything.
        fs::write(&img, &original).unwrap();
        let e = failed(
            &vabc(&[
                "avb",
                "add-hashtree-footer",
                p(&img),
                "--partition-size",
                "524288",
                "--partition-name",
                "system",
            ]),
            "small partition",
        );
        assert!(e.contains("exceeds the maximum image size"), "{e}");
        assert!(fs::read(&img).unwrap() == original);
    }
    let e = failed(
        &vabc(&[
            "avb",
            "info",
            p(&dir.path().join("avb_129blk_sha1_p1MiB.img")),
        ]),
        "info on raw data",
    );
    assert!(e.contains("no AVB footer") && e.contains("offset 0"), "{e}");
    let help = ok(&vabc(&["avb", "add-hashtree-footer", "--help"]), "help");
    assert!(help.contains("FEC"), "{help}");
}
