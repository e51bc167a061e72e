//! `vabc trace` on a real device (a loop device over a file; root), its report
//! checked against btt's on the same capture (blkparse and btt from Debian's
//! blktrace: the trace files we write are blktrace's format).

mod serve_common;

use std::path::Path;
use std::process::{Command, Output};

use serve_common::{Server, os};

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

/// `vabc trace record -d DEV -o OUT -- dd ARGS... status=none`.
fn record_dd(dev: &str, out: &Path, dd: &[&str]) -> Output {
    let mut args = vec![
        "trace",
        "record",
        "-d",
        dev,
        "-o",
        out.to_str().unwrap(),
        "--",
        "dd",
    ];
    args.extend(dd);
    args.push("status=none");
    vabc(&args)
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
    let input = format!("if={}", dev.0);
    let o = record_dd(
        &dev.0,
        &out,
        &[&input, "of=/dev/null", "bs=4k", "count=8", "iflag=direct"],
    );
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

/// A span of the time line: (thread, start µs, end µs).
fn spans<'a>(
    events: &'a [serde_json::Value],
    name: &str,
) -> Vec<(&'a serde_json::Value, f64, f64)> {
    events
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == name)
        .map(|e| {
            let ts = e["ts"].as_f64().unwrap();
            (&e["tid"], ts, ts + e["dur"].as_f64().unwrap())
        })
        .collect()
}

/// `serve --trace`: one cold, verified 64 KiB read through FUSE is one time line from
/// the FUSE request through the engine, the decoding of its REPLACE blocks and the
/// dm-verity check down to the base disk's bio (Q, D, C), and the spans of each
/// thread nest as Perfetto draws them.
#[test]
fn a_served_verified_cold_read_is_one_time_line() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path();
    let old = t.join("old.img");
    let dev = Loop::new(&old, 8);
    // The new image: every 7th block from 100 on rewritten (REPLACE), the rest as in old.
    let mut new = std::fs::read(&old).unwrap();
    for b in (100..1200).step_by(7) {
        let text = format!("new data of block {b} ").repeat(200);
        new[b * 4096..b * 4096 + 4096].copy_from_slice(&text.as_bytes()[..4096]);
    }
    std::fs::write(t.join("new.img"), &new).unwrap();
    let cow = t.join("u.cow");
    let o = vabc(&[
        "diff",
        old.to_str().unwrap(),
        t.join("new.img").to_str().unwrap(),
        "-o",
        cow.to_str().unwrap(),
        "--verity",
        "--json",
    ]);
    let diff: serde_json::Value = serde_json::from_str(&ok(&o, "diff")).unwrap();
    let root = diff["verity"]["root_hash"].as_str().unwrap().to_string();
    let fuse = t.join("fuse");
    std::fs::create_dir(&fuse).unwrap();
    let prefix = t.join("tl");
    let hash = t.join("u.cow.verity");
    let server = Server::start_logged(
        &[
            os("--base"),
            os(&dev.0),
            os("--cow"),
            cow.as_os_str(),
            os("--verity-hash"),
            hash.as_os_str(),
            os("--root-hash"),
            os(&root),
            os("--fuse"),
            fuse.as_os_str(),
            os("--trace"),
            prefix.as_os_str(),
        ],
        &t.join("serve.log"),
    );
    // Blocks 96..112: base blocks and the REPLACE blocks 100 and 107.
    let o = Command::new("dd")
        .args([
            format!("if={}/disk.img", fuse.display()),
            "of=/dev/null".into(),
            "bs=64k".into(),
            "skip=6".into(),
            "count=1".into(),
            "iflag=direct".into(),
        ])
        .output()
        .unwrap();
    ok(&o, "dd through FUSE");
    assert!(server.stop().success());
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.join("tl.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();

    // Every thread's spans nest (or are disjoint), and every thread is named.
    let mut by_tid: std::collections::BTreeMap<u64, Vec<(f64, f64)>> = Default::default();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let ts = e["ts"].as_f64().unwrap();
        let dur = e["dur"].as_f64().unwrap();
        assert!(ts >= 0.0 && dur >= 0.0, "{e}");
        by_tid
            .entry(e["tid"].as_u64().unwrap())
            .or_default()
            .push((ts, ts + dur));
        assert!(
            events
                .iter()
                .any(|m| m["ph"] == "M" && m["name"] == "thread_name" && m["tid"] == e["tid"])
        );
    }
    for (tid, spans) in &by_tid {
        for a in spans {
            for b in spans {
                let disjoint = a.1 <= b.0 || b.1 <= a.0;
                let nested = (a.0 <= b.0 && b.1 <= a.1) || (b.0 <= a.0 && a.1 <= b.1);
                assert!(
                    disjoint || nested,
                    "thread {tid}: {a:?} and {b:?} overlap without nesting"
                );
            }
        }
    }

    // The request: FUSE read of 64 KiB at 384 KiB ⊃ engine read on the same thread ⊃
    // decode and the verity check; the base disk's bio inside the engine read.
    let inside = |outer: &(&serde_json::Value, f64, f64),
                  inner: &(&serde_json::Value, f64, f64)| {
        outer.1 <= inner.1 && inner.2 <= outer.2
    };
    let fuse_read = events
        .iter()
        .find(|e| e["ph"] == "X" && e["name"] == "fuse read" && e["args"]["offset"] == 393216)
        .unwrap_or_else(|| {
            panic!(
                "no FUSE read span of the request: {:?}",
                spans(events, "fuse read")
            )
        });
    let f = (
        &fuse_read["tid"],
        fuse_read["ts"].as_f64().unwrap(),
        fuse_read["ts"].as_f64().unwrap() + fuse_read["dur"].as_f64().unwrap(),
    );
    let engine = spans(events, "engine read")
        .into_iter()
        .find(|e| e.0 == f.0 && inside(&f, e))
        .expect("engine read inside the FUSE read");
    assert!(
        spans(events, "decode").iter().any(|d| inside(&engine, d)),
        "no decode inside the engine read"
    );
    assert!(
        spans(events, "verity check")
            .iter()
            .any(|v| v.0 == engine.0 && inside(&engine, v)),
        "no verity check inside the engine read"
    );
    let loop_name = format!("({})", dev.0.trim_start_matches("/dev/"));
    let base_pid = events
        .iter()
        .find(|e| {
            e["ph"] == "M"
                && e["name"] == "process_name"
                && e["args"]["name"].as_str().unwrap().ends_with(&loop_name)
        })
        .expect("the base disk's track")["pid"]
        .clone();
    let bio_begin = events.iter().filter(|e| {
        e["pid"] == base_pid && e["ph"] == "b" && e["name"].as_str().unwrap().starts_with("read ")
    });
    let within = bio_begin.filter(|b| {
        let end = events
            .iter()
            .find(|e| e["ph"] == "e" && e["id"] == b["id"] && e["name"] == b["name"])
            .unwrap();
        engine.1 <= b["ts"].as_f64().unwrap() && end["ts"].as_f64().unwrap() <= engine.2
    });
    let bio = within
        .clone()
        .next()
        .expect("a base-disk bio (Q to C) inside the engine read");
    for stage in ["Q2D", "D2C"] {
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "b" && e["name"] == stage && e["id"] == bio["id"]),
            "{stage} of the bio"
        );
    }
    // The trace's blktrace files report too.
    let o = vabc(&["trace", "report", prefix.to_str().unwrap(), "--json"]);
    ok(&o, "report of serve's trace");
}

#[test]
fn replay_refuses_a_mounted_device_and_a_trace_without_requests() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Loop::new(&dir.path().join("disk.img"), 16);
    let out = dir.path().join("r");
    let output = format!("of={}", dev.0);
    let o = record_dd(
        &dev.0,
        &out,
        &[&output, "if=/dev/zero", "bs=4k", "count=32", "oflag=direct"],
    );
    ok(&o, "record");
    // A block device in use is refused (mounted: opened exclusively).
    let dev2 = Loop::new(&dir.path().join("fs.img"), 16);
    ok(
        &Command::new("mkfs.ext4")
            .args(["-q", &dev2.0])
            .output()
            .unwrap(),
        "mkfs",
    );
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    ok(
        &Command::new("mount")
            .arg(&dev2.0)
            .arg(&mnt)
            .output()
            .unwrap(),
        "mount",
    );
    let e = failed(
        &vabc(&[
            "trace",
            "replay",
            out.to_str().unwrap(),
            "--target",
            &dev2.0,
        ]),
        "mounted target",
    );
    let _ = Command::new("umount").arg(&mnt).status();
    assert!(e.contains("in use (mounted?)"), "{e}");
    // The replay onto the traced device itself writes what the trace wrote.
    let o = vabc(&[
        "trace",
        "replay",
        out.to_str().unwrap(),
        "--target",
        &dev.0,
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&ok(&o, "replay")).unwrap();
    assert_eq!(v["outcome"]["writes"], 32);
    // Another device's requests: none in this trace.
    let e = failed(
        &vabc(&[
            "trace",
            "replay",
            out.to_str().unwrap(),
            "--target",
            "x",
            "-d",
            "1:1",
        ]),
        "no requests",
    );
    assert!(e.contains("device 1,1 issued no requests"), "{e}");
}
