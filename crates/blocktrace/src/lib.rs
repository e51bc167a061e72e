//! Block-layer tracing: what blktrace, blkparse and btt do, without them.
//!
//! - [`tracefs`] records the kernel's block tracepoints (the events blktrace's own
//!   kernel probes hang on) through a private tracefs instance, reading each CPU's
//!   ring buffer in its binary page format, and writes them as blktrace files
//!   (`NAME.blktrace.CPU`), so `blkparse` and `btt` read what we record and we read
//!   what they record.
//! - [`blktrace`] reads and writes those files.
//! - [`btt`] computes btt's per-stage breakdown (Q2Q, Q2G, G2I, Q2M, I2D, M2D, D2C,
//!   Q2C), iostat's merge counts, request sizes and seek distances.
//!
//! Why by hand: no maintained crate parses the ftrace ring-buffer page format or
//! blktrace's record format (libtraceevent and blktrace are C), and btt is a
//! program, not a library. Each format is small and documented in the kernel
//! (`events/header_page`, `events/header_event`, `include/uapi/linux/blktrace_api.h`).

pub mod blktrace;
pub mod btt;
pub mod replay;
pub mod timeline;
pub mod tracefs;

/// The fuzz targets' bodies (`fuzz/fuzz_targets/blktrace_read.rs`,
/// `tracefs_pages.rs`), also run over their corpora by `cargo test`.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    /// Parses arbitrary bytes as a blktrace file and analyses what parsed.
    pub fn exercise_blktrace(data: &[u8]) {
        let mut events = Vec::new();
        let mut stats = crate::blktrace::ReadStats::default();
        let _ = crate::blktrace::parse(data, std::path::Path::new("fuzz"), &mut events, &mut stats);
        let _ = crate::btt::Analysis::new(&events);
    }

    /// Decodes arbitrary bytes as tracefs ring-buffer pages and analyses the events.
    pub fn exercise_pages(data: &[u8]) {
        let events = crate::tracefs::fuzz_pages(data);
        let _ = crate::btt::Analysis::new(&events);
    }
}

use std::fmt;
use std::path::PathBuf;

/// A block device number, as the kernel's traces carry it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, schemars::JsonSchema,
)]
pub struct Dev {
    pub major: u32,
    pub minor: u32,
}

impl Dev {
    /// The kernel-internal encoding (`MKDEV`: major in the top 12 bits, minor in the
    /// low 20), which tracepoints and blktrace records use.
    pub fn from_kernel(dev: u32) -> Dev {
        Dev {
            major: dev >> 20,
            minor: dev & 0xf_ffff,
        }
    }

    pub fn to_kernel(self) -> u32 {
        (self.major << 20) | (self.minor & 0xf_ffff)
    }

    /// From a user-space `st_rdev` (glibc's encoding).
    pub fn from_rdev(rdev: u64) -> Dev {
        Dev {
            major: libc::major(rdev),
            minor: libc::minor(rdev),
        }
    }
}

impl fmt::Display for Dev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{},{}", self.major, self.minor)
    }
}

/// What happened to an I/O: blktrace's action codes (`__BLK_TA_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Action {
    Queue = 1,
    BackMerge = 2,
    FrontMerge = 3,
    GetRq = 4,
    SleepRq = 5,
    Requeue = 6,
    Issue = 7,
    Complete = 8,
    Plug = 9,
    UnplugIo = 10,
    UnplugTimer = 11,
    Insert = 12,
    Split = 13,
    Bounce = 14,
    Remap = 15,
    Abort = 16,
    DrvData = 17,
}

impl Action {
    pub fn from_code(code: u16) -> Option<Action> {
        use Action::*;
        Some(match code {
            1 => Queue,
            2 => BackMerge,
            3 => FrontMerge,
            4 => GetRq,
            5 => SleepRq,
            6 => Requeue,
            7 => Issue,
            8 => Complete,
            9 => Plug,
            10 => UnplugIo,
            11 => UnplugTimer,
            12 => Insert,
            13 => Split,
            14 => Bounce,
            15 => Remap,
            16 => Abort,
            17 => DrvData,
            _ => return None,
        })
    }

    /// blkparse's one-letter name.
    pub fn letter(self) -> char {
        use Action::*;
        match self {
            Queue => 'Q',
            BackMerge => 'M',
            FrontMerge => 'F',
            GetRq => 'G',
            SleepRq => 'S',
            Requeue => 'R',
            Issue => 'D',
            Complete => 'C',
            Plug => 'P',
            UnplugIo => 'U',
            UnplugTimer => 'T',
            Insert => 'I',
            Split => 'X',
            Bounce => 'B',
            Remap => 'A',
            Abort => 'K',
            DrvData => 'Z',
        }
    }

    /// The category blktrace files this action under (`BLK_TC_ACT` of the kernel's
    /// `BLK_TA_*` definitions).
    fn category(self) -> u32 {
        match self {
            Action::Issue => cat::ISSUE,
            Action::Complete => cat::COMPLETE,
            Action::Requeue => cat::REQUEUE,
            Action::DrvData => cat::DRV_DATA,
            _ => cat::QUEUE,
        }
    }
}

/// blktrace's category bits (`BLK_TC_*`), kept in [`Event::flags`].
pub mod cat {
    pub const READ: u32 = 1 << 0;
    pub const WRITE: u32 = 1 << 1;
    pub const FLUSH: u32 = 1 << 2;
    pub const SYNC: u32 = 1 << 3;
    pub const QUEUE: u32 = 1 << 4;
    pub const REQUEUE: u32 = 1 << 5;
    pub const ISSUE: u32 = 1 << 6;
    pub const COMPLETE: u32 = 1 << 7;
    pub const FS: u32 = 1 << 8;
    pub const PC: u32 = 1 << 9;
    pub const NOTIFY: u32 = 1 << 10;
    pub const AHEAD: u32 = 1 << 11;
    pub const META: u32 = 1 << 12;
    pub const DISCARD: u32 = 1 << 13;
    pub const DRV_DATA: u32 = 1 << 14;
    pub const FUA: u32 = 1 << 15;
}

/// What an event carries besides its sector and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extra {
    None,
    /// A remap (`A`): where the I/O came from.
    Remap {
        from_dev: Dev,
        from_sector: u64,
    },
    /// A split (`X`): where the second part starts.
    Split {
        new_sector: u64,
    },
}

/// One block-layer event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Nanoseconds on the monotonic clock (`CLOCK_MONOTONIC`, blktrace's `ktime_get`).
    pub time_ns: u64,
    pub dev: Dev,
    pub action: Action,
    /// [`cat`] bits: direction (read, write, discard, flush) and modifiers.
    pub flags: u32,
    pub sector: u64,
    pub bytes: u32,
    pub pid: u32,
    pub cpu: u32,
    /// The completion's status (an errno, or 0).
    pub error: u16,
    pub extra: Extra,
}

impl Event {
    pub fn is_write(&self) -> bool {
        self.flags & cat::WRITE != 0
    }

    pub fn sectors(&self) -> u64 {
        u64::from(self.bytes) >> 9
    }

    /// blkparse's RWBS text: the direction and its modifiers.
    pub fn rwbs(&self) -> String {
        let f = self.flags;
        let mut s = String::new();
        if f & cat::FLUSH != 0 {
            s.push('F');
        }
        if f & cat::DISCARD != 0 {
            s.push('D');
        } else if f & cat::WRITE != 0 {
            s.push('W');
        } else if self.bytes != 0 {
            s.push('R');
        } else {
            s.push('N');
        }
        for (bit, c) in [
            (cat::FUA, 'F'),
            (cat::AHEAD, 'A'),
            (cat::SYNC, 'S'),
            (cat::META, 'M'),
        ] {
            if f & bit != 0 {
                s.push(c);
            }
        }
        s
    }
}

/// Errors of capture and of parsing, each naming the file and, for bad data, the
/// offset.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] vabc_io::Error),
    #[error("{path}: offset {offset}: {what}")]
    Format {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("tracefs: {0}")]
    Tracefs(String),
    #[error("{0}")]
    Input(String),
}

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io(vabc_io::Error::new(op, path, source))
    }
}

pub type Result<T> = std::result::Result<T, Error>;
