//! Interrupted commands leave nothing behind: SIGINT and SIGTERM at random moments of
//! `diff`, `bundle create` and `bundle install` remove every temporary file and
//! folder (what is left is the inputs, and the whole output if the command had
//! finished), and what a SIGKILL left is removed by `vabc cleanup`.

mod serve_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serve_common::vabc;

/// Interrupts per signal and command.
const RUNS: usize = 20;

/// An old and a new image (8 MiB, a quarter of the blocks changed) in `dir`.
fn images(dir: &Path) -> (PathBuf, PathBuf) {
    let mut rng = fastrand::Rng::with_seed(7);
    let old: Vec<u8> = (0..8 << 20).map(|_| rng.u8(..)).collect();
    let mut new = old.clone();
    for block in (0..2048).step_by(4) {
        let at = block * 4096;
        rng.fill(&mut new[at..at + 4096]);
    }
    let (o, n) = (dir.join("old.img"), dir.join("new.img"));
    std::fs::write(&o, old).unwrap();
    std::fs::write(&n, new).unwrap();
    (o, n)
}

/// A folder with the images and an empty run folder for the commands' records.
fn setup() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (old, new) = images(tmp.path());
    let run_dir = tmp.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    (tmp, old, new, run_dir)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// One command under test: its arguments and the files a finished run leaves.
struct Case {
    what: &'static str,
    args: Vec<String>,
    /// What the folder holds after a finished run, beyond what it held before.
    outputs: Vec<&'static str>,
    /// A folder the command writes into (checked as a whole), if any.
    out_dir: Option<PathBuf>,
    /// What a finished run leaves in `out_dir`, by name (filled by the first run).
    reference: std::collections::BTreeMap<String, Vec<u8>>,
}

/// `bundle create` of the partition `parts` (`system=OLD,NEW`) into `c.vabc`.
fn bundle_create(parts: String) -> Case {
    Case {
        what: "bundle create",
        args: [
            "bundle",
            "create",
            "-p",
            &parts,
            "-o",
            "c.vabc",
            "--unsigned",
        ]
        .map(String::from)
        .to_vec(),
        outputs: vec!["c.vabc"],
        out_dir: None,
        reference: Default::default(),
    }
}

/// The case's command, started in `dir` with its records in `run_dir`.
fn spawn(case: &Case, dir: &Path, run_dir: &Path) -> std::process::Child {
    Command::new(vabc())
        .args(&case.args)
        .current_dir(dir)
        .env("VABC_RUN_DIR", run_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn run(case: &Case, dir: &Path, run_dir: &Path, signal: Option<(i32, Duration)>) -> Option<i32> {
    let mut child = spawn(case, dir, run_dir);
    if let Some((sig, after)) = signal {
        std::thread::sleep(after);
        // SAFETY: kill(2) with the child's pid, which has not been reaped yet.
        unsafe { libc::kill(child.id() as i32, sig) };
    }
    let st = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    st.code().or(st.signal().map(|s| 128 + s))
}

/// Each run leaves the inputs and either nothing or the whole output.
fn check(
    case: &Case,
    dir: &Path,
    run_dir: &Path,
    before: &[String],
    code: Option<i32>,
    label: &str,
) {
    let now = names(dir);
    let added: Vec<&String> = now.iter().filter(|n| !before.contains(n)).collect();
    let finished = code == Some(0);
    let mut got: Vec<String> = added.iter().map(|s| s.to_string()).collect();
    got.sort();
    match &case.out_dir {
        // An install keeps each partition it finished (a resumed run passes over
        // it): its folder holds complete files or nothing, never a temporary one.
        Some(out) => {
            let inside = names(out);
            assert!(
                inside.iter().all(|n| !n.starts_with('.')),
                "{} {label}: {inside:?} in {}",
                case.what,
                out.display()
            );
            if finished || !inside.is_empty() {
                assert_eq!(
                    got, case.outputs,
                    "{} {label}: the folder holds {now:?}",
                    case.what
                );
                for n in &inside {
                    assert_eq!(
                        std::fs::read(out.join(n)).ok(),
                        case.reference.get(n).cloned(),
                        "{} {label}: {n} is not the finished run's",
                        case.what
                    );
                }
            } else {
                assert!(
                    got.is_empty(),
                    "{} {label}: the folder holds {now:?}",
                    case.what
                );
            }
        }
        // Any other command finished whole, or left nothing.
        None => {
            let want: Vec<String> = if finished {
                case.outputs.iter().map(|s| s.to_string()).collect()
            } else {
                Vec::new()
            };
            assert_eq!(
                got, want,
                "{} {label} (exit {code:?}): the folder holds {now:?}",
                case.what
            );
        }
    }
    assert!(
        names(run_dir).is_empty(),
        "{} {label}: {:?} in the run folder",
        case.what,
        names(run_dir)
    );
}

fn reset(case: &Case, dir: &Path, before: &[String]) {
    for n in names(dir) {
        if !before.contains(&n) {
            let p = dir.join(&n);
            if p.is_dir() {
                std::fs::remove_dir_all(&p).unwrap();
            } else {
                std::fs::remove_file(&p).unwrap();
            }
        }
    }
    if let Some(out) = &case.out_dir {
        let _ = std::fs::remove_dir_all(out);
    }
}

#[test]
fn sigint_and_sigterm_at_random_moments_leave_nothing_behind() {
    let (tmp, old, new, run_dir) = setup();
    let dir = tmp.path();
    // A signed bundle to install (made once, by the command under test).
    let key = dir.join("key.pem");
    let st = Command::new("openssl")
        .args(["genpkey", "-algorithm", "ed25519", "-out"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(st.success());
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let parts = format!("system={},{}", s(&old), s(&new));
    let bundle = dir.join("u.vabc");
    let o = Command::new(vabc())
        .args([
            "bundle",
            "create",
            "-p",
            &parts,
            "-o",
            &s(&bundle),
            "--unsigned",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out_dir = dir.join("ota");
    let mut cases = [
        Case {
            what: "diff",
            args: vec![
                "diff".into(),
                s(&old),
                s(&new),
                "-o".into(),
                "d.cow".into(),
                "--no-progress".into(),
            ],
            outputs: vec!["d.cow", "d.cow.manifest"],
            out_dir: None,
            reference: Default::default(),
        },
        bundle_create(parts.clone()),
        Case {
            what: "bundle install",
            args: vec![
                "bundle".into(),
                "install".into(),
                s(&bundle),
                "-b".into(),
                format!("system={}", s(&old)),
                "-o".into(),
                s(&out_dir),
                "--allow-unsigned".into(),
            ],
            outputs: vec!["ota"],
            out_dir: Some(out_dir.clone()),
            reference: Default::default(),
        },
    ];
    let before = names(dir);
    let mut rng = fastrand::Rng::with_seed(42);
    let mut interrupted = 0;
    for case in &mut cases {
        // How long a whole run takes: the signals land anywhere in it.
        let t = Instant::now();
        let code = run(case, dir, &run_dir, None);
        assert_eq!(code, Some(0), "{}", case.what);
        let span = t.elapsed().as_millis() as u64;
        if let Some(out) = &case.out_dir {
            for n in names(out) {
                let bytes = std::fs::read(out.join(&n)).unwrap();
                case.reference.insert(n, bytes);
            }
        }
        let case = &*case;
        check(case, dir, &run_dir, &before, code, "uninterrupted");
        reset(case, dir, &before);
        let mut landed = 0;
        for sig in [libc::SIGINT, libc::SIGTERM] {
            for i in 0..RUNS {
                let after = Duration::from_millis(rng.u64(0..=span));
                let code = run(case, dir, &run_dir, Some((sig, after)));
                let label = format!("signal {sig} after {after:?} (run {i})");
                check(case, dir, &run_dir, &before, code, &label);
                if code == Some(128 + sig) {
                    landed += 1;
                }
                reset(case, dir, &before);
            }
        }
        assert!(
            landed >= RUNS,
            "{}: only {landed} of {} signals landed before the end",
            case.what,
            2 * RUNS
        );
        interrupted += landed;
    }
    eprintln!("{interrupted} interrupts, nothing left behind");
}

#[test]
fn what_a_sigkill_left_is_removed_by_cleanup() {
    let (tmp, old, new, run_dir) = setup();
    let dir = tmp.path();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let parts = format!("system={},{}", s(&old), s(&new));
    let case = bundle_create(parts);
    let before = names(dir);
    let mut child = spawn(&case, dir, &run_dir);
    let t = Instant::now();
    // Killed once its work folder is there and recorded (the record is written just
    // after the folder is made: a kill between the two is the one moment left).
    while !names(dir).iter().any(|n| n.starts_with(".vabc-bundle.")) || names(&run_dir).is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no work folder appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(names(dir).iter().any(|n| n.starts_with(".vabc-bundle.")));
    assert_eq!(names(&run_dir).len(), 1, "{:?}", names(&run_dir));
    let o = Command::new(vabc())
        .args(["cleanup", "--json"])
        .env("VABC_RUN_DIR", &run_dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        report["removed"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["kind"] == "temp"),
        "{report}"
    );
    assert_eq!(names(dir), before, "cleanup left something");
    assert!(names(&run_dir).is_empty());
}
