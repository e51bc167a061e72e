//! What-if replay: the requests a trace issued to one device (its D events), issued
//! again against a target with one thing changed, and the time it takes.
//!
//! Each request goes out when the number in flight is below what it was when the
//! traced device got it (the recorded queue depth), so the replay keeps the
//! workload's parallelism without its think time: the runtime is the I/O's. A flush
//! (a request with no data and the flush flag) waits for everything before it and
//! then `fdatasync`s the target; a write with the pre-flush flag does the same before
//! it goes; a FUA write is written with `RWF_DSYNC`. What can change:
//! - `no_sync`: flushes, pre-flushes and FUA dropped (the "no-sync" of the
//!   smartphone storage study: what do the app's syncs cost?);
//! - the target: a file on another disk, on a RAM file system (`/dev/shm`), a block
//!   device, a served image;
//! - `sequential`: the same requests in sector order, at the same depths (what does
//!   its randomness cost?).
//!
//! I/O goes through one io_uring with O_DIRECT, so the page cache neither absorbs
//! writes nor serves reads. Writes write zeros: a replay destroys the target's data.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

use io_uring::{IoUring, opcode, types};

use crate::{Action, Dev, Error, Event, Result, cat};

/// One thing the device was asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Item {
    Io(Request),
    /// A flush with no data (an `fsync`'s cache flush).
    Flush,
}

/// A request with data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub write: bool,
    pub offset: u64,
    pub len: u32,
    /// Flush the device's cache before it (REQ_PREFLUSH).
    pub preflush: bool,
    /// Reach stable storage before completing (REQ_FUA).
    pub fua: bool,
    /// Requests in flight on the traced device when it was issued, itself included.
    pub depth: u32,
}

/// The requests issued to `dev` (its D events), in issue order.
pub fn requests(events: &[Event], dev: Dev) -> Vec<Item> {
    let mut items = Vec::new();
    let mut in_flight: u32 = 0;
    for ev in events.iter().filter(|e| e.dev == dev) {
        match ev.action {
            Action::Issue => {
                in_flight += 1;
                if ev.bytes == 0 {
                    if ev.flags & cat::FLUSH != 0 {
                        items.push(Item::Flush);
                    }
                    continue;
                }
                if ev.flags & (cat::READ | cat::WRITE) == 0 || ev.flags & cat::DISCARD != 0 {
                    continue;
                }
                items.push(Item::Io(Request {
                    write: ev.flags & cat::WRITE != 0,
                    offset: ev.sector * 512,
                    len: ev.bytes,
                    preflush: ev.flags & cat::FLUSH != 0,
                    fua: ev.flags & cat::FUA != 0,
                    depth: in_flight,
                }));
            }
            Action::Complete => in_flight = in_flight.saturating_sub(1),
            Action::Requeue => in_flight = in_flight.saturating_sub(1),
            _ => {}
        }
    }
    items
}

/// The device of a trace with the most issued requests.
pub fn busiest_device(events: &[Event]) -> Option<Dev> {
    let mut counts: std::collections::BTreeMap<Dev, u64> = Default::default();
    for e in events.iter().filter(|e| e.action == Action::Issue) {
        *counts.entry(e.dev).or_default() += 1;
    }
    counts.into_iter().max_by_key(|(_, n)| *n).map(|(d, _)| d)
}

/// What changes in a replay.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    pub no_sync: bool,
    pub sequential: bool,
}

/// What a replay did and how long it took.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, schemars::JsonSchema)]
pub struct Outcome {
    pub seconds: f64,
    pub reads: u64,
    pub writes: u64,
    pub bytes: u64,
    /// Cache flushes issued (`fdatasync`), and writes written with RWF_DSYNC.
    pub syncs: u64,
    pub fua_writes: u64,
    /// Flushes, pre-flushes and FUA flags the no-sync replay left out.
    pub syncs_dropped: u64,
}

/// The items in the order a replay issues them.
pub fn plan(items: &[Item], opts: &Options) -> Vec<Item> {
    let mut out: Vec<Item> = items.to_vec();
    if opts.sequential {
        // Sector order; flushes lose their place, so one goes last if there were any.
        let flushes = out.iter().any(|i| matches!(i, Item::Flush));
        out.retain(|i| matches!(i, Item::Io(_)));
        out.sort_by_key(|i| match i {
            Item::Io(r) => r.offset,
            Item::Flush => u64::MAX,
        });
        if flushes {
            out.push(Item::Flush);
        }
    }
    out
}

/// The requests with data among `items`.
fn ios(items: &[Item]) -> impl Iterator<Item = &Request> {
    items.iter().filter_map(|i| match i {
        Item::Io(r) => Some(r),
        Item::Flush => None,
    })
}

/// The bytes a target must hold for `items`.
pub fn extent(items: &[Item]) -> u64 {
    ios(items)
        .map(|r| r.offset + u64::from(r.len))
        .max()
        .unwrap_or(0)
}

const RING: u32 = 256;
const FSYNC_TAG: u64 = u64::MAX;

/// Replays `items` against `target` (a file, created or extended as needed, or a
/// block device not in use); `progress` is called with the items done so far.
pub fn replay(
    items: &[Item],
    target: &Path,
    opts: &Options,
    mut progress: impl FnMut(u64),
) -> Result<Outcome> {
    let plan = plan(items, opts);
    let need = extent(&plan);
    let file = open_target(target, need)?;
    let io_err = |op: &str, e: std::io::Error| {
        Error::Input(format!("{}: replay {op}: {e}", target.display()))
    };
    let mut ring: IoUring = vabc_io::ring::new(RING).map_err(|e| io_err("io_uring setup", e))?;
    let max_len = ios(&plan).map(|r| r.len as usize).max().unwrap_or(4096);
    let slots = ios(&plan)
        .map(|r| r.depth as usize)
        .max()
        .unwrap_or(1)
        .clamp(1, RING as usize - 1);
    let mut bufs: Vec<engine::AlignedBuf> = (0..slots)
        .map(|_| engine::AlignedBuf::new(max_len))
        .collect();
    let mut in_flight = 0usize;
    let mut out = Outcome::default();
    let fd = types::Fd(file.as_raw_fd());
    let started = Instant::now();
    let result = issue(
        &plan,
        opts,
        &mut ring,
        fd,
        &mut bufs,
        slots,
        &mut in_flight,
        &mut out,
        &mut progress,
        &io_err,
    );
    // Nothing may be in flight when the buffers go: after an error, reap the rest.
    if result.is_err()
        && drain(&mut ring, &mut in_flight, &mut Vec::new(), 0, &io_err).is_err()
        && in_flight > 0
    {
        // The ring cannot be entered any more: the kernel may still fill the buffers,
        // so they are never freed.
        std::mem::forget(bufs);
        return result.map(|_| out);
    }
    result?;
    out.seconds = started.elapsed().as_secs_f64();
    progress(plan.len() as u64);
    Ok(out)
}

/// Reaps completions until at most `limit` are in flight (all of them, errors or not);
/// then returns the first error.
fn drain(
    ring: &mut IoUring,
    in_flight: &mut usize,
    free: &mut Vec<usize>,
    limit: usize,
    io_err: &dyn Fn(&str, std::io::Error) -> Error,
) -> Result<()> {
    let mut first = None;
    while *in_flight > limit {
        engine::io_uring_enter(ring, 1).map_err(|e| io_err("io_uring_enter", e))?;
        for cqe in ring.completion() {
            if cqe.result() < 0 && first.is_none() {
                first = Some(io_err(
                    "I/O",
                    std::io::Error::from_raw_os_error(-cqe.result()),
                ));
            }
            *in_flight -= 1;
            if cqe.user_data() != FSYNC_TAG {
                free.push(cqe.user_data() as usize);
            }
        }
    }
    first.map_or(Ok(()), Err)
}

/// Waits for everything in flight, then `fdatasync`s the target.
fn sync(
    ring: &mut IoUring,
    fd: types::Fd,
    in_flight: &mut usize,
    free: &mut Vec<usize>,
    io_err: &dyn Fn(&str, std::io::Error) -> Error,
) -> Result<()> {
    drain(ring, in_flight, free, 0, io_err)?;
    let e = opcode::Fsync::new(fd)
        .flags(types::FsyncFlags::DATASYNC)
        .build()
        .user_data(FSYNC_TAG);
    // SAFETY: the entry refers to no memory; the fd outlives the ring's use of it.
    unsafe { ring.submission().push(&e) }
        .map_err(|_| Error::Input("replay: submission queue full".into()))?;
    *in_flight += 1;
    drain(ring, in_flight, free, 0, io_err)
}

#[allow(clippy::too_many_arguments)]
fn issue(
    plan: &[Item],
    opts: &Options,
    ring: &mut IoUring,
    fd: types::Fd,
    bufs: &mut [engine::AlignedBuf],
    slots: usize,
    in_flight: &mut usize,
    out: &mut Outcome,
    progress: &mut dyn FnMut(u64),
    io_err: &dyn Fn(&str, std::io::Error) -> Error,
) -> Result<()> {
    let mut free: Vec<usize> = (0..slots).rev().collect();
    for (n, item) in plan.iter().enumerate() {
        match *item {
            Item::Flush if opts.no_sync => out.syncs_dropped += 1,
            Item::Flush => {
                sync(ring, fd, in_flight, &mut free, io_err)?;
                out.syncs += 1;
            }
            Item::Io(r) => {
                if r.write && r.preflush {
                    if opts.no_sync {
                        out.syncs_dropped += 1;
                    } else {
                        sync(ring, fd, in_flight, &mut free, io_err)?;
                        out.syncs += 1;
                    }
                }
                drain(
                    ring,
                    in_flight,
                    &mut free,
                    (r.depth as usize).clamp(1, slots) - 1,
                    io_err,
                )?;
                let Some(slot) = free.pop() else {
                    return Err(Error::Input("replay: no free buffer (internal)".into()));
                };
                let buf = bufs[slot].slice_mut(r.len as usize);
                let entry = if r.write {
                    let dsync = r.fua && !opts.no_sync;
                    if r.fua {
                        if dsync {
                            out.fua_writes += 1;
                        } else {
                            out.syncs_dropped += 1;
                        }
                    }
                    out.writes += 1;
                    opcode::Write::new(fd, buf.as_ptr(), r.len)
                        .offset(r.offset)
                        .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                        .build()
                } else {
                    out.reads += 1;
                    opcode::Read::new(fd, buf.as_mut_ptr(), r.len)
                        .offset(r.offset)
                        .build()
                };
                out.bytes += u64::from(r.len);
                // SAFETY: the buffer is the slot's and is not touched (nor handed out
                // again) until its completion is reaped; `replay` reaps every
                // completion before the buffers are freed, or never frees them.
                unsafe { ring.submission().push(&entry.user_data(slot as u64)) }
                    .map_err(|_| Error::Input("replay: submission queue full".into()))?;
                *in_flight += 1;
                engine::io_uring_enter(ring, 0).map_err(|e| io_err("io_uring_enter", e))?;
            }
        }
        if n % 256 == 0 {
            progress(n as u64);
        }
    }
    drain(ring, in_flight, &mut free, 0, io_err)
}

/// Opens the target for direct I/O: a file (created, and extended to `need`), or a
/// block device at least `need` long that nothing has open exclusively (mounted).
fn open_target(target: &Path, need: u64) -> Result<File> {
    let err = |what: String| Error::Input(format!("{}: {what}", target.display()));
    let md = std::fs::metadata(target).ok();
    let block = md.as_ref().is_some_and(|m| m.file_type().is_block_device());
    let mut o = OpenOptions::new();
    o.read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT | if block { libc::O_EXCL } else { 0 });
    if !block {
        o.create(true);
    }
    let file = o.open(target).map_err(|e| {
        if e.raw_os_error() == Some(libc::EBUSY) {
            err("in use (mounted?): a replay writes to it".into())
        } else {
            err(format!("cannot open for direct I/O: {e}"))
        }
    })?;
    let size = vabc_io::size_of(&file).map_err(|e| Error::io("find the size of", target, e))?;
    if size < need {
        if block {
            return Err(err(format!(
                "{size} bytes, but the trace reaches byte {need}"
            )));
        }
        file.set_len(need)
            .map_err(|e| Error::io("extend", target, e))?;
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Extra;

    fn ev(action: Action, flags: u32, sector: u64, sectors: u32) -> Event {
        Event {
            time_ns: 0,
            dev: Dev { major: 7, minor: 0 },
            action,
            flags,
            sector,
            bytes: sectors * 512,
            pid: 1,
            cpu: 0,
            error: 0,
            extra: Extra::None,
        }
    }

    #[test]
    fn issued_requests_keep_their_depth_and_sync_flags() {
        use Action::*;
        let w = cat::WRITE;
        let events = [
            ev(Issue, w, 0, 8),
            ev(Issue, w | cat::SYNC, 8, 8),
            ev(Complete, w, 0, 8),
            ev(Complete, w, 8, 8),
            ev(Issue, w | cat::FLUSH, 0, 0),
            ev(Complete, w | cat::FLUSH, 0, 0),
            ev(Issue, w | cat::FUA, 16, 8),
            ev(Complete, w, 16, 8),
            ev(Issue, cat::READ, 100, 8),
        ];
        let items = requests(&events, Dev { major: 7, minor: 0 });
        assert_eq!(items.len(), 5);
        assert!(matches!(
            items[1],
            Item::Io(Request {
                depth: 2,
                offset: 4096,
                ..
            })
        ));
        assert_eq!(items[2], Item::Flush);
        assert!(matches!(
            items[3],
            Item::Io(Request {
                fua: true,
                depth: 1,
                ..
            })
        ));
        assert!(matches!(
            items[4],
            Item::Io(Request {
                write: false,
                offset: 51200,
                ..
            })
        ));
        let seq = plan(
            &items,
            &Options {
                sequential: true,
                ..Options::default()
            },
        );
        assert_eq!(seq.last(), Some(&Item::Flush));
        assert_eq!(extent(&items), 51200 + 4096);
    }

    #[test]
    fn a_replay_writes_reads_and_syncs_a_file_or_drops_the_syncs() {
        use Action::*;
        let w = cat::WRITE;
        let mut events = Vec::new();
        for i in 0..64u64 {
            events.push(ev(Issue, w, i * 8, 8));
            events.push(ev(Complete, w, i * 8, 8));
            if i % 8 == 7 {
                events.push(ev(Issue, w | cat::FLUSH, 0, 0));
                events.push(ev(Complete, w | cat::FLUSH, 0, 0));
            }
        }
        events.push(ev(Issue, cat::READ, 0, 64));
        let items = requests(&events, Dev { major: 7, minor: 0 });
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t.img");
        let a = replay(&items, &target, &Options::default(), |_| {}).unwrap();
        assert_eq!((a.writes, a.reads, a.syncs, a.syncs_dropped), (64, 1, 8, 0));
        assert_eq!(a.bytes, 64 * 4096 + 32768);
        assert_eq!(std::fs::metadata(&target).unwrap().len(), 64 * 4096);
        let b = replay(
            &items,
            &target,
            &Options {
                no_sync: true,
                ..Options::default()
            },
            |_| {},
        )
        .unwrap();
        assert_eq!((b.writes, b.syncs, b.syncs_dropped), (64, 0, 8));
    }
}
