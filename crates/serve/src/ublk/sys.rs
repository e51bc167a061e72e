//! The parts of the kernel's ublk UAPI (`include/uapi/linux/ublk_cmd.h`) this frontend
//! uses, written out by hand so the build needs neither kernel headers nor bindgen.
//!
//! The structs travel as byte arrays in the io_uring command area or through a user
//! buffer. Each has a `#[repr(C)]` twin in the kernel's layout (native endianness,
//! reserved fields spelled out) whose zerocopy derives prove it has no padding and takes
//! any bytes, so converting to and from the arrays needs no `unsafe`.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Control device; one `/dev/ublkcN` character device and one `/dev/ublkbN` block device
/// appear per added device.
pub const CONTROL_PATH: &str = "/dev/ublk-control";

// Control command numbers (`UBLK_CMD_*`).
pub const CMD_ADD_DEV: u8 = 0x04;
pub const CMD_DEL_DEV: u8 = 0x05;
pub const CMD_START_DEV: u8 = 0x06;
pub const CMD_STOP_DEV: u8 = 0x07;
pub const CMD_SET_PARAMS: u8 = 0x08;

// I/O command numbers (`UBLK_IO_*`).
pub const IO_FETCH_REQ: u8 = 0x20;
pub const IO_COMMIT_AND_FETCH_REQ: u8 = 0x21;

/// `UBLK_IO_RES_OK`: a fetch completed with a request in the tag's descriptor.
pub const IO_RES_OK: i32 = 0;
/// `UBLK_IO_RES_ABORT`: the device is going away; the tag is not re-armed.
pub const IO_RES_ABORT: i32 = -libc::ENODEV;

/// `UBLK_MAX_QUEUE_DEPTH`: tags are 16 bits but the driver caps a queue at 4096.
pub const MAX_QUEUE_DEPTH: u16 = 4096;

/// `UBLK_F_CMD_IOCTL_ENCODE`: commands are `_IOWR('u', nr, struct)` encoded, which
/// kernels built without `CONFIG_BLKDEV_UBLK_LEGACY_OPCODES` require.
pub const F_CMD_IOCTL_ENCODE: u64 = 1 << 6;

/// `UBLK_ATTR_READ_ONLY` in `ublk_param_basic.attrs`.
pub const ATTR_READ_ONLY: u32 = 1 << 0;
/// `UBLK_PARAM_TYPE_BASIC` in `ublk_params.types`.
pub const PARAM_TYPE_BASIC: u32 = 1 << 0;

// `UBLK_IO_OP_*`: bits 0-7 of `ublksrv_io_desc.op_flags`.
pub const IO_OP_READ: u8 = 0;
pub const IO_OP_WRITE: u8 = 1;
pub const IO_OP_FLUSH: u8 = 2;
pub const IO_OP_DISCARD: u8 = 3;
pub const IO_OP_WRITE_SAME: u8 = 4;
pub const IO_OP_WRITE_ZEROES: u8 = 5;

/// `sizeof(struct ublksrv_ctrl_cmd)`.
pub const CTRL_CMD_SIZE: usize = 32;
/// `sizeof(struct ublksrv_io_cmd)`.
pub const IO_CMD_SIZE: usize = 16;
/// `sizeof(struct ublksrv_io_desc)`.
pub const IO_DESC_SIZE: usize = 24;
/// `sizeof(struct ublksrv_ctrl_dev_info)`.
pub const DEV_INFO_SIZE: usize = 64;
/// `ublk_params` header + `ublk_param_basic` + `ublk_param_discard`: the struct as the
/// first ublk kernel (6.0) defined it. The driver accepts any `len` up to its own
/// `sizeof(struct ublk_params)` and zero-fills the rest, so this works on every version.
pub const PARAMS_SIZE: usize = 8 + 32 + 20;

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOC(dir, 'u', nr, size)`.
const fn ioc(dir: u32, nr: u8, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr as u32
}

/// `UBLK_U_CMD_*`: every control command the driver defines as `_IOWR` except the
/// read-only queries, which this frontend does not use.
pub const fn ctrl_op(nr: u8) -> u32 {
    ioc(IOC_READ | IOC_WRITE, nr, CTRL_CMD_SIZE)
}

/// `UBLK_U_IO_*`.
pub const fn io_op(nr: u8) -> u32 {
    ioc(IOC_READ | IOC_WRITE, nr, IO_CMD_SIZE)
}

/// Byte offset in `/dev/ublkcN` of queue `q_id`'s descriptor array: the driver reserves
/// room for `UBLK_MAX_QUEUE_DEPTH` descriptors per queue, rounded up to a page.
pub fn desc_mmap_offset(q_id: u16, page_size: usize) -> u64 {
    let per_queue = (MAX_QUEUE_DEPTH as usize * IO_DESC_SIZE).next_multiple_of(page_size);
    q_id as u64 * per_queue as u64
}

/// Length of the descriptor mapping of a queue of `depth` tags.
pub fn desc_mmap_len(depth: u16, page_size: usize) -> usize {
    (depth as usize * IO_DESC_SIZE).next_multiple_of(page_size)
}

/// `struct ublksrv_ctrl_cmd` as the kernel lays it out.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawCtrlCmd {
    dev_id: u32,
    queue_id: u16,
    len: u16,
    addr: u64,
    data: u64,
    /// Only for unprivileged devices.
    dev_path_len: u16,
    pad: u16,
    reserved: u32,
}

/// `struct ublksrv_ctrl_dev_info` as the kernel lays it out.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawDevInfo {
    nr_hw_queues: u16,
    queue_depth: u16,
    state: u16,
    pad0: u16,
    max_io_buf_bytes: u32,
    dev_id: u32,
    ublksrv_pid: i32,
    pad1: u32,
    flags: u64,
    /// The daemon's own; the driver neither reads nor writes it.
    ublksrv_flags: u64,
    owner_uid: u32,
    owner_gid: u32,
    reserved1: u64,
    reserved2: u64,
}

/// `struct ublk_param_basic`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawParamBasic {
    attrs: u32,
    logical_bs_shift: u8,
    physical_bs_shift: u8,
    io_opt_shift: u8,
    io_min_shift: u8,
    max_sectors: u32,
    chunk_sectors: u32,
    dev_sectors: u64,
    virt_boundary_mask: u64,
}

/// `struct ublk_param_discard`, left zero: discards are not offered.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawParamDiscard {
    discard_alignment: u32,
    discard_granularity: u32,
    max_discard_sectors: u32,
    max_write_zeroes_sectors: u32,
    max_discard_segments: u16,
    reserved0: u16,
}

/// `struct ublk_params` up to its discard part ([`PARAMS_SIZE`]). Packed because C
/// would round its size up to 64 for the alignment of `basic`, while `len` is 60 and
/// the driver reads no further.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C, packed)]
struct RawParams {
    len: u32,
    types: u32,
    basic: RawParamBasic,
    discard: RawParamDiscard,
}

/// `struct ublksrv_io_desc`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct RawIoDesc {
    op_flags: u32,
    nr_sectors: u32,
    start_sector: u64,
    addr: u64,
}

// The kernel's sizes: a struct that drifts from them does not build.
const _: () = {
    assert!(size_of::<RawCtrlCmd>() == CTRL_CMD_SIZE);
    assert!(size_of::<IoCmd>() == IO_CMD_SIZE);
    assert!(size_of::<RawIoDesc>() == IO_DESC_SIZE);
    assert!(size_of::<RawDevInfo>() == DEV_INFO_SIZE);
    assert!(size_of::<RawParamBasic>() == 32);
    assert!(size_of::<RawParamDiscard>() == 20);
    assert!(size_of::<RawParams>() == PARAMS_SIZE);
};

/// `struct ublksrv_ctrl_cmd`, sent in the SQE's command area.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtrlCmd {
    pub dev_id: u32,
    /// `u16::MAX` (-1) for commands not aimed at one queue.
    pub queue_id: u16,
    pub len: u16,
    pub addr: u64,
    pub data: u64,
}

impl CtrlCmd {
    /// The 80-byte `IORING_OP_URING_CMD` payload of a 128-byte SQE.
    pub fn to_sqe_cmd(self) -> [u8; 80] {
        let raw = RawCtrlCmd {
            dev_id: self.dev_id,
            queue_id: self.queue_id,
            len: self.len,
            addr: self.addr,
            data: self.data,
            ..RawCtrlCmd::default()
        };
        let mut b = [0u8; 80];
        b[..CTRL_CMD_SIZE].copy_from_slice(raw.as_bytes());
        b
    }
}

/// `struct ublksrv_io_cmd`, in the kernel's layout.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    pub result: i32,
    pub addr: u64,
}

impl IoCmd {
    pub fn to_bytes(self) -> [u8; IO_CMD_SIZE] {
        zerocopy::transmute!(self)
    }
}

/// `struct ublksrv_ctrl_dev_info`: in/out buffer of `ADD_DEV`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub flags: u64,
}

impl DevInfo {
    pub fn to_bytes(self) -> [u8; DEV_INFO_SIZE] {
        zerocopy::transmute!(RawDevInfo {
            nr_hw_queues: self.nr_hw_queues,
            queue_depth: self.queue_depth,
            state: self.state,
            max_io_buf_bytes: self.max_io_buf_bytes,
            dev_id: self.dev_id,
            ublksrv_pid: self.ublksrv_pid,
            flags: self.flags,
            ..RawDevInfo::default()
        })
    }

    pub fn from_bytes(b: &[u8; DEV_INFO_SIZE]) -> DevInfo {
        let raw: RawDevInfo = zerocopy::transmute!(*b);
        DevInfo {
            nr_hw_queues: raw.nr_hw_queues,
            queue_depth: raw.queue_depth,
            state: raw.state,
            max_io_buf_bytes: raw.max_io_buf_bytes,
            dev_id: raw.dev_id,
            ublksrv_pid: raw.ublksrv_pid,
            flags: raw.flags,
        }
    }
}

/// `struct ublk_params` with only `ublk_param_basic` filled in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamsBasic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

impl ParamsBasic {
    pub fn to_params_bytes(self) -> [u8; PARAMS_SIZE] {
        zerocopy::transmute!(RawParams {
            len: PARAMS_SIZE as u32,
            types: PARAM_TYPE_BASIC,
            basic: RawParamBasic {
                attrs: self.attrs,
                logical_bs_shift: self.logical_bs_shift,
                physical_bs_shift: self.physical_bs_shift,
                io_opt_shift: self.io_opt_shift,
                io_min_shift: self.io_min_shift,
                max_sectors: self.max_sectors,
                chunk_sectors: self.chunk_sectors,
                dev_sectors: self.dev_sectors,
                virt_boundary_mask: self.virt_boundary_mask,
            },
            discard: RawParamDiscard::default(),
        })
    }
}

/// Decodes one `struct ublksrv_io_desc` (`op_flags`, `nr_sectors`, `start_sector`,
/// `addr`; `addr` is ours, given at fetch time, and not needed back).
pub fn parse_io_desc(b: &[u8; IO_DESC_SIZE]) -> (u32, u32, u64) {
    let d: RawIoDesc = zerocopy::transmute!(*b);
    (d.op_flags, d.nr_sectors, d.start_sector)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_encoded_opcodes_match_the_kernel_header() {
        // Values of UBLK_U_CMD_ADD_DEV etc. as the C preprocessor computes them.
        assert_eq!(ctrl_op(CMD_ADD_DEV), 0xc020_7504);
        assert_eq!(ctrl_op(CMD_DEL_DEV), 0xc020_7505);
        assert_eq!(ctrl_op(CMD_START_DEV), 0xc020_7506);
        assert_eq!(ctrl_op(CMD_STOP_DEV), 0xc020_7507);
        assert_eq!(ctrl_op(CMD_SET_PARAMS), 0xc020_7508);
        assert_eq!(io_op(IO_FETCH_REQ), 0xc010_7520);
        assert_eq!(io_op(IO_COMMIT_AND_FETCH_REQ), 0xc010_7521);
    }

    #[test]
    fn descriptor_mapping_layout() {
        assert_eq!(desc_mmap_offset(0, 4096), 0);
        // 4096 * 24 = 98304 = 24 pages exactly.
        assert_eq!(desc_mmap_offset(1, 4096), 98304);
        assert_eq!(desc_mmap_offset(3, 4096), 3 * 98304);
        assert_eq!(desc_mmap_offset(1, 65536), 131072);
        assert_eq!(desc_mmap_len(64, 4096), 4096);
        assert_eq!(desc_mmap_len(171, 4096), 8192);
    }

    #[test]
    fn raw_structs_have_the_kernel_layout() {
        use std::mem::offset_of;
        assert_eq!(size_of::<RawCtrlCmd>(), 32);
        assert_eq!(offset_of!(RawCtrlCmd, data), 16);
        assert_eq!(offset_of!(RawCtrlCmd, dev_path_len), 24);
        assert_eq!(size_of::<IoCmd>(), 16);
        assert_eq!(offset_of!(IoCmd, addr), 8);
        assert_eq!(size_of::<RawDevInfo>(), 64);
        assert_eq!(offset_of!(RawDevInfo, max_io_buf_bytes), 8);
        assert_eq!(offset_of!(RawDevInfo, flags), 24);
        assert_eq!(offset_of!(RawDevInfo, owner_uid), 40);
        assert_eq!(size_of::<RawParams>(), 60);
        assert_eq!(offset_of!(RawParams, basic), 8);
        assert_eq!(offset_of!(RawParams, discard), 40);
        assert_eq!(offset_of!(RawParamBasic, dev_sectors), 16);
        assert_eq!(size_of::<RawIoDesc>(), 24);
        assert_eq!(offset_of!(RawIoDesc, start_sector), 8);
    }

    /// Bytes laid out field by field as the kernel header has them decode to the
    /// fields and encode back to the same bytes.
    #[test]
    fn kernel_bytes_round_trip() {
        let mut info = [0u8; DEV_INFO_SIZE];
        info[0..2].copy_from_slice(&4u16.to_ne_bytes());
        info[2..4].copy_from_slice(&128u16.to_ne_bytes());
        info[4..6].copy_from_slice(&1u16.to_ne_bytes());
        info[8..12].copy_from_slice(&(512u32 << 10).to_ne_bytes());
        info[12..16].copy_from_slice(&3u32.to_ne_bytes());
        info[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
        info[24..32].copy_from_slice(&F_CMD_IOCTL_ENCODE.to_ne_bytes());
        let d = DevInfo::from_bytes(&info);
        assert_eq!(
            (
                d.nr_hw_queues,
                d.queue_depth,
                d.state,
                d.dev_id,
                d.ublksrv_pid
            ),
            (4, 128, 1, 3, -1)
        );
        assert_eq!(
            (d.max_io_buf_bytes, d.flags),
            (512 << 10, F_CMD_IOCTL_ENCODE)
        );
        assert_eq!(d.to_bytes(), info);

        let mut io = [0u8; IO_CMD_SIZE];
        io[0..2].copy_from_slice(&2u16.to_ne_bytes());
        io[2..4].copy_from_slice(&77u16.to_ne_bytes());
        io[4..8].copy_from_slice(&(-11i32).to_ne_bytes());
        io[8..16].copy_from_slice(&0x7f00_1234_5000u64.to_ne_bytes());
        let cmd = IoCmd::read_from_bytes(&io).unwrap();
        assert_eq!((cmd.q_id, cmd.tag, cmd.result), (2, 77, -11));
        assert_eq!(cmd.addr, 0x7f00_1234_5000);
        assert_eq!(cmd.to_bytes(), io);

        let mut desc = [0u8; IO_DESC_SIZE];
        desc[0..4].copy_from_slice(&u32::from(IO_OP_FLUSH).to_ne_bytes());
        desc[4..8].copy_from_slice(&0u32.to_ne_bytes());
        desc[8..16].copy_from_slice(&123_456u64.to_ne_bytes());
        desc[16..24].copy_from_slice(&0x7f00_1234_5000u64.to_ne_bytes());
        assert_eq!(parse_io_desc(&desc), (u32::from(IO_OP_FLUSH), 0, 123_456));
        let raw: RawIoDesc = zerocopy::transmute!(desc);
        assert_eq!(raw.addr, 0x7f00_1234_5000);
        assert_eq!(raw.as_bytes(), desc);

        let params = ParamsBasic {
            attrs: 0,
            logical_bs_shift: 9,
            physical_bs_shift: 12,
            io_opt_shift: 12,
            io_min_shift: 9,
            max_sectors: 1024,
            chunk_sectors: 0,
            dev_sectors: 1 << 21,
            virt_boundary_mask: 0,
        }
        .to_params_bytes();
        let raw = RawParams::read_from_bytes(&params).unwrap();
        let basic = raw.basic;
        assert_eq!((basic.logical_bs_shift, basic.dev_sectors), (9, 1 << 21));
        assert_eq!(raw.as_bytes(), params);
    }

    #[test]
    fn structs_encode_in_c_layout() {
        let c = CtrlCmd {
            dev_id: 7,
            queue_id: u16::MAX,
            len: 64,
            addr: 0x1122_3344_5566_7788,
            data: 42,
        }
        .to_sqe_cmd();
        assert_eq!(&c[0..4], &7u32.to_ne_bytes());
        assert_eq!(&c[4..6], &[0xff, 0xff]);
        assert_eq!(&c[6..8], &64u16.to_ne_bytes());
        assert_eq!(&c[8..16], &0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(&c[16..24], &42u64.to_ne_bytes());
        assert!(c[24..].iter().all(|&b| b == 0));

        let info = DevInfo {
            nr_hw_queues: 2,
            queue_depth: 64,
            state: 0,
            max_io_buf_bytes: 1 << 20,
            dev_id: u32::MAX,
            ublksrv_pid: 1234,
            flags: F_CMD_IOCTL_ENCODE,
        };
        assert_eq!(DevInfo::from_bytes(&info.to_bytes()), info);

        let p = ParamsBasic {
            attrs: ATTR_READ_ONLY,
            logical_bs_shift: 12,
            physical_bs_shift: 12,
            io_opt_shift: 12,
            io_min_shift: 12,
            max_sectors: 2048,
            chunk_sectors: 0,
            dev_sectors: 1000,
            virt_boundary_mask: 0,
        }
        .to_params_bytes();
        assert_eq!(&p[0..4], &60u32.to_ne_bytes());
        assert_eq!(&p[4..8], &1u32.to_ne_bytes());
        assert_eq!(&p[8..12], &1u32.to_ne_bytes());
        assert_eq!(&p[12..16], &[12, 12, 12, 12]);
        assert_eq!(&p[16..20], &2048u32.to_ne_bytes());
        assert_eq!(&p[24..32], &1000u64.to_ne_bytes());
        assert!(p[40..].iter().all(|&b| b == 0));

        let io = IoCmd {
            q_id: 1,
            tag: 5,
            result: -5,
            addr: 0xdead_beef,
        }
        .to_bytes();
        assert_eq!(&io[0..2], &1u16.to_ne_bytes());
        assert_eq!(&io[2..4], &5u16.to_ne_bytes());
        assert_eq!(&io[4..8], &(-5i32).to_ne_bytes());
        assert_eq!(&io[8..16], &0xdead_beefu64.to_ne_bytes());

        let mut d = [0u8; IO_DESC_SIZE];
        d[0..4].copy_from_slice(&(IO_OP_READ as u32 | (1 << 13)).to_ne_bytes());
        d[4..8].copy_from_slice(&8u32.to_ne_bytes());
        d[8..16].copy_from_slice(&77u64.to_ne_bytes());
        assert_eq!(parse_io_desc(&d), (1 << 13, 8, 77));
    }
}
