#!/usr/bin/env bash
# What the device's trust checks cost: `vabc update boot` of an installed update,
# whose serving daemon proves the store against the signed head before it serves
# (signature, the COW's sealed sha256, the tree's levels against the signed root
# hash), against the same boot's other steps, and `sha256sum` of the COW (the floor of
# any full hash of it) as the anchor, in the same run.
#
#   bench/trust.sh [PAIR ...]      (default: small; the corpus pairs' ext4 images)
# Env: VABC (default: the release build), VABC_CORPUS, ROUNDS (default 5), RECORD=0.
# Reports run medians: the boot's wall time, the daemon's proof times from its log,
# the proof's cost per GB of COW, and sha256sum's time on the same COW.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/common.sh
. "$ROOT/bench/common.sh"
need_vabc
CORPUS=${VABC_CORPUS:-${TMPDIR:-/tmp}/corpus}
ROUNDS=${ROUNDS:-5}
PAIRS=("$@")
((${#PAIRS[@]})) || PAIRS=(small)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vabc-trust.XXXXXX")
stop_daemon() {
	local pid
	pid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$WORK/run/system.ready" 2>/dev/null) || return 0
	kill "$pid" 2>/dev/null || true
	while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
}
trap 'stop_daemon; rm -rf "$WORK"' EXIT
OUT=$WORK/results.md
{
	echo "## Trust checks at boot: $(date -u +%Y-%m-%d)"
	echo
	echo "\`bench/trust.sh ${PAIRS[*]}\`, medians of $ROUNDS boots; $(machine)."
	echo "The daemon proves the store before serving: the COW's sealed sha256 (the"
	echo "merge's own bytes taken as installed) and the tree's levels against the signed"
	echo "root hash. Anchor: \`sha256sum\` of the same COW, warm."
	echo
	echo "| pair | COW MB | boot s | COW proof s | tree proof s | proof s/GB of COW | sha256sum s | proof / sha256sum |"
	echo "|---|---|---|---|---|---|---|---|"
} >"$OUT"
openssl genpkey -algorithm ed25519 -out "$WORK/k.pem" 2>/dev/null
openssl pkey -in "$WORK/k.pem" -pubout -out "$WORK/pub.pem"
for pair in "${PAIRS[@]}"; do
	old=$CORPUS/$pair/old.ext4.img new=$CORPUS/$pair/new.ext4.img
	[ -e "$old" ] || "$ROOT/../shared/corpus/make-corpus.sh" "$pair" >&2
	rm -rf "$WORK/store" "$WORK/run"
	cp "$old" "$WORK/base.img"
	"$VABC" -q bundle create -p "system=$old,$new" -o "$WORK/u.vabc" --key "$WORK/k.pem" --verity >/dev/null
	"$VABC" -q update init --store "$WORK/store" >/dev/null
	"$VABC" -q update install --store "$WORK/store" "$WORK/u.vabc" -b "system=$WORK/base.img" \
		--key "$WORK/pub.pem" --max-boot-attempts 100 >/dev/null
	cow=$WORK/store/system.cow
	mb=$(awk -v b="$(stat -c %s "$cow")" 'BEGIN {printf "%.1f", b / 1e6}')
	: >"$WORK/boot" && : >"$WORK/cowp" && : >"$WORK/treep" && : >"$WORK/sum"
	for _ in $(seq "$ROUNDS"); do
		t0=$(date +%s.%N)
		"$VABC" -q update boot --store "$WORK/store" -b "system=$WORK/base.img" --frontend fuse \
			--run-dir "$WORK/run" --key "$WORK/pub.pem" >/dev/null
		t1=$(date +%s.%N)
		echo "$t1 - $t0" | bc -l >>"$WORK/boot"
		line=$(grep 'COW proven' "$WORK/run/system.log" | tail -1)
		echo "$line" | sed 's/.* in \([0-9.]*\) s, tree.*/\1/' >>"$WORK/cowp"
		echo "$line" | sed 's/.*tree in \([0-9.]*\) s.*/\1/' >>"$WORK/treep"
		stop_daemon
		t0=$(date +%s.%N)
		sha256sum "$cow" >/dev/null
		t1=$(date +%s.%N)
		echo "$t1 - $t0" | bc -l >>"$WORK/sum"
	done
	b=$(median <"$WORK/boot") c=$(median <"$WORK/cowp") t=$(median <"$WORK/treep") s=$(median <"$WORK/sum")
	per=$(awk -v c="$c" -v t="$t" -v mb="$mb" 'BEGIN {printf "%.2f", (c + t) / (mb / 1000)}')
	ratio=$(awk -v c="$c" -v s="$s" 'BEGIN {printf "%.2f", c / s}')
	printf '| %s | %s | %.2f | %.3f | %.3f | %s | %.3f | %s |\n' "$pair" "$mb" "$b" "$c" "$t" "$per" "$s" "$ratio" >>"$OUT"
done
cat "$OUT"
record_results "bench/trust.sh" "$OUT" trust
