//! The parts of the kernel's ublk UAPI (`include/uapi/linux/ublk_cmd.h`) this frontend
//! uses, written out by hand so the build needs neither kernel headers nor bindgen.
//!
//! The structs travel as byte arrays in the io_uring command area or through a user
//! buffer; they are encoded field by field (native endianness, C layout, no padding
//! holes in any of them), which keeps this file free of `unsafe`.

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
        let mut b = [0u8; 80];
        b[0..4].copy_from_slice(&self.dev_id.to_ne_bytes());
        b[4..6].copy_from_slice(&self.queue_id.to_ne_bytes());
        b[6..8].copy_from_slice(&self.len.to_ne_bytes());
        b[8..16].copy_from_slice(&self.addr.to_ne_bytes());
        b[16..24].copy_from_slice(&self.data.to_ne_bytes());
        // dev_path_len, pad, reserved: zero (only for unprivileged devices).
        b
    }
}

/// `struct ublksrv_io_cmd`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    pub result: i32,
    pub addr: u64,
}

impl IoCmd {
    pub fn to_bytes(self) -> [u8; IO_CMD_SIZE] {
        let mut b = [0u8; IO_CMD_SIZE];
        b[0..2].copy_from_slice(&self.q_id.to_ne_bytes());
        b[2..4].copy_from_slice(&self.tag.to_ne_bytes());
        b[4..8].copy_from_slice(&self.result.to_ne_bytes());
        b[8..16].copy_from_slice(&self.addr.to_ne_bytes());
        b
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
        let mut b = [0u8; DEV_INFO_SIZE];
        b[0..2].copy_from_slice(&self.nr_hw_queues.to_ne_bytes());
        b[2..4].copy_from_slice(&self.queue_depth.to_ne_bytes());
        b[4..6].copy_from_slice(&self.state.to_ne_bytes());
        b[8..12].copy_from_slice(&self.max_io_buf_bytes.to_ne_bytes());
        b[12..16].copy_from_slice(&self.dev_id.to_ne_bytes());
        b[16..20].copy_from_slice(&self.ublksrv_pid.to_ne_bytes());
        b[24..32].copy_from_slice(&self.flags.to_ne_bytes());
        b
    }

    pub fn from_bytes(b: &[u8; DEV_INFO_SIZE]) -> DevInfo {
        let u16_at = |o: usize| u16::from_ne_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut flags = [0u8; 8];
        flags.copy_from_slice(&b[24..32]);
        DevInfo {
            nr_hw_queues: u16_at(0),
            queue_depth: u16_at(2),
            state: u16_at(4),
            max_io_buf_bytes: u32_at(8),
            dev_id: u32_at(12),
            ublksrv_pid: u32_at(16) as i32,
            flags: u64::from_ne_bytes(flags),
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
        let mut b = [0u8; PARAMS_SIZE];
        b[0..4].copy_from_slice(&(PARAMS_SIZE as u32).to_ne_bytes());
        b[4..8].copy_from_slice(&PARAM_TYPE_BASIC.to_ne_bytes());
        let p = &mut b[8..40];
        p[0..4].copy_from_slice(&self.attrs.to_ne_bytes());
        p[4] = self.logical_bs_shift;
        p[5] = self.physical_bs_shift;
        p[6] = self.io_opt_shift;
        p[7] = self.io_min_shift;
        p[8..12].copy_from_slice(&self.max_sectors.to_ne_bytes());
        p[12..16].copy_from_slice(&self.chunk_sectors.to_ne_bytes());
        p[16..24].copy_from_slice(&self.dev_sectors.to_ne_bytes());
        p[24..32].copy_from_slice(&self.virt_boundary_mask.to_ne_bytes());
        b
    }
}

/// Decodes one `struct ublksrv_io_desc` (`op_flags`, `nr_sectors`, `start_sector`,
/// `addr`; `addr` is ours, given at fetch time, and not needed back).
pub fn parse_io_desc(b: &[u8; IO_DESC_SIZE]) -> (u32, u32, u64) {
    let op_flags = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    let nr_sectors = u32::from_ne_bytes([b[4], b[5], b[6], b[7]]);
    let mut s = [0u8; 8];
    s.copy_from_slice(&b[8..16]);
    (op_flags, nr_sectors, u64::from_ne_bytes(s))
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
