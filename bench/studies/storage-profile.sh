#!/usr/bin/env bash
# bench/studies/storage-profile.sh: the storage profile (issue: the read-path studies).
#
# Mobile flash is far slower at random than at sequential I/O, and synchronous SQLite
# writes make that the bottleneck of ordinary apps. This measures the same on this
# machine: sequential (1 MiB, 8 in flight) and random (4 KiB, 1 and 32 in flight)
# reads and writes, O_DIRECT through io_uring, of a file on this machine's disk and
# of a served image (the same file as the base of an update, `vabc serve --fuse`:
# reads only, the device is read-only), then the SQLite workload of bench/replay.sh
# (ROWS inserts, one transaction each) with synchronous=FULL and OFF on ext4 on the
# same disk. Each fio run lasts SECONDS_EACH; each row is the median of ROUNDS.
#
# Usage: [VABC=binary] [SIZE_MIB=1024] [SECONDS_EACH=5] [ROUNDS=3] [ROWS=2000] [RECORD=0]
#        bench/studies/storage-profile.sh [-d WORKDIR]
# Prints the table and (unless RECORD=0) appends it, with the command, date and
# machine, to bench/results/read-path.md. Needs root (FUSE, loop, mount), fio, python3.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIZE=${SIZE_MIB:-1024} SECS=${SECONDS_EACH:-5} ROUNDS=${ROUNDS:-3} ROWS=${ROWS:-2000}
DIR=${TMPDIR:-/var/tmp}
while getopts d: o; do case $o in d) DIR=$OPTARG ;; *) sed -n '2,19p' "$0"; exit 2 ;; esac; done
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"
need_vabc
W=$(mktemp -d "$DIR/vabc-profile.XXXXXX")
PID= LOOP=
cleanup() {
	local rc=$?
	[ -n "$PID" ] && kill -TERM "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
	mountpoint -q "$W/mnt" && umount "$W/mnt"
	[ -n "$LOOP" ] && losetup -d "$LOOP"
	rm -rf "$W"
	exit "$rc"
}
trap cleanup EXIT
fio_run() { # FILE RW BS DEPTH: "MB/s IOPS"
	fio --name=p --filename="$1" --rw="$2" --bs="$3" --iodepth="$4" --ioengine=io_uring --direct=1 \
		--runtime="$SECS" --time_based --size="${SIZE}M" --output-format=json 2>/dev/null |
		python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; d=j['read'] if j['read']['io_bytes'] else j['write']; print(f\"{d['bw_bytes']/1e6:.1f} {d['iops']:.0f}\")"
}

echo "storage-profile: writing a $SIZE MiB file and its update" >&2
head -c "${SIZE}M" /dev/urandom >"$W/disk.img"
cp "$W/disk.img" "$W/new.img"
for i in $(seq 0 16 $((SIZE - 1))); do head -c 256K /dev/urandom | dd of="$W/new.img" bs=1M seek="$i" conv=notrunc status=none; done
"$VABC" -q diff "$W/disk.img" "$W/new.img" -o "$W/u.cow" >/dev/null
# The served base: a copy, since the disk rows write into disk.img.
mv "$W/new.img" "$W/base.img"
cp "$W/disk.img" "$W/base.img"
sync

PATTERNS=("read 1M 8" "randread 4k 1" "randread 4k 32" "write 1M 8" "randwrite 4k 1" "randwrite 4k 32")
declare -A R
for r in $(seq "$ROUNDS"); do
	echo "storage-profile: round $r of $ROUNDS" >&2
	for p in "${PATTERNS[@]}"; do
		# shellcheck disable=SC2086
		R[disk $p]+="$(fio_run "$W/disk.img" $p | tr ' ' '/') "
	done
	mkdir -p "$W/fuse"
	"$VABC" serve --base "$W/base.img" --cow "$W/u.cow" --fuse "$W/fuse" >"$W/serve.log" 2>&1 &
	PID=$!
	for _ in $(seq 300); do grep -q ready "$W/serve.log" && break; sleep 0.1; done
	kill -0 "$PID" 2>/dev/null && grep -q ready "$W/serve.log" || { cat "$W/serve.log" >&2; exit 1; }
	for p in "${PATTERNS[@]:0:3}"; do
		# shellcheck disable=SC2086
		R[served $p]+="$(fio_run "$W/fuse/disk.img" $p | tr ' ' '/') "
	done
	kill -TERM "$PID"; wait "$PID" || true; PID=
	grep -q "stopped" "$W/serve.log" || { echo "storage-profile: the server died:" >&2; cat "$W/serve.log" >&2; exit 1; }
done

# SQLite on ext4 on a loop device (direct I/O) over a file on the same disk.
truncate -s 512M "$W/fs.img"
LOOP=$(losetup --direct-io=on -f --show "$W/fs.img")
mkfs.ext4 -q "$LOOP" && mkdir -p "$W/mnt" && mount "$LOOP" "$W/mnt"
declare -A Q
for r in $(seq "$ROUNDS"); do
	for s in FULL OFF; do
		rm -f "$W/mnt"/db*
		Q[$s]+="$(python3 "$ROOT/bench/workloads/sqlite_inserts.py" "$W/mnt/db" "$ROWS" "$s") "
	done
done

cell() { # KEY FIELD(1: MB/s, 2: IOPS)
	printf '%s\n' ${R[$1]:-} | cut -d/ -f"$2" | median
}
MACHINE="$(machine), the disk under $DIR: $(df --output=source "$DIR" | tail -1)"
{
	echo "### Storage profile, $(date -u +%Y-%m-%d)"
	echo
	echo "\`SIZE_MIB=$SIZE SECONDS_EACH=$SECS ROUNDS=$ROUNDS ROWS=$ROWS bench/studies/storage-profile.sh\` on $MACHINE (medians of $ROUNDS rounds; fio io_uring O_DIRECT)."
	echo
	echo "| pattern | disk MB/s | disk IOPS | served MB/s | served IOPS | served / disk |"
	echo "|---|---:|---:|---:|---:|---:|"
	for p in "${PATTERNS[@]}"; do
		d=$(cell "disk $p" 1); di=$(cell "disk $p" 2)
		if [ -n "${R[served $p]:-}" ]; then
			s=$(cell "served $p" 1); si=$(cell "served $p" 2)
			ratio=$(python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$si" "$di")
		else
			s=- si=- ratio="- (read-only)"
		fi
		set -- $p
		echo "| $1 $2 QD$3 | $d | $di | $s | $si | $ratio |"
	done
	echo
	seq_r=$(cell "disk read 1M 8" 1); rnd_r=$(cell "disk randread 4k 1" 1)
	seq_w=$(cell "disk write 1M 8" 1); rnd_w=$(cell "disk randwrite 4k 1" 1)
	echo "Sequential over random at QD1: reads $(python3 -c "print(f'{$seq_r / $rnd_r:.0f}')")×, writes $(python3 -c "print(f'{$seq_w / $rnd_w:.0f}')")× (MB/s)."
	full=$(printf '%s\n' ${Q[FULL]} | median); off=$(printf '%s\n' ${Q[OFF]} | median)
	echo "SQLite, $ROWS single-row transactions on ext4 on this disk: synchronous=FULL $full s, OFF $off s ($(python3 -c "print(f'{$full / $off:.0f}')")×; what-if replays of the same workload: \"What-if replay: an SQLite workload\" above)."
} >"$W/report.md"
cat "$W/report.md"
record_results storage-profile "$W/report.md"
