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

fn request(out: &mut Vec<u8>, kind: u16, cookie: u64, offset: u64, len: u32) {
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
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
    ]
}

/// Regenerate the seed corpus: `cargo test -p serve --test nbd_fuzz_corpus -- --ignored`.
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

#[test]
fn replay_fuzz_corpus() {
    let inputs = replay::inputs("nbd_server");
    for data in &inputs {
        serve::fuzzing::exercise_nbd(data);
    }
    let n = inputs.len();
    assert!(n >= 4, "fuzz corpus has only {n} inputs");
}
