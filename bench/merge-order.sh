#!/usr/bin/env bash
# Merge order at Android's scale (issue: Android's own updates in, item 6): the merge
# operations of real partitions (update_engine's testdata/cycle_nodes_*.bin) ordered by
# vabc and by update_engine's generator as the spec describes it (blocks sent to
# REPLACE by cycles, time; both orders checked op by op), then the product set merged
# for real: its COW (v3, lz4) over a synthetic base of its size, merged in place by
# `vabc merge` with the sync engine (pread/pwrite/fsync per op: the "~500k COPY ops,
# 1.5M syscalls" case) and with io_uring, each result compared with the new image.
#
# Usage: bench/merge-order.sh    ROUNDS=N merges per engine (default 3);
# VABC=/path/to/vabc skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
ROUNDS=${ROUNDS:-3}
WORK=${BENCH_DIR:-${TMPDIR:-/tmp}/vabc-bench-merge-order}
mkdir -p "$WORK"
need_vabc
OUT=$WORK/results.md
V=crates/payload/tests/vectors/update_engine
{
	echo "### Merge order of real partitions, $(date -u +%Y-%m-%d)"
	echo
	echo "Machine: $(machine). Command: \`ROUNDS=$ROUNDS bench/merge-order.sh\`."
	echo
	cargo run --release -q -p vabc-payload --features fuzzing --example merge_order -- \
		--cow "$WORK" "$V"/cycle_nodes_*.bin
} >"$OUT"
"$VABC" manifest "$WORK/product.base.img" "$WORK/product.new.img" --cow "$WORK/product.cow" >/dev/null
ops=$("$VABC" inspect --json "$WORK/product.cow" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ops_total"])')
rm -f "$WORK"/*.t
for _ in $(seq "$ROUNDS"); do
	for engine in sync uring; do
		cp "$WORK/product.base.img" "$WORK/base.img"
		cp "$WORK/product.cow" "$WORK/run.cow" && cp "$WORK/product.cow.manifest" "$WORK/run.cow.manifest"
		cold
		"$VABC" --no-progress merge --engine "$engine" --json --base "$WORK/base.img" --cow "$WORK/run.cow" >"$WORK/$engine.json"
		cmp -s "$WORK/base.img" "$WORK/product.new.img" || { echo "MISMATCH after the $engine merge" >&2; exit 1; }
		python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["seconds"], r["syscalls"], r["fsyncs"], r["windows"])' \
			"$WORK/$engine.json" >>"$WORK/$engine.t"
	done
done
{
	echo
	echo "The product set merged in place ($ops COW ops, $(($(stat -c %s "$WORK/product.base.img") >> 20)) MiB base, cold"
	echo "page cache, median of $ROUNDS rounds; every result is the new image):"
	echo
	echo "| engine | wall s | syscalls | fsyncs | windows | time / uring |"
	echo "|---|---|---|---|---|---|"
	ut=$(cut -d' ' -f1 "$WORK/uring.t" | median)
	for engine in sync uring; do
		t=$(cut -d' ' -f1 "$WORK/$engine.t" | median)
		read -r _ sc fs win < <(tail -1 "$WORK/$engine.t")
		printf '| %s | %.1f | %s | %s | %s | %.2f |\n' "$engine" "$t" "$sc" "$fs" "$win" "$(echo "$t / $ut" | bc -l)"
	done
} >>"$OUT"
rm -f "$WORK/base.img" "$WORK/run.cow" "$WORK/run.cow.manifest"
cat "$OUT"
record_results merge-order "$OUT" merge
