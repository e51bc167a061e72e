#!/usr/bin/env bash
# Android OTA payloads (issue: Android's own updates in): vabc's extraction against
# the most used extractors, in the same run.
#
# Full: a full payload of more than 1 GB of partitions, laid out as delta_generator
# lays one out (2 MiB chunks, REPLACE_XZ or ZERO: crates/payload/examples/
# full_payload.rs; update_engine's Python payload tools write only major version 1
# and no data), from the corpus's new images. Each tool extracts every partition,
# ROUNDS times in turn; wall seconds (median) and peak RSS (largest) by
# /usr/bin/time; every image is compared with its source.
#   vabc        vabc payload extract --no-verify (every operation's data hash and
#               every image's hash still checked; the payload is unsigned)
#   pd-python   payload_dumper 0.3.0 from PyPI (nnsee/payload-dumper, the lineage of
#               vm03's payload_dumper; a thread per partition), in a venv under WORK
#   pd-rust     payload_dumper 0.8.4 from crates.io (rhythmcache's
#               payload-dumper-rust), cargo-installed under WORK
# payload-dumper-go, the most used, is not run: the Go module proxy answers 403
# ("This module version is not available") for github.com/ssut/payload-dumper-go at
# @latest, v1.3.0 and v1.2.2.
# Incremental: update_engine's own sample delta payload (BROTLI_BSDIFF,
# SOURCE_COPY, ZERO, REPLACE_BZ, REPLACE_XZ), and a payload of compressed and
# executable files (PUFFDIFF with puffin's own patch of a zip's blocks,
# LZ4DIFF_BSDIFF of an EROFS-like LZ4HC file, ZUCCHINI with a raw ensemble patch:
# crates/payload/examples/compressed_payload.rs), each tool's output compared with
# the target images.
#
# Usage: bench/payload.sh    ROUNDS=N (default 3); VABC=/path/to/vabc skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=bench/common.sh
. bench/common.sh
ROUNDS=${ROUNDS:-3}
CORPUS=${CORPUS:-${TMPDIR:-/tmp}/corpus}
WORK=${BENCH_DIR:-${TMPDIR:-/tmp}/vabc-bench-payload}
mkdir -p "$WORK"
need_vabc
OUT=$WORK/results.md

# The partitions: system (ext4) and vendor (EROFS) of the system pair, product
# (ext4) of the medium pair.
PARTS=(system="$CORPUS/system/new.ext4.img" vendor="$CORPUS/system/new.erofs.img" product="$CORPUS/medium/new.ext4.img")
for p in system medium; do
	[ -f "$CORPUS/$p/new.ext4.img" ] || bash ../shared/corpus/make-corpus.sh -p "$p" -o "$CORPUS" >/dev/null
done
PAYLOAD=$WORK/full.bin
if [ ! -f "$PAYLOAD" ]; then
	cargo run --release -q -p vabc-payload --features fuzzing --example full_payload -- "$PAYLOAD" "${PARTS[@]}"
fi

# The peers.
if [ ! -x "$WORK/venv/bin/payload_dumper" ]; then
	python3 -m venv "$WORK/venv"
	"$WORK/venv/bin/pip" install -q payload_dumper==0.3.0
fi
if [ ! -x "$WORK/cargo/bin/payload_dumper" ]; then
	cargo install -q --locked --root "$WORK/cargo" payload_dumper@0.8.4
fi
PD_PY=$WORK/venv/bin/payload_dumper
PD_RS=$WORK/cargo/bin/payload_dumper

# Runs a command; prints "SECONDS MAX_RSS_KIB", or "failed" (its stderr kept in
# $WORK/err).
measure() {
	local t="$WORK/time"
	if /usr/bin/time -f "%e %M" -o "$t" "$@" >"$WORK/log" 2>"$WORK/err"; then
		cat "$t"
	else
		echo failed
	fi
}
# same_all DIR: every partition image in DIR is its source.
same_all() {
	local spec
	for spec in "${PARTS[@]}"; do
		cmp -s "$1/${spec%%=*}.img" "${spec#*=}" || { echo "MISMATCH: $1/${spec%%=*}.img" >&2; return 1; }
	done
}
run() { # TOOL OUTDIR
	case $1 in
	vabc) measure "$VABC" --no-progress payload extract --no-verify -o "$2" "$PAYLOAD" ;;
	pd-python) measure "$PD_PY" --out "$2" "$PAYLOAD" ;;
	pd-rust) measure "$PD_RS" --out "$2" "$PAYLOAD" ;;
	esac
}

TOOLS=(vabc pd-python pd-rust)
rm -f "$WORK"/*.t "$WORK"/*.m
for _ in $(seq "$ROUNDS"); do
	for t in "${TOOLS[@]}"; do
		d=$WORK/out-$t
		rm -rf "$d" && mkdir -p "$d"
		cold
		r=$(run "$t" "$d")
		if [ "$r" = failed ] || ! same_all "$d"; then
			echo "$t failed: $(tail -3 "$WORK/err")" >&2
			echo failed >>"$WORK/$t.t"
			continue
		fi
		echo "${r% *}" >>"$WORK/$t.t"
		echo "${r#* }" >>"$WORK/$t.m"
	done
done
rm -rf "$WORK"/out-*

total=0
for spec in "${PARTS[@]}"; do total=$((total + $(stat -c %s "${spec#*=}"))); done
{
	echo "### Payload extraction, $(date -u +%Y-%m-%d)"
	echo
	echo "Machine: $(machine). Command: \`ROUNDS=$ROUNDS bench/payload.sh\`."
	echo "Full payload: $(stat -c %s "$PAYLOAD") bytes, 3 partitions of $total bytes in all"
	echo "(system ext4, vendor EROFS, product ext4; 2 MiB REPLACE_XZ/ZERO chunks), cold page cache,"
	echo "median of $ROUNDS rounds, peak RSS the largest."
	echo
	echo "| tool | wall s | peak RSS MiB | wall / vabc | RSS / vabc |"
	echo "|---|---|---|---|---|"
	vt=$(grep -v failed "$WORK/vabc.t" | median)
	vm=$(sort -g "$WORK/vabc.m" | tail -1)
	for t in "${TOOLS[@]}"; do
		if grep -q failed "$WORK/$t.t"; then
			echo "| $t | failed | | | |"
			continue
		fi
		tt=$(median <"$WORK/$t.t")
		tm=$(sort -g "$WORK/$t.m" | tail -1)
		printf '| %s | %.1f | %d | %.2f | %.2f |\n' "$t" "$tt" $((tm / 1024)) \
			"$(echo "$tt / $vt" | bc -l)" "$(echo "$tm / $vm" | bc -l)"
	done
} >"$OUT"

# Incremental: update_engine's sample delta payload.
S=$WORK/samples
rm -rf "$S" && mkdir -p "$S/images" "$S/old"
tar -xJf crates/payload/tests/vectors/update_engine/sample_payloads.tar.xz -C "$S"
tar -xjf crates/payload/tests/vectors/update_engine/sample_images.tar.bz2 -C "$S/images"
cp "$S/images/disk_ext2_4k_empty.img" "$S/old/kernel.img"
cp "$S/images/disk_sqfs_empty.img" "$S/old/root.img"
inc() { # TOOL OUTDIR
	case $1 in
	vabc) "$VABC" --no-progress payload extract --no-verify --old "$S/old" -o "$2" "$S/delta_payload.bin" ;;
	pd-python) "$PD_PY" --diff --old "$S/old" --out "$2" "$S/delta_payload.bin" ;;
	pd-rust) "$PD_RS" --source-dir "$S/old" --out "$2" "$S/delta_payload.bin" ;;
	esac
}
{
	echo
	echo "Incremental: update_engine's sample delta payload (minor version 6; BROTLI_BSDIFF,"
	echo "SOURCE_COPY, ZERO, REPLACE_BZ, REPLACE_XZ) applied to its old images:"
	echo
	echo "| tool | result |"
	echo "|---|---|"
	for t in "${TOOLS[@]}"; do
		d=$S/out-$t
		mkdir -p "$d"
		if inc "$t" "$d" >"$WORK/log" 2>&1 &&
			cmp -s "$d/kernel.img" "$S/images/disk_ext2_4k.img" &&
			cmp -s "$d/root.img" "$S/images/disk_sqfs_default.img"; then
			echo "| $t | both images exact |"
		else
			echo "| $t | fails: $(grep -v '^\s*$' "$WORK/log" | tail -1 | cut -c1-120 | tr '|' '/') |"
		fi
	done
} >>"$OUT"

# Incremental with compressed files.
C=$WORK/compressed
rm -rf "$C" && mkdir -p "$C"
cargo run --release -q -p vabc-payload --features fuzzing --example compressed_payload -- "$C"
cinc() { # TOOL OUTDIR
	case $1 in
	vabc) "$VABC" --no-progress payload extract --no-verify --old "$C/old" -o "$2" "$C/compressed.bin" ;;
	pd-python) "$PD_PY" --diff --old "$C/old" --out "$2" "$C/compressed.bin" ;;
	pd-rust) "$PD_RS" --source-dir "$C/old" --out "$2" "$C/compressed.bin" ;;
	esac
}
{
	echo
	echo "Incremental with compressed and executable files (PUFFDIFF: puffin's own patch"
	echo "of a zip's blocks; LZ4DIFF_BSDIFF: an EROFS-like LZ4HC file; ZUCCHINI: a raw"
	echo "ensemble patch) applied to its old image:"
	echo
	echo "| tool | result |"
	echo "|---|---|"
	for t in "${TOOLS[@]}"; do
		d=$C/out-$t
		mkdir -p "$d"
		if cinc "$t" "$d" >"$WORK/log" 2>&1 && cmp -s "$d/vendor.img" "$C/new/vendor.img"; then
			echo "| $t | image exact |"
		else
			# The tool's first complaint (some exit 0 and leave a wrong image).
			why=$(grep -iE 'unsupported|mismatch|error|fail' "$WORK/log" | head -1)
			[ -n "$why" ] || why=$(grep -v '^\s*$' "$WORK/log" | tail -1)
			echo "| $t | fails: $(echo "$why" | cut -c1-120 | tr '|' '/') |"
		fi
	done
} >>"$OUT"
cat "$OUT"
record_results payload "$OUT" payload
