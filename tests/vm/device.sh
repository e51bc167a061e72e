#!/usr/bin/env bash
# The device scenario of the VM tier: vabc as a device updater on a stock kernel,
# boot after boot, with power cuts.
#
#   tests/vm/device.sh [--install-cuts N] [--merge-cuts N]
#
# The guest has a system disk (/dev/vda: a 40 MiB EROFS root file system, version 1)
# and a data disk (/dev/vdb: the update store, the bundles and the public key). Every
# boot runs the project's initramfs hook (guest-device.sh), switches to the root it
# names, and the system does one step (guest-device-stage2.sh). The host:
#   1. boots the old system, which installs the update (version 2); the emulator is
#      killed (SIGKILL: a power cut) at random moments while it installs (once its
#      state says installing), until N cuts landed mid-install: each next boot must run the old system (version 1,
#      its root device read whole equal to the old image) and the install resumes;
#   2. boots the new system, served from base + COW (ublk, kernel dm-verity): its
#      root is version 2 and reads whole as the new image; it marks itself good and
#      the merge runs while it keeps reading its root; the emulator is killed at
#      random moments of the merge until N cuts landed mid-merge (more when the
#      install had fewer than N, so that 10 land in all): each next boot
#      must run the new system again and resume the merge; after the first such
#      cut, one boot runs three boot steps that must mount no root and write
#      nothing: without the ublk driver, with the data disk unreadable
#      (device-mapper's error target), and with the COW altered on the data disk;
#   3. the boot after the merge mounts the base itself, which is the new image, and
#      cleans the COW store; that system installs a bad update (version 3, whose
#      health check fails);
#   4. the bad update boots twice, fails its health check each time (the second
#      time a COW block altered on the data disk must fail to read: dm-verity), and
#      the third boot rolls it back: the base is byte-identical to version 2 and the
#      store holds nothing but its state.
# It prints each boot's facts, the power-cut moments and the recovered states.
# Disks are attached with cache=directsync (every write the guest makes reaches the
# image file before it completes): a kill of the emulator loses exactly what the guest
# had not written out of its page cache, and nothing it was told was written. In a
# boot to be cut, the disks' writes are throttled to 1 MB/s, a slow eMMC, so that an
# install and a merge last long enough to be cut more than once. Torn and unflushed
# writes of a real disk are the simulated-disk crash tests' job (crates/merge).
# Boots cost 10-70 s each under software emulation, so none is spent on what another
# boot shows: a cut is planned only while the cuts that will land fall short.
# Env: VABC (default target/debug/vabc), TMPDIR.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
INSTALL_CUTS=5 MERGE_CUTS=5
while (($#)); do
	case $1 in
	--install-cuts) INSTALL_CUTS=$2; shift 2 ;;
	--merge-cuts) MERGE_CUTS=$2; shift 2 ;;
	*) sed -n '2,30p' "$0" >&2; exit 2 ;;
	esac
done
VABC=$(realpath "${VABC:-$ROOT/target/debug/vabc}")
[ -x "$VABC" ] || { echo "device: no vabc binary at $VABC (build it first)" >&2; exit 1; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vabc-device.XXXXXX")
# The trap runs under set -e and decides the exit status: pkill finding no emulator
# left (its status 1) must not turn a pass into a failure.
cleanup() {
	local rc=$?
	pkill -KILL -f "file=$WORK/" 2>/dev/null || true
	[ -n "${VABC_KEEP:-}" ] || rm -rf "$WORK"
	exit "$rc"
}
trap cleanup EXIT
say() { echo "device: $*" >&2; }
fail() { say "FAIL: $*"; FAILED=$((FAILED + 1)); }
FAILED=0

# --- The images: version 1 (old), 2 (new), 3 (new, but its health check fails).
mkroot() { # DIR VERSION HEALTH
	mkdir -p "$1"/{usr,dev,proc,sys,run,out,data,tmp,etc,opt/payload}
	for l in bin sbin lib lib64; do ln -s "usr/$l" "$1/$l"; done
	echo "$2" >"$1/etc/version"
	echo "$3" >"$1/etc/health"
	: >"$1/etc/ld.so.cache"
	python3 - "$1/opt/payload" "$2" "$HERE" <<-'PY'
		import sys
		d, v = sys.argv[1], int(sys.argv[2])
		sys.dont_write_bytecode = True  # nothing written into the source tree
		sys.path.insert(0, sys.argv[3])
		from words import text
		# Version 1: two files. Later versions change half of one, replace the other and
		# add a third: about 20 MiB of changed blocks for the merge to write.
		a = bytearray(text(1, 16 << 20))
		if v >= 2:
		    a[4 << 20:12 << 20] = text(10 + v, 8 << 20)
		open(f"{d}/a.bin", "wb").write(a)
		open(f"{d}/b.bin", "wb").write(text(2 if v == 1 else 20 + v, 8 << 20))
		if v >= 2:
		    open(f"{d}/c.bin", "wb").write(text(30 + v, 4 << 20))
	PY
}
# EROFS, as Android's system partitions are, padded to the partition's 40 MiB. (An
# install against a mounted ext4 base is crates/vabc/tests/update_cli.rs's.)
mkimg() { # VERSION HEALTH IMG
	rm -rf "$WORK/root"
	mkroot "$WORK/root" "$1" "$2"
	mkfs.erofs --quiet -T0 --all-root -U 6f1c7a52-1d5e-4d0c-9a3e-0c9d5b1a2e41 "$3" "$WORK/root"
	truncate -s 40M "$3"
}
mkimg 1 ok "$WORK/v1.img"
mkimg 2 ok "$WORK/v2.img"
mkimg 3 fail "$WORK/v3.img"
sha() { sha256sum "$1" | cut -d' ' -f1; }
V1=$(sha "$WORK/v1.img") V2=$(sha "$WORK/v2.img")

# --- The bundles (signed, with dm-verity root hashes), the store, the data disk.
D=$WORK/data
# The public key is the device's, not the data disk's: the guest's initramfs step
# copies it from a share into /run/vabc-keys (the keyring a real initramfs carries).
mkdir -p "$D/bundles" "$WORK/keys"
openssl genpkey -algorithm ed25519 -out "$WORK/key.pem" 2>/dev/null
openssl pkey -in "$WORK/key.pem" -pubout -out "$WORK/keys/pub.pem"
export VABC_DEVICE_KEYS=$WORK/keys
"$VABC" -q bundle create -p "system=$WORK/v1.img,$WORK/v2.img" -o "$D/bundles/good.vabc" \
	--key "$WORK/key.pem" --verity --release-version 2 >/dev/null
# The bad update's device COW stores its blocks uncompressed, so that the scenario can
# alter one that still decodes (only dm-verity can tell).
"$VABC" -q bundle create -p "system=$WORK/v2.img,$WORK/v3.img" -o "$D/bundles/bad.vabc" \
	--key "$WORK/key.pem" --verity --cow-compression none --release-version 3 >/dev/null
"$VABC" -q update init --store "$D/vabc" >/dev/null
DATA=$WORK/data.img
mkfs.ext4 -q -F -b 4096 -L data -E root_owner=0:0 -d "$D" "$DATA" 160M
SYS=$WORK/system.img
cp "$WORK/v1.img" "$SYS"
# The guest's binary, stripped as a device's is (a third of the size to copy at boot).
mkdir "$WORK/bin"
strip -o "$WORK/bin/vabc" "$VABC"
say "images: version 1 $V1, version 2 $V2; bundles $(stat -c %s "$D/bundles/good.vabc") and $(stat -c %s "$D/bundles/bad.vabc") bytes"

# --- One boot: ACTION for the system; with MARKER and MAX_MS, the power is cut at a
# random moment up to MAX_MS after the guest prints MARKER. Sets LOG, CUT (the cut's
# delay in ms, or empty) and the facts the guest reported.
N=0 FLAKES=0
boot() {
	local action=$1 marker=${2:-} max_ms=${3:-0}
	N=$((N + 1))
	LOG=$WORK/boot$N.log CUT= MARK=
	boot_once "$action" "$marker" "$max_ms"
	# A guest that died before the initramfs step said anything never ran vabc: the
	# emulator's fault (software emulation of a stock kernel, about one boot in a
	# few dozen, panics in early boot). That boot is made again, and counted.
	while ! grep -q '^scenario:' "$LOG" && grep -q 'Kernel panic' "$LOG" && ((FLAKES < 3)); do
		FLAKES=$((FLAKES + 1))
		say "boot $N: the guest kernel panicked before the boot step ran; booting again"
		grep -m3 -E 'Oops|RIP:|Kernel panic' "$LOG" | sed 's/^/    /' >&2
		boot_once "$action" "$marker" "$max_ms"
	done
	report_boot
}
boot_once() {
	local action=$1 marker=$2 max_ms=$3
	CUT= MARK=
	# One vCPU: the scenario is sequential, and a single emulated CPU cannot race
	# the kernel's live code patching (the cause of those panics under multi-threaded
	# emulation).
	# A boot to be cut writes at a slow eMMC's pace; one that runs its course need not.
	local opts=cache=directsync
	[ -z "$marker" ] || opts=$opts,throttling.bps-write=$((1 << 20))
	"$HERE/run.sh" --smp 1 --timeout 600 --disk "$SYS,$opts" --disk "$DATA,$opts" \
		--share "$WORK/bin" --share "$WORK/keys" -- \
		bash "$HERE/guest-device.sh" "$WORK/bin/vabc" "$action" >"$LOG" 2>&1 &
	local pid=$!
	if [ -n "$marker" ]; then
		while kill -0 $pid 2>/dev/null && ! grep -sEq "scenario: ($marker)" "$LOG"; do sleep 0.05; done
		if kill -0 $pid 2>/dev/null; then
			MARK=$(grep -Eo "scenario: ($marker)" "$LOG" | head -1 | sed 's/^scenario: //')
			CUT=$((RANDOM % (max_ms + 1)))
			sleep "$(printf '%d.%03d' $((CUT / 1000)) $((CUT % 1000)))"
			pkill -KILL -f "file=$SYS," || true
		fi
	fi
	wait $pid || true
}
report_boot() {
	BOOTED=$(grep -m1 'scenario: booted:' "$LOG" || true)
	ROOTSHA=$(grep -m1 'scenario: root-sha256' "$LOG" | awk '{print $3}' || true)
	VERSION=$(echo "$BOOTED" | sed -n 's/.* version \([0-9]*\) .*/\1/p')
	# The state the boot found (stage 1, before acting on it).
	STATE=$(sed -n 's/^scenario: initramfs: state \([a-z-]*\).*/\1/p' "$LOG" | head -1)
	ROOTDEV=$(echo "$BOOTED" | sed -n 's/.*booted: root \([^ ]*\) .*/\1/p')
	echo "boot $N ($action${CUT:+, power cut ${CUT} ms after \"$MARK\"}): found state ${STATE:-?}; root ${ROOTDEV:-?}, version ${VERSION:-?}"
	grep -E 'scenario: (install-done|merged|merge-start|read during|health-failed|corrupt-block|end:|initramfs|step|noublk|nostore|swapcow)|vabc update boot:|vabc-boot:' "$LOG" | sed 's/^/    /' || true
	if [ -z "$BOOTED" ] && [ -z "$CUT" ] && ! grep -q 'scenario: initramfs: halted' "$LOG"; then
		fail "boot $N did not reach its system:"
		tail -30 "$LOG" >&2
	fi
}
# One halting boot step's lines of the boot's log (from its "step NAME" line to the
# next).
step() { # NAME
	awk -v s="scenario: step $1" '$0 == s { on = 1; next } /^scenario: step / { on = 0 } on' "$LOG"
}
# Checks a boot that reached its system (one cut before that has nothing to check:
# the boot after it tells what the cut left).
expect() { # WHAT VERSION SHA
	[ -n "$BOOTED" ] || return 0
	[ "$VERSION" = "$2" ] || fail "boot $N ($1): version ${VERSION:-?}, expected $2"
	# A cut may land after the system came up but before it had read its root whole.
	[ -z "$ROOTSHA" ] && [ -n "$CUT" ] && return 0
	[ "$ROOTSHA" = "$3" ] || fail "boot $N ($1): the root device reads as ${ROOTSHA:-?}, expected $3"
}

# A power cut's outcome, told by the boot after it: the state it came up in.
CUTS=()
record_cut() { # WHAT PREV_CUT PREV_MARK
	[ -n "$2" ] || return 0
	CUTS+=("$1 cut ${2} ms after \"$3\": the next boot found state $STATE and ran ${ROOTDEV:-(cut again before its system came up)}${VERSION:+ (version $VERSION)}")
}

# Whether the cuts that landed, with the last boot's (told by the next boot), fall
# short of N, with tries left.
short_of() { # N
	((landed + (${#prev} > 0) < $1 && tries < $1 * 3))
}

# --- 1. Install, cut at random moments: until the install is done, every boot runs
# the old system, and the install resumes.
landed=0 tries=0 prev= prev_mark=
while :; do
	if short_of "$INSTALL_CUTS"; then
		tries=$((tries + 1))
		# The cut lands after the state file says installing (the guest's marker), so
		# it always leaves a begun install; a window short against the install's
		# writes (the data disk throttled too) leaves most of it for later cuts.
		boot install-good installing 1500
	else
		boot install-good
	fi
	record_cut install "$prev" "$prev_mark"
	if [ "$STATE" = installed ]; then
		# The install finished before the power went: this boot runs the new system.
		expect "first boot of the update" 2 "$V2"
		break
	fi
	[ -n "$prev" ] && [ "$STATE" = installing ] && landed=$((landed + 1))
	expect "installing" 1 "$V1"
	case $STATE in none | installing) ;; *) fail "boot $N: state $STATE while installing" ;; esac
	prev=$CUT prev_mark=$MARK
	if [ -z "$CUT" ]; then
		# Installed: the next boot, the merge's first, is the update's first boot.
		grep -q 'scenario: install-done rc=0 state installed' "$LOG" || fail "boot $N: the install did not finish"
		break
	fi
	((N < 40)) || { fail "no end to the install"; break; }
done
INSTALL_LANDED=$landed
# The merge makes up what the install left short of 10 cuts: an install that ran
# faster than planned ends with fewer of its own.
MERGE_CUTS=$((MERGE_CUTS > 10 - INSTALL_LANDED ? MERGE_CUTS : 10 - INSTALL_LANDED))

# --- 2. The new system, marked good; the merge cut at random moments: every boot
# runs the new system (served, verified), and the merge resumes.
landed=0 tries=0 prev= prev_mark=
while :; do
	if [ -n "$prev" ] && [ -z "${HALTED:-}" ]; then
		# After a cut mid-merge, one boot runs three boot steps that must mount no root
		# (the half-merged base least of all) and write nothing.
		before=$(sha "$SYS")
		boot halts
		if [ "$STATE" = merging ]; then
			HALTED=1
			# Without the ublk driver: the update cannot be served.
			step noublk | grep -q 'scenario: noublk: halted: no root (exit 4' ||
				fail "boot $N: merging without ublk did not halt"
			# The data disk unreadable: the state is unknown.
			step nostore | grep -q 'scenario: nostore: halted: no root (exit 4' &&
				step nostore | grep -q "vabc-boot: cannot mount the store's partition /dev/mapper/vabc-nostore" ||
				fail "boot $N: an unreadable store partition did not halt the boot"
			# The COW altered on the data disk after mark-good: not merged.
			step swapcow | grep -q 'scenario: swapcow: halted: no root (exit 4' &&
				step swapcow | grep -q 'altered after it was installed' &&
				grep -q 'scenario: swapcow: the COW put back' "$LOG" ||
				fail "boot $N: a COW altered after mark-good was not refused"
			[ -z "$BOOTED" ] || fail "boot $N: a boot step that should have halted mounted $ROOTDEV"
			grep -q 'scenario: initramfs: halted (noublk, nostore, swapcow)' "$LOG" ||
				fail "boot $N: the halting boot steps did not all run"
			[ "$(sha "$SYS")" = "$before" ] || fail "boot $N: the base changed in boot steps that halted"
		fi
	fi
	if short_of "$MERGE_CUTS"; then
		tries=$((tries + 1))
		if ((tries == 1)); then
			# The boot that marks the update good reads its root whole while the merge
			# runs, and is cut soon after that read: a resumed merge can end in the
			# initramfs, before a later system reads anything.
			boot run "read during the merge" 3000
		else
			# A fresh merge starts after mark-good; a resumed one when the daemon starts.
			boot run "merge-start|initramfs: state merging" 10000
		fi
	else
		boot run
	fi
	record_cut merge "$prev" "$prev_mark"
	if [ "$STATE" = merged ] || [ "$STATE" = none ]; then
		# Merged before the power went: this boot mounts the base, the new image.
		expect "after the merge" 2 "$V2"
		[ "$ROOTDEV" = /dev/vda ] || fail "boot $N: root $ROOTDEV after the merge, expected the base /dev/vda"
		break
	fi
	[ -n "$prev" ] && [ "$STATE" = merging ] && landed=$((landed + 1))
	expect "new system" 2 "$V2"
	[ -z "$BOOTED" ] || [ "$ROOTDEV" = /dev/mapper/vabc-system ] || fail "boot $N: root $ROOTDEV is not the served, verified update"
	if grep -q 'scenario: read during the merge' "$LOG"; then
		grep -q "scenario: read during the merge: root-sha256 $V2 " "$LOG" ||
			fail "boot $N: the root read during the merge is not the new image"
		grep -q "scenario: read during the merge: .*(state merging when it ended)" "$LOG" &&
			READ_DURING=1
	fi
	prev=$CUT prev_mark=$MARK
	if [ -z "$CUT" ]; then
		# Merged: the next boot (the bad update's install) mounts the base.
		grep -q "scenario: end: state merged" "$LOG" || fail "boot $N: the merge did not finish"
		break
	fi
	((N < 80)) || { fail "no end to the merge"; break; }
done
MERGE_LANDED=$landed
[ -n "${READ_DURING:-}" ] || fail "no boot read its root whole while the merge ran"

# --- 3. Merged: the base is the new image, the store clean; install the bad update.
boot install-bad
expect "merged" 2 "$V2"
[ "$ROOTDEV" = /dev/vda ] || fail "boot $N: root $ROOTDEV after the merge, expected the base /dev/vda"
grep -q 'scenario: store: state state.copy version$' "$LOG" || fail "boot $N: the store was not cleaned after the merge"
[ "$(sha "$SYS")" = "$V2" ] || fail "the system disk is not version 2 after the merge"
grep -q 'scenario: install-done rc=0 state installed' "$LOG" || fail "boot $N: the bad update did not install"

# --- 4. The bad update: two failed boots; its COW altered on the data disk (during
# the second), so the third boot does not serve it; then the rollback.
boot run
[ "$VERSION" = 3 ] && grep -q 'scenario: health-failed' "$LOG" || fail "boot $N: the bad update did not boot and fail"
boot corrupt
[ "$VERSION" = 3 ] || fail "boot $N: version $VERSION, expected the bad update's 3"
grep -Eq 'scenario: corrupt-block [0-9]+: read failed with EIO .*; blocks [0-9]+ and [0-9]+ read$' "$LOG" ||
	fail "boot $N: an altered COW block was served, or failed otherwise, or took its neighbours along"
boot run
expect "an altered COW not booted" 2 "$V2"
[ "$ROOTDEV" = /dev/vda ] && grep -q 'altered after it was installed' "$LOG" ||
	fail "boot $N: the altered COW was not refused (root $ROOTDEV)"
boot run
expect "rolled back" 2 "$V2"
[ "$ROOTDEV" = /dev/vda ] && grep -q 'scenario: end: state none' "$LOG" ||
	fail "boot $N: not rolled back to the base (root $ROOTDEV)"
grep -q 'vabc update boot: .*rolled back' "$LOG" || fail "boot $N: the boot did not say it rolled back"
grep -q 'scenario: store: state state.copy version$' "$LOG" || fail "boot $N: the store was not freed by the rollback"
[ "$(sha "$SYS")" = "$V2" ] || fail "the system disk is not version 2 after the rollback"
[ -n "${HALTED:-}" ] || fail "no boot found the merge under way without ublk (no halt was checked)"

echo "power cuts and what the next boot recovered:"
for c in "${CUTS[@]}"; do echo "    $c"; done
say "$N boots ($FLAKES made again after the emulated kernel panicked before the boot step); power cuts that landed mid-install: $INSTALL_LANDED, mid-merge: $MERGE_LANDED"
((INSTALL_LANDED + MERGE_LANDED >= 10)) || fail "only $((INSTALL_LANDED + MERGE_LANDED)) power cuts landed mid-operation (10 wanted)"
if ((FAILED)); then
	say "$FAILED check(s) FAILED"
	exit 1
fi
say "PASS"
