#!/bin/bash
# dracut module "vabc" (installed as /usr/lib/dracut/modules.d/90vabc): puts vabc, its
# boot step, /etc/vabc/initramfs.conf, the keyring, veritysetup and the ublk,
# dm-verity and loop modules into the initramfs, and runs the step before the root
# is mounted (vabc-pre-mount.sh) and mounts the other partitions before the switch
# (vabc-pre-pivot.sh). The same configuration as the initramfs-tools scripts
# (docs/08-device-updates.md); without /etc/vabc/initramfs.conf the module is left
# out unless asked for.

check() {
	[[ -e /etc/vabc/initramfs.conf ]] || return 255
	require_binaries vabc veritysetup || return 1
	return 0
}

depends() {
	echo dm
	return 0
}

installkernel() {
	hostonly='' instmods ublk_drv dm_verity loop
}

install() {
	inst_multiple vabc veritysetup sh grep mount mkdir
	inst_simple /usr/share/vabc/vabc-boot.sh
	inst_simple /etc/vabc/initramfs.conf
	local k
	for k in /etc/vabc/keys/*.pem; do
		[[ -e $k ]] && inst_simple "$k"
	done
	[[ -e /etc/vabc/version ]] && inst_simple /etc/vabc/version
	inst_hook pre-mount 50 "$moddir/vabc-pre-mount.sh"
	inst_hook pre-pivot 50 "$moddir/vabc-pre-pivot.sh"
}
