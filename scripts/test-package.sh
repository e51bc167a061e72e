#!/usr/bin/env bash
# Install the .deb from scripts/package.sh into a fresh Debian (bookworm, minbase)
# chroot and run it there: `vabc --version`, `vabc diff` and `vabc apply` of a small
# update, and the manual page files. The chroot is made once with debootstrap and
# kept in $VABC_CHROOT_CACHE (default ~/.cache/vabc-chroot); each run installs into a
# fresh copy of it. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
DEB=$(ls -t target/debian/vabc_*.deb | head -1)
CACHE=${VABC_CHROOT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vabc-chroot}
command -v debootstrap >/dev/null || apt-get -o DPkg::Lock::Timeout=300 install -y -qq debootstrap >/dev/null
if [ ! -e "$CACHE/.done" ]; then
	rm -rf "$CACHE"
	echo "test-package: debootstrap bookworm (minbase) into $CACHE, once" >&2
	debootstrap --variant=minbase bookworm "$CACHE" >/dev/null
	touch "$CACHE/.done"
fi
ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/vabc-chroot.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT
cp -a "$CACHE/." "$ROOTFS/"
cp "$DEB" "$ROOTFS/tmp/vabc.deb"
head -c 8M /dev/urandom >"$ROOTFS/tmp/old.img"
cp "$ROOTFS/tmp/old.img" "$ROOTFS/tmp/new.img"
head -c 1M /dev/urandom | dd of="$ROOTFS/tmp/new.img" bs=1M seek=3 conv=notrunc status=none
chroot "$ROOTFS" /bin/sh -ec '
	dpkg -i /tmp/vabc.deb
	vabc --version
	vabc diff /tmp/old.img /tmp/new.img -o /tmp/u.cow --no-progress
	vabc apply --base /tmp/old.img --cow /tmp/u.cow -o /tmp/out.img --no-progress
	cmp /tmp/out.img /tmp/new.img && echo "apply in the chroot: equal to the new image"
	ls /usr/share/man/man1/vabc-diff.1.gz /usr/lib/systemd/system/vabc-serve@.service
'
echo "test-package: $(basename "$DEB") installs and runs on a fresh Debian bookworm"
