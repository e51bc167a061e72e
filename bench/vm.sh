#!/usr/bin/env bash
# Serving on a real kernel, side by side, in one guest boot of the VM tier
# (tests/vm/run.sh: a stock Debian kernel, usually under software emulation):
#   raw          a loop device (direct I/O) on new.img: the limit
#   dm-snapshot  the kernel's own answer: a classic dm-snapshot of a loop device on
#                old.img, with the blocks the update changes written into it (COW store
#                on a second loop device, 4 KiB chunks, persistent)
#   ublk         vabc serve --ublk, default settings (one queue per vCPU)
#   nbd          vabc serve --nbd unix:... + the kernel's nbd-client
#   fuse         vabc serve --fuse DIR --loop (FUSE file under a direct-I/O loop device)
# Jobs on each block device, page cache out of the way (O_DIRECT): seq = dd of the whole
# device in 1 MiB reads, SEQ_PASSES times (default 5); rand1 / rand32 = fio 4 KiB random reads at QD1 (psync) and
# QD32 (libaio), RUNTIME seconds each. ROUNDS rounds (default 3), forwards in odd rounds
# and backwards in even ones; the table gives medians and ratios to raw and to
# dm-snapshot. Every image lives in the guest's RAM (tmpfs), so this compares the
# software stacks, not a disk. Under emulation absolute numbers mean little: read the
# ratios, within one run.
#
# Usage: bench/vm.sh [PAIR] [FS]   (default: tiny ext4; RUNTIME=4 ROUNDS=3)
#        VABC=path/to/vabc (default target/release/vabc, else target/debug/vabc)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)

if [ "${1:-}" != --guest ]; then
	PAIR=${1:-tiny} FS=${2:-ext4}
	CORPUS=${VABC_CORPUS:-${TMPDIR:-/tmp}/corpus}
	VABC=${VABC:-}
	if [ -z "$VABC" ]; then
		VABC=$ROOT/target/release/vabc
		[ -x "$VABC" ] || VABC=$ROOT/target/debug/vabc
	fi
	VABC=$(realpath "$VABC")
	[ -e "$CORPUS/$PAIR/new.$FS.img" ] || bash "$ROOT/../shared/corpus/make-corpus.sh" -p "$PAIR" -o "$CORPUS" >&2
	W=$(mktemp -d "${TMPDIR:-/tmp}/vabc-vmbench.XXXXXX")
	trap 'rm -rf "$W"' EXIT
	"$VABC" diff "$CORPUS/$PAIR/old.$FS.img" "$CORPUS/$PAIR/new.$FS.img" -o "$W/u.cow" --json >"$W/diff.json"
	echo "vm bench: pair $PAIR ($FS), $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["cow_size"], "byte COW,", d["compression"])' "$W/diff.json"); vabc $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)" >&2
	exec "$ROOT/tests/vm/run.sh" --timeout 1800 --share "$W:rw" --share "$CORPUS/$PAIR" --share "$(dirname "$VABC")" -- \
		env RUNTIME="${RUNTIME:-4}" ROUNDS="${ROUNDS:-3}" SEQ_PASSES="${SEQ_PASSES:-5}" bash "$0" --guest "$VABC" "$W" \
		"$CORPUS/$PAIR/old.$FS.img" "$CORPUS/$PAIR/new.$FS.img"
fi

# In the guest.
VABC=$2 W=$3 OLD=$4 NEW=$5
T=/tmp/b
mkdir -p $T
for m in ublk_drv nbd loop fuse dm_snapshot; do modprobe -d "$VM_KMOD" $m; done
echo "guest kernel $(uname -r), $(nproc) vCPUs; fio $(fio --version)"
cp "$OLD" $T/old.img
cp "$NEW" $T/new.img
SIZE=$(stat -c %s $T/new.img)
SHA=$(sha256sum <$T/new.img | cut -d' ' -f1)
SIZE_ARG=(--size "$SIZE")
declare -A DEV PIDS

wait_ready() { # FILE PID
	for _ in $(seq 600); do
		[ -e "$1" ] && return 0
		kill -0 "$2" 2>/dev/null || break
		sleep 0.1
	done
	echo "not ready: $1" >&2
	return 1
}
json_dev() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["block_device"])' "$1"; }

DEV[raw]=$(losetup --direct-io=on -r -f --show $T/new.img)

# dm-snapshot: the update written into a snapshot of the old image.
cp $T/old.img $T/snap-base.img
truncate -s "$SIZE" $T/snap-cow.img
SB=$(losetup --direct-io=on -f --show $T/snap-base.img)
SC=$(losetup --direct-io=on -f --show $T/snap-cow.img)
dmsetup create vabc-snap --table "0 $((SIZE / 512)) snapshot $SB $SC P 8"
python3 - $T/old.img $T/new.img /dev/mapper/vabc-snap <<'PY'
import os, sys
old, new = open(sys.argv[1], "rb"), open(sys.argv[2], "rb")
fd = os.open(sys.argv[3], os.O_WRONLY)
n = 0
while True:
    a, b = old.read(1 << 20), new.read(1 << 20)
    if not b:
        break
    for i in range(0, len(b), 4096):
        if a[i:i + 4096] != b[i:i + 4096]:
            os.pwrite(fd, b[i:i + 4096], new.tell() - len(b) + i)
            n += 1
os.fsync(fd)
print(f"dm-snapshot: wrote the {n} changed blocks into the snapshot")
PY
DEV[dm-snapshot]=/dev/mapper/vabc-snap

cp $T/old.img $T/base-ublk.img
"$VABC" serve --base $T/base-ublk.img --cow "$W/u.cow" "${SIZE_ARG[@]}" --ublk --ready-file $T/ublk.json >$T/ublk.log 2>&1 &
PIDS[ublk]=$!
wait_ready $T/ublk.json "${PIDS[ublk]}"
DEV[ublk]=$(json_dev $T/ublk.json)

cp $T/old.img $T/base-nbd.img
"$VABC" serve --base $T/base-nbd.img --cow "$W/u.cow" "${SIZE_ARG[@]}" --nbd unix:$T/nbd.sock --ready-file $T/nbd.json >$T/nbd.log 2>&1 &
PIDS[nbd]=$!
wait_ready $T/nbd.json "${PIDS[nbd]}"
nbd-client -unix $T/nbd.sock /dev/nbd0 -N vabc -b 4096 -timeout 5 >/dev/null
DEV[nbd]=/dev/nbd0

cp $T/old.img $T/base-fuse.img
mkdir -p $T/fuse
"$VABC" serve --base $T/base-fuse.img --cow "$W/u.cow" "${SIZE_ARG[@]}" --fuse $T/fuse --loop --ready-file $T/fuse.json >$T/fuse.log 2>&1 &
PIDS[fuse]=$!
wait_ready $T/fuse.json "${PIDS[fuse]}"
DEV[fuse]=$(json_dev $T/fuse.json)

CONFIGS=(raw dm-snapshot ublk nbd fuse)
for c in "${CONFIGS[@]}"; do
	got=$(head -c "$SIZE" "${DEV[$c]}" | sha256sum | cut -d' ' -f1)
	[ "$got" = "$SHA" ] || { echo "$c: ${DEV[$c]} does not read as the new image" >&2; exit 1; }
done
echo "all five devices read as the new image (sha256); $SIZE bytes"

RES=$T/results
: >$RES
seq_mbs() { # DEV -> MB/s of SEQ_PASSES O_DIRECT passes (one pass of a small image
	# takes a fraction of a second, too short to time under emulation)
	sync; echo 3 >/proc/sys/vm/drop_caches
	local t0 t1 i
	t0=$(date +%s.%N)
	for ((i = 0; i < SEQ_PASSES; i++)); do
		dd if="$1" of=/dev/null iflag=direct bs=1M status=none
	done
	t1=$(date +%s.%N)
	python3 -c "print(f'{$SIZE * $SEQ_PASSES / ($t1 - $t0) / 1e6:.1f}')"
}
fio_iops() { # DEV ENGINE QD
	fio --name=r --filename="$1" --rw=randread --bs=4k --direct=1 --ioengine="$2" \
		--iodepth="$3" --runtime="$RUNTIME" --time_based --output-format=json 2>/dev/null |
		python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))'
}
for r in $(seq "$ROUNDS"); do
	order=("${CONFIGS[@]}")
	if ((r % 2 == 0)); then
		order=()
		for ((i = ${#CONFIGS[@]} - 1; i >= 0; i--)); do order+=("${CONFIGS[$i]}"); done
	fi
	for c in "${order[@]}"; do
		echo "$r $c seq $(seq_mbs "${DEV[$c]}")" >>$RES
		echo "$r $c rand1 $(fio_iops "${DEV[$c]}" psync 1)" >>$RES
		echo "$r $c rand32 $(fio_iops "${DEV[$c]}" libaio 32)" >>$RES
	done
	echo "round $r done"
done

nbd-client -d /dev/nbd0 >/dev/null
for c in ublk nbd fuse; do kill -TERM "${PIDS[$c]}"; done
wait
dmsetup remove vabc-snap
losetup -d "$SB" "$SC" "${DEV[raw]}"

python3 - $RES "${CONFIGS[@]}" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
configs = sys.argv[2:]
jobs = [("seq", "seq 1 MiB MB/s"), ("rand1", "rand 4K QD1 IOPS"), ("rand32", "rand 4K QD32 IOPS")]
med = {}
per = {}
for r, c, j, v in rows:
    per.setdefault((c, j), []).append(float(v))
for k, v in per.items():
    med[k] = statistics.median(v)
print()
print("| stack | " + " | ".join(f"{t} | vs raw | vs dm-snapshot" for _, t in jobs) + " |")
print("|---|" + "---:|---:|---:|" * len(jobs))
for c in configs:
    cells = []
    for j, _ in jobs:
        v = med[(c, j)]
        cells += [f"{v:.0f}", f"{v / med[('raw', j)]:.2f}", f"{v / med[('dm-snapshot', j)]:.2f}"]
    print(f"| {c} | " + " | ".join(cells) + " |")
print()
print("per round (seq MB/s, rand1, rand32):")
for c in configs:
    print(f"  {c:12}", "; ".join(",".join(f"{x:.0f}" for x in per[(c, j)]) for j, _ in jobs))
PY
