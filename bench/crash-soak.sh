#!/usr/bin/env bash
# bench/crash-soak.sh: thousands of injected crashes during merges of real
# corpus updates. Each crash point (process stop, power loss, torn unsynced
# writes) is checked twice: the snapshot view of what survived must be the
# new image, and a resumed merge must end at the new image. A point costs a
# few windows of work (see crates/merge/tests/crash_soak.rs), so thousands
# of points on the system pair take minutes; the working copies live in
# /dev/shm when it exists (override: SOAK_DIR=...).
#
# -f picks the corpus images (ext4, erofs, erofs-lz4hc; several in quotes).
# -d passes options to `vabc diff`, to soak other COW shapes than the default
# (v3, zstd:19, 128 KiB units), e.g. -d "--compression lz4" or -d "--format v2".
#
# Usage: bench/crash-soak.sh [-p "tiny small system"] [-n POINTS_PER_PAIR] [-c CORPUS_DIR]
#                           [-f "ext4 erofs"] [-d "DIFF OPTIONS"]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$ROOT/../shared}
CORPUS=/tmp/corpus
PAIRS="tiny small"
POINTS=1500
DIFF_OPTS=""
FSTYPES=ext4
while getopts "p:n:c:d:f:" opt; do
	case $opt in
	p) PAIRS=$OPTARG ;;
	n) POINTS=$OPTARG ;;
	c) CORPUS=$OPTARG ;;
	d) DIFF_OPTS=$OPTARG ;;
	f) FSTYPES=$OPTARG ;;
	*) sed -n '2,16p' "$0" >&2; exit 2 ;;
	esac
done
cd "$ROOT"
cargo build --release -q -p vabc
VABC=${CARGO_TARGET_DIR:-$ROOT/target}/release/vabc
if [ -z "${SOAK_DIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then SOAK_DIR=/dev/shm; fi
SOAK_DIR=${SOAK_DIR:-${TMPDIR:-/tmp}}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
total=0
for pair in $PAIRS; do
	[ -e "$CORPUS/$pair/old.ext4.img" ] || bash "$SHARED/corpus/make-corpus.sh" -p "$pair" -o "$CORPUS" >&2
	for fs in $FSTYPES; do
		old=$CORPUS/$pair/old.$fs.img new=$CORPUS/$pair/new.$fs.img
		osize=$(stat -c %s "$old") nsize=$(stat -c %s "$new")
		if [ "$osize" != "$nsize" ]; then
			# EROFS images differ in size: both padded with zeros to the
			# larger, as in a partition that holds either.
			size=$((osize > nsize ? osize : nsize))
			cp "$old" "$WORK/old.img" && truncate -s "$size" "$WORK/old.img"
			cp "$new" "$WORK/new.img" && truncate -s "$size" "$WORK/new.img"
			old=$WORK/old.img new=$WORK/new.img
		fi
		# shellcheck disable=SC2086 # DIFF_OPTS is a list of options
		"$VABC" diff $DIFF_OPTS "$old" "$new" -o "$WORK/$pair.cow" >/dev/null
		start=$(date +%s)
		out=$(VABC_SOAK_OLD="$old" VABC_SOAK_NEW="$new" \
			VABC_SOAK_COW="$WORK/$pair.cow" VABC_SOAK_POINTS="$POINTS" VABC_SOAK_DIR="$SOAK_DIR" \
			cargo test --release -q -p vabc-merge --test crash_soak -- --ignored --nocapture 2>&1) || { echo "$out"; exit 1; }
		line=$(echo "$out" | grep 'crash points over')
		echo "$pair $fs: $line ($(($(date +%s) - start)) s)"
		n=$(echo "$line" | sed -E 's/.*crash-soak: ([0-9]+) crash points.*/\1/')
		total=$((total + n))
	done
done
echo "total: $total crash points, all recovered"
echo "command: bench/crash-soak.sh -p \"$PAIRS\" -n $POINTS -f \"$FSTYPES\"${DIFF_OPTS:+ -d \"$DIFF_OPTS\"}   ($(nproc) cores, $(uname -sr), load $(cut -d' ' -f1-3 /proc/loadavg))"
