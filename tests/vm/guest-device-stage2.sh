#!/usr/bin/env bash
# Stage 2 of a device boot in the VM scenario: PID 1 of the system that booted (the
# old image, or the new one served from base + COW). Reports what runs (the root
# device, /etc/version, the update's state, the sha256 of a full read of the root
# device), then does this boot's ACTION:
#   install-good|install-bad  install that bundle from the data disk (old system)
#   run                       the new system's duty: its health check, then
#                             mark-good and wait for the merge; a failing check
#                             does nothing (the next boot counts another attempt)
#   corrupt                   run, then corrupt one REPLACE block of the COW and
#                             read it back: dm-verity must fail the read (EIO)
# Ends by writing /out/rc and resetting the machine.
set -uo pipefail
source /run/scenario.env
export PATH=/usr/sbin:/usr/bin
mount -t tmpfs tmp /tmp
V=/run/bin/vabc S=/data/vabc
say() { echo "scenario: $*"; }
# The store's status as "STATE MERGED/TOTAL" (the first partition's merge progress),
# read in bash: Python's start-up costs seconds under emulation, and the merge polls
# this; awk is a link through /etc, which is the system image's own here.
status() {
	local line st= merged= total=
	while IFS= read -r line; do
		if [[ $line =~ ^\ \ \"state\":\ \"([a-z-]+)\" ]]; then
			st=${BASH_REMATCH[1]}
		elif [[ -z $merged && $line =~ ^\ *\"merged\":\ ([0-9]+) ]]; then
			merged=${BASH_REMATCH[1]}
		elif [[ -z $total && $line =~ ^\ *\"total\":\ ([0-9]+) ]]; then
			total=${BASH_REMATCH[1]}
		fi
	done < <("$V" update status --store $S --json)
	echo "$st ${merged:-0}/${total:-?}"
}
state() {
	local s
	s=$(status)
	echo "${s%% *}"
}
finish() {
	echo "$1" >/out/rc.tmp && mv /out/rc.tmp /out/rc
	sync
	busybox reboot -f
}
# The device read whole with O_DIRECT: what the disk (or the served update) holds,
# not the page cache, where a mounted ext4 keeps its own view of its superblock.
devsha() { dd if="$1" bs=1M iflag=direct status=none | sha256sum | cut -d' ' -f1; }
say "booted: root $ROOTDEV version $(cat /etc/version) health $(cat /etc/health) state $(state) on $(sed -n 's|^\([^ ]*\) / .*|\1|p' /proc/mounts | tail -1)"
say "store: $(ls /data/vabc | tr '\n' ' ' | sed 's/ $//')"
say "root-sha256 $(devsha "$ROOTDEV")"

# Waits for the merge, printing its progress ("merging DONE/TOTAL ops") as it moves.
wait_merged() {
	local t0=$SECONDS last=
	while :; do
		local st
		read -r st prog < <(status)
		[ "$st" = merged ] && { say "merged ($((SECONDS - t0)) s); root-sha256 $(devsha "$ROOTDEV")"; return 0; }
		[ "$st" = merging ] || { say "unexpected state $st while merging"; return 1; }
		[ "$prog" != "$last" ] && say "merging $prog ops" && last=$prog
		sleep 0.2
	done
}

# The system keeps reading its root whole while the merge overwrites the base; the
# read is reported as soon as it ends, with the state then (it counts as a read
# during the merge only if the merge was still running).
merge_and_read() {
	(
		sha=$(devsha "$ROOTDEV")
		say "read during the merge: root-sha256 $sha (state $(state) when it ended)"
	) &
	local reader=$! r=0
	wait_merged || r=1
	wait $reader
	return $r
}

rc=0
case $ACTION in
install-good | install-bad)
	# The good update allows 3 boots before mark-good, the bad one 2.
	if [ "$(state)" = installed ]; then
		say "install: the update is installed already (this is its boot)"
	else
		t0=$SECONDS
		say "install-start ${ACTION#install-}"
		# "installing" once the state file says so (read directly: a status command
		# costs too much under emulation to poll): from then on, a power cut leaves a
		# begun install for the next boot to resume, which is what the host cuts.
		(
			until grep -qs '"state": "installing"' $S/state; do sleep 0.05; done
			say "installing"
		) &
		watcher=$!
		"$V" update install --store $S "/data/bundles/${ACTION#install-}.vabc" -b system=/dev/vda \
			--keyring /run/vabc-keys --max-boot-attempts 3 || rc=$?
		kill $watcher 2>/dev/null
		wait $watcher 2>/dev/null
		say "install-done rc=$rc state $(state) ($((SECONDS - t0)) s)"
	fi
	;;
run | corrupt)
	case $(state) in
	installed)
		if [ "$(cat /etc/health)" = ok ]; then
			"$V" update mark-good --store $S --keyring /run/vabc-keys >/dev/null || rc=$?
			say "merge-start"
			merge_and_read || rc=1
		else
			say "health-failed"
		fi
		;;
	merging)
		say "merge-start (resumed at boot)"
		merge_and_read || rc=1
		;;
	esac
	if [ "$ACTION" = corrupt ]; then
		# One REPLACE block of the COW, stored uncompressed (the bad bundle's device COW),
		# altered where the daemon reads it: it decodes cleanly, so only dm-verity can
		# tell: that block's read must fail with EIO, and its neighbours still read.
		read -r blk off < <("$V" inspect $S/system.cow --ops --json | python3 -c '
import json, sys
ops = [o for o in json.load(sys.stdin)["ops"] if o["type"] == "REPLACE"]
o = ops[len(ops) // 2]
print(o["new_block"], o["data_offset"])')
		# Each read of one block with O_DIRECT (dd's error in /tmp/dd.err).
		readblk() { dd if="$ROOTDEV" of=/dev/null bs=4096 skip="$1" count=1 iflag=direct status=none 2>/tmp/dd.err; }
		if ! [[ $blk =~ ^[0-9]+$ && $off =~ ^[0-9]+$ ]] || ((blk == 0)); then
			# An empty offset would alter the COW's header and an empty block read
			# nothing: neither may pass for dm-verity's refusal.
			say "corrupt-block: no REPLACE block to alter (block '$blk', offset '$off')"
			rc=1
		else
			printf 'corrupted by the scenario' | dd of=$S/system.cow bs=1 seek=$((off + 100)) conv=notrunc status=none
			sync
			echo 3 >/proc/sys/vm/drop_caches
			if readblk "$blk"; then
				say "corrupt-block $blk: READ SUCCEEDED (served altered data)"
				rc=1
			elif ! grep -q 'Input/output error' /tmp/dd.err; then
				say "corrupt-block $blk: failed, but not with EIO: $(tr '\n' ' ' </tmp/dd.err)"
				rc=1
			elif ! readblk $((blk - 1)) || ! readblk $((blk + 1)); then
				say "corrupt-block $blk: a neighbour failed too: $(tr '\n' ' ' </tmp/dd.err)"
				rc=1
			else
				say "corrupt-block $blk: read failed with EIO (Input/output error); blocks $((blk - 1)) and $((blk + 1)) read"
				say "corrupt-block dmesg: $(dmesg | grep -i verity | tail -1)"
			fi
		fi
	fi
	;;
esac
say "end: state $(state) rc $rc"
finish $rc
