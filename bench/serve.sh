#!/usr/bin/env bash
# Serving the new image of an update before merging, measured against two anchors in
# the same run (docs/05-serving.md explains the stacks):
#   loop-raw  a loop device (direct I/O) on the raw new.img: the limit of this machine
#   vabc      vabc serve --fuse (base + COW) + loop device (direct I/O), default
#             options: FUSE over io_uring, for which the bench turns the kernel switch
#             /sys/module/fuse/parameters/enable_uring on for the run (then back; off,
#             `vabc serve` would answer through /dev/fuse, as vabc-classic does)
#   vabc-classic  the same with --fuse-transport classic (requests read from and
#             answered through /dev/fuse)
#   vabc-uring  --fuse-transport uring: what `vabc` is when the switch is on (named so
#             before io_uring became the default, 2026-11-25)
#   qsd       qemu-storage-daemon's FUSE export of the raw new.img + loop (direct I/O):
#             a peer that serves a plain file, so an upper bound for a FUSE daemon
# Data: the corpus pair `system` (ext4), COW made with `vabc diff` (v3, lz4, default
# 128 KiB units).
# fio on the loop device, page cache dropped before each job:
#   seq 1 MiB QD1 (psync) and QD8 (io_uring); rand 4 KiB QD1 (psync) and QD32 (io_uring).
# Then one buffered read of the whole device and a mincore count of every cache layer
# (loop device, FUSE file, files the daemon reads): "copies" = cached bytes / image size.
# Targets (issue 4): rand 4K QD32 >= 1.5x qsd; seq 1M >= 0.8x loop-raw.
# All stacks stay up for the whole run and each job runs on every config back to back
# (forwards in odd rounds, backwards in even ones), so a ratio compares measurements
# seconds apart. ROUNDS (default 3) repeats the jobs; the table shows medians, the ratios
# are given per round and as their median (this disk's speed drifts by tens of percent
# from minute to minute, so one round says little). Each fio job also records the CPU
# time the hypervisor stole (/proc/stat); a round where it exceeded STEAL_MAX percent
# (default 5) for either side of a ratio is marked: on a shared host those rounds
# measure the neighbours, so the median of the other rounds is given too. EXTRA
# (default 0) more rounds are run while fewer than ROUNDS were free of steal. Each
# round's own figures follow the table, each with the KiB per read that reached the
# disk. fio's buffers are huge pages (bench/hugepages.sh), without which the loop-on-raw
# anchor moved between two speeds with the size of its reads.
#
# Needs root, fio, qemu-storage-daemon (qemu-system-common), python3.
# Usage: bench/serve.sh [PAIR]        (default system; RUNTIME=8 seconds per random job,
#                                     ROUNDS=3)
# Subsets for quick iterations: CONFIGS="loop-raw vabc" JOBS="seq1 seq8" bench/serve.sh
# (CONFIGS may also name vabc-uring)
# Other COWs: DIFF_ARGS="--no-xor" or DIFF_ARGS="--min-xor-run 64 --block-order" bench/serve.sh
# (more `vabc diff` options). VABC=/path/to/vabc serves with that binary, no build.
# BASELINE=/path/to/another/vabc adds the configs base-uring and base-classic (CONFIGS
# must name them): vabc-uring and vabc-classic served by that binary, for a refactor's
# before and after in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
PAIR=${1:-system}
RUNTIME=${RUNTIME:-8}
ROUNDS=${ROUNDS:-3}
CONFIGS=${CONFIGS:-loop-raw vabc vabc-classic qsd}
JOBS=${JOBS:-seq1 seq8 rnd1 rnd32 cache}
SEQ_SIZE=${SEQ_SIZE:-512M}
CORPUS=${CORPUS:-${TMPDIR:-/tmp}/corpus}
WORK=${BENCH_DIR:-${TMPDIR:-/tmp}/vabc-bench-serve}
mkdir -p "$WORK"

OLD=$CORPUS/$PAIR/old.ext4.img
NEW=$CORPUS/$PAIR/new.ext4.img
[ -f "$NEW" ] || bash ../shared/corpus/make-corpus.sh -p "$PAIR" -o "$CORPUS"

# VABC=/path/to/vabc skips the build (e.g. to compare two binaries).
if [ -z "${VABC:-}" ]; then
	cargo build --release -q -p vabc
	VABC=${CARGO_TARGET_DIR:-target}/release/vabc
fi
[ -x "$VABC" ] || { echo "no vabc binary at $VABC" >&2; exit 1; }
# lz4 by default: the codec Android devices decode at boot (zstd:19, our diff default,
# makes a smaller COW that costs more CPU per served XOR/REPLACE block).
CODEC=${CODEC:-lz4}
# DIFF_ARGS: more `vabc diff` options, e.g. --no-xor (a larger COW without the XOR ops'
# scattered two-block base reads; see bench/results/serve.md).
DIFF_ARGS=${DIFF_ARGS:-}
COW=$WORK/$PAIR.${CODEC//:/-}$(printf '%s' "$DIFF_ARGS" | tr -c 'a-zA-Z0-9=\n' '_').cow
# shellcheck disable=SC2086 # DIFF_ARGS is a list of options (as in bench/merge.sh)
[ -f "$COW" ] && [ "$COW" -nt "$NEW" ] || "$VABC" diff --compression "$CODEC" $DIFF_ARGS "$OLD" "$NEW" -o "$COW" >/dev/null
SIZE=$(stat -L -c %s "$NEW")

# Every stack is set up once and stays up for the whole run, so that each job runs
# on all configs back to back: a ratio compares measurements seconds apart, not
# minutes (the host's load drifts between them).
LOOPS=() DAEMONS=() MNTS=() URING_WAS=""
URING_PARAM=/sys/module/fuse/parameters/enable_uring
declare -A DEV FILES
cleanup() {
	{ exec 9<&-; } 2>/dev/null || true
	local x
	for x in "${LOOPS[@]}"; do losetup -d "$x" 2>/dev/null || true; done
	for x in "${DAEMONS[@]}"; do kill -TERM "$x" 2>/dev/null || true; wait "$x" 2>/dev/null || true; done
	for x in "${MNTS[@]}"; do mountpoint -q "$x" && umount "$x" 2>/dev/null || true; done
	LOOPS=() DAEMONS=() MNTS=()
	huge_off
	# The FUSE-over-io_uring switch goes back to what it was before the run.
	if [ -n "$URING_WAS" ]; then echo "$URING_WAS" >"$URING_PARAM" || true; fi
	URING_WAS=""
}
trap cleanup EXIT
# fio's buffers in huge pages (see bench/hugepages.sh): the loop-on-raw anchor's 1 MiB
# reads then reach the disk whole in every round.
# shellcheck source=bench/hugepages.sh
. bench/hugepages.sh
huge_on "$WORK/huge"

drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# MiB of PATH resident in the page cache (mincore over a read-only mapping; works for
# block devices too, which fincore does not).
resident() {
	python3 - "$1" <<'PY'
import ctypes, os, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.lseek(fd, 0, os.SEEK_END)
addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
if addr in (None, ctypes.c_void_p(-1).value):
    print("n/a")  # FUSE direct_io files cannot be mapped: they have no page cache
    sys.exit()
page = os.sysconf("SC_PAGE_SIZE")
vec = ctypes.create_string_buffer((size + page - 1) // page)
assert libc.mincore(addr, size, vec) == 0
print(sum(b & 1 for b in vec.raw) * page // 2**20)
libc.munmap(addr, size)
PY
}

# The block device under the images, for the size of the reads that reach it (a
# 1 MiB read goes out whole only from a physically contiguous buffer, see
# bench/hugepages.sh).
DISK_STAT=/sys/class/block/$(basename "$(findmnt -no SOURCE --target "$NEW" 2>/dev/null || echo none)")/stat
disk_reads() { if [ -r "$DISK_STAT" ]; then awk '{print $1, $3}' "$DISK_STAT"; else echo 0 0; fi; }
# CPU time the hypervisor gave to other guests (the `steal` column of
# /proc/stat) and all CPU time, in ticks.
cpu_ticks() { awk '/^cpu /{print $9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
# Prints MiB/s, IOPS, KiB per read that reached the disk ("-" if unknown) and the
# percentage of CPU time stolen during the job.
fio_job() { # TARGET NAME RW BS ENGINE DEPTH [extra...]
	local t=$1 name=$2 rw=$3 bs=$4 eng=$5 qd=$6 s0 s1 d0 d1 res
	shift 6
	drop
	d0=$(disk_reads)
	s0=$(cpu_ticks)
	res=$(fio --name="$name" --filename="$t" --rw="$rw" --bs="$bs" --direct=1 --ioengine="$eng" \
		--iodepth="$qd" "${FIO_MEM[@]}" --output-format=json "$@" 2>/dev/null |
		python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]; print("%.0f %.0f" % (j["bw_bytes"]/2**20, j["iops"]))')
	s1=$(cpu_ticks)
	d1=$(disk_reads)
	echo "$res $(echo "$d0 $d1" | awk '{n = $3 - $1; if (n > 0) printf "%.0f", ($4 - $2) / 2 / n; else printf "-"}') $(echo "$s0 $s1" | awk '{d = $4 - $2; printf "%.0f", (d > 0 ? 100 * ($3 - $1) / d : 0)}')"
}

declare -A R
has() { [[ " $JOBS " == *" $1 "* ]]; }
want() { [[ " $CONFIGS " == *" $1 "* ]]; }
# Runs job NAME on config CFG in round ROUND; keeps its figure (MiB/s for the
# sequential jobs, IOPS for the random ones) and its steal.
job() { # CFG NAME ROUND
	local cfg=$1 name=$2 round=$3 out field=1 dev=${DEV[$1]}
	case $name in
	seq1) out=$(fio_job "$dev" "$name" read 1M psync 1 --size="$SEQ_SIZE") ;;
	seq8) out=$(fio_job "$dev" "$name" read 1M io_uring 8 --size="$SEQ_SIZE") ;;
	rnd1) out=$(fio_job "$dev" "$name" randread 4k psync 1 --runtime="$RUNTIME" --time_based --randrepeat=0) field=2 ;;
	rnd32) out=$(fio_job "$dev" "$name" randread 4k io_uring 32 --runtime="$RUNTIME" --time_based --randrepeat=0) field=2 ;;
	esac
	R[$cfg.$name.$round]=$(echo "$out" | cut -d' ' -f"$field") R[$cfg.$name.kib.$round]=$(echo "$out" | cut -d' ' -f3)
	R[$cfg.$name.st.$round]=${out##* }
}
# Page-cache copies: the whole device read once, buffered, device kept open so its
# cache survives; then every layer counted.
copies() { # CFG
	local cfg=$1 dev=${DEV[$1]} layers="" total=0 f r
	drop
	exec 9<"$dev"
	dd if="$dev" of=/dev/null bs=1M status=none
	for f in "$dev" ${FILES[$cfg]}; do
		r=$(resident "$f")
		layers+="$(basename "$f")=${r} "
		[ "$r" != n/a ] && total=$((total + r))
	done
	exec 9<&-
	R[$cfg.cache]=$layers
	R[$cfg.copies]=$(echo "scale=2; $total / ($SIZE / 1048576)" | bc -l)
}
loop_on() { # CFG FILE: a read-only direct-I/O loop device on FILE is CFG's device
	DEV[$1]=$(losetup --find --show --read-only --direct-io=on "$2")
	LOOPS+=("${DEV[$1]}")
}
wait_ready() { # LOG
	for _ in $(seq 100); do grep -q ready "$1" && return; sleep 0.1; done
	cat "$1"
	exit 1
}

# (a) loop on the raw new image
start_loop_raw() {
	loop_on loop-raw "$NEW"
	FILES[loop-raw]=$NEW
}

# (b) vabc: FUSE export of base + COW, loop on top; (b2) the same over
# FUSE-over-io_uring (the kernel switch is per connection: the classic export
# does not negotiate it)
start_vabc_daemon() { # CFG DIR LOG [serve args...]
	local cfg=$1 dir=$2 log=$3
	shift 3
	mkdir -p "$dir"
	: >"$log" # truncate now: the background job may start after wait_ready's grep
	"$VABC" serve --base "$OLD" --cow "$COW" --size "$SIZE" --fuse "$dir" "$@" >"$log" 2>&1 &
	DAEMONS+=($!) MNTS+=("$dir")
	wait_ready "$log"
	loop_on "$cfg" "$dir/disk.img"
	FILES[$cfg]="$dir/disk.img $OLD $COW"
}
uring_on() {
	[ -n "$URING_WAS" ] || URING_WAS=$(cat "$URING_PARAM")
	echo Y >"$URING_PARAM"
}
start_vabc() {
	# Kernels without FUSE over io_uring (before 6.14) serve through /dev/fuse by default.
	local via="over FUSE io_uring"
	if [ -e "$URING_PARAM" ]; then uring_on; else via="through /dev/fuse"; fi
	start_vabc_daemon vabc "$WORK/fuse" "$WORK/serve.log"
	# The row must measure the transport it is said to (the log says which was picked).
	grep -q "$via" "$WORK/serve.log" || { echo "vabc serve did not serve $via:" >&2; cat "$WORK/serve.log" >&2; exit 1; }
	echo "vabc (the default options) serves $via"
}
start_vabc_classic() { start_vabc_daemon vabc-classic "$WORK/fuse-classic" "$WORK/serve-classic.log" --fuse-transport classic; }
start_vabc_uring() {
	uring_on
	start_vabc_daemon vabc-uring "$WORK/fuse-uring" "$WORK/serve-uring.log" --fuse-transport uring
}

start_base_uring() {
	uring_on
	VABC=$BASELINE start_vabc_daemon base-uring "$WORK/fuse-base-uring" "$WORK/serve-base-uring.log" --fuse-transport uring
}
start_base_classic() { VABC=$BASELINE start_vabc_daemon base-classic "$WORK/fuse-base-classic" "$WORK/serve-base-classic.log" --fuse-transport classic; }

# (c) qemu-storage-daemon FUSE export of the raw new image, loop on top
start_qsd() {
	touch "$WORK/qsdfile"
	qemu-storage-daemon \
		--blockdev driver=file,node-name=file0,filename="$NEW",cache.direct=on,aio=io_uring,read-only=on \
		--blockdev driver=raw,node-name=fmt0,file=file0,read-only=on \
		--export type=fuse,id=exp0,node-name=fmt0,mountpoint="$WORK/qsdfile",writable=off &
	DAEMONS+=($!) MNTS+=("$WORK/qsdfile")
	for _ in $(seq 100); do mountpoint -q "$WORK/qsdfile" && break; sleep 0.1; done
	loop_on qsd "$WORK/qsdfile"
	FILES[qsd]=$NEW
}

for c in $CONFIGS; do
	R[$c.copies]=- R[$c.cache]=""
	"start_${c//-/_}"
done

# Rounds: each job runs on every config back to back, in turn forwards and
# backwards (so a drift during the job's sequence hits both sides of a ratio
# alike); the table shows each cell's median and the ratios are given per round
# and as the median of those.
STEAL_MAX=${STEAL_MAX:-5}
# Up to EXTRA more rounds are run while fewer than ROUNDS rounds were free of
# steal (every job's steal at most STEAL_MAX percent).
EXTRA=${EXTRA:-0}
FORWARD=$CONFIGS
BACKWARD=$(printf '%s\n' $CONFIGS | tac | tr '\n' ' ')
round=0 clean=0
while [ "$clean" -lt "$ROUNDS" ] && [ "$round" -lt $((ROUNDS + EXTRA)) ]; do
	round=$((round + 1))
	order=$FORWARD
	[ $((round % 2)) = 0 ] && order=$BACKWARD
	worst=0
	for j in seq1 seq8 rnd1 rnd32; do
		has "$j" || continue
		for c in $order; do
			job "$c" "$j" "$round"
			st=${R[$c.$j.st.$round]:-0}
			worst=$((st > worst ? st : worst))
		done
	done
	[ "$worst" -gt "$STEAL_MAX" ] || clean=$((clean + 1))
done
# The page-cache count reads the whole device: once is enough.
if has cache; then
	for c in $CONFIGS; do copies "$c"; done
fi
cleanup
# How many requests went through the rings (the daemon says so as it stops).
for c in vabc vabc-uring; do
	if want "$c"; then echo "$c: $(grep -h "via the rings" "$WORK/serve${c#vabc}.log" || true)"; fi
done
RAN=$round
# The median of the numeric arguments ("-" if none), printed with FORMAT.
median() { # FORMAT VALUES...
	local fmt=$1
	shift
	printf '%s\n' "$@" | { grep -E '^[0-9.]+$' || true; } | sort -n |
		awk -v f="$fmt" '{v[NR]=$1} END {if (NR == 0) print "-"; else printf f "\n", (NR % 2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'
}
for c in $CONFIGS; do
	for j in seq1 seq8 rnd1 rnd32; do
		vals=()
		for round in $(seq "$RAN"); do vals+=("${R[$c.$j.$round]:-}"); done
		R[$c.$j]=$(median %.0f "${vals[@]}")
	done
done

ratio() { if [[ $1 =~ ^[0-9]+$ && $2 =~ ^[1-9][0-9]*$ ]]; then printf '%.2f' "$(echo "$1 / $2" | bc -l)"; else echo -; fi; }
# CONFIG ANCHOR JOB: the ratio in each round, then their median. A round in
# which the hypervisor stole more than STEAL_MAX percent of the CPU time
# during either job is marked with the larger of the two, and the median of
# the other rounds follows.
ratios() {
	local r st out="" vals=() shown=() calm=()
	for r in $(seq "$RAN"); do
		vals+=("$(ratio "${R[$1.$3.$r]:-}" "${R[$2.$3.$r]:-}")")
		st=$(( ${R[$1.$3.st.$r]:-0} > ${R[$2.$3.st.$r]:-0} ? ${R[$1.$3.st.$r]:-0} : ${R[$2.$3.st.$r]:-0} ))
		if [ "$st" -gt "$STEAL_MAX" ] && [ "${vals[-1]}" != - ]; then
			shown+=("${vals[-1]}[steal ${st}%]")
		else
			shown+=("${vals[-1]}") calm+=("${vals[-1]}")
		fi
	done
	if [ "$RAN" -gt 1 ] || [ "${shown[*]}" != "${vals[*]}" ]; then out=" (rounds: ${shown[*]})"; fi
	if [ "${#calm[@]}" -lt "${#vals[@]}" ]; then out+=", without steal $(median %.2f "${calm[@]}") (${#calm[@]} rounds)"; fi
	echo "$(median %.2f "${vals[@]}")$out"
}
echo
echo "pair $PAIR: new.ext4.img $((SIZE / 1048576)) MiB, COW $(($(stat -L -c %s "$COW") / 1048576)) MiB ($CODEC${DIFF_ARGS:+ $DIFF_ARGS}); $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
echo
echo "| config | seq 1M QD1 MiB/s | seq 1M QD8 MiB/s | rand 4K QD1 IOPS | rand 4K QD32 IOPS | page-cache copies after one full read (MiB per layer) |"
echo "|---|---|---|---|---|---|"
for c in loop-raw vabc vabc-classic vabc-uring qsd; do
	want "$c" || R[$c.seq1]=- R[$c.seq8]=- R[$c.rnd1]=- R[$c.rnd32]=- R[$c.copies]=- R[$c.cache]=""
	echo "| $c | ${R[$c.seq1]} | ${R[$c.seq8]} | ${R[$c.rnd1]} | ${R[$c.rnd32]} | ${R[$c.copies]} (${R[$c.cache]% }) |"
done
echo
for c in vabc vabc-classic vabc-uring; do
	want "$c" || continue
	echo "$c / loop-raw, seq 1M QD1: $(ratios "$c" loop-raw seq1)  QD8: $(ratios "$c" loop-raw seq8)   (target >= 0.8)"
	echo "$c / qsd, rand 4K QD32: $(ratios "$c" qsd rnd32)   QD1: $(ratios "$c" qsd rnd1)   (target >= 1.5)"
done
echo
# Each round's own figures, so that a ratio that moved can be traced to its side.
for c in $CONFIGS; do
	line=""
	for j in seq1 seq8 rnd1 rnd32; do
		has "$j" || continue
		vals=()
		for round in $(seq "$RAN"); do vals+=("${R[$c.$j.$round]:--}/${R[$c.$j.kib.$round]:--}"); done
		line+="  $j: ${vals[*]}"
	done
	echo "per round, $c (MiB/s or IOPS / KiB per disk read):$line"
done
echo "rounds: $RAN run, $clean without steal above $STEAL_MAX%"
echo "reproduce: sudo CODEC=$CODEC${DIFF_ARGS:+ DIFF_ARGS=\"$DIFF_ARGS\"} RUNTIME=$RUNTIME SEQ_SIZE=$SEQ_SIZE ROUNDS=$ROUNDS EXTRA=$EXTRA CONFIGS=\"$CONFIGS\" JOBS=\"$JOBS\" bench/serve.sh $PAIR"
