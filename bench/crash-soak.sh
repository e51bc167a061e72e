#!/usr/bin/env bash
# bench/crash-soak.sh: thousands of injected crashes during merges of real
# corpus updates. Each crash point (process stop, power loss, torn unsynced
# writes) is checked twice: the snapshot view of what survived must be the
# new image, and a resumed merge must end at the new image.
#
# Usage: bench/crash-soak.sh [-p "tiny small"] [-n POINTS_PER_PAIR] [-c CORPUS_DIR]
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
	*) sed -n '2,8p' "$0" >&2; exit 2 ;;
	esac
done
cd "$ROOT"
cargo build --release -q -p vabc
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
total=0
for pair in $PAIRS; do
	[ -e "$CORPUS/$pair/old.ext4.img" ] || bash "$SHARED/corpus/make-corpus.sh" -p "$pair" -o "$CORPUS" >&2
	target/release/vabc diff "$CORPUS/$pair/old.ext4.img" "$CORPUS/$pair/new.ext4.img" -o "$WORK/$pair.cow" >/dev/null
	start=$(date +%s)
	out=$(VABC_SOAK_OLD="$CORPUS/$pair/old.ext4.img" VABC_SOAK_NEW="$CORPUS/$pair/new.ext4.img" \
		VABC_SOAK_COW="$WORK/$pair.cow" VABC_SOAK_POINTS="$POINTS" \
		cargo test --release -q -p merge --test crash_soak -- --ignored --nocapture 2>&1) || { echo "$out"; exit 1; }
	line=$(echo "$out" | grep 'crash points over')
	echo "$pair ext4: $line ($(($(date +%s) - start)) s)"
	n=$(echo "$line" | sed -E 's/.*crash-soak: ([0-9]+) crash points.*/\1/')
	total=$((total + n))
done
echo "total: $total crash points, all recovered"
echo "command: bench/crash-soak.sh -p \"$PAIRS\" -n $POINTS   ($(nproc) cores, $(uname -sr))"
