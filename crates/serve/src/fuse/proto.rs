//! The FUSE wire protocol as far as a read-only one-file export needs it, plus the
//! FUSE-over-io_uring structures (`include/uapi/linux/fuse.h`, protocol 7.42+).
//! Layouts are checked against the kernel's sizes in the tests below.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

// Opcodes (enum fuse_opcode).
pub const LOOKUP: u32 = 1;
pub const FORGET: u32 = 2;
pub const GETATTR: u32 = 3;
pub const SETATTR: u32 = 4;
pub const SYMLINK: u32 = 6;
pub const MKNOD: u32 = 8;
pub const MKDIR: u32 = 9;
pub const UNLINK: u32 = 10;
pub const RMDIR: u32 = 11;
pub const RENAME: u32 = 12;
pub const LINK: u32 = 13;
pub const OPEN: u32 = 14;
pub const READ: u32 = 15;
pub const WRITE: u32 = 16;
pub const STATFS: u32 = 17;
pub const RELEASE: u32 = 18;
pub const FSYNC: u32 = 20;
pub const SETXATTR: u32 = 21;
pub const GETXATTR: u32 = 22;
pub const LISTXATTR: u32 = 23;
pub const REMOVEXATTR: u32 = 24;
pub const FLUSH: u32 = 25;
pub const INIT: u32 = 26;
pub const OPENDIR: u32 = 27;
pub const READDIR: u32 = 28;
pub const RELEASEDIR: u32 = 29;
pub const FSYNCDIR: u32 = 30;
pub const ACCESS: u32 = 34;
pub const CREATE: u32 = 35;
pub const INTERRUPT: u32 = 36;
pub const DESTROY: u32 = 38;
pub const BATCH_FORGET: u32 = 42;
pub const FALLOCATE: u32 = 43;
pub const RENAME2: u32 = 45;
pub const LSEEK: u32 = 46;
pub const COPY_FILE_RANGE: u32 = 47;

// INIT flags (64 bits: `flags | flags2 << 32` once FUSE_INIT_EXT is set).
pub const FUSE_ASYNC_READ: u64 = 1 << 0;
pub const FUSE_BIG_WRITES: u64 = 1 << 5;
pub const FUSE_ASYNC_DIO: u64 = 1 << 15;
pub const FUSE_MAX_PAGES: u64 = 1 << 22;
pub const FUSE_INIT_EXT: u64 = 1 << 30;
pub const FUSE_OVER_IO_URING: u64 = 1 << 41;

pub const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub const FUSE_KERNEL_VERSION: u32 = 7;
/// The newest minor we speak: 7.42 brought FUSE_OVER_IO_URING; nothing we use changed
/// after it, and the kernel takes the smaller of its and our minor.
pub const FUSE_KERNEL_MINOR: u32 = 44;
pub const ROOT_ID: u64 = 1;

pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
/// `d_type` values for READDIR.
pub const DT_DIR: u32 = 4;
pub const DT_REG: u32 = 8;

// FUSE-over-io_uring.
pub const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
pub const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;
pub const FUSE_URING_IN_OUT_HEADER_SZ: usize = 128;
pub const FUSE_URING_OP_IN_OUT_SZ: usize = 128;

/// Plain-old-data wire structs: any byte pattern is a valid value, and no padding the
/// kernel would not also send. zerocopy's derives prove both at compile time, so no
/// hand-written `unsafe impl` is needed.
pub trait Pod: FromBytes + IntoBytes + Immutable + KnownLayout + Copy + Default {}

impl<T: FromBytes + IntoBytes + Immutable + KnownLayout + Copy + Default> Pod for T {}

/// Reads a `T` from the start of `b` (any alignment); `None` when `b` is too short.
pub fn read<T: Pod>(b: &[u8]) -> Option<T> {
    T::read_from_prefix(b).ok().map(|(t, _)| t)
}

/// The bytes of a wire struct.
pub fn bytes<T: Pod>(t: &T) -> &[u8] {
    t.as_bytes()
}

/// Writes `t` at the start of `out`; returns its size, or `None` when `out` is too short.
pub fn put<T: Pod>(out: &mut [u8], t: &T) -> Option<usize> {
    let b = bytes(t);
    out.get_mut(..b.len())?.copy_from_slice(b);
    Some(b.len())
}

#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
    pub padding: u16,
}

#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct OutHeader {
    pub len: u32,
    pub error: i32,
    pub unique: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct InitIn {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub flags2: u32,
    pub unused: [u32; 11],
}

impl InitIn {
    /// The kernel's capabilities; `flags2` counts only with FUSE_INIT_EXT.
    pub fn capabilities(&self) -> u64 {
        let lo = u64::from(self.flags);
        if lo & FUSE_INIT_EXT != 0 {
            lo | u64::from(self.flags2) << 32
        } else {
            lo
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    pub flags: u32,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub time_gran: u32,
    pub max_pages: u16,
    pub map_alignment: u16,
    pub flags2: u32,
    pub max_stack_depth: u32,
    pub request_timeout: u16,
    pub unused: [u16; 11],
}

#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: u64,
    pub mtime: u64,
    pub ctime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub ctimensec: u32,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct EntryOut {
    pub nodeid: u64,
    pub generation: u64,
    pub entry_valid: u64,
    pub attr_valid: u64,
    pub entry_valid_nsec: u32,
    pub attr_valid_nsec: u32,
    pub attr: Attr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct AttrOut {
    pub attr_valid: u64,
    pub attr_valid_nsec: u32,
    pub dummy: u32,
    pub attr: Attr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct OpenIn {
    pub flags: u32,
    pub open_flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct OpenOut {
    pub fh: u64,
    pub open_flags: u32,
    pub backing_id: i32,
}

/// Also the argument of READDIR.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub read_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
    pub padding: u32,
    pub spare: [u32; 6],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct LseekIn {
    pub fh: u64,
    pub offset: u64,
    pub whence: u32,
    pub padding: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct LseekOut {
    pub offset: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct AccessIn {
    pub mask: u32,
    pub padding: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Dirent {
    pub ino: u64,
    pub off: u64,
    pub namelen: u32,
    pub typ: u32,
}

#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct UringEntInOut {
    pub flags: u64,
    /// The request's `unique`; echoed in [`UringCmdReq::commit_id`] to answer it.
    pub commit_id: u64,
    /// Bytes used in the payload buffer, in either direction.
    pub payload_sz: u32,
    pub padding: u32,
    pub reserved: u64,
}

/// The header buffer of one ring entry (`iov[0]` of a REGISTER).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct UringReqHeader {
    /// `InHeader` from the kernel, `OutHeader` back to it.
    pub in_out: [u8; FUSE_URING_IN_OUT_HEADER_SZ],
    /// The request's fixed argument (its first in-arg; empty for LOOKUP, whose name
    /// travels in the payload).
    pub op_in: [u8; FUSE_URING_OP_IN_OUT_SZ],
    pub ring_ent_in_out: UringEntInOut,
}

impl Default for UringReqHeader {
    fn default() -> Self {
        UringReqHeader {
            in_out: [0; FUSE_URING_IN_OUT_HEADER_SZ],
            op_in: [0; FUSE_URING_OP_IN_OUT_SZ],
            ring_ent_in_out: UringEntInOut::default(),
        }
    }
}

/// What goes into the 80-byte command area of the SQE128.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct UringCmdReq {
    pub flags: u64,
    pub commit_id: u64,
    pub qid: u16,
    pub padding: [u8; 6],
}

impl UringCmdReq {
    pub fn to_cmd(self) -> [u8; 80] {
        let mut cmd = [0u8; 80];
        cmd[..size_of::<Self>()].copy_from_slice(bytes(&self));
        cmd
    }
}

// Their sizes, as the kernel's headers have them.
const _: () = {
    assert!(size_of::<LseekIn>() == 24);
    assert!(size_of::<LseekOut>() == 8);
    assert!(size_of::<InHeader>() == 40);
    assert!(size_of::<OutHeader>() == 16);
    assert!(size_of::<InitIn>() == 64);
    assert!(size_of::<InitOut>() == 64);
    assert!(size_of::<Attr>() == 88);
    assert!(size_of::<EntryOut>() == 128);
    assert!(size_of::<AttrOut>() == 104);
    assert!(size_of::<OpenIn>() == 8);
    assert!(size_of::<OpenOut>() == 16);
    assert!(size_of::<ReadIn>() == 40);
    assert!(size_of::<StatfsOut>() == 80);
    assert!(size_of::<AccessIn>() == 8);
    assert!(size_of::<Dirent>() == 24);
    assert!(size_of::<UringEntInOut>() == 32);
    assert!(size_of::<UringReqHeader>() == 288);
    assert!(size_of::<UringCmdReq>() == 24);
};

/// Size of the fixed first argument of `opcode`: what the kernel puts in
/// [`UringReqHeader::op_in`]; the rest (names) follows it on /dev/fuse and goes to the
/// payload on the ring.
pub fn fixed_arg_size(opcode: u32) -> usize {
    match opcode {
        GETATTR => 16,
        OPEN | OPENDIR | ACCESS | GETXATTR | LISTXATTR | FORGET | INTERRUPT => 8,
        BATCH_FORGET => 8,
        READ | READDIR | WRITE => 40,
        RELEASE | RELEASEDIR | FLUSH => 24,
        FSYNC | FSYNCDIR => 16,
        LSEEK => 24,
        INIT => 64,
        _ => 0,
    }
}

/// Appends one READDIR entry at `out[*used..]`; false when it does not fit.
pub fn put_dirent(
    out: &mut [u8],
    used: &mut usize,
    ino: u64,
    off: u64,
    typ: u32,
    name: &[u8],
) -> bool {
    let len = (size_of::<Dirent>() + name.len()).next_multiple_of(8);
    let Some(dst) = out.get_mut(*used..*used + len) else {
        return false;
    };
    let d = Dirent {
        ino,
        off,
        namelen: name.len() as u32,
        typ,
    };
    dst.fill(0);
    dst[..size_of::<Dirent>()].copy_from_slice(bytes(&d));
    dst[size_of::<Dirent>()..][..name.len()].copy_from_slice(name);
    *used += len;
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn uring_layouts_match_the_kernel_header() {
        assert_eq!(offset_of!(UringReqHeader, op_in), 128);
        assert_eq!(offset_of!(UringReqHeader, ring_ent_in_out), 256);
        assert_eq!(offset_of!(UringEntInOut, commit_id), 8);
        assert_eq!(offset_of!(UringEntInOut, payload_sz), 16);
        assert_eq!(offset_of!(UringCmdReq, qid), 16);
        let cmd = UringCmdReq {
            flags: 0,
            commit_id: 0x1122_3344_5566_7788,
            qid: 3,
            padding: [0; 6],
        }
        .to_cmd();
        assert_eq!(&cmd[8..16], &0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(&cmd[16..18], &3u16.to_ne_bytes());
        assert!(cmd[18..].iter().all(|&b| b == 0));
    }

    #[test]
    fn classic_layouts_match_the_kernel_header() {
        assert_eq!(offset_of!(InHeader, unique), 8);
        assert_eq!(offset_of!(InHeader, nodeid), 16);
        assert_eq!(offset_of!(InHeader, total_extlen), 36);
        assert_eq!(offset_of!(InitOut, max_write), 20);
        assert_eq!(offset_of!(InitOut, max_pages), 28);
        assert_eq!(offset_of!(InitOut, flags2), 32);
        assert_eq!(offset_of!(InitOut, request_timeout), 40);
        assert_eq!(offset_of!(Attr, mode), 60);
        assert_eq!(offset_of!(Attr, blksize), 80);
        assert_eq!(offset_of!(EntryOut, attr), 40);
        assert_eq!(offset_of!(AttrOut, attr), 16);
        assert_eq!(offset_of!(ReadIn, size), 16);
    }

    #[test]
    fn parse_headers_from_unaligned_bytes() {
        let h = InHeader {
            len: 80,
            opcode: READ,
            unique: 42,
            nodeid: 2,
            uid: 0,
            gid: 0,
            pid: 7,
            total_extlen: 0,
            padding: 0,
        };
        let r = ReadIn {
            fh: 0,
            offset: 1 << 20,
            size: 4096,
            ..Default::default()
        };
        let mut wire = vec![0u8; 1];
        wire.extend_from_slice(bytes(&h));
        wire.extend_from_slice(bytes(&r));
        let got: InHeader = read(&wire[1..]).unwrap();
        assert_eq!(got, h);
        let got: ReadIn = read(&wire[1 + 40..]).unwrap();
        assert_eq!(got, r);
        assert!(read::<ReadIn>(&wire[1 + 41..]).is_none());
    }

    #[test]
    fn init_capabilities_use_flags2_only_with_init_ext() {
        let mut i = InitIn {
            flags: FUSE_ASYNC_DIO as u32,
            flags2: (FUSE_OVER_IO_URING >> 32) as u32,
            ..Default::default()
        };
        assert_eq!(i.capabilities() & FUSE_OVER_IO_URING, 0);
        i.flags |= FUSE_INIT_EXT as u32;
        assert_ne!(i.capabilities() & FUSE_OVER_IO_URING, 0);
        assert_ne!(i.capabilities() & FUSE_ASYNC_DIO, 0);
    }

    #[test]
    fn dirents_are_padded_to_eight_bytes() {
        let mut out = [0xffu8; 64];
        let mut used = 0;
        assert!(put_dirent(&mut out, &mut used, 2, 3, DT_REG, b"disk.img"));
        assert_eq!(used, 32);
        assert!(!put_dirent(
            &mut out,
            &mut used,
            2,
            4,
            DT_REG,
            b"a-longer-name-than-fits"
        ));
        assert_eq!(used, 32);
        let d: Dirent = read(&out).unwrap();
        assert_eq!((d.ino, d.off, d.namelen, d.typ), (2, 3, 8, DT_REG));
        assert_eq!(&out[24..32], b"disk.img");
        assert_eq!(out[32], 0xff);
    }
}
