//! Recording the block tracepoints through tracefs.
//!
//! A private instance (`instances/vabc-PID`) keeps our events, clock and filters out
//! of the global buffer other tools use. Its clock is `mono`, blktrace's own
//! (`ktime_get`), which is also user space's `CLOCK_MONOTONIC`: our spans and the
//! block events share one time line. A thread per CPU reads that CPU's ring buffer
//! in its binary form (`per_cpu/cpuN/trace_pipe_raw`, one page per read, no
//! formatting by the kernel) into memory, waking every 100 ms or when the buffer is
//! half full; pages are decoded after the recording stops, so the recording itself
//! costs a copy per page.
//!
//! The page format (`events/header_page`, `events/header_event`): a 64-bit time
//! stamp, a 64-bit commit word (bytes of data; bit 31 says events were lost before
//! this page), then events, each a 32-bit header (5 bits type/length, 27 bits time
//! delta) and its data, whose fields sit at the offsets each event's `format` file
//! gives.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::{Action, Dev, Error, Event, Extra, Result, cat};

/// The tracepoints recorded and the blktrace action each stands for. Plug and
/// unplug are left out: they carry no device, so they cannot be filtered by one.
const EVENTS: &[(&str, Action)] = &[
    ("block_bio_queue", Action::Queue),
    ("block_bio_backmerge", Action::BackMerge),
    ("block_bio_frontmerge", Action::FrontMerge),
    ("block_rq_merge", Action::BackMerge),
    ("block_getrq", Action::GetRq),
    ("block_rq_insert", Action::Insert),
    ("block_rq_issue", Action::Issue),
    ("block_rq_requeue", Action::Requeue),
    ("block_rq_complete", Action::Complete),
    ("block_bio_complete", Action::Complete),
    ("block_split", Action::Split),
    ("block_bio_remap", Action::Remap),
    ("block_rq_remap", Action::Remap),
];

/// Where tracefs is mounted (mounting it when it is not).
pub fn tracefs_root() -> Result<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mounted = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "tracefs").then(|| PathBuf::from(dir))
        })
        .next();
    if let Some(dir) = mounted {
        return match fs::read_dir(dir.join("events")) {
            Ok(_) => Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                Err(Error::Tracefs(format!(
                    "{}: permission denied (tracing the block layer needs root)",
                    dir.display()
                )))
            }
            Err(e) => Err(Error::Tracefs(format!(
                "{}: {e}",
                dir.join("events").display()
            ))),
        };
    }
    let p = Path::new("/sys/kernel/tracing");
    if !p.is_dir() {
        return Err(Error::Tracefs(
            "this kernel has no /sys/kernel/tracing (built without CONFIG_FTRACE?)".into(),
        ));
    }
    rustix::mount::mount(
        "nodev",
        p,
        "tracefs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .map_err(|e| {
        Error::Tracefs(format!(
            "tracefs is not mounted and mounting it at {} failed: {e}{}",
            p.display(),
            if e == rustix::io::Errno::PERM {
                " (tracing the block layer needs root)"
            } else {
                ""
            }
        ))
    })?;
    Ok(p.to_path_buf())
}

/// A field of an event's record: where it is and how wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub offset: usize,
    pub size: usize,
}

/// An event's `format` file: its id and fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Format {
    pub id: u16,
    pub fields: HashMap<String, Field>,
}

/// Parses a tracefs `format` file.
pub fn parse_format(text: &str, path: &Path) -> Result<Format> {
    let bad = |what: String| Error::Format {
        path: path.to_path_buf(),
        offset: 0,
        what,
    };
    let mut id = None;
    let mut fields = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(v) = line.strip_prefix("ID:") {
            id = Some(
                v.trim()
                    .parse::<u16>()
                    .map_err(|_| bad(format!("bad ID line {line:?}")))?,
            );
        } else if let Some(rest) = line.strip_prefix("field:") {
            let mut parts = rest.split(';').map(str::trim);
            let decl = parts.next().unwrap_or("");
            let mut offset = None;
            let mut size = None;
            for p in parts {
                if let Some(v) = p.strip_prefix("offset:") {
                    offset = v.parse::<usize>().ok();
                } else if let Some(v) = p.strip_prefix("size:") {
                    size = v.parse::<usize>().ok();
                }
            }
            // The name is the declaration's last word, without an array suffix.
            let name = decl.rsplit([' ', '\t']).next().unwrap_or("");
            let name = name.split('[').next().unwrap_or(name);
            match (offset, size) {
                (Some(offset), Some(size)) if !name.is_empty() => {
                    fields.insert(name.to_string(), Field { offset, size });
                }
                _ => return Err(bad(format!("bad field line {line:?}"))),
            }
        }
    }
    let id = id.ok_or_else(|| bad("no ID line".into()))?;
    Ok(Format { id, fields })
}

/// How to turn one tracepoint's record into an [`Event`].
#[derive(Clone, Debug)]
struct Decoder {
    action: Action,
    request: bool,
    dev: Field,
    sector: Field,
    nr_sector: Option<Field>,
    rwbs: Field,
    error: Option<Field>,
    new_sector: Option<Field>,
    old_dev: Option<Field>,
    old_sector: Option<Field>,
}

impl Decoder {
    fn new(name: &str, action: Action, f: &Format, path: &Path) -> Result<Decoder> {
        let need = |n: &str| {
            f.fields.get(n).copied().ok_or_else(|| Error::Format {
                path: path.to_path_buf(),
                offset: 0,
                what: format!("event {name} has no field {n}"),
            })
        };
        Ok(Decoder {
            action,
            request: name.starts_with("block_rq_") || name == "block_getrq",
            dev: need("dev")?,
            sector: need("sector")?,
            nr_sector: f.fields.get("nr_sector").copied(),
            rwbs: need("rwbs")?,
            error: f.fields.get("error").copied(),
            new_sector: f.fields.get("new_sector").copied(),
            old_dev: f.fields.get("old_dev").copied(),
            old_sector: f.fields.get("old_sector").copied(),
        })
    }

    fn decode(&self, data: &[u8], time_ns: u64, cpu: u32) -> Option<Event> {
        let pid = le_uint(data, Field { offset: 4, size: 4 })? as u32;
        let dev = Dev::from_kernel(le_uint(data, self.dev)? as u32);
        let sector = le_uint(data, self.sector)?;
        let sectors = match self.nr_sector {
            Some(f) => le_uint(data, f)?,
            None => 0,
        };
        let rwbs = data.get(self.rwbs.offset..self.rwbs.offset.checked_add(self.rwbs.size)?)?;
        let mut flags = rwbs_flags(rwbs);
        // blktrace marks requests from file systems (not passthrough commands) FS.
        if self.request && self.action != Action::GetRq {
            flags |= cat::FS;
        }
        let error = match self.error {
            Some(f) => le_uint(data, f)? as u16,
            None => 0,
        };
        let extra = match (self.new_sector, self.old_dev, self.old_sector) {
            (Some(n), _, _) => Extra::Split {
                new_sector: le_uint(data, n)?,
            },
            (None, Some(d), Some(s)) => Extra::Remap {
                from_dev: Dev::from_kernel(le_uint(data, d)? as u32),
                from_sector: le_uint(data, s)?,
            },
            _ => Extra::None,
        };
        Some(Event {
            time_ns,
            dev,
            action: self.action,
            flags,
            sector,
            bytes: (sectors << 9).min(u64::from(u32::MAX)) as u32,
            pid,
            cpu,
            error,
            extra,
        })
    }
}

/// A little-endian unsigned field of 1, 2, 4 or 8 bytes (tracefs records are in the
/// host's order; the hosts we run on are little-endian).
fn le_uint(data: &[u8], f: Field) -> Option<u64> {
    let b = data.get(f.offset..f.offset.checked_add(f.size)?)?;
    let mut v = [0u8; 8];
    v.get_mut(..b.len())?.copy_from_slice(b);
    Some(u64::from_le_bytes(v))
}

/// The kernel's RWBS text (`blk_fill_rwbs`) as blktrace's category bits.
fn rwbs_flags(rwbs: &[u8]) -> u32 {
    let text = rwbs.split(|&b| b == 0).next().unwrap_or(&[]);
    let mut flags = 0;
    let mut seen_dir = false;
    for &c in text {
        flags |= match (c, seen_dir) {
            (b'F', false) => cat::FLUSH,
            (b'F', true) => cat::FUA,
            (b'W', _) => cat::WRITE,
            (b'R', _) => cat::READ,
            (b'D', _) => cat::DISCARD | cat::WRITE,
            (b'E', _) => cat::DISCARD | cat::WRITE,
            (b'A', _) => cat::AHEAD,
            (b'S', _) => cat::SYNC,
            (b'M', _) => cat::META,
            _ => 0,
        };
        if matches!(c, b'W' | b'R' | b'D' | b'E' | b'N') {
            seen_dir = true;
        }
    }
    flags
}

/// The ring buffer's record types (`type_len` values past the data lengths).
const PADDING: u32 = 29;
const TIME_EXTEND: u32 = 30;
const TIME_STAMP: u32 = 31;
/// The commit word's flags: events were lost before this page (and their count is
/// stored after the data).
const MISSED_EVENTS: u64 = 1 << 31;
const MISSED_STORED: u64 = 1 << 30;
const PAGE_HEADER: usize = 16;

/// What decoding the pages found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PageStats {
    pub pages: u64,
    pub events: u64,
    /// Records of other events (should not happen: the instance records only ours).
    pub foreign: u64,
    /// Pages that said events were lost before them.
    pub lossy_pages: u64,
    /// Events known lost (from the pages that stored the count).
    pub lost: u64,
}

/// Decodes one CPU's raw pages (each `page_size` bytes, as `trace_pipe_raw` returns
/// them) into events, in time order.
fn decode_pages(
    raw: &[u8],
    page_size: usize,
    cpu: u32,
    decoders: &HashMap<u16, Decoder>,
    out: &mut Vec<Event>,
    stats: &mut PageStats,
    path: &Path,
) -> Result<()> {
    for (i, page) in raw.chunks(page_size).enumerate() {
        let bad = |off: usize, what: &str| Error::Format {
            path: path.to_path_buf(),
            offset: (i * page_size + off) as u64,
            what: what.to_string(),
        };
        if page.len() < PAGE_HEADER {
            return Err(bad(0, "short page"));
        }
        stats.pages += 1;
        let mut ts = u64::from_le_bytes(page[0..8].try_into().unwrap_or_default());
        let commit = u64::from_le_bytes(page[8..16].try_into().unwrap_or_default());
        let len = (commit & 0x000f_ffff) as usize;
        if PAGE_HEADER + len > page.len() {
            return Err(bad(8, "page commit length runs past the page"));
        }
        if commit & MISSED_EVENTS != 0 {
            stats.lossy_pages += 1;
            if commit & MISSED_STORED != 0
                && let Some(b) = page.get(PAGE_HEADER + len..PAGE_HEADER + len + 8)
            {
                stats.lost += u64::from_le_bytes(b.try_into().unwrap_or_default());
            }
        }
        let data = &page[PAGE_HEADER..PAGE_HEADER + len];
        let mut off = 0;
        while off + 4 <= data.len() {
            let head = u32::from_le_bytes(data[off..off + 4].try_into().unwrap_or_default());
            let type_len = head & 0x1f;
            let delta = u64::from(head >> 5);
            let array = data
                .get(off + 4..off + 8)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()));
            match type_len {
                PADDING => {
                    if delta == 0 {
                        break; // the rest of the page is unused
                    }
                    let a = array.ok_or_else(|| bad(PAGE_HEADER + off, "truncated padding"))?;
                    off += 4 + a as usize;
                }
                TIME_EXTEND => {
                    let a = array.ok_or_else(|| bad(PAGE_HEADER + off, "truncated time extend"))?;
                    ts = ts.wrapping_add(delta | (u64::from(a) << 27));
                    off += 8;
                }
                TIME_STAMP => {
                    let a = array.ok_or_else(|| bad(PAGE_HEADER + off, "truncated time stamp"))?;
                    // The absolute stamp holds the low 59 bits.
                    let abs = delta | (u64::from(a) << 27);
                    ts = (ts & !((1u64 << 59) - 1)) | abs;
                    off += 8;
                }
                _ => {
                    let (start, size) = if type_len == 0 {
                        let a = array.ok_or_else(|| bad(PAGE_HEADER + off, "truncated event"))?;
                        (off + 8, (a as usize).saturating_sub(4))
                    } else {
                        (off + 4, type_len as usize * 4)
                    };
                    let rec = data
                        .get(start..start + size)
                        .ok_or_else(|| bad(PAGE_HEADER + off, "event runs past the page's data"))?;
                    ts = ts.wrapping_add(delta);
                    let id = u16::from_le_bytes([
                        rec.first().copied().unwrap_or(0),
                        rec.get(1).copied().unwrap_or(0),
                    ]);
                    match decoders.get(&id).and_then(|d| d.decode(rec, ts, cpu)) {
                        Some(ev) => {
                            stats.events += 1;
                            out.push(ev);
                        }
                        None => stats.foreign += 1,
                    }
                    off = start + size;
                }
            }
        }
    }
    Ok(())
}

/// Most raw bytes kept per CPU (about 8 million events): a recording left running
/// must not take the machine's memory; later pages are read and left out (counted).
const MAX_RAW_PER_CPU: usize = 512 << 20;

/// What to record.
#[derive(Clone, Debug)]
pub struct RecordOptions {
    /// Only these devices (all when empty).
    pub devices: Vec<Dev>,
    /// Ring buffer per CPU, KiB.
    pub buffer_kb: u32,
}

impl Default for RecordOptions {
    fn default() -> Self {
        RecordOptions {
            devices: Vec::new(),
            buffer_kb: 8192,
        }
    }
}

/// A recording under way.
pub struct Recorder {
    instance: PathBuf,
    page_size: usize,
    decoders: HashMap<u16, Decoder>,
    stop: Arc<AtomicBool>,
    read: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
    readers: Vec<(u32, JoinHandle<Result<Vec<u8>>>)>,
}

/// A finished recording: each CPU's events, in time order.
#[derive(Debug, Default)]
pub struct Recording {
    pub per_cpu: Vec<(u32, Vec<Event>)>,
    pub stats: PageStats,
    /// Events the kernel overwrote or dropped because the buffer was full
    /// (`per_cpu/cpuN/stats`).
    pub overrun: u64,
    /// Pages read but not kept: past `MAX_RAW_PER_CPU` of one CPU's.
    pub dropped_pages: u64,
}

impl Recording {
    /// All events in time order.
    pub fn merged(&self) -> Vec<Event> {
        let mut all: Vec<Event> = self
            .per_cpu
            .iter()
            .flat_map(|(_, e)| e.iter().copied())
            .collect();
        all.sort_by_key(|e| e.time_ns);
        all
    }
}

fn write_file(path: &Path, value: &str) -> Result<()> {
    fs::write(path, value).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
            " (tracing needs root)"
        } else {
            ""
        };
        Error::Tracefs(format!(
            "writing {value:?} to {}: {e}{hint}",
            path.display()
        ))
    })
}

impl Recorder {
    /// Creates the instance, enables the events and starts a reader per CPU.
    pub fn start(opts: &RecordOptions) -> Result<Recorder> {
        let root = tracefs_root()?;
        let instances = root.join("instances");
        remove_stale_instances(&instances);
        let instance = instances.join(format!("vabc-{}", std::process::id()));
        if instance.exists() {
            let _ = fs::remove_dir(&instance);
        }
        fs::create_dir(&instance).map_err(|e| {
            Error::Tracefs(format!(
                "creating the instance {}: {e}{}",
                instance.display(),
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    " (tracing needs root)"
                } else {
                    ""
                }
            ))
        })?;
        let mut rec = Recorder {
            instance,
            page_size: page_size(&root),
            decoders: HashMap::new(),
            stop: Arc::new(AtomicBool::new(false)),
            read: Arc::new(AtomicU64::new(0)),
            dropped: Arc::new(AtomicU64::new(0)),
            readers: Vec::new(),
        };
        // Dropping `rec` on an error below removes the instance.
        write_file(&rec.instance.join("tracing_on"), "0")?;
        write_file(&rec.instance.join("trace_clock"), "mono")?;
        write_file(
            &rec.instance.join("buffer_size_kb"),
            &opts.buffer_kb.to_string(),
        )?;
        let filter = opts
            .devices
            .iter()
            .map(|d| format!("dev == {}", d.to_kernel()))
            .collect::<Vec<_>>()
            .join(" || ");
        for &(name, action) in EVENTS {
            let dir = rec.instance.join("events/block").join(name);
            let fmt_path = dir.join("format");
            let Ok(text) = fs::read_to_string(&fmt_path) else {
                continue; // not every kernel has every event (bio_complete, rq_merge)
            };
            let format = parse_format(&text, &fmt_path)?;
            rec.decoders
                .insert(format.id, Decoder::new(name, action, &format, &fmt_path)?);
            if !filter.is_empty() {
                write_file(&dir.join("filter"), &filter)?;
            }
            write_file(&dir.join("enable"), "1")?;
        }
        if rec.decoders.is_empty() {
            return Err(Error::Tracefs(format!(
                "{}: no block events (this kernel traces no block layer?)",
                root.join("events/block").display()
            )));
        }
        for cpu in online_cpus(&rec.instance)? {
            let path = rec
                .instance
                .join(format!("per_cpu/cpu{cpu}/trace_pipe_raw"));
            let file = fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&path)
                .map_err(|e| Error::io("read", &path, e))?;
            let stop = rec.stop.clone();
            let read = rec.read.clone();
            let dropped = rec.dropped.clone();
            let page = rec.page_size;
            let handle = std::thread::Builder::new()
                .name(format!("trace-cpu{cpu}"))
                .spawn(move || read_cpu(file, page, &stop, &read, &dropped, &path))
                .map_err(|e| Error::Tracefs(format!("starting a reader thread: {e}")))?;
            rec.readers.push((cpu, handle));
        }
        write_file(&rec.instance.join("tracing_on"), "1")?;
        Ok(rec)
    }

    /// Bytes of ring-buffer pages read so far (for progress).
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Stops the recording, drains the buffers and decodes them.
    pub fn stop(mut self) -> Result<Recording> {
        write_file(&self.instance.join("tracing_on"), "0")?;
        self.stop.store(true, Ordering::Release);
        let mut recording = Recording::default();
        let mut first_err = None;
        for (cpu, handle) in std::mem::take(&mut self.readers) {
            let raw = match handle.join() {
                Ok(Ok(raw)) => raw,
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                    continue;
                }
                Err(_) => {
                    first_err
                        .get_or_insert(Error::Tracefs(format!("the reader of CPU {cpu} panicked")));
                    continue;
                }
            };
            let path = self
                .instance
                .join(format!("per_cpu/cpu{cpu}/trace_pipe_raw"));
            let mut events = Vec::new();
            decode_pages(
                &raw,
                self.page_size,
                cpu,
                &self.decoders,
                &mut events,
                &mut recording.stats,
                &path,
            )?;
            recording.overrun += cpu_overrun(&self.instance, cpu);
            recording.dropped_pages = self.dropped.load(Ordering::Relaxed);
            recording.per_cpu.push((cpu, events));
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(recording),
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = fs::write(self.instance.join("tracing_on"), "0");
        for (_, h) in self.readers.drain(..) {
            let _ = h.join();
        }
        // The instance goes with its buffers and event settings.
        let _ = fs::remove_dir(&self.instance);
    }
}

/// Reads one CPU's pages until told to stop and the buffer is empty.
fn read_cpu(
    mut file: fs::File,
    page: usize,
    stop: &AtomicBool,
    read: &AtomicU64,
    dropped: &AtomicU64,
    path: &Path,
) -> Result<Vec<u8>> {
    let mut raw = Vec::new();
    let mut buf = vec![0u8; page];
    loop {
        match file.read(&mut buf) {
            Ok(n) if n > 0 && raw.len() >= MAX_RAW_PER_CPU => {
                // Full: keep draining the kernel's buffer, keep nothing.
                dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Ok(n) if n > 0 => {
                // A read returns one page (the unused tail included).
                raw.extend_from_slice(&buf[..n]);
                raw.resize(raw.len().next_multiple_of(page), 0);
                read.fetch_add(page as u64, Ordering::Relaxed);
                continue;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io("read", path, e)),
        }
        // Empty: done when stopped (tracing was switched off before the flag was set,
        // so nothing more arrives), else wait for the buffer to fill or 100 ms.
        if stop.load(Ordering::Acquire) {
            return Ok(raw);
        }
        let mut fds = [rustix::event::PollFd::new(
            &file,
            rustix::event::PollFlags::IN,
        )];
        let timeout = rustix::event::Timespec::try_from(Duration::from_millis(100)).ok();
        let _ = rustix::event::poll(&mut fds, timeout.as_ref());
    }
}

/// The ring buffer's page size: the sub-buffer size where the kernel lets it be set,
/// else the system page.
fn page_size(root: &Path) -> usize {
    fs::read_to_string(root.join("buffer_subbuf_size_kb"))
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .map_or(4096, |kb| kb * 1024)
}

fn online_cpus(instance: &Path) -> Result<Vec<u32>> {
    let dir = instance.join("per_cpu");
    let mut cpus = Vec::new();
    for entry in fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))? {
        let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
        if let Some(n) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("cpu"))
            .and_then(|n| n.parse().ok())
        {
            cpus.push(n);
        }
    }
    cpus.sort();
    Ok(cpus)
}

/// Events a CPU's buffer lost: overwritten (`overrun`) or refused (`dropped events`).
fn cpu_overrun(instance: &Path, cpu: u32) -> u64 {
    let Ok(text) = fs::read_to_string(instance.join(format!("per_cpu/cpu{cpu}/stats"))) else {
        return 0;
    };
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| matches!(k.trim(), "overrun" | "dropped events"))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

/// Instances a killed recorder left (`vabc-PID` whose process is gone).
fn remove_stale_instances(instances: &Path) {
    let Ok(entries) = fs::read_dir(instances) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("vabc-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir(entry.path());
        }
    }
}

/// Decodes arbitrary bytes as ring-buffer pages of one `block_bio_queue` event type
/// (the fuzz target's body).
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_pages(data: &[u8]) -> Vec<Event> {
    let text = "ID: 7\nformat:\n\tfield:dev_t dev;\toffset:8;\tsize:4;\tsigned:0;\n\tfield:sector_t sector;\toffset:16;\tsize:8;\tsigned:0;\n\tfield:unsigned int nr_sector;\toffset:24;\tsize:4;\tsigned:0;\n\tfield:char rwbs[10];\toffset:28;\tsize:10;\tsigned:0;\n";
    let mut out = Vec::new();
    let Ok(format) = parse_format(text, Path::new("fuzz")) else {
        return out;
    };
    let Ok(dec) = Decoder::new("block_bio_queue", Action::Queue, &format, Path::new("fuzz")) else {
        return out;
    };
    let decoders = HashMap::from([(7u16, dec)]);
    let _ = decode_pages(
        data,
        4096,
        0,
        &decoders,
        &mut out,
        &mut PageStats::default(),
        Path::new("fuzz"),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUEUE_FORMAT: &str = "name: block_bio_queue\nID: 2097\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\n\tfield:dev_t dev;\toffset:8;\tsize:4;\tsigned:0;\n\tfield:sector_t sector;\toffset:16;\tsize:8;\tsigned:0;\n\tfield:unsigned int nr_sector;\toffset:24;\tsize:4;\tsigned:0;\n\tfield:char rwbs[10];\toffset:28;\tsize:10;\tsigned:0;\n\tfield:char comm[16];\toffset:38;\tsize:16;\tsigned:0;\n";

    fn queue_record(dev: u32, sector: u64, n: u32, rwbs: &str) -> Vec<u8> {
        let mut r = vec![0u8; 56];
        r[0..2].copy_from_slice(&2097u16.to_le_bytes());
        r[4..8].copy_from_slice(&77i32.to_le_bytes());
        r[8..12].copy_from_slice(&dev.to_le_bytes());
        r[16..24].copy_from_slice(&sector.to_le_bytes());
        r[24..28].copy_from_slice(&n.to_le_bytes());
        r[28..28 + rwbs.len()].copy_from_slice(rwbs.as_bytes());
        r
    }

    #[test]
    fn format_files_are_parsed() {
        let f = parse_format(QUEUE_FORMAT, Path::new("format")).unwrap();
        assert_eq!(f.id, 2097);
        assert_eq!(
            f.fields["rwbs"],
            Field {
                offset: 28,
                size: 10
            }
        );
        assert_eq!(
            f.fields["sector"],
            Field {
                offset: 16,
                size: 8
            }
        );
        assert!(parse_format("format:\n", Path::new("f")).is_err());
    }

    #[test]
    fn pages_decode_with_deltas_extends_and_padding() {
        let f = parse_format(QUEUE_FORMAT, Path::new("format")).unwrap();
        let dec = Decoder::new("block_bio_queue", Action::Queue, &f, Path::new("format")).unwrap();
        let decoders = HashMap::from([(2097u16, dec)]);
        let mut data = Vec::new();
        // A data event of 56 bytes: type_len 14, delta 5.
        data.extend_from_slice(&((5u32 << 5) | 14).to_le_bytes());
        data.extend_from_slice(&queue_record(7 << 20 | 2, 100, 8, "RS"));
        // A time extend of 1<<27 + 3, then an event with delta 2 as a type_len 0 record.
        data.extend_from_slice(&((3u32 << 5) | TIME_EXTEND).to_le_bytes());
        data.extend_from_slice(&1u32.to_le_bytes());
        data.extend_from_slice(&(2u32 << 5).to_le_bytes());
        data.extend_from_slice(&(56u32 + 4).to_le_bytes());
        data.extend_from_slice(&queue_record(7 << 20 | 2, 200, 16, "FWFS"));
        // The rest of the page unused.
        data.extend_from_slice(&PADDING.to_le_bytes());
        let mut page = vec![0u8; 4096];
        page[0..8].copy_from_slice(&1000u64.to_le_bytes());
        page[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        page[16..16 + data.len()].copy_from_slice(&data);
        let mut out = Vec::new();
        let mut stats = PageStats::default();
        decode_pages(
            &page,
            4096,
            1,
            &decoders,
            &mut out,
            &mut stats,
            Path::new("p"),
        )
        .unwrap();
        assert_eq!(stats.events, 2);
        assert_eq!(out[0].time_ns, 1005);
        assert_eq!(out[0].dev, Dev { major: 7, minor: 2 });
        assert_eq!((out[0].sector, out[0].bytes, out[0].pid), (100, 4096, 77));
        assert_eq!(out[0].flags, cat::READ | cat::SYNC);
        assert_eq!(out[1].time_ns, 1005 + 3 + (1 << 27) + 2);
        assert_eq!(out[1].flags, cat::FLUSH | cat::WRITE | cat::FUA | cat::SYNC);
        assert_eq!(out[1].rwbs(), "FWFS");
        // A commit length past the page is refused with the offset.
        page[8..16].copy_from_slice(&5000u64.to_le_bytes());
        let err = decode_pages(
            &page,
            4096,
            1,
            &decoders,
            &mut out,
            &mut stats,
            Path::new("p"),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "p: offset 8: page commit length runs past the page"
        );
    }
}
