#!/usr/bin/env bash
# Throughput of `vabc apply` (base + COW -> new image) against the raw limits
# of the same machine, measured in the same run:
#   read limit:        cat base.img > /dev/null
#   read+write limit:  cp base.img out.img && sync
# Data: a synthetic update made by our writer (crates/cow/examples/make_bench_cow.rs),
# SIZE_MIB of image (default 512), 50% unchanged blocks, COPY, unaligned XOR,
# multi-block REPLACE (v3, 64 KiB units) and ZERO, one COW per codec.
# Cold runs drop the page cache before each command (needs root); warm runs don't.
#
# Usage: bench/apply.sh [SIZE_MIB] [CODEC...]     e.g. bench/apply.sh 512 lz4 zstd
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:-512}
shift || true
CODECS=${*:-lz4 zstd}
WORK=${BENCH_DIR:-${TMPDIR:-/tmp}/vabc-bench-apply}
mkdir -p "$WORK"

cargo build --release -q -p vabc
cargo build --release -q -p vabc-cow --example make_bench_cow
VABC=target/release/vabc
if [ ! -f "$WORK/base.img" ] || [ "$(stat -c %s "$WORK/base.img")" -ne $((SIZE * 1048576)) ]; then
	target/release/examples/make_bench_cow "$WORK" "$SIZE" $CODECS
fi
for c in $CODECS; do
	[ -f "$WORK/update-$c.cow" ] || target/release/examples/make_bench_cow "$WORK" "$SIZE" $CODECS
done

can_drop=0
if [ -w /proc/sys/vm/drop_caches ]; then can_drop=1; fi
drop() { if [ "$can_drop" = 1 ]; then sync; echo 3 >/proc/sys/vm/drop_caches; fi; }
# Seconds (wall) of a command, to the millisecond.
timeit() {
	local s e
	s=$(date +%s.%N)
	"$@" >/dev/null
	e=$(date +%s.%N)
	echo "$e - $s" | bc -l
}
mbps() { echo "scale=1; $SIZE / $1" | bc -l; }

printf '%-7s %-5s %12s %9s %9s %13s %13s %9s %9s\n' codec cache cow_bytes apply_s apply_MB/s cat_MB/s cp+sync_MB/s vs_cat vs_cp
for mode in cold warm; do
	for c in $CODECS; do
		[ "$mode" = cold ] && drop
		t_cat=$(timeit cat "$WORK/base.img")
		[ "$mode" = cold ] && drop
		rm -f "$WORK/cp.img"
		t_cp=$(timeit sh -c "cp '$WORK/base.img' '$WORK/cp.img' && sync '$WORK/cp.img'")
		rm -f "$WORK/cp.img" "$WORK/out.img"
		[ "$mode" = cold ] && drop
		t_apply=$(timeit "$VABC" apply --base "$WORK/base.img" --cow "$WORK/update-$c.cow" -o "$WORK/out.img")
		cmp "$WORK/out.img" "$WORK/new.img" || { echo "MISMATCH for $c" >&2; exit 1; }
		rm -f "$WORK/out.img"
		printf '%-7s %-5s %12d %9.3f %9.1f %13.1f %13.1f %9.2f %9.2f\n' "$c" "$mode" \
			"$(stat -c %s "$WORK/update-$c.cow")" "$t_apply" "$(mbps "$t_apply")" \
			"$(mbps "$t_cat")" "$(mbps "$t_cp")" \
			"$(echo "$t_cat / $t_apply" | bc -l)" "$(echo "$t_cp / $t_apply" | bc -l)"
	done
done
echo "vs_cat / vs_cp: throughput of apply relative to the anchor (1.00 = as fast as the anchor)."
echo "command: bench/apply.sh $SIZE $CODECS   ($(nproc) cores, $(uname -sr))"
