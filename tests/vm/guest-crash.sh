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
#   guest-crash.sh VABC WORK
set -uo pipefail
VABC=$1 WORK=$2
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
say "done"
