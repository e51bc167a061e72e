//! dm-log-writes logs, and the disk states a power cut could leave made from them.
//!
//! The kernel's `log-writes` device-mapper target (the one xfstests' crash tests use)
//! records every write that reaches a device, with the flushes and FUA writes that
//! made them durable, on a second device. [`Log`] reads such a log;
//! [`Log::durable_points`] and [`Log::clean_state`] give the states at each point
//! where everything acknowledged was durable, and [`Log::random_state`] the states
//! in between, where a volatile write cache lost, reordered or tore the writes it
//! still held; [`Log::apply`] writes one onto a copy of the device as it was when
//! logging began. A crash test then runs the recovery on each state and checks what
//! it finds.
//!
//! Written here because no maintained crate reads the format, and xfstests'
//! `replay-log` (C) replays only whole prefixes of the log: it has no states where
//! unflushed writes were lost or torn.
//!
//! ```
//! # fn main() -> Result<(), writelog::Error> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let path = dir.path().join("log");
//! # std::fs::write(&path, writelog::fuzzing::sample_log()).unwrap();
//! let log = writelog::Log::open(&path)?;
//! let mut rng = fastrand::Rng::with_seed(7);
//! let mut device = vec![0u8; log.device_len() as usize];
//! let state = log.random_state(writelog::ATOMIC_UNIT, &mut rng);
//! log.apply(&state, &std::fs::read(&path).unwrap(), &mut device, "device".as_ref())?;
//! # Ok(())
//! # }
//! ```

mod crash;
mod log;

use std::path::PathBuf;

pub use crash::{ATOMIC_UNIT, CrashState, Piece};
pub use log::{
    END_MARK, Entry, EntryHeader, FLAG_DISCARD, FLAG_FLUSH, FLAG_FUA, FLAG_MARK, FLAG_METADATA,
    Log, MAGIC, Op, Super, VERSION,
};

/// What reading a log or applying a state can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    /// The log is not one the kernel wrote.
    #[error("{}: at offset {offset}: {what}", .path.display())]
    Format {
        path: PathBuf,
        offset: u64,
        what: String,
    },
}

/// A result whose error is an [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Entry points and sample logs for the fuzz target and the tests.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    use zerocopy::IntoBytes;

    use crate::log::{EntryHeader, FLAG_FLUSH, FLAG_FUA, FLAG_MARK, MAGIC, Super, VERSION};

    /// Reads arbitrary bytes as a log and applies a few states of what it read.
    pub fn exercise_log(data: &[u8]) {
        let Ok(log) = crate::Log::read(data, data.len() as u64, "fuzz".as_ref()) else {
            return;
        };
        // Bounded: a crafted log may name a device of exabytes.
        if log.device_len() > 64 << 20 {
            return;
        }
        let mut device = vec![0u8; log.device_len() as usize];
        let mut rng = fastrand::Rng::with_seed(data.len() as u64);
        for _ in 0..4 {
            let state = log.random_state(crate::ATOMIC_UNIT, &mut rng);
            let _ = log.apply(&state, data, &mut device, "fuzz".as_ref());
        }
        for point in log.durable_points() {
            let _ = log.apply(&log.clean_state(point), data, &mut device, "fuzz".as_ref());
        }
    }

    /// A log builder: entries as the kernel lays them out.
    pub struct Builder {
        sector: u32,
        entries: u64,
        body: Vec<u8>,
    }

    impl Builder {
        /// An empty log of a device with `sector`-byte sectors.
        pub fn new(sector: u32) -> Builder {
            Builder {
                sector,
                entries: 0,
                body: Vec::new(),
            }
        }

        fn header(&mut self, sector: u64, sectors: u64, flags: u64, data_len: u64, inline: &[u8]) {
            let h = EntryHeader {
                sector: sector.into(),
                nr_sectors: sectors.into(),
                flags: flags.into(),
                data_len: data_len.into(),
            };
            let start = self.body.len();
            self.body.extend_from_slice(h.as_bytes());
            self.body.extend_from_slice(inline);
            self.body.resize(start + self.sector as usize, 0);
            self.entries += 1;
        }

        /// A write of `data` (whole sectors) at sector `sector`, with `flags`
        /// (FLAG_FLUSH, FLAG_FUA, FLAG_METADATA).
        pub fn write(mut self, sector: u64, data: &[u8], flags: u64) -> Builder {
            let sectors = data.len() as u64 / u64::from(self.sector);
            self.header(sector, sectors, flags, 0, &[]);
            self.body.extend_from_slice(data);
            self
        }

        /// An empty flush.
        pub fn flush(mut self) -> Builder {
            self.header(0, 0, FLAG_FLUSH, 0, &[]);
            self
        }

        /// A discard of `sectors` sectors at `sector`.
        pub fn discard(mut self, sector: u64, sectors: u64) -> Builder {
            self.header(sector, sectors, crate::log::FLAG_DISCARD, 0, &[]);
            self
        }

        /// A mark.
        pub fn mark(mut self, name: &str) -> Builder {
            self.header(0, 0, FLAG_MARK, name.len() as u64, name.as_bytes());
            self
        }

        /// The log's bytes.
        pub fn build(self) -> Vec<u8> {
            let sup = Super {
                magic: MAGIC.into(),
                version: VERSION.into(),
                nr_entries: self.entries.into(),
                sectorsize: self.sector.into(),
            };
            let mut out = sup.as_bytes().to_vec();
            out.resize(self.sector as usize, 0);
            out.extend_from_slice(&self.body);
            out
        }
    }

    /// A small log: two flushed writes, a FUA write, unflushed writes (one spanning
    /// four sectors), a discard and the end mark.
    pub fn sample_log() -> Vec<u8> {
        let fill = |b: u8, sectors: usize| vec![b; sectors * 512];
        Builder::new(512)
            .write(0, &fill(1, 2), 0)
            .write(8, &fill(2, 1), 0)
            .flush()
            .write(2, &fill(3, 1), FLAG_FUA)
            .write(0, &fill(4, 4), 0)
            .write(9, &fill(5, 1), 0)
            .discard(16, 4)
            .mark(crate::END_MARK)
            .build()
    }
}
