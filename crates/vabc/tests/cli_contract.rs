//! docs/cli.md, checked: the exit status of each failure class, and the `--json`
//! reports (they parse, carry `schema_version`, and have the keys scripts use).

mod serve_common;

use std::path::Path;

use serve_common::{run_vabc, vectors};

fn code(args: &[&str]) -> (Option<i32>, String) {
    let o = run_vabc(args);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn json(args: &[&str]) -> serde_json::Value {
    let o = run_vabc(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    });
    assert_eq!(v["schema_version"], 1, "{args:?}");
    v
}

fn has(v: &serde_json::Value, keys: &[&str]) {
    for k in keys {
        assert!(v.get(k).is_some(), "no {k:?} in {v}");
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn every_json_report_parses_and_carries_its_schema_version() {
    let d = tempfile::tempdir().unwrap();
    let (base, expected) = (vectors().join("base.img"), vectors().join("expected.img"));
    let cow = d.path().join("u.cow");
    let v = json(&["diff", s(&base), s(&expected), "-o", s(&cow), "--json"]);
    // An unmerged copy for apply and manifest (the merge below uses the COW up).
    let fresh = d.path().join("fresh.cow");
    std::fs::copy(&cow, &fresh).unwrap();
    std::fs::copy(
        d.path().join("u.cow.manifest"),
        d.path().join("fresh.cow.manifest"),
    )
    .unwrap();
    has(
        &v,
        &[
            "ops",
            "cow_size",
            "new_size",
            "manifest",
            "base_sha256",
            "new_sha256",
        ],
    );
    let v = json(&["inspect", s(&cow), "--json", "--check", "--base", s(&base)]);
    has(&v, &["ops_total", "merge_state", "merge_complete", "check"]);
    assert_eq!(v["check"]["ok"], true);
    let b = d.path().join("b.img");
    std::fs::copy(&base, &b).unwrap();
    let v = json(&["merge", "--base", s(&b), "--cow", s(&cow), "--json"]);
    has(
        &v,
        &[
            "total_ops",
            "merged",
            "complete",
            "check_seconds",
            "seconds",
        ],
    );
    let v = json(&[
        "verity",
        "format",
        s(&expected),
        s(&d.path().join("h")),
        "--json",
    ]);
    has(&v, &["root_hash", "salt", "data_blocks"]);
    let v = json(&["cleanup", "--json"]);
    has(&v, &["removed", "failed"]);
    let out = d.path().join("out.img");
    let v = json(&[
        "apply",
        "--base",
        s(&base),
        "--cow",
        s(&fresh),
        "-o",
        s(&out),
        "--json",
    ]);
    has(&v, &["output", "size", "base_checked", "new_sha256"]);
    let root = run_vabc(&[
        "verity",
        "format",
        s(&expected),
        s(&d.path().join("h2")),
        "--json",
    ]);
    let root: serde_json::Value = serde_json::from_slice(&root.stdout).unwrap();
    let root = root["root_hash"].as_str().unwrap().to_string();
    let v = json(&[
        "verity",
        "verify",
        s(&expected),
        s(&d.path().join("h2")),
        &root,
        "--json",
    ]);
    assert_eq!(v["verified"], true);
    let m = d.path().join("m.manifest");
    let v = json(&[
        "manifest",
        s(&base),
        s(&expected),
        "--cow",
        s(&fresh),
        "-o",
        s(&m),
        "--json",
    ]);
    has(&v, &["manifest", "base_sha256", "new_sha256", "cow_ops"]);
    let img = d.path().join("avb.img");
    std::fs::copy(&expected, &img).unwrap();
    let v = json(&[
        "avb",
        "add-hashtree-footer",
        s(&img),
        "--partition-size",
        "8M",
        "--partition-name",
        "system",
        "--json",
    ]);
    assert_eq!(v["descriptors"][0]["partition_name"], "system");
    let v = json(&["avb", "info", s(&img), "--json"]);
    has(&v, &["image_size", "footer", "descriptors"]);

    // The bundle commands (unsigned here; bundle_cli.rs covers keys).
    let bundle = d.path().join("u.vabc");
    let part = format!("system={},{}", s(&base), s(&expected));
    let v = json(&[
        "bundle",
        "create",
        "-p",
        &part,
        "-o",
        s(&bundle),
        "--unsigned",
        "--json",
    ]);
    has(&v, &["output", "size", "signed", "partitions"]);
    let v = json(&["bundle", "info", s(&bundle), "--json"]);
    has(
        &v,
        &["format_version", "signed", "payload_bytes", "manifest"],
    );
    let v = json(&["bundle", "verify", s(&bundle), "--allow-unsigned", "--json"]);
    has(&v, &["signature", "partitions", "payload_bytes"]);
    let b = format!("system={}", s(&base));
    let v = json(&[
        "bundle",
        "plan",
        s(&bundle),
        "-b",
        &b,
        "--allow-unsigned",
        "--json",
    ]);
    has(
        &v,
        &[
            "bases_ok",
            "download_bytes",
            "cow_bytes",
            "install_seconds",
            "merge_seconds",
        ],
    );
    let out = d.path().join("bundle-out");
    std::fs::create_dir(&out).unwrap();
    for cmd in ["install", "apply"] {
        let v = json(&[
            "bundle",
            cmd,
            s(&bundle),
            "-b",
            &b,
            "-o",
            s(&out),
            "--allow-unsigned",
            "--json",
        ]);
        has(&v, &["bundle", "partitions"]);
    }
}

#[test]
fn each_failure_class_has_its_exit_status() {
    let d = tempfile::tempdir().unwrap();
    let (base, expected) = (vectors().join("base.img"), vectors().join("expected.img"));
    let cow = d.path().join("u.cow");
    assert_eq!(
        code(&["diff", s(&base), s(&expected), "-o", s(&cow)]).0,
        Some(0)
    );
    // Usage.
    assert_eq!(code(&["inspect", s(&cow), "--no-such-flag"]).0, Some(2));
    // Error: the command cannot decide.
    let (c, e) = code(&["inspect", s(&d.path().join("missing.cow"))]);
    assert_eq!(c, Some(1), "{e}");
    // Mismatch: a wrong base, a bad merge order, a tree that does not verify.
    let out = d.path().join("out.img");
    let (c, e) = code(&[
        "apply",
        "--base",
        s(&expected),
        "--cow",
        s(&cow),
        "-o",
        s(&out),
    ]);
    assert_eq!(c, Some(3), "{e}");
    let (c, e) = code(&[
        "inspect",
        s(&vectors().join("v3_lz4_4096_badseq.cow")),
        "--verify-merge",
    ]);
    assert_eq!(c, Some(3), "{e}");
    let h = d.path().join("h");
    assert_eq!(code(&["verity", "format", s(&expected), s(&h)]).0, Some(0));
    let (c, e) = code(&["verity", "verify", s(&base), s(&h), &"00".repeat(32)]);
    assert_eq!(c, Some(3), "{e}");
}

#[test]
fn the_documented_install_gives_manual_pages_and_completions() {
    let prefix = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install.sh");
    let o = std::process::Command::new("bash")
        .arg(&script)
        .arg(prefix.path())
        .env("VABC", serve_common::vabc())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let man = prefix.path().join("share/man");
    let o = std::process::Command::new("man")
        .arg("-M")
        .arg(&man)
        .arg("vabc-diff")
        .env("MANPAGER", "cat")
        .env("PAGER", "cat")
        .output()
        .unwrap();
    let page = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && page.contains("--compression"),
        "{page}"
    );
    // The synopsis is the command as typed, each option with its value.
    let synopsis = page
        .split("SYNOPSIS")
        .nth(1)
        .and_then(|t| t.split("DESCRIPTION").next())
        .unwrap_or_default()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        synopsis.starts_with("vabc diff ") && synopsis.contains("-o|--output <OUTPUT>"),
        "{synopsis}"
    );
    let bash =
        std::fs::read_to_string(prefix.path().join("share/bash-completion/completions/vabc"))
            .unwrap();
    assert!(
        bash.contains("_vabc") && bash.contains("--verity"),
        "{bash}"
    );
}

#[test]
fn progress_is_plain_lines_off_a_terminal_and_off_when_asked() {
    let d = tempfile::tempdir().unwrap();
    let (base, expected) = (vectors().join("base.img"), vectors().join("expected.img"));
    let cow = d.path().join("u.cow");
    let out = d.path().join("out.img");
    let run = |extra: &[&str]| {
        let o = std::process::Command::new(serve_common::vabc())
            .args(["diff", s(&base), s(&expected), "-o", s(&cow)])
            .args(extra)
            .env("VABC_PROGRESS_INTERVAL", "0")
            .output()
            .unwrap();
        assert!(o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = run(&[]);
    assert!(e.contains("vabc: planning: ") && e.contains('%'), "{e}");
    assert!(!e.contains('\r'), "a bar on a pipe: {e:?}");
    assert_eq!(run(&["--no-progress"]), "");
    assert_eq!(run(&["-q"]), "");
    let o = std::process::Command::new(serve_common::vabc())
        .args(["apply", "--base", s(&base), "--cow", s(&cow), "-o", s(&out)])
        .env("VABC_PROGRESS_INTERVAL", "0")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("vabc: apply: "));
}

#[test]
fn messages_go_through_one_logger_that_q_and_vabc_log_quiet() {
    // A COW without a manifest: apply says it cannot check the base (a warning).
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out.img");
    let run = |extra: &[&str], env: Option<&str>| {
        let mut c = std::process::Command::new(serve_common::vabc());
        c.args(["apply", "--base"])
            .arg(vectors().join("base.img"))
            .arg("--cow")
            .arg(vectors().join("v3_lz4_65536.cow"))
            .arg("-o")
            .arg(&out)
            .args(extra);
        if let Some(e) = env {
            c.env("VABC_LOG", e);
        }
        let o = c.output().unwrap();
        assert!(o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    assert!(run(&[], None).contains("has no manifest"));
    assert!(!run(&["-q"], None).contains("has no manifest"));
    assert!(!run(&[], Some("error")).contains("has no manifest"));
}

#[test]
fn trace_json_reports_carry_their_schema_version() {
    let d = tempfile::tempdir().unwrap();
    let prefix = d.path().join("t");
    let data = d.path().join("data");
    let dd = format!(
        "if=/dev/zero of={} bs=4k count=64 oflag=direct conv=fsync",
        s(&data)
    );
    let mut args = vec![
        "trace",
        "record",
        "-o",
        s(&prefix),
        "--json",
        "--",
        "dd",
        "status=none",
    ];
    args.extend(dd.split(' '));
    let v = json(&args);
    has(
        &v,
        &[
            "files",
            "events",
            "lost_events",
            "devices",
            "unmatched_events",
        ],
    );
    let v = json(&["trace", "report", s(&prefix), "--json"]);
    has(&v, &["files", "events", "devices"]);
    let dev = &v["devices"][0];
    has(
        dev,
        &[
            "device",
            "direction",
            "stages",
            "queued",
            "issued",
            "merged",
            "seeks",
        ],
    );
    let v = json(&[
        "trace",
        "replay",
        s(&prefix),
        "--target",
        s(&d.path().join("target")),
        "--json",
    ]);
    has(&v, &["device", "requests", "outcome"]);
    has(
        &v["outcome"],
        &["seconds", "reads", "writes", "bytes", "syncs"],
    );
}

/// docs/cli.md, "Errors": each message says what to do next, and a usage error
/// exits 2.
#[test]
fn errors_name_the_next_step() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let img = |name: &str, seed: u8| {
        let p = d.join(name);
        let data: Vec<u8> = (0..1u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8 ^ seed)
            .collect();
        std::fs::write(&p, data).unwrap();
        p
    };
    let (old, new) = (img("old.img", 0), img("new.img", 1));
    let parts = format!("system={},{}", s(&old), s(&new));
    let says = |args: &[&str], status: i32, words: &[&str]| {
        let (c, e) = code(args);
        assert_eq!(c, Some(status), "{args:?}: {e}");
        for w in words {
            assert!(e.contains(w), "{args:?}: no {w:?} in: {e}");
        }
    };
    // A partition value without its name: usage (2), with the fix.
    says(
        &[
            "bundle",
            "install",
            "u.vabc",
            "-b",
            "old.img",
            "-o",
            s(d),
            "--allow-unsigned",
        ],
        2,
        &["expected NAME=", "system=old.img"],
    );
    // No key: the tip names the way without one.
    says(
        &["bundle", "create", "-p", &parts, "-o", "x.vabc"],
        2,
        &["tip:", "--unsigned"],
    );
    says(
        &["bundle", "verify", "x.vabc"],
        2,
        &["tip:", "--allow-unsigned"],
    );
    // An output that is a folder, or in a folder that is not there: refused at once.
    says(
        &["diff", s(&old), s(&new), "-o", s(d)],
        1,
        &["is a folder", "name the file to write"],
    );
    let nowhere = d.join("no/such/u.cow");
    says(
        &["diff", s(&old), s(&new), "-o", s(&nowhere)],
        1,
        &["does not exist; create it first"],
    );
    says(
        &["bundle", "create", "-p", &parts, "-o", s(d), "--unsigned"],
        1,
        &["is a folder"],
    );
    // A folder given as an image.
    let folder = format!("system={},{}", s(d), s(&new));
    says(
        &[
            "bundle",
            "create",
            "-p",
            &folder,
            "-o",
            s(&d.join("f.vabc")),
            "--unsigned",
        ],
        1,
        &["Is a directory"],
    );
    says(
        &["diff", s(d), s(&new), "-o", s(&d.join("f.cow"))],
        1,
        &["Is a directory"],
    );
    assert!(!d.join("f.vabc").exists() && !d.join("f.cow").exists());
    // A ready file whose folder is missing: refused before serving, naming the fix.
    let cow = d.join("u.cow");
    let o = run_vabc(&["diff", s(&old), s(&new), "-o", s(&cow)]);
    assert!(o.status.success());
    let ready = d.join("run/vabc/ready.json");
    let f = d.join("f");
    let mnt = d.join("mnt");
    let serve = |how: &[&str]| {
        let mut a = vec!["serve", "--base", s(&old), "--cow", s(&cow)];
        a.extend_from_slice(how);
        code(&a)
    };
    let (c, e) = serve(&["--ready-file", s(&ready), "--fuse", s(&f)]);
    assert_eq!(c, Some(1), "{e}");
    assert!(
        e.contains("does not exist; create it first") && e.contains("RuntimeDirectory="),
        "{e}"
    );
    // --mount of an image that holds no file system it knows: serve it as a device.
    std::fs::create_dir(&mnt).unwrap();
    let (c, e) = serve(&["--mount", s(&mnt)]);
    assert_eq!(c, Some(1), "{e}");
    assert!(
        e.contains("neither ext4 nor EROFS") && e.contains("--fuse, --nbd or --ublk"),
        "{e}"
    );
}
