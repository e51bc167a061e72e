//! The bodies of the NBD and FUSE request fuzz targets, shared with the tests that
//! replay their fuzz corpora in the normal test run. Not part of the stable API.

pub use crate::pattern::Pattern;

/// Feed `data` to the NBD server as everything one client sends, then hang
/// up. The server must never panic, hang or stall a later connection, and
/// whatever the client sent, it greets first. Returns what the server sent.
pub fn exercise_nbd(data: &[u8]) -> Vec<u8> {
    let out = crate::nbd::exercise_connection(data);
    let hello = crate::nbd::greeting();
    assert_eq!(
        out.get(..hello.len()),
        Some(&hello[..]),
        "the server did not greet first"
    );
    out
}

/// Size of the device behind [`exercise_fuse`]: a MiB and a bit, so that reads cross
/// its end at an odd offset.
pub const FUSE_DEVICE_SIZE: u64 = (1 << 20) + 1000;
/// Reply buffer of [`exercise_fuse`]: the largest READ it answers whole.
pub const FUSE_OUT_SIZE: usize = 128 << 10;

/// One answered request of [`exercise_fuse`].
#[derive(Debug, PartialEq, Eq)]
pub struct FuseAnswer {
    pub opcode: u32,
    pub unique: u64,
    /// 0 or a positive errno; `None` when the kernel expects no answer.
    pub error: Option<i32>,
    pub reply: Vec<u8>,
}

/// Feeds `data` to the FUSE request handler of the io_uring transport (which also
/// serves its /dev/fuse fallback) as the kernel writes requests to /dev/fuse: each a
/// header whose `len` says where the next begins (clamped to what is left), split into
/// the fixed argument and the rest as the /dev/fuse reader does. Every request is
/// answered a second time as it arrives on a ring (the fixed argument in `op_in`, the
/// rest in the payload), and both answers must agree; replies must fit their buffer,
/// and a READ of the file must return exactly the device's bytes. Never panics on any
/// input otherwise. Returns the answers.
pub fn exercise_fuse(data: &[u8]) -> Vec<FuseAnswer> {
    use crate::fuse::fs::{DiskFs, FILE_ID, Outcome};
    use crate::fuse::proto::{self, InHeader};
    use std::sync::Arc;

    let fs = DiskFs {
        dev: Arc::new(Pattern(FUSE_DEVICE_SIZE)),
        size: FUSE_DEVICE_SIZE,
        name: b"disk.img".to_vec(),
        uid: 0,
        gid: 0,
    };
    let hdr_len = size_of::<InHeader>();
    let mut answers = Vec::new();
    let mut out = vec![0u8; FUSE_OUT_SIZE];
    let mut ring_out = vec![0u8; FUSE_OUT_SIZE];
    let mut rest = data;
    while let Some(h) = proto::read::<InHeader>(rest) {
        let len = (h.len as usize).clamp(hdr_len, rest.len());
        let body = &rest[hdr_len..len];
        rest = &rest[len..];
        let fixed = proto::fixed_arg_size(h.opcode);
        let (arg, tail) = body.split_at(fixed.min(body.len()));
        let outcome = fs.handle(&h, arg, tail, &mut out);
        let (error, reply) = match outcome {
            Outcome::Reply(n) => {
                assert!(
                    n <= out.len(),
                    "reply of {n} bytes in a {} buffer",
                    out.len()
                );
                (Some(0), out[..n].to_vec())
            }
            Outcome::Error(e) => {
                assert!(e > 0, "errno {e}");
                (Some(e), Vec::new())
            }
            Outcome::NoReply => (None, Vec::new()),
        };
        if h.opcode == proto::READ
            && h.nodeid == FILE_ID
            && error == Some(0)
            && let Some(r) = proto::read::<proto::ReadIn>(arg)
        {
            let want = u64::from(r.size).min(FUSE_DEVICE_SIZE.saturating_sub(r.offset));
            assert_eq!(reply.len() as u64, want, "READ {} at {}", r.size, r.offset);
            for (i, b) in reply.iter().enumerate() {
                assert_eq!(*b, ((r.offset + i as u64) % 251) as u8, "READ byte {i}");
            }
        }
        // The ring carries the fixed argument in op_in (128 bytes) and the rest in the
        // payload; the answer must be the same when the kernel sent the whole argument.
        if body.len() >= fixed && fixed <= proto::FUSE_URING_OP_IN_OUT_SZ {
            let mut op_in = [0u8; proto::FUSE_URING_OP_IN_OUT_SZ];
            op_in[..fixed].copy_from_slice(arg);
            let ring = fs.handle(&h, &op_in[..fixed], tail, &mut ring_out);
            let same = match (&outcome, &ring) {
                (Outcome::Reply(a), Outcome::Reply(b)) => out[..*a] == ring_out[..*b],
                (a, b) => a == b,
            };
            assert!(
                same,
                "opcode {}: {outcome:?} over /dev/fuse, {ring:?} over the ring",
                h.opcode
            );
        }
        answers.push(FuseAnswer {
            opcode: h.opcode,
            unique: h.unique,
            error,
            reply,
        });
    }
    answers
}
