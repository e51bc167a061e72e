//! Replays the fuzz corpora of the payload reader and the patch formats
//! (fuzz/corpus/{payload_read,bspatch,puffpatch,lz4diff,zucchini}) through their targets'
//! bodies in the normal test run, and regenerates their seeds: sample payloads and
//! patches (puffin's own among them), and damaged copies.

#[path = "../../../fuzz/replay.rs"]
mod replay;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let (full, _) = payload::fuzzing::sample_full(None);
    let (inc, _, _) = payload::fuzzing::sample_incremental(dir.path(), None);
    let mut out = vec![
        ("full".to_string(), full.clone()),
        ("incremental".into(), inc.clone()),
    ];
    for (name, at) in [
        ("magic", 0),
        ("version", 11),
        ("manifest_len", 19),
        ("manifest", 40),
    ] {
        let mut b = full.clone();
        b[at] ^= 0x41;
        out.push((name.to_string(), b));
    }
    out.push(("truncated".into(), inc[..inc.len() * 2 / 3].to_vec()));
    out
}

/// bspatch seeds: a BSDIFF40 patch made by the `bsdiff` tool, the same in BSDF2 with
/// brotli streams, and a damaged copy of each.
fn bspatch_seeds() -> Vec<(String, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let old = payload::fuzzing::image(7, 2);
    let mut new = old.clone();
    new[100..200].fill(7);
    new.splice(3000..3000, *b"moved");
    new.truncate(old.len());
    let p40 = payload::fuzzing::bsdiff_tool(dir.path(), &old, &new);
    let p2 = payload::fuzzing::bsdf2_from_bsdiff40(&p40);
    let mut out = Vec::new();
    for (name, p) in [("bsdiff40", p40), ("bsdf2", p2)] {
        out.push((name.to_string(), payload::fuzzing::bspatch_input(&old, &p)));
        let mut bad = p.clone();
        let at = bad.len() / 2;
        bad[at] ^= 0x10;
        out.push((
            format!("{name}_damaged"),
            payload::fuzzing::bspatch_input(&old, &bad),
        ));
    }
    out
}

#[test]
fn bspatch_corpus_replays_without_panics() {
    let inputs = replay::inputs("bspatch");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        payload::fuzzing::exercise_bspatch(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/bspatch/seed_*"]
fn generate_bspatch_seed_corpus() {
    replay::write_seeds("bspatch", bspatch_seeds());
}

#[test]
fn corpus_replays_without_panics() {
    let inputs = replay::inputs("payload_read");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        payload::fuzzing::exercise_read(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/payload_read/seed_*"]
fn generate_seed_corpus() {
    replay::write_seeds("payload_read", seeds());
}

#[test]
fn seeds_behave() {
    for (name, data) in seeds() {
        payload::fuzzing::exercise_read(&data);
        let r = payload::fuzzing::open(&data);
        match name.as_str() {
            "full" | "incremental" | "truncated" => assert!(r.is_ok(), "{name}"),
            "magic" | "version" | "manifest_len" => assert!(r.is_err(), "{name}"),
            _ => {}
        }
    }
}

/// A few thousand random byte changes of the seeds, every run: a cheap fuzzer between
/// libFuzzer runs.
#[test]
fn random_damage_to_the_seeds_never_panics() {
    let mut rng = fastrand::Rng::with_seed(45);
    let mut damage = |seed: &[u8]| {
        let mut b = seed.to_vec();
        for _ in 0..rng.usize(1..8) {
            let at = rng.usize(..b.len());
            match rng.u8(..3) {
                0 => b[at] = rng.u8(..),
                1 => b[at] ^= 1 << rng.u8(..8),
                _ => b.truncate(at.max(1)),
            }
        }
        b
    };
    for (_, s) in seeds() {
        for _ in 0..150 {
            payload::fuzzing::exercise_read(&damage(&s));
        }
    }
    for (_, s) in bspatch_seeds() {
        for _ in 0..500 {
            payload::fuzzing::exercise_bspatch(&damage(&s));
        }
    }
}

/// `input`, and a copy with one byte changed in its second half.
fn with_damaged(name: &str, input: Vec<u8>) -> Vec<(String, Vec<u8>)> {
    let mut bad = input.clone();
    let at = bad.len() * 3 / 4;
    bad[at] ^= 0x10;
    vec![(name.to_string(), input), (format!("{name}_damaged"), bad)]
}

/// puffpatch seeds: puffin's own patches (its tool's and its unit tests').
fn puffpatch_seeds() -> Vec<(String, Vec<u8>)> {
    let v = payload::fuzzing::puffin_vector;
    let mut out = Vec::new();
    for name in ["zip", "stored", "deflate", "bitgaps"] {
        let input = payload::fuzzing::bspatch_input(
            &v(&format!("{name}.src")),
            &v(&format!("{name}.patch")),
        );
        out.extend(with_damaged(name, input));
    }
    let input = payload::fuzzing::bspatch_input(
        &v("unittest/kDeflates8.bin"),
        &v("unittest/kPatch8To9.bin"),
    );
    out.extend(with_damaged("kPatch8To9", input));
    out
}

/// lz4diff seeds: a patch as update_engine's generator makes it, with block fixes.
fn lz4diff_seeds() -> Vec<(String, Vec<u8>)> {
    use payload::lz4diff::{CompressionAlgorithm, compress_for_tests, make_patch};
    let dir = tempfile::tempdir().unwrap();
    let hc = |level| CompressionAlgorithm { r#type: 2, level };
    let old = payload::fuzzing::image(8, 4);
    let mut new = old.clone();
    new[5000..5100].fill(3);
    let (oc, oi) = compress_for_tests(&hc(9), &old, 4096, true);
    let (nc, ni) = compress_for_tests(&hc(12), &new, 4096, true);
    let p = make_patch((&oc, &oi), (&nc, &ni), &hc(9), true, dir.path());
    with_damaged("lz4hc", payload::fuzzing::bspatch_input(&oc, &p))
}

#[test]
fn puffpatch_corpus_replays_without_panics() {
    let inputs = replay::inputs("puffpatch");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        payload::fuzzing::exercise_puffpatch(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/puffpatch/seed_*"]
fn generate_puffpatch_seed_corpus() {
    replay::write_seeds("puffpatch", puffpatch_seeds());
}

#[test]
fn lz4diff_corpus_replays_without_panics() {
    let inputs = replay::inputs("lz4diff");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        payload::fuzzing::exercise_lz4diff(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/lz4diff/seed_*"]
fn generate_lz4diff_seed_corpus() {
    replay::write_seeds("lz4diff", lz4diff_seeds());
}

/// zucchini seeds: a raw ensemble patch of blocks with copies, differences and extra
/// data, uncompressed.
fn zucchini_seeds() -> Vec<(String, Vec<u8>)> {
    let old = payload::fuzzing::image(12, 4);
    let mut new = old[4096..].to_vec();
    new.extend_from_slice(&old[..4096]);
    new[10] ^= 1;
    new[5000..5100].fill(9);
    let p = payload::zucchini::raw_patch_for_tests(&old, &new);
    with_damaged("raw", payload::fuzzing::bspatch_input(&old, &p))
}

#[test]
fn zucchini_corpus_replays_without_panics() {
    let inputs = replay::inputs("zucchini");
    assert!(!inputs.is_empty(), "empty corpus");
    for input in inputs {
        payload::fuzzing::exercise_zucchini(&input);
    }
}

#[test]
#[ignore = "regenerates fuzz/corpus/zucchini/seed_*"]
fn generate_zucchini_seed_corpus() {
    replay::write_seeds("zucchini", zucchini_seeds());
}
