//! The decode pool: where a request's REPLACE units are decoded when they are spread
//! over other threads, in one of three designs (the decode-pool study,
//! `bench/studies/decode-pool.sh`, measures them):
//! - [`PoolDesign::Shared`]: one queue every worker takes from (rayon's injector: a
//!   request handed from outside the pool lands there), like a kernel workqueue;
//! - [`PoolDesign::PerCpu`]: a worker per CPU, pinned to it, each with its own queue;
//!   a request's units go to the worker of the CPU the request runs on (EROFS'
//!   per-CPU decompression workers);
//! - [`PoolDesign::PerCpuFifo`]: the same at real-time priority (`SCHED_FIFO` 1, as
//!   EROFS' high-priority workers), where the system permits it.
//!
//! Every hand-off's queueing delay (from the moment the unit is queued to the moment
//! a worker starts it) is recorded: a histogram always, every sample on request.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// How decode work is handed to workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PoolDesign {
    #[default]
    Shared,
    PerCpu,
    PerCpuFifo,
}

impl std::str::FromStr for PoolDesign {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shared" => Ok(PoolDesign::Shared),
            "per-cpu" => Ok(PoolDesign::PerCpu),
            "per-cpu-fifo" => Ok(PoolDesign::PerCpuFifo),
            _ => Err(format!("{s}: not shared, per-cpu or per-cpu-fifo")),
        }
    }
}

/// Queueing delays of the hand-offs.
#[derive(Debug, Default)]
pub struct QueueDelays {
    pub histogram: trace::Histogram,
    sampling: AtomicBool,
    /// (queued at, waited), nanoseconds on `CLOCK_MONOTONIC`.
    samples: Mutex<Vec<(u64, u64)>>,
}

impl QueueDelays {
    /// Keeps every sample from now on (for [`QueueDelays::take_samples`]).
    pub fn sample(&self) {
        self.sampling.store(true, Ordering::Relaxed);
    }

    /// Each hand-off since [`QueueDelays::sample`]: when it was queued and how long it
    /// waited (nanoseconds, `CLOCK_MONOTONIC`).
    pub fn take_samples(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn record(&self, queued: u64, ns: u64) {
        self.histogram.record(std::time::Duration::from_nanos(ns));
        if self.sampling.load(Ordering::Relaxed) {
            self.samples
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((queued, ns));
        }
    }
}

/// The workers.
pub(crate) struct DecodePool {
    design: PoolDesign,
    /// One pool (shared), or one single-thread pool per CPU.
    pools: Vec<rayon::ThreadPool>,
    threads: usize,
}

impl DecodePool {
    /// `threads` workers (shared), or one per CPU this process may run on.
    pub(crate) fn new(design: PoolDesign, threads: usize) -> Option<DecodePool> {
        let pools = match design {
            PoolDesign::Shared => vec![
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("vabc-decode-{i}"))
                    .build()
                    .ok()?,
            ],
            PoolDesign::PerCpu | PoolDesign::PerCpuFifo => {
                let fifo = design == PoolDesign::PerCpuFifo;
                let mut pools = Vec::new();
                for cpu in allowed_cpus() {
                    pools.push(
                        rayon::ThreadPoolBuilder::new()
                            .num_threads(1)
                            .thread_name(move |_| format!("vabc-decode-cpu{cpu}"))
                            .start_handler(move |_| pin_and_prioritise(cpu, fifo))
                            .build()
                            .ok()?,
                    );
                }
                if pools.is_empty() {
                    return None;
                }
                pools
            }
        };
        let threads = pools.iter().map(|p| p.current_num_threads()).sum();
        Some(DecodePool {
            design,
            pools,
            threads,
        })
    }

    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Where this thread hands work it does not do itself while it works (a verified
    /// request's second half): the shared pool, or the next CPU's worker.
    pub(crate) fn other(&self) -> &rayon::ThreadPool {
        match self.design {
            PoolDesign::Shared => &self.pools[0],
            _ => {
                // SAFETY: sched_getcpu takes nothing and returns a CPU number or -1.
                let cpu = unsafe { libc::sched_getcpu() };
                &self.pools[(usize::try_from(cpu).unwrap_or(0) + 1) % self.pools.len()]
            }
        }
    }

    /// The pool this thread hands its work to: the shared one, or its CPU's worker.
    pub(crate) fn local(&self) -> &rayon::ThreadPool {
        match self.design {
            PoolDesign::Shared => &self.pools[0],
            _ => {
                // SAFETY: sched_getcpu takes nothing and returns a CPU number or -1.
                let cpu = unsafe { libc::sched_getcpu() };
                &self.pools[usize::try_from(cpu).unwrap_or(0) % self.pools.len()]
            }
        }
    }
}

/// Runs `job` on a worker, recording its queueing delay.
pub(crate) fn timed<'s, F>(scope: &rayon::Scope<'s>, delays: &'s QueueDelays, job: F)
where
    F: FnOnce() + Send + 's,
{
    let queued = trace::spans::now_ns();
    scope.spawn(move |_| {
        delays.record(queued, trace::spans::now_ns().saturating_sub(queued));
        job()
    });
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set is ours and its size is passed.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        return (0..n).collect();
    }
    // SAFETY: CPU_ISSET reads the set for an index below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Pins the calling thread to `cpu` and, with `fifo`, raises it to SCHED_FIFO 1 where
/// permitted (a warning once where not).
fn pin_and_prioritise(cpu: usize, fifo: bool) {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET writes index `cpu` of our set; it came from the allowed set, so
    // it is below CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the set is ours and its size is passed; 0 is the calling thread.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        log::warn!(
            "decode worker: cannot pin to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
    if fifo {
        // SAFETY: sched_param is plain integers (one in glibc; musl adds the
        // SCHED_SPORADIC fields), for which all zeroes is a valid value.
        let mut param: libc::sched_param = unsafe { std::mem::zeroed() };
        param.sched_priority = 1;
        // The pthread call rather than sched_setscheduler: musl's is a stub that
        // fails with ENOSYS, and this is the calling thread either way.
        // SAFETY: pthread_self() is this live thread; the parameter is valid.
        let rc =
            unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) };
        if rc != 0 {
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "decode workers: SCHED_FIFO not permitted ({}): they run at normal priority",
                    std::io::Error::from_raw_os_error(rc)
                );
            }
        }
    }
}
