#!/usr/bin/env bash
# bench/replay.sh: what-if replay (vabc trace replay) of an SQLite workload, and
# each prediction checked against running the workload that way.
#
# The workload (bench/workloads/sqlite_inserts.py): ROWS rows inserted by Python's
# sqlite3, one transaction each, synchronous=FULL, rollback journal: an ordinary
# app's storage pattern. It runs on ext4 on a loop device (direct I/O, so the loop
# device's requests reach the file below it) whose file is on this machine's disk
# ("disk") or in /dev/shm ("RAM").
#  1. `vabc trace record` takes its block trace on the disk;
#  2. `vabc trace replay` issues the traced requests again (recorded queue depths and
#     sync flags, no think time) against a file on the disk and one in /dev/shm, with
#     and without syncs (--no-sync), and in sector order (--sequential);
#  3. the workload itself runs on disk and in RAM, with synchronous=FULL and OFF.
# Each is run ROUNDS times, alternating; medians are reported. The replay's
# predictions are the ratios between its rows; the workload's own ratios are what
# they predict (the replay leaves out the app's CPU time: compare ratios, not
# seconds).
#
# Usage: [VABC=binary] [ROWS=2000] [ROUNDS=5] bench/replay.sh [-d WORKDIR]
# Needs root (loop devices, mounts, tracefs), e2fsprogs, python3.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROWS=${ROWS:-2000} ROUNDS=${ROUNDS:-5}
DIR=${TMPDIR:-/var/tmp}
while getopts d: o; do case $o in d) DIR=$OPTARG ;; *) sed -n '2,22p' "$0"; exit 2 ;; esac; done
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"
need_vabc
W=$(mktemp -d "$DIR/vabc-replay.XXXXXX")
RAM=$(mktemp -d /dev/shm/vabc-replay.XXXXXX)
LOOPS=()
cleanup() {
	local rc=$?
	for m in "$W"/mnt-*; do mountpoint -q "$m" && umount "$m"; done
	for l in "${LOOPS[@]}"; do losetup -d "$l" 2>/dev/null || true; done
	rm -rf "$W" "$RAM"
	exit "$rc"
}
trap cleanup EXIT

# mkfs_on WHERE NAME: ext4 on a loop device over a file in WHERE, mounted at
# $W/mnt-NAME; prints the device.
mkfs_on() {
	local img=$1/$2.img mnt=$W/mnt-$2 dev
	truncate -s 512M "$img"
	dev=$(losetup --direct-io=on -f --show "$img")
	mkfs.ext4 -q -F "$dev"
	mkdir -p "$mnt" && mount "$dev" "$mnt"
	echo "$dev"
}
# (Called in a subshell: the devices are remembered here, for the clean-up.)
DISK_DEV=$(mkfs_on "$W" disk)
LOOPS+=("$DISK_DEV")
LOOPS+=("$(mkfs_on "$RAM" ram)")
app() { # MEDIUM SYNC: seconds of one run on a fresh database
	rm -f "$W/mnt-$1"/db*
	sync
	python3 "$ROOT/bench/workloads/sqlite_inserts.py" "$W/mnt-$1/db" "$ROWS" "$2"
}

echo "replay: recording $ROWS inserts (synchronous=FULL) on the disk" >&2
rm -f "$W/mnt-disk"/db*
"$VABC" -q trace record -d "$DISK_DEV" -o "$W/sqlite" --json -- sh -c \
	'python3 "$1" "$2" "$3" FULL >&2' sh "$ROOT/bench/workloads/sqlite_inserts.py" "$W/mnt-disk/db" "$ROWS" >"$W/record.json"
REQS=$(python3 -c "import json,sys; d=[x for x in json.load(open(sys.argv[1]))['devices'] if x['direction']=='all'][0]; print(d['issued'], d['stages']['D2C']['avg_ns']/1e3)" "$W/record.json")

declare -A T
for r in $(seq "$ROUNDS"); do
	echo "replay: round $r of $ROUNDS" >&2
	for target in disk ram; do
		case $target in disk) t=$W/target.img ;; ram) t=$RAM/target.img ;; esac
		for v in sync no-sync sequential; do
			flag=(); [ $v = sync ] || flag=(--"$v")
			s=$("$VABC" -q trace replay "$W/sqlite" --target "$t" "${flag[@]}" --json |
				python3 -c "import json,sys; print(json.load(sys.stdin)['outcome']['seconds'])")
			T[replay-$target-$v]+="$s "
		done
	done
	for medium in disk ram; do
		for s in FULL OFF; do T[app-$medium-$s]+="$(app $medium $s) "; done
	done
done
m() { printf '%s\n' ${T[$1]} | median; }
py() { python3 -c "import sys; a = [float(x) for x in sys.argv[2:]]; print(f'{eval(sys.argv[1]):.3f}')" "$@"; }
row() { # WHAT REPLAY_KEY APP_KEY APP_NOTE
	local r a
	r=$(m "$2")
	a=${3:+$(m "$3")}
	printf '| %s | %.3f | %s | %s | %s |\n' "$1" "$r" "$(py 'a[0] / a[1]' "$r" "$(m replay-disk-sync)")" \
		"${a:-}${4:-}" "${a:+$(py 'a[0] / a[1]' "$a" "$(m app-disk-FULL)")}"
}
echo
echo "| what-if | replay, s | replay / as recorded | the app run that way, s | app / as recorded |"
echo "|---|---:|---:|---:|---:|"
row "as recorded: disk, syncs" replay-disk-sync app-disk-FULL
row "no syncs, disk" replay-disk-no-sync app-disk-OFF " (synchronous=OFF)"
row "RAM, syncs" replay-ram-sync app-ram-FULL
row "RAM, no syncs" replay-ram-no-sync app-ram-OFF " (synchronous=OFF)"
row "sequentialised, disk" replay-disk-sequential
echo
echo "rows $ROWS, rounds $ROUNDS (medians); the trace: $REQS (requests issued, mean D2C µs)"
echo "rounds' seconds:"
for k in "${!T[@]}"; do echo "  $k: ${T[$k]}"; done | sort
