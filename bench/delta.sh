#!/usr/bin/env bash
# bench/delta.sh: `vabc diff` against the usual delta tools on the corpus.
#
# For every corpus pair and filesystem: patch/COW size, wall time and peak
# RSS (/usr/bin/time -v) of
#   vabc-lz4     vabc diff --compression lz4 (v3, 64 KiB units: Android's configuration)
#   vabc-zstd    vabc diff (defaults: v3, zstd level 19, 128 KiB units)
#   vabc-zstd64  vabc diff --compression-factor 64k (zstd:19 in Android's 64 KiB units)
#   vabc-zstd3   vabc diff --compression zstd:3 (fast)
#   vabc-zstd19  vabc diff --compression zstd:19 --compression-factor 256k (smallest)
#   vabc-noxor   vabc diff --no-xor (COPY+REPLACE only, default codec)
#   xd3          xdelta3 -e -9 -B <old size> -s OLD
#   zstd19p      zstd -19 --long=31 --patch-from=OLD
#   zstd3p       zstd -3 --long=31 --patch-from=OLD
#   bsdiff       bsdiff OLD NEW (killed after BSDIFF_TIMEOUT s, default 1200:
#                the row then says "did not finish in 20 min")
#   zstd19       zstd -19 --long=31 of NEW alone (full-image baseline)
# "payload" is what a COW stores beyond its fixed parts (REPLACE and XOR
# data; not the 2 MiB merge scratch area, op records and sequence); for the
# other tools it is the whole patch. Every output is decoded again (`vabc
# apply` for COWs) and compared with NEW byte for byte. The table goes to stdout (markdown) and, raw, to
# bench-delta.tsv in the working directory.
#
# With -m, the round-trip matrix follows the table: v2 and v3 x every codec
# of -C (diff + apply + cmp) on every pair. Its default levels are fast ones
# (brotli:1, zstd:3): it checks every codec's encode/decode path, not sizes.
# -t "" skips the table (matrix only); exit status 1 if a matrix row fails.
#
# Usage: bench/delta.sh [-p "tiny small medium system"] [-f "ext4 erofs erofs-lz4hc"]
#                       [-t "vabc-lz4 vabc-zstd ..."] [-c CORPUS_DIR] [-m]
#                       [-C "none gz lz4 zstd:3 brotli:1"]
# Example (the full system-pair run):
#   nice -n 19 bench/delta.sh -p system -f "ext4 erofs erofs-lz4hc" -m
# Everything at once (hours): bench/delta.sh -m
# Needs (Debian): xdelta3 zstd bsdiff time; the corpus is built with
# ../shared/corpus/make-corpus.sh when missing.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$ROOT/../shared}
CORPUS=/tmp/corpus
PAIRS="tiny small medium system"
FSS="ext4 erofs erofs-lz4hc"
TOOLS="vabc-lz4 vabc-zstd vabc-zstd64 vabc-zstd3 vabc-zstd19 vabc-noxor xd3 zstd19p zstd3p bsdiff zstd19"
CODECS="none gz lz4 zstd:3 brotli:1"
MATRIX=0
BSDIFF_TIMEOUT=${BSDIFF_TIMEOUT:-1200}
CMDLINE="bench/delta.sh$(printf " %q" "$@")"
while getopts "p:f:t:c:mC:" opt; do
	case $opt in
	p) PAIRS=$OPTARG ;;
	f) FSS=$OPTARG ;;
	t) TOOLS=$OPTARG ;;
	c) CORPUS=$OPTARG ;;
	m) MATRIX=1 ;;
	C) CODECS=$OPTARG ;;
	*) sed -n '2,37p' "$0" >&2; exit 2 ;;
	esac
done

for t in xdelta3 zstd bsdiff /usr/bin/time; do
	command -v "$t" >/dev/null || { echo "missing $t (apt-get install xdelta3 zstd bsdiff time)" >&2; exit 1; }
done

(cd "$ROOT" && cargo build --release -q -p vabc)
VABC=${CARGO_TARGET_DIR:-$ROOT/target}/release/vabc
[ -x "$VABC" ] || { echo "no vabc binary at $VABC" >&2; exit 1; }

for pair in $PAIRS; do
	for fs in $FSS; do
		if [ ! -e "$CORPUS/$pair/new.$fs.img" ]; then
			bash "$SHARED/corpus/make-corpus.sh" -p "$pair" -o "$CORPUS" >&2
			break
		fi
	done
done

W=$(mktemp -d "${TMPDIR:-/tmp}/bench-delta.XXXXXX")
trap 'rm -rf "$W"' EXIT

# measure CMD...: R_S = wall seconds, R_MB = peak RSS MiB, R_RC = exit
# status (124 when killed by timeout); fails like CMD
measure() {
	R_RC=0
	/usr/bin/time -v -o "$W/time" "$@" >"$W/out.log" 2>"$W/err.log" || R_RC=$?
	if [ $R_RC = 0 ]; then
		R_S=$(awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,a,":"); s=0; for(i=1;i<=n;i++) s=s*60+a[i]; print s}' "$W/time")
		R_MB=$(awk -F': ' '/Maximum resident set size/ {printf "%d", $2/1024}' "$W/time")
		return 0
	fi
	R_S=NA R_MB=NA
	tail -3 "$W/err.log" >&2
	return 1
}

same() { cmp -s "$1" "$2" && echo ok || echo MISMATCH; }

cow_apply() { # OLD COW NEW -> $W/applied, prints ok/MISMATCH
	local size
	size=$(stat -c %s "$3")
	if "$VABC" apply --base "$1" --cow "$2" -o "$W/applied" --size "$size" >/dev/null 2>"$W/apply.err"; then
		same "$W/applied" "$3"
	else
		tail -2 "$W/apply.err" >&2
		echo APPLY-FAILED
	fi
}

matrix() {
	printf '| pair | fs | format | codec | COW bytes | diff s | round trip |\n|---|---|---|---|---:|---:|---|\n'
	fail=0
	for pair in $PAIRS; do
		for fs in $FSS; do
			old=$CORPUS/$pair/old.$fs.img new=$CORPUS/$pair/new.$fs.img
			for v in v2 v3; do
				for c in $CODECS; do
					rm -f "$W/u.cow" "$W/applied"
					if measure "$VABC" diff "$old" "$new" -o "$W/u.cow" --format $v --compression $c; then
						ok=$(cow_apply "$old" "$W/u.cow" "$new")
					else
						ok=DIFF-FAILED
					fi
					[ "$ok" = ok ] || fail=1
					printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$pair" "$fs" $v $c "$(stat -c %s "$W/u.cow" 2>/dev/null || echo NA)" "$R_S" "$ok"
				done
			done
		done
	done
	return $fail
}


status=0
if [ -n "${TOOLS// /}" ]; then
TSV=bench-delta.tsv
printf 'pair\tfs\ttool\tbytes\tpayload\twall_s\trss_mib\tok\n' >"$TSV"
echo "| pair | fs | tool | bytes | × xdelta3 -9 | payload bytes | payload × xdelta3 | wall s | × xdelta3 time | peak RSS MiB | output = NEW |"
echo "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
for pair in $PAIRS; do
	for fs in $FSS; do
		old=$CORPUS/$pair/old.$fs.img new=$CORPUS/$pair/new.$fs.img
		oldsize=$(stat -c %s "$old")
		rows=()
		xd_bytes= xd_s=
		for t in $TOOLS; do
			rm -f "$W/p" "$W/applied" "$W/out"
			ok=fail bytes=NA payload=
			case $t in
			vabc-lz4 | vabc-zstd | vabc-zstd64 | vabc-zstd3 | vabc-zstd19 | vabc-noxor)
				args=()
				[ $t = vabc-lz4 ] && args=(--compression lz4 --compression-factor 64k)
				[ $t = vabc-zstd64 ] && args=(--compression-factor 64k)
				[ $t = vabc-zstd3 ] && args=(--compression zstd:3)
				[ $t = vabc-zstd19 ] && args=(--compression zstd:19 --compression-factor 256k)
				[ $t = vabc-noxor ] && args=(--no-xor)
				if measure "$VABC" diff "$old" "$new" -o "$W/p" --json "${args[@]}"; then
					payload=$(python3 -c 'import json,sys; b=json.load(open(sys.argv[1]))["bytes"]; print(b["replace"]+b["xor"])' "$W/out.log")
					ok=$(cow_apply "$old" "$W/p" "$new")
				fi
				;;
			xd3)
				B=$(((oldsize + 1048575) / 1048576 * 1048576))
				if measure xdelta3 -e -f -9 -B "$B" -s "$old" "$new" "$W/p"; then
					s=$R_S m=$R_MB
					xdelta3 -d -f -B "$B" -s "$old" "$W/p" "$W/out" && ok=$(same "$W/out" "$new")
					R_S=$s R_MB=$m
				fi
				;;
			zstd19p | zstd3p)
				lvl=19
				[ $t = zstd3p ] && lvl=3
				if measure zstd -q -f -T1 -$lvl --long=31 --patch-from="$old" "$new" -o "$W/p"; then
					s=$R_S m=$R_MB
					zstd -q -f -d --long=31 --patch-from="$old" "$W/p" -o "$W/out" && ok=$(same "$W/out" "$new")
					R_S=$s R_MB=$m
				fi
				;;
			bsdiff)
				if measure timeout "$BSDIFF_TIMEOUT" bsdiff "$old" "$new" "$W/p"; then
					s=$R_S m=$R_MB
					bspatch "$old" "$W/out" "$W/p" && ok=$(same "$W/out" "$new")
					R_S=$s R_MB=$m
				elif [ "$R_RC" = 124 ]; then
					# a partial patch is no result
					rm -f "$W/p"
					R_S=">$BSDIFF_TIMEOUT"
					ok="did not finish in $((BSDIFF_TIMEOUT / 60)) min"
				fi
				;;
			zstd19)
				if measure zstd -q -f -T1 -19 --long=31 "$new" -o "$W/p"; then
					s=$R_S m=$R_MB
					zstd -q -f -d --long=31 "$W/p" -o "$W/out" && ok=$(same "$W/out" "$new")
					R_S=$s R_MB=$m
				fi
				;;
			*) echo "unknown tool $t" >&2; continue ;;
			esac
			[ -e "$W/p" ] && bytes=$(stat -c %s "$W/p")
			[ -n "$payload" ] || payload=$bytes
			if [ $t = xd3 ]; then xd_bytes=$bytes xd_s=$R_S; fi
			printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$pair" "$fs" "$t" "$bytes" "$payload" "$R_S" "$R_MB" "$ok" >>"$TSV"
			rows+=("$t|$bytes|$payload|$R_S|$R_MB|$ok")
		done
		for r in "${rows[@]}"; do
			IFS='|' read -r t bytes payload s mb ok <<<"$r"
			ratio=- pratio=- tratio=-
			if [ -n "$xd_bytes" ] && [ "$xd_bytes" != NA ] && [ "$bytes" != NA ]; then
				ratio=$(awk -v a="$bytes" -v b="$xd_bytes" 'BEGIN { printf "%.2f", a / b }')
				pratio=$(awk -v a="$payload" -v b="$xd_bytes" 'BEGIN { printf "%.2f", a / b }')
			fi
			if [[ $xd_s =~ ^[0-9.]+$ && $s =~ ^[0-9.]+$ ]]; then
				tratio=$(awk -v a="$s" -v b="$xd_s" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }')
			fi
			printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$pair" "$fs" "$t" "$bytes" "$ratio" "$payload" "$pratio" "$s" "$tratio" "$mb" "$ok"
		done
	done
done
fi
if [ $MATRIX = 1 ]; then
	echo
	matrix || status=1
fi
echo
echo "machine: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -r); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "command: $CMDLINE"
exit $status
