//! Spans: where one request's time went, layer by layer, on one time line with the
//! kernel's block events.
//!
//! Off (the default), [`span`] is one relaxed atomic load. On ([`enable`]), each span
//! is stamped with `CLOCK_MONOTONIC` (the clock of tracefs' `mono` and of blktrace, so
//! the block events of the same moments line up) and pushed into its thread's own
//! buffer (a mutex no other thread takes until [`take`] collects them), in chunks
//! that never move once full.

use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(false);
static NEXT_TID: AtomicU32 = AtomicU32::new(1);
/// Every thread's buffer, leaked: one per thread that ever recorded a span (a
/// server's threads), so a thread reaches its own through a plain reference.
static BUFFERS: Mutex<Vec<&'static ThreadBuf>> = Mutex::new(Vec::new());

struct ThreadBuf {
    tid: u32,
    name: String,
    /// Chunks of [`CHUNK`] spans: a full one is never moved (no reallocation copies
    /// on the request path).
    spans: Mutex<Vec<Vec<Span>>>,
    /// Spans not kept: past [`MAX_CHUNKS`] (a daemon traced for hours must not grow
    /// without bound; a time line of more would not open anyway).
    dropped: AtomicU64,
}

const CHUNK: usize = 4096;
/// At most this many chunks per thread: 256 Ki spans, 12 MiB.
const MAX_CHUNKS: usize = 64;

thread_local! {
    static LOCAL: Cell<Option<&'static ThreadBuf>> = const { Cell::new(None) };
}

/// One timed piece of work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub name: &'static str,
    /// The recording thread (numbered from 1 in order of first span).
    pub tid: u32,
    pub start_ns: u64,
    pub dur_ns: u64,
    /// What it worked on: a byte offset and length (of the device, the base, the COW).
    pub offset: u64,
    pub len: u64,
}

/// A thread's spans, with its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadSpans {
    pub tid: u32,
    pub name: String,
    pub spans: Vec<Span>,
    /// Spans this thread made after its buffer was full (the first ones are kept).
    pub dropped: u64,
}

/// Starts recording spans (for the rest of the process, or until [`disable`]).
pub fn enable() {
    ENABLED.store(true, Ordering::Release);
}

pub fn disable() {
    ENABLED.store(false, Ordering::Release);
}

#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// `CLOCK_MONOTONIC` in nanoseconds.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Times the work until the guard drops; `None` (and no cost) when spans are off.
#[inline]
pub fn span(name: &'static str, offset: u64, len: u64) -> Option<SpanGuard> {
    if !enabled() {
        return None;
    }
    Some(SpanGuard {
        name,
        offset,
        len,
        start: now_ns(),
    })
}

/// Records its span when dropped.
pub struct SpanGuard {
    name: &'static str,
    offset: u64,
    len: u64,
    start: u64,
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        let end = now_ns();
        record(Span {
            name: self.name,
            tid: 0,
            start_ns: self.start,
            dur_ns: end.saturating_sub(self.start),
            offset: self.offset,
            len: self.len,
        });
    }
}

fn record(mut span: Span) {
    let buf = LOCAL.with(|local| match local.get() {
        Some(b) => b,
        None => {
            let b: &'static ThreadBuf = Box::leak(Box::new(ThreadBuf {
                tid: NEXT_TID.fetch_add(1, Ordering::Relaxed),
                name: std::thread::current()
                    .name()
                    .unwrap_or("thread")
                    .to_string(),
                spans: Mutex::new(Vec::new()),
                dropped: AtomicU64::new(0),
            }));
            BUFFERS.lock().unwrap_or_else(|p| p.into_inner()).push(b);
            local.set(Some(b));
            b
        }
    });
    span.tid = buf.tid;
    let mut chunks = buf.spans.lock().unwrap_or_else(|p| p.into_inner());
    let full = chunks.len() >= MAX_CHUNKS;
    match chunks.last_mut() {
        Some(c) if c.len() < CHUNK => c.push(span),
        _ if full => {
            buf.dropped.fetch_add(1, Ordering::Relaxed);
        }
        _ => {
            let mut c = Vec::with_capacity(CHUNK);
            c.push(span);
            chunks.push(c);
        }
    }
}

/// Takes every thread's spans recorded so far.
pub fn take() -> Vec<ThreadSpans> {
    let bufs = BUFFERS.lock().unwrap_or_else(|p| p.into_inner());
    bufs.iter()
        .map(|b| ThreadSpans {
            tid: b.tid,
            name: b.name.clone(),
            spans: std::mem::take(&mut *b.spans.lock().unwrap_or_else(|p| p.into_inner()))
                .into_iter()
                .flatten()
                .collect(),
            dropped: b.dropped.swap(0, Ordering::Relaxed),
        })
        .filter(|t| !t.spans.is_empty() || t.dropped > 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_nest_by_time_on_their_thread_and_cost_nothing_when_off() {
        let _one = super::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        disable();
        assert!(span("off", 0, 0).is_none());
        enable();
        let outer = span("outer", 4096, 8192);
        {
            let _inner = span("inner", 4096, 4096);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop(outer);
        std::thread::Builder::new()
            .name("other".into())
            .spawn(|| drop(span("elsewhere", 1, 2)))
            .unwrap()
            .join()
            .unwrap();
        disable();
        let all = take();
        let mine = all
            .iter()
            .find(|t| t.spans.iter().any(|s| s.name == "outer"))
            .unwrap();
        let (inner, outer) = (&mine.spans[0], &mine.spans[1]);
        assert_eq!((inner.name, outer.name), ("inner", "outer"));
        assert!(outer.start_ns <= inner.start_ns);
        assert!(inner.start_ns + inner.dur_ns <= outer.start_ns + outer.dur_ns);
        assert!(inner.dur_ns >= 1_000_000);
        let other = all.iter().find(|t| t.name == "other").unwrap();
        assert_ne!(other.tid, mine.tid);
        assert_eq!(other.spans[0].len, 2);
        assert!(take().is_empty(), "taken once");
    }
}
/// The span tests share the process's recorder: one at a time.
#[cfg(test)]
static TEST_LOCK: Mutex<()> = Mutex::new(());

#[cfg(test)]
mod cap {
    #[test]
    fn a_thread_keeps_its_first_spans_and_counts_the_rest() {
        let _one = super::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        super::enable();
        let n = super::CHUNK * super::MAX_CHUNKS + 10;
        std::thread::Builder::new()
            .name("capped".into())
            .spawn(move || {
                for i in 0..n {
                    drop(super::span("x", i as u64, 1));
                }
            })
            .unwrap()
            .join()
            .unwrap();
        super::disable();
        let all = super::take();
        let t = all.iter().find(|t| t.name == "capped").unwrap();
        assert_eq!(t.spans.len(), super::CHUNK * super::MAX_CHUNKS);
        assert_eq!(t.dropped, 10);
        assert_eq!(t.spans[0].offset, 0, "the first ones kept");
    }
}

/// What one span costs on this machine (a measurement, not a check: it asserts
/// nothing). `cargo test --release -p vabc-trace span_cost -- --ignored --nocapture`
#[cfg(test)]
mod cost {
    #[test]
    #[ignore = "a measurement; run by hand"]
    fn span_cost() {
        let _one = super::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        super::enable();
        let n = 3_000_000u64;
        let t = std::time::Instant::now();
        for i in 0..n {
            drop(super::span("x", i, 4096));
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        super::disable();
        let t = std::time::Instant::now();
        for i in 0..n {
            drop(std::hint::black_box(super::span("x", i, 4096)));
        }
        let off = t.elapsed().as_nanos() as f64 / n as f64;
        let t = std::time::Instant::now();
        let mut x = 0u64;
        for _ in 0..n {
            x = x.wrapping_add(super::now_ns());
        }
        let clock = t.elapsed().as_nanos() as f64 / n as f64;
        std::hint::black_box(x);
        eprintln!("span on: {ns:.1} ns, off: {off:.2} ns, one clock read: {clock:.1} ns");
        let _ = super::take();
    }
}
