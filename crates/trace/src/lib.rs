//! Latency measurement for the serving path.
//!
//! A [`Histogram`] is recorded into by any number of threads at once, on every request:
//! one relaxed atomic add per bucket, count and sum, and a compare-exchange only when a
//! new maximum is seen. Buckets are log-linear (four per power of two of nanoseconds),
//! so a quantile is known to within 25% of its value at any scale, from nanoseconds to
//! minutes, in 2 KiB. A [`Snapshot`] is read without stopping the writers (each counter
//! is read once; a snapshot taken while requests complete may be a request or two off).

pub mod spans;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Sub-buckets per power of two.
const SUB_BITS: u32 = 2;
const SUB: usize = 1 << SUB_BITS;
/// `SUB` buckets for the values below `SUB`, then `SUB` per power of two up to 2^63.
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) * SUB;

/// Bucket of a value in nanoseconds: values below `SUB` have their own bucket; above,
/// the power of two and the next `SUB_BITS` bits choose it.
fn bucket(ns: u64) -> usize {
    if ns < SUB as u64 {
        return ns as usize;
    }
    let exp = 63 - ns.leading_zeros();
    let sub = (ns >> (exp - SUB_BITS)) as usize & (SUB - 1);
    (exp - SUB_BITS + 1) as usize * SUB + sub
}

/// The largest value in nanoseconds that falls in bucket `b`.
fn bucket_max(b: usize) -> u64 {
    if b < SUB {
        return b as u64;
    }
    let exp = (b / SUB) as u32 + SUB_BITS - 1;
    let sub = (b % SUB) as u64;
    let width = 1u64 << (exp - SUB_BITS);
    ((1u64 << exp) + sub * width).saturating_add(width - 1)
}

/// Latencies recorded concurrently; see the crate comment.
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new()
    }
}

impl fmt::Debug for Histogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Histogram({})", self.snapshot())
    }
}

impl Histogram {
    pub const fn new() -> Histogram {
        Histogram {
            buckets: [const { AtomicU64::new(0) }; BUCKETS],
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }

    pub fn record(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket(ns)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// Records the time since `start`.
    pub fn record_since(&self, start: Instant) {
        self.record(start.elapsed());
    }

    /// Runs `f` and records how long it took.
    pub fn time<R>(&self, f: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let r = f();
        self.record_since(start);
        r
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
            max_ns: self.max_ns.load(Ordering::Relaxed),
        }
    }
}

/// The state of a [`Histogram`] at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
}

impl Snapshot {
    pub fn mean(&self) -> Duration {
        Duration::from_nanos(self.sum_ns.checked_div(self.count).unwrap_or(0))
    }

    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// An upper bound of the `q` quantile (0 ≤ q ≤ 1): the top of the bucket holding
    /// it, at most 25% above the true value (and never above the maximum).
    pub fn quantile(&self, q: f64) -> Duration {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return Duration::ZERO;
        }
        // The rank of the quantile, 1-based: the smallest value with at least
        // q * total values at or below it.
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Duration::from_nanos(bucket_max(b).min(self.max_ns));
            }
        }
        self.max()
    }
}

/// Milliseconds with three significant digits or so.
struct Ms(Duration);

impl fmt::Display for Ms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_secs_f64() * 1e3;
        match ms {
            m if m < 0.1 => write!(f, "{m:.3} ms"),
            m if m < 10.0 => write!(f, "{m:.2} ms"),
            m => write!(f, "{m:.0} ms"),
        }
    }
}

impl fmt::Display for Snapshot {
    /// `N, mean …, p50 ≤ …, p90 ≤ …, p99 ≤ …, max …` (quantiles are bucket tops).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 0 {
            return write!(f, "none");
        }
        write!(
            f,
            "{} timed, mean {}, p50 ≤ {}, p90 ≤ {}, p99 ≤ {}, max {}",
            self.count,
            Ms(self.mean()),
            Ms(self.quantile(0.5)),
            Ms(self.quantile(0.9)),
            Ms(self.quantile(0.99)),
            Ms(self.max())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut last = 0;
        for ns in (0..100_000u64).chain([u64::MAX / 3, u64::MAX - 1, u64::MAX]) {
            let b = bucket(ns);
            assert!(b < BUCKETS);
            assert!(b >= last || ns > 100_000, "bucket order at {ns}");
            assert!(bucket_max(b) >= ns, "{ns} above the top of its bucket {b}");
            if b > 0 {
                assert!(bucket_max(b - 1) < ns, "{ns} also fits bucket {}", b - 1);
            }
            last = b;
        }
        assert_eq!(bucket_max(BUCKETS - 1), u64::MAX);
    }

    #[test]
    fn quantiles_of_a_known_spread() {
        let h = Histogram::new();
        // 1..=1000 µs, once each.
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!(s.count, 1000);
        assert_eq!(s.mean(), Duration::from_nanos(500_500));
        assert_eq!(s.max(), Duration::from_micros(1000));
        for (q, want) in [(0.5, 500u64), (0.9, 900), (0.99, 990), (1.0, 1000)] {
            let got = s.quantile(q).as_nanos() as f64;
            let want = (want * 1000) as f64;
            assert!(got >= want && got <= want * 1.25, "p{q}: {got} for {want}");
        }
        assert_eq!(Histogram::new().snapshot().quantile(0.5), Duration::ZERO);
        assert_eq!(Histogram::new().snapshot().to_string(), "none");
        let text = s.to_string();
        assert!(
            text.starts_with("1000 timed, mean 0.50 ms, p50 ≤ 0."),
            "{text}"
        );
        assert!(text.ends_with("max 1.00 ms"), "{text}");
    }

    #[test]
    fn time_records_the_closure() {
        let h = Histogram::new();
        let r = h.time(|| {
            std::thread::sleep(Duration::from_millis(2));
            7
        });
        assert_eq!(r, 7);
        let s = h.snapshot();
        assert_eq!(s.count, 1);
        assert!(s.max() >= Duration::from_millis(2), "{s}");
    }

    #[test]
    fn concurrent_writers_lose_nothing() {
        let h = std::sync::Arc::new(Histogram::new());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    for i in 0..10_000u64 {
                        h.record(Duration::from_nanos(t * 10_000 + i));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = h.snapshot();
        assert_eq!(s.count, 40_000);
        assert_eq!(s.buckets.iter().sum::<u64>(), 40_000);
        assert_eq!(s.sum_ns, (0..40_000u64).sum::<u64>());
        assert_eq!(s.max_ns, 39_999);
    }

    proptest! {
        /// Every quantile is an upper bound within 25% (or 1 ns) of the exact one.
        #[test]
        fn quantiles_bound_the_exact_ones(
            mut values in proptest::collection::vec(0u64..10_000_000_000, 1..300),
            q in 0.0f64..=1.0,
        ) {
            let h = Histogram::new();
            for &v in &values {
                h.record(Duration::from_nanos(v));
            }
            values.sort_unstable();
            let rank = ((q * values.len() as f64).ceil() as usize).max(1);
            let exact = values[rank - 1];
            let got = h.snapshot().quantile(q).as_nanos() as u64;
            prop_assert!(got >= exact, "{got} < {exact}");
            prop_assert!(got <= exact + exact / 4 + 1, "{got} far above {exact}");
        }
    }
}
