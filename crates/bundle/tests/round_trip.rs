//! The property the bundle rests on: replaying a bundle's plan and frames through the
//! COW writer gives, byte for byte, the COW the host wrote, for images with every kind
//! of change; and a payload that is not the one signed is caught.

use std::io::Read;
use std::path::Path;

use bundle::format::Trust;
use bundle::{BundleReader, data::Replayer, plan_wire};
use delta::MemImage;
use delta::write::{CowOptions, write_cow};

fn replay(bytes: &[u8], old: &[u8], dir: &Path) -> Vec<u8> {
    let mut r = BundleReader::open(bytes, Path::new("b"), Trust::Unchecked).unwrap();
    let (part, mut stream) = r.payload().unwrap();
    let mut len = [0u8; 8];
    stream.read_exact(&mut len).unwrap();
    let mut plan_bytes = vec![0u8; u64::from_le_bytes(len) as usize];
    stream.read_exact(&mut plan_bytes).unwrap();
    let plan = plan_wire::decode(&plan_bytes, part.image.new.size).unwrap();
    let o = MemImage::new("old", old.to_vec());
    let pos = stream.position();
    let rep = Replayer::new(
        &o,
        &plan,
        true,
        part.payload.frame_blocks,
        &mut stream,
        pos,
        Path::new("b"),
        part.image.new.size,
    )
    .unwrap();
    let cow = dir.join("replayed.cow");
    let copts = CowOptions {
        version: 3,
        compression: cow::Compression::new(cow::Codec::Lz4),
        compression_factor: 65536,
        threads: 1,
        block_order: false,
    };
    write_cow(&plan, &o, &rep, &cow, &copts, &delta::NoProgress).unwrap();
    rep.finish().unwrap();
    stream.finish().unwrap();
    std::fs::read(&cow).unwrap()
}

#[test]
fn replayed_cows_are_the_hosts_byte_for_byte() {
    for seed in 0..6 {
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = bundle::fuzzing::image_pair(seed, 300 + seed as usize * 97);
        let (bytes, host_cow) =
            bundle::fuzzing::sample(dir.path(), old.clone(), new, None).unwrap();
        assert!(replay(&bytes, &old, dir.path()) == host_cow, "seed {seed}");
    }
}

#[test]
fn a_changed_payload_byte_fails_the_hash_check() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = bundle::fuzzing::image_pair(9, 200);
    let (mut bytes, _) = bundle::fuzzing::sample(dir.path(), old, new, None).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    let mut r = BundleReader::open(&bytes[..], Path::new("b"), Trust::Unchecked).unwrap();
    let (_, mut stream) = r.payload().unwrap();
    std::io::copy(&mut stream, &mut std::io::sink()).unwrap();
    let e = stream.finish().unwrap_err().to_string();
    assert!(e.contains("damaged"), "{e}");
}

#[test]
fn a_spooled_payload_reads_back_what_an_earlier_read_saved() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = bundle::fuzzing::image_pair(3, 400);
    let (bytes, _) = bundle::fuzzing::sample(dir.path(), old, new, None).unwrap();
    let file = dir.path().join("b.vabc");
    std::fs::write(&file, &bytes).unwrap();
    let spool = dir.path().join("payload.part");
    // Reads the whole payload through a spool, after `pre` (bytes an earlier run saved).
    let read_all = |pre: Option<&[u8]>| {
        if let Some(p) = pre {
            std::fs::File::create(&spool).unwrap().write_all(p).unwrap();
        }
        let f = std::fs::File::open(&file).unwrap();
        let mut r = BundleReader::open(f, &file, Trust::Unchecked).unwrap();
        let (_, mut stream) = r.payload().unwrap();
        let resumed = stream.spool(&spool).unwrap();
        let health = stream.source_health();
        let mut got = Vec::new();
        stream.read_to_end(&mut got).unwrap();
        (resumed, got, stream.finish(), health.failed())
    };
    let (_, payload, done, failed) = read_all(None);
    assert!(done.is_ok() && !failed);
    assert_eq!(std::fs::read(&spool).unwrap(), payload, "all of it saved");

    // Killed after `k` bytes: the next read takes them from the spool.
    let k = payload.len() / 3;
    let (resumed, got, done, _) = read_all(Some(&payload[..k]));
    assert_eq!((resumed, got == payload), (k as u64, true));
    assert!(done.is_ok());

    // A spool longer than the payload is someone else's: started again.
    let mut long = payload.clone();
    long.push(0);
    let (resumed, got, done, _) = read_all(Some(&long));
    assert_eq!((resumed, got == payload), (0, true));
    assert!(done.is_ok());

    // A wrong saved byte fails the signed hash, with a healthy source (blame the spool).
    let mut bad = payload[..k].to_vec();
    bad[k / 2] ^= 1;
    let (_, _, done, failed) = read_all(Some(&bad));
    assert!(matches!(done, Err(bundle::BundleError::PayloadHash { .. })));
    assert!(!failed);
}

#[test]
fn a_stream_of_several_groups_replays_byte_for_byte() {
    // Every block changed a little: more data blocks than one group holds, so the
    // replayer decodes groups one after another, the last one short.
    let dir = tempfile::tempdir().unwrap();
    let blocks = bundle::data::GROUP_BLOCKS + 700;
    let (old, _) = bundle::fuzzing::image_pair(5, blocks);
    let mut new = old.clone();
    for (i, b) in new.chunks_mut(delta::BLOCK_SIZE).enumerate() {
        b[i % 4000] ^= 0x5a;
        b[(i * 7) % 4096] ^= 0x33;
    }
    let (bytes, host_cow) = bundle::fuzzing::sample(dir.path(), old.clone(), new, None).unwrap();
    let mut r = BundleReader::open(&bytes[..], Path::new("b"), Trust::Unchecked).unwrap();
    let (part, _) = r.payload().unwrap();
    assert!(part.payload.data_bytes > (bundle::data::GROUP_BLOCKS * delta::BLOCK_SIZE) as u64);
    assert!(replay(&bytes, &old, dir.path()) == host_cow);
}
