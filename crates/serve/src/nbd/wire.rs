//! The fixed layouts of the NBD protocol (NetworkBlockDevice `doc/proto.md`), all
//! big-endian. Their zerocopy derives prove that every byte pattern is a value and that
//! they have no padding and alignment 1, so a request is read straight into one and a
//! reply is sent from one's bytes.

use zerocopy::big_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// What the server sends first (fixed newstyle).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct Greeting {
    pub nbd_magic: U64,
    pub ihaveopt: U64,
    pub handshake_flags: U16,
}

/// An option request's header; `length` bytes of data follow.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct OptionRequest {
    pub magic: U64,
    pub option: U32,
    pub length: U32,
}

/// An option reply's header; `length` bytes of data follow.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct OptionReply {
    pub magic: U64,
    pub option: U32,
    pub reply_type: U32,
    pub length: U32,
}

/// The answer to `NBD_OPT_EXPORT_NAME`, followed by 124 zero bytes unless the client
/// asked for none.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct ExportNameReply {
    pub size: U64,
    pub transmission_flags: U16,
}

/// The data of an `NBD_REP_INFO` reply of type `NBD_INFO_EXPORT`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct InfoExport {
    pub info_type: U16,
    pub size: U64,
    pub transmission_flags: U16,
}

/// The data of an `NBD_REP_INFO` reply of type `NBD_INFO_BLOCK_SIZE`.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct InfoBlockSize {
    pub info_type: U16,
    pub minimum: U32,
    pub preferred: U32,
    pub maximum: U32,
}

/// A transmission request's header; a WRITE's `length` bytes follow.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct Request {
    pub magic: U32,
    pub flags: U16,
    pub kind: U16,
    pub cookie: U64,
    pub offset: U64,
    pub length: U32,
}

/// A simple reply's header; a READ's data follows.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct SimpleReply {
    pub magic: U32,
    pub error: U32,
    pub cookie: U64,
}

/// A structured reply chunk's header; `length` bytes of payload follow.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct StructuredReply {
    pub magic: U32,
    pub flags: U16,
    pub kind: U16,
    pub cookie: U64,
    pub length: U32,
}

/// The payload of an `NBD_REPLY_TYPE_ERROR` chunk, with an empty message.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct ErrorPayload {
    pub error: U32,
    pub message_length: U16,
}

/// One extent of an `NBD_REPLY_TYPE_BLOCK_STATUS` chunk (after the context id).
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub(super) struct BlockDescriptor {
    pub length: U32,
    pub status_flags: U32,
}

// The sizes `doc/proto.md` gives: a struct that drifts from them does not build.
const _: () = {
    assert!(size_of::<Greeting>() == 18);
    assert!(size_of::<OptionRequest>() == 16);
    assert!(size_of::<OptionReply>() == 20);
    assert!(size_of::<ExportNameReply>() == 10);
    assert!(size_of::<InfoExport>() == 12);
    assert!(size_of::<InfoBlockSize>() == 14);
    assert!(size_of::<Request>() == 28);
    assert!(size_of::<SimpleReply>() == 16);
    assert!(size_of::<StructuredReply>() == 20);
    assert!(size_of::<ErrorPayload>() == 6);
    assert!(size_of::<BlockDescriptor>() == 8);
};

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes `bytes` (written out from `doc/proto.md`, not by this module) as a `T`,
    /// checks that it encodes back to them, and returns it.
    fn round_trip<T: FromBytes + IntoBytes + Immutable>(bytes: &[u8]) -> T {
        assert_eq!(
            size_of::<T>(),
            bytes.len(),
            "{}",
            std::any::type_name::<T>()
        );
        let t = T::read_from_bytes(bytes).unwrap();
        assert_eq!(t.as_bytes(), bytes);
        t
    }

    #[test]
    fn handshake_structs_round_trip() {
        let g: Greeting = round_trip(b"NBDMAGICIHAVEOPT\x00\x03");
        assert_eq!(g.nbd_magic.get(), 0x4e42_444d_4147_4943);
        assert_eq!(g.handshake_flags.get(), 3);

        // NBD_OPT_GO with 10 bytes of data.
        let o: OptionRequest = round_trip(b"IHAVEOPT\x00\x00\x00\x07\x00\x00\x00\x0a");
        assert_eq!((o.option.get(), o.length.get()), (7, 10));

        // NBD_REP_INFO (3) to NBD_OPT_GO with 12 bytes of data.
        let r: OptionReply = round_trip(&[
            0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0, 12,
        ]);
        assert_eq!(r.magic.get(), 0x0003_e889_0455_65a9);
        assert_eq!(
            (r.option.get(), r.reply_type.get(), r.length.get()),
            (7, 3, 12)
        );

        // 1 MiB, HAS_FLAGS | READ_ONLY.
        let e: ExportNameReply = round_trip(&[0, 0, 0, 0, 0, 0x10, 0, 0, 0, 3]);
        assert_eq!((e.size.get(), e.transmission_flags.get()), (1 << 20, 3));

        let i: InfoExport = round_trip(&[0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0x01, 0x07]);
        assert_eq!((i.info_type.get(), i.size.get()), (0, 1 << 20));
        assert_eq!(i.transmission_flags.get(), 0x107);

        let b: InfoBlockSize = round_trip(&[0, 3, 0, 0, 0, 1, 0, 0, 0x10, 0, 0x02, 0, 0, 0]);
        assert_eq!(b.info_type.get(), 3);
        assert_eq!(
            (b.minimum.get(), b.preferred.get(), b.maximum.get()),
            (1, 4096, 32 << 20)
        );
    }

    #[test]
    fn transmission_structs_round_trip() {
        // READ of 4096 bytes at 8192, cookie 0x0102030405060708, flag REQ_ONE.
        let r: Request = round_trip(&[
            0x25, 0x60, 0x95, 0x13, 0, 8, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0x20, 0,
            0, 0, 0x10, 0,
        ]);
        assert_eq!(r.magic.get(), 0x2560_9513);
        assert_eq!((r.flags.get(), r.kind.get()), (8, 0));
        assert_eq!(r.cookie.get(), 0x0102_0304_0506_0708);
        assert_eq!((r.offset.get(), r.length.get()), (8192, 4096));

        let s: SimpleReply =
            round_trip(&[0x67, 0x44, 0x66, 0x98, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9]);
        assert_eq!(s.magic.get(), 0x6744_6698);
        assert_eq!((s.error.get(), s.cookie.get()), (1, 9));

        // The DONE chunk of type OFFSET_DATA (1), 4104 bytes of payload.
        let c: StructuredReply = round_trip(&[
            0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0x10, 0x08,
        ]);
        assert_eq!(c.magic.get(), 0x668e_33ef);
        assert_eq!((c.flags.get(), c.kind.get()), (1, 1));
        assert_eq!((c.cookie.get(), c.length.get()), (9, 4104));

        let e: ErrorPayload = round_trip(&[0, 0, 0, 22, 0, 0]);
        assert_eq!((e.error.get(), e.message_length.get()), (22, 0));

        let d: BlockDescriptor = round_trip(&[0, 1, 0, 0, 0, 0, 0, 3]);
        assert_eq!((d.length.get(), d.status_flags.get()), (65536, 3));
    }
}
