#!/usr/bin/env bash
# The packaged service unit under a real systemd, on the VM tier's stock kernel.
#
#   tests/vm/unit.sh
#
# Boots the Debian bookworm system scripts/test-package.sh makes (minbase and systemd)
# with the .deb installed as the guest's root file system, systemd as PID 1. A
# oneshot unit there starts `vabc-serve@system` (the package's template: ublk,
# Type=notify, its runtime folder), reads the ublk device it names whole against the
# new image, stops it, and checks the stop was clean: the unit's result "success",
# its main process's status 0, the ready report and the ublk device gone, and the
# ExecStopPost `vabc cleanup` with nothing to remove. About a minute under TCG.
# Needs the .deb (scripts/package.sh deb) and root; makes the chroot if missing.
# Env: VABC_CHROOT_CACHE (as scripts/test-package.sh), TMPDIR.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
say() { echo "unit: $*" >&2; }
DEB=$(ls -t "$ROOT"/target/debian/vabc_*.deb 2>/dev/null | head -1)
[ -n "$DEB" ] || { say "no target/debian/vabc_*.deb: run scripts/package.sh deb first"; exit 1; }
CACHE=${VABC_CHROOT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vabc-chroot}/bookworm-systemd
if [ ! -e "$CACHE/.done" ]; then
	"$ROOT/scripts/test-package.sh" >/dev/null
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vabc-unit.XXXXXX")
trap '[ -n "${VABC_KEEP:-}" ] || rm -rf "$WORK"' EXIT
R=$WORK/root
cp -a "$CACHE/." "$R/"
cp "$DEB" "$R/tmp/vabc.deb"
chroot "$R" dpkg -i /tmp/vabc.deb >/dev/null
rm "$R/tmp/vabc.deb"
# The update: 8 MiB old and new images, a quarter of their blocks changed.
T=$R/var/lib/vabc-test
mkdir -p "$T" "$R/out"
head -c 8M /dev/urandom >"$T/old.img"
cp "$T/old.img" "$T/new.img"
for at in 0 2 5 7; do
	head -c 512K /dev/urandom | dd of="$T/new.img" bs=512K seek=$((at * 2)) conv=notrunc status=none
done
chroot "$R" vabc diff /var/lib/vabc-test/old.img /var/lib/vabc-test/new.img \
	-o /var/lib/vabc-test/u.cow --no-progress >/dev/null
NEW_SHA=$(sha256sum "$T/new.img" | cut -d' ' -f1)
rm "$T/new.img"
mkdir -p "$R/etc/vabc"
cat >"$R/etc/vabc/system.conf" <<-EOF
	BASE=/var/lib/vabc-test/old.img
	COW=/var/lib/vabc-test/u.cow
	ARGS=--ublk
EOF
# The check, as a oneshot unit the boot's default target wants; it ends the machine.
cat >"$R/usr/local/sbin/vabc-unit-check" <<-EOF
	#!/bin/bash
	set -u
	log() { echo "unit-check: \$*" | tee -a /out/unit.log; }
	fail=0
	check() { if eval "\$2"; then log "ok: \$1"; else log "FAIL: \$1"; fail=1; fi; }
	systemctl start vabc-serve@system.service
	check "the unit is active (Type=notify: ready)" '[ "\$(systemctl is-active vabc-serve@system)" = active ]'
	dev=\$(sed -n 's/.*"block_device": "\([^"]*\)".*/\1/p' /run/vabc/system.ready.json)
	log "ready report: device \${dev:-none}"
	check "the served device reads as the new image" \
		'[ -b "\$dev" ] && [ "\$(dd if="\$dev" bs=1M iflag=direct status=none | sha256sum | cut -d" " -f1)" = $NEW_SHA ]'
	systemctl stop vabc-serve@system.service
	check "stopped with result success" '[ "\$(systemctl show -P Result vabc-serve@system)" = success ]'
	check "the daemon exited 0" '[ "\$(systemctl show -P ExecMainStatus vabc-serve@system)" = 0 ]'
	check "the ready report is gone" '[ ! -e /run/vabc/system.ready.json ]'
	check "the ublk device is gone" '! ls /dev/ublkc* /dev/ublkb* >/dev/null 2>&1'
	check "vabc cleanup finds nothing left" 'vabc cleanup | grep -q "nothing to clean up"'
	journalctl -u vabc-serve@system --no-pager -o cat | sed 's/^/unit-check: journal: /' >>/out/unit.log
	echo \$fail >/out/rc.tmp && mv /out/rc.tmp /out/rc
	sync
	systemctl reboot --force --force
EOF
chmod 755 "$R/usr/local/sbin/vabc-unit-check"
cat >"$R/etc/systemd/system/vabc-unit-check.service" <<-EOF
	[Unit]
	Description=vabc: check the packaged vabc-serve@ unit
	After=basic.target
	[Service]
	Type=oneshot
	ExecStart=/usr/local/sbin/vabc-unit-check
	StandardOutput=journal+console
EOF
cat >"$R/etc/systemd/system/vabc-unit-check.target" <<-EOF
	[Unit]
	Description=vabc unit check
	Requires=basic.target vabc-unit-check.service
	After=basic.target
	AllowIsolate=yes
EOF
ln -sf vabc-unit-check.target "$R/etc/systemd/system/default.target"
# PID 1 of the new root (init.sh runs it with bash): systemd itself.
printf '#!/bin/bash\nexec /lib/systemd/systemd\n' >"$R/usr/local/sbin/vabc-pid1"
chmod 755 "$R/usr/local/sbin/vabc-pid1"
IMG=$WORK/root.img
mkfs.ext4 -q -F -L root -d "$R" "$IMG" 1G
# Stage 1, in the test initramfs: the modules, then the switch to this root with its
# own /usr (the host's is not the package's).
cat >"$WORK/stage1.sh" <<-'EOF'
	for m in ublk_drv ext4; do modprobe -d "$VM_KMOD" "$m" || echo "unit: cannot load $m"; done
	mkdir -p /newroot
	mount /dev/vda /newroot || exit 1
	echo "/newroot /usr/local/sbin/vabc-pid1 own-usr" >/out/switch-root
EOF
set +e
"$HERE/run.sh" --smp 1 --timeout 600 --disk "$IMG" --share "$WORK" -- bash "$WORK/stage1.sh" >"$WORK/console.log" 2>&1
rc=$?
set -e
grep -h 'unit-check:' "$WORK/console.log" | sed 's/^.*unit-check: /    /' >&2 || true
if [ "$rc" != 0 ]; then
	tail -40 "$WORK/console.log" >&2
	say "FAIL (exit $rc)"
	exit 1
fi
say "PASS: vabc-serve@ started by systemd, served the new image over ublk, stopped cleanly"
