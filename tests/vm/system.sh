#!/usr/bin/env bash
# A real OS on the device: Debian with systemd as PID 1, updated by vabc as a
# distribution would ship it, boot after boot on the VM tier's stock kernel.
#
#   tests/vm/system.sh
#
# The system is two partitions, each its own virtio disk: system (/dev/vda, the root,
# EROFS) and vendor (/dev/vdb, EROFS, mounted on /vendor); the data disk (/dev/vdc,
# ext4) holds the update store and the bundles. Version 1 is Debian bookworm as
# released (mmdebstrap: minbase, systemd, udev, initramfs-tools); version 2 is the
# same with bookworm's security and stable updates applied (a few package upgrades);
# version 3 is version 2 with a health check that fails. Each has the .deb
# (scripts/package.sh deb) installed with its units enabled by its postinst, and the
# kernel boots with an initramfs that initramfs-tools made in version 1 from the
# package's hook and scripts (nothing of the test in it); boots 4 to 6 with one that
# dracut made from the package's module, in version 1 with dracut in place of
# initramfs-tools. The boots:
#   1. version 1 runs; a test unit installs the signed update to version 2 (both
#      partitions) from inside the running system;
#   2. the initramfs serves base + COW (ublk, kernel dm-verity) and systemd boots the
#      new system's own init: its health check passes, boot-complete.target is
#      reached, vabc-mark-good.service marks it good, the daemons merge while it runs
#      and vabc-merge.service follows the merge to its end (STATUS= in its status,
#      its progress in the journal); the serving daemons carry '@' in argv[0] and an
#      oom_score_adj of -1000, and are still there after systemd's shutdown killed
#      every other process (a system-shutdown hook looks);
#   3. the merged partitions boot directly (the store cleaned); version 3 is installed
#      with two boots allowed before mark-good;
#   4-5. version 3 boots from base + COW, its health check fails, boot-complete.target
#      is never reached and nothing marks it good;
#   6. the boot step rolls it back: version 2 from the bases, the store empty.
# After the last boot both disks must be byte for byte version 2. The three
# mmdebstrap trees are made once (in $VABC_OS_CACHE, default ~/.cache/vabc-os), the
# images from them on every run; a run is six boots under software emulation.
# Env: VABC (default target/debug/vabc; makes the bundles), VABC_OS_CACHE, TMPDIR,
# VABC_KEEP (keep the work folder).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
[ $# = 0 ] || { sed -n '2,36p' "$0" >&2; exit 2; }
say() { echo "system: $*" >&2; }
FAILED=0
fail() { say "FAIL: $*"; FAILED=$((FAILED + 1)); }
VABC=$(realpath "${VABC:-$ROOT/target/debug/vabc}")
[ -x "$VABC" ] || { say "no vabc binary at $VABC (build it first)"; exit 1; }
DEB=$(ls -t "$ROOT"/target/debian/vabc_*.deb 2>/dev/null | head -1)
[ -n "$DEB" ] || { say "no target/debian/vabc_*.deb: run scripts/package.sh deb first"; exit 1; }
command -v mmdebstrap >/dev/null || apt-get -o DPkg::Lock::Timeout=300 install -y -qq mmdebstrap >/dev/null
VMCACHE=$("$HERE/prepare.sh")
KROOT=$VMCACHE/$(cat "$VMCACHE/kernel.pkg")
KVER=$(ls "$KROOT/lib/modules")

# --- The two Debian trees, made once. The same time stamp for both, so that what
# differs between them is what the upgrades changed.
OSCACHE=${VABC_OS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vabc-os}
MIRROR=http://deb.debian.org/debian
# Tree d1 is version 1 with dracut in place of initramfs-tools (they conflict): the
# system whose dracut makes the second initramfs.
mkdir -p "$OSCACHE"
for v in 1 2 d1; do
	[ -e "$OSCACHE/v$v.tar" ] && continue
	say "mmdebstrap Debian bookworm ($v) into $OSCACHE, once"
	src=("deb $MIRROR bookworm main") gen=initramfs-tools
	[ $v != 2 ] || src+=("deb $MIRROR bookworm-updates main"
		"deb http://deb.debian.org/debian-security bookworm-security main")
	[ $v != d1 ] || gen=dracut
	# (mmdebstrap picks the output's format by its name: a tarball's ends in .tar.)
	SOURCE_DATE_EPOCH=1700000000 mmdebstrap --quiet --variant=minbase \
		--include=systemd,systemd-sysv,udev,$gen,busybox,kmod,cryptsetup-bin,dmsetup \
		--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
		--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
		bookworm "$OSCACHE/v$v.tmp.tar" "${src[@]}" >/dev/null
	mv "$OSCACHE/v$v.tmp.tar" "$OSCACHE/v$v.tar"
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vabc-system.XXXXXX")
cleanup() {
	local rc=$?
	for r in r1 rd; do
		for m in proc dev usr/lib/modules/"$KVER"; do umount "$WORK/$r/$m" 2>/dev/null || true; done
	done
	pkill -KILL -f "file=$WORK/" 2>/dev/null || true
	[ -n "${VABC_KEEP:-}" ] || rm -rf "$WORK"
	exit "$rc"
}
trap cleanup EXIT
openssl genpkey -algorithm ed25519 -out "$WORK/key.pem" 2>/dev/null
openssl pkey -in "$WORK/key.pem" -pubout -out "$WORK/pub.pem"

# --- The test's own parts of each system: a unit that reports what runs and does
# the boot's action (vabc.test= on the kernel's command line), and a shutdown hook
# that looks for the serving daemons after systemd's last killing spree.
cat >"$WORK/check" <<-'EOF'
	#!/bin/bash
	set -u
	say() { echo "vabc-os: $*" >/dev/console; }
	S=/run/vabc-store/vabc
	state() { vabc update status --store $S --json | sed -n 's/^  "state": "\([a-z-]*\)".*/\1/p'; }
	action=$(sed -n 's/.*vabc\.test=\([a-z-]*\).*/\1/p' /proc/cmdline)
	say "booted: version $(cat /etc/vabc/version) vendor $(cat /vendor/version) root $(findmnt -no SOURCE /) vendor-dev $(findmnt -no SOURCE /vendor) pid1 $(cat /proc/1/comm) state $(state)"
	# Each process's argv[0], read with builtins (a fork per process costs seconds
	# under emulation).
	daemons=0 oom=
	for p in /proc/[0-9]*; do
		IFS= read -r -d '' a0 <"$p/cmdline" 2>/dev/null || continue
		[ "$a0" = @vabc ] || continue
		read -r adj <"$p/oom_score_adj"
		daemons=$((daemons + 1)) oom="$oom $adj"
	done
	say "daemons: $daemons with argv[0] @vabc, oom_score_adj${oom:- none}"
	say "up $(cut -d' ' -f1 /proc/uptime) s"
	if [ "$(state)" = merging ]; then
		seen=
		for _ in $(seq 1800); do
			[ "$(systemctl is-active vabc-merge.service)" = active ] || break
			t=$(systemctl show -P StatusText vabc-merge.service)
			case $t in merging:*) [ -n "$seen" ] || say "merge unit status: $t"; seen=1 ;; esac
			sleep 0.5
		done
	fi
	# The last STATUS= the merge unit sent, kept by systemd after it ended.
	say "merge unit last status: $(systemctl show -P StatusText vabc-merge.service)"
	say "units: health $(systemctl show -P Result vabc-health-check.service)/$(systemctl is-active vabc-health-check.service) boot-complete $(systemctl is-active boot-complete.target) mark-good $(systemctl show -P Result vabc-mark-good.service)/$(systemctl is-active vabc-mark-good.service) merge $(systemctl show -P Result vabc-merge.service)/$(systemctl is-active vabc-merge.service)"
	journalctl -b -o cat -u vabc-health-check.service -u vabc-mark-good.service -u vabc-merge.service --no-pager |
		sed 's/^/vabc-os: journal: /' >/dev/console
	rc=0
	case $action in
	install-*)
		attempts=3
		[ "$action" = install-bad ] && attempts=2
		t0=$SECONDS
		vabc update install --store $S "/run/vabc-store/bundles/${action#install-}.vabc" \
			-b system=/dev/vda -b vendor=/dev/vdb --max-boot-attempts $attempts >/dev/null || rc=$?
		say "install-done rc=$rc state $(state) ($((SECONDS - t0)) s)"
		;;
	esac
	say "end: state $(state)"
	# The boot's journal, for where its time went (the host reads the data disk).
	journalctl -b -o short-monotonic --no-pager >"/run/vabc-store/journal-$(date +%s%N).txt" 2>&1
	sync
	systemctl reboot
EOF
cat >"$WORK/shutdown-hook" <<-'EOF'
	#!/bin/bash
	# systemd-shutdown runs this after its killing spree and unmounts.
	n=0
	for p in /proc/[0-9]*; do
		IFS= read -r -d '' a0 <"$p/cmdline" 2>/dev/null || continue
		[ "$a0" = @vabc ] && n=$((n + 1))
	done
	echo "vabc-os: shutdown: $n @vabc daemons alive after the killing spree ($1)" >/dev/console
EOF

# --- One system tree: Debian VERSION_TREE, the package, the device's configuration.
mkroot() { # DIR TREE VERSION
	local R=$1
	mkdir -p "$R"
	tar -C "$R" -xf "$OSCACHE/v$2.tar"
	cp "$DEB" "$R/tmp/vabc.deb"
	chroot "$R" dpkg -i /tmp/vabc.deb >"$WORK/dpkg.log" 2>&1 || { cat "$WORK/dpkg.log" >&2; return 1; }
	rm "$R/tmp/vabc.deb"
	mkdir -p "$R/etc/vabc/keys" "$R/etc/vabc/health.d" "$R/vendor"
	cp "$WORK/pub.pem" "$R/etc/vabc/keys/"
	echo "$3" >"$R/etc/vabc/version"
	cat >"$R/etc/vabc/initramfs.conf" <<-EOF
		STORE_DEV=/dev/vdc
		STORE_DIR=vabc
		PARTITIONS="system=/dev/vda:/ vendor=/dev/vdb:/vendor"
		BOOT_OPTIONS="--frontend ublk --verity kernel"
	EOF
	echo "STORE=/run/vabc-store/vabc" >"$R/etc/vabc/device.conf"
	# The system's own health check: both partitions of one version.
	cat >"$R/etc/vabc/health.d/10-partitions-agree" <<-'EOF'
		#!/bin/sh
		[ "$(cat /etc/vabc/version)" = "$(cat /vendor/version)" ] ||
			{ echo "system $(cat /etc/vabc/version) with vendor $(cat /vendor/version)"; exit 1; }
	EOF
	chmod 755 "$R/etc/vabc/health.d/10-partitions-agree"
	# A read-only root (EROFS under dm-verity): what the system writes goes to tmpfs.
	printf 'tmpfs /var tmpfs mode=0755 0 0\ntmpfs /tmp tmpfs mode=1777 0 0\n' >"$R/etc/fstab"
	echo 6f1c7a521d5e4d0c9a3e0c9d5b1a2e41 >"$R/etc/machine-id"
	# Units the test system has no use for: each process costs a second or more under
	# emulation. (The image carries no kernel modules: the initramfs loads them.)
	for u in serial-getty@ttyS0 getty@tty1 systemd-firstboot apt-daily.timer apt-daily-upgrade.timer \
		e2scrub_all.timer e2scrub_reap fstrim.timer modprobe@ systemd-modules-load \
		systemd-binfmt proc-sys-fs-binfmt_misc.automount systemd-pstore; do
		case $u in *.*) ;; *) u=$u.service ;; esac
		ln -sf /dev/null "$R/etc/systemd/system/$u"
	done
	# Generators the system does not use, masked: each is a process that costs a
	# second or more under emulation (only the fstab one has work here).
	mkdir -p "$R/etc/systemd/system-generators"
	for g in "$R"/usr/lib/systemd/system-generators/*; do
		case $g in */systemd-fstab-generator) continue ;; esac
		ln -sf /dev/null "$R/etc/systemd/system-generators/${g##*/}"
	done
	install -m 755 "$WORK/check" "$R/usr/local/sbin/vabc-os-check"
	install -D -m 755 "$WORK/shutdown-hook" "$R/usr/lib/systemd/system-shutdown/vabc-os-check"
	cat >"$R/etc/systemd/system/vabc-os-check.service" <<-'EOF'
		[Unit]
		Description=vabc: the VM test's report of this boot
		After=multi-user.target boot-complete.target vabc-mark-good.service vabc-merge.service
		DefaultDependencies=no
		[Service]
		Type=oneshot
		ExecStart=/usr/local/sbin/vabc-os-check
		[Install]
		WantedBy=multi-user.target
	EOF
	ln -sf /etc/systemd/system/vabc-os-check.service "$R/etc/systemd/system/multi-user.target.wants/"
}
mkvendor() { # DIR VERSION
	mkdir -p "$1"
	echo "$2" >"$1/version"
	python3 - "$1/firmware.bin" "$2" "$HERE" <<-'PY'
		import sys
		sys.dont_write_bytecode = True
		sys.path.insert(0, sys.argv[3])
		from words import text
		open(sys.argv[1], "wb").write(text(40 + int(sys.argv[2]), 3 << 20))
	PY
}
erofs() { # DIR IMG
	mkfs.erofs --quiet -zlz4hc -T1700000000 --all-root -U 4c2d9e1a-7b3f-4e58-a1c0-2f6d8b9e0a13 "$2" "$1"
}
t0=$SECONDS
mkroot "$WORK/r1" 1 1
mkroot "$WORK/r2" 2 2
mkroot "$WORK/r3" 2 3
cat >"$WORK/r3/etc/vabc/health.d/50-broken" <<-'EOF'
	#!/bin/sh
	echo "version 3 is broken on purpose"
	exit 1
EOF
chmod 755 "$WORK/r3/etc/vabc/health.d/50-broken"
# The initramfs, as the system makes it: initramfs-tools with the package's hook and
# scripts, the kernel's modules lent for the while.
mkinitrd() { # ROOT OUT COMMAND...: COMMAND run in ROOT makes /tmp/initrd.img
	local R=$1 out=$2
	shift 2
	mkdir -p "$R/usr/lib/modules/$KVER" "$R/boot"
	mount --bind -o ro "$KROOT/lib/modules/$KVER" "$R/usr/lib/modules/$KVER"
	mount --bind /dev "$R/dev"
	mount -t proc proc "$R/proc"
	cp "$KROOT/boot/config-$KVER" "$R/boot/"
	local rc=0
	chroot "$R" "$@" >"$WORK/mkinitrd.log" 2>&1 || rc=$?
	umount "$R/proc" "$R/dev" "$R/usr/lib/modules/$KVER"
	if ((rc)); then
		cat "$WORK/mkinitrd.log" >&2
		say "$1 failed (exit $rc)"
		exit 1
	fi
	# Its warnings (no zstd, say), if any: grep finding none is no failure.
	grep -v '^$' "$WORK/mkinitrd.log" | grep -iE 'warn|W:|error' | sed "s/^/    $1: /" >&2 || true
	mv "$R/tmp/initrd.img" "$out"
	rm -rf "$R/boot/config-$KVER" "$R/usr/lib/modules/$KVER"
}
sed -i 's/^MODULES=.*/MODULES=list/' "$WORK/r1/etc/initramfs-tools/initramfs.conf"
printf '%s\n' virtio_pci virtio_blk erofs ext4 dm_mod dm_verity ublk_drv >>"$WORK/r1/etc/initramfs-tools/modules"
mkinitrd "$WORK/r1" "$WORK/initrd.img" mkinitramfs -o /tmp/initrd.img "$KVER"
# The same system's initramfs as dracut (Fedora's and RHEL's generator) makes it,
# with the package's module: the boots of version 3 and the rollback use it.
mkroot "$WORK/rd" d1 1
mkinitrd "$WORK/rd" "$WORK/initrd-dracut.img" dracut --quiet --force --no-hostonly --kver "$KVER" \
	--modules "systemd systemd-initrd dracut-systemd base dm rootfs-block fs-lib udev-rules vabc" \
	--drivers "virtio_pci virtio_blk erofs ext4 dm_mod dm_verity ublk_drv loop" /tmp/initrd.img
rm -rf "$WORK/rd"
for v in 1 2 3; do
	erofs "$WORK/r$v" "$WORK/system$v.img"
	mkvendor "$WORK/vendor$v" "$v"
	erofs "$WORK/vendor$v" "$WORK/vendor$v.img"
	rm -rf "$WORK/r$v" "$WORK/vendor$v"
done
# Partitions of one size per name, whatever the version holds.
size_of() { # IMG... : the largest, in MiB rounded up, plus 8 MiB
	local m=0 s
	for f in "$@"; do s=$(stat -c %s "$f"); ((s > m)) && m=$s; done
	echo $(((m + (1 << 20) - 1) / (1 << 20) + 8))M
}
SYSSIZE=$(size_of "$WORK"/system?.img) VENSIZE=$(size_of "$WORK"/vendor?.img)
truncate -s "$SYSSIZE" "$WORK"/system?.img
truncate -s "$VENSIZE" "$WORK"/vendor?.img
sha() { sha256sum "$1" | cut -d' ' -f1; }
D=$WORK/data
mkdir -p "$D/bundles"
"$VABC" -q bundle create -p "system=$WORK/system1.img,$WORK/system2.img" \
	-p "vendor=$WORK/vendor1.img,$WORK/vendor2.img" -o "$D/bundles/good.vabc" \
	--key "$WORK/key.pem" --verity --release-version 2 >/dev/null
"$VABC" -q bundle create -p "system=$WORK/system2.img,$WORK/system3.img" \
	-p "vendor=$WORK/vendor2.img,$WORK/vendor3.img" -o "$D/bundles/bad.vabc" \
	--key "$WORK/key.pem" --verity --release-version 3 >/dev/null
"$VABC" -q update init --store "$D/vabc" >/dev/null
truncate -s 320M "$WORK/data.img"
mkfs.ext4 -q -F -b 4096 -L data -E root_owner=0:0 -d "$D" "$WORK/data.img" 320M
cp "$WORK/system1.img" "$WORK/system.img"
cp "$WORK/vendor1.img" "$WORK/vendor.img"
say "images in $((SECONDS - t0)) s: system $SYSSIZE (EROFS: $(stat -c %s "$WORK/system1.img") bytes), vendor $VENSIZE;" \
	"initramfs $(stat -c %s "$WORK/initrd.img") bytes (dracut's $(stat -c %s "$WORK/initrd-dracut.img")); bundles $(stat -c %s "$D/bundles/good.vabc") and $(stat -c %s "$D/bundles/bad.vabc") bytes"

# --- One boot of the device: the system makes its report and reboots itself.
N=0 FLAKES=0
# Two vCPUs: systemd starts units in parallel, and under emulation every process
# start costs. Not quiet: initramfs-tools says which scripts it ran.
boot_once() { # ACTION
	timeout -k 10 900 qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu max -smp 2 -m 1536 \
		-display none -monitor none -serial stdio -no-reboot -nodefaults \
		-kernel "$KROOT/vmlinux" -initrd "${INITRD:-$WORK/initrd.img}" \
		-append "console=ttyS0 root=/dev/vda ro rootfstype=erofs panic=-1 loglevel=3 systemd.show_status=error vabc.test=$1" \
		-drive "file=$WORK/system.img,if=virtio,format=raw,cache=writeback" \
		-drive "file=$WORK/vendor.img,if=virtio,format=raw,cache=writeback" \
		-drive "file=$WORK/data.img,if=virtio,format=raw,cache=writeback" \
		</dev/null 2>&1 | sed -u 's/\r$//' >"$LOG"
}
boot() { # ACTION
	N=$((N + 1))
	LOG=$WORK/boot$N.log
	local start=$SECONDS qrc=0
	boot_once "$1" || qrc=$?
	# A guest kernel that panicked before initramfs-tools ran a script never reached
	# vabc: the emulator's fault (multi-threaded emulation of a stock kernel, about
	# one boot in a few dozen: its live code patching), booted again and counted.
	while ! grep -qE 'Running /scripts/init-premount|dracut' "$LOG" && grep -q 'Kernel panic' "$LOG" && ((FLAKES < 3)); do
		FLAKES=$((FLAKES + 1))
		say "boot $N: the guest kernel panicked before the initramfs ran; booting again"
		grep -m3 -E 'Oops|RIP:|Kernel panic' "$LOG" | sed 's/^/    /' >&2
		qrc=0
		boot_once "$1" || qrc=$?
	done
	BOOTED=$(grep -m1 'vabc-os: booted:' "$LOG" || true)
	field() { echo "$BOOTED" | sed -n "s/.* $1 \([^ ]*\).*/\1/p"; }
	VERSION=$(field version) VENDOR=$(field vendor) ROOTDEV=$(field root) VENDORDEV=$(field vendor-dev)
	STATE=$(field state) PID1=$(field pid1)
	echo "boot $N ($1, $((SECONDS - start)) s): version ${VERSION:-?} (vendor ${VENDOR:-?}), root ${ROOTDEV:-?}, vendor ${VENDORDEV:-?}, PID 1 ${PID1:-?}, state ${STATE:-?}"
	grep -E 'vabc-os: |vabc update boot:|vabc-boot:|vabc: ' "$LOG" | grep -v 'vabc-os: booted:' | sed 's/^/    /' || true
	if [ -z "$BOOTED" ]; then
		fail "boot $N reached no system (qemu exit $qrc):"
		tail -40 "$LOG" >&2
	fi
	[ "$PID1" = systemd ] || fail "boot $N: PID 1 is ${PID1:-?}, not systemd"
	grep -q 'vabc-os: end: ' "$LOG" || fail "boot $N: the test unit did not finish"
}
has() { grep -q "$1" "$LOG"; }
units() { grep -m1 'vabc-os: units:' "$LOG" | sed 's/.*units: //'; }
versions() { # WHAT VERSION ROOTDEV VENDORDEV
	[ "$VERSION" = "$2" ] && [ "$VENDOR" = "$2" ] || fail "boot $N ($1): version $VERSION, vendor $VENDOR; expected $2"
	[ "$ROOTDEV" = "$3" ] && [ "$VENDORDEV" = "$4" ] || fail "boot $N ($1): root $ROOTDEV, vendor $VENDORDEV; expected $3 and $4"
}
SERVED=(/dev/mapper/vabc-system /dev/mapper/vabc-vendor)

# 1. Version 1 installs version 2 from inside the running system.
boot install-good
versions "version 1" 1 /dev/vda /dev/vdb
has 'vabc-os: install-done rc=0 state installed' || fail "boot $N: the update did not install"
case $(units) in "health success/active boot-complete active mark-good success/active"*) ;;
*) fail "boot $N: version 1's boot was not assessed good: $(units)" ;; esac
has 'nothing to mark good' || fail "boot $N: mark-good did not say there was nothing to mark"

# 2. Version 2 from base + COW: assessed good, marked good, merged.
boot run
versions "the update's first boot" 2 "${SERVED[@]}"
[ "$STATE" = installed ] || [ "$STATE" = merging ] || fail "boot $N: state $STATE at first"
case $(units) in "health success/active boot-complete active mark-good success/active merge success/inactive") ;;
*) fail "boot $N: health check, boot-complete, mark-good and merge not all done: $(units)" ;; esac
# Its progress is seen only when the test looks before the merge ends; its last
# STATUS= stays.
has 'vabc-os: merge unit last status: merged (state merged)' || fail "boot $N: vabc-merge.service's status does not say merged"
has 'vabc-os: journal: .*: merged (state merged)' || fail "boot $N: the journal does not say the merge ended"
has 'vabc-os: end: state merged' || fail "boot $N: not merged"
has 'vabc-os: daemons: 2 with argv\[0\] @vabc, oom_score_adj -1000 -1000' || fail "boot $N: the serving daemons are not '@' and OOM-proof"
has 'vabc-os: shutdown: 2 @vabc daemons alive after the killing spree' || fail "boot $N: the serving daemons did not outlive systemd's shutdown"
[ "$(sha "$WORK/system.img")" = "$(sha "$WORK/system2.img")" ] || fail "boot $N: the system disk is not version 2 after the merge"
[ "$(sha "$WORK/vendor.img")" = "$(sha "$WORK/vendor2.img")" ] || fail "boot $N: the vendor disk is not version 2 after the merge"

# 3. The merged bases boot directly; version 3 is installed.
boot install-bad
versions "merged" 2 /dev/vda /dev/vdb
has 'vabc-os: install-done rc=0 state installed' || fail "boot $N: version 3 did not install"

# 4-5. Version 3 fails its health check twice: never marked good. From here on the
# initramfs is dracut's.
INITRD=$WORK/initrd-dracut.img
for attempt in 1 2; do
	boot run
	versions "version 3, attempt $attempt" 3 "${SERVED[@]}"
	case $(units) in "health exit-code/failed boot-complete inactive mark-good success/inactive"*) ;;
	*) fail "boot $N: version 3's failed health check did not keep boot-complete.target and mark-good from running: $(units)" ;; esac
	has 'vabc-os: journal: .*version 3 is broken on purpose' || fail "boot $N: the failing check's words are not in the journal"
	has 'vabc-os: end: state installed' || fail "boot $N: state is not installed after a failed attempt"
	has 'vabc-os: shutdown: 2 @vabc daemons alive' || fail "boot $N: the serving daemons did not outlive systemd's shutdown"
done

# 6. Rolled back: version 2 from the bases, the store empty.
boot run
versions "rolled back" 2 /dev/vda /dev/vdb
has 'vabc update boot: .*rolled back' || fail "boot $N: the boot step did not say it rolled back"
has 'vabc-os: end: state none' || fail "boot $N: the store is not back to none"
[ "$(sha "$WORK/system.img")" = "$(sha "$WORK/system2.img")" ] || fail "the system disk is not version 2 after the rollback"
[ "$(sha "$WORK/vendor.img")" = "$(sha "$WORK/vendor2.img")" ] || fail "the vendor disk is not version 2 after the rollback"

if ((FAILED)); then
	say "$FAILED check(s) FAILED"
	exit 1
fi
((FLAKES == 0)) || say "$FLAKES boot(s) made again after the emulated kernel panicked before the initramfs ran"
say "PASS: $N boots of a real Debian system (systemd as PID 1; initramfs-tools, then dracut): installed, booted from base + COW under dm-verity, assessed good through boot-complete.target, merged, and a failing update rolled back"
