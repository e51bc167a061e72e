//! `vabc serve` under a service manager: READY=1 on $NOTIFY_SOCKET once serving (and
//! not before the ready report exists), STOPPING=1 on SIGTERM.

mod serve_common;

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

use serve_common::{sigterm, sparse_pair, vabc};

#[test]
fn serve_tells_the_service_manager_when_it_is_ready_and_when_it_stops() {
    let d = tempfile::tempdir().unwrap();
    let (old, _new, cow) = sparse_pair(d.path());
    let notify = d.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let ready = d.path().join("ready.json");
    // A stale report from an earlier run must not pass for this one.
    std::fs::write(&ready, "{\"pid\": 1}").unwrap();
    let mut child = Command::new(vabc())
        .arg("serve")
        .arg("--base")
        .arg(&old)
        .arg("--cow")
        .arg(&cow)
        .arg("--nbd")
        .arg(format!("unix:{}", d.path().join("nbd.sock").display()))
        .arg("--ready-file")
        .arg(&ready)
        .env("NOTIFY_SOCKET", &notify)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).expect("no notification within 60 s");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg}");
    assert!(ready.exists(), "READY=1 before the ready report");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    assert_eq!(report["pid"], child.id());
    serve_common::validate_report("serve-ready", &report);
    sigterm(child.id());
    let n = sock.recv(&mut buf).expect("no STOPPING=1");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("STOPPING=1"));
    assert!(child.wait().unwrap().success());
    assert!(!ready.exists(), "the ready report outlived the server");
}
