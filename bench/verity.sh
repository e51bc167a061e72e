#!/usr/bin/env bash
# bench/verity.sh: dm-verity tree building, `vabc verity format` against
# `veritysetup format`, on the same 1 GiB file in the same run.
#
# Both tools get the same salt and parameters (sha256, 4096/4096, superblock,
# fixed UUID) and must print the same root hash and write identical hash files;
# the run fails otherwise. Each tool runs RUNS times, alternating, with the data
# in the page cache (warm, as the anchor was measured: docs/06-verifying.md).
# Wall time is reported as median and best; the ratio is veritysetup's median
# over ours (target: >= 1.5).
#
# Also timed (no anchor on this machine): `vabc verity verify` (veritysetup
# verify alongside) and `vabc avb add-hashtree-footer` on a copy of the file.
#
# Serving: the same file is the base of an update whose new image differs in
# SERVE_CHANGES scattered MiB (COW by `vabc diff`, lz4), served as a device
# serves it: `vabc serve --base --cow` (CowEngine over base + COW), plain and
# with --verity-hash (tree of the new image by `vabc verity format`), each
# exporting FUSE and NBD. The base is read with O_DIRECT, vabc serve's
# default, so warm and cold differ in the COW and hash tree being cached;
# SERVE_DIRECT=0 serves with --buffered instead, where a warm base makes
# unverified serving a memcpy and hashing the whole difference (the worst
# case for the ratio). Each run reads the whole device sequentially from both daemons,
# alternating: `dd bs=1M iflag=direct` on the FUSE file (one request at a
# time) and `nbdcopy` to null: (many in flight). Two cache states, each with
# its verified/unverified ratio (target: >= 0.85):
#  - warm: files in the page cache (with SERVE_DIRECT=0 the base too) and the
#    daemons kept up;
#  - cold, as at boot: the page cache is dropped (`sync; echo 3 >
#    /proc/sys/vm/drop_caches`) after a fresh daemon starts, before each read,
#    so data and hash tree come from the disk while being served.
#
# Usage: [VABC=binary] bench/verity.sh [-s SIZE_MIB] [-r RUNS] [-c COLD_RUNS]
#                                      [-p PARTS] [-d WORKDIR]
# PARTS: comma-separated from format (tree build/verify/AVB, with veritysetup),
# warm, cold; default format,warm,cold. COLD_RUNS defaults to RUNS.
# Needs (Debian): cryptsetup-bin (veritysetup), libnbd-bin (nbdcopy), fuse3;
# root for the FUSE mounts and for dropping caches. Builds vabc in release mode.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SIZE_MIB=1024
RUNS=5
COLD_RUNS=
PARTS=format,warm,cold
WORK=${TMPDIR:-/tmp}/vabc-bench-verity
CMDLINE="${SERVE_DIRECT:+SERVE_DIRECT=$SERVE_DIRECT }${SERVE_CHANGES:+SERVE_CHANGES=$SERVE_CHANGES }bench/verity.sh $*"
while getopts "s:r:c:p:d:" opt; do
	case $opt in
	s) SIZE_MIB=$OPTARG ;;
	r) RUNS=$OPTARG ;;
	c) COLD_RUNS=$OPTARG ;;
	p) PARTS=$OPTARG ;;
	d) WORK=$OPTARG ;;
	*) echo "usage: $0 [-s SIZE_MIB] [-r RUNS] [-c COLD_RUNS] [-p format,warm,cold] [-d WORKDIR]" >&2; exit 2 ;;
	esac
done
COLD_RUNS=${COLD_RUNS:-$RUNS}
part() { [[ ",$PARTS," == *",$1,"* ]]; }

! part format || command -v veritysetup >/dev/null || { echo "veritysetup missing: apt-get install -y cryptsetup-bin" >&2; exit 1; }

# VABC=/path/to/vabc skips the build (e.g. to compare two binaries).
if [ -z "${VABC:-}" ]; then
	(cd "$ROOT" && cargo build --release -q -p vabc)
	VABC=${CARGO_TARGET_DIR:-$ROOT/target}/release/vabc
fi
[ -x "$VABC" ] || { echo "no release binary at $VABC" >&2; exit 1; }

mkdir -p "$WORK"
DATA=$WORK/data.img
BYTES=$((SIZE_MIB * 1024 * 1024))
if [ ! -f "$DATA" ] || [ "$(stat -c %s "$DATA")" -ne "$BYTES" ]; then
	echo "creating $SIZE_MIB MiB of random data in $DATA" >&2
	head -c "$BYTES" /dev/urandom >"$DATA.tmp" && mv "$DATA.tmp" "$DATA"
fi
cat "$DATA" >/dev/null # warm the page cache

SALT=000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f
UUID=01234567-89ab-4cde-8f01-23456789abcd
COMMON=(--hash=sha256 --salt=$SALT --uuid=$UUID --data-block-size=4096 --hash-block-size=4096)

now() { date +%s.%N; }
# elapsed START -> seconds with 3 decimals
elapsed() { echo "$(now) $1" | awk '{printf "%.3f", $1 - $2}'; }
# stats "t1 t2 ..." -> "median best"
stats() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{a[NR]=$1} END {m = (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2; printf "%.3f %.3f", m, a[1]}'; }

if part format; then
	T_OURS="" T_THEIRS="" T_VOURS="" T_VTHEIRS=""
	ROOT_OURS="" ROOT_THEIRS=""
	for i in $(seq "$RUNS"); do
		rm -f "$WORK/ours.hash" "$WORK/theirs.hash"
		t=$(now)
		ROOT_OURS=$("$VABC" verity format "${COMMON[@]}" "$DATA" "$WORK/ours.hash" | awk '/^Root hash:/{print $3}')
		T_OURS+=" $(elapsed "$t")"
		t=$(now)
		ROOT_THEIRS=$(veritysetup format "${COMMON[@]}" "$DATA" "$WORK/theirs.hash" | awk '/^Root hash:/{print $3}')
		T_THEIRS+=" $(elapsed "$t")"
		t=$(now)
		"$VABC" verity verify "$DATA" "$WORK/theirs.hash" "$ROOT_THEIRS" >/dev/null
		T_VOURS+=" $(elapsed "$t")"
		t=$(now)
		veritysetup verify "$DATA" "$WORK/ours.hash" "$ROOT_OURS"
		T_VTHEIRS+=" $(elapsed "$t")"
		echo "run $i: format vabc $(awk '{print $NF}' <<<"$T_OURS") s, veritysetup $(awk '{print $NF}' <<<"$T_THEIRS") s" >&2
	done
	[ "$ROOT_OURS" = "$ROOT_THEIRS" ] || { echo "root hashes differ: $ROOT_OURS vs $ROOT_THEIRS" >&2; exit 1; }
	cmp "$WORK/ours.hash" "$WORK/theirs.hash" || { echo "hash files differ" >&2; exit 1; }

	# AVB footer on a copy (the file is modified in place).
	T_AVB=""
	for i in $(seq "$RUNS"); do
		cp "$DATA" "$WORK/avb.img"
		t=$(now)
		"$VABC" avb add-hashtree-footer "$WORK/avb.img" --partition-size $((BYTES + 16 * 1024 * 1024)) \
			--partition-name system --salt $SALT >/dev/null
		T_AVB+=" $(elapsed "$t")"
	done
	rm -f "$WORK/avb.img"
fi

# --- verified vs unverified serving ---
if part warm || part cold; then
	command -v nbdcopy >/dev/null || { echo "nbdcopy missing: apt-get install -y libnbd-bin" >&2; exit 1; }
	SERVE_CHANGES=${SERVE_CHANGES:-64}
	SERVE_IO=(--buffered)
	[ "${SERVE_DIRECT:-1}" = 1 ] && SERVE_IO=()
	NEW=$WORK/serve-new.img
	if [ ! -f "$NEW" ] || [ "$NEW" -ot "$DATA" ]; then
		cp "$DATA" "$NEW.tmp"
		for k in $(seq 0 $((SERVE_CHANGES - 1))); do
			dd if=/dev/urandom of="$NEW.tmp" bs=1M count=1 seek=$((k * SIZE_MIB / SERVE_CHANGES + 3)) conv=notrunc status=none
		done
		mv "$NEW.tmp" "$NEW"
		rm -f "$WORK/serve.cow" "$WORK/serve.hash"
	fi
	[ -f "$WORK/serve.cow" ] || "$VABC" diff --compression lz4 "$DATA" "$NEW" -o "$WORK/serve.cow" >/dev/null
	# The tree is made from the real new image (kept for reruns); what is served is base + COW.
	SERVE_ROOT=$("$VABC" verity format --salt=$SALT "$NEW" "$WORK/serve.hash" | awk '/^Root hash:/{print $3}')
	cat "$DATA" "$WORK/serve.cow" "$WORK/serve.hash" >/dev/null

	PIDS=()
	stop_daemons() {
		for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
		PIDS=()
	}
	trap stop_daemons EXIT
	rm -f "$WORK"/serve-*.log
	NSTART=0
	start_daemon() { # NAME [extra args...]
		local name=$1
		shift
		NSTART=$((NSTART + 1))
		local log="$WORK/serve-$name-$NSTART.log"
		mkdir -p "$WORK/fuse-$name"
		rm -f "$WORK/$name.sock"
		: >"$log"
		"$VABC" serve --base "$DATA" --cow "$WORK/serve.cow" "${SERVE_IO[@]}" --fuse "$WORK/fuse-$name" \
			--nbd "unix:$WORK/$name.sock" "$@" >"$log" 2>&1 &
		PIDS+=($!)
		for _ in $(seq 300); do grep -q ready "$log" && return; sleep 0.1; done
		cat "$log" >&2
		exit 1
	}
	start_mode() { # plain|verified
		if [ "$1" = verified ]; then
			start_daemon verified --verity-hash "$WORK/serve.hash" --root-hash "$SERVE_ROOT"
		else
			start_daemon plain
		fi
	}
	# read_device FRONTEND MODE: reads the whole device once, prints the seconds.
	read_device() {
		local t
		t=$(now)
		if [ "$1" = fuse ]; then
			dd if="$WORK/fuse-$2/disk.img" of=/dev/null bs=1M iflag=direct status=none
		else
			nbdcopy "nbd+unix:///?socket=$WORK/$2.sock" null:
		fi
		elapsed "$t"
	}
	drop_caches() { sync && echo 3 >/proc/sys/vm/drop_caches; }

	declare -A TS
	# Warm: both daemons stay up, base, COW and hash file in the page cache, tree
	# blocks in the verifier's cache after the first read.
	if part warm; then
		start_mode plain
		start_mode verified
		for i in $(seq "$RUNS"); do
			for mode in plain verified; do
				for fe in fuse nbd; do TS[warm.$fe.$mode]+=" $(read_device $fe $mode)"; done
			done
			echo "run $i warm: fuse $(awk '{print $NF}' <<<"${TS[warm.fuse.plain]}")/$(awk '{print $NF}' <<<"${TS[warm.fuse.verified]}") s, nbd $(awk '{print $NF}' <<<"${TS[warm.nbd.plain]}")/$(awk '{print $NF}' <<<"${TS[warm.nbd.verified]}") s (plain/verified)" >&2
		done
		stop_daemons
	fi
	# Cold, as at boot: a fresh daemon per read and the page cache dropped after it
	# starts, so base, COW and hash tree all come from the disk while being served.
	if part cold; then
		for i in $(seq "$COLD_RUNS"); do
			for mode in plain verified; do
				for fe in fuse nbd; do
					start_mode $mode
					drop_caches
					TS[cold.$fe.$mode]+=" $(read_device $fe $mode)"
					stop_daemons
				done
			done
			echo "run $i cold: fuse $(awk '{print $NF}' <<<"${TS[cold.fuse.plain]}")/$(awk '{print $NF}' <<<"${TS[cold.fuse.verified]}") s, nbd $(awk '{print $NF}' <<<"${TS[cold.nbd.plain]}")/$(awk '{print $NF}' <<<"${TS[cold.nbd.verified]}") s (plain/verified)" >&2
		done
	fi
	# A verified read must have failed nowhere.
	if cat /dev/null "$WORK"/serve-verified-*.log 2>/dev/null | grep -q "failed verification"; then
		cat "$WORK"/serve-verified-*.log >&2
		exit 1
	fi
fi

mbps() { awk -v b="$BYTES" -v t="$1" 'BEGIN {printf "%.0f", b / t / 1e6}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)

if part format; then
	read -r MO BO <<<"$(stats "$T_OURS")"
	read -r MT BT <<<"$(stats "$T_THEIRS")"
	read -r MVO BVO <<<"$(stats "$T_VOURS")"
	read -r MVT BVT <<<"$(stats "$T_VTHEIRS")"
	read -r MA BA <<<"$(stats "$T_AVB")"
	echo
	echo "dm-verity tree, sha256 4K/4K, $SIZE_MIB MiB, warm cache, $RUNS runs each, $(nproc) CPUs, load $LOAD"
	echo
	echo "| operation | tool | median s | best s | MB/s (median) | ratio veritysetup/vabc (median) |"
	echo "|---|---|---:|---:|---:|---:|"
	echo "| format | vabc verity format | $MO | $BO | $(mbps "$MO") | $(ratio "$MT" "$MO") |"
	echo "| format | veritysetup format | $MT | $BT | $(mbps "$MT") | 1.00 |"
	echo "| verify | vabc verity verify | $MVO | $BVO | $(mbps "$MVO") | $(ratio "$MVT" "$MVO") |"
	echo "| verify | veritysetup verify | $MVT | $BVT | $(mbps "$MVT") | 1.00 |"
	echo "| avb footer | vabc avb add-hashtree-footer | $MA | $BA | $(mbps "$MA") | (avbtool not packaged: 2.24 s in notes) |"
	echo
	echo "root hash $ROOT_OURS (identical hash files)"
fi

if part warm || part cold; then
	echo
	echo "verified serving, $SIZE_MIB MiB device (base + $SERVE_CHANGES MiB of changes in the COW), sequential read, base read ${SERVE_IO[*]:-O_DIRECT}, $(nproc) CPUs, load $LOAD"
	echo
	echo "| cache | frontend | mode | runs | median s | best s | MB/s (median) | ratio verified/unverified (median) |"
	echo "|---|---|---|---:|---:|---:|---:|---:|"
	for cache in warm cold; do
		part $cache || continue
		[ $cache = warm ] && n=$RUNS || n=$COLD_RUNS
		for fe in fuse nbd; do
			read -r MP BP <<<"$(stats "${TS[$cache.$fe.plain]}")"
			read -r MV BV <<<"$(stats "${TS[$cache.$fe.verified]}")"
			[ $fe = fuse ] && how="FUSE, dd bs=1M iflag=direct" || how="NBD, nbdcopy to null:"
			echo "| $cache | $how | unverified | $n | $MP | $BP | $(mbps "$MP") | 1.00 |"
			echo "| $cache | $how | --verity-hash | $n | $MV | $BV | $(mbps "$MV") | $(ratio "$MP" "$MV") |"
		done
	done
fi
echo
echo "reproduce: $CMDLINE"
