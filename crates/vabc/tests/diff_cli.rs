//! `vabc diff` end to end: real image pairs from the corpus (tiny and small;
//! ext4, EROFS, EROFS-lz4hc), COW v2 and v3, every codec: `vabc apply` of
//! the COW on OLD gives NEW byte for byte. Also: determinism across thread
//! counts, inputs of different sizes, unaligned sizes, block devices, empty
//! and identical pairs.
//!
//! The corpus is built on first use (`shared/corpus/make-corpus.sh`, as
//! root, under a lock) into `$TMPDIR/corpus`, and reused afterwards.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

const VABC: &str = env!("CARGO_BIN_EXE_vabc");
/// Brotli at level 5: its default, 11, spends 12-19 s on each 7-35 MB image here
/// (four fifths of the corpus matrix's time) and decodes with the same code;
/// `brotli_at_its_default_level` covers the default.
const CODECS: [&str; 5] = ["none", "gz", "lz4", "zstd", "brotli:5"];
const FILESYSTEMS: [&str; 3] = ["ext4", "erofs", "erofs-lz4hc"];

fn corpus_dir() -> PathBuf {
    std::env::temp_dir().join("corpus")
}

/// Build the tiny and small pairs once per machine.
fn corpus() -> &'static Path {
    static DONE: OnceLock<PathBuf> = OnceLock::new();
    DONE.get_or_init(|| {
        let dir = corpus_dir();
        let have = |p: &str| {
            FILESYSTEMS
                .iter()
                .all(|fs| dir.join(p).join(format!("new.{fs}.img")).exists())
        };
        let missing: Vec<&str> = ["tiny", "small"].into_iter().filter(|p| !have(p)).collect();
        if !missing.is_empty() {
            let script =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/corpus/make-corpus.sh");
            let lock = std::env::temp_dir().join("corpus.lock");
            let st = Command::new("flock")
                .arg(&lock)
                .arg("bash")
                .arg(&script)
                .arg("-p")
                .arg(missing.join(" "))
                .arg("-o")
                .arg(&dir)
                .status()
                .expect("run make-corpus.sh");
            assert!(st.success(), "make-corpus.sh failed");
        }
        dir
    })
}

fn vabc(args: &[&str]) -> Output {
    Command::new(VABC).args(args).output().expect("run vabc")
}

fn ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).expect("diff --json output")
}

/// diff + apply; returns the COW bytes and the diff report.
fn round_trip(old: &Path, new: &Path, dir: &Path, extra: &[&str]) -> (Vec<u8>, serde_json::Value) {
    let cow = dir.join("u.cow");
    let applied = dir.join("applied.img");
    let mut args = vec!["diff", s(old), s(new), "-o", s(&cow), "--json"];
    args.extend_from_slice(extra);
    let out = vabc(&args);
    ok(&out, &format!("diff {extra:?}"));
    let report = json(&out);
    let new_bytes = std::fs::read(new).unwrap();
    let size = new_bytes.len().to_string();
    let out = vabc(&[
        "apply",
        "--base",
        s(old),
        "--cow",
        s(&cow),
        "-o",
        s(&applied),
        "--size",
        &size,
    ]);
    ok(&out, &format!("apply {extra:?}"));
    let got = std::fs::read(&applied).unwrap();
    assert!(
        got == new_bytes,
        "{}: applied COW ({extra:?}) differs from NEW",
        new.display()
    );
    // The census covers every NEW block exactly once.
    let b = &report["blocks"];
    let total: u64 = ["unchanged", "zero", "copy", "xor", "replace"]
        .iter()
        .map(|k| b[*k].as_u64().unwrap())
        .sum();
    assert_eq!(total * 4096, new_bytes.len() as u64);
    assert_eq!(
        report["cow_size"].as_u64().unwrap(),
        std::fs::metadata(&cow).unwrap().len()
    );
    (std::fs::read(&cow).unwrap(), report)
}

/// Round trips of a corpus pair in `format`, on each file system with the codecs
/// `codecs` gives it.
fn corpus_matrix(pair: &str, format: &str, codecs: impl Fn(usize) -> Vec<&'static str>) {
    let c = corpus();
    for (i, fs) in FILESYSTEMS.iter().enumerate() {
        let old = c.join(pair).join(format!("old.{fs}.img"));
        let new = c.join(pair).join(format!("new.{fs}.img"));
        for codec in codecs(i) {
            let dir = tempfile::tempdir().unwrap();
            let (_, r) = round_trip(
                &old,
                &new,
                dir.path(),
                &["--format", format, "--compression", codec],
            );
            eprintln!(
                "{pair}.{fs} {format} {codec}: {} bytes, blocks {}",
                r["cow_size"], r["blocks"]
            );
        }
    }
}

// Every codec on every file system of the tiny pair; the small pair (four times the
// size: its plan, not its codec, is what more data tests) with one codec per file
// system and format, so that each codec still meets it.
#[test]
fn corpus_tiny_v2() {
    corpus_matrix("tiny", "v2", |_| CODECS.to_vec());
}

#[test]
fn corpus_tiny_v3() {
    corpus_matrix("tiny", "v3", |_| CODECS.to_vec());
}

#[test]
fn corpus_small_v2() {
    corpus_matrix("small", "v2", |i| vec![CODECS[i]]);
}

#[test]
fn corpus_small_v3() {
    corpus_matrix("small", "v3", |i| vec![CODECS[(i + 3) % CODECS.len()]]);
}

#[test]
fn xor_and_copy_are_used_on_real_data() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let (_, r) = round_trip(
        &c.join("tiny/old.ext4.img"),
        &c.join("tiny/new.ext4.img"),
        dir.path(),
        &[],
    );
    let b = &r["blocks"];
    assert!(b["copy"].as_u64().unwrap() > 1000, "{b}");
    assert!(b["xor"].as_u64().unwrap() > 1000, "{b}");
    // Without XOR the same pair costs much more.
    let (_, n) = round_trip(
        &c.join("tiny/old.ext4.img"),
        &c.join("tiny/new.ext4.img"),
        dir.path(),
        &["--no-xor"],
    );
    assert_eq!(n["blocks"]["xor"].as_u64(), Some(0));
    // Payload, not file size: both files carry the same 2 MiB merge scratch area.
    let payload = |j: &serde_json::Value| {
        j["bytes"]["replace"].as_u64().unwrap() + j["bytes"]["xor"].as_u64().unwrap()
    };
    assert!(
        payload(&n) > 2 * payload(&r),
        "{} vs {}",
        payload(&n),
        payload(&r)
    );
}

#[test]
fn serving_layout_options_round_trip() {
    // `--min-xor-run` stores the XORs of short lone source runs as REPLACE;
    // `--block-order` writes the ops by block with the merge order as
    // sequence data. Both must still apply to NEW (checked by round_trip).
    let c = corpus();
    let (old, new) = (c.join("tiny/old.ext4.img"), c.join("tiny/new.ext4.img"));
    let dir = tempfile::tempdir().unwrap();
    let (_, base) = round_trip(&old, &new, dir.path(), &["--compression", "lz4"]);
    assert_eq!(base["block_order"].as_bool(), Some(false));
    let (_, lone) = round_trip(
        &old,
        &new,
        dir.path(),
        &["--compression", "lz4", "--min-xor-run", "16"],
    );
    let (b, l) = (&base["blocks"], &lone["blocks"]);
    let lone_xors = l["lone_xors"].as_u64().unwrap();
    assert!(lone_xors > 0, "{l}");
    assert_eq!(b["lone_xors"].as_u64(), Some(0));
    // Fewer XORs, more REPLACE, the same COPYs; cycle breaks may differ.
    assert!(l["xor"].as_u64() < b["xor"].as_u64(), "{b} vs {l}");
    assert_eq!(l["copy"], b["copy"]);
    assert!(lone["cow_size"].as_u64() > base["cow_size"].as_u64());

    let (_, ordered) = round_trip(
        &old,
        &new,
        dir.path(),
        &["--compression", "lz4", "--block-order"],
    );
    assert_eq!(ordered["block_order"].as_bool(), Some(true));
    assert_eq!(ordered["blocks"], base["blocks"]);
    let cow = dir.path().join("u.cow");
    let out = vabc(&["inspect", s(&cow), "--json", "--verify-merge"]);
    ok(&out, "inspect --block-order COW");
    let seq = json(&out)["header"]["sequence_data_count"]
        .as_u64()
        .unwrap();
    let ordered_ops = b["copy"].as_u64().unwrap() + b["xor"].as_u64().unwrap();
    assert_eq!(seq, ordered_ops, "one sequence entry per COPY/XOR block");
    // 4 bytes per entry is all the layout costs.
    assert_eq!(
        ordered["cow_size"].as_u64().unwrap(),
        base["cow_size"].as_u64().unwrap() + 4 * ordered_ops
    );
}

#[test]
fn same_bytes_for_any_thread_count() {
    let c = corpus();
    for (pair, fs, codec) in [("small", "erofs", "zstd"), ("tiny", "ext4", "lz4")] {
        let old = c.join(pair).join(format!("old.{fs}.img"));
        let new = c.join(pair).join(format!("new.{fs}.img"));
        let dir = tempfile::tempdir().unwrap();
        let (one, _) = round_trip(
            &old,
            &new,
            dir.path(),
            &["--threads", "1", "--compression", codec],
        );
        let (two, _) = round_trip(
            &old,
            &new,
            dir.path(),
            &["--threads", "2", "--compression", codec],
        );
        let (three, _) = round_trip(
            &old,
            &new,
            dir.path(),
            &["--threads", "3", "--compression", codec],
        );
        assert!(
            one == two && two == three,
            "{pair}.{fs}: output depends on the thread count"
        );
    }
}

#[test]
fn new_larger_and_smaller_than_old() {
    // The EROFS images of a pair differ in size; swapping them gives the
    // other direction.
    let c = corpus();
    let a = c.join("tiny/old.erofs.img");
    let b = c.join("tiny/new.erofs.img");
    assert_ne!(
        std::fs::metadata(&a).unwrap().len(),
        std::fs::metadata(&b).unwrap().len()
    );
    let dir = tempfile::tempdir().unwrap();
    round_trip(&a, &b, dir.path(), &[]);
    round_trip(&b, &a, dir.path(), &["--format", "v2"]);
}

/// `--base OLD --new NEW` name the same inputs as `OLD NEW` (the spelling the other
/// commands use); one input named both ways, or neither, is a usage error.
#[test]
fn inputs_by_flags_or_position() {
    let dir = tempfile::tempdir().unwrap();
    let old = write(dir.path(), "old", &[1u8; 64 << 10]);
    let mut n = vec![1u8; 64 << 10];
    n[5000..5100].fill(9);
    let new = write(dir.path(), "new", &n);
    let (a, b) = (dir.path().join("a.cow"), dir.path().join("b.cow"));
    ok(
        &vabc(&["diff", s(&old), s(&new), "-o", s(&a)]),
        "positional",
    );
    ok(
        &vabc(&["diff", "--base", s(&old), "--new", s(&new), "-o", s(&b)]),
        "flags",
    );
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let c = dir.path().join("c.cow");
    for args in [
        vec!["diff", "--base", s(&old), s(&new), "-o", s(&c)],
        vec!["diff", "-o", s(&c)],
    ] {
        let o = vabc(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
    assert!(!c.exists());
}

/// The level a bare `--compression brotli` means (11) round-trips, on a pair small
/// enough for its cost: compressible and random blocks, some changed.
#[test]
fn brotli_at_its_default_level() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    let mut old = vec![0u8; 2 << 20];
    for (i, block) in old.chunks_mut(4096).enumerate() {
        match i % 3 {
            0 => rng.fill(block),
            1 => block.fill(i as u8),
            _ => block.copy_from_slice(&[b"vabc brotli "[i % 12]; 4096]),
        }
    }
    let mut new = old.clone();
    for at in (0..new.len()).step_by(7 * 4096 + 512) {
        new[at..at + 100].fill(0x5a);
    }
    let (o, n) = (
        write(dir.path(), "old", &old),
        write(dir.path(), "new", &new),
    );
    for format in ["v2", "v3"] {
        let (_, r) = round_trip(
            &o,
            &n,
            dir.path(),
            &["--format", format, "--compression", "brotli"],
        );
        let changed = ["xor", "replace"].map(|k| r["blocks"][k].as_u64().unwrap_or(0));
        assert!(changed.iter().sum::<u64>() > 0, "{r}");
    }
}

fn write(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, data).unwrap();
    p
}

#[test]
fn empty_and_identical_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let e1 = write(dir.path(), "e1", &[]);
    let e2 = write(dir.path(), "e2", &[]);
    let (_, r) = round_trip(&e1, &e2, dir.path(), &[]);
    assert_eq!(r["ops"].as_u64(), Some(0));
    let img = std::fs::read(corpus().join("tiny/old.erofs.img")).unwrap();
    let a = write(dir.path(), "a", &img);
    let b = write(dir.path(), "b", &img);
    for f in ["v2", "v3"] {
        let (_, r) = round_trip(&a, &b, dir.path(), &["--format", f]);
        assert_eq!(r["ops"].as_u64(), Some(0));
        assert_eq!(
            r["blocks"]["unchanged"].as_u64(),
            Some(img.len() as u64 / 4096)
        );
    }
    // From nothing: every block is new data.
    round_trip(&e1, &a, dir.path(), &[]);
}

#[test]
fn unaligned_size_is_rejected_or_padded() {
    let dir = tempfile::tempdir().unwrap();
    let old: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
    let mut new = old.clone();
    new[5000] ^= 0xff;
    let o = write(dir.path(), "old.img", &old);
    let n = write(dir.path(), "new.img", &new);
    let cow = dir.path().join("u.cow");
    let out = vabc(&["diff", s(&o), s(&n), "-o", s(&cow)]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("old.img") && err.contains("12388") && err.contains("4096"),
        "{err}"
    );
    assert!(!cow.exists(), "a failed diff left an output file");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "temporary files left behind"
    );

    // --pad: the COW describes NEW padded with zeros to 4 KiB.
    let out = vabc(&["diff", s(&o), s(&n), "-o", s(&cow), "--pad", "--json"]);
    ok(&out, "diff --pad");
    let r = json(&out);
    assert_eq!(r["new_size"].as_u64(), Some(4 * 4096));
    assert_eq!(r["new_physical_size"].as_u64(), Some(new.len() as u64));
    let mut padded_old = old.clone();
    padded_old.resize(4 * 4096, 0);
    let po = write(dir.path(), "old.padded", &padded_old);
    let applied = dir.path().join("applied");
    ok(
        &vabc(&[
            "apply",
            "--base",
            s(&po),
            "--cow",
            s(&cow),
            "-o",
            s(&applied),
            "--size",
            "16384",
        ]),
        "apply padded",
    );
    let got = std::fs::read(&applied).unwrap();
    assert_eq!(&got[..new.len()], &new[..]);
    assert!(got[new.len()..].iter().all(|&b| b == 0));
}

#[test]
fn bad_arguments_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a", &[1u8; 8192]);
    let cow = dir.path().join("u.cow");
    let missing = dir.path().join("missing.img");
    let out = vabc(&["diff", s(&a), s(&missing), "-o", s(&cow)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.img"));
    for bad in [
        ["--compression", "lz5"],
        ["--compression-factor", "3k"],
        ["--format", "v4"],
    ] {
        let mut args = vec!["diff", s(&a), s(&a), "-o", s(&cow)];
        args.extend_from_slice(&bad);
        let out = vabc(&args);
        assert!(!out.status.success(), "{bad:?} accepted");
    }
    assert!(!cow.exists());
    // Refuses to overwrite an input, even through another name.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&a, &link).unwrap();
    let out = vabc(&["diff", s(&a), s(&a), "-o", s(&link)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("same file"));
    assert_eq!(std::fs::read(&a).unwrap(), vec![1u8; 8192]);
}

/// A loop device over an image, detached on drop.
struct Loop(String);

impl Loop {
    fn attach(img: &Path) -> Loop {
        let out = Command::new("losetup")
            .args(["--find", "--show", "--read-only", s(img)])
            .output()
            .expect("run losetup");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Loop(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["--detach", &self.0]).status();
    }
}

#[test]
fn block_devices_as_inputs() {
    let c = corpus();
    let old = c.join("tiny/old.erofs.img");
    let new = c.join("tiny/new.erofs.img");
    let lo_old = Loop::attach(&old);
    let lo_new = Loop::attach(&new);
    let dir = tempfile::tempdir().unwrap();
    let (from_dev, _) = round_trip(Path::new(&lo_old.0), Path::new(&lo_new.0), dir.path(), &[]);
    let (from_file, _) = round_trip(&old, &new, dir.path(), &[]);
    assert!(
        from_dev == from_file,
        "COW from block devices differs from COW from files"
    );
}
