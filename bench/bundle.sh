#!/usr/bin/env bash
# The update bundle against the byte-level deltas, in the same run (issue: the update
# bundle). Per corpus pair (ext4 images unless FS says otherwise):
#   vabc       vabc bundle create (signed, default options) and its install
#   xdelta3    xdelta3 -9 -B <old image size>  (the whole old image as source window)
#   zstd       zstd -19 --long=31 --patch-from=OLD  (the old image as a prefix)
# Each output is decoded again and compared with NEW (vabc: bundle apply, and the
# installed COW merged in place into a copy of OLD; the anchors: their own decoders),
# sizes in bytes, wall seconds and peak RSS (/usr/bin/time).
# Target: bundle <= min(xdelta3, zstd) on every ext4 pair and for a bundle of several
# partitions against the sum; creation <= xdelta3's wall time with peak RSS < 1 GiB;
# install peak RSS < 512 MiB.
#
# Usage: bench/bundle.sh [PAIR...]         (default: tiny small medium system)
# FS=erofs for the EROFS images; VABC=/path/to/vabc skips the build.
# MULTI=1 also makes one bundle of all the pairs (one partition each) and compares it
# with the sum of the anchors. ROUNDS=N (default 1) runs the three creations and the
# install N times, in turn, and reports the median times and the largest peak RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
ROUNDS=${ROUNDS:-1}
PAIRS=${*:-tiny small medium system}
FS=${FS:-ext4}
CORPUS=${CORPUS:-${TMPDIR:-/tmp}/corpus}
WORK=${BENCH_DIR:-${TMPDIR:-/tmp}/vabc-bench-bundle}
mkdir -p "$WORK"
need_vabc
command -v xdelta3 >/dev/null && command -v zstd >/dev/null && command -v openssl >/dev/null ||
	{ echo "needs xdelta3, zstd and openssl (scripts/install-deps.sh)" >&2; exit 1; }
[ -f "$WORK/key.pem" ] || openssl genpkey -algorithm ed25519 -out "$WORK/key.pem" 2>/dev/null
openssl pkey -in "$WORK/key.pem" -pubout -out "$WORK/pub.pem"

# Runs a command; prints "SECONDS MAX_RSS_KIB".
measure() {
	local t="$WORK/time"
	/usr/bin/time -f "%e %M" -o "$t" "$@" >/dev/null 2>"$WORK/err" || { cat "$WORK/err" >&2; return 1; }
	cat "$t"
}
same() { cmp -s "$1" "$2" || { echo "MISMATCH: $1 is not $2" >&2; exit 1; }; }
# med NAME: the median of the times in file NAME.t, the largest RSS in NAME.m.
med() { printf '%s %s\n' "$(median <"$WORK/$1.t")" "$(sort -g "$WORK/$1.m" | tail -1)"; }

echo "| pair | image MB | vabc bundle | xdelta3 -9 -B | zstd -19 --patch-from | bundle / best | create s (vabc / xdelta3 / zstd) | create time / xdelta3, / zstd | create peak RSS MiB (vabc / xdelta3 / zstd) | install s, peak RSS MiB |"
echo "|---|---|---|---|---|---|---|---|---|---|"
SUM_X=0 SUM_Z=0 SPECS=() BASES=()
for p in $PAIRS; do
	OLD=$CORPUS/$p/old.$FS.img NEW=$CORPUS/$p/new.$FS.img
	[ -f "$NEW" ] || bash ../shared/corpus/make-corpus.sh -p "$p" -o "$CORPUS" >/dev/null
	out=$WORK/$p
	rm -rf "$out" && mkdir -p "$out/cows" "$out/imgs"
	if (($(stat -c %s "$NEW") > $(stat -c %s "$OLD"))); then
		# A bundle takes OLD as the whole partition, and a partition that will hold NEW
		# is at least as large: every tool gets OLD padded with zeros to NEW's size.
		cp "$OLD" "$out/old-padded.img" && truncate -s "$(stat -c %s "$NEW")" "$out/old-padded.img"
		OLD=$out/old-padded.img
	fi
	rm -f "$WORK"/[vxzi].[tm]
	for _ in $(seq "$ROUNDS"); do
		rm -rf "$out/cows" && mkdir -p "$out/cows"
		for t in v x z i; do
			case $t in
			v) r=$(measure "$VABC" bundle create -p "$p=$OLD,$NEW" -o "$out/u.vabc" --key "$WORK/key.pem") ;;
			x) r=$(measure xdelta3 -9 -B "$(stat -c %s "$OLD")" -e -f -s "$OLD" "$NEW" "$out/u.xd3") ;;
			z) r=$(measure zstd -q -19 --long=31 -f --patch-from="$OLD" "$NEW" -o "$out/u.zst") ;;
			i) r=$(measure "$VABC" bundle install "$out/u.vabc" -b "$p=$OLD" -o "$out/cows" --key "$WORK/pub.pem") ;;
			esac
			echo "${r% *}" >>"$WORK/$t.t"
			echo "${r#* }" >>"$WORK/$t.m"
		done
	done
	read -r vt vm < <(med v)
	read -r xt xm < <(med x)
	read -r zt zm < <(med z)
	read -r it im < <(med i)
	# Every output decodes to NEW.
	"$VABC" bundle apply "$out/u.vabc" -b "$p=$OLD" -o "$out/imgs" --key "$WORK/pub.pem" >/dev/null
	same "$out/imgs/$p.img" "$NEW"
	xdelta3 -d -B "$(stat -c %s "$OLD")" -f -s "$OLD" "$out/u.xd3" "$out/x.img"
	same "$out/x.img" "$NEW"
	zstd -q -d --long=31 -f --patch-from="$OLD" "$out/u.zst" -o "$out/z.img"
	same "$out/z.img" "$NEW"
	# The installed COW merges in place to NEW (a base file shorter than NEW is
	# extended first, as a partition would be large enough).
	ns=$(stat -c %s "$NEW")
	cp "$OLD" "$out/base.img"
	(($(stat -c %s "$out/base.img") >= ns)) || truncate -s "$ns" "$out/base.img"
	"$VABC" -q merge --base "$out/base.img" --cow "$out/cows/$p.cow" >/dev/null
	cmp -s -n "$ns" "$out/base.img" "$NEW" || { echo "MISMATCH: merged $p is not $NEW" >&2; exit 1; }
	rm -f "$out/x.img" "$out/z.img" "$out/imgs/$p.img" "$out/base.img"
	vs=$(stat -c %s "$out/u.vabc") xs=$(stat -c %s "$out/u.xd3") zs=$(stat -c %s "$out/u.zst")
	best=$((xs < zs ? xs : zs))
	SUM_X=$((SUM_X + xs)) SUM_Z=$((SUM_Z + zs))
	SPECS+=(-p "$p=$OLD,$NEW") BASES+=(-b "$p=$OLD")
	printf '| %s | %.0f | %s | %s | %s | %.3f | %s / %s / %s | %.2f, %.2f | %d / %d / %d | %s, %d |\n' \
		"$p" "$(echo "$(stat -c %s "$NEW") / 1000000" | bc -l)" "$vs" "$xs" "$zs" \
		"$(echo "$vs / $best" | bc -l)" "$vt" "$xt" "$zt" \
		"$(echo "$vt / $xt" | bc -l)" "$(echo "$vt / $zt" | bc -l)" \
		$((vm / 1024)) $((xm / 1024)) $((zm / 1024)) "$it" $((im / 1024))
done
if [ "${MULTI:-0}" = 1 ]; then
	read -r vt vm < <(measure "$VABC" bundle create "${SPECS[@]}" -o "$WORK/multi.vabc" --key "$WORK/key.pem")
	rm -rf "$WORK/multi" && mkdir -p "$WORK/multi"
	read -r it im < <(measure "$VABC" bundle install "$WORK/multi.vabc" "${BASES[@]}" -o "$WORK/multi" --key "$WORK/pub.pem")
	vs=$(stat -c %s "$WORK/multi.vabc")
	best=$((SUM_X < SUM_Z ? SUM_X : SUM_Z))
	printf '| all (one bundle) | | %s | %s (sum) | %s (sum) | %.3f | %s | | %d | %s, %d |\n' \
		"$vs" "$SUM_X" "$SUM_Z" "$(echo "$vs / $best" | bc -l)" "$vt" $((vm / 1024)) "$it" $((im / 1024))
fi
echo
echo "$(machine), load $(cut -d' ' -f1 /proc/loadavg); medians of $ROUNDS; reproduce: ROUNDS=$ROUNDS FS=$FS MULTI=${MULTI:-0} bench/bundle.sh $PAIRS"
