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
# The kernel's modules, in one modprobe (each call reads the module index: a second
# under emulation); ACTION halts loads ublk later.
mods="dm_verity loop ext4 erofs"
[ "$ACTION" = halts ] || mods="ublk_drv $mods"
# shellcheck disable=SC2086
modprobe -a -d "$VM_KMOD" $mods || echo "scenario: cannot load all of $mods"
# The binary (stripped by the host, as a device's is) and the system's script go where
# the switch of root carries them (/run): the shares they come from stay behind.
mkdir -p /run/bin
cp "$VABC_SRC" /run/bin/vabc
cp "$HERE/guest-device-stage2.sh" /run/bin/stage2.sh
export VABC=/run/bin/vabc
# The device's keyring, as an initramfs carries it (never the data disk's).
mkdir -p /run/vabc-keys
cp "$VABC_DEVICE_KEYS"/*.pem /run/vabc-keys/
# One field of the store's status (its JSON is one key per line; Python's start-up
# costs seconds under emulation, on every poll).
status_field() { # FIELD STORE
	/run/bin/vabc update status --store "$2" --json | sed -n "s/^ *\"$1\": \"*\([^\",]*\)\"*,*\$/\1/p" | head -1
}
# The state the boot finds (what a power cut left), before the hook acts on it.
mkdir -p /tmp/data
if mount -o ro /dev/vdb /tmp/data 2>/dev/null; then
	echo "scenario: initramfs: state $(status_field state /tmp/data/vabc)"
	umount /tmp/data
fi
# The project's initramfs hook, as /init runs it: sets root (the device it names) and
# rc.
boot_step() { # STORE_DEV
	root=$(sh "$ROOT/packaging/initramfs/vabc-boot.sh" "$1" /data vabc system=/dev/vda --frontend ublk \
		--keyring /run/vabc-keys)
	rc=$?
}
# ACTION halts (the merge under way): three boot steps that must each mount no root and
# write nothing, each from what a fresh boot finds (the store unmounted, no daemon's
# report), run in one boot because each costs a boot's time under emulation. A step
# that names a root ends the boot: what it started is no fresh boot's state.
halting_step() { # NAME STORE_DEV
	echo "scenario: step $1"
	boot_step "$2"
	if [ $rc -eq 0 ]; then
		echo "scenario: $1: root device $root (did not halt)"
		exit 0
	fi
	echo "scenario: $1: halted: no root (exit $rc, root '$root')"
	[ -e /run/vabc/system.log ] && sed "s/^/scenario: $1: daemon: /" /run/vabc/system.log
	umount /data 2>/dev/null
	rm -rf /run/vabc
}
if [ "$ACTION" = halts ]; then
	# Without the ublk driver (loaded after this step): the update cannot be served.
	halting_step noublk /dev/vdb
	modprobe -d "$VM_KMOD" ublk_drv || echo "scenario: cannot load ublk_drv"
	# The data disk failing every read (the device-mapper error target in its place):
	# the update's state cannot be known.
	dmsetup create vabc-nostore --table "0 $(blockdev --getsz /dev/vdb) error" &&
		echo "scenario: nostore: the store's partition is /dev/mapper/vabc-nostore"
	halting_step nostore /dev/mapper/vabc-nostore
	dmsetup remove vabc-nostore
	# The COW altered on the data disk after mark-good (3 MiB in, past its header and
	# scratch area), as someone who can write that disk would; put back afterwards.
	mount /dev/vdb /tmp/data && cp /tmp/data/vabc/system.cow /tmp/data/saved.cow &&
		printf 'swapped by the scenario' |
		dd of=/tmp/data/vabc/system.cow bs=1 seek=$((3 << 20)) conv=notrunc status=none
	sync
	umount /tmp/data
	halting_step swapcow /dev/vdb
	mount /dev/vdb /tmp/data && mv /tmp/data/saved.cow /tmp/data/vabc/system.cow && sync &&
		umount /tmp/data && echo "scenario: swapcow: the COW put back"
	# This initramfs powers off, as an unattended device's would reboot or stop in an
	# emergency shell.
	echo "scenario: initramfs: halted (noublk, nostore, swapcow)"
	exit 0
fi
t0=$SECONDS
boot_step /dev/vdb
if [ $rc -ne 0 ]; then
	echo "scenario: initramfs: halted: no root (exit $rc, root '$root')"
	[ -e /run/vabc/system.log ] && sed 's/^/scenario: daemon: /' /run/vabc/system.log
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
