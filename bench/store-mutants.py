#!/usr/bin/env python3
"""Mutation run over a device's update store: does anything unsigned boot or merge?

Someone who can write the data partition changes the store between two steps of an
update, and the device goes on. A device (the tiny ext4 pair's old image as its base,
a store, a signed --verity bundle) is brought to a point, the store is saved, and each
mutant is that store with one change:

  byte      bytes flipped in one store file (state, update.head, the COW, its
            manifest, the tree, the version record), anywhere or in its first 4 KiB
  zero      a range of one file zeroed
  truncate  one file cut short (or emptied)
  append    bytes added at the end of one file
  remove    one file deleted
  link      one file replaced by a symbolic link to a file outside the store
  swap      the COW (and its manifest) replaced by a valid COW of the old image to
            another image; or the signed head by another signed bundle's
  state     one field of the state file changed: a file name to a path outside the
            store, the base to another file, the update id, the step (installed,
            merging, none), the boot attempts

Two points: `install` (the mutant is booted: `vabc update boot`, read whole when
served) and `mark-good` (the state says merging; the boot serves and merges, and the
run waits for the merge to end or be refused). Every mutant is classified:

  unsigned boot   the served device returned data that is not the new image
  unsigned merge  the base ended as neither the old image nor the new one
  refused merge changed the base   the merge was refused, and the base changed
  outside touched a file outside the store changed or appeared (victims beside it)
  panic           exit 101, "panicked at" on stderr, or killed by a signal (abort)
  hang            a step did not finish within the time limit

Anything else (a refusal, the base booted, a boot of the new image, a merge to the new
image) is fine; a boot that halts (exit 4) is fine. With --json, a machine-readable
summary. Exit status 1 if any mutant was one of the failures above.

Usage: bench/store-mutants.py [--install N] [--mark-good N] [--seed S]
Env: VABC (default target/release/vabc), VABC_CORPUS (default $TMPDIR/corpus).
"""
import argparse
import hashlib
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
CORPUS = Path(os.environ.get("VABC_CORPUS") or Path(tempfile.gettempdir()) / "corpus")
TIMEOUT = 60
FILES = ["state", "state.copy", "update.head", "system.cow", "system.cow.manifest", "system.verity", "version"]
FAILURES = ["unsigned boot", "unsigned merge", "refused merge changed the base",
            "outside touched", "panic", "hang"]


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def vabc(*args, timeout=TIMEOUT):
    """(exit code, stdout, stderr); 'hang' for a timeout."""
    try:
        p = subprocess.run([VABC, *args], capture_output=True, timeout=timeout)
        return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        return "hang", "", ""


def panicked(code, err):
    return code == 101 or (isinstance(code, int) and code < 0) or "panicked at" in err


class Device:
    def __init__(self, work):
        self.work = work
        self.old = CORPUS / "tiny/old.ext4.img"
        self.new = CORPUS / "tiny/new.ext4.img"
        if not self.old.exists():
            subprocess.run([str(ROOT.parent / "shared/corpus/make-corpus.sh"), "tiny"],
                           check=True, env={**os.environ, "VABC_CORPUS": str(CORPUS)})
        self.old_sha, self.new_sha = sha(self.old), sha(self.new)
        self.base = work / "base.img"
        self.store = work / "store"
        self.run = work / "run"
        self.outside = work / "outside"
        key = work / "k.pem"
        self.pub = work / "k.pub.pem"
        subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)],
                       check=True, capture_output=True)
        subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(self.pub)],
                       check=True)
        self.bundle = work / "u.vabc"
        self.other = work / "other.vabc"
        part = f"system={self.old},{self.new}"
        for out in (self.bundle, self.other):
            code, _, err = vabc("bundle", "create", "-p", part, "-o", str(out), "--key", str(key),
                                "--verity", "--release-version", "5")
            assert code == 0, err
        # A valid COW of the old image to an image nobody signed.
        evil = bytearray(self.new.read_bytes())
        evil[1 << 20:(1 << 20) + 11] = b"not signed!"
        (work / "evil.img").write_bytes(evil)
        code, _, err = vabc("diff", str(self.old), str(work / "evil.img"), "-o",
                            str(work / "evil.cow"))
        assert code == 0, err
        self.outside.mkdir()
        for name in ["victim", "victim.manifest", "victim.cow"]:
            (self.outside / name).write_bytes(b"keep")

    def boot_args(self):
        return ["update", "boot", "--store", str(self.store), "-b", f"system={self.base}",
                "--frontend", "fuse", "--run-dir", str(self.run), "--key", str(self.pub),
                "--json"]

    def power_off(self):
        ready = self.run / "system.ready"
        try:
            pid = json.loads(ready.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        t = time.time()
        while Path(f"/proc/{pid}").exists() and time.time() - t < 30:
            time.sleep(0.05)
        ready.unlink(missing_ok=True)

    def prepare(self, point):
        """The store (and base) at `point`, saved under work/saved-POINT."""
        shutil.rmtree(self.store, ignore_errors=True)
        shutil.rmtree(self.run, ignore_errors=True)
        shutil.copyfile(self.old, self.base)
        assert vabc("update", "init", "--store", str(self.store))[0] == 0
        code, _, err = vabc("update", "install", "--store", str(self.store), str(self.bundle),
                            "-b", f"system={self.base}", "--key", str(self.pub),
                            "--max-boot-attempts", "3")
        assert code == 0, err
        if point == "mark-good":
            code, out, err = vabc(*self.boot_args())
            assert code == 0 and json.loads(out)["partitions"][0]["served"], err
            self.power_off()
            code, _, err = vabc("update", "mark-good", "--store", str(self.store),
                                "--run-dir", str(self.run), "--key", str(self.pub))
            assert code == 0, err
        saved = self.work / f"saved-{point}"
        shutil.rmtree(saved, ignore_errors=True)
        shutil.copytree(self.store, saved, symlinks=True)
        return saved

    def restore(self, saved):
        self.power_off()
        shutil.rmtree(self.store, ignore_errors=True)
        shutil.copytree(saved, self.store, symlinks=True)
        os.chmod(self.store, 0o700)
        shutil.rmtree(self.run, ignore_errors=True)
        shutil.copyfile(self.old, self.base)

    def outside_touched(self):
        names = sorted(p.name for p in self.outside.iterdir())
        if names != ["victim", "victim.cow", "victim.manifest"]:
            return True
        return any((self.outside / n).read_bytes() != b"keep" for n in names)


def mutate(d, rng):
    """Applies one mutation to the store; returns its description."""
    present = [f for f in FILES if (d.store / f).exists()]
    kind = rng.choice(["byte", "byte", "byte", "zero", "truncate", "append", "remove", "link",
                       "swap", "state", "state"])
    name = rng.choice(present)
    path = d.store / name
    if kind == "state":
        st = json.loads((d.store / "state").read_text())
        upd = st.get("update")
        if not upd:
            kind, name = "byte", "state"
        else:
            p = upd["partitions"][0]
            field, value = rng.choice([
                ("cow", "../outside/victim.cow"), ("cow", str(d.outside / "victim.cow")),
                ("cow", "state"), ("name", "../outside/victim"),
                ("base", str(d.outside / "victim")), ("base", "relative.img"),
                ("verity", {"file": "../outside/victim", "root_hash": "ab" * 32}),
                ("new_sha256", "00" * 32), ("id", "00" * 32),
                ("state", rng.choice(["installed", "merging", "none", "merged", "installing"])),
                ("boot_attempts", rng.choice([0, 1, 99])),
                ("max_boot_attempts", rng.choice([0, 1000])),
            ])
            if field in ("state", "boot_attempts"):
                st[field] = value
            elif field in ("id", "max_boot_attempts"):
                upd[field] = value
            else:
                p[field] = value
            # As an attacker writes it: the state file and its copy, no check (it
            # finds damage; whoever writes the partition can compute it).
            st.pop("check", None)
            for f in ("state", "state.copy"):
                (d.store / f).write_text(json.dumps(st))
            return f"state {field}={value}"
    data = path.read_bytes()
    if kind == "byte":
        n = rng.randint(1, 8)
        b = bytearray(data)
        if not b:
            b = bytearray(b"\x00")
        span = len(b) if rng.random() < 0.5 else min(len(b), 4096)
        for _ in range(n):
            i = rng.randrange(span)
            b[i] ^= rng.randint(1, 255)
        path.write_bytes(b)
        return f"{name}: {n} byte(s) flipped in its first {span}"
    if kind == "zero":
        b = bytearray(data)
        if b:
            i = rng.randrange(len(b))
            j = min(len(b), i + rng.choice([1, 512, 4096, 65536]))
            b[i:j] = bytes(j - i)
        path.write_bytes(b)
        return f"{name}: zeroed"
    if kind == "truncate":
        path.write_bytes(data[: rng.randrange(len(data) + 1) if data else 0])
        return f"{name}: truncated"
    if kind == "append":
        path.write_bytes(data + os.urandom(rng.choice([1, 100, 4096])))
        return f"{name}: appended"
    if kind == "remove":
        path.unlink()
        return f"{name}: removed"
    if kind == "link":
        path.unlink()
        os.symlink(d.outside / "victim", path)
        return f"{name}: a link outside"
    # swap
    if rng.random() < 0.5:
        shutil.copyfile(d.work / "evil.cow", d.store / "system.cow")
        shutil.copyfile(d.work / "evil.cow.manifest", d.store / "system.cow.manifest")
        return "system.cow: a valid COW to an unsigned image"
    raw = d.other.read_bytes()
    mlen = int.from_bytes(raw[16:20], "little")
    slen = int.from_bytes(raw[20:24], "little")
    (d.store / "update.head").write_bytes(raw[: 32 + mlen + slen])
    return "update.head: another signed bundle's"


def served_device(out):
    try:
        b = json.loads(out)
    except ValueError:
        return None
    p = b.get("partitions") or [{}]
    return p[0].get("device") if p[0].get("served") else None


def read_device(dev, want_sha):
    """'new', 'eio' (a read refused: verity), or 'wrong'."""
    h = hashlib.sha256()
    try:
        with open(dev, "rb", buffering=0) as f:
            while True:
                b = f.read(1 << 20)
                if not b:
                    break
                h.update(b)
    except OSError:
        return "eio"
    return "new" if h.hexdigest() == want_sha else "wrong"


def one(d, point, rng, tally, failures, i):
    what = mutate(d, rng)
    base_before = sha(d.base)
    code, out, err = vabc(*d.boot_args())
    verdict = "fine"
    if code == "hang":
        verdict = "hang"
    elif panicked(code, err):
        verdict = "panic"
    else:
        dev = served_device(out) if code == 0 else None
        if dev and read_device(dev, d.new_sha) == "wrong":
            verdict = "unsigned boot"
        c, o, _ = vabc("update", "status", "--store", str(d.store), "--json")
        merging = c == 0 and json.loads(o)["state"] == "merging"
        if merging and dev and verdict == "fine":
            # The daemon merges; wait for it to end (merged) or to stop.
            t = time.time()
            while time.time() - t < TIMEOUT:
                c, o, _ = vabc("update", "status", "--store", str(d.store), "--json")
                if c == 0 and json.loads(o)["state"] == "merged":
                    break
                ready = d.run / "system.ready"
                if not ready.exists():
                    break
                try:
                    pid = json.loads(ready.read_text())["pid"]
                except (OSError, ValueError, KeyError):
                    break
                if not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.2)
            else:
                verdict = "hang"
        d.power_off()
        base_after = sha(d.base)
        if verdict == "fine" and base_after not in (d.old_sha, d.new_sha):
            verdict = "unsigned merge"
        elif verdict == "fine" and not dev and base_after != base_before:
            verdict = "refused merge changed the base"
    if verdict == "fine" and d.outside_touched():
        verdict = "outside touched"
        for n in ["victim", "victim.cow", "victim.manifest"]:
            (d.outside / n).write_bytes(b"keep")
    outcome = ("halted (exit 4)" if code == 4 else
               "served" if code == 0 and served_device(out) else
               "base booted" if code == 0 else f"refused (exit {code})")
    tally.setdefault(point, {}).setdefault(outcome, 0)
    tally[point][outcome] += 1
    if verdict != "fine":
        failures.append({"point": point, "mutant": i, "mutation": what, "verdict": verdict,
                         "exit": code, "stderr": err[-400:]})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--install", type=int, default=600)
    ap.add_argument("--mark-good", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("store-mutants.py: run as root (it mounts FUSE and loop devices)")
    rng = random.Random(a.seed)
    tally, failures = {}, []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="vabc-store-mutants.") as w:
        d = Device(Path(w))
        for point, n in [("install", a.install), ("mark-good", a.mark_good)]:
            saved = d.prepare(point)
            for i in range(n):
                d.restore(saved)
                one(d, point, rng, tally, failures, i)
                if (i + 1) % 100 == 0:
                    print(f"{point}: {i + 1}/{n} mutants, {len(failures)} failures, "
                          f"{time.time() - t0:.0f} s", file=sys.stderr)
        d.power_off()
    counts = {f: sum(1 for x in failures if x["verdict"] == f) for f in FAILURES}
    summary = {"mutants": a.install + a.mark_good, "seed": a.seed, "outcomes": tally,
               "failures": counts, "seconds": round(time.time() - t0), "examples": failures[:10]}
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['mutants']} mutants (seed {a.seed}) in {summary['seconds']} s")
        for point, t in tally.items():
            print(f"  {point}: " + ", ".join(f"{k} {v}" for k, v in sorted(t.items())))
        for f in FAILURES:
            print(f"  {f}: {counts[f]}")
        for x in failures[:10]:
            print(f"  FAIL {x}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
