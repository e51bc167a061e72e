//! blktrace's binary files: one per CPU (`NAME.blktrace.CPU`) as `blktrace` writes
//! them, or one merged file (`blkparse -d`). Each record is a 48-byte
//! `struct blk_io_trace` in the recording machine's byte order (its magic tells
//! which), followed by `pdu_len` bytes of payload.

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use zerocopy::byteorder::{BE, ByteOrder, LE, U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{Action, Dev, Error, Event, Extra, Result, cat};

const MAGIC: u32 = 0x6561_7400;
const VERSION: u32 = 0x07;
const RECORD: usize = 48;

#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C, packed)]
struct Record<O: ByteOrder> {
    magic: U32<O>,
    sequence: U32<O>,
    time: U64<O>,
    sector: U64<O>,
    bytes: U32<O>,
    action: U32<O>,
    pid: U32<O>,
    device: U32<O>,
    cpu: U32<O>,
    error: U16<O>,
    pdu_len: U16<O>,
}

/// A remap's payload (`struct blk_io_trace_remap`, big-endian whatever the host).
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct RemapPdu {
    device_from: U32<BE>,
    device_to: U32<BE>,
    sector_from: U64<BE>,
}

/// What reading a trace found besides the events.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReadStats {
    pub files: Vec<PathBuf>,
    pub records: u64,
    /// Notify records (process names, timestamps, messages) and unknown actions.
    pub skipped: u64,
}

/// The files of a trace named by `input`: a file, a `DIR/NAME` prefix of
/// `NAME.blktrace.N` files, or a folder holding one trace's files.
pub fn trace_files(input: &Path) -> Result<Vec<PathBuf>> {
    if input.is_file() {
        return Ok(vec![input.to_path_buf()]);
    }
    let (dir, name) = if input.is_dir() {
        (input.to_path_buf(), None)
    } else {
        let dir = match input.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = input.file_name().map(|n| n.to_string_lossy().into_owned());
        (dir, name)
    };
    let entries = fs::read_dir(&dir).map_err(|e| Error::io("list", &dir, e))?;
    let mut found: Vec<(String, u32, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some((stem, cpu)) = file.rsplit_once(".blktrace.") else {
            continue;
        };
        let Ok(cpu) = cpu.parse::<u32>() else {
            continue;
        };
        if name.as_deref().is_none_or(|n| n == stem) {
            found.push((stem.to_string(), cpu, entry.path()));
        }
    }
    found.sort();
    let names: std::collections::BTreeSet<&str> = found.iter().map(|f| f.0.as_str()).collect();
    match names.len() {
        0 => Err(Error::Input(format!(
            "{}: no blktrace files (NAME.blktrace.CPU) found",
            input.display()
        ))),
        1 => Ok(found.into_iter().map(|f| f.2).collect()),
        _ => Err(Error::Input(format!(
            "{}: holds several traces ({}): name one as DIR/NAME",
            input.display(),
            names.into_iter().collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Reads a trace (see [`trace_files`]) into one list ordered by time.
pub fn read_trace(input: &Path) -> Result<(Vec<Event>, ReadStats)> {
    let files = trace_files(input)?;
    let mut events = Vec::new();
    let mut stats = ReadStats {
        files: files.clone(),
        ..ReadStats::default()
    };
    for file in &files {
        let data = fs::read(file).map_err(|e| Error::io("read", file, e))?;
        parse(&data, file, &mut events, &mut stats)?;
    }
    // Per-CPU files are each in time order; a stable sort keeps a CPU's order for
    // equal times.
    events.sort_by_key(|e| e.time_ns);
    Ok((events, stats))
}

/// Parses one file's bytes, appending its events.
pub fn parse(data: &[u8], path: &Path, out: &mut Vec<Event>, stats: &mut ReadStats) -> Result<()> {
    let bad = |offset: usize, what: String| Error::Format {
        path: path.to_path_buf(),
        offset: offset as u64,
        what,
    };
    let mut off = 0;
    while off < data.len() {
        let Some(head) = data.get(off..off + RECORD) else {
            return Err(bad(
                off,
                format!("truncated record: {} of {RECORD} bytes", data.len() - off),
            ));
        };
        let rec = decode(head).ok_or_else(|| {
            bad(
                off,
                format!(
                    "not a blktrace record (magic {:#010x})",
                    u32::from_le_bytes([head[0], head[1], head[2], head[3]])
                ),
            )
        })?;
        let pdu_start = off + RECORD;
        let pdu = data
            .get(pdu_start..pdu_start + usize::from(rec.pdu_len))
            .ok_or_else(|| {
                bad(
                    off,
                    format!(
                        "truncated record: its payload of {} bytes runs past the end",
                        rec.pdu_len
                    ),
                )
            })?;
        stats.records += 1;
        match to_event(&rec, pdu) {
            Some(ev) => out.push(ev),
            None => stats.skipped += 1,
        }
        off = pdu_start + pdu.len();
    }
    Ok(())
}

/// A record's fields in host order.
struct Fields {
    time: u64,
    sector: u64,
    bytes: u32,
    action: u32,
    pid: u32,
    device: u32,
    cpu: u32,
    error: u16,
    pdu_len: u16,
}

fn fields<O: ByteOrder>(r: &Record<O>) -> Fields {
    Fields {
        time: r.time.get(),
        sector: r.sector.get(),
        bytes: r.bytes.get(),
        action: r.action.get(),
        pid: r.pid.get(),
        device: r.device.get(),
        cpu: r.cpu.get(),
        error: r.error.get(),
        pdu_len: r.pdu_len.get(),
    }
}

fn magic_ok(magic: u32) -> bool {
    magic & 0xffff_ff00 == MAGIC && magic & 0xff == VERSION
}

/// The record in either byte order.
fn decode(head: &[u8]) -> Option<Fields> {
    let le = Record::<LE>::ref_from_bytes(head).ok()?;
    if magic_ok(le.magic.get()) {
        return Some(fields(le));
    }
    let be = Record::<BE>::ref_from_bytes(head).ok()?;
    magic_ok(be.magic.get()).then(|| fields(be))
}

fn to_event(r: &Fields, pdu: &[u8]) -> Option<Event> {
    let flags = r.action >> 16;
    if flags & cat::NOTIFY != 0 {
        return None;
    }
    let action = Action::from_code((r.action & 0xffff) as u16)?;
    let extra = match action {
        Action::Remap => RemapPdu::ref_from_bytes(pdu)
            .ok()
            .map_or(Extra::None, |p| Extra::Remap {
                from_dev: Dev::from_kernel(p.device_from.get()),
                from_sector: p.sector_from.get(),
            }),
        Action::Split => <[u8; 8]>::try_from(pdu).map_or(Extra::None, |b| Extra::Split {
            new_sector: u64::from_be_bytes(b),
        }),
        _ => Extra::None,
    };
    Some(Event {
        time_ns: r.time,
        dev: Dev::from_kernel(r.device),
        action,
        flags,
        sector: r.sector,
        bytes: r.bytes,
        pid: r.pid,
        cpu: r.cpu,
        error: r.error,
        extra,
    })
}

/// Encodes one event as blktrace does on a little-endian host.
pub fn encode(ev: &Event, sequence: u32, out: &mut Vec<u8>) {
    let mut pdu = Vec::new();
    match ev.extra {
        Extra::Remap {
            from_dev,
            from_sector,
        } => pdu.extend_from_slice(
            RemapPdu {
                device_from: U32::new(from_dev.to_kernel()),
                device_to: U32::new(ev.dev.to_kernel()),
                sector_from: U64::new(from_sector),
            }
            .as_bytes(),
        ),
        Extra::Split { new_sector } => pdu.extend_from_slice(&new_sector.to_be_bytes()),
        Extra::None => {}
    }
    let rec = Record::<LE> {
        magic: U32::new(MAGIC | VERSION),
        sequence: U32::new(sequence),
        time: U64::new(ev.time_ns),
        sector: U64::new(ev.sector),
        bytes: U32::new(ev.bytes),
        action: U32::new(u32::from(ev.action as u16) | ((ev.flags | ev.action.category()) << 16)),
        pid: U32::new(ev.pid),
        device: U32::new(ev.dev.to_kernel()),
        cpu: U32::new(ev.cpu),
        error: U16::new(ev.error),
        pdu_len: U16::new(pdu.len() as u16),
    };
    out.extend_from_slice(rec.as_bytes());
    out.extend_from_slice(&pdu);
}

/// Writes one CPU's events as `DIR/NAME.blktrace.CPU` (through a temporary file and
/// a rename, so a reader never sees half a file).
pub fn write_cpu_file(dir: &Path, name: &str, cpu: u32, events: &[Event]) -> Result<PathBuf> {
    let path = dir.join(format!("{name}.blktrace.{cpu}"));
    let tmp = dir.join(format!(".{name}.blktrace.{cpu}.tmp"));
    let file = fs::File::create(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
    let mut w = BufWriter::new(file);
    let mut buf = Vec::with_capacity(64);
    for (i, ev) in events.iter().enumerate() {
        buf.clear();
        encode(ev, i as u32 + 1, &mut buf);
        w.write_all(&buf).map_err(|e| Error::io("write", &tmp, e))?;
    }
    w.into_inner()
        .map_err(|e| Error::io("write", &tmp, e.into_error()))?
        .sync_all()
        .map_err(|e| Error::io("sync", &tmp, e))?;
    fs::rename(&tmp, &path).map_err(|e| Error::io("rename the finished trace to", &path, e))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(action: Action, time_ns: u64, extra: Extra) -> Event {
        Event {
            time_ns,
            dev: Dev { major: 7, minor: 3 },
            action,
            flags: cat::READ | cat::SYNC,
            sector: 1234,
            bytes: 4096,
            pid: 42,
            cpu: 1,
            error: 0,
            extra,
        }
    }

    #[test]
    fn records_round_trip() {
        let events = [
            ev(Action::Queue, 10, Extra::None),
            ev(Action::Split, 11, Extra::Split { new_sector: 1240 }),
            ev(
                Action::Remap,
                12,
                Extra::Remap {
                    from_dev: Dev {
                        major: 253,
                        minor: 1,
                    },
                    from_sector: 99,
                },
            ),
            ev(Action::Complete, 13, Extra::None),
        ];
        let mut buf = Vec::new();
        for (i, e) in events.iter().enumerate() {
            encode(e, i as u32, &mut buf);
        }
        let mut out = Vec::new();
        let mut stats = ReadStats::default();
        parse(&buf, Path::new("t"), &mut out, &mut stats).unwrap();
        // The category bit of the action comes back in the flags.
        for (a, b) in events.iter().zip(&out) {
            assert_eq!(
                Event {
                    flags: a.flags | a.action.category(),
                    ..*a
                },
                *b
            );
        }
    }

    #[test]
    fn truncated_and_foreign_files_name_the_offset() {
        let mut buf = Vec::new();
        encode(&ev(Action::Queue, 1, Extra::None), 1, &mut buf);
        encode(&ev(Action::Queue, 2, Extra::None), 2, &mut buf);
        let mut out = Vec::new();
        let mut stats = ReadStats::default();
        let err = parse(&buf[..70], Path::new("t.blktrace.0"), &mut out, &mut stats).unwrap_err();
        assert_eq!(
            err.to_string(),
            "t.blktrace.0: offset 48: truncated record: 22 of 48 bytes"
        );
        let err = parse(
            b"this is not a trace at all, it is text of some length\n",
            Path::new("x"),
            &mut out,
            &mut stats,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("x: offset 0: not a blktrace record (magic"),
            "{err}"
        );
    }

    #[test]
    fn big_endian_records_are_read() {
        let e = ev(Action::Issue, 5, Extra::None);
        let rec = Record::<BE> {
            magic: U32::new(MAGIC | VERSION),
            sequence: U32::new(1),
            time: U64::new(e.time_ns),
            sector: U64::new(e.sector),
            bytes: U32::new(e.bytes),
            action: U32::new(7 | ((e.flags | cat::ISSUE) << 16)),
            pid: U32::new(e.pid),
            device: U32::new(e.dev.to_kernel()),
            cpu: U32::new(e.cpu),
            error: U16::new(0),
            pdu_len: U16::new(0),
        };
        let mut out = Vec::new();
        parse(
            rec.as_bytes(),
            Path::new("be"),
            &mut out,
            &mut ReadStats::default(),
        )
        .unwrap();
        assert_eq!(
            out,
            vec![Event {
                flags: e.flags | cat::ISSUE,
                ..e
            }]
        );
    }
}
