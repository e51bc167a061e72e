//! Nothing wrong is ever written or served: a wrong base, a corrupt or undecodable
//! payload, a COW already merged elsewhere and an impossible merge state are each
//! refused before the first byte is written, with an error naming the file and what
//! differs, and the base left as it was.

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serve_common::{run_vabc, sha256_file, vabc};

/// An 8 MiB old image of compressible, varied text and a new one with ~100 blocks
/// changed in place and 64 KiB moved; the update made with `vabc diff` (and its
/// manifest) in `codec`.
fn update(dir: &Path, codec: &str) -> (PathBuf, PathBuf, PathBuf) {
    let mut rng = fastrand::Rng::with_seed(7);
    let words = [
        "alpha ", "beta ", "gamma ", "delta ", "epsilon ", "zeta\n", "eta ",
    ];
    let mut old = Vec::with_capacity(8 << 20);
    while old.len() < 8 << 20 {
        old.extend_from_slice(words[rng.usize(..words.len())].as_bytes());
        if rng.u8(..) < 8 {
            old.extend_from_slice(&rng.u64(..).to_le_bytes());
        }
    }
    old.truncate(8 << 20);
    let mut new = old.clone();
    for _ in 0..100 {
        let b = rng.usize(..2048) * 4096;
        let len = rng.usize(16..4096);
        for x in &mut new[b..b + len] {
            *x = rng.u8(b'a'..=b'z');
        }
    }
    new.copy_within(1 << 20..(1 << 20) + (64 << 10), 5 << 20);
    let (o, n, c) = (dir.join("old.img"), dir.join("new.img"), dir.join("u.cow"));
    std::fs::write(&o, &old).unwrap();
    std::fs::write(&n, &new).unwrap();
    let out = run_vabc(&[
        "diff",
        o.to_str().unwrap(),
        n.to_str().unwrap(),
        "-o",
        c.to_str().unwrap(),
        "--compression",
        codec,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.join("u.cow.manifest").exists());
    (o, n, c)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs a command that must fail (a serve that would otherwise run until stopped):
/// waits up to 60 s, then kills it and fails the test.
fn must_fail(args: &[&str]) -> Output {
    let mut child = Command::new(vabc())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("vabc {args:?} is still running after 60 s: it should have refused");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    assert!(!o.status.success(), "vabc {args:?} succeeded");
    o
}

/// `vabc apply --base BASE --cow COW -o OUT`, which must refuse; its stderr.
fn apply_refuses(base: &Path, cow: &Path, out: &Path) -> String {
    stderr(&must_fail(&[
        "apply",
        "--base",
        s(base),
        "--cow",
        s(cow),
        "-o",
        s(out),
    ]))
}

/// `vabc serve --nbd unix:DIR/nbd.sock` of `base` + `cow`, which must refuse; its stderr.
fn serve_refuses(dir: &Path, base: &Path, cow: &Path) -> String {
    let sock = dir.join("nbd.sock");
    stderr(&must_fail(&[
        "serve",
        "--base",
        s(base),
        "--cow",
        s(cow),
        "--nbd",
        &format!("unix:{}", s(&sock)),
    ]))
}

/// The first REPLACE op's payload offset and length, from `inspect --ops --json`.
fn replace_payload(cow: &Path) -> (u64, u64) {
    let o = run_vabc(&["inspect", s(cow), "--ops", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let op = v["ops"]
        .as_array()
        .unwrap()
        .iter()
        .find(|op| op["type"] == "REPLACE")
        .expect("a REPLACE op");
    (
        op["data_offset"].as_u64().unwrap(),
        op["data_length"].as_u64().unwrap(),
    )
}

fn poke(path: &Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

fn header_size(cow: &Path) -> u64 {
    let o = run_vabc(&["inspect", s(cow), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["header"]["header_size"].as_u64().unwrap()
}

#[test]
fn a_wrong_base_is_refused_by_apply_merge_serve_and_check() {
    let d = tempfile::tempdir().unwrap();
    let (old, new, cow) = update(d.path(), "zstd");
    let out = d.path().join("out.img");
    // The new image given as the base.
    let o = must_fail(&["apply", "--base", s(&new), "--cow", s(&cow), "-o", s(&out)]);
    let e = stderr(&o);
    assert!(
        e.contains(s(&new)) && e.contains("is not the image this update was made for"),
        "{e}"
    );
    assert!(e.contains("bytes 0..4194304"), "names the region: {e}");
    assert!(!out.exists());
    let base = d.path().join("base.img");
    std::fs::copy(&new, &base).unwrap();
    let before = sha256_file(&base);
    let e = stderr(&must_fail(&["merge", "--base", s(&base), "--cow", s(&cow)]));
    assert!(
        e.contains("is not the image this update was made for"),
        "{e}"
    );
    assert_eq!(sha256_file(&base), before, "merge wrote to a wrong base");
    // A stop, not a hint: the flag that skips the check is named only with what
    // skipping it does.
    assert!(
        !e.contains("--no-base-check") || e.contains("makes one that is neither"),
        "{e}"
    );
    let e = serve_refuses(d.path(), &base, &cow);
    assert!(
        e.contains("is not the image this update was made for"),
        "{e}"
    );
    let o = must_fail(&["inspect", s(&cow), "--check", "--base", s(&base)]);
    assert!(stderr(&o).contains("is not the image"), "{}", stderr(&o));
    // Arguments swapped at diff time: the update is for NEW, and says so.
    let swapped = d.path().join("swapped.cow");
    assert!(
        run_vabc(&["diff", s(&new), s(&old), "-o", s(&swapped)])
            .status
            .success()
    );
    let e = apply_refuses(&old, &swapped, &out);
    assert!(
        e.contains("is not the image this update was made for"),
        "{e}"
    );
    // The right base still works, and --no-base-check is the explicit way around.
    let o = run_vabc(&["apply", "--base", s(&old), "--cow", s(&cow), "-o", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(sha256_file(&out), sha256_file(&new));
    let o = run_vabc(&[
        "apply",
        "--base",
        s(&new),
        "--cow",
        s(&cow),
        "-o",
        s(&out),
        "--no-base-check",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_corrupt_payload_is_caught_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    // Uncompressed payloads: a flipped byte still decodes, to wrong data.
    let (old, _new, cow) = update(d.path(), "none");
    let (off, len) = replace_payload(&cow);
    poke(&cow, off + len / 2, &[0xde, 0xad, 0xbe, 0xef]);
    let o = must_fail(&["inspect", s(&cow), "--check", "--base", s(&old)]);
    assert!(
        stderr(&o).contains("does not make the new image"),
        "{}",
        stderr(&o)
    );
    let out = d.path().join("out.img");
    let e = apply_refuses(&old, &cow, &out);
    assert!(
        e.contains("does not make the new image") && e.contains("bytes"),
        "{e}"
    );
    assert!(!out.exists(), "apply left a wrong image");
    let leftovers: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    let base = d.path().join("base.img");
    std::fs::copy(&old, &base).unwrap();
    let before = sha256_file(&base);
    let e = stderr(&must_fail(&["merge", "--base", s(&base), "--cow", s(&cow)]));
    assert!(e.contains("does not make the new image"), "{e}");
    assert_eq!(sha256_file(&base), before, "merge wrote a corrupt payload");
}

#[test]
fn an_undecodable_payload_never_touches_the_base_even_without_a_manifest() {
    for codec in ["zstd", "lz4", "gz"] {
        let d = tempfile::tempdir().unwrap();
        let (old, _new, cow) = update(d.path(), codec);
        std::fs::remove_file(d.path().join("u.cow.manifest")).unwrap();
        let (off, len) = replace_payload(&cow);
        poke(&cow, off, &vec![0xff; len.min(64) as usize]);
        let o = must_fail(&["inspect", s(&cow), "--check"]);
        assert!(stderr(&o).contains("decode"), "{codec}: {}", stderr(&o));
        let base = d.path().join("base.img");
        std::fs::copy(&old, &base).unwrap();
        let before = sha256_file(&base);
        let o = must_fail(&[
            "merge",
            "--without-manifest",
            "--base",
            s(&base),
            "--cow",
            s(&cow),
        ]);
        assert!(stderr(&o).contains(s(&cow)), "{codec}: {}", stderr(&o));
        assert_eq!(
            sha256_file(&base),
            before,
            "{codec}: merge touched the base"
        );
    }
}

#[test]
fn a_merged_cow_is_used_up() {
    let d = tempfile::tempdir().unwrap();
    let (old, new, cow) = update(d.path(), "lz4");
    let a = d.path().join("a.img");
    std::fs::copy(&old, &a).unwrap();
    let o = run_vabc(&["merge", "--base", s(&a), "--cow", s(&cow)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(sha256_file(&a), sha256_file(&new));
    let o = run_vabc(&["inspect", s(&cow), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["merge_complete"], true);
    assert!(v["merge_state"].as_str().unwrap().starts_with("complete"));
    // Again on the merged base: nothing to do, and it says so.
    let o = run_vabc(&["merge", "--base", s(&a), "--cow", s(&cow)]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("already complete"), "{out}");
    // Another device's old image: refused, untouched.
    let b = d.path().join("b.img");
    std::fs::copy(&old, &b).unwrap();
    let e = stderr(&must_fail(&["merge", "--base", s(&b), "--cow", s(&cow)]));
    assert!(e.contains("merged COW is used up"), "{e}");
    assert_eq!(sha256_file(&b), sha256_file(&old));
    let e = serve_refuses(d.path(), &b, &cow);
    assert!(e.contains("merged COW is used up"), "{e}");
}

#[test]
fn apply_refuses_a_merge_killed_inside_its_first_window() {
    let d = tempfile::tempdir().unwrap();
    let (old, _new, cow) = update(d.path(), "lz4");
    // Counter still 0, but the first window published (state byte 2, STATE_DONE):
    // base blocks may already be overwritten.
    poke(&cow, header_size(&cow), &[2]);
    let out = d.path().join("out.img");
    let e = apply_refuses(&old, &cow, &out);
    assert!(e.contains("in progress"), "{e}");
    assert!(!out.exists());
}

#[test]
fn a_merge_counter_past_the_op_count_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (old, _new, cow) = update(d.path(), "lz4");
    poke(&cow, 26, &1_000_000u64.to_le_bytes());
    let e = serve_refuses(d.path(), &old, &cow);
    assert!(e.contains("num_merge_ops 1000000 exceeds"), "{e}");
    let e = stderr(&must_fail(&["inspect", s(&cow)]));
    assert!(e.contains("exceeds"), "{e}");
}

#[test]
fn apply_writes_zeros_as_holes_and_refuses_an_unbounded_size() {
    use std::os::unix::fs::MetadataExt;
    let d = tempfile::tempdir().unwrap();
    // 64 MiB, all zeros but for a little text: the output must stay sparse.
    let (old, new) = (d.path().join("old.img"), d.path().join("new.img"));
    let f = std::fs::File::create(&old).unwrap();
    f.set_len(64 << 20).unwrap();
    drop(f);
    std::fs::copy(&old, &new).unwrap();
    poke(&new, 5 << 20, b"hello, sparse world");
    let cow = d.path().join("u.cow");
    assert!(
        run_vabc(&["diff", s(&old), s(&new), "-o", s(&cow)])
            .status
            .success()
    );
    let out = d.path().join("out.img");
    let o = run_vabc(&["apply", "--base", s(&old), "--cow", s(&cow), "-o", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(sha256_file(&out), sha256_file(&new));
    let md = std::fs::metadata(&out).unwrap();
    assert!(
        md.blocks() * 512 <= 2 << 20,
        "{} bytes allocated for 64 MiB of mostly zeros",
        md.blocks() * 512
    );
    // Without a manifest, an op that reaches past the base's end needs --size.
    std::fs::remove_file(d.path().join("u.cow.manifest")).unwrap();
    let short = d.path().join("short.img");
    let f = std::fs::File::create(&short).unwrap();
    f.set_len(4 << 20).unwrap();
    drop(f);
    let e = apply_refuses(&short, &cow, &out);
    assert!(
        e.contains("past the end of the base") && e.contains("--size"),
        "{e}"
    );
}

#[test]
fn sigterm_during_apply_leaves_no_temporary_file() {
    let d = tempfile::tempdir().unwrap();
    // 96 MiB of random data over a zero base, stored uncompressed: apply takes long
    // enough to be interrupted while its temporary file exists.
    let (old, new) = (d.path().join("old.img"), d.path().join("new.img"));
    let f = std::fs::File::create(&old).unwrap();
    f.set_len(96 << 20).unwrap();
    drop(f);
    let mut rng = fastrand::Rng::with_seed(3);
    let data: Vec<u8> = (0..96 << 20).map(|_| rng.u8(..)).collect();
    std::fs::write(&new, data).unwrap();
    let cow = d.path().join("u.cow");
    let o = run_vabc(&[
        "diff",
        s(&old),
        s(&new),
        "-o",
        s(&cow),
        "--compression",
        "none",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = d.path().join("out.img");
    let temps = || -> Vec<String> {
        std::fs::read_dir(d.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    };
    let mut child = Command::new(vabc())
        .args(["apply", "--base", s(&old), "--cow", s(&cow), "-o", s(&out)])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while temps().is_empty() {
        assert!(Instant::now() < deadline, "no temporary file appeared");
        assert!(
            child.try_wait().unwrap().is_none(),
            "apply finished before it could be interrupted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: sending SIGTERM to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), None.or(Some(143)), "{}", stderr(&o));
    assert!(stderr(&o).contains("interrupted"), "{}", stderr(&o));
    assert!(temps().is_empty(), "left behind: {:?}", temps());
    assert!(!out.exists());
}

/// A counter damaged into "half merged" on an unmerged base: the manifest's per-op
/// hashes show that the ops it calls merged are not, before anything is written.
#[test]
fn a_merge_counter_damaged_to_half_merged_is_refused_before_writing() {
    let d = tempfile::tempdir().unwrap();
    let (old, _new, cow) = update(d.path(), "lz4");
    let o = run_vabc(&["inspect", s(&cow), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let total = v["ops_total"].as_u64().unwrap();
    poke(&cow, 26, &(total / 2).to_le_bytes());
    let base = d.path().join("base.img");
    std::fs::copy(&old, &base).unwrap();
    let e = stderr(&must_fail(&["merge", "--base", s(&base), "--cow", s(&cow)]));
    assert!(
        e.contains("ops are merged, but block") && e.contains("nothing was written"),
        "{e}"
    );
    assert_eq!(sha256_file(&base), sha256_file(&old));
}

/// A manifest whose new image ends before the ops do (a damaged block number would do
/// the same): the merge would write outside the new image, so it is refused.
#[test]
fn ops_past_the_end_of_the_new_image_are_refused_before_writing() {
    let d = tempfile::tempdir().unwrap();
    let (old, _new, cow) = update(d.path(), "lz4");
    let mp = d.path().join("u.cow.manifest");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
    m["new"]["size"] = serde_json::json!(4 << 20);
    let first = m["new"]["regions"][0].clone();
    m["new"]["regions"] = serde_json::json!([first]);
    std::fs::write(&mp, m.to_string()).unwrap();
    let base = d.path().join("base.img");
    std::fs::copy(&old, &base).unwrap();
    let e = stderr(&must_fail(&["merge", "--base", s(&base), "--cow", s(&cow)]));
    assert!(e.contains("past the end of the new image"), "{e}");
    assert_eq!(sha256_file(&base), sha256_file(&old));
}

/// `apply --label` makes a partial image, which the manifest (of the whole update)
/// does not describe: the base is still checked, the partial result is not.
#[test]
fn a_partial_apply_checks_the_base_but_not_the_result() {
    let d = tempfile::tempdir().unwrap();
    let vec = serve_common::vectors();
    let (base, expected) = (vec.join("base.img"), vec.join("expected.img"));
    let cow = d.path().join("u.cow");
    std::fs::copy(vec.join("v2_lz4_4096.cow"), &cow).unwrap();
    let o = run_vabc(&["manifest", s(&base), s(&expected), "--cow", s(&cow)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = d.path().join("l1.img");
    let args = |b: &Path| {
        run_vabc(&[
            "apply",
            "--base",
            s(b),
            "--cow",
            s(&cow),
            "-o",
            s(&out),
            "--label",
            "1",
        ])
    };
    let o = args(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = args(&expected);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("is not the image this update was made for"));
}
