#!/usr/bin/env bash
# bench/trace.sh: what tracing costs (issue #34: under 5% of throughput when on,
# nothing when off), fio random 4 KiB reads (io_uring, O_DIRECT, 32 in flight) in the
# same run with and without it, alternating, ROUNDS rounds, median IOPS:
#  1. block events: a loop device over a file in /dev/shm (the most events per second
#     this machine makes), bare and under `vabc trace record -d LOOP`;
#  2. spans: the same image served by `vabc serve --fuse` (base + COW), read through
#     the FUSE file, without and with `--trace` (spans on every request, and every
#     block device's events);
#  3. off: with BASELINE=binary (a build without the span hooks), `vabc serve`
#     without --trace against that build.
#
# The daemon's CPU time per request (from /proc/PID/stat) is reported too: on
# this noisy machine it resolves the cost of spans better than IOPS do.
#
# Usage: [VABC=binary] [BASELINE=binary] [ROUNDS=5] [SECONDS_EACH=5] bench/trace.sh
# Needs root (loop, FUSE, tracefs), fio.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-5} SECS=${SECONDS_EACH:-5}
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"
need_vabc
W=$(mktemp -d /dev/shm/vabc-trace-bench.XXXXXX)
LOOP= PID=
cleanup() {
	local rc=$?
	[ -n "$PID" ] && kill -TERM "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
	[ -n "$LOOP" ] && losetup -d "$LOOP"
	rm -rf "$W"
	exit "$rc"
}
trap cleanup EXIT
fio_json() { # FILE: fio's JSON report of random 4 KiB reads
	fio --name=r --filename="$1" --rw=randread --bs=4k --iodepth=32 --ioengine=io_uring --direct=1 \
		--runtime="$SECS" --time_based --size=256M --output-format=json 2>/dev/null
}
fio_iops() { fio_json "$1" | python3 -c "import json,sys; print(round(json.load(sys.stdin)['jobs'][0]['read']['iops']))"; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# served KEY: IOPS into R[KEY], the daemon's CPU per request (µs) into C[KEY].
served() {
	local t0 out
	t0=$(ticks "$PID")
	out=$(fio_json "$W/fuse/disk.img")
	R[$1]+="$(echo "$out" | python3 -c "import json,sys; print(round(json.load(sys.stdin)['jobs'][0]['read']['iops']))") "
	C[$1]+="$(echo "$out" | python3 -c "import json,sys,os; ios=json.load(sys.stdin)['jobs'][0]['read']['total_ios']; print(f'{(int(sys.argv[2]) - int(sys.argv[1])) / os.sysconf(\"SC_CLK_TCK\") / ios * 1e6:.3f}')" "$t0" "$(ticks "$PID")") "
}

# The image: 256 MiB of random data; an update of every 16th MiB's first 256 KiB.
head -c 256M /dev/urandom >"$W/old.img"
cp "$W/old.img" "$W/new.img"
for i in $(seq 0 16 255); do head -c 256K /dev/urandom | dd of="$W/new.img" bs=1M seek="$i" conv=notrunc status=none; done
"$VABC" -q diff "$W/old.img" "$W/new.img" -o "$W/u.cow" >/dev/null
LOOP=$(losetup --direct-io=on -f --show "$W/old.img")
mkdir -p "$W/fuse"
serve() { # BINARY [ARGS]: starts it, sets PID
	local bin=$1; shift
	"$bin" serve --base "$W/old.img" --cow "$W/u.cow" --fuse "$W/fuse" "$@" >"$W/serve.log" 2>&1 &
	PID=$!
	for _ in $(seq 100); do grep -q ready "$W/serve.log" && return; sleep 0.1; done
	cat "$W/serve.log" >&2; exit 1
}
unserve() { kill -TERM "$PID"; wait "$PID" || true; PID=; }

declare -A R C
for r in $(seq "$ROUNDS"); do
	echo "trace-bench: round $r of $ROUNDS" >&2
	R[loop-off]+="$(fio_iops "$LOOP") "
	"$VABC" -q trace record -d "$LOOP" -o "$W/rec" --json -- sh -c 'fio_out=$("$@"); echo "$fio_out" >"'"$W"'/iops"' sh \
		bash -c "$(declare -f fio_json fio_iops); SECS=$SECS fio_iops $LOOP" >"$W/rec.json"
	R[loop-on]+="$(cat "$W/iops") "
	lost=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['lost_events'])" "$W/rec.json")
	[ "$lost" = 0 ] || echo "trace-bench: $lost events lost in round $r" >&2
	serve "$VABC"; served serve-off; unserve
	serve "$VABC" --trace "$W/tl"; served serve-on; unserve
	if [ -n "${BASELINE:-}" ]; then
		serve "$BASELINE"; served serve-baseline; unserve
	fi
done
m() { printf '%s\n' ${R[$1]} | median; }
mc() { printf '%s\n' ${C[$1]} | median; }
ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.3f}')" "$(m "$1")" "$(m "$2")"; }
echo
echo "| what | off, IOPS | on, IOPS | on / off |"
echo "|---|---:|---:|---:|"
echo "| block events (\`trace record\`), loop device over /dev/shm | $(m loop-off) | $(m loop-on) | $(ratio loop-on loop-off) |"
echo "| spans + all block events (\`serve --trace\`), FUSE | $(m serve-off) | $(m serve-on) | $(ratio serve-on serve-off) |"
if [ -n "${BASELINE:-}" ]; then
	echo "| span hooks compiled in, off: this build vs BASELINE, FUSE | $(m serve-baseline) | $(m serve-off) | $(ratio serve-off serve-baseline) |"
fi
echo
echo "The daemon's CPU time per request (µs, median; /proc/PID/stat over the fio run):"
echo "off $(mc serve-off), --trace $(mc serve-on) ($(python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.3f}')" "$(mc serve-on)" "$(mc serve-off)")x)${BASELINE:+, BASELINE $(mc serve-baseline)}"
echo
echo "fio randread 4k QD32 io_uring direct, ${SECS} s each, $ROUNDS rounds (medians); rounds:"
for k in "${!R[@]}"; do echo "  $k: ${R[$k]}"; done | sort
for k in "${!C[@]}"; do echo "  cpu-us-per-request $k: ${C[$k]}"; done | sort
