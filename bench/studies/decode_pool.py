#!/usr/bin/env python3
"""The decode-pool study (driven by bench/studies/decode-pool.sh; see there)."""
import argparse
import os
import statistics
import subprocess
import sys
import time


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def decode_threads(pid):
    """(tid, run_delay ns, timeslices) of the daemon's decode workers."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            if comm.startswith("vabc-decode"):
                _, delay, slices = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()
                out.append((tid, int(delay), int(slices)))
        except OSError:
            pass
    return out


def files_of(root):
    fs = []
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                fs.append(p)
    return sorted(fs)


def launch(files, reads):
    """Reads every file once, whole (1 MiB reads); returns the seconds, and appends
    each read's latency (µs) to `reads`."""
    t0 = time.monotonic()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                r0 = time.monotonic_ns()
                n = len(f.read(1 << 20))
                reads.append((time.monotonic_ns() - r0) / 1000)
                if not n:
                    break
    return time.monotonic() - t0


def run_design(a, design):
    mnt = os.path.join(a.work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    delays = os.path.join(a.work, f"delays-{design}")
    log = open(os.path.join(a.work, f"serve-{design}.log"), "w")
    serve = subprocess.Popen(
        [a.vabc, "serve", "--base", a.old, "--cow", a.cow, "--mount", mnt, "--fstype", "erofs",
         "--decode-pool", design, "--queue-delays", delays, "--cache-mib", "0", "--stats"],
        stdout=subprocess.PIPE, stderr=log, text=True)
    for line in serve.stdout:
        if "ready" in line:
            break
    else:
        sys.exit(f"serve --decode-pool {design} did not start: see {log.name}")
    try:
        files = files_of(mnt)
        before = {t: (d, s) for t, d, s in decode_threads(serve.pid)}
        windows, times, reads = [], [], []
        for _ in range(a.iterations):
            drop_caches()
            start = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            times.append(launch(files, reads))
            windows.append((start, time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
        after = decode_threads(serve.pid)
    finally:
        serve.terminate()
        serve.wait()
    d_delay = sum(d - before.get(t, (0, 0))[0] for t, d, _ in after)
    d_slices = sum(s - before.get(t, (0, 0))[1] for t, _, s in after)
    samples = []
    with open(delays) as f:
        for line in f:
            q, d = line.split()
            samples.append((int(q), int(d)))
    per_launch = []
    for (s, e) in windows:
        per_launch.append(sum(d for q, d in samples if s <= q <= e) / 1000)
    hand = [d / 1000 for _, d in samples]
    return {
        "files": len(files),
        "per_launch": per_launch,
        "hand_offs": hand,
        "launch_s": times,
        "reads_us": reads,
        "schedstat_us": (d_delay / d_slices / 1000) if d_slices else 0.0,
    }


def row(name, v, base, fmt="{:,.0f}"):
    if not v:
        return f"| {name} | - | - | - | - | - | - |"
    diff = (statistics.mean(v) / statistics.mean(base) - 1) * 100 if base and statistics.mean(base) else 0.0
    cells = [statistics.mean(v), statistics.median(v), min(v), max(v), statistics.pstdev(v)]
    return f"| {name} | " + " | ".join(fmt.format(c) for c in cells) + f" | {diff:+.0f}% |"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vabc", required=True)
    p.add_argument("--old", required=True)
    p.add_argument("--cow", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--designs", default="shared,per-cpu,per-cpu-fifo")
    a = p.parse_args()
    res = {}
    for design in a.designs.split(","):
        print(f"decode-pool: {design}: {a.iterations} cold launches", file=sys.stderr)
        res[design] = run_design(a, design)
    first = next(iter(res))
    print()
    print("Scheduling latency per cold launch (sum of the decode hand-offs' waits, µs):")
    print()
    print("| pool | avg | median | min | max | stdev | diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for d, r in res.items():
        print(row(d, r["per_launch"], res[first]["per_launch"]))
    print()
    print("Per hand-off (µs):")
    print()
    print("| pool | avg | median | min | max | stdev | diff | hand-offs | schedstat run_delay per timeslice (µs) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d, r in res.items():
        print(row(d, r["hand_offs"], res[first]["hand_offs"])[:-1] + f"| {len(r['hand_offs'])} | {r['schedstat_us']:.1f} |")
    print()
    print("Cold launch time (s):")
    print()
    print("| pool | avg | median | min | max | stdev | diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for d, r in res.items():
        print(row(d, r["launch_s"], res[first]["launch_s"], "{:.3f}"))
    print()
    print("The application's reads (1 MiB read() calls, µs):")
    print()
    print("| pool | avg | median | min | max | stdev | diff | p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for d, r in res.items():
        v = sorted(r["reads_us"])
        print(row(d, v, res[first]["reads_us"]) + f" {v[int(len(v) * 0.99)]:,.0f} |")
    print()
    print(f"{res[first]['files']} files read whole per launch, {a.iterations} launches per pool, caches dropped before each")


if __name__ == "__main__":
    main()
