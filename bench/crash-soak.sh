#!/usr/bin/env bash
# bench/crash-soak.sh: thousands of injected crashes during merges of real
# corpus updates. Each crash point (process stop, power loss, torn unsynced
# writes) is checked twice: the snapshot view of what survived must be the
# new image, and a resumed merge must end at the new image. A point costs a
# few windows of work (see crates/merge/tests/crash_soak.rs), so thousands
# of points on the system pair take minutes; the working copies live in
# /dev/shm when it exists (override: SOAK_DIR=...).
#
# Usage: bench/crash-soak.sh [-p "tiny small system"] [-n POINTS_PER_PAIR] [-c CORPUS_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$ROOT/../shared}
CORPUS=/tmp/corpus
PAIRS="tiny small"
POINTS=1500
while getopts "p:n:c:" opt; do
	case $opt in
	p) PAIRS=$OPTARG ;;
	n) POINTS=$OPTARG ;;
	c) CORPUS=$OPTARG ;;
	*) sed -n '2,11p' "$0" >&2; exit 2 ;;
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
	"$VABC" diff "$CORPUS/$pair/old.ext4.img" "$CORPUS/$pair/new.ext4.img" -o "$WORK/$pair.cow" >/dev/null
	start=$(date +%s)
	out=$(VABC_SOAK_OLD="$CORPUS/$pair/old.ext4.img" VABC_SOAK_NEW="$CORPUS/$pair/new.ext4.img" \
		VABC_SOAK_COW="$WORK/$pair.cow" VABC_SOAK_POINTS="$POINTS" VABC_SOAK_DIR="$SOAK_DIR" \
		cargo test --release -q -p merge --test crash_soak -- --ignored --nocapture 2>&1) || { echo "$out"; exit 1; }
	line=$(echo "$out" | grep 'crash points over')
	echo "$pair ext4: $line ($(($(date +%s) - start)) s)"
	n=$(echo "$line" | sed -E 's/.*crash-soak: ([0-9]+) crash points.*/\1/')
	total=$((total + n))
done
echo "total: $total crash points, all recovered"
echo "command: bench/crash-soak.sh -p \"$PAIRS\" -n $POINTS   ($(nproc) cores, $(uname -sr), load $(cut -d' ' -f1-3 /proc/loadavg))"
