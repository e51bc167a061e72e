//! btt's breakdown of where a request's time goes, and iostat's merge counts.
//!
//! Each bio is followed from its queueing (Q) to its completion (C), by btt's rules
//! (btt 2.09 as Debian ships it), so that the two agree on the same trace:
//! - a G, I or merge (M, F) belongs to the outstanding bio whose range holds its
//!   sector; a D or C to every outstanding bio inside its range. A new bio starting
//!   where an outstanding one starts replaces it.
//! - Q2Q is between two bios queued on the device; Q2G, G2I, Q2M, I2D (or M2D for a
//!   merged bio), D2C and Q2C are per bio: a request of three bios gives three D2C
//!   samples. G2I needs a G and an I; without an I/O scheduler blk-mq issues straight
//!   after G and traces no I, so G2I and I2D have no samples then (btt's behaviour).
//! - events with no bytes (flushes) and passthrough commands are left out; nothing
//!   on a device counts before its first Q (a trace begun mid-request); a time
//!   difference of zero counts as 1 ns; a requeue counts as a queued bio.
//! - one deliberate difference: btt ignores splits (X), so a split bio never
//!   completes for it; here the outstanding bio is split in two at the same sector
//!   the kernel split it, each part keeping its times, and both complete.
//!
//! Everything is kept per device and per direction (the bio's: reads, writes) besides
//! the whole (a direction's Q2Q is between its own bios); each stage has min,
//! average, max, N and percentiles.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::{Action, Dev, Event, Extra, cat};

/// One stage's samples, in nanoseconds.
#[derive(Clone, Debug, Default)]
pub struct Samples(Vec<u64>);

impl Samples {
    pub fn summary(&self) -> Summary {
        let mut v = self.0.clone();
        v.sort_unstable();
        let n = v.len() as u64;
        let pct = |p: f64| -> u64 {
            if v.is_empty() {
                0
            } else {
                // Nearest rank.
                let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
                v[rank.min(v.len()) - 1]
            }
        };
        let sum: u128 = v.iter().map(|&x| u128::from(x)).sum();
        Summary {
            n,
            min_ns: v.first().copied().unwrap_or(0),
            avg_ns: if n == 0 { 0.0 } else { sum as f64 / n as f64 },
            max_ns: v.last().copied().unwrap_or(0),
            p50_ns: pct(50.0),
            p90_ns: pct(90.0),
            p99_ns: pct(99.0),
            total_ns: sum.min(u128::from(u64::MAX)) as u64,
        }
    }
}

/// A stage's statistics (nanoseconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Summary {
    pub n: u64,
    pub min_ns: u64,
    pub avg_ns: f64,
    pub max_ns: u64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub total_ns: u64,
}

/// The stages btt reports, in its order.
pub const STAGES: [&str; 8] = ["Q2Q", "Q2G", "G2I", "Q2M", "I2D", "M2D", "D2C", "Q2C"];

const Q2Q: usize = 0;
const Q2G: usize = 1;
const G2I: usize = 2;
const Q2M: usize = 3;
const I2D: usize = 4;
const M2D: usize = 5;
const D2C: usize = 6;
const Q2C: usize = 7;

/// Everything measured for one device and direction (or all of them).
#[derive(Clone, Debug, Default)]
pub struct Breakdown {
    /// Samples of each of [`STAGES`].
    pub stages: [Samples; 8],
    /// Bios queued (Q, and requeues: btt's #Q), requests issued (D), bios merged
    /// into a request (M, F: iostat's rrqm/wrqm), completions (C).
    pub queued: u64,
    pub issued: u64,
    pub merged: u64,
    pub completed: u64,
    pub bytes_completed: u64,
    /// Issued request sizes: sectors → count.
    pub sizes: BTreeMap<u64, u64>,
    /// Distance in sectors of each issued request from the one before (btt's D2D
    /// seek: 0 when they touch or overlap).
    pub seeks: Vec<u64>,
    pub first_ns: u64,
    pub last_ns: u64,
}

/// The report: per device, per direction.
#[derive(Clone, Debug, Default)]
pub struct Analysis {
    /// (device, direction) → breakdown; direction is "all", "read" or "write".
    pub parts: BTreeMap<(Dev, &'static str), Breakdown>,
    /// Events on a device before its first Q (a trace begun mid-request), and
    /// events for which no outstanding bio was found.
    pub unmatched: u64,
    pub events: u64,
    /// Every completed bio's moments (kept by [`Analysis::with_ios`]).
    pub ios: Vec<Io>,
    keep_ios: bool,
}

/// One completed bio: when it was queued, got a request, was inserted, merged,
/// issued and completed (nanoseconds, the trace's clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Io {
    pub dev: Dev,
    pub write: bool,
    pub sector: u64,
    pub sectors: u64,
    pub q: u64,
    pub g: Option<u64>,
    pub i: Option<u64>,
    pub m: Option<u64>,
    pub d: Option<u64>,
    pub c: u64,
}

/// A bio in flight.
#[derive(Clone, Copy, Debug)]
struct Bio {
    q: u64,
    end: u64,
    write: bool,
    g: Option<u64>,
    i: Option<u64>,
    m: Option<u64>,
    d: Option<u64>,
}

#[derive(Default)]
struct DevState {
    /// Outstanding bios by start sector.
    bios: BTreeMap<u64, Bio>,
    seen_q: bool,
    last_q: Option<u64>,
    /// The last Q of reads, of writes.
    last_q_dir: [Option<u64>; 2],
    last_d: Option<(u64, u64)>,
}

impl DevState {
    /// The outstanding bio whose range holds `sector`.
    fn holding(&mut self, sector: u64) -> Option<&mut Bio> {
        // Overlapping outstanding bios are rare: a few steps back find any.
        let key = self
            .bios
            .range(..=sector)
            .rev()
            .take(8)
            .find(|(_, b)| b.end > sector)
            .map(|(k, _)| *k)?;
        self.bios.get_mut(&key)
    }

    /// The outstanding bios inside [start, end].
    fn inside(&self, start: u64, end: u64) -> Vec<u64> {
        self.bios
            .range(start..end.max(start.saturating_add(1)))
            .filter(|(_, b)| b.end <= end)
            .map(|(k, _)| *k)
            .collect()
    }
}

fn dir(write: bool) -> &'static str {
    if write { "write" } else { "read" }
}

/// btt's difference: never below 1 ns.
fn delta(from: u64, to: u64) -> u64 {
    if from < to { to - from } else { 1 }
}

/// btt's seek distance from the previous range: 0 when they touch or overlap.
fn seek(prev: (u64, u64), start: u64, end: u64) -> u64 {
    let (ps, pe) = prev;
    if (ps <= start && start <= pe) || (ps <= end && end <= pe) {
        0
    } else if start > pe {
        start - pe
    } else {
        start.abs_diff(ps)
    }
}

impl Analysis {
    /// Analyses events in time order.
    pub fn new(events: &[Event]) -> Analysis {
        Analysis::run(events, false)
    }

    /// As [`Analysis::new`], keeping every completed bio in [`Analysis::ios`] (for a
    /// time line).
    pub fn with_ios(events: &[Event]) -> Analysis {
        Analysis::run(events, true)
    }

    fn run(events: &[Event], keep_ios: bool) -> Analysis {
        let mut a = Analysis {
            keep_ios,
            ..Analysis::default()
        };
        let mut devs: HashMap<Dev, DevState> = HashMap::new();
        for ev in events {
            a.events += 1;
            let st = devs.entry(ev.dev).or_default();
            a.event(st, ev);
        }
        a
    }

    /// The device's whole and one direction.
    fn both(&mut self, dev: Dev, write: bool, mut f: impl FnMut(&mut Breakdown)) {
        for d in ["all", dir(write)] {
            f(self.parts.entry((dev, d)).or_default());
        }
    }

    fn sample(&mut self, dev: Dev, write: bool, stage: usize, from: u64, to: u64) {
        self.both(dev, write, |b| b.stages[stage].0.push(delta(from, to)));
    }

    fn event(&mut self, st: &mut DevState, ev: &Event) {
        let t = ev.time_ns;
        let dev = ev.dev;
        if ev.flags & cat::PC != 0 {
            return;
        }
        let write = ev.flags & cat::READ == 0;
        let end = ev.sector.saturating_add(ev.sectors());
        let counted = matches!(
            ev.action,
            Action::Queue
                | Action::GetRq
                | Action::SleepRq
                | Action::Insert
                | Action::BackMerge
                | Action::FrontMerge
                | Action::Issue
                | Action::Complete
        );
        if counted && ev.bytes == 0 {
            return;
        }
        if ev.action == Action::Queue {
            st.seen_q = true;
        } else if !st.seen_q {
            if counted {
                self.unmatched += 1;
            }
            return;
        }
        if counted || ev.action == Action::Requeue {
            self.both(dev, write, |b| {
                if b.first_ns == 0 || t < b.first_ns {
                    b.first_ns = t;
                }
                b.last_ns = b.last_ns.max(t);
            });
        }
        match ev.action {
            Action::Queue => self.queued(st, dev, write, t, ev.sector, end),
            Action::Requeue => self.both(dev, write, |b| b.queued += 1),
            Action::Split => {
                if let Extra::Split { new_sector } = ev.extra
                    && let Some(b) = st.bios.get_mut(&ev.sector)
                    && new_sector > ev.sector
                    && new_sector < b.end
                {
                    let second = *b;
                    b.end = new_sector;
                    st.bios.insert(new_sector, second);
                }
            }
            Action::GetRq => match st.holding(ev.sector) {
                Some(b) => {
                    b.g = Some(t);
                    let (q, w) = (b.q, b.write);
                    self.sample(dev, w, Q2G, q, t);
                }
                None => self.unmatched += 1,
            },
            Action::Insert => match st.holding(ev.sector) {
                Some(b) => {
                    b.i = Some(t);
                    let (g, w) = (b.g, b.write);
                    if let Some(g) = g {
                        self.sample(dev, w, G2I, g, t);
                    }
                }
                None => self.unmatched += 1,
            },
            Action::BackMerge | Action::FrontMerge => {
                self.both(dev, write, |b| b.merged += 1);
                match st.holding(ev.sector) {
                    Some(b) => {
                        b.m = Some(t);
                        let (q, w) = (b.q, b.write);
                        self.sample(dev, w, Q2M, q, t);
                    }
                    None => self.unmatched += 1,
                }
            }
            Action::Issue => self.issued(st, ev, write, end),
            Action::Complete => self.completed(st, ev, write, end),
            _ => {}
        }
    }

    /// Q: a bio enters the block layer.
    fn queued(&mut self, st: &mut DevState, dev: Dev, write: bool, t: u64, sector: u64, end: u64) {
        if let Some(prev) = st.last_q {
            self.parts.entry((dev, "all")).or_default().stages[Q2Q]
                .0
                .push(delta(prev, t));
        }
        st.last_q = Some(t);
        // A direction's own Q2Q: between its bios (btt has only the device's).
        if let Some(prev) = st.last_q_dir[usize::from(write)].replace(t) {
            self.parts.entry((dev, dir(write))).or_default().stages[Q2Q]
                .0
                .push(delta(prev, t));
        }
        self.both(dev, write, |b| b.queued += 1);
        let bio = Bio {
            q: t,
            end,
            write,
            g: None,
            i: None,
            m: None,
            d: None,
        };
        st.bios.insert(sector, bio);
    }

    /// The bios a request at `sector..end` holds; a request holding none is counted
    /// as unmatched.
    fn held_bios(&mut self, st: &DevState, sector: u64, end: u64) -> Vec<u64> {
        let keys = st.inside(sector, end);
        if keys.is_empty() {
            self.unmatched += 1;
        }
        keys
    }

    /// D: a request goes to the driver, with the bios it holds.
    fn issued(&mut self, st: &mut DevState, ev: &Event, write: bool, end: u64) {
        let (t, dev) = (ev.time_ns, ev.dev);
        let distance = seek(st.last_d.unwrap_or((0, 0)), ev.sector, end);
        st.last_d = Some((ev.sector, end));
        self.both(dev, write, |b| {
            b.issued += 1;
            *b.sizes.entry(ev.sectors()).or_default() += 1;
            b.seeks.push(distance);
        });
        for k in self.held_bios(st, ev.sector, end) {
            let Some(b) = st.bios.get_mut(&k) else {
                continue;
            };
            let (i, m, w) = (b.i, b.m, b.write);
            b.d = Some(t);
            if let Some(i) = i {
                self.sample(dev, w, I2D, i, t);
            } else if let Some(m) = m {
                self.sample(dev, w, M2D, m, t);
            }
        }
    }

    /// C: a request completes, and the bios it held with it.
    fn completed(&mut self, st: &mut DevState, ev: &Event, write: bool, end: u64) {
        let (t, dev) = (ev.time_ns, ev.dev);
        let bytes = u64::from(ev.bytes);
        self.both(dev, write, |b| {
            b.completed += 1;
            b.bytes_completed += bytes;
        });
        for k in self.held_bios(st, ev.sector, end) {
            let Some(b) = st.bios.remove(&k) else {
                continue;
            };
            if self.keep_ios {
                self.ios.push(Io {
                    dev,
                    write: b.write,
                    sector: k,
                    sectors: b.end.saturating_sub(k),
                    q: b.q,
                    g: b.g,
                    i: b.i,
                    m: b.m,
                    d: b.d,
                    c: t,
                });
            }
            self.sample(dev, b.write, Q2C, b.q, t);
            if let Some(d) = b.d {
                self.sample(dev, b.write, D2C, d, t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(us: u64, action: Action, sector: u64, sectors: u32) -> Event {
        Event {
            time_ns: us * 1000,
            dev: Dev { major: 8, minor: 0 },
            action,
            flags: cat::WRITE,
            sector,
            bytes: sectors * 512,
            pid: 100,
            cpu: 0,
            error: 0,
            extra: Extra::None,
        }
    }

    fn stat(a: &Analysis, stage: usize) -> (u64, f64) {
        let s = a.parts[&(Dev { major: 8, minor: 0 }, "all")].stages[stage].summary();
        (s.n, s.avg_ns / 1000.0)
    }

    /// btt's numbers for this trace (run on the same records): a request of two bios
    /// (one back-merged) through the scheduler, then one issued directly.
    #[test]
    fn a_merge_and_a_direct_issue_give_btts_numbers() {
        use Action::*;
        let events = [
            ev(0, Queue, 100, 8),
            ev(10, GetRq, 100, 8),
            ev(30, Insert, 100, 8),
            ev(100, Queue, 108, 8),
            ev(110, BackMerge, 108, 8),
            ev(200, Issue, 100, 16),
            ev(500, Complete, 100, 16),
            ev(1000, Queue, 1000, 8),
            ev(1005, GetRq, 1000, 8),
            ev(1020, Issue, 1000, 8),
            ev(1300, Complete, 1000, 8),
        ];
        let a = Analysis::new(&events);
        assert_eq!(stat(&a, Q2Q), (2, 500.0));
        assert_eq!(stat(&a, Q2G), (2, 7.5));
        assert_eq!(stat(&a, G2I), (1, 20.0));
        assert_eq!(stat(&a, Q2M), (1, 10.0));
        assert_eq!(stat(&a, I2D), (1, 170.0));
        assert_eq!(stat(&a, M2D), (1, 90.0));
        let (n, avg) = stat(&a, D2C);
        assert_eq!(n, 3);
        assert!((avg - 293.333).abs() < 0.001);
        assert_eq!(stat(&a, Q2C), (3, 400.0));
        let all = &a.parts[&(Dev { major: 8, minor: 0 }, "all")];
        assert_eq!((all.queued, all.issued, all.merged), (3, 2, 1));
    }

    #[test]
    fn events_before_a_devices_first_queue_are_left_out() {
        use Action::*;
        let events = [
            ev(0, Issue, 5000, 8),
            ev(5, Complete, 5000, 8),
            ev(10, Queue, 100, 8),
            ev(20, GetRq, 100, 8),
            ev(30, Issue, 100, 8),
            ev(90, Complete, 100, 8),
        ];
        let a = Analysis::new(&events);
        assert_eq!(stat(&a, D2C), (1, 60.0));
        assert_eq!(a.unmatched, 2);
    }

    #[test]
    fn a_split_bio_completes_in_two_parts() {
        use Action::*;
        let mut x = ev(1, Split, 600, 0);
        x.extra = Extra::Split { new_sector: 608 };
        let events = [
            ev(0, Queue, 600, 16),
            x,
            ev(2, GetRq, 600, 8),
            ev(3, GetRq, 608, 8),
            ev(4, Issue, 600, 8),
            ev(5, Issue, 608, 8),
            ev(10, Complete, 600, 8),
            ev(12, Complete, 608, 8),
        ];
        let a = Analysis::new(&events);
        assert_eq!(stat(&a, Q2C), (2, 11.0));
        assert_eq!(stat(&a, D2C), (2, 6.5));
    }
}
