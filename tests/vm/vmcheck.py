#!/usr/bin/env python3
"""Read checks of a served block device against the image it must equal.

  vmcheck.py direct DEV IMAGE [--reads N]
      random O_DIRECT reads (4 KiB to 512 KiB, aligned) compared with IMAGE
  vmcheck.py readers DEV IMAGE [--procs P] [--reads N]
      P processes at once, half O_DIRECT and half buffered, random reads compared
  vmcheck.py until DEV IMAGE --stop-file F [--timeout S] [--min-reads N] [--reached-file R]
      random O_DIRECT reads compared with IMAGE until F exists (e.g. while a merge
      runs); prints how many reads ran, and fails if fewer than N did; creates R
      once N have (what holds the merge back can then let it go)
  vmcheck.py never-wrong DEV IMAGE --seconds S [--ready-file F --min-good N]
      random O_DIRECT reads for S seconds while the daemon may die: an I/O error is
      acceptable, different bytes are not; prints counts of good reads and errors.
      With --ready-file, F is made once N reads have matched and the S seconds
      count from then: the caller kills the daemon only after F appears, so the
      reads provably span the kill (fewer than N good reads, or a device that
      cannot be opened, fails)

Each exits 1 on the first wrong byte, naming the offset. Reads use one seeded
generator per process, so a failure can be replayed with the same --seed.
"""
import argparse
import mmap
import os
import random
import sys
import time

BS = 4096


def size_of(fd):
    return os.lseek(fd, 0, os.SEEK_END)


class Reader:
    def __init__(self, dev, image, direct):
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        self.fd = os.open(dev, flags)
        self.img = open(image, "rb")
        self.size = os.path.getsize(image)
        self.buf = mmap.mmap(-1, 512 * 1024)  # page-aligned, as O_DIRECT needs
        self.dev = dev

    def check(self, off, length):
        """Returns None when the read matched, the OSError when it failed."""
        view = memoryview(self.buf)[:length]
        try:
            n = os.preadv(self.fd, [view], off)
        except OSError as e:
            return e
        want = os.pread(self.img.fileno(), length, off)
        got = bytes(view[:n])
        if got == want[: len(got)] and n < min(length, self.size - off):
            # Fewer bytes than asked, all of them right: the device shrank (a driver
            # sets its capacity to 0 when it removes it). No data, like an error.
            return OSError(0, f"short read: {n} of {length} bytes")
        if got != want[: len(got)]:
            bad = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), len(got))
            sys.exit(f"WRONG DATA: {self.dev} at offset {off + bad} (read of {length} at {off}, got {n} bytes)")
        return None

    def random_read(self, rng):
        blocks = self.size // BS
        length = BS * rng.choice([1, 1, 2, 4, 8, 16, 32, 64, 128])
        start = rng.randrange(0, max(1, blocks - length // BS)) * BS
        return start, min(length, self.size - start)


def cmd_direct(a):
    r = Reader(a.dev, a.image, True)
    rng = random.Random(a.seed)
    for _ in range(a.reads):
        e = r.check(*r.random_read(rng))
        if e:
            sys.exit(f"{a.dev}: read failed: {e}")
    print(f"direct: {a.reads} random O_DIRECT reads equal the image")


def cmd_readers(a):
    pids = []
    for p in range(a.procs):
        pid = os.fork()
        if pid == 0:
            try:
                r = Reader(a.dev, a.image, p % 2 == 0)
                rng = random.Random(a.seed + p)
                for _ in range(a.reads):
                    e = r.check(*r.random_read(rng))
                    if e:
                        print(f"{a.dev}: reader {p}: read failed: {e}", file=sys.stderr)
                        os._exit(1)
                os._exit(0)
            except SystemExit as e:
                print(e, file=sys.stderr)
                os._exit(1)
        pids.append(pid)
    bad = sum(1 for pid in pids if os.waitpid(pid, 0)[1] != 0)
    if bad:
        sys.exit(f"readers: {bad} of {a.procs} readers failed")
    print(f"readers: {a.procs} concurrent readers x {a.reads} reads equal the image")


def cmd_until(a):
    r = Reader(a.dev, a.image, True)
    rng = random.Random(a.seed)
    n = 0
    deadline = time.monotonic() + a.timeout
    while not os.path.exists(a.stop_file):
        if time.monotonic() > deadline:
            sys.exit(f"until: {a.stop_file} did not appear within {a.timeout}s")
        e = r.check(*r.random_read(rng))
        if e:
            sys.exit(f"{a.dev}: read failed: {e}")
        n += 1
        if n == a.min_reads and a.reached_file:
            open(a.reached_file, "w").close()
    if n < a.min_reads:
        sys.exit(f"until: only {n} reads before {a.stop_file} appeared (at least {a.min_reads} wanted)")
    print(f"until: {n} random O_DIRECT reads equal the image before {os.path.basename(a.stop_file)}")


def cmd_never_wrong(a):
    try:
        r = Reader(a.dev, a.image, True)
    except OSError as e:
        if a.ready_file:
            sys.exit(f"never-wrong: {a.dev} cannot be opened ({e.strerror}) before the kill")
        # The driver removed the device once its daemon died: nothing can be read.
        print(f"never-wrong: {a.dev} cannot be opened ({e.strerror}): no reads, none wrong")
        return
    rng = random.Random(a.seed)
    good = errors = 0
    ready = not a.ready_file
    end = time.monotonic() + a.seconds if ready else time.monotonic() + a.timeout
    while time.monotonic() < end:
        e = r.check(*r.random_read(rng))
        if e:
            errors += 1
            if not ready:
                sys.exit(f"never-wrong: {a.dev}: read failed before the kill: {e}")
            time.sleep(0.05)
        else:
            good += 1
        if not ready and good >= a.min_good:
            ready = True
            open(a.ready_file, "w").close()
            end = time.monotonic() + a.seconds
    if not ready:
        sys.exit(f"never-wrong: only {good} good reads within {a.timeout}s ({a.min_good} wanted before the kill)")
    print(f"never-wrong: {good} reads equal the image, {errors} failed with an error, none wrong")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["direct", "readers", "until", "never-wrong"])
    p.add_argument("dev")
    p.add_argument("image")
    p.add_argument("--reads", type=int, default=200)
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stop-file")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--min-reads", type=int, default=0)
    p.add_argument("--reached-file")
    p.add_argument("--ready-file")
    p.add_argument("--min-good", type=int, default=20)
    a = p.parse_args()
    {"direct": cmd_direct, "readers": cmd_readers, "until": cmd_until, "never-wrong": cmd_never_wrong}[a.cmd](a)


if __name__ == "__main__":
    main()
