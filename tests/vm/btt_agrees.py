#!/usr/bin/env python3
"""Compare btt's "All Devices" table with `vabc trace report --json` of the same
blktrace capture: every stage btt prints must have the same N and an average within
1% in vabc's report, and vabc must report no stage btt has no samples for.

    btt_agrees.py BTT.txt VABC.json [--same-n OURS.json]

--same-n: also a `vabc trace record --json` of the same run (our own tracefs
capture, taken alongside blktrace): its N per stage must equal btt's (its times come
from another probe of the same events, so only N is compared)."""
import argparse
import json
import sys


def btt_rows(path):
    text = open(path).read().split("==================== Device Overhead")[0]
    rows = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) == 5 and len(f[0]) == 3 and f[0][1] == "2":
            rows[f[0]] = (float(f[2]), int(f[4]))
    return rows


def vabc_rows(path):
    devs = [d for d in json.load(open(path))["devices"] if d["direction"] == "all"]
    if len(devs) != 1:
        sys.exit(f"{path}: expected one device, found {len(devs)}")
    return {k: (v["avg_ns"] / 1e9, v["n"]) for k, v in devs[0]["stages"].items() if v["n"] > 0}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("btt")
    p.add_argument("vabc")
    p.add_argument("--same-n")
    a = p.parse_args()
    btt, ours = btt_rows(a.btt), vabc_rows(a.vabc)
    bad = 0
    print(f"{'stage':6} {'btt N':>8} {'vabc N':>8} {'btt avg (s)':>14} {'vabc avg (s)':>14} {'diff':>8}")
    for stage in sorted(set(btt) | set(ours)):
        b_avg, b_n = btt.get(stage, (0.0, 0))
        o_avg, o_n = ours.get(stage, (0.0, 0))
        diff = abs(o_avg - b_avg) / b_avg * 100 if b_avg else 0.0
        ok = b_n == o_n and (diff <= 1.0 or abs(o_avg - b_avg) < 1e-9)
        bad += not ok
        print(f"{stage:6} {b_n:8} {o_n:8} {b_avg:14.9f} {o_avg:14.9f} {diff:7.3f}% {'ok' if ok else 'DIFFERS'}")
    if not btt.get("D2C"):
        print("btt reported no D2C: nothing was traced")
        bad += 1
    if a.same_n:
        rec = vabc_rows(a.same_n)
        for stage in ("Q2Q", "D2C", "Q2C"):
            b_n, r_n = btt.get(stage, (0, 0))[1], rec.get(stage, (0, 0))[1]
            print(f"vabc's own recording of the same run: {stage} N {r_n} (btt {b_n})")
            bad += b_n != r_n
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
