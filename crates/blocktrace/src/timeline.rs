//! One time line: vabc's spans (frontend request, engine read, decode, verity check,
//! base and COW reads) and the block layer's events of the same moments, as a Chrome
//! JSON trace (the Trace Event Format), which ui.perfetto.dev and chrome://tracing
//! open.
//!
//! Spans are complete events ("X") on their thread's track in one process ("vabc");
//! each block device is a process of its own, where each completed bio is a nestable
//! async slice from Q to C ("read 8 sectors @ 1234") holding Q2D and D2C slices.
//! Both sources use `CLOCK_MONOTONIC`; times are written in microseconds from the
//! first moment either saw.
//!
//! Written with serde_json: the format is JSON objects, and no maintained crate
//! writes the Chrome trace format without also owning the recording side.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use trace::spans::ThreadSpans;

use crate::Dev;
use crate::btt::Io;

const VABC_PID: u64 = 1;
/// Block devices' pseudo process ids start here.
const BLOCK_PID: u64 = 1000;

/// Builds the trace: `names` gives each device's name (`loop0`) where known.
pub fn chrome_trace(threads: &[ThreadSpans], ios: &[Io], names: &BTreeMap<Dev, String>) -> Value {
    let origin = threads
        .iter()
        .flat_map(|t| t.spans.iter().map(|s| s.start_ns))
        .chain(ios.iter().map(|io| io.q))
        .min()
        .unwrap_or(0);
    let us = |ns: u64| ns.saturating_sub(origin) as f64 / 1000.0;
    let mut events = Vec::new();
    if !threads.is_empty() {
        events.push(
            json!({"ph": "M", "name": "process_name", "pid": VABC_PID, "args": {"name": "vabc"}}),
        );
    }
    for t in threads {
        events.push(
            json!({"ph": "M", "name": "thread_name", "pid": VABC_PID, "tid": t.tid,
            "args": {"name": format!("{} ({})", t.name, t.tid)}}),
        );
        for s in &t.spans {
            events.push(
                json!({"ph": "X", "cat": "vabc", "name": s.name, "pid": VABC_PID, "tid": t.tid,
                "ts": us(s.start_ns), "dur": s.dur_ns as f64 / 1000.0,
                "args": {"offset": s.offset, "len": s.len}}),
            );
        }
    }
    let devs: Vec<Dev> = ios
        .iter()
        .map(|io| io.dev)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for (i, dev) in devs.iter().enumerate() {
        let pid = BLOCK_PID + i as u64;
        let name = names
            .get(dev)
            .map(|n| format!("block {dev} ({n})"))
            .unwrap_or_else(|| format!("block {dev}"));
        events.push(json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}));
    }
    for (n, io) in ios.iter().enumerate() {
        let pid = BLOCK_PID + devs.iter().position(|d| *d == io.dev).unwrap_or(0) as u64;
        let id = format!("{:#x}", n + 1);
        let dir = if io.write { "write" } else { "read" };
        let name = format!("{dir} {} sectors @ {}", io.sectors, io.sector);
        let args =
            json!({"sector": io.sector, "sectors": io.sectors, "device": io.dev.to_string()});
        let slice = |ph: &str, name: &str, t: u64, args: &Value| json!({"ph": ph, "cat": "block", "name": name, "id": id, "pid": pid, "tid": pid, "ts": us(t), "args": args});
        events.push(slice("b", &name, io.q, &args));
        if let Some(d) = io.d {
            events.push(slice("b", "Q2D", io.q, &Value::Null));
            events.push(slice("e", "Q2D", d, &Value::Null));
            events.push(slice("b", "D2C", d, &Value::Null));
            events.push(slice("e", "D2C", io.c, &Value::Null));
        }
        events.push(slice("e", &name, io.c, &Value::Null));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ns"})
}

#[cfg(test)]
mod tests {
    use super::*;
    use trace::spans::Span;

    #[test]
    fn spans_and_bios_share_one_clock_and_nest() {
        let threads = vec![ThreadSpans {
            tid: 3,
            name: "ublk-q0".into(),
            dropped: 0,
            spans: vec![
                Span {
                    name: "base read",
                    tid: 3,
                    start_ns: 1_500,
                    dur_ns: 3_000,
                    offset: 0,
                    len: 4096,
                },
                Span {
                    name: "engine read",
                    tid: 3,
                    start_ns: 1_000,
                    dur_ns: 5_000,
                    offset: 0,
                    len: 4096,
                },
            ],
        }];
        let dev = Dev { major: 7, minor: 1 };
        let ios = [Io {
            dev,
            write: false,
            sector: 8,
            sectors: 8,
            q: 2_000,
            g: Some(2_100),
            i: None,
            m: None,
            d: Some(2_200),
            c: 4_000,
        }];
        let names = BTreeMap::from([(dev, "loop1".to_string())]);
        let v = chrome_trace(&threads, &ios, &names);
        let ev = v["traceEvents"].as_array().unwrap();
        let x: Vec<_> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 2);
        assert_eq!(x[1]["name"], "engine read");
        assert_eq!(x[1]["ts"], 0.0);
        assert_eq!(x[1]["dur"], 5.0);
        let b: Vec<_> = ev.iter().filter(|e| e["ph"] == "b").collect();
        assert_eq!(b[0]["name"], "read 8 sectors @ 8");
        assert_eq!(b[0]["ts"], 1.0);
        assert!(
            ev.iter()
                .any(|e| e["ph"] == "M" && e["args"]["name"] == "block 7,1 (loop1)")
        );
        let ends: Vec<_> = ev
            .iter()
            .filter(|e| e["ph"] == "e")
            .map(|e| (e["name"].as_str().unwrap(), e["ts"].as_f64().unwrap()))
            .collect();
        assert_eq!(
            ends,
            vec![("Q2D", 1.2), ("D2C", 3.0), ("read 8 sectors @ 8", 3.0)]
        );
    }
}
