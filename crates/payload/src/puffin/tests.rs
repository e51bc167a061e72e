use super::stream::{Layout, huff_stream, locate_puffs, puff_stream};
use super::*;
use std::io::Write;

fn deflate(data: &[u8], level: u32) -> Vec<u8> {
    let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::new(level));
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// Text-like data: words from a small vocabulary, some random bytes.
fn sample(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let words: [&[u8]; 8] = [
        b"update ",
        b"engine ",
        b"puff ",
        b"deflate ",
        b"block ",
        b"\n",
        b"huff ",
        b"0123 ",
    ];
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        if rng.u8(..) < 20 {
            v.push(rng.u8(..));
        } else {
            v.extend_from_slice(words[rng.usize(..words.len())]);
        }
    }
    v.truncate(len);
    v
}

/// Each block's bit extent in a deflate stream.
fn blocks(d: &[u8]) -> Vec<(u64, u64)> {
    let mut r = bits::BitReader::new(d);
    let mut b = Vec::new();
    puff::puff(&mut r, usize::MAX, Some(&mut b)).unwrap();
    b
}

/// Puffs `file` at `deflates` and huffs it back.
fn round_trip(file: &[u8], deflates: &[(u64, u64)]) {
    let l = locate_puffs(file, deflates).unwrap();
    let puffed = puff_stream(file, &l).unwrap();
    assert_eq!(puffed.len() as u64, l.puff_size());
    let back = huff_stream(&puffed, &l, file.len() as u64).unwrap();
    assert!(
        back == file,
        "{} deflates do not round-trip",
        deflates.len()
    );
}

#[test]
fn whole_streams_round_trip_at_every_level() {
    for level in 0..=9 {
        for (seed, len) in [(1, 0), (2, 1), (3, 300), (4, 70_000), (5, 200_000)] {
            let d = deflate(&sample(seed, len), level);
            round_trip(&d, &[(0, d.len() as u64 * 8)]);
        }
    }
}

#[test]
fn blocks_as_separate_deflates_round_trip_inside_a_file() {
    // Sub-block extents, as update_engine locates them: blocks end and start inside
    // bytes, next to each other.
    for level in [1, 6, 9] {
        let d = deflate(&sample(level.into(), 600_000), level);
        let b = blocks(&d);
        assert!(b.len() > 1, "level {level}: one block");
        let mut file = b"header:".to_vec();
        let shift = file.len() as u64 * 8;
        file.extend_from_slice(&d);
        file.extend_from_slice(b"trailer");
        let ext: Vec<_> = b.iter().map(|&(o, l)| (o + shift, l)).collect();
        round_trip(&file, &ext);
        // Every other block: the rest stays as bytes between deflates.
        let some: Vec<_> = ext.iter().copied().step_by(2).collect();
        round_trip(&file, &some);
    }
}

#[test]
fn stored_and_fixed_blocks_round_trip() {
    let mut rng = fastrand::Rng::with_seed(7);
    let random: Vec<u8> = (0..100_000).map(|_| rng.u8(..)).collect();
    let d = deflate(&random, 6);
    let b = blocks(&d);
    round_trip(&d, &b);
    let tiny = deflate(b"a", 9);
    round_trip(&tiny, &[(0, tiny.len() as u64 * 8)]);
}

/// A BSDF2 patch with no compression that writes `new` from its extra stream.
fn literal_bsdiff(new: &[u8]) -> Vec<u8> {
    let mut p = b"BSDF2\0\0\0".to_vec();
    let ctrl = [0i64, new.len() as i64, 0];
    p.extend((24i64).to_le_bytes());
    p.extend(0i64.to_le_bytes());
    p.extend((new.len() as i64).to_le_bytes());
    for c in ctrl {
        p.extend(c.to_le_bytes());
    }
    p.extend_from_slice(new);
    p
}

fn info(l: &[(u64, u64)], file: &[u8]) -> (StreamInfo, Vec<u8>) {
    let lay = locate_puffs(file, l).unwrap();
    let puffed = puff_stream(file, &lay).unwrap();
    let puffs = stream_puffs(file, l);
    (
        StreamInfo {
            deflates: l
                .iter()
                .map(|&(offset, length)| BitExtent { offset, length })
                .collect(),
            puffs: puffs
                .iter()
                .map(|&(o, n)| BitExtent {
                    offset: o * 8,
                    length: n * 8,
                })
                .collect(),
            puff_length: lay.puff_size(),
        },
        puffed,
    )
}

/// The puff extents `locate_puffs` chose.
fn stream_puffs(file: &[u8], l: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let lay: Layout = locate_puffs(file, l).unwrap();
    lay.puffs_for_tests()
}

fn patch(src: &[u8], sd: &[(u64, u64)], dst: &[u8], dd: &[(u64, u64)]) -> Vec<u8> {
    let (s, _) = info(sd, src);
    let (d, dst_puffed) = info(dd, dst);
    let h = PatchHeader {
        version: 1,
        src: Some(s),
        dst: Some(d),
        r#type: 0,
    };
    let h = prost::Message::encode_to_vec(&h);
    let mut p = MAGIC.to_vec();
    p.extend((h.len() as u32).to_be_bytes());
    p.extend(h);
    p.extend(literal_bsdiff(&dst_puffed));
    p
}

#[test]
fn a_patch_makes_its_destination() {
    let src = deflate(&sample(10, 50_000), 6);
    let dst = deflate(&sample(11, 60_000), 9);
    let p = patch(&src, &blocks(&src), &dst, &blocks(&dst));
    assert!(apply(&src, &p, dst.len() as u64).unwrap() == dst);
    // A destination larger than the operation writes is refused.
    assert!(apply(&src, &p, dst.len() as u64 - 1).is_err());
}

#[test]
fn damaged_patches_and_sources_are_errors() {
    let src = deflate(&sample(12, 20_000), 6);
    let dst = deflate(&sample(13, 20_000), 6);
    let p = patch(&src, &blocks(&src), &dst, &blocks(&dst));
    let max = dst.len() as u64;
    assert!(matches!(
        apply(&src, b"PUF2\0\0\0\0", max),
        Err(PuffError::Magic(_))
    ));
    assert!(apply(&src, &p[..7], max).is_err());
    assert!(apply(&src, &p[..p.len() / 2], max).is_err());
    // Another source does not puff to the sizes the patch says.
    let other = deflate(&sample(14, 20_000), 6);
    assert!(apply(&other, &p, max).is_err());
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..300 {
        let mut q = p.clone();
        let i = rng.usize(..q.len());
        q[i] ^= 1 << rng.u8(0..8);
        // Whatever a flipped bit does, it is an error or some output, never a panic.
        let _ = apply(&src, &q, max);
    }
}

// Vectors made by puffin's own tool and unit tests (tests/vectors/puffin,
// PROVENANCE.md there).

fn vector(name: &str) -> Vec<u8> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/vectors/puffin")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn cases() -> Vec<String> {
    String::from_utf8(vector("cases.txt"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

#[test]
fn puffins_patches_make_their_targets() {
    let names = cases();
    assert!(names.len() >= 5, "{names:?}");
    for name in names {
        let (src, dst) = (
            vector(&format!("{name}.src")),
            vector(&format!("{name}.dst")),
        );
        let patch = vector(&format!("{name}.patch"));
        let got = apply(&src, &patch, dst.len() as u64).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == dst, "{name}: the target differs");
    }
}

#[test]
fn sources_puff_and_targets_huff_as_puffins_tool_does() {
    for name in cases() {
        let patch = vector(&format!("{name}.patch"));
        let p = parse(&patch, u64::MAX / 32, u64::MAX / 32).unwrap();
        for (side, l) in [("src", &p.src), ("dst", &p.dst)] {
            let file = vector(&format!("{name}.{side}"));
            let puffed = vector(&format!("{name}.{side}.puff"));
            let ours = puff_stream(&file, l).unwrap_or_else(|e| panic!("{name}.{side}: {e}"));
            assert!(ours == puffed, "{name}.{side}: the puffed form differs");
            let back = huff_stream(&puffed, l, file.len() as u64).unwrap();
            assert!(back == file, "{name}.{side}: huffing differs");
        }
    }
}

fn unit(name: &str) -> Vec<u8> {
    vector(&format!("unittest/{name}.bin"))
}

/// An extent list of unittest/extents.txt.
fn unit_extents(name: &str) -> Vec<(u64, u64)> {
    let text = String::from_utf8(vector("unittest/extents.txt")).unwrap();
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("{name} is not in extents.txt"));
    line.split_whitespace()
        .skip(1)
        .map(|e| {
            let (o, l) = e.split_once(':').unwrap();
            (o.parse().unwrap(), l.parse().unwrap())
        })
        .collect()
}

#[test]
fn puffins_unit_vectors_puff_and_huff() {
    // Single deflates and their puffs.
    for n in ["1", "1_1", "2", "3", "4", "7", "7_2", "7_3", "7_4", "10"] {
        let (d, p) = (unit(&format!("kDeflate{n}")), unit(&format!("kPuff{n}")));
        let mut r = bits::BitReader::new(&d);
        let got = puff::puff(&mut r, p.len(), None).unwrap_or_else(|e| panic!("{n}: {e}"));
        assert_eq!(got, p, "kDeflate{n} puffs differently");
        let mut w = bits::BitWriter::new(d.len());
        huff::huff(&p, &mut w).unwrap_or_else(|e| panic!("{n}: {e}"));
        assert_eq!(w.into_bytes(), d, "kPuff{n} huffs differently");
    }
    // Invalid ones: a stored block's length and complement disagree; type 3.
    for n in ["5", "6"] {
        let d = unit(&format!("kDeflate{n}"));
        assert!(puff::puff(&mut bits::BitReader::new(&d), 1 << 16, None).is_err());
    }
    // Streams with several deflates at bit extents.
    for (d, ext, puffs, p) in [
        (
            "kDeflates8",
            "kSubblockDeflateExtents8",
            "kPuffExtents8",
            "kPuffs8",
        ),
        (
            "kDeflates9",
            "kSubblockDeflateExtents9",
            "kPuffExtents9",
            "kPuffs9",
        ),
        (
            "kDeflate11",
            "kSubblockDeflateExtents11",
            "kPuffExtents11",
            "kPuff11",
        ),
    ] {
        let (d, p) = (unit(d), unit(p));
        let l = Layout::new(&unit_extents(ext), &unit_extents(puffs), p.len() as u64).unwrap();
        assert_eq!(puff_stream(&d, &l).unwrap(), p, "{ext}");
        assert_eq!(huff_stream(&p, &l, d.len() as u64).unwrap(), d, "{ext}");
    }
}

#[test]
fn puffins_unit_patches_apply() {
    let (d8, d9) = (unit("kDeflates8"), unit("kDeflates9"));
    assert_eq!(apply(&d8, &unit("kPatch8To9"), 1 << 20).unwrap(), d9);
    assert_eq!(apply(&d9, &unit("kPatch9To8"), 1 << 20).unwrap(), d8);
    assert_eq!(apply(&d8, &unit("kPatch8ToEmpty"), 1 << 20).unwrap(), b"");
    assert_eq!(
        apply(&d8, &unit("kPatch8ToNoDeflate"), 1 << 20).unwrap(),
        [11, 22, 33, 44]
    );
}

#[test]
fn inconsistent_extents_are_refused() {
    let patch = vector("zip.patch");
    let (src, dst) = (vector("zip.src"), vector("zip.dst"));
    let n = u32::from_be_bytes([patch[4], patch[5], patch[6], patch[7]]) as usize;
    let mut h: PatchHeader = prost::Message::decode(&patch[8..8 + n]).unwrap();
    let reencode = |h: &PatchHeader| {
        let b = prost::Message::encode_to_vec(h);
        let mut p = MAGIC.to_vec();
        p.extend((b.len() as u32).to_be_bytes());
        p.extend(b);
        p.extend_from_slice(&patch[8 + n..]);
        p
    };
    assert!(apply(&src, &reencode(&h), dst.len() as u64).unwrap() == dst);
    // A puff that is not whole bytes.
    let mut bad = h.clone();
    bad.dst.as_mut().unwrap().puffs[0].offset += 3;
    let e = apply(&src, &reencode(&bad), dst.len() as u64).unwrap_err();
    assert!(e.to_string().contains("not whole bytes"), "{e}");
    // A puffed size that claims gigabytes for a small file.
    h.src.as_mut().unwrap().puff_length = 1 << 40;
    let e = apply(&src, &reencode(&h), dst.len() as u64).unwrap_err();
    assert!(e.to_string().contains("can puff to"), "{e}");
}
