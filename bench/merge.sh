#!/usr/bin/env bash
# bench/merge.sh: in-place merge, `sync` engine vs `uring` engine vs the
# device limit, on corpus ext4 pairs, all in one run.
#
# For each pair: `vabc diff --compression $CODEC` old -> new (v3; CODEC
# defaults to lz4, as in bench/serve.sh: the update a device boots from is
# the one it merges, and lz4 is the codec devices decode; zstd:19, the diff's
# default, makes a smaller COW whose payloads cost the merge more CPU; DIFF_ARGS
# adds diff options, e.g. "--min-xor-run 64" or "--far-xor-blocks 4096"), then for
# each engine a fresh, fully allocated copy of old.img and of the COW (a
# device has no holes to allocate), caches dropped, `vabc merge --json`
# (wall time, syscalls, fsyncs as counted by the engine), the result checked
# against new.img. The device limit is the time to read the merge's source
# bytes and write its destination bytes at the sequential bandwidth fio
# measures on the same filesystem in the same run (1 MiB blocks, O_DIRECT,
# writes ending in fsync). The sources are where the new content comes
# from: the base blocks COPY and XOR ops read, and the COW's payloads (XOR
# and REPLACE data), which no merge can skip reading; "vs base-only limit"
# leaves the payloads out, as this bench's first version did, so that older
# ratios (bench/results/merge.md) stay comparable. "MB written"
# counts the scratch-area copies the crash protocol makes (every COPY/XOR
# block is written twice); the limit does not. The protocol floor adds
# one measured write+fdatasync latency per sync the run made: the scratch
# protocol (AOSP's layout, one 2 MiB scratch area) needs 4 serial syncs per
# window, which no engine can overlap.
# Engines: sync (per-op baseline), uring-buffered (`--buffered`: through the
# page cache), uring (the default: O_DIRECT for aligned transfers). The
# "waits" column splits the run's wall time into time blocked on reads,
# writes and syncs (the rest is CPU). After the table, per pair, the request
# floor: the uring merge's reads and writes at the IOPS fio reaches with
# random transfers of their mean size at QD32 (a merge of scattered blocks is
# bound by its request count on a disk whose IOPS saturate), and the write
# floor: the bytes the uring merge wrote, as random writes of its mean write
# size at QD32 with one fsync at the end (the writes alone, before any read or
# ordering flush; on a disk with a write-back cache each flush waits for the
# writes before it, which the protocol floor does not count). "CPU steal": the
# share of CPU time the hypervisor gave to other guests during the run.
# Rounds (ROUNDS, default 3): this virtual disk's speed drifts by tens of
# percent from minute to minute, so each round measures fio's bandwidth
# and the write + fdatasync latency again right after its uring merge (not
# only before the sync baseline, which takes 15-30 s) and gives the ratios
# to its own limit and floor; the summary is the median of the rounds'
# ratios. Every round runs the sync baseline too, so that each speedup
# compares runs minutes apart at most.
#
# Usage: [CODEC=lz4] [DIFF_ARGS=...] [ROUNDS=3] [STEAL_MAX=5] [VABC=/path/to/vabc] bench/merge.sh [-p "medium system"] [-c CORPUS_DIR] [-w WORKDIR]
# VABC runs another binary (an older build, to compare) and skips the build.
# Needs (Debian): fio; the corpus is built with ../shared/corpus/make-corpus.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${SHARED:-$ROOT/../shared}
CORPUS=${CORPUS:-${TMPDIR:-/tmp}/corpus}
PAIRS="medium system"
WORK=${TMPDIR:-/tmp}/vabc-bench-merge
ROUNDS=${ROUNDS:-3}
# A round whose uring run lost more than this share of its CPU time to the
# host (percent) is left out of the steal-free list in the summary.
STEAL_MAX=${STEAL_MAX:-5}
CODEC=${CODEC:-lz4}
DIFF_ARGS=${DIFF_ARGS:-}
while getopts "p:c:w:" opt; do
	case $opt in
	p) PAIRS=$OPTARG ;;
	c) CORPUS=$OPTARG ;;
	w) WORK=$OPTARG ;;
	*) sed -n '2,43p' "$0" >&2; exit 2 ;;
	esac
done
command -v fio >/dev/null || { echo "missing fio (apt-get install fio)" >&2; exit 1; }
if [ -z "${VABC:-}" ]; then
	(cd "$ROOT" && cargo build --release -q -p vabc)
	VABC=${CARGO_TARGET_DIR:-$ROOT/target}/release/vabc
fi
mkdir -p "$WORK"
# Cold data, warm program: on a device the merge runs in a resident daemon,
# so reading the vabc binary back from disk is not part of it (on the medium
# pair it was: uring 0.04-0.07 s with a cold binary, 0.03 s with a warm one).
# The program includes the shared libraries it loads: read from disk they
# cost every run ~10 ms, more than the medium pair's whole uring merge.
PROGRAM=("$VABC")
while read -r lib; do PROGRAM+=("$lib"); done < <(ldd "$VABC" | awk '$3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
drop() {
	sync
	if [ -w /proc/sys/vm/drop_caches ]; then echo 3 >/proc/sys/vm/drop_caches; fi
	cat "${PROGRAM[@]}" >/dev/null
}
# CPU time the hypervisor gave to other guests (/proc/stat `steal`) and all
# CPU time, in ticks: a run during which the host took much of our CPUs
# measures its neighbours too.
cpu_ticks() { awk '/^cpu /{print $9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
now() { date +%s.%N; }
# The mean transfer of BYTES in COUNT requests, in whole 4 KiB blocks (at
# least one): the size fio's floors repeat the merge's transfers at.
mean_bs() { local bs=$(($1 / $2 / 4096 * 4096)); echo $((bs > 0 ? bs : 4096)); }

# fio's buffers in huge pages (see bench/hugepages.sh): without them its 1 MiB
# transfers reached the disk whole in some rounds and split in others, and the
# bandwidth it measured swung between 1.0 and 2.2 GB/s.
# shellcheck source=bench/hugepages.sh
. "$ROOT/bench/hugepages.sh"
huge_on "$WORK/huge"
trap huge_off EXIT

# Sequential bandwidth of this filesystem, bytes/s.
fio_bw() {
	fio --name=bw --filename="$WORK/fio.dat" --size=1G --bs=1M --direct=1 --ioengine=psync "${FIO_MEM[@]}" \
		--rw="$1" --end_fsync=1 --output-format=json 2>/dev/null |
		python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(int(j['$1']['bw_bytes']))"
}
# Latency of one 4 KiB write + fdatasync, seconds: the price of each
# durability step of the crash protocol (4 per scratch window, 2 per direct
# window or REPLACE/ZERO commit). It drifts like the bandwidth (0.13-0.58
# ms between runs), so it is measured with it.
fsync_lat() {
	fio --name=fs --filename="$WORK/fsync.dat" --size=8M --bs=4k --rw=randwrite --ioengine=psync --direct=1 "${FIO_MEM[@]}" \
		--fdatasync=1 --number_ios=300 --output-format=json 2>/dev/null |
		python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print('%.9f' % (j['sync']['lat_ns']['mean'] / 1e9 + j['write']['lat_ns']['mean'] / 1e9))"
	rm -f "$WORK/fsync.dat"
}
measure_bw() {
	fio --name=prep --filename="$WORK/fio.dat" --size=1G --bs=1M --rw=write --end_fsync=1 >/dev/null 2>&1
	READ_BW=$(fio_bw read)
	WRITE_BW=$(fio_bw write)
	rm -f "$WORK/fio.dat"
	# Printed as a plain decimal: bc reads no exponent, and a flush under 0.1 ms
	# would print as 9e-05.
	FSYNC_S=$(fsync_lat)
	check_number "fio's sequential read bandwidth" "$READ_BW"
	check_number "fio's sequential write bandwidth" "$WRITE_BW"
	check_number "fio's write + fdatasync latency" "$FSYNC_S"
	# Only the measurement the uring ratio uses is listed under the table.
	[ "${1:-}" = uring ] || return 0
	BWS+=("$(printf '%.0f/%.0f/%.2f' "$(echo "$READ_BW / 1048576" | bc -l)" "$(echo "$WRITE_BW / 1048576" | bc -l)" "$(echo "$FSYNC_S * 1000" | bc -l)")")
}
BWS=()
median() { sort -g | awk '{v[NR] = $1} END {if (NR == 0) print "-"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

echo "| pair | round | engine | ops | seconds | waits read/write/sync s | syscalls | fsyncs | MB read | MB written (incl. scratch) | device limit s | vs limit | vs base-only limit | protocol floor s | vs floor | speedup vs sync | CPU steal |"
echo "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
notes=()
summary=()
for pair in $PAIRS; do
	[ -e "$CORPUS/$pair/old.ext4.img" ] || bash "$SHARED/corpus/make-corpus.sh" -p "$pair" -o "$CORPUS" >&2
	# shellcheck disable=SC2086 # DIFF_ARGS is a list of options
	"$VABC" diff --compression "$CODEC" $DIFF_ARGS "$CORPUS/$pair/old.ext4.img" "$CORPUS/$pair/new.ext4.img" -o "$WORK/$pair.cow" >/dev/null
	# The limit: read every COPY/XOR source and the COW's payloads once, write
	# every destination once.
	read -r src cow_data dst < <("$VABC" inspect --json "$WORK/$pair.cow" | python3 -c "import json,sys; v=json.load(sys.stdin); b=v['blocks_by_type']; print((b.get('COPY',0)+b.get('XOR',0))*4096, v['data_bytes'], v['blocks_covered']*4096)")
	sync_s=
	vs_limit=() vs_base=() vs_sync=() quiet=()
	for round in $(seq "$ROUNDS"); do
		# The baselines' limits use the bandwidth measured at the round's
		# start, uring's the one measured right after it: seconds apart,
		# and without fio's gigabytes of I/O running just before the merge.
		measure_bw
		engines="sync uring-buffered uring"
		for engine in $engines; do
			cp --sparse=never "$CORPUS/$pair/old.ext4.img" "$WORK/base.img"
			cp --sparse=never "$WORK/$pair.cow" "$WORK/merge.cow"
			case $engine in
			uring-buffered) args=(--engine uring --buffered) ;;
			*) args=(--engine "$engine") ;;
			esac
			drop
			c0=$(cpu_ticks)
			t0=$(now)
			"$VABC" merge --base "$WORK/base.img" --cow "$WORK/merge.cow" --manifest "$WORK/$pair.cow.manifest" "${args[@]}" --json >"$WORK/report.json"
			t1=$(now)
			steal=$(echo "$c0 $(cpu_ticks)" | awk '{d = $4 - $2; printf "%.0f", (d > 0 ? 100 * ($3 - $1) / d : 0)}')
			cmp "$WORK/base.img" "$CORPUS/$pair/new.ext4.img" || { echo "MISMATCH $pair $engine" >&2; exit 1; }
			if [ "$engine" = uring ]; then measure_bw uring; fi
			read -r ops sc fs br bw waits nreq nwr < <(python3 -c "import json; r=json.load(open('$WORK/report.json')); print(r['total_ops'], r['syscalls'], r['fsyncs'], r['bytes_read'], r['bytes_written'], '%.2f/%.2f/%.2f' % (r['read_wait_seconds'], r['write_wait_seconds'], r['sync_wait_seconds']), r['reads'] + r['writes'], r['writes'])")
			secs=$(echo "$t1 - $t0" | bc -l)
			limit=$(echo "($src + $cow_data) / $READ_BW + $dst / $WRITE_BW" | bc -l)
			base_limit=$(echo "$src / $READ_BW + $dst / $WRITE_BW" | bc -l)
			# The floor of this protocol: the limit plus one write+fdatasync
			# latency per sync the engine needed (each is a serial step).
			# (Only for uring: the sync baseline's per-block fdatasyncs of one
			# file cost far less each than this measured one.)
			floor=$(echo "$limit + $fs * $FSYNC_S" | bc -l)
			[ "$engine" = sync ] && sync_s=$secs
			if [ "$engine" = uring ]; then
				uring_stat="$nreq $br $bw $secs $nwr"
				vs_limit+=("$(echo "$secs / $limit" | bc -l)")
				vs_base+=("$(echo "$secs / $base_limit" | bc -l)")
				[ "$steal" -le "$STEAL_MAX" ] && quiet+=("$(echo "$secs / $limit" | bc -l)")
				vs_sync+=("$(echo "$sync_s / $secs" | bc -l)")
			fi
			if [ "$engine" != sync ]; then
				fcol=$(printf '%.2f | %.2fx' "$floor" "$(echo "$secs / $floor" | bc -l)")
			else
				fcol="- | -"
			fi
			printf '| %s | %d | %s | %d | %.2f | %s | %d | %d | %.1f | %.1f | %.2f | %.2fx | %.2fx | %s | %.2fx | %d%% |\n' "$pair" "$round" "$engine" "$ops" "$secs" "$waits" "$sc" "$fs" \
				"$(echo "$br / 1048576" | bc -l)" "$(echo "$bw / 1048576" | bc -l)" "$limit" "$(echo "$secs / $limit" | bc -l)" "$(echo "$secs / $base_limit" | bc -l)" \
				"$fcol" "$(echo "$sync_s / $secs" | bc -l)" "$steal"
		done
	done
	summary+=("$(printf '%s: uring vs device limit %.2fx (rounds: %s; steal-free rounds: %s; base-only limit: %.2fx; target <= 1.5), uring vs sync %.2fx (rounds: %s; target >= 2)' "$pair" \
		"$(printf '%s\n' "${vs_limit[@]}" | median)" "$(printf '%.2f ' "${vs_limit[@]}")" \
		"$( ((${#quiet[@]})) && printf '%.2f ' "${quiet[@]}" || echo none)" "$(printf '%s\n' "${vs_base[@]}" | median)" \
		"$(printf '%s\n' "${vs_sync[@]}" | median)" "$(printf '%.2f ' "${vs_sync[@]}")")")
	# The request floor: the uring merge's transfers (reads and writes, as
	# the engine issued them) at the rate fio reaches with random reads and
	# writes of their mean size at queue depth 32 on the same filesystem.
	# A merge of scattered blocks is bound by this, not by the sequential
	# bandwidth of the device limit.
	read -r nreq br bw secs nwr <<<"$uring_stat"
	[ "$nreq" -gt 0 ] || continue # nothing to merge: no floor
	bs=$(mean_bs $((br + bw)) "$nreq")
	fio --name=prep --filename="$WORK/fio.dat" --size=1G --bs=1M --rw=write --end_fsync=1 >/dev/null 2>&1
	iops=$(fio --name=rr --filename="$WORK/fio.dat" --size=1G --bs="$bs" --direct=1 --ioengine=io_uring --iodepth=32 "${FIO_MEM[@]}" \
		--rw=randrw --runtime=4 --time_based --output-format=json 2>/dev/null |
		python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(int(j['read']['iops'] + j['write']['iops']))")
	check_number "fio's random read/write IOPS" "$iops"
	notes+=("$(printf '%s: uring issued %d reads and writes of %d KiB on average; fio random read/write at %d KiB, QD32: %d IOPS, so a request floor of %.2f s; uring took %.2f s (%.2fx)' \
		"$pair" "$nreq" "$(((br + bw) / nreq / 1024))" "$((bs / 1024))" "$iops" "$(echo "$nreq / $iops" | bc -l)" "$secs" "$(echo "$secs * $iops / $nreq" | bc -l)")")
	# The write floor: the bytes the uring merge wrote (scratch copies and
	# header pages included), as random writes of its mean write size at
	# queue depth 32 with one fsync at the end. It is what this disk takes for
	# the writes alone, before any read and without the flushes that order
	# them. On a disk with a write-back cache a flush waits for the writes
	# before it, so the protocol floor above (one lone flush's latency per
	# sync) undercounts it; this floor shows how much of the gap to the device
	# limit the scattered writes already are. Timed by the clock around fio,
	# so it includes fio's start-up (tens of ms), as the merge's time
	# includes vabc's.
	if [ "${nwr:-0}" -gt 0 ]; then
		wbs=$(mean_bs "$bw" "$nwr")
		drop
		w0=$(now)
		fio --name=wf --filename="$WORK/fio.dat" --size=1G --bs="$wbs" --io_size="$bw" --rw=randwrite --direct=1 \
			--ioengine=io_uring --iodepth=32 "${FIO_MEM[@]}" --end_fsync=1 --randrepeat=0 >/dev/null 2>&1
		wsecs=$(echo "$(now) - $w0" | bc -l)
		notes+=("$(printf '%s: uring wrote %.0f MB in %d requests of %d KiB on average; fio writing as many bytes at random in %d KiB requests, QD32, one fsync at the end: %.2f s (write floor, %.2fx the device limit of the last round), and uring took %.2fx of it' \
			"$pair" "$(echo "$bw / 1000000" | bc -l)" "$nwr" "$((bw / nwr / 1024))" "$((wbs / 1024))" "$wsecs" "$(echo "$wsecs / $limit" | bc -l)" "$(echo "$secs / $wsecs" | bc -l)")")
	fi
	rm -f "$WORK/fio.dat"
done
printf '\n'
printf -- '- %s\n' "${summary[@]}"
if [ ${#notes[@]} -gt 0 ]; then printf -- '- %s\n' "${notes[@]}"; fi
printf '\nfio on this filesystem per round, right after the uring merge: read/write MB/s (1 MiB, O_DIRECT) / 4 KiB O_DIRECT write + fdatasync ms: %s\n' \
	"${BWS[*]}"
echo "command: CODEC=$CODEC DIFF_ARGS=\"$DIFF_ARGS\" ROUNDS=$ROUNDS bench/merge.sh -p \"$PAIRS\"   ($(nproc) cores, $(uname -sr), load $(cut -d' ' -f1-3 /proc/loadavg))"
rm -f "$WORK/base.img" "$WORK/merge.cow"
