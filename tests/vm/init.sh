#!/busybox sh
# PID 1 of the test guest. Mounts the host's /usr and /etc (read-only, 9p), the
# kernel's modules at /kmod, the job folder at /out, and whatever else the job
# lists in /out/mounts ("TAG PATH ro|rw" per line), runs /out/job.sh, writes its
# exit status to /out/rc and resets the machine (QEMU runs with -no-reboot, so a
# reset ends it), or switches to a root file system the job mounted (below).
B=/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
$B mount -t tmpfs -o mode=1777 tmp /tmp
$B mount -t tmpfs run /run
for m in $($B cat /mods/order); do
	$B insmod /mods/$m 2>/dev/null
done
ninep() { # TAG PATH ro|rw
	o=trans=virtio,version=9p2000.L,msize=512000
	# Read-only trees never change under the guest: let it cache them.
	[ "$3" = ro ] && o=$o,ro,cache=loose
	$B mkdir -p "$2" 2>/dev/null
	$B mount -t 9p -o "$o" "$1" "$2" || echo "vm-init: cannot mount $1 on $2" >&2
}
ninep out /out rw
ninep usr /usr ro
ninep etc /etc ro
ninep kmod /kmod ro
if [ -e /out/mounts ]; then
	while read -r tag path mode; do
		[ -n "$tag" ] && ninep "$tag" "$path" "$mode"
	done </out/mounts
fi
$B mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
$B mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
$B mount -t devpts devpts /dev/pts 2>/dev/null
$B ln -s /proc/self/fd /dev/fd 2>/dev/null
$B hostname vabc-vm
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin HOME=/root TMPDIR=/tmp
export VM_KMOD=/kmod VM_KVER=$($B uname -r) DM_DISABLE_UDEV=1
cd /
/bin/bash /out/job.sh </dev/null
rc=$?
# A job that mounted a new root and wrote "NEWROOT INIT" to /out/switch-root gets it
# as the root file system, as an initramfs hands over to the real system: /dev,
# /proc, /sys, /run, /usr and /out move along, and INIT runs as PID 1 there (it
# writes /out/rc and resets the machine itself). "NEWROOT INIT own-usr" keeps the
# new root's own /usr (a whole system, not the host's binaries).
if [ "$rc" = 0 ] && [ -e /out/switch-root ]; then
	read -r newroot newinit usr </out/switch-root
	$B rm -f /out/switch-root
	moves="/dev /proc /sys /run /usr /out"
	[ "$usr" = own-usr ] && moves="/dev /proc /sys /run /out"
	for m in $moves; do
		$B mount --move "$m" "$newroot$m" || echo "vm-init: cannot move $m" >&2
	done
	exec $B switch_root "$newroot" /usr/bin/bash "$newinit"
fi
echo $rc >/out/rc.tmp && $B mv /out/rc.tmp /out/rc
$B sync
$B reboot -f
