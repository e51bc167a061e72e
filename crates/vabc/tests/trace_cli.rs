//! `vabc trace` on a real device (a loop device over a file; root), its report
//! checked against btt's on the same capture (blkparse and btt from Debian's
//! blktrace: the trace files we write are blktrace's format).

use std::path::Path;
use std::process::{Command, Output};

fn vabc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vabc"))
        .args(args)
        .output()
        .expect("run vabc")
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
        "{what} unexpectedly succeeded: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A loop device over a new file of `mib` MiB; detached on drop.
struct Loop(String);

impl Loop {
    fn new(file: &Path, mib: usize) -> Loop {
        std::fs::write(file, vec![0x5au8; mib << 20]).unwrap();
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(file)
            .output()
            .expect("losetup");
        Loop(ok(&out, "losetup").trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// btt's "All Devices" rows: stage → (avg seconds, N).
fn btt_rows(dir: &Path, name: &str) -> std::collections::HashMap<String, (f64, u64)> {
    let merged = dir.join("merged.bin");
    let o = Command::new("blkparse")
        .current_dir(dir)
        .args(["-i", name, "-d"])
        .arg(&merged)
        .arg("-O")
        .output()
        .expect("blkparse not found: install the Debian package blktrace");
    ok(&o, "blkparse");
    // btt writes its per-device rate files into the current folder.
    let o = Command::new("btt")
        .current_dir(dir)
        .arg("-i")
        .arg(&merged)
        .output()
        .expect("btt");
    let text = ok(&o, "btt");
    let all = text
        .split("==================== Device Overhead")
        .next()
        .unwrap_or("");
    all.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 5 && f[0].len() == 3 && f[0].as_bytes()[1] == b'2').then(|| {
                (
                    f[0].to_string(),
                    (f[2].parse().unwrap(), f[4].parse().unwrap()),
                )
            })
        })
        .collect()
}

#[test]
fn a_recorded_cold_read_and_direct_writes_agree_with_btt() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Loop::new(&dir.path().join("disk.img"), 32);
    // Through an I/O scheduler (I events, merges of the buffered writes' bios).
    let name = dev.0.trim_start_matches("/dev/");
    std::fs::write(format!("/sys/block/{name}/queue/scheduler"), "mq-deadline").unwrap();
    let out = dir.path().join("t");
    let script = format!(
        "dd if={0} of=/dev/null bs=128k count=96 iflag=direct status=none && \
         dd if=/dev/zero of={0} bs=4k count=300 seek=2000 oflag=direct status=none && \
         dd if=/dev/urandom of={0} bs=4k count=1000 seek=4000 conv=fsync status=none",
        dev.0
    );
    let o = vabc(&[
        "trace",
        "record",
        "-d",
        &dev.0,
        "-o",
        out.to_str().unwrap(),
        "--json",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let rec: serde_json::Value = serde_json::from_str(&ok(&o, "trace record")).unwrap();
    let devs = rec["devices"].as_array().unwrap();
    let part = |d: &str| {
        devs.iter()
            .find(|x| x["direction"] == d)
            .unwrap_or_else(|| panic!("no {d} part"))
    };
    let (read, write, all) = (part("read"), part("write"), part("all"));
    assert_eq!(read["stages"]["D2C"]["n"], 96);
    assert_eq!(read["stages"]["Q2C"]["n"], 96);
    assert_eq!(read["bytes_completed"], 96 * 131072);
    assert_eq!(
        write["stages"]["D2C"]["n"], 1300,
        "per bio, merged ones included"
    );
    assert!(
        write["merged"].as_u64().unwrap() > 0,
        "the buffered writes' bios merged"
    );
    assert!(
        write["stages"]["G2I"]["n"].as_u64().unwrap() >= 300,
        "I events under mq-deadline"
    );
    assert_eq!(rec["lost_events"], 0);

    // The report of the written files says the same; btt agrees stage by stage.
    let o = vabc(&["trace", "report", out.to_str().unwrap(), "--json"]);
    let rep: serde_json::Value = serde_json::from_str(&ok(&o, "trace report")).unwrap();
    assert_eq!(rep["devices"], rec["devices"]);
    let btt = btt_rows(dir.path(), "t");
    assert!(
        ["D2C", "Q2C", "M2D", "I2D"]
            .iter()
            .all(|k| btt.contains_key(*k)),
        "btt printed {btt:?}"
    );
    for (stage, (avg_s, n)) in &btt {
        let ours = &all["stages"][stage.as_str()];
        assert_eq!(ours["n"].as_u64(), Some(*n), "{stage}: N");
        let avg = ours["avg_ns"].as_f64().unwrap() / 1e9;
        assert!(
            (avg - avg_s).abs() <= avg_s * 0.01 + 1e-9,
            "{stage}: avg {avg} vs btt's {avg_s}"
        );
    }

    // The text report is btt's table, per direction.
    let o = vabc(&["trace", "report", out.to_str().unwrap()]);
    let text = ok(&o, "trace report");
    assert!(
        text.contains("D2C") && text.contains("read: 96 bios queued"),
        "{text}"
    );
}

#[test]
fn bad_input_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = failed(
        &vabc(&["trace", "record", "-d", "/dev/no-such-disk", "--", "true"]),
        "missing device",
    );
    assert!(e.contains("/dev/no-such-disk: no such device"), "{e}");
    let e = failed(
        &vabc(&["trace", "record", "-d", "/dev/null", "--", "true"]),
        "not a block device",
    );
    assert!(e.contains("/dev/null: not a block device"), "{e}");

    let foreign = dir.path().join("x.blktrace.0");
    std::fs::write(
        &foreign,
        b"PK\x03\x04 this is a zip file, or something else entirely",
    )
    .unwrap();
    let e = failed(
        &vabc(&["trace", "report", foreign.to_str().unwrap()]),
        "foreign file",
    );
    assert!(
        e.contains("x.blktrace.0: offset 0: not a blktrace record"),
        "{e}"
    );

    // A real record cut short.
    let dev = Loop::new(&dir.path().join("disk.img"), 4);
    let out = dir.path().join("cut");
    let o = vabc(&[
        "trace",
        "record",
        "-d",
        &dev.0,
        "-o",
        out.to_str().unwrap(),
        "--",
        "dd",
        &format!("if={}", dev.0),
        "of=/dev/null",
        "bs=4k",
        "count=8",
        "iflag=direct",
        "status=none",
    ]);
    ok(&o, "record");
    let full = dir.path().join("cut.blktrace.0");
    let cpu = if std::fs::metadata(&full).unwrap().len() > 0 {
        full
    } else {
        dir.path().join("cut.blktrace.1")
    };
    let data = std::fs::read(&cpu).unwrap();
    std::fs::write(&cpu, &data[..data.len() - 20]).unwrap();
    let e = failed(
        &vabc(&["trace", "report", out.to_str().unwrap()]),
        "truncated",
    );
    assert!(
        e.contains("truncated record") && e.contains(&format!("offset {}", data.len() - 48)),
        "{e}"
    );

    let e = failed(
        &vabc(&["trace", "report", dir.path().join("none").to_str().unwrap()]),
        "no trace",
    );
    assert!(e.contains("no blktrace files"), "{e}");
}
