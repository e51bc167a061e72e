#!/usr/bin/env bash
# The guest side of tests/vm/crash.sh: one update's whole life on a device whose
# disk is logged write by write. /dev/vda holds the partitions (system, vendor,
# data: LAYOUT gives their sizes); the kernel's log-writes target records every
# write to it, with its flush and FUA flags, on /dev/vdb. On top, device-mapper's
# linear target makes the partitions, named by device nodes in /dev/vabc-crash (the
# host makes nodes of the same names for its replays, so the store's recorded base
# paths name the same partitions there). Then, as the device's boots would:
#   install   the old system installs the bundle (system + vendor)
#   boot      the next boot serves base + COW (ublk, kernel dm-verity)
#   mark-good the new system marks itself good; the daemons merge
#   merged    the merge is complete; the daemons are stopped (a shutdown)
#   cleanup   the boot after the merge runs the base and cleans the store
# and then a second update that is rolled back:
#   rb-install   version 2 installs version 3
#   rb-boot      the next boot serves version 3
#   rb-rollback  the new system rolls it back (vabc update rollback); a shutdown
#   rb-cleanup   the next boot runs the base, version 2
#   end
# Each phase's start is a mark in the log (dm-log-writes' "mark" message).
# After the log ends, with the partitions mapped on the disk directly (nothing of
# it logged), the serving daemon is killed KILLS times while the new system reads
# its partitions (below, "kills").
#   guest-crash.sh VABC WORK [KILLS]
set -uo pipefail
VABC=$1 WORK=$2 KILLS=${3:-0}
# shellcheck disable=SC1091
source "$WORK/layout.env" # SYS_BYTES VEN_BYTES DATA_BYTES V2_* V3_*
say() { echo "crash-guest: $*"; }
die() {
	say "FAIL: $*"
	exit 1
}
modprobe -a -d "$VM_KMOD" ublk_drv dm_log_writes dm_verity loop ext4 ||
	die "cannot load the modules"
sys=$((SYS_BYTES / 512)) ven=$((VEN_BYTES / 512)) data=$((DATA_BYTES / 512))
dmsetup create lw --table "0 $(blockdev --getsz /dev/vda) log-writes /dev/vda /dev/vdb" ||
	die "log-writes over /dev/vda"
dmsetup create lw-system --table "0 $sys linear /dev/mapper/lw 0" &&
	dmsetup create lw-vendor --table "0 $ven linear /dev/mapper/lw $sys" &&
	dmsetup create lw-data --table "0 $data linear /dev/mapper/lw $((sys + ven))" ||
	die "the partitions"
mkdir -p /dev/vabc-crash
for p in system vendor data; do
	read -r major minor < <(stat -L -c '%t %T' /dev/mapper/lw-$p)
	mknod /dev/vabc-crash/$p b $((0x$major)) $((0x$minor)) || die "node for $p"
done
mark() {
	sync
	dmsetup message lw 0 mark "$1" || die "mark $1"
	say "phase $1"
}
B=(-b system=/dev/vabc-crash/system -b vendor=/dev/vabc-crash/vendor)
K=(--keyring "$WORK/keys")
mkdir -p /data
state() { sed -n 's/^ *"state": "\([a-z-]*\)".*/\1/p' /data/vabc/state | head -1; }
devsha() { dd if="$1" bs=1M iflag=direct status=none | sha256sum | cut -d' ' -f1; }

mark install
mount /dev/vabc-crash/data /data || die "mount the data partition"
"$VABC" update install --store /data/vabc /data/bundles/u.vabc "${B[@]}" "${K[@]}" \
	--max-boot-attempts 3 || die "install"
say "installed: state $(state)"
umount /data

mark boot
mount /dev/vabc-crash/data /data || die "mount the data partition"
"$VABC" update boot --store /data/vabc "${B[@]}" "${K[@]}" --frontend ublk --json >/tmp/boot.json ||
	die "boot: $(cat /tmp/boot.json)"
# The devices a boot step's report names serve VERSION (2 or 3) of each partition.
served() { # REPORT VERSION
	local p dev want got
	for p in system vendor; do
		dev=$(sed -n "/\"name\": \"$p\"/,/}/s/.*\"device\": \"\([^\"]*\)\".*/\1/p" "$1" | head -1)
		want=V$2_${p^^}
		got=$(devsha "$dev")
		[ "$got" = "${!want}" ] || die "$p served from '$dev' is not version $2 ($got)"
		say "$p served on $dev: version $2"
	done
}
served /tmp/boot.json 2

mark mark-good
"$VABC" update mark-good --store /data/vabc "${K[@]}" >/dev/null || die "mark-good"
mark merge
t0=$SECONDS
until [ "$(state)" = merged ]; do
	((SECONDS - t0 < 600)) || die "the merge did not end (state $(state))"
	sleep 0.2
done
mark merged
say "merged in $((SECONDS - t0)) s"
# A shutdown: dm-verity's mappings closed, then the daemons stopped.
shutdown() {
	local p r pid
	for p in system vendor; do veritysetup close vabc-$p || die "close vabc-$p"; done
	for r in /run/vabc/*.ready; do
		pid=$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' "$r")
		kill -TERM "$pid" 2>/dev/null
		for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		kill -0 "$pid" 2>/dev/null && die "daemon $pid did not stop"
		rm -f "$r"
	done
	umount /data
}
shutdown

mark cleanup
mount /dev/vabc-crash/data /data || die "mount the data partition"
"$VABC" update boot --store /data/vabc "${B[@]}" "${K[@]}" --frontend ublk --json >/tmp/boot2.json ||
	die "the boot after the merge: $(cat /tmp/boot2.json)"
say "after the merge: state $(state); store: $(ls /data/vabc | tr '\n' ' ')"
for p in system vendor; do
	want=V2_${p^^}
	[ "$(devsha /dev/vabc-crash/$p)" = "${!want}" ] || die "$p is not version 2 after the merge"
done
umount /data

mark rb-install
mount /dev/vabc-crash/data /data || die "mount the data partition"
"$VABC" update install --store /data/vabc /data/bundles/u3.vabc "${B[@]}" "${K[@]}" \
	--max-boot-attempts 3 || die "install version 3"
umount /data
mark rb-boot
mount /dev/vabc-crash/data /data || die "mount the data partition"
"$VABC" update boot --store /data/vabc "${B[@]}" "${K[@]}" --frontend ublk --json >/tmp/boot3.json ||
	die "boot version 3: $(cat /tmp/boot3.json)"
served /tmp/boot3.json 3
mark rb-rollback
"$VABC" update rollback --store /data/vabc >/dev/null || die "rollback"
say "rolled back: state $(state)"
shutdown
mark rb-cleanup
mount /dev/vabc-crash/data /data || die "mount the data partition"
"$VABC" update boot --store /data/vabc "${B[@]}" "${K[@]}" --frontend ublk --json >/tmp/boot4.json ||
	die "the boot after the rollback: $(cat /tmp/boot4.json)"
for p in system vendor; do
	want=V2_${p^^}
	[ "$(devsha /dev/vabc-crash/$p)" = "${!want}" ] || die "$p is not version 2 after the rollback"
done
say "after the rollback: state $(state); store: $(ls /data/vabc | tr '\n' ' ')"
umount /data
mark end
dmsetup remove lw-data lw-vendor lw-system && dmsetup remove lw || die "remove the log"

# --- Kills: the daemon that serves the system partition killed at a random moment of
# the new system's reads, alternately by SIGKILL and by the kernel's OOM killer (a
# memory cgroup's limit lowered under it; its oom_score_adj is raised from -1000
# first, which otherwise keeps any OOM killer from choosing it). Version 2 installs
# version 3; two boots of it are killed (attempts 1 and 2), the third serves it whole
# (the kernel's state of a killed boot goes as a reboot takes it: the mappings
# closed, the other daemon stopped, `vabc cleanup`), and it is rolled back to make
# room for the next round. Reads that fail are allowed; a read that succeeds must be
# version 3, and each killed boot must have read something whole before the kill.
if ((KILLS > 0)); then
	for p in system vendor data; do
		case $p in
		system) table="0 $sys linear /dev/vda 0" ;;
		vendor) table="0 $ven linear /dev/vda $sys" ;;
		data) table="0 $data linear /dev/vda $((sys + ven))" ;;
		esac
		dmsetup create k-$p --table "$table" || die "map $p"
		rm -f /dev/vabc-crash/$p
		read -r major minor < <(stat -L -c '%t %T' /dev/mapper/k-$p)
		mknod /dev/vabc-crash/$p b $((0x$major)) $((0x$minor)) || die "node for $p"
	done
	mkdir -p /sys/fs/cgroup
	mount -t cgroup2 none /sys/fs/cgroup && echo +memory >/sys/fs/cgroup/cgroup.subtree_control ||
		die "a memory cgroup"
	# Reads both served partitions whole until /tmp/stop appears, a line per read in
	# /tmp/reads: ok, failed, or WRONG.
	reader() { # REPORT
		local p dev want
		while [ ! -e /tmp/stop ]; do
			for p in system vendor; do
				[ -e /tmp/stop ] && break
				dev=$(sed -n "/\"name\": \"$p\"/,/}/s/.*\"device\": \"\([^\"]*\)\".*/\1/p" "$1" | head -1)
				want=V3_${p^^}
				if dd if="$dev" of=/tmp/read.img bs=1M iflag=direct status=none 2>/dev/null; then
					if [ "$(sha256sum </tmp/read.img | cut -d' ' -f1)" = "${!want}" ]; then
						echo "ok $p" >>/tmp/reads
					else
						echo "WRONG $p" >>/tmp/reads
					fi
				else
					echo "failed $p" >>/tmp/reads
				fi
			done
		done
	}
	# A reboot after a kill: what the kernel held for the killed boot goes.
	after_kill() {
		local p r pid
		for p in system vendor; do veritysetup close vabc-$p 2>/dev/null; done
		for r in /run/vabc/*.ready; do
			[ -e "$r" ] || continue
			pid=$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' "$r")
			kill -TERM "$pid" 2>/dev/null
			for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		done
		"$VABC" -q cleanup >/dev/null || die "cleanup after a kill"
		umount /data || die "unmount the data partition"
	}
	n=0 round=0
	while ((n < KILLS)); do
		round=$((round + 1))
		mount /dev/vabc-crash/data /data || die "mount the data partition"
		"$VABC" -q update install --store /data/vabc /data/bundles/u3.vabc "${B[@]}" "${K[@]}" \
			--max-boot-attempts 3 >/dev/null || die "kills: install version 3"
		umount /data
		for attempt in 1 2; do
			((n < KILLS)) || break
			n=$((n + 1))
			how=$([ $((n % 2)) = 1 ] && echo SIGKILL || echo OOM)
			mount /dev/vabc-crash/data /data || die "mount the data partition"
			# For the OOM killer, the boot step starts the daemons in a memory cgroup of
			# their own: a cgroup is charged for what is allocated in it, and what a
			# process had before it moved stays charged where it was.
			mkdir -p /sys/fs/cgroup/vabc-oom
			(
				[ "$how" = OOM ] && echo "$BASHPID" >/sys/fs/cgroup/vabc-oom/cgroup.procs
				exec "$VABC" update boot --store /data/vabc "${B[@]}" "${K[@]}" --frontend ublk --json
			) >/tmp/kb.json || die "kills: boot: $(cat /tmp/kb.json)"
			rm -f /tmp/stop
			: >/tmp/reads
			reader /tmp/kb.json &
			rpid=$!
			# Something read whole first, then a random moment of up to 3 s.
			for _ in $(seq 600); do grep -q '^ok' /tmp/reads 2>/dev/null && break; sleep 0.1; done
			grep -q '^ok' /tmp/reads || die "kill $n: nothing read whole in 60 s: $(tr '\n' ' ' </tmp/reads)"
			sleep "$((RANDOM % 3)).$((RANDOM % 10))"
			pid=$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' /run/vabc/system.ready)
			before=$(grep -c . /tmp/reads)
			if [ "$how" = SIGKILL ]; then
				kill -KILL "$pid" || die "kill $pid"
			else
				# The limit far under what the daemons use: the OOM killer takes the one it
				# may take (the vendor daemon keeps its -1000).
				grep -qx "$pid" /sys/fs/cgroup/vabc-oom/cgroup.procs || die "kill $n: $pid is not in the cgroup"
				# The cgroup counts the OOM killer's kills in it (its log line names the
				# thread it chose, which may be one io_uring started a moment ago).
				ooms=$(sed -n 's/^oom_kill //p' /sys/fs/cgroup/vabc-oom/memory.events)
				echo 0 >/proc/$pid/oom_score_adj
				echo 1M >/sys/fs/cgroup/vabc-oom/memory.max 2>/dev/null
			fi
			for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
			kill -0 "$pid" 2>/dev/null && die "kill $n ($how): daemon $pid still runs"
			if [ "$how" = OOM ]; then
				echo max >/sys/fs/cgroup/vabc-oom/memory.max
				# The OOM killer, or the daemon's own end when the kernel refused it
				# memory without invoking it (an allocation that may fail): either way
				# the daemon died of the memory limit, and what follows must hold.
				if (($(sed -n 's/^oom_kill //p' /sys/fs/cgroup/vabc-oom/memory.events) > ooms)); then
					how="OOM killer"
					OOM_KILLED=$((${OOM_KILLED:-0} + 1))
				else
					how="memory limit, not the OOM killer: $(tail -1 /run/vabc/system.log)"
				fi
			fi
			# Reads of the killed daemon's partition fail (the kernel aborts them once it
			# sees the daemon gone); they neither hang nor return anything else.
			for _ in $(seq 600); do grep -q '^failed system' /tmp/reads && break; sleep 0.1; done
			grep -q '^failed system' /tmp/reads || die "kill $n ($how): no read failed in 60 s after the kill"
			touch /tmp/stop
			wait "$rpid"
			grep -q WRONG /tmp/reads && die "kill $n ($how): a read returned something else than version 3: $(tr '\n' ' ' </tmp/reads)"
			say "kill $n ($how, attempt $attempt): reads $(grep -c '^ok' /tmp/reads) whole, $(grep -c '^failed' /tmp/reads) failed ($before before the kill)"
			after_kill
		done
		# The next boot serves version 3 again, whole.
		mount /dev/vabc-crash/data /data || die "mount the data partition"
		"$VABC" update boot --store /data/vabc "${B[@]}" "${K[@]}" --frontend ublk --json >/tmp/kb.json ||
			die "kills: the boot after: $(cat /tmp/kb.json)"
		served /tmp/kb.json 3
		"$VABC" -q update rollback --store /data/vabc >/dev/null || die "kills: rollback"
		shutdown
	done
	say "kills: $KILLS ($(((KILLS + 1) / 2)) SIGKILL, ${OOM_KILLED:-0} by the OOM killer), every next boot served version 3"
fi
say "done"
