#!/bin/sh
# dracut pre-pivot hook of the vabc module: mounts read-only, in the real root
# ($NEWROOT), the partitions of PARTITIONS other than the root, each on the device
# the boot step named for it (or its base when there is no update store).
type die >/dev/null 2>&1 || . /lib/dracut-lib.sh
[ -e /etc/vabc/initramfs.conf ] || return 0
PARTITIONS=
. /etc/vabc/initramfs.conf
for p in $PARTITIONS; do
	name=${p%%=*} rest=${p#*=}
	dev=${rest%%:*} mnt=${rest#*:}
	[ "$mnt" = / ] && continue
	if [ -e /run/vabc-boot.devices ]; then
		while read -r n d; do [ "$n" = "$name" ] && dev=$d; done </run/vabc-boot.devices
	fi
	mount -r "$dev" "${NEWROOT:-/sysroot}$mnt" || die "vabc: cannot mount $name ($dev) on $mnt"
done
