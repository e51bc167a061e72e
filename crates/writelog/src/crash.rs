//! The disk states a power cut could leave, made from a log.
//!
//! A cut after the first `acknowledged` entries leaves on the media:
//! - every write before the last flush among them (the flush made them durable);
//! - every FUA write among them (durable when it completed);
//! - of the other writes after that flush, any subset, each whole or torn into
//!   atomic units: a volatile write cache may have written back any of them, in any
//!   order, or part of one. The unit is what the device writes all or nothing on a
//!   power loss: its physical sector, 4 KiB ([`ATOMIC_UNIT`]) on Advanced Format
//!   disks and flash storage. At 512 bytes a cut can tear ext4's 1 KiB superblock
//!   itself, which the file system does not survive (its checksum fails before
//!   the journal can repair it).
//!
//! Applying what reached the media in the log's order gives every outcome a reordering
//! can: for each sector, the newest write that reached the media wins, and dropping
//! the newer ones leaves an older one or the sector's old bytes. A discard's sectors
//! read back as zeros here (a device may also keep the old bytes; nothing vabc writes
//! depends on either).

use std::path::Path;

use vabc_io::{ReadAt, WriteAt};

use crate::Result;
use crate::log::{Entry, Log, Op};

/// Where an entry that changes the device starts (0 for one that does not).
fn entry_offset(e: &Entry) -> u64 {
    e.extent().map_or(0, |(offset, _)| offset)
}

/// The atomic write unit the states assume unless told otherwise: 4 KiB, the
/// physical sector of Advanced Format disks and the page of eMMC and UFS storage.
pub const ATOMIC_UNIT: u64 = 4096;

/// A part of one logged write or discard that reached the media.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The entry's index in the log.
    pub entry: usize,
    /// Bytes into the entry's extent.
    pub skip: u64,
    pub len: u64,
}

/// A disk state a power cut could leave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrashState {
    /// The entries the device had completed when the power went: `[0, acknowledged)`.
    pub acknowledged: usize,
    /// The entries a flush had made durable: `[0, durable)`.
    pub durable: usize,
    /// What reached the media, in the order it is applied.
    pub pieces: Vec<Piece>,
    /// Writes after the last flush that were lost whole.
    pub dropped: usize,
    /// Writes after the last flush that reached the media in part.
    pub torn: usize,
}

impl CrashState {
    /// Whether everything acknowledged reached the media.
    pub fn is_clean(&self) -> bool {
        self.dropped == 0 && self.torn == 0
    }
}

impl Log {
    /// The points where everything acknowledged was durable: after each flush, each
    /// FUA write, and at the log's end (where the target was removed cleanly). Each is
    /// an `acknowledged` count for [`Log::clean_state`].
    pub fn durable_points(&self) -> Vec<usize> {
        let mut points: Vec<usize> = self
            .entries()
            .iter()
            .enumerate()
            .filter(|(_, e)| e.flush || e.fua)
            .map(|(i, _)| i + 1)
            .collect();
        if points.last() != Some(&self.entries().len()) {
            points.push(self.entries().len());
        }
        points
    }

    /// The state where the first `acknowledged` entries all reached the media.
    pub fn clean_state(&self, acknowledged: usize) -> CrashState {
        let acknowledged = acknowledged.min(self.entries().len());
        CrashState {
            acknowledged,
            durable: acknowledged,
            pieces: (0..acknowledged).filter_map(|i| self.whole(i)).collect(),
            dropped: 0,
            torn: 0,
        }
    }

    /// A random state of a cut after a random number of entries: the writes after
    /// the last flush each kept whole (half the time), lost (a quarter) or torn
    /// into units of `unit` bytes (rounded up to a multiple of the log's sector).
    pub fn random_state(&self, unit: u64, rng: &mut fastrand::Rng) -> CrashState {
        let acknowledged = rng.usize(0..=self.entries().len());
        self.random_state_at(acknowledged, unit, rng)
    }

    /// A random state of a cut after the first `acknowledged` entries, writes torn
    /// into units of `unit` bytes.
    pub fn random_state_at(
        &self,
        acknowledged: usize,
        unit: u64,
        rng: &mut fastrand::Rng,
    ) -> CrashState {
        let sector = u64::from(self.sector_size());
        let unit = unit.max(sector).div_ceil(sector) * sector;
        let entries = self.entries();
        let acknowledged = acknowledged.min(entries.len());
        // Everything before the last flush is durable; the flush entry itself, if it
        // carries data, is as volatile as any write after it unless it is FUA.
        let durable = entries[..acknowledged]
            .iter()
            .rposition(|e| e.flush)
            .unwrap_or(0);
        let mut state = CrashState {
            acknowledged,
            durable,
            pieces: (0..durable).filter_map(|i| self.whole(i)).collect(),
            dropped: 0,
            torn: 0,
        };
        for (i, entry) in entries.iter().enumerate().take(acknowledged).skip(durable) {
            let Some(whole) = self.whole(i) else { continue };
            if entry.fua {
                state.pieces.push(whole);
                continue;
            }
            match rng.u8(0..4) {
                0 | 1 => state.pieces.push(whole),
                2 => state.dropped += 1,
                _ => {
                    // Units counted from the device's start: a write's edges need
                    // not be aligned to them.
                    let (offset, len) = (entry_offset(entry), whole.len);
                    let first = offset / unit;
                    let last = (offset + len).div_ceil(unit);
                    if last - first < 2 {
                        state.dropped += 1;
                        continue;
                    }
                    state.torn += 1;
                    // A random subset of its units, as runs.
                    let mut run: Option<u64> = None;
                    for u in first..=last {
                        let keep = u < last && rng.bool();
                        match (keep, run) {
                            (true, None) => run = Some(u),
                            (false, Some(start)) => {
                                let from = (start * unit).max(offset);
                                let to = (u * unit).min(offset + len);
                                state.pieces.push(Piece {
                                    entry: i,
                                    skip: from - offset,
                                    len: to - from,
                                });
                                run = None;
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        state
    }

    /// Applies `state` to `device` (the device as it was when logging began), reading
    /// the written data from the log in `log`; `device_path` names the device in
    /// errors.
    pub fn apply(
        &self,
        state: &CrashState,
        log: &(impl ReadAt + ?Sized),
        device: &mut (impl WriteAt + ?Sized),
        device_path: &Path,
    ) -> Result<()> {
        const CHUNK: u64 = 1 << 20;
        let mut buf = Vec::new();
        for piece in &state.pieces {
            let entry = &self.entries()[piece.entry];
            let Some((offset, _)) = entry.extent() else {
                continue;
            };
            let mut done = 0;
            while done < piece.len {
                let n = (piece.len - done).min(CHUNK);
                buf.resize(n as usize, 0);
                let at = offset + piece.skip + done;
                match entry.op {
                    Op::Write { data_at, .. } => {
                        let from = data_at + piece.skip + done;
                        log.read_exact_at(&mut buf, from).map_err(vabc_io::at(
                            "read",
                            self.path(),
                            from,
                        ))?;
                    }
                    _ => buf.fill(0),
                }
                device
                    .write_all_at(&buf, at)
                    .map_err(vabc_io::at("write", device_path, at))?;
                done += n;
            }
        }
        Ok(())
    }

    /// Entry `i` whole, when it changes the device.
    fn whole(&self, i: usize) -> Option<Piece> {
        let (_, len) = self.entries()[i].extent()?;
        Some(Piece {
            entry: i,
            skip: 0,
            len,
        })
    }
}
