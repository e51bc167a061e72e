//! The log's on-disk form, as the kernel's `log-writes` target writes it
//! (drivers/md/dm-log-writes.c): a super block in the first sector, then one entry per
//! logged request, each a header sector followed by the request's data.
//!
//! Sizes and sector numbers are in the logged device's logical sectors (`sectorsize`
//! in the super block: 512 or 4096), which this module turns into bytes. The kernel
//! rewrites the super block's entry count only after a FUA write or a mark, and when
//! the target is removed (after logging a `dm-log-writes-end` mark), so a log read
//! after a clean `dmsetup remove` is complete.

use std::fs::File;
use std::path::{Path, PathBuf};

use vabc_io::ReadAt;
use zerocopy::byteorder::{LE, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{Error, Result};

/// "jsfwshr" (`WRITE_LOG_MAGIC`).
pub const MAGIC: u64 = 0x006a_7366_7773_6872;
/// The only version the kernel writes.
pub const VERSION: u64 = 1;
/// The mark the kernel logs when the target is removed.
pub const END_MARK: &str = "dm-log-writes-end";

/// The request carried REQ_PREFLUSH.
pub const FLAG_FLUSH: u64 = 1 << 0;
/// The request carried REQ_FUA.
pub const FLAG_FUA: u64 = 1 << 1;
/// A discard.
pub const FLAG_DISCARD: u64 = 1 << 2;
/// A mark (`dmsetup message DEV 0 mark NAME`).
pub const FLAG_MARK: u64 = 1 << 3;
/// The request carried REQ_META.
pub const FLAG_METADATA: u64 = 1 << 4;
const KNOWN_FLAGS: u64 = FLAG_FLUSH | FLAG_FUA | FLAG_DISCARD | FLAG_MARK | FLAG_METADATA;

/// `struct log_write_super`.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct Super {
    pub magic: U64<LE>,
    pub version: U64<LE>,
    pub nr_entries: U64<LE>,
    pub sectorsize: U32<LE>,
}

/// `struct log_write_entry`.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct EntryHeader {
    pub sector: U64<LE>,
    pub nr_sectors: U64<LE>,
    pub flags: U64<LE>,
    pub data_len: U64<LE>,
}

/// What a logged request did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `len` bytes written at byte `offset` of the device; the data is at byte
    /// `data_at` of the log.
    Write { offset: u64, len: u64, data_at: u64 },
    /// `len` bytes from byte `offset` discarded.
    Discard { offset: u64, len: u64 },
    /// A flush without data.
    Flush,
    /// A mark the tester logged.
    Mark(String),
}

/// One logged request, in the order the device completed them (a write without FUA
/// is logged when the next flush is issued: the log holds what a flush made durable
/// in front of that flush).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub op: Op,
    /// REQ_PREFLUSH: every write completed before this request was issued is durable
    /// once it completes.
    pub flush: bool,
    /// REQ_FUA: this write was durable when it completed.
    pub fua: bool,
    /// REQ_META, as the writer flagged it.
    pub metadata: bool,
    /// Byte offset of the entry's header in the log.
    pub at: u64,
}

impl Entry {
    /// The device bytes the entry changes: (offset, length), for writes and discards.
    pub fn extent(&self) -> Option<(u64, u64)> {
        match self.op {
            Op::Write { offset, len, .. } | Op::Discard { offset, len } => Some((offset, len)),
            Op::Flush | Op::Mark(_) => None,
        }
    }
}

/// A dm-log-writes log, its entries indexed (their data stays in the log).
#[derive(Debug, Clone)]
pub struct Log {
    path: PathBuf,
    sector_size: u32,
    entries: Vec<Entry>,
}

impl Log {
    /// Reads the log in the file or device at `path`.
    pub fn open(path: &Path) -> Result<Log> {
        let file = File::open(path).map_err(vabc_io::on("open", path))?;
        let len = vabc_io::size_of(&file).map_err(vabc_io::on("find the size of", path))?;
        Log::read(&file, len, path)
    }

    /// Reads a log of `len` bytes from `src`; `path` names it in errors.
    pub fn read(src: &(impl ReadAt + ?Sized), len: u64, path: &Path) -> Result<Log> {
        let bad = |offset: u64, what: String| Error::Format {
            path: path.to_path_buf(),
            offset,
            what,
        };
        let mut head = [0u8; size_of::<Super>()];
        if len < head.len() as u64 {
            return Err(bad(
                0,
                format!("{len} bytes: too short for a log's super block"),
            ));
        }
        src.read_exact_at(&mut head, 0)
            .map_err(vabc_io::at("read", path, 0))?;
        let sup = Super::read_from_bytes(&head).map_err(|_| bad(0, "super block".into()))?;
        if sup.magic.get() != MAGIC {
            return Err(bad(
                0,
                format!("magic {:#x}: not a dm-log-writes log", sup.magic.get()),
            ));
        }
        if sup.version.get() != VERSION {
            return Err(bad(
                8,
                format!(
                    "version {}; this reads version {VERSION}",
                    sup.version.get()
                ),
            ));
        }
        let sector = sup.sectorsize.get();
        if !(512..=65536).contains(&sector) || !sector.is_power_of_two() {
            return Err(bad(
                24,
                format!("sector size {sector}: not a power of two from 512 to 65536"),
            ));
        }
        let sector_bytes = u64::from(sector);
        let count = sup.nr_entries.get();
        // Each entry takes a sector at least: a count the log cannot hold is a lie,
        // not a reason to reserve memory for it.
        if count > len / sector_bytes {
            return Err(bad(16, format!("{count} entries in a log of {len} bytes")));
        }
        let mut entries = Vec::with_capacity(count as usize);
        let mut at = sector_bytes;
        let mut sector_buf = vec![0u8; sector as usize];
        for index in 0..count {
            if at.checked_add(sector_bytes).is_none_or(|end| end > len) {
                return Err(bad(
                    at,
                    format!("entry {index}: past the log's end ({len} bytes)"),
                ));
            }
            src.read_exact_at(&mut sector_buf, at)
                .map_err(vabc_io::at("read", path, at))?;
            let (header, rest) = EntryHeader::read_from_prefix(&sector_buf)
                .map_err(|_| bad(at, format!("entry {index}: header")))?;
            let entry = decode(&header, rest, at, sector_bytes)
                .map_err(|what| bad(at, format!("entry {index}: {what}")))?;
            at += sector_bytes;
            if let Op::Write { len: data, .. } = entry.op {
                at = at
                    .checked_add(data)
                    .filter(|end| *end <= len)
                    .ok_or_else(|| {
                        bad(at, format!("entry {index}: its {data} bytes of data pass the log's end ({len} bytes)"))
                    })?;
            }
            entries.push(entry);
        }
        Ok(Log {
            path: path.to_path_buf(),
            sector_size: sector,
            entries,
        })
    }

    /// The log's file or device.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The logged device's logical sector size.
    pub fn sector_size(&self) -> u32 {
        self.sector_size
    }

    /// The entries, in the log's order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The index of the first mark named `name`.
    pub fn mark(&self, name: &str) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| matches!(&e.op, Op::Mark(m) if m == name))
    }

    /// The device size the log needs: the end of its furthest write or discard.
    pub fn device_len(&self) -> u64 {
        self.entries
            .iter()
            .filter_map(Entry::extent)
            .map(|(offset, len)| offset + len)
            .max()
            .unwrap_or(0)
    }
}

/// One entry from its header and the rest of its header sector.
fn decode(h: &EntryHeader, rest: &[u8], at: u64, sector: u64) -> Result<Entry, String> {
    let flags = h.flags.get();
    if flags & !KNOWN_FLAGS != 0 {
        return Err(format!("unknown flags {flags:#x}"));
    }
    let bytes = |sectors: u64| {
        sectors
            .checked_mul(sector)
            .ok_or_else(|| format!("{sectors} sectors overflow"))
    };
    let offset = bytes(h.sector.get())?;
    let len = bytes(h.nr_sectors.get())?;
    offset.checked_add(len).ok_or_else(|| {
        format!(
            "sectors {} + {} overflow",
            h.sector.get(),
            h.nr_sectors.get()
        )
    })?;
    let data_len = h.data_len.get();
    let op = if flags & FLAG_MARK != 0 {
        let name = usize::try_from(data_len)
            .ok()
            .and_then(|n| rest.get(..n))
            .ok_or_else(|| format!("a mark of {data_len} bytes in a {sector}-byte sector"))?;
        Op::Mark(String::from_utf8_lossy(name).into_owned())
    } else if data_len != 0 {
        // The kernel logs inline data only for marks.
        return Err(format!("{data_len} bytes of inline data without a mark"));
    } else if flags & FLAG_DISCARD != 0 {
        Op::Discard { offset, len }
    } else if len == 0 {
        if flags & FLAG_FLUSH == 0 {
            return Err("neither data, a flush, a discard nor a mark".into());
        }
        Op::Flush
    } else {
        Op::Write {
            offset,
            len,
            data_at: at + sector,
        }
    };
    Ok(Entry {
        op,
        flush: flags & FLAG_FLUSH != 0,
        fua: flags & FLAG_FUA != 0,
        metadata: flags & FLAG_METADATA != 0,
        at,
    })
}
