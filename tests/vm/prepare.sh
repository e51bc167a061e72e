#!/usr/bin/env bash
# Prepare the VM test tier: the emulator and guest tools (Debian packages), a stock
# Debian kernel (downloaded and unpacked into a cache, never installed), and a small
# initramfs that boots it and shares this machine's /usr and /etc into the guest.
# Idempotent: everything lands in $VABC_VM_CACHE (default ~/.cache/vabc-vm) and is
# reused on the next run. Prints nothing but progress; the last line is the cache.
#
# Env: VABC_VM_CACHE   where the kernel and initramfs live
#      VABC_VM_KERNEL  a kernel package name (default: the newest
#                      linux-image-6.12.*-amd64-unsigned the package index offers)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${VABC_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vabc-vm}
mkdir -p "$CACHE"
say() { echo "vm-prepare: $*" >&2; }

# Emulator and what the guest runs (from this machine's /usr, shared read-only).
PKGS=(qemu-system-x86 busybox-static kmod cpio zstd xz-utils
	cryptsetup-bin nbd-client blktrace e2fsprogs erofs-utils fio)
missing=()
for p in "${PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
	[ "$(id -u)" = 0 ] || { say "need root to install: ${missing[*]}"; exit 1; }
	say "installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	# Another apt (unattended upgrades, a parallel job) may hold the lock for a while.
	apt_get() { apt-get -o DPkg::Lock::Timeout=300 "$@"; }
	apt_get update -qq
	apt_get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The kernel: a stock Debian 6.12 build with ublk_drv, nbd, dm-verity, dm-snapshot.
PKG=${VABC_VM_KERNEL:-}
if [ -z "$PKG" ] && [ -e "$CACHE/kernel.pkg" ]; then
	PKG=$(cat "$CACHE/kernel.pkg")
fi
if [ -z "$PKG" ]; then
	PKG=$(apt-cache search --names-only '^linux-image-6\.12\.[0-9.]+\+deb[0-9]+-amd64-unsigned$' |
		awk '{print $1}' | sort -V | tail -1)
	if [ -z "$PKG" ]; then
		apt-get -o DPkg::Lock::Timeout=300 update -qq
		PKG=$(apt-cache search --names-only '^linux-image-6\.12\.[0-9.]+\+deb[0-9]+-amd64-unsigned$' |
			awk '{print $1}' | sort -V | tail -1)
	fi
	[ -n "$PKG" ] || { say "no linux-image-6.12.*-amd64-unsigned package in the index"; exit 1; }
fi
KROOT=$CACHE/$PKG
if [ ! -e "$KROOT/.done" ]; then
	say "downloading and unpacking $PKG (about 107 MB, once)"
	rm -rf "$KROOT" "$CACHE/dl"
	mkdir -p "$CACHE/dl"
	# apt drops privileges to _apt for downloads where it can write the folder.
	chown _apt "$CACHE/dl" 2>/dev/null || true
	(cd "$CACHE/dl" && apt-get download -qq "$PKG")
	dpkg -x "$CACHE"/dl/*.deb "$KROOT"
	rm -rf "$CACHE/dl"
	KVER=$(ls "$KROOT/lib/modules")
	say "depmod $KVER"
	depmod -b "$KROOT" "$KVER"
	# PVH entry: the ELF vmlinux boots without the bzImage's decompressor and BIOS
	# handover, which under emulation saves a few seconds per boot.
	python3 "$HERE/extract-vmlinux.py" "$KROOT/boot/vmlinuz-$KVER" "$KROOT/vmlinux"
	touch "$KROOT/.done"
fi
echo "$PKG" >"$CACHE/kernel.pkg.tmp" && mv "$CACHE/kernel.pkg.tmp" "$CACHE/kernel.pkg"
KVER=$(ls "$KROOT/lib/modules")

# The initramfs: static busybox, the 9p modules, and init.sh. Rebuilt when init.sh
# or this script differ from those it was built from (by content: checkouts of other
# revisions share the cache, and their files' times say nothing).
INITRD=$CACHE/initramfs-$KVER.cpio.gz
STAMP=$(cat "$HERE/init.sh" "$0" | sha256sum | cut -d' ' -f1)
if [ ! -e "$INITRD" ] || [ "$(cat "$INITRD.sha256" 2>/dev/null)" != "$STAMP" ]; then
	say "building the initramfs"
	T=$(mktemp -d)
	trap 'rm -rf "$T"' EXIT
	mkdir -p "$T"/{dev,proc,sys,tmp,run,kmod,out,host,usr,etc,root,mnt}
	ln -s usr/bin "$T/bin"; ln -s usr/sbin "$T/sbin"
	ln -s usr/lib "$T/lib"; ln -s usr/lib64 "$T/lib64"
	cp /bin/busybox "$T/busybox"
	cp "$HERE/init.sh" "$T/init"
	chmod 755 "$T/init"
	mkdir -p "$T/mods"
	modprobe -d "$KROOT" -S "$KVER" -a --show-depends 9pnet_virtio 9p virtio_blk |
		awk '$1 == "insmod" {print $2}' | while read -r m; do
			b=$(basename "$m")
			case $b in
			*.ko.xz) xz -dc "$m" >"$T/mods/${b%.xz}" ;;
			*.ko.zst) zstd -qdc "$m" >"$T/mods/${b%.zst}" ;;
			*.ko.gz) gzip -dc "$m" >"$T/mods/${b%.gz}" ;;
			*) cp "$m" "$T/mods/$b" ;;
			esac
			echo "${b%.ko*}.ko" >>"$T/mods/order"
		done
	(cd "$T" && find . | cpio -o -H newc --quiet) | gzip -1 >"$INITRD.tmp"
	mv "$INITRD.tmp" "$INITRD"
	echo "$STAMP" >"$INITRD.sha256"
fi
echo "$CACHE"
