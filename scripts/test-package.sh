#!/usr/bin/env bash
# What the packages promise, checked on a clean system:
#   scripts/test-package.sh [--musl FILE]
# installs the newest target/debian/vabc_*.deb (scripts/package.sh deb) into a fresh
# Debian bookworm chroot (minbase and systemd) and checks there:
#   - `systemd-analyze verify` passes for every unit it ships (an instance of the
#     template: its ExecStart exists and is executable, its directives are known);
#   - the initramfs step, its hook and scripts and the manual pages are where the
#     docs say, and the postinst enabled the boot assessment's units;
#   - `vabc diff` then `vabc apply` of a small update gives the new image;
# and outside it that the packaged binary is stripped. With --musl, the static
# binary (scripts/package.sh musl) makes the same round trip in the chroot, which has
# no Rust runtime libraries beyond libc (a static binary needs none), and is stripped.
# The chroot is made once (mmdebstrap) and kept in $VABC_CHROOT_CACHE (default
# ~/.cache/vabc-chroot); each run installs into a fresh copy. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
MUSL=
while (($#)); do
	case $1 in
	--musl) MUSL=$(realpath "$2"); shift 2 ;;
	*) sed -n '2,16p' "$0" >&2; exit 2 ;;
	esac
done
say() { echo "test-package: $*" >&2; }
DEB=$(ls -t target/debian/vabc_*.deb 2>/dev/null | head -1)
[ -n "$DEB" ] || { say "no target/debian/vabc_*.deb: run scripts/package.sh deb first"; exit 1; }
CACHE=${VABC_CHROOT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vabc-chroot}/bookworm-systemd
command -v mmdebstrap >/dev/null || apt-get -o DPkg::Lock::Timeout=300 install -y -qq mmdebstrap >/dev/null
if [ ! -e "$CACHE/.done" ]; then
	rm -rf "$CACHE"
	mkdir -p "$(dirname "$CACHE")"
	say "mmdebstrap bookworm (minbase, systemd) into $CACHE, once"
	mmdebstrap --quiet --variant=minbase --include=systemd bookworm "$CACHE" >/dev/null
	touch "$CACHE/.done"
fi
# Stripped: no DWARF sections left (the build keeps line tables).
stripped() { # FILE
	! readelf -SW "$1" | grep -qE '\.debug_(info|line|str)'
}
X=$(mktemp -d "${TMPDIR:-/tmp}/vabc-deb.XXXXXX")
ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/vabc-chroot.XXXXXX")
trap 'rm -rf "$ROOTFS" "$X"' EXIT
dpkg-deb -x "$DEB" "$X"
stripped "$X/usr/bin/vabc" || { say "FAIL: the packaged binary is not stripped"; exit 1; }
say "$(basename "$DEB"): $(stat -c %s "$DEB") bytes, binary $(stat -c %s "$X/usr/bin/vabc") bytes (stripped)"
cp -a "$CACHE/." "$ROOTFS/"
cp "$DEB" "$ROOTFS/tmp/vabc.deb"
head -c 8M /dev/urandom >"$ROOTFS/tmp/old.img"
cp "$ROOTFS/tmp/old.img" "$ROOTFS/tmp/new.img"
head -c 1M /dev/urandom | dd of="$ROOTFS/tmp/new.img" bs=1M seek=3 conv=notrunc status=none
if [ -n "$MUSL" ]; then
	stripped "$MUSL" || { say "FAIL: the static binary is not stripped"; exit 1; }
	file "$MUSL" | grep -qE 'static(ally|-pie) linked' || { say "FAIL: $MUSL is not static: $(file "$MUSL")"; exit 1; }
	cp "$MUSL" "$ROOTFS/tmp/vabc-static"
	say "static binary: $(stat -c %s "$MUSL") bytes"
fi
chroot "$ROOTFS" /bin/sh -ec '
	dpkg -i /tmp/vabc.deb >/dev/null
	vabc --version
	# Every unit, as an instance of the template (systemd-analyze verifies instances).
	for u in /usr/lib/systemd/system/vabc*.service; do
		case $u in
		*@.service) i=/tmp/$(basename "$u" .service)check.service; cp "$u" "$i"; u=$i ;;
		esac
		systemd-analyze verify --man=no "$u"
		echo "unit $(basename "$u"): systemd-analyze verify clean"
	done
	# The check has teeth: the unit as it once was (ExecStart in /usr/local/bin) fails.
	sed "s#/usr/bin/vabc#/usr/local/bin/vabc#" /usr/lib/systemd/system/vabc-serve@.service \
		>/tmp/vabc-serve@old.service
	systemd-analyze verify --man=no /tmp/vabc-serve@old.service 2>&1 | grep -q "is not executable" ||
		{ echo "systemd-analyze verify did not flag a missing ExecStart binary"; exit 1; }
	ls /usr/share/vabc/vabc-boot.sh /usr/share/vabc/health-check.sh \
		/usr/share/initramfs-tools/hooks/vabc /usr/share/initramfs-tools/scripts/local-top/vabc \
		/usr/share/initramfs-tools/scripts/local-bottom/vabc /usr/share/man/man1/vabc-diff.1.gz \
		/usr/lib/dracut/modules.d/90vabc/module-setup.sh >/dev/null
	# The postinst enabled the boot assessment (inert until /etc/vabc/device.conf).
	for u in vabc-health-check vabc-mark-good vabc-merge; do
		[ "$(systemctl is-enabled $u.service)" = enabled ] || { echo "$u.service is not enabled"; exit 1; }
	done
	echo "units vabc-health-check, vabc-mark-good, vabc-merge: enabled by the postinst"
	roundtrip() { # BINARY
		"$1" diff /tmp/old.img /tmp/new.img -o /tmp/u.cow --no-progress >/dev/null
		"$1" apply --base /tmp/old.img --cow /tmp/u.cow -o /tmp/out.img --no-progress >/dev/null
		cmp /tmp/out.img /tmp/new.img
		rm -f /tmp/u.cow /tmp/u.cow.manifest /tmp/out.img
		echo "$1: diff and apply give the new image"
	}
	roundtrip vabc
	[ ! -e /tmp/vabc-static ] || roundtrip /tmp/vabc-static
' 2>&1 | tee "$X/log" | sed 's/^/    /' >&2
# systemd-analyze verify prints its findings but exits 0 for some of them.
if grep -qiE 'not executable|unknown (key|section)|failed|invalid' "$X/log"; then
	say "FAIL: see the findings above"
	exit 1
fi
say "PASS: $(basename "$DEB") installs and runs on a fresh Debian bookworm${MUSL:+; so does the static binary}"
