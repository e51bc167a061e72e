//! The FUSE-over-io_uring transport (Linux 6.14+, `CONFIG_FUSE_IO_URING`, module
//! parameter `fuse.enable_uring=Y`) of [`super::FuseExport`].
//!
//! The classic transport pays two system calls per request, which bounds random 4 KiB
//! reads on a small machine (docs/05-serving.md). Here the kernel hands each request to a
//! ring entry of the issuing CPU's queue; the queue's thread answers it straight into
//! the entry's payload buffer, and commits the answer and fetches the next request in
//! one SQE.
//!
//! By default the queue threads are asynchronous (`async_queue`): one thread per
//! queue holds many entries, issues the base-image and COW reads of small READs on its
//! own ring and never blocks on them; large READs go to a worker pool. Measured on the
//! corpus `system` pair through a loop device (2 vCPUs, bench/serve.sh, machine shared
//! with other jobs): rand 4K QD32 costs the daemon 13-14 µs of CPU per request against
//! 28-31 µs with the synchronous threads (8 per queue, one entry each), for 1.4x the
//! IOPS in the same runs; sequential 1 MiB reads showed no difference beyond the noise.
//! The synchronous design stays selectable ([`UringOptions::synchronous`]).
//!
//! Each queue thread owns one ring (`ring`), registered with the connection after INIT.

mod async_queue;
mod ring;
#[cfg(test)]
mod tests_async;

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use engine::BlockDevice;

use self::ring::QueueThread;
use super::fs::DiskFs;
use super::{FuseExport, MAX_REQUEST};
use crate::{Result, ServeError, io_err};

/// Where the kernel's switch lives.
pub const ENABLE_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Options of the io_uring transport ([`super::FuseOptions::uring`]).
#[derive(Clone, Debug)]
pub struct UringOptions {
    /// Asynchronous queue threads (the default): each thread keeps many requests in
    /// flight, issuing their base-image and COW reads on its own ring
    /// (`async_queue`); large READs and devices that cannot plan reads go to
    /// `sync_workers` threads. Off: every thread answers one request at a time,
    /// blocking in the engine, so each queue needs many threads.
    pub async_reads: bool,
    /// Threads per queue (one queue per possible CPU), each with its own ring. In the
    /// synchronous design the engine blocks while it reads, so this is the number of
    /// requests of one CPU served at once; asynchronous threads need only one.
    pub threads_per_queue: usize,
    /// Ring entries per thread (each with a 1 MiB payload buffer): the requests a
    /// thread holds at once. Synchronous threads want one: the kernel hands a request
    /// to any available entry of the queue, and a second entry of a busy thread would
    /// make it wait for that thread although others are idle. Requests beyond the
    /// entries wait in the kernel and go to the next entry that commits.
    pub entries_per_thread: usize,
    /// Asynchronous design: threads that serve the READs the queue threads do not plan
    /// (large ones, through the readahead, and those of devices without a planner).
    pub sync_workers: usize,
    /// Pin each queue's threads to the queue's CPU (the kernel queues a request on the
    /// queue of the CPU that issued it). Off by default: under a loop device nearly all
    /// requests come from its one worker, so from one CPU at a time, and pinned threads
    /// leave the other CPUs idle (2 vCPUs, bench/serve.sh, synchronous design: rand 4K
    /// QD32 24.7k pinned vs 32-35k unpinned, seq 1M QD8 810-900 vs 880-1050 MiB/s; not
    /// measured with the asynchronous threads, which also leave the readahead and the
    /// workers unpinned).
    pub pin: bool,
    /// How long an asynchronous queue thread polls its ring before sleeping while
    /// one of its small reads is in flight (zero: never). See `async_queue` for why.
    pub poll: Duration,
}

/// Default of [`UringOptions::poll`], chosen by measurement (bench/results/serve.md).
pub const DEFAULT_POLL: Duration = Duration::from_micros(50);

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            async_reads: true,
            threads_per_queue: 1,
            entries_per_thread: 32,
            sync_workers: 8,
            pin: false,
            poll: DEFAULT_POLL,
        }
    }
}

impl UringOptions {
    /// `workers` threads that may block in the device: the worker pool of the
    /// asynchronous design.
    pub fn with_workers(workers: usize) -> UringOptions {
        UringOptions {
            sync_workers: workers.max(1),
            ..UringOptions::default()
        }
    }

    /// The synchronous design with `workers` request threads in all, spread over the
    /// queues (one per possible CPU), one entry each.
    pub fn synchronous(workers: usize) -> UringOptions {
        let queues = possible_cpus().unwrap_or(1).max(1);
        UringOptions {
            async_reads: false,
            threads_per_queue: workers.div_ceil(queues).max(1),
            entries_per_thread: 1,
            ..UringOptions::default()
        }
    }
}

/// Whether this kernel lets a FUSE server use io_uring (see [`support`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UringSupport {
    /// [`ENABLE_PARAM`] is on: servers that ask for rings get them.
    Enabled,
    /// Built in but switched off (the kernel's default): root can turn it on.
    Disabled,
    /// The kernel has no FUSE over io_uring (before 6.14, or built without
    /// CONFIG_FUSE_IO_URING).
    Absent,
}

/// Whether this process can create io_uring instances at all (they can be disabled by
/// `kernel.io_uring_disabled` or a seccomp filter); the error says why not.
pub fn rings_usable() -> Result<()> {
    engine::io_uring_usable().map_err(|e| ServeError::Invalid {
        path: "/proc/sys/kernel/io_uring_disabled".into(),
        msg: format!(
            "cannot create an io_uring instance ({e}): io_uring is disabled for this \
             process, by that setting or by a seccomp filter"
        ),
    })
}

/// What [`ENABLE_PARAM`] says right now; an error only when it exists and cannot be read.
pub fn support() -> Result<UringSupport> {
    match std::fs::read_to_string(ENABLE_PARAM) {
        Ok(v) if matches!(v.trim(), "Y" | "1") => Ok(UringSupport::Enabled),
        Ok(_) => Ok(UringSupport::Disabled),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(UringSupport::Absent),
        Err(e) => Err(io_err("read", ENABLE_PARAM)(e)),
    }
}

/// Whether the kernel accepts FUSE-over-io_uring servers right now; an error when it
/// cannot (parameter absent or off), saying how to turn it on.
pub fn check_enabled() -> Result<()> {
    let path = Path::new(ENABLE_PARAM);
    match support()? {
        UringSupport::Enabled => Ok(()),
        UringSupport::Disabled => Err(ServeError::Invalid {
            path: path.into(),
            msg: "FUSE over io_uring is disabled in the kernel; enable it with \
                  `echo Y > /sys/module/fuse/parameters/enable_uring` (as root), \
                  or let `vabc serve` choose (`--fuse-transport auto`, the default)"
                .into(),
        }),
        UringSupport::Absent => Err(ServeError::Invalid {
            path: path.into(),
            msg: "this kernel has no FUSE over io_uring (needs Linux 6.14+ built with \
                  CONFIG_FUSE_IO_URING); serve with `--fuse-transport classic` or `auto`"
                .into(),
        }),
    }
}

/// Queue ids the kernel expects: one per possible CPU (`num_possible_cpus()`), and the
/// ring is ready only when every one of them has an entry.
fn possible_cpus() -> Result<usize> {
    let path = "/sys/devices/system/cpu/possible";
    let s = std::fs::read_to_string(path).map_err(io_err("read", path))?;
    parse_cpu_list(s.trim()).ok_or_else(|| ServeError::Invalid {
        path: path.into(),
        msg: format!("cannot parse CPU list {:?}", s.trim()),
    })
}

/// Counts the CPUs of a list like `0-3,5,7-8`.
fn parse_cpu_list(s: &str) -> Option<usize> {
    let mut n = 0;
    for part in s.split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => {
                b.parse::<usize>()
                    .ok()?
                    .checked_sub(a.parse::<usize>().ok()?)?
                    + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    Some(n)
}

/// Starts the queue threads of `export` (threads per queue, one queue per possible CPU)
/// and waits until each has registered its ring entries with the kernel.
pub(super) fn start_queues(
    export: &mut FuseExport,
    fs: &Arc<DiskFs>,
    planned: &Arc<dyn BlockDevice>,
    opts: &UringOptions,
) -> Result<()> {
    export.queue_count = possible_cpus()?;
    let (tx, rx) = mpsc::channel();
    let threads = opts.threads_per_queue.max(1);
    // Only the queue threads hold senders, so the workers end after them.
    let jobs = if opts.async_reads {
        let (jobs, queue) = crossbeam_channel::unbounded();
        export.workers = async_queue::spawn_workers(opts.sync_workers, fs, &queue)
            .map_err(io_err("spawn FUSE worker threads for", &export.dir))?;
        Some(jobs)
    } else {
        None
    };
    for qid in 0..export.queue_count {
        for t in 0..threads {
            let q = QueueThread {
                fuse: export.fuse.clone(),
                fs: fs.clone(),
                counters: export.counters.clone(),
                qid: qid as u16,
                cpu: opts.pin.then_some(qid),
                entries: opts.entries_per_thread.max(1),
                payload_size: MAX_REQUEST,
                async_mode: jobs.as_ref().map(|jobs| {
                    Box::new(async_queue::AsyncParts {
                        planned: planned.clone(),
                        jobs: jobs.clone(),
                        poll: opts.poll,
                    }) as Box<dyn ring::Answer>
                }),
            };
            let tx = tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("vabc-fuse-q{qid}-{t}"))
                .spawn(move || q.run(tx))
                .map_err(io_err("spawn FUSE io_uring queue threads for", &export.dir))?;
            export.queues.push(h);
        }
    }
    drop(tx);
    drop(jobs);
    let fail = |msg: String| ServeError::Invalid {
        path: export.dir.clone(),
        msg,
    };
    for _ in 0..export.queues.len() {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(fail(format!(
                    "the kernel refused the FUSE io_uring registration: {e} (see dmesg)"
                )));
            }
            Err(_) => return Err(fail("FUSE io_uring queue threads did not start".into())),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0-3,5,7-8"), Some(7));
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("3-1"), None);
    }

    #[test]
    fn possible_cpus_covers_the_online_ones() {
        let n = possible_cpus().unwrap();
        assert!(n >= std::thread::available_parallelism().map_or(1, |p| p.get()));
    }
}
