#!/usr/bin/env bash
# bench/studies/decode-pool.sh: the decode-pool study (issue: the read-path studies).
#
# EROFS moved decompression from a shared workqueue to per-CPU high-priority workers
# and cut scheduling latency over 50 cold app launches by 80%. vabc's engine hands a
# request's compressed units to a pool too; this runs it three ways
# (`vabc serve --decode-pool shared|per-cpu|per-cpu-fifo`) on a cold "app launch":
# the corpus pair's new EROFS image served from base + COW (Android's device COW:
# lz4 in 64 KiB units, so a 128 KiB read holds two units to hand off; the base is
# empty, so that every block is compressed REPLACE data in the COW, as in a full
# update, and every cold read decodes: the pair's own delta replaces too few
# blocks to load the pool), mounted
# through the kernel's EROFS, every file read whole after the caches are dropped
# (and the daemon's unit cache off), ITERATIONS times per design. Scheduling
# latency is each hand-off's wait from being queued to a worker starting it (the
# engine's timestamps, `--queue-delays`), summed per launch as the EROFS study
# reports it, and per hand-off; cross-checked with the decode threads' run_delay per
# timeslice from /proc/PID/task/TID/schedstat (a thread's own wait for a CPU, a part
# of the hand-off's wait). Also the launch time the application sees.
#
# Usage: [VABC=binary] [PAIR=small] [ITERATIONS=50] [DESIGNS=shared,per-cpu,per-cpu-fifo]
#        [RECORD=0] bench/studies/decode-pool.sh
# Prints the tables and (unless RECORD=0) appends them, with the command, date and
# machine, to bench/results/read-path.md. Needs root (FUSE, loop, mount, drop_caches), the
# corpus (built on first use), python3. About 5 minutes for `small` here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PAIR=${PAIR:-small} ITERATIONS=${ITERATIONS:-50} DESIGNS=${DESIGNS:-shared,per-cpu,per-cpu-fifo}
CORPUS=${VABC_CORPUS:-${TMPDIR:-/tmp}/corpus}
[ -e "$CORPUS/$PAIR/new.erofs.img" ] || bash "$ROOT/../shared/corpus/make-corpus.sh" -p "$PAIR" -o "$CORPUS" >&2
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"
need_vabc
W=$(mktemp -d "${TMPDIR:-/tmp}/vabc-decode-pool.XXXXXX")
trap 'mountpoint -q "$W/mnt" && umount "$W/mnt"; rm -rf "$W"' EXIT
truncate -s "$(stat -c %s "$CORPUS/$PAIR/new.erofs.img")" "$W/old.img"
"$VABC" -q diff "$W/old.img" "$CORPUS/$PAIR/new.erofs.img" -o "$W/u.cow" \
	--compression lz4 --compression-factor 64k --json >"$W/diff.json"
OUT=$(python3 "$ROOT/bench/studies/decode_pool.py" --vabc "$VABC" --old "$W/old.img" --cow "$W/u.cow" \
	--work "$W" --iterations "$ITERATIONS" --designs "$DESIGNS")
REPLACE=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['blocks']['replace'], d['cow_size'])" "$W/diff.json")
MACHINE=$(machine)
REPORT="### Decode pool: $PAIR EROFS, $(date -u +%Y-%m-%d)

\`PAIR=$PAIR ITERATIONS=$ITERATIONS DESIGNS=$DESIGNS bench/studies/decode-pool.sh\` on $MACHINE.
The COW: lz4, 64 KiB units, $(echo "$REPLACE" | cut -d' ' -f1) REPLACE blocks, $(echo "$REPLACE" | cut -d' ' -f2) bytes.
$OUT"
echo "$REPORT" | tee "$W/report.md"
record_results decode-pool "$W/report.md"
