#!/bin/sh
# vabc's first-stage boot step, for an initramfs's /init (busybox sh or dash).
#
#   vabc-boot.sh STORE_DEV STORE_MNT STORE_DIR NAME=ROOT_DEV [vabc update boot options]
#
# Mounts the data partition STORE_DEV (read-write) on STORE_MNT, asks
# `vabc update boot --store STORE_MNT/STORE_DIR -b NAME=ROOT_DEV` what to mount as
# the root partition NAME, and prints that device on stdout: ROOT_DEV itself when
# no update is to be booted (or an installed update cannot be served: the base is
# untouched then, the attempt counted), else base + COW served by a vabc daemon
# (ublk by default) under the kernel's dm-verity with the signed root hash.
#
# It never prints a base it cannot prove whole. When the store cannot be mounted or
# read, or the merge is under way (part of the base already overwritten) and the
# update cannot be served, it prints nothing and exits 4, after VABC_ON_FAIL says
# what to do: "exit" (the default: /init decides, e.g. an emergency shell) or
# "reboot" (reboot -f, for a device nobody watches). Only a data partition that
# holds no update store boots ROOT_DEV without asking.
#
# After mounting the printed device on the new root, /init must move STORE_MNT and
# /run into it (mount --move) before switch_root: the daemon keeps serving from the
# descriptors it holds, and the new system finds the store (for `vabc update
# mark-good`) and the daemons' reports (/run/vabc) where they were.
# Env: VABC (the binary; default: vabc on PATH), VABC_ON_FAIL (exit|reboot),
# VABC_BOOT_DEVICES (a file to get every partition's "NAME DEVICE" line when more
# partitions than the root are given with -b in the options: the boot step's answer
# for them; not written when the store holds no update state).
set -u
[ $# -ge 4 ] || { sed -n '2,27p' "$0" >&2; exit 2; }
STORE_DEV=$1 STORE_MNT=$2 STORE_DIR=$3 ROOT=$4
shift 4
NAME=${ROOT%%=*} ROOT_DEV=${ROOT#*=}
VABC=${VABC:-vabc}

fallback() {
	echo "vabc-boot: $*; booting $ROOT_DEV" >&2
	echo "$ROOT_DEV"
	exit 0
}

# Nothing is mounted as root: the base may be neither the old system nor the new.
halt() {
	echo "vabc-boot: $*; not booting $ROOT_DEV (it may be half merged)" >&2
	if [ "${VABC_ON_FAIL:-exit}" = reboot ]; then
		echo "vabc-boot: rebooting (VABC_ON_FAIL=reboot)" >&2
		reboot -f
	fi
	exit 4
}

mkdir -p "$STORE_MNT"
# (/proc/mounts, not mountpoint(1): initramfs-tools' busybox has no such applet.)
grep -q " $STORE_MNT " /proc/mounts || mount -o rw "$STORE_DEV" "$STORE_MNT" ||
	halt "cannot mount the store's partition $STORE_DEV, so the update's state is unknown"
[ -d "$STORE_MNT/$STORE_DIR" ] || fallback "no update store in $STORE_MNT/$STORE_DIR"
# (The state's copy counts: vabc reads it when the state file is damaged or gone.)
[ -e "$STORE_MNT/$STORE_DIR/state" ] || [ -e "$STORE_MNT/$STORE_DIR/state.copy" ] ||
	fallback "no update state in $STORE_MNT/$STORE_DIR"
out=$("$VABC" update boot --store "$STORE_MNT/$STORE_DIR" -b "$NAME=$ROOT_DEV" "$@")
rc=$?
# 0: the device to mount (the base when that is safe, said on stderr); anything else
# (4: merging and not servable; 1: the state could not be read) leaves the base's
# contents unknown.
[ $rc -eq 0 ] || halt "vabc update boot failed (exit $rc)"
dev=$(echo "$out" | while read -r n d; do [ "$n" = "$NAME" ] && echo "$d"; done)
[ -n "$dev" ] || halt "vabc update boot named no device for $NAME"
if [ -n "${VABC_BOOT_DEVICES:-}" ]; then
	echo "$out" >"$VABC_BOOT_DEVICES" || halt "cannot write $VABC_BOOT_DEVICES"
fi
echo "$dev"
