#!/usr/bin/env bash
# Install what building, testing and the demo need on a fresh Debian/Ubuntu
# machine. Idempotent and quick when everything is already there.
set -euo pipefail

# System packages: compilers for the C codecs, filesystem tools for the
# mount tests and the corpus, FUSE, NBD clients, veritysetup, fio and
# qemu-storage-daemon (the peer of bench/serve.sh).
PKGS=(
	build-essential pkg-config bc time
	e2fsprogs erofs-utils util-linux mount fuse3
	qemu-utils libnbd-bin qemu-system-common
	cryptsetup-bin fio openssl man-db blktrace
	bindfs squashfs-tools meson ninja-build
	xdelta3 zstd bsdiff xz-utils
	python3 python3-pip python3-numpy
)
missing=()
for p in "${PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "install-deps: need root to install: ${missing[*]}" >&2
		exit 1
	fi
	echo "install-deps: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get -o DPkg::Lock::Timeout=300 update -qq
	apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
	echo "install-deps: a Rust toolchain (1.95 or newer, with cargo, rustfmt and clippy) is required" >&2
	exit 1
fi
