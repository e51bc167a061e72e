#!/usr/bin/env bash
# Runs inside the test guest (see conformance.sh): one conformance body, run against
# every frontend on the real kernel, for each file system image.
#   guest-conformance.sh VABC WORK "FRONTENDS" "FSES"
# WORK holds, per file system FS, what the host prepared: FS.cow, FS.cow.verity,
# FS.bad.cow (serves one block wrong), FS.env (sizes, hashes, image paths).
set -uo pipefail
VABC=$1 WORK=$2 FRONTENDS=$3 FSES=$4
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CHECK="python3 $HERE/vmcheck.py"
T=/tmp/conf
mkdir -p $T
RESULTS=()
FAILED=0
say() { printf '\n=== %s\n' "$*"; }
# check NAME CMD...: run one check, record PASS/FAIL, go on either way.
check() {
	local name=$1; shift
	local t0=$SECONDS
	if "$@"; then
		RESULTS+=("PASS  $CUR  $name")
		echo "--- PASS $name ($((SECONDS - t0))s)"
	else
		RESULTS+=("FAIL  $CUR  $name")
		echo "--- FAIL $name ($((SECONDS - t0))s)"
		FAILED=$((FAILED + 1))
	fi
}
mod() { modprobe -d "$VM_KMOD" "$@"; }

echo "guest kernel: $(uname -r) ($(uname -v)); $(nproc) vCPUs"
for m in ublk_drv nbd loop fuse ext4 erofs dm_verity dm_snapshot dm_delay; do
	mod "$m" || echo "cannot load $m"
done

# serve_up FRONTEND BASE COW [serve args...]: sets SERVE_PID and DEV.
serve_up() {
	local f=$1 base=$2 cow=$3; shift 3
	local args=()
	rm -f $T/ready.json
	case $f in
	ublk) args=(--ublk) ;;
	nbd) args=(--nbd "unix:$T/nbd.sock") ;;
	fuse) mkdir -p $T/fuse; args=(--fuse $T/fuse --loop) ;;
	esac
	"$VABC" serve --base "$base" --cow "$cow" --size "$SIZE" "${args[@]}" \
		--ready-file $T/ready.json "$@" >$T/serve.log 2>&1 &
	SERVE_PID=$!
	local i
	for i in $(seq 600); do
		[ -e $T/ready.json ] && break
		kill -0 $SERVE_PID 2>/dev/null || break
		sleep 0.1
	done
	if [ ! -e $T/ready.json ]; then
		echo "serve did not become ready:"; cat $T/serve.log
		return 1
	fi
	case $f in
	nbd)
		DEV=/dev/nbd0
		# -timeout: without it the kernel retries a request of a dead server forever
		# (a reader hangs); with it the request fails with EIO after 5 s.
		nbd-client -unix $T/nbd.sock $DEV -N vabc -b 4096 -timeout 5 >$T/nbd-client.log 2>&1 ||
			{ cat $T/nbd-client.log; return 1; }
		;;
	*) DEV=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["block_device"])' $T/ready.json) ;;
	esac
	echo "serving on $DEV: $(grep -v '^vabc serve: ready' $T/serve.log | tr '\n' ' ')"
}

# What must be gone after the daemon ended: its device and its record.
device_gone() {
	case $FRONT in
	ublk)
		local n=${DEV#/dev/ublkb}
		[ ! -e "$DEV" ] && [ ! -e /dev/ublkc$n ] && [ ! -e /sys/class/ublk-char/ublkc$n ] ||
			{ echo "ublk device $n still exists"; ls -l /dev/ublk*; return 1; }
		;;
	nbd)
		[ ! -e /sys/block/nbd0/pid ] || { echo "nbd0 still connected"; return 1; }
		;;
	fuse)
		local n=${DEV#/dev/loop}
		[ ! -e /sys/block/loop$n/loop/backing_file ] || { echo "loop$n still attached"; return 1; }
		! grep -q " $T/fuse " /proc/mounts || { echo "FUSE mount still there"; return 1; }
		;;
	esac
	[ -z "$(ls /run/vabc 2>/dev/null)" ] || { echo "records left: $(ls /run/vabc)"; return 1; }
}

stop_term() {
	kill -TERM $SERVE_PID
	local rc=0
	wait $SERVE_PID || rc=$?
	# The NBD device belongs to nbd-client: after its server is gone, disconnect it.
	[ "$FRONT" = nbd ] && nbd-client -d $DEV >/dev/null 2>&1
	tail -2 $T/serve.log
	[ $rc = 0 ] || { echo "serve exited $rc after SIGTERM"; cat $T/serve.log; return 1; }
	device_gone
}

same_sha() { # DEV/FILE [BYTES]: the sha256 of its first $SIZE bytes is $SHA
	local got
	got=$(head -c "$SIZE" "$1" | sha256sum | cut -d' ' -f1)
	[ "$got" = "$SHA" ] || { echo "$1: sha256 $got, want $SHA"; return 1; }
}
direct_sha() {
	local got
	got=$(dd if="$DEV" iflag=direct bs=1M status=none | head -c "$SIZE" | sha256sum | cut -d' ' -f1)
	[ "$got" = "$SHA" ] || { echo "O_DIRECT sha256 $got, want $SHA"; return 1; }
}
size_ok() {
	local got
	got=$(blockdev --getsize64 "$DEV")
	[ "$got" = "$SIZE" ] || { echo "device size $got, want $SIZE"; return 1; }
}
mount_diff() {
	mkdir -p $T/m
	mount -t "$FSTYPE" -o ro "$DEV" $T/m || return 1
	local rc=0
	diff -r $T/ref $T/m >$T/diff.out 2>&1 || rc=1
	umount $T/m
	[ $rc = 0 ] || { head -20 $T/diff.out; return 1; }
	echo "mounted $FSTYPE equals the new tree ($(find $T/ref | wc -l) entries)"
}
kernel_verity() {
	veritysetup open "$DEV" vabc-v $T/$FS/verity "$ROOT_HASH" || return 1
	local rc=0
	same_sha /dev/mapper/vabc-v || rc=1
	veritysetup close vabc-v || rc=1
	[ $rc = 0 ] && echo "dm-verity over $DEV: every block verified, sha256 equal"
	return $rc
}
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# The serving daemon died with SIGKILL: reads never return wrong data, and one
# documented command removes what is left.
after_kill() {
	local rc=0
	wait $READER || { echo "the reader running across the kill saw wrong data"; rc=1; }
	timeout 60 $CHECK never-wrong "$DEV" "$NEW" --seconds 3 || rc=1
	case $FRONT in
	nbd) nbd-client -d $DEV ;;
	*) "$VABC" cleanup ;;
	esac
	device_gone || rc=1
	return $rc
}

# A block the bad COW serves wrong: dm-verity over the device must answer EIO.
verity_catches() {
	local kind=$1 dev=$2 b=$BAD_BLOCK
	local err
	if err=$(dd if="$dev" iflag=direct bs=4096 skip="$b" count=1 status=none 2>&1 >/dev/null); then
		echo "$kind: block $b of the bad COW read without an error"; return 1
	fi
	case $err in *"Input/output error"*) ;; *) echo "$kind: unexpected error: $err"; return 1 ;; esac
	# Its neighbours still read, and equal the new image.
	for nb in $((b - 1)) $((b + 1)); do
		cmp <(dd if="$dev" iflag=direct bs=4096 skip=$nb count=1 status=none) \
			<(dd if="$NEW" bs=4096 skip=$nb count=1 status=none) ||
			{ echo "$kind: block $nb wrong"; return 1; }
	done
	echo "$kind: block $b answered EIO ($err), blocks $((b - 1)) and $((b + 1)) read correctly"
}
bad_cow_kernel_verity() {
	dmesg -C
	veritysetup open "$DEV" vabc-bad $T/$FS/verity "$ROOT_HASH" || return 1
	local rc=0
	verity_catches "kernel dm-verity" /dev/mapper/vabc-bad || rc=1
	# (Not `dmesg | grep -q`: grep's early exit would fail the pipe under pipefail.)
	grep -q "data block $BAD_BLOCK is corrupted" <(dmesg) ||
		{ echo "no dm-verity corruption message in dmesg"; rc=1; }
	veritysetup close vabc-bad
	return $rc
}

# The same cold reads of the served device recorded by blktrace and by `vabc trace
# record` at once; btt and `vabc trace report` analyse blktrace's files.
blktrace_agrees() {
	local d=$T/bt bt i
	rm -rf $d && mkdir -p $d
	mountpoint -q /sys/kernel/debug || mount -t debugfs none /sys/kernel/debug
	drop_caches
	blktrace -d "$DEV" -D $d -o cap >$d/blktrace.log 2>&1 &
	bt=$!
	for i in $(seq 100); do [ -e $d/cap.blktrace.0 ] && break; sleep 0.1; done
	"$VABC" trace record -d "$DEV" -o $d/ours --json -- sh -c \
		"dd if=$DEV of=/dev/null bs=256k iflag=direct status=none &&
		 fio --name=r --filename=$DEV --rw=randread --bs=4k --iodepth=8 --ioengine=io_uring \
		 --direct=1 --runtime=2 --time_based --output=/dev/null" >$d/ours.json || return 1
	kill -INT $bt && wait $bt
	blkparse -D $d -i cap -d $d/cap.bin -O >/dev/null || return 1
	(cd $d && btt -i cap.bin >btt.txt) || return 1
	"$VABC" trace report $d/cap --json >$d/theirs.json || return 1
	python3 "$HERE/btt_agrees.py" $d/btt.txt $d/theirs.json --same-n $d/ours.json
}

for FS in $FSES; do
	# shellcheck disable=SC1090
	source "$WORK/$FS.env" # SIZE SHA ROOT_HASH BAD_BLOCK FSTYPE OLD_IMG NEW_IMG
	mkdir -p $T/$FS $T/ref
	cp "$OLD_IMG" $T/$FS/old.img
	cp "$NEW_IMG" $T/$FS/new.img
	# veritysetup puts a loop device under a hash file; keep it off the 9p share.
	cp "$WORK/$FS.cow.verity" $T/$FS/verity
	NEW=$T/$FS/new.img
	mountpoint -q $T/ref && umount $T/ref
	mount -t "$FSTYPE" -o ro,loop "$NEW" $T/ref
	for FRONT in $FRONTENDS; do
		CUR="$(printf '%-5s %-6s' "$FRONT" "$FS")"
		say "$FRONT on $FS ($SIZE bytes)"
		cp $T/$FS/old.img $T/base.img
		if ! serve_up "$FRONT" $T/base.img "$WORK/$FS.cow"; then
			check "serve becomes ready" false
			continue
		fi
		check "device size" size_ok
		drop_caches
		check "buffered read: sha256 equals the new image" same_sha "$DEV"
		drop_caches
		check "O_DIRECT read: sha256 equals the new image" direct_sha
		check "random O_DIRECT reads" $CHECK direct "$DEV" "$NEW" --reads 300
		[ "$FRONT" = ublk ] && check "blktrace + btt and vabc trace agree: N per stage, averages within 1%" blktrace_agrees
		drop_caches
		check "8 concurrent readers" $CHECK readers "$DEV" "$NEW" --procs 8 --reads 60
		drop_caches
		check "mount $FSTYPE, diff -r against the new tree" mount_diff
		check "kernel dm-verity over the device" kernel_verity
		check "SIGTERM tears down, no device left" stop_term

		say "$FRONT on $FS: reads while --merge runs"
		cp $T/$FS/old.img $T/base.img
		# The merge records its progress in the COW: merge a copy.
		cp "$WORK/$FS.cow" $T/merge.cow
		cp "$WORK/$FS.cow.manifest" $T/merge.cow.manifest
		rm -f $T/merged
		# The base under dm-delay, reads at once and writes held back (an hour late)
		# until 20 reads have checked the served device while the merge runs; then
		# writes and flushes go 100 ms late, and the reads go on until the merge
		# reports its end. The merge cannot end before those reads (before, with a
		# fixed delay alone, a stall of the emulated guest once left room for only 15).
		SLOW_LOOP=$(losetup --direct-io=on -f --show $T/base.img)
		SECTORS=$(blockdev --getsz "$SLOW_LOOP")
		dmsetup create vabc-slow --table "0 $SECTORS delay $SLOW_LOOP 0 0 $SLOW_LOOP 0 3600000"
		rm -f $T/reads-done
		if serve_up "$FRONT" /dev/mapper/vabc-slow $T/merge.cow --merge; then
			# The stop file appears when the daemon reports the merge complete.
			(while ! grep -q "merge complete" $T/serve.log; do
				kill -0 $SERVE_PID 2>/dev/null || break; sleep 0.05; done; touch $T/merged) &
			# The writes let go (a suspend submits those held) once the reads are in.
			(while [ ! -e $T/reads-done ] && [ ! -e $T/merged ]; do sleep 0.05; done
				dmsetup suspend vabc-slow &&
				dmsetup load vabc-slow --table "0 $SECTORS delay $SLOW_LOOP 0 0 $SLOW_LOOP 0 100" &&
				dmsetup resume vabc-slow || echo "could not let the merge's writes go") &
			check "reads during the merge equal the new image" \
				$CHECK until "$DEV" "$NEW" --stop-file $T/merged --timeout 300 --min-reads 20 \
				--reached-file $T/reads-done
			grep -q "merge complete" $T/serve.log || { echo "merge did not complete"; cat $T/serve.log; }
			drop_caches
			check "after the merge: O_DIRECT sha256 equals the new image" direct_sha
			check "SIGTERM after the merge" stop_term
		else
			check "serve --merge becomes ready" false
		fi
		dmsetup remove vabc-slow
		losetup -d "$SLOW_LOOP"
		check "the base file is now the new image" same_sha $T/base.img

		say "$FRONT on $FS: SIGKILL of the daemon"
		cp $T/$FS/old.img $T/base.img
		if serve_up "$FRONT" $T/base.img "$WORK/$FS.cow"; then
			drop_caches
			# The kill lands only once the reader has read the image right 20
			# times, so its reads span the kill (under emulation, Python's start-up
			# alone can outlast a fixed sleep).
			rm -f $T/reading
			timeout 90 $CHECK never-wrong "$DEV" "$NEW" --seconds 2 --ready-file $T/reading --min-good 20 --timeout 60 &
			READER=$!
			for _ in $(seq 600); do
				[ -e $T/reading ] || ! kill -0 $READER 2>/dev/null && break
				sleep 0.1
			done
			kill -KILL $SERVE_PID
			wait $SERVE_PID 2>/dev/null
			check "reads after SIGKILL: errors, never wrong data; cleanup leaves nothing" after_kill
		else
			check "serve becomes ready (kill test)" false
		fi

		say "$FRONT on $FS: a COW that serves one block wrong, under dm-verity"
		cp $T/$FS/old.img $T/base.img
		if serve_up "$FRONT" $T/base.img "$WORK/$FS.bad.cow"; then
			check "kernel dm-verity: EIO for the bad block" bad_cow_kernel_verity
			stop_term >/dev/null || check "SIGTERM (bad COW)" false
		else
			check "serve the bad COW" false
		fi
		if [ "$FRONT" = ublk ]; then
			cp $T/$FS/old.img $T/base.img
			if serve_up ublk $T/base.img "$WORK/$FS.bad.cow" \
				--verity-hash "$WORK/$FS.cow.verity" --root-hash "$ROOT_HASH"; then
				check "vabc serve --verity-hash: EIO for the bad block" verity_catches "vabc --verity-hash" "$DEV"
				stop_term >/dev/null || check "SIGTERM (--verity-hash)" false
			else
				check "serve --verity-hash" false
			fi
		fi
	done
	umount $T/ref
	rm -f $T/$FS/*.img $T/base.img
done

say "conformance summary (guest kernel $(uname -r))"
printf '%s\n' "${RESULTS[@]}"
echo "$((${#RESULTS[@]} - FAILED)) passed, $FAILED failed"
[ $FAILED = 0 ]
