#!/usr/bin/env bash
# Stage 1 of a device boot in the VM scenario (device.sh): what a device's initramfs
# does. Runs the project's initramfs hook (packaging/initramfs/vabc-boot.sh) against
# the system disk (/dev/vda) and the data disk holding the update store (/dev/vdb),
# mounts the device it names read-only on /newroot, moves the store there, and asks
# the test init to switch to it; the system's side runs as guest-device-stage2.sh.
#   guest-device.sh VABC ACTION
set -uo pipefail
VABC_SRC=$1 ACTION=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# ACTION noublk: a boot without the ublk driver (the update cannot be served).
for m in ublk_drv dm_verity loop ext4 erofs; do
	[ "$ACTION" = noublk ] && [ $m = ublk_drv ] && continue
	modprobe -d "$VM_KMOD" "$m" || echo "scenario: cannot load $m"
done
# The binary and the system's script go where the switch of root carries them (/run):
# the shares they come from stay behind.
mkdir -p /run/bin
cp "$VABC_SRC" /run/bin/vabc
cp "$HERE/guest-device-stage2.sh" /run/bin/stage2.sh
export VABC=/run/bin/vabc
# The device's keyring, as an initramfs carries it (never the data disk's).
mkdir -p /run/vabc-keys
cp "$VABC_DEVICE_KEYS"/*.pem /run/vabc-keys/
# The state the boot finds (what a power cut left), before the hook acts on it.
mkdir -p /tmp/data
if mount -o ro /dev/vdb /tmp/data 2>/dev/null; then
	echo "scenario: initramfs: state $(/run/bin/vabc update status --store /tmp/data/vabc --json |
		python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')"
	umount /tmp/data
fi
# ACTION swapcow: the COW is altered on the data disk after mark-good (3 MiB in,
# past its header and scratch area), as someone who can write that disk would; the
# original is put back after this boot's hook has run.
if [ "$ACTION" = swapcow ] && mount /dev/vdb /tmp/data; then
	cp /tmp/data/vabc/system.cow /tmp/data/saved.cow
	printf 'swapped by the scenario' | dd of=/tmp/data/vabc/system.cow bs=1 seek=$((3 << 20)) conv=notrunc status=none
	sync
	umount /tmp/data
fi
# ACTION nostore: the data disk fails every read (the device-mapper error target in
# its place), so the update's state cannot be known.
STORE_DEV=/dev/vdb
if [ "$ACTION" = nostore ]; then
	dmsetup create vabc-nostore --table "0 $(blockdev --getsz /dev/vdb) error" &&
		STORE_DEV=/dev/mapper/vabc-nostore
	echo "scenario: nostore: the store's partition is $STORE_DEV"
fi
t0=$SECONDS
root=$(sh "$ROOT/packaging/initramfs/vabc-boot.sh" "$STORE_DEV" /data vabc system=/dev/vda --frontend ublk \
	--keyring /run/vabc-keys)
rc=$?
if [ $rc -ne 0 ]; then
	# The hook named no root: this initramfs powers off, as an unattended device's
	# would reboot or stop in an emergency shell.
	echo "scenario: initramfs: halted: no root (exit $rc, root '$root')"
	[ -e /run/vabc/system.log ] && sed 's/^/scenario: daemon: /' /run/vabc/system.log
	if [ "$ACTION" = swapcow ]; then
		umount /data 2>/dev/null
		mount /dev/vdb /tmp/data && mv /tmp/data/saved.cow /tmp/data/vabc/system.cow && sync &&
			umount /tmp/data && echo "scenario: swapcow: the COW put back"
	fi
	exit 0
fi
echo "scenario: initramfs: root device $root ($((SECONDS - t0)) s)"
[ -e /run/vabc/system.log ] && sed 's/^/scenario: daemon: /' /run/vabc/system.log
mkdir -p /newroot
mount -o ro "$root" /newroot || { echo "scenario: cannot mount $root"; exit 1; }
mount --move /data /newroot/data
# The host's binaries run in the new root from the host's /usr (moved there by the
# test init); their loader's cache comes along.
mount --bind /etc/ld.so.cache /newroot/etc/ld.so.cache
printf 'ACTION=%q\nROOTDEV=%q\n' "$ACTION" "$root" >/run/scenario.env
echo "/newroot /run/bin/stage2.sh" >/out/switch-root
