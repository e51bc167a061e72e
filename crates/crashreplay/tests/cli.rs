//! `vabc-crashreplay` as crash.sh runs it: `plan` lists states whose ids `make`
//! turns into images; a bad log or id fails with a message naming it, and leaves
//! nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vabc-crashreplay"))
        .args(args)
        .output()
        .unwrap()
}

/// `make` of state `id` from `log` over `dev` into `out`.
fn make(log: &Path, dev: &Path, id: &str, out: &Path) -> Output {
    run(&[
        "make",
        s(log),
        "--device",
        s(dev),
        "--state",
        id,
        "-o",
        s(out),
    ])
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The sample log in `dir` ("log"), parsed, and a zeroed device of `len` bytes
/// ("dev"; the log's own device size when `None`).
fn sample(dir: &Path, len: Option<u64>) -> (PathBuf, writelog::Log, PathBuf) {
    let log = dir.join("log");
    std::fs::write(&log, writelog::fuzzing::sample_log()).unwrap();
    let parsed = writelog::Log::open(&log).unwrap();
    let dev = dir.join("dev");
    let len = len.unwrap_or(parsed.device_len());
    std::fs::write(&dev, vec![0u8; len as usize]).unwrap();
    (log, parsed, dev)
}

#[test]
fn planned_states_are_made_from_their_ids() {
    let dir = tempfile::tempdir().unwrap();
    let (log, parsed, dev) = sample(dir.path(), None);

    let o = run(&["info", s(&log)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let info: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(info["entries"], parsed.entries().len());

    let o = run(&["plan", s(&log), "--random", "5", "--seed", "3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan: Vec<serde_json::Value> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(plan.len(), parsed.durable_points().len() + 5);
    for p in &plan {
        let id = p["id"].as_str().unwrap();
        let out = dir.path().join(format!("{id}.img"));
        let o = make(&log, &dev, id, &out);
        assert!(
            o.status.success(),
            "{id}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(std::fs::metadata(&out).unwrap().len(), parsed.device_len());
    }
    // The last durable point is the whole log applied.
    let last = plan[parsed.durable_points().len() - 1]["id"]
        .as_str()
        .unwrap();
    let mut want = vec![0u8; parsed.device_len() as usize];
    let n = parsed.entries().len();
    parsed
        .apply(
            &parsed.clean_state(n),
            &std::fs::File::open(&log).unwrap(),
            &mut want,
            &dev,
        )
        .unwrap();
    assert_eq!(
        std::fs::read(dir.path().join(format!("{last}.img"))).unwrap(),
        want
    );
}

#[test]
fn bad_input_names_what_is_wrong_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.log");
    std::fs::write(&bad, b"not a log").unwrap();
    let o = run(&["plan", s(&bad)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("bad.log"));

    let (log, _, dev) = sample(dir.path(), Some(1 << 20));
    let out = dir.path().join("out.img");
    let o = make(&log, &dev, "q1", &out);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("\"q1\""));
    let mut names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["bad.log", "dev", "log"]);
}
