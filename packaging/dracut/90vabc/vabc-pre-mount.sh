#!/bin/sh
# dracut pre-mount hook of the vabc module: runs vabc's boot step and makes the root
# the device it names (the base, or the update served from base + COW under
# dm-verity). Under systemd (dracut's usual mode) the root is sysroot.mount: a
# drop-in gives it the device, and the manager reloads before it mounts. A boot
# that must mount nothing (exit 4) stops in dracut's emergency shell, never on a
# root. Configured by /etc/vabc/initramfs.conf, as the initramfs-tools scripts are.
type die >/dev/null 2>&1 || . /lib/dracut-lib.sh
[ -e /etc/vabc/initramfs.conf ] || return 0
STORE_DIR=vabc STORE_MNT=/run/vabc-store BOOT_OPTIONS= PARTITIONS=
. /etc/vabc/initramfs.conf
for m in ublk_drv dm_verity loop; do modprobe -q "$m" || warn "vabc: cannot load $m"; done
# The devices the step reads: under systemd, this hook runs once the root's base is
# there, not necessarily the others.
vabc_wait_dev() {
	n=0
	while [ ! -b "$1" ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
	[ -b "$1" ] || warn "vabc: no device $1 after 30 s"
}
vabc_wait_dev "$STORE_DEV"
root_spec= bases=
for p in $PARTITIONS; do
	name=${p%%=*} rest=${p#*=}
	dev=${rest%%:*} mnt=${rest#*:}
	vabc_wait_dev "$dev"
	if [ "$mnt" = / ]; then root_spec=$name=$dev; else bases="$bases -b $name=$dev"; fi
done
[ -n "$root_spec" ] || die "vabc: no partition of PARTITIONS is mounted on /"
# shellcheck disable=SC2086
dev=$(VABC_BOOT_DEVICES=/run/vabc-boot.devices sh /usr/share/vabc/vabc-boot.sh \
	"$STORE_DEV" "$STORE_MNT" "$STORE_DIR" "$root_spec" $bases $BOOT_OPTIONS)
rc=$?
if [ $rc -ne 0 ] || [ -z "$dev" ]; then
	die "vabc: the boot step mounts no root (exit $rc): the base may be half merged"
fi
info "vabc: root $dev"
if [ -d /run/systemd/system ]; then
	mkdir -p /run/systemd/system/sysroot.mount.d
	printf '[Mount]\nWhat=%s\n' "$dev" >/run/systemd/system/sysroot.mount.d/50-vabc.conf
	systemctl daemon-reload
else
	root=block:$dev
	echo "root='block:$dev'" >>/tmp/root.info
fi
