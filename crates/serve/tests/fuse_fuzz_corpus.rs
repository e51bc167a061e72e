//! Replays the fuzz corpus of the FUSE request target (fuzz/corpus/fuse_request)
//! through the target's body in the normal test run, and regenerates its seeds: the
//! requests the kernel sends a read-only one-file export (lookup, attributes, open,
//! directory listing, reads at and past the end, refused writes, forgets, unknown
//! opcodes, truncated arguments).

#[path = "../../../fuzz/replay.rs"]
mod replay;

use serve::fuzzing::{FUSE_DEVICE_SIZE, FUSE_OUT_SIZE, exercise_fuse};

const ROOT: u64 = 1;
const FILE: u64 = 2;

/// Appends one request as the kernel writes it to /dev/fuse: the 40-byte header
/// (len, opcode, unique, nodeid, uid, gid, pid, extension length, padding), then `body`.
fn request(out: &mut Vec<u8>, opcode: u32, unique: u64, nodeid: u64, body: &[u8]) {
    out.extend_from_slice(&(40 + body.len() as u32).to_le_bytes());
    out.extend_from_slice(&opcode.to_le_bytes());
    out.extend_from_slice(&unique.to_le_bytes());
    out.extend_from_slice(&nodeid.to_le_bytes());
    out.extend_from_slice(&[0; 16]);
    out.extend_from_slice(body);
}

/// READ's and READDIR's fixed argument: fh, offset, size, read_flags, lock_owner,
/// flags, padding.
fn read_in(offset: u64, size: u32) -> Vec<u8> {
    let mut b = 0u64.to_le_bytes().to_vec();
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&size.to_le_bytes());
    b.extend_from_slice(&[0; 20]);
    b
}

/// LSEEK's argument: fh, offset, whence, padding.
fn lseek_in(offset: u64, whence: u32) -> Vec<u8> {
    let mut b = 0u64.to_le_bytes().to_vec();
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&two_u32(whence, 0));
    b
}

fn two_u32(a: u32, b: u32) -> Vec<u8> {
    let mut v = a.to_le_bytes().to_vec();
    v.extend_from_slice(&b.to_le_bytes());
    v
}

/// Named request streams.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut session = Vec::new();
    request(&mut session, 1, 1, ROOT, b"disk.img\0"); // LOOKUP
    request(&mut session, 1, 2, ROOT, b"other\0"); // LOOKUP: ENOENT
    request(&mut session, 3, 3, ROOT, &[0; 16]); // GETATTR root
    request(&mut session, 3, 4, FILE, &[0; 16]); // GETATTR file
    request(&mut session, 14, 5, FILE, &two_u32(0, 0)); // OPEN O_RDONLY
    request(&mut session, 14, 6, FILE, &two_u32(2, 0)); // OPEN O_RDWR: EROFS
    request(&mut session, 27, 7, ROOT, &two_u32(0, 0)); // OPENDIR
    request(&mut session, 28, 8, ROOT, &read_in(0, 4096)); // READDIR
    request(&mut session, 15, 9, FILE, &read_in(0, 4096)); // READ
    request(
        &mut session,
        15,
        10,
        FILE,
        &read_in(FUSE_DEVICE_SIZE - 100, 4096),
    ); // at the end
    request(
        &mut session,
        15,
        11,
        FILE,
        &read_in(FUSE_DEVICE_SIZE + 5, 4096),
    ); // past it
    request(
        &mut session,
        15,
        12,
        FILE,
        &read_in(0, FUSE_OUT_SIZE as u32 + 1),
    ); // too big
    request(&mut session, 17, 13, ROOT, &[]); // STATFS
    request(&mut session, 34, 14, FILE, &two_u32(2, 0)); // ACCESS W_OK: EROFS
    request(&mut session, 16, 15, FILE, &read_in(0, 8)); // WRITE: EROFS
    request(&mut session, 2, 16, FILE, &1u64.to_le_bytes()); // FORGET: no reply
    request(&mut session, 22, 17, FILE, &[0; 8]); // GETXATTR: ENOSYS
    request(&mut session, 999, 18, FILE, &[]); // unknown: ENOSYS
    request(&mut session, 15, 19, FILE, &[0; 7]); // READ, argument cut short: EINVAL
    request(&mut session, 15, 20, ROOT, &read_in(0, 4096)); // READ of the directory
    request(&mut session, 46, 21, FILE, &lseek_in(100, 3)); // LSEEK SEEK_DATA
    request(&mut session, 46, 22, FILE, &lseek_in(100, 4)); // SEEK_HOLE: the end
    request(&mut session, 46, 23, FILE, &lseek_in(FUSE_DEVICE_SIZE, 3)); // ENXIO
    request(&mut session, 46, 24, FILE, &lseek_in(0, 0)); // SEEK_SET: EINVAL
    request(&mut session, 46, 25, ROOT, &lseek_in(0, 3)); // the directory: EINVAL

    let mut cut = Vec::new();
    request(&mut cut, 15, 1, FILE, &read_in(4096, 8192));
    cut.truncate(cut.len() - 9); // the stream ends inside the argument
    let mut bad_len = Vec::new();
    request(&mut bad_len, 1, 1, ROOT, b"disk.img\0");
    bad_len[..4].copy_from_slice(&3u32.to_le_bytes()); // len shorter than the header
    request(&mut bad_len, 3, 2, FILE, &[0; 16]);
    vec![("session", session), ("cut", cut), ("bad_len", bad_len)]
}

/// Regenerate the seed corpus: `cargo test -p vabc-serve --test fuse_fuzz_corpus -- --ignored`.
#[test]
#[ignore]
fn generate_seed_corpus() {
    replay::write_seeds("fuse_request", seeds());
}

#[test]
fn every_request_of_a_session_is_answered_as_the_export_should() {
    let (_, session) = seeds().remove(0);
    let answers = exercise_fuse(&session);
    let (enoent, eisdir, erofs, enosys, einval) = (2, 21, 30, 38, 22);
    let err = |u: u64| {
        answers
            .iter()
            .find(|a| a.unique == u)
            .unwrap_or_else(|| panic!("request {u} not answered: {answers:?}"))
            .error
    };
    let len = |u: u64| answers.iter().find(|a| a.unique == u).unwrap().reply.len();
    assert_eq!(answers.len(), 25);
    assert_eq!((err(1), len(1)), (Some(0), 128)); // entry_out
    assert_eq!(err(2), Some(enoent));
    assert_eq!((err(3), len(3)), (Some(0), 104)); // attr_out
    assert_eq!((err(4), len(4)), (Some(0), 104));
    assert_eq!((err(5), len(5)), (Some(0), 16)); // open_out
    assert_eq!(err(6), Some(erofs));
    assert_eq!(err(7), Some(0));
    assert_eq!(err(8), Some(0));
    assert!(len(8) > 0, "READDIR listed nothing");
    assert_eq!((err(9), len(9)), (Some(0), 4096));
    assert_eq!((err(10), len(10)), (Some(0), 100));
    assert_eq!((err(11), len(11)), (Some(0), 0));
    assert_eq!(err(12), Some(einval));
    assert_eq!(err(13), Some(0));
    assert_eq!(err(14), Some(erofs));
    assert_eq!(err(15), Some(erofs));
    assert_eq!(err(16), None);
    assert_eq!(err(17), Some(enosys));
    assert_eq!(err(18), Some(enosys));
    assert_eq!(err(19), Some(einval));
    assert_eq!(err(20), Some(eisdir));
    // The fuzz device stores everything: data where asked, the one hole at the end.
    let offset = |u: u64| {
        let r = &answers.iter().find(|a| a.unique == u).unwrap().reply;
        u64::from_le_bytes(r[..8].try_into().unwrap())
    };
    assert_eq!((err(21), offset(21)), (Some(0), 100));
    assert_eq!((err(22), offset(22)), (Some(0), FUSE_DEVICE_SIZE));
    assert_eq!(err(23), Some(6)); // ENXIO
    assert_eq!(err(24), Some(einval));
    assert_eq!(err(25), Some(einval));
    // The GETATTR of the file reports the device's size (attr starts after 16 bytes:
    // attr_valid, attr_valid_nsec, dummy; then ino, size).
    let a = &answers.iter().find(|a| a.unique == 4).unwrap().reply;
    assert_eq!(a[24..32], FUSE_DEVICE_SIZE.to_le_bytes());
}

#[test]
fn cut_and_malformed_streams_end_cleanly() {
    let seeds = seeds();
    let cut = exercise_fuse(&seeds[1].1);
    // The header is whole, so the request is answered: its argument is short.
    assert_eq!(cut.len(), 1);
    assert_eq!(cut[0].error, Some(22));
    // A header whose len is below 40 is taken as a bare header: the LOOKUP without its
    // name finds nothing, and the next bytes are read as the following request.
    let bad = exercise_fuse(&seeds[2].1);
    assert_eq!(bad[0].error, Some(2));
}

#[test]
fn replay_fuzz_corpus() {
    let inputs = replay::inputs("fuse_request");
    for data in &inputs {
        exercise_fuse(data);
    }
    let n = inputs.len();
    assert!(n >= 3, "fuzz corpus has only {n} inputs");
}
