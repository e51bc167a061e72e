#!/bin/sh
# vabc's first-stage boot step, for an initramfs's /init (busybox sh or dash).
#
#   vabc-boot.sh STORE_DEV STORE_MNT STORE_DIR NAME=ROOT_DEV [vabc update boot options]
#
# Mounts the data partition STORE_DEV (read-write) on STORE_MNT, asks
# `vabc update boot --store STORE_MNT/STORE_DIR` what to mount as the root partition
# NAME, and prints that device on stdout: ROOT_DEV itself when no update is to be
# booted, else base + COW served by a vabc daemon (ublk by default), under the
# kernel's dm-verity when the update carries a root hash. On any failure it prints
# ROOT_DEV: the device always boots, and a boot that failed to start the update
# counted as one of its attempts, so an update that cannot be served is rolled back.
#
# After mounting the printed device on the new root, /init must move STORE_MNT and
# /run into it (mount --move) before switch_root: the daemon keeps serving from the
# descriptors it holds, and the new system finds the store (for `vabc update
# mark-good`) and the daemons' reports (/run/vabc) where they were.
# Env: VABC (the binary; default: vabc on PATH).
set -u
[ $# -ge 4 ] || { sed -n '2,18p' "$0" >&2; exit 2; }
STORE_DEV=$1 STORE_MNT=$2 STORE_DIR=$3 ROOT=$4
shift 4
NAME=${ROOT%%=*} ROOT_DEV=${ROOT#*=}
VABC=${VABC:-vabc}

fallback() {
	echo "vabc-boot: $*; booting $ROOT_DEV" >&2
	echo "$ROOT_DEV"
	exit 0
}

mkdir -p "$STORE_MNT"
mountpoint -q "$STORE_MNT" || mount -o rw "$STORE_DEV" "$STORE_MNT" ||
	fallback "cannot mount the store's partition $STORE_DEV"
[ -e "$STORE_MNT/$STORE_DIR/state" ] || fallback "no update store in $STORE_MNT/$STORE_DIR"
out=$("$VABC" update boot --store "$STORE_MNT/$STORE_DIR" -b "$NAME=$ROOT_DEV" "$@") ||
	fallback "vabc update boot failed"
dev=$(echo "$out" | while read -r n d; do [ "$n" = "$NAME" ] && echo "$d"; done)
[ -n "$dev" ] || fallback "vabc update boot named no device for $NAME"
echo "$dev"
