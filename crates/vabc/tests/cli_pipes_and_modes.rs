//! Command-line manners: a reader that closes the pipe early ends a command quietly
//! (exit 0 or SIGPIPE, never a panic), and output files get the mode the umask allows.

mod serve_common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use serve_common::{vabc, vectors};

#[test]
fn closing_the_pipe_early_never_panics() {
    let cow = vectors().join("v3_lz4_65536.cow");
    let cow = cow.to_str().unwrap();
    for args in [
        vec!["inspect", cow, "--ops", "--json"],
        vec!["inspect", cow, "--ops"],
        vec!["inspect", cow, "--ops", "--order", "merge", "--json"],
    ] {
        let mut child = Command::new(vabc())
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(!first.is_empty());
        // The reader is gone (as `| head -1` would be).
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
            "{args:?}: {:?} {stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn outputs_follow_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out.img");
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 022 && exec {} apply --base {} --cow {} -o {}",
            vabc(),
            vectors().join("base.img").display(),
            vectors().join("v3_lz4_65536.cow").display(),
            out.display()
        ))
        .status()
        .unwrap();
    assert!(st.success());
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644);
    // The COW `diff` writes (through the COW writer's own temporary file), its
    // manifest and verity tree too.
    let cow = d.path().join("u.cow");
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 027 && exec {} diff {} {} -o {} --verity",
            vabc(),
            vectors().join("base.img").display(),
            vectors().join("expected.img").display(),
            cow.display()
        ))
        .status()
        .unwrap();
    assert!(st.success());
    for f in ["u.cow", "u.cow.manifest", "u.cow.verity"] {
        let mode = std::fs::metadata(d.path().join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o640, "{f}");
    }
}
