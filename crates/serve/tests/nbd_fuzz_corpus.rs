//! Replays the fuzz corpus of the NBD target (fuzz/corpus/nbd_server) through
//! the target's body in the normal test run, and regenerates its seeds: the
//! byte streams real clients send (option haggling, reads, flushes, refused
//! writes, disconnects).

#[path = "../../../fuzz/replay.rs"]
mod replay;

const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const REQUEST_MAGIC: u32 = 0x2560_9513;

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// OPT_INFO / OPT_GO payload: export name and the info types asked for.
fn info_request(name: &[u8], infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name);
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// LIST/SET_META_CONTEXT payload: export "" and the queries.
fn meta_request(queries: &[&[u8]]) -> Vec<u8> {
    let mut d = 0u32.to_be_bytes().to_vec();
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        d.extend_from_slice(q);
    }
    d
}

fn request(out: &mut Vec<u8>, kind: u16, cookie: u64, offset: u64, len: u32) {
    request_flagged(out, 0, kind, cookie, offset, len);
}

fn request_flagged(out: &mut Vec<u8>, flags: u16, kind: u16, cookie: u64, offset: u64, len: u32) {
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let size = (1u64 << 20) + 1000; // the fuzz device's size
    let transmission = |out: &mut Vec<u8>| {
        request(out, 0, 1, 0, 4096); // READ
        request(out, 0, 2, size - 100, 100); // READ ending at the device's end
        request(out, 0, 3, size - 100, 200); // READ past the end: EINVAL
        request(out, 3, 4, 0, 0); // FLUSH
        request(out, 1, 5, 0, 8); // WRITE: refused, its data skipped
        out.extend_from_slice(b"ignored!");
        request(out, 4, 6, 0, 4096); // TRIM: refused
        request(out, 9, 7, 0, 0); // unknown command
        request(out, 2, 8, 0, 0); // DISC
    };
    let mut go = 3u32.to_be_bytes().to_vec(); // FIXED_NEWSTYLE | NO_ZEROES
    option(&mut go, 3, &[]); // LIST
    option(&mut go, 6, &info_request(b"", &[0, 3])); // INFO
    option(&mut go, 6, &info_request(b"nope", &[])); // INFO, unknown export
    option(&mut go, 5, b"x"); // unsupported option
    option(&mut go, 7, &info_request(b"", &[3])); // GO
    transmission(&mut go);

    let mut oldstyle = 1u32.to_be_bytes().to_vec(); // no NO_ZEROES: 124 zero bytes
    option(&mut oldstyle, 1, b""); // EXPORT_NAME
    transmission(&mut oldstyle);

    // Structured replies and base:allocation, then READs and BLOCK_STATUS.
    let mut structured = 3u32.to_be_bytes().to_vec();
    option(&mut structured, 9, &meta_request(&[])); // LIST_META_CONTEXT: all
    option(&mut structured, 10, &meta_request(&[b"base:allocation"])); // too early
    option(&mut structured, 8, &[]); // STRUCTURED_REPLY
    option(&mut structured, 10, &meta_request(&[b"base:allocation"])); // SET
    option(&mut structured, 7, &info_request(b"", &[]));
    request(&mut structured, 0, 1, 0, 4096); // READ: OFFSET_DATA
    request(&mut structured, 7, 2, 0, 1 << 20); // BLOCK_STATUS
    request_flagged(&mut structured, 1 << 3, 7, 3, 0, 1 << 20); // REQ_ONE
    request(&mut structured, 0, 4, size - 100, 200); // READ past the end: ERROR
    request(&mut structured, 7, 5, size, 1); // BLOCK_STATUS past the end
    request(&mut structured, 2, 6, 0, 0); // DISC

    let mut abort = 1u32.to_be_bytes().to_vec();
    option(&mut abort, 2, &[]);

    let mut bad = 3u32.to_be_bytes().to_vec();
    option(&mut bad, 7, &info_request(b"", &[]));
    request(&mut bad, 0, 1, 0, 512);
    bad.extend_from_slice(&[0xff; 28]); // bad request magic

    vec![
        ("go", go),
        ("export_name", oldstyle),
        ("abort", abort),
        ("bad_magic", bad),
        ("structured", structured),
    ]
}

/// Regenerate the seed corpus: `cargo test -p vabc-serve --test nbd_fuzz_corpus -- --ignored`.
#[test]
#[ignore]
fn generate_seed_corpus() {
    replay::write_seeds("nbd_server", seeds());
}

/// The simple reply (error, data that follows) for `cookie` in a server's byte stream.
fn reply(out: &[u8], cookie: u64, data_len: usize) -> Option<(u32, &[u8])> {
    let mut magic_and_cookie = Vec::new();
    magic_and_cookie.extend_from_slice(&0x6744_6698u32.to_be_bytes());
    out.windows(16).enumerate().find_map(|(i, h)| {
        (h[..4] == magic_and_cookie[..] && h[8..] == cookie.to_be_bytes()).then(|| {
            let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
            let len = if err == 0 { data_len } else { 0 };
            (err, &out[i + 16..(i + 16 + len).min(out.len())])
        })
    })
}

#[test]
fn every_request_of_a_session_is_answered() {
    let size = (1u64 << 20) + 1000;
    let pattern = |off: u64, len: usize| -> Vec<u8> {
        (0..len as u64).map(|i| ((off + i) % 251) as u8).collect()
    };
    for (name, data) in seeds() {
        if name != "go" && name != "export_name" {
            continue;
        }
        let out = serve::fuzzing::exercise_nbd(&data);
        assert_eq!(
            reply(&out, 1, 4096),
            Some((0, &pattern(0, 4096)[..])),
            "{name}"
        );
        assert_eq!(
            reply(&out, 2, 100),
            Some((0, &pattern(size - 100, 100)[..])),
            "{name}"
        );
        let einval = 22;
        let eperm = 1;
        assert_eq!(reply(&out, 3, 0).map(|r| r.0), Some(einval), "{name}");
        assert_eq!(reply(&out, 4, 0).map(|r| r.0), Some(0), "{name}");
        assert_eq!(reply(&out, 5, 0).map(|r| r.0), Some(eperm), "{name}");
        assert_eq!(reply(&out, 6, 0).map(|r| r.0), Some(eperm), "{name}");
        assert_eq!(reply(&out, 7, 0).map(|r| r.0), Some(einval), "{name}");
        assert_eq!(reply(&out, 8, 0), None, "{name}: DISC gets no reply");
    }
}

/// The structured chunk (flags, type, payload) for `cookie` in a server's byte stream.
fn chunk(out: &[u8], cookie: u64) -> Option<(u16, u16, &[u8])> {
    out.windows(20).enumerate().find_map(|(i, h)| {
        (h[..4] == 0x668e_33efu32.to_be_bytes() && h[8..16] == cookie.to_be_bytes()).then(|| {
            let flags = u16::from_be_bytes([h[4], h[5]]);
            let kind = u16::from_be_bytes([h[6], h[7]]);
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            (flags, kind, &out[i + 20..(i + 20 + len).min(out.len())])
        })
    })
}

#[test]
fn a_structured_session_gets_structured_replies() {
    let (_, data) = seeds()
        .into_iter()
        .find(|(n, _)| *n == "structured")
        .unwrap();
    let out = serve::fuzzing::exercise_nbd(&data);
    let (flags, kind, d) = chunk(&out, 1).expect("READ reply");
    assert_eq!((flags, kind), (1, 1), "OFFSET_DATA, DONE");
    assert_eq!(&d[..8], &0u64.to_be_bytes());
    let pattern: Vec<u8> = (0..4096u64).map(|i| (i % 251) as u8).collect();
    assert!(d[8..] == pattern[..]);
    // The fuzz device stores everything: one data descriptor (length, flags 0).
    let (_, kind, d) = chunk(&out, 2).expect("BLOCK_STATUS reply");
    assert_eq!((kind, &d[4..]), (5, &[0, 0x10, 0, 0, 0, 0, 0, 0][..]));
    assert_eq!(chunk(&out, 3).map(|c| c.2.len()), Some(12), "REQ_ONE");
    let error = (1 << 15) + 1;
    assert_eq!(
        chunk(&out, 4).map(|c| (c.1, c.2[..4].to_vec())),
        Some((error, 22u32.to_be_bytes().to_vec()))
    );
    assert_eq!(chunk(&out, 5).map(|c| c.1), Some(error));
    assert_eq!(chunk(&out, 6), None, "DISC gets no reply");
}

#[test]
fn replay_fuzz_corpus() {
    let inputs = replay::inputs("nbd_server");
    for data in &inputs {
        serve::fuzzing::exercise_nbd(data);
    }
    let n = inputs.len();
    assert!(n >= 4, "fuzz corpus has only {n} inputs");
}
