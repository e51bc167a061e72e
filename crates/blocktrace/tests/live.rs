//! Recording a real device: a loop device over a file, read cold with O_DIRECT.
//! Needs root and loop devices (the test suite runs as root; see test.sh).

use std::process::Command;

use blocktrace::tracefs::{RecordOptions, Recorder};
use blocktrace::{Action, Dev};

fn loop_device(file: &std::path::Path) -> String {
    let out = Command::new("losetup")
        .args(["-f", "--show"])
        .arg(file)
        .output()
        .expect("losetup");
    assert!(
        out.status.success(),
        "losetup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn a_cold_direct_read_is_recorded_request_by_request() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.img");
    std::fs::write(&img, vec![7u8; 8 << 20]).unwrap();
    let dev_path = loop_device(&img);
    let rdev = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&dev_path).unwrap().rdev()
    };
    let dev = Dev::from_rdev(rdev);
    let rec = Recorder::start(&RecordOptions {
        devices: vec![dev],
        ..Default::default()
    })
    .unwrap();
    let st = Command::new("dd")
        .args([
            format!("if={dev_path}"),
            "of=/dev/null".into(),
            "bs=64k".into(),
            "count=32".into(),
            "iflag=direct".into(),
        ])
        .output()
        .unwrap();
    let recording = rec.stop();
    Command::new("losetup")
        .args(["-d", &dev_path])
        .status()
        .unwrap();
    assert!(st.status.success());
    let recording = recording.unwrap();
    let events = recording.merged();
    let count = |a: Action| events.iter().filter(|e| e.action == a).count();
    eprintln!(
        "{:?} {:?}",
        recording.stats,
        [
            count(Action::Queue),
            count(Action::GetRq),
            count(Action::Issue),
            count(Action::Complete)
        ]
    );
    assert!(
        events.iter().all(|e| e.dev == dev),
        "only the traced device"
    );
    assert_eq!(count(Action::Queue), 32, "one bio per 64 KiB read");
    assert_eq!(count(Action::Complete), 32);
    let reads: u64 = events
        .iter()
        .filter(|e| e.action == Action::Complete)
        .map(|e| u64::from(e.bytes))
        .sum();
    assert_eq!(reads, 32 * 65536);
    assert!(events.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
}
