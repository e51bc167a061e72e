#!/usr/bin/env python3
"""Mutation run: damaged COWs through every command that reads one.

Each mutant is a copy of a good COW with one damage: bytes flipped (anywhere outside
the scratch area, in the header, among the op records and data), a range zeroed, the
file truncated, or the merge record (num_merge_ops, the scratch state byte) set to
another value. Its manifest is the good COW's. Each mutant goes through
  inspect, inspect --check --base, apply, merge (on a copy of the base), and, for every
  SERVE_EVERY-th mutant, serve --fuse with a full read of the exported file,
and every outcome is classified:
  wrong output   exit 0 (or data served) that is not the expected image
  base modified  merge failed and the base is no longer what it was
  panic          exit 101 or "panicked at" on stderr
  hang           not finished within the time limit
Anything else (a clear refusal, a success with the right result) is fine.

Sources: the shared AOSP vectors (each with a manifest made by `vabc manifest`) and a
corpus COW (`vabc diff` of the tiny ext4 pair).

Usage: bench/mutants.py [--vectors N] [--corpus N] [--seed S] [--serve-every K]
Env: VABC (default target/release/vabc), VABC_CORPUS (default $TMPDIR/corpus).
Exit status 1 if any mutant was classified as one of the four failures.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VABC = os.environ.get("VABC") or str(ROOT / "target/release/vabc")
TIMEOUT = 60


def run(args, timeout=TIMEOUT):
    """(exit code or 'hang', stderr)"""
    try:
        p = subprocess.run([VABC, *args], capture_output=True, timeout=timeout)
        return p.returncode, p.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        return "hang", ""


def same(a, b):
    with open(a, "rb") as x, open(b, "rb") as y:
        while True:
            p, q = x.read(1 << 20), y.read(1 << 20)
            if p != q:
                return False
            if not p:
                return True


def prefix_equals(path, expected):
    """Whether the first len(expected) bytes of path equal expected's."""
    n = os.path.getsize(expected)
    with open(path, "rb") as x, open(expected, "rb") as y:
        while n > 0:
            k = min(n, 1 << 20)
            if x.read(k) != y.read(k):
                return False
            n -= k
    return True


class Source:
    def __init__(self, name, base, expected, cow, manifest, work):
        self.name, self.base, self.expected, self.cow, self.manifest = name, base, expected, cow, manifest
        info = json.loads(subprocess.run([VABC, "inspect", cow, "--json"], capture_output=True, check=True).stdout)
        h = info["header"]
        self.size = os.path.getsize(cow)
        self.header_size = h["header_size"]
        self.scratch = (h["header_size"], h["header_size"] + h.get("buffer_size", 0))
        self.work = work


def mutate(src, rng, out):
    data = bytearray(open(src.cow, "rb").read())
    kind = rng.choice(["flip", "flip", "flip", "header", "zero", "truncate", "counter", "state"])
    lo, hi = src.scratch

    def pick():
        while True:
            off = rng.randrange(len(data))
            if not (lo <= off < hi):
                return off

    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            data[pick()] ^= 1 << rng.randrange(8)
    elif kind == "header":
        for _ in range(rng.randint(1, 2)):
            data[rng.randrange(src.header_size)] ^= 1 << rng.randrange(8)
    elif kind == "zero":
        off = pick()
        n = rng.randint(1, 4096)
        data[off:off + n] = bytes(len(data[off:off + n]))
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "counter":
        v = rng.choice([1, 2, rng.randrange(1, 1 << 16), (1 << 64) - 1])
        data[26:34] = v.to_bytes(8, "little")
    elif kind == "state":
        if src.header_size < len(data):
            data[src.header_size] = rng.choice([1, 2, 3, 255])
    open(out, "wb").write(data)
    return kind


def serve_read(base, cow, expected, d):
    """Serve through FUSE and read everything: 'ok', 'refused', 'wrong', 'panic' or 'hang'."""
    fuse = d / "fuse"
    fuse.mkdir(exist_ok=True)
    ready = d / "ready.json"
    if ready.exists():
        ready.unlink()
    p = subprocess.Popen([VABC, "serve", "--base", base, "--cow", cow, "--fuse", str(fuse),
                          "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + TIMEOUT
    while not ready.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if not ready.exists():
        if p.poll() is None:
            p.kill()
            p.wait()
            return "hang"
        err = p.stderr.read().decode(errors="replace")
        return "panic" if p.returncode == 101 or "panicked at" in err else "refused"
    verdict = "ok"
    try:
        n = os.path.getsize(expected)
        with open(fuse / "disk.img", "rb") as f, open(expected, "rb") as e:
            off = 0
            while off < n:
                want = e.read(1 << 20)
                try:
                    got = os.pread(f.fileno(), len(want), off)
                except OSError:
                    got = None  # an error is an acceptable answer; wrong bytes are not
                if got is not None and got != want[: len(got)]:
                    verdict = "wrong"
                    break
                off += len(want)
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            verdict = "hang"
    if p.returncode == 101:
        verdict = "panic"
    return verdict


def one(src, rng, i, serve_every, tally, failures):
    d = src.work / f"m{i}"
    d.mkdir()
    cow = d / "u.cow"
    kind = mutate(src, rng, cow)
    shutil.copy(src.manifest, str(cow) + ".manifest")
    out = d / "out.img"
    results = {}
    results["inspect"] = run(["inspect", str(cow)])
    results["check"] = run(["inspect", str(cow), "--check", "--base", src.base])
    rc, err = run(["apply", "--base", src.base, "--cow", str(cow), "-o", str(out)])
    results["apply"] = (rc, err)
    wrong = []
    if rc == 0 and not same(out, src.expected):
        wrong.append("apply")
    base = d / "base.img"
    shutil.copy(src.base, base)
    mcow = d / "merge.cow"
    shutil.copy(cow, mcow)
    shutil.copy(src.manifest, str(mcow) + ".manifest")
    rc, err = run(["merge", "--base", str(base), "--cow", str(mcow)])
    results["merge"] = (rc, err)
    modified = False
    if rc == 0 and not prefix_equals(base, src.expected):
        wrong.append("merge")
    if rc not in (0, "hang") and not same(base, src.base):
        modified = True
    served = None
    if serve_every and i % serve_every == 0:
        served = serve_read(src.base, str(cow), src.expected, d)
        if served == "wrong":
            wrong.append("serve")
    for cmd, (rc, err) in results.items():
        t = tally.setdefault(cmd, {"runs": 0, "ok": 0, "refused": 0, "wrong": 0, "panic": 0, "hang": 0, "base_modified": 0})
        t["runs"] += 1
        if rc == "hang":
            t["hang"] += 1
            failures.append((src.name, i, kind, cmd, "hang"))
        elif rc == 101 or "panicked at" in err:
            t["panic"] += 1
            failures.append((src.name, i, kind, cmd, "panic: " + err[-300:]))
        elif cmd in wrong:
            t["wrong"] += 1
            failures.append((src.name, i, kind, cmd, "wrong output with exit 0"))
        elif rc == 0:
            t["ok"] += 1
        else:
            t["refused"] += 1
        if cmd == "merge" and modified:
            t["base_modified"] += 1
            failures.append((src.name, i, kind, cmd, "failed merge modified the base: " + err[-300:]))
    if served is not None:
        t = tally.setdefault("serve", {"runs": 0, "ok": 0, "refused": 0, "wrong": 0, "panic": 0, "hang": 0, "base_modified": 0})
        t["runs"] += 1
        key = {"ok": "ok", "refused": "refused", "wrong": "wrong", "panic": "panic", "hang": "hang"}[served]
        t[key] += 1
        if served in ("wrong", "panic", "hang"):
            failures.append((src.name, i, kind, "serve", served))
    shutil.rmtree(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vectors", type=int, default=1700)
    ap.add_argument("--corpus", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--serve-every", type=int, default=10)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    vec = ROOT.parent / "shared/aosp-cow-vectors"
    corpus = Path(os.environ.get("VABC_CORPUS") or Path(tempfile.gettempdir()) / "corpus")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="vabc-mutants.") as tmp:
        tmp = Path(tmp)
        sources = []
        for cow in sorted(vec.glob("*.cow")):
            if "badseq" in cow.name:
                continue
            m = tmp / (cow.name + ".manifest")
            subprocess.run([VABC, "manifest", str(vec / "base.img"), str(vec / "expected.img"),
                            "--cow", str(cow), "-o", str(m)], check=True, capture_output=True)
            w = tmp / cow.stem
            w.mkdir()
            sources.append(Source(cow.name, str(vec / "base.img"), str(vec / "expected.img"), str(cow), str(m), w))
        if a.corpus:
            old, new = corpus / "tiny/old.ext4.img", corpus / "tiny/new.ext4.img"
            if not new.exists():
                subprocess.run(["bash", str(ROOT.parent / "shared/corpus/make-corpus.sh"), "-p", "tiny", "-o", str(corpus)],
                               check=True, stdout=subprocess.DEVNULL)
            cow = tmp / "tiny.cow"
            subprocess.run([VABC, "diff", str(old), str(new), "-o", str(cow)], check=True, capture_output=True)
            w = tmp / "tiny"
            w.mkdir()
            corpus_src = Source("tiny-ext4 (vabc diff)", str(old), str(new), str(cow), str(cow) + ".manifest", w)
        tally = {}
        failures = []
        per_source = {}
        plan = [(sources[i % len(sources)], i) for i in range(a.vectors)]
        if a.corpus:
            plan += [(corpus_src, a.vectors + i) for i in range(a.corpus)]
        for n, (src, i) in enumerate(plan):
            one(src, rng, i, a.serve_every, tally, failures)
            per_source[src.name] = per_source.get(src.name, 0) + 1
            if n % 100 == 99:
                print(f"mutants: {n + 1}/{len(plan)} ({time.time() - t0:.0f} s), {len(failures)} failures", file=sys.stderr, flush=True)
    secs = time.time() - t0
    print(f"\n{len(plan)} mutants ({a.vectors} of {len(sources)} AOSP vectors, {a.corpus} of a corpus COW), "
          f"seed {a.seed}, {secs:.0f} s; vabc {VABC}\n")
    print("| command | runs | ok (right result) | refused (clear error) | wrong output, exit 0 | base modified by a failed merge | panic | hang |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for cmd in ["inspect", "check", "apply", "merge", "serve"]:
        t = tally.get(cmd)
        if t:
            name = {"check": "inspect --check"}.get(cmd, cmd)
            print(f"| {name} | {t['runs']} | {t['ok']} | {t['refused']} | {t['wrong']} | {t['base_modified']} | {t['panic']} | {t['hang']} |")
    for f in failures[:50]:
        print("FAILURE:", *f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
