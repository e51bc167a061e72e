//! Replays the fuzz corpora of the blktrace and tracefs-page targets
//! (fuzz/corpus/blktrace_read, fuzz/corpus/tracefs_pages) through the targets' bodies
//! in the normal test run, and regenerates their seeds.

#[path = "../../../fuzz/replay.rs"]
mod replay;

use blocktrace::blktrace::encode;
use blocktrace::{Action, Dev, Event, Extra, cat};

fn event(action: Action, us: u64, sector: u64, sectors: u32) -> Event {
    Event {
        time_ns: us * 1000,
        dev: Dev { major: 7, minor: 0 },
        action,
        flags: cat::READ,
        sector,
        bytes: sectors * 512,
        pid: 1,
        cpu: 0,
        error: 0,
        extra: Extra::None,
    }
}

fn blktrace_seeds() -> Vec<(String, Vec<u8>)> {
    use Action::*;
    let mut io = Vec::new();
    let mut split = event(Split, 1, 600, 0);
    split.extra = Extra::Split { new_sector: 608 };
    let mut remap = event(Remap, 2, 600, 16);
    remap.extra = Extra::Remap {
        from_dev: Dev {
            major: 253,
            minor: 0,
        },
        from_sector: 0,
    };
    let evs = [
        event(Queue, 0, 600, 16),
        split,
        remap,
        event(GetRq, 3, 600, 8),
        event(Insert, 4, 600, 8),
        event(Queue, 5, 616, 8),
        event(BackMerge, 6, 616, 8),
        event(Issue, 7, 600, 8),
        event(Issue, 8, 608, 16),
        event(Complete, 20, 600, 8),
        event(Complete, 30, 608, 16),
    ];
    for (i, e) in evs.iter().enumerate() {
        encode(e, i as u32, &mut io);
    }
    let mut huge = Vec::new();
    encode(&event(Queue, 0, u64::MAX - 3, 16), 0, &mut huge);
    encode(&event(Complete, 1, u64::MAX - 3, 16), 1, &mut huge);
    vec![
        ("io".into(), io.clone()),
        ("truncated".into(), io[..io.len() - 7].to_vec()),
        ("huge_sector".into(), huge),
        ("empty".into(), Vec::new()),
    ]
}

fn page_seeds() -> Vec<(String, Vec<u8>)> {
    let mut rec = vec![0u8; 40];
    rec[0..2].copy_from_slice(&7u16.to_le_bytes());
    rec[8..12].copy_from_slice(&(7u32 << 20).to_le_bytes());
    rec[16..24].copy_from_slice(&100u64.to_le_bytes());
    rec[24..28].copy_from_slice(&8u32.to_le_bytes());
    rec[28..30].copy_from_slice(b"RS");
    let mut data = Vec::new();
    data.extend_from_slice(&((5u32 << 5) | 10).to_le_bytes());
    data.extend_from_slice(&rec);
    data.extend_from_slice(&((3u32 << 5) | 30).to_le_bytes());
    data.extend_from_slice(&1u32.to_le_bytes());
    data.extend_from_slice(&(2u32 << 5).to_le_bytes());
    data.extend_from_slice(&44u32.to_le_bytes());
    data.extend_from_slice(&rec);
    data.extend_from_slice(&((1u32 << 5) | 31).to_le_bytes());
    data.extend_from_slice(&9u32.to_le_bytes());
    let mut page = vec![0u8; 4096];
    page[8..16].copy_from_slice(&((data.len() as u64) | (1 << 31) | (1 << 30)).to_le_bytes());
    page[16..16 + data.len()].copy_from_slice(&data);
    vec![
        ("page".into(), page.clone()),
        ("half_page".into(), page[..2000].to_vec()),
    ]
}

#[test]
fn corpora_replay_without_panics() {
    for (target, body) in [
        (
            "blktrace_read",
            blocktrace::fuzzing::exercise_blktrace as fn(&[u8]),
        ),
        ("tracefs_pages", blocktrace::fuzzing::exercise_pages),
    ] {
        let inputs = replay::inputs(target);
        assert!(!inputs.is_empty(), "empty corpus {target}");
        for input in inputs {
            body(&input);
        }
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/{blktrace_read,tracefs_pages}/seed_*"]
fn generate_seed_corpus() {
    replay::write_seeds("blktrace_read", blktrace_seeds());
    replay::write_seeds("tracefs_pages", page_seeds());
}

#[test]
fn seeds_run() {
    for (_, data) in blktrace_seeds() {
        blocktrace::fuzzing::exercise_blktrace(&data);
    }
    for (_, data) in page_seeds() {
        blocktrace::fuzzing::exercise_pages(&data);
    }
}
