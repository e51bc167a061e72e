#!/usr/bin/env bash
# bench/studies/fuse-cost.sh: the FUSE cost table (issue: the read-path studies).
#
# FUSE in front of ext4 (Android's emulated storage) copied a large file 17% slower,
# 10,000 small files 3.6× slower, and cached every byte twice. The same here, ext4 on
# this machine's disk directly and through a FUSE passthrough file system (bindfs,
# Debian's): default (the page cache on both sides) and with FUSE direct I/O (`-o
# direct_io`: no page cache on the FUSE side). Cold each time (caches dropped):
#  - a FILE_MIB MiB file copied within the file system (`cp`, then `sync`);
#  - FILES files of 4 KiB created (copied in from /dev/shm, then `sync`), then read
#    back whole;
#  - the page-cache copies after reading the large file once: how much the page
#    cache grew (`Cached` in /proc/meminfo, from cold), over the file's size (2.00:
#    every byte cached twice). Not `fincore` on the FUSE file: opening it makes the
#    kernel drop the FUSE side's pages (bindfs does not ask to keep them);
#  - the same count for `vabc serve` (a served FUSE file of FILE_MIB, base + COW).
# The kernel's FUSE passthrough mode (FOPEN_PASSTHROUGH, Linux 6.9) needs a server
# that hands the kernel its backing files; no packaged one does, so libfuse's own
# `passthrough_hp` example is built (from LIBFUSE_SRC, a libfuse >= 3.16 source
# tree, else a clone of its fuse-3.18.2 tag) and run three ways: passthrough mode,
# `--nopassthrough` (every read and write through the server), and that with
# `--direct-io`. Without a source or a compiler those rows say why they are missing.
#
# Usage: [VABC=binary] [FILE_MIB=1024] [FILES=10000] [ROUNDS=3] [LIBFUSE_SRC=DIR]
#        [RECORD=0] bench/studies/fuse-cost.sh [-d WORKDIR]
# Appends the table (command, date, machine) to bench/results/read-path.md unless RECORD=0.
# Needs root, bindfs, util-linux (fincore).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIZE=${FILE_MIB:-1024} FILES=${FILES:-10000} ROUNDS=${ROUNDS:-3}
DIR=${TMPDIR:-/var/tmp}
while getopts d: o; do case $o in d) DIR=$OPTARG ;; *) sed -n '2,25p' "$0"; exit 2 ;; esac; done
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"
need_vabc
W=$(mktemp -d "$DIR/vabc-fuse-cost.XXXXXX")
SRC=$(mktemp -d /dev/shm/vabc-fuse-cost.XXXXXX)
PID=
cleanup() {
	local rc=$?
	[ -n "$PID" ] && kill -TERM "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
	for m in "$W"/m-*; do mountpoint -q "$m" && umount "$m"; done
	rm -rf "$W" "$SRC"
	exit "$rc"
}
trap cleanup EXIT
secs() { local t0; t0=$(date +%s.%N); "$@" >/dev/null; python3 -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.3f}')" "$t0"; }
# The page cache: files' pages (Cached) and block devices' (Buffers).
cached() { awk '/^(Cached|Buffers):/ {n += $2} END {printf "%d\n", n * 1024}' /proc/meminfo; }
# copies FILE: the page cache's growth from cold while FILE is read once, over its size.
copies() {
	local before
	cold; before=$(cached)
	cat "$1" >/dev/null
	local size
	size=$( [ -b "$1" ] && blockdev --getsize64 "$1" || stat -c %s "$1")
	python3 -c "import sys; print(f'{(int(sys.argv[1]) - int(sys.argv[2])) / int(sys.argv[3]):.2f}')" "$(cached)" "$before" "$size"
}

mkdir -p "$W/lower" "$SRC/small"
head -c "${SIZE}M" /dev/urandom >"$W/lower/big"
for i in $(seq "$FILES"); do head -c 4096 /dev/urandom >"$SRC/small/f$i"; done

# SETUP → the path the workload runs in.
declare -A PATHS=([ext4]="$W/lower")
mkdir -p "$W/m-bindfs" "$W/m-bindfs-dio"
bindfs --no-allow-other "$W/lower" "$W/m-bindfs"
bindfs --no-allow-other -o direct_io "$W/lower" "$W/m-bindfs-dio"
PATHS[bindfs]="$W/m-bindfs" PATHS[bindfs-dio]="$W/m-bindfs-dio"
SETUPS=(ext4 bindfs bindfs-dio)

# libfuse's passthrough_hp, built here (meson, ninja, a C++ compiler).
PHP_NOTE=
if [ -z "${LIBFUSE_SRC:-}" ]; then
	git clone -q --depth 1 -b fuse-3.18.2 https://github.com/libfuse/libfuse "$W/libfuse" 2>/dev/null &&
		LIBFUSE_SRC=$W/libfuse || PHP_NOTE="no libfuse source (set LIBFUSE_SRC, or allow a clone from GitHub)"
fi
if [ -z "$PHP_NOTE" ]; then
	echo "fuse-cost: building passthrough_hp from $LIBFUSE_SRC" >&2
	if meson setup "$W/libfuse-build" "$LIBFUSE_SRC" -Dexamples=true -Dutils=false -Dtests=false >"$W/meson.log" 2>&1 &&
		ninja -C "$W/libfuse-build" example/passthrough_hp >>"$W/meson.log" 2>&1; then
		PHP=$W/libfuse-build/example/passthrough_hp
		for v in pt nopt nopt-dio; do
			mkdir -p "$W/m-php-$v"
			case $v in
			pt) "$PHP" "$W/lower" "$W/m-php-$v" ;;
			nopt) "$PHP" --nopassthrough "$W/lower" "$W/m-php-$v" ;;
			nopt-dio) "$PHP" --nopassthrough --direct-io "$W/lower" "$W/m-php-$v" ;;
			esac
			PATHS[passthrough_hp-$v]="$W/m-php-$v"
			SETUPS+=("passthrough_hp-$v")
		done
	else
		PHP_NOTE="building libfuse's passthrough_hp failed (see meson and ninja)"
	fi
fi

declare -A T
for r in $(seq "$ROUNDS"); do
	echo "fuse-cost: round $r of $ROUNDS" >&2
	for s in "${SETUPS[@]}"; do
		p=${PATHS[$s]}
		cold; T[$s-copy]+="$(secs sh -c "cp '$p/big' '$p/big.copy' && sync") "
		rm -f "$p/big.copy"
		cold; T[$s-create]+="$(secs sh -c "cp -r '$SRC/small' '$p/small' && sync") "
		cold; T[$s-read]+="$(secs sh -c "cat '$p'/small/* >/dev/null") "
		rm -rf "$p/small"
		T[$s-copies]+="$(copies "$p/big") "
	done
done

# vabc serve: the served file's pages, the base's and the COW's after one full read.
cp "$W/lower/big" "$W/new.img"
for i in $(seq 0 16 $((SIZE - 1))); do head -c 256K /dev/urandom | dd of="$W/new.img" bs=1M seek="$i" conv=notrunc status=none; done
"$VABC" -q diff "$W/lower/big" "$W/new.img" -o "$W/u.cow" >/dev/null
rm "$W/new.img"
mkdir -p "$W/m-vabc"
"$VABC" serve --base "$W/lower/big" --cow "$W/u.cow" --fuse "$W/m-vabc" --loop >"$W/serve.log" 2>&1 &
PID=$!
for _ in $(seq 300); do grep -q ready "$W/serve.log" && break; sleep 0.1; done
SERVED=$(copies "$W/m-vabc/disk.img")
LOOPDEV=$(grep -o '/dev/loop[0-9]*' "$W/serve.log" | head -1)
SERVED_LOOP=$(copies "$LOOPDEV")
kill -TERM "$PID"; wait "$PID" || true; PID=

m() { printf '%s\n' ${T[$1]} | median; }
ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$(m "$1")" "$(m "$2")"; }
MACHINE="$(machine), ext4 on $(df --output=source "$DIR" | tail -1), bindfs $(bindfs --version 2>&1 | head -1 | awk '{print $2}')"
{
	echo "### FUSE cost, $(date -u +%Y-%m-%d)"
	echo
	echo "\`FILE_MIB=$SIZE FILES=$FILES ROUNDS=$ROUNDS bench/studies/fuse-cost.sh\` on $MACHINE (medians of $ROUNDS rounds, cold caches)."
	echo
	echo "| setup | copy ${SIZE} MiB, s | × ext4 | create $FILES files, s | × ext4 | read them, s | × ext4 | page-cache copies after a read |"
	echo "|---|---:|---:|---:|---:|---:|---:|---:|"
	for s in "${SETUPS[@]}"; do
		echo "| $s | $(m "$s-copy") | $(ratio "$s-copy" ext4-copy) | $(m "$s-create") | $(ratio "$s-create" ext4-create) | $(m "$s-read") | $(ratio "$s-read" ext4-read) | $(m "$s-copies") |"
	done
	[ -z "$PHP_NOTE" ] || echo "| passthrough_hp (libfuse; passthrough mode and without) | not measured: $PHP_NOTE | | | | | | |"
	echo
	echo "vabc serve (base and COW read with O_DIRECT), one full read of the served $SIZE MiB: through its FUSE file $SERVED page-cache copies (the file is answered with direct I/O), through the loop device over it (--loop, as a mount uses it) $SERVED_LOOP."
} >"$W/report.md"
cat "$W/report.md"
record_results fuse-cost "$W/report.md"
