#!/usr/bin/env bash
# Crash consistency write by write: one update's install and merge (two partitions,
# system and vendor) run in the VM on a disk logged by the kernel's log-writes target
# (guest-crash.sh), then, on this machine, every disk state a power cut could have
# left is made from the log and recovered:
#
#   tests/vm/crash.sh [--points N|all] [--random N] [--seed S] [--log DIR] [--jobs N]
#                     [--kills N]
#
# States (vabc-crashreplay plan): the clean cuts at the durable points (after each
# flush and FUA write: --points all, or N of them evenly spread) and --random cuts in
# between, where each write the disk had acknowledged but not flushed was kept, lost
# or torn by sector. For each state the partitions go on loop devices (named by the
# device nodes the guest used, so the store's base paths hold), the data partition is
# mounted (ext4 replays its journal), and the device boots as its initramfs would
# (vabc update boot, FUSE here): it must boot, and both partitions must be version 1
# or both version 2, byte for byte. Then the update is carried on to its end as the
# device would: an interrupted install run again, mark-good, the merge (resumed
# where it was), the boot after it: both bases must then be version 2 exactly and
# the store clean.
# --kills N: after the log ends, the recording boot also kills the serving daemon N
# times while the new system reads it, by SIGKILL and by the OOM killer in turn
# (guest-crash.sh says how); reads must fail or be right, and each next boot serve
# the update again.
# --log DIR keeps (or reuses) the recorded run there: the guest boot is skipped when
# DIR holds one. --jobs N checks N states at a time (default: one per CPU), each
# worker in a mount namespace of its own where the device nodes name its own loop
# devices. Prints a table by phase; exit status 0 when every state recovered.
# Env: VABC (default target/debug/vabc), VABC_CRASHREPLAY (default
#      target/debug/vabc-crashreplay), TMPDIR.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
POINTS=all RANDOM_STATES=0 SEED=1 LOGDIR= JOBS=$(nproc) WORKER= KILLS=0
while (($#)); do
	case $1 in
	--jobs) JOBS=$2; shift 2 ;;
	--worker) WORKER=$2; shift 2 ;;
	--points) POINTS=$2; shift 2 ;;
	--random) RANDOM_STATES=$2; shift 2 ;;
	--seed) SEED=$2; shift 2 ;;
	--log) LOGDIR=$2; shift 2 ;;
	--kills) KILLS=$2; shift 2 ;;
	*) sed -n '2,30p' "$0" >&2; exit 2 ;;
	esac
done
VABC=$(realpath "${VABC:-$ROOT/target/debug/vabc}")
REPLAY=$(realpath "${VABC_CRASHREPLAY:-$ROOT/target/debug/vabc-crashreplay}")
for b in "$VABC" "$REPLAY"; do
	[ -x "$b" ] || { echo "crash: no binary at $b (build it first)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "crash: loop devices and mounts need root" >&2; exit 1; }
say() { echo "crash: $*" >&2; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
MIB=$((1 << 20))
SYS_BYTES=$((16 * MIB)) VEN_BYTES=$((8 * MIB)) DATA_BYTES=$((48 * MIB))
LOOPS=() STUCK=0
teardown() {
	local r pids=()
	for r in "$S"/run/*.ready; do
		[ -e "$r" ] || continue
		pids+=("$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' "$r")")
		rm -f "$r"
	done
	# All stopped at once (a shutdown), then waited for.
	((${#pids[@]})) && kill -TERM "${pids[@]}" 2>/dev/null
	local waited=0
	for r in "${pids[@]}"; do
		while kill -0 "$r" 2>/dev/null && ((waited++ < 1500)); do sleep 0.02; done
		kill -0 "$r" 2>/dev/null && { say "daemon $r ignored SIGTERM for 30 s"; kill -KILL "$r"; STUCK=1; }
	done
	mountpoint -q "$S/mnt" 2>/dev/null && umount "$S/mnt"
	for r in "${LOOPS[@]}"; do losetup -d "$r" 2>/dev/null || true; done
	LOOPS=()
}
# --- One state: made, booted, carried on to the end.
SYSDEV=/dev/vabc-crash/system VENDEV=/dev/vabc-crash/vendor
mknode() { # DEVICE NODE: NODE names DEVICE
	local major minor
	read -r major minor < <(stat -L -c '%t %T' "$1")
	mknod "$2" b $((16#$major)) $((16#$minor))
}
# A boot: the partitions on loop devices at their offsets, the data partition mounted.
power_on() {
	local sys ven data
	sys=$(losetup -f --show -o 0 --sizelimit "$SYS_BYTES" "$S/disk.img") && LOOPS+=("$sys")
	ven=$(losetup -f --show -o "$SYS_BYTES" --sizelimit "$VEN_BYTES" "$S/disk.img") && LOOPS+=("$ven")
	data=$(losetup -f --show -o $((SYS_BYTES + VEN_BYTES)) --sizelimit "$DATA_BYTES" "$S/disk.img") && LOOPS+=("$data")
	rm -f "$SYSDEV" "$VENDEV"
	mknode "$sys" "$SYSDEV" && mknode "$ven" "$VENDEV" || { WHY="cannot make the device nodes"; return 1; }
	mkdir -p "$S/mnt"
	mount "$data" "$S/mnt" || { WHY="the data partition does not mount"; return 1; }
}
B=(-b "system=$SYSDEV" -b "vendor=$VENDEV")
# The boot step; sets BOOTED (v1, v2, or what it found) and STATE.
boot_step() {
	local out rc=0
	out=$("$VABC" update boot --store "$S/mnt/vabc" "${B[@]}" --key "$WORK/keys/pub.pem" --frontend fuse \
		--run-dir "$S/run" --json 2>"$S/boot.err") || rc=$?
	if ((rc != 0)); then
		WHY="the boot step failed (exit $rc): $(tr '\n' ' ' <"$S/boot.err")"
		return 1
	fi
	local sdev vdev
	read -r STATE sdev vdev < <(echo "$out" | python3 -c '
import json, sys
b = json.load(sys.stdin)
d = {p["name"]: p["device"] for p in b["partitions"]}
print(b["state"], d.get("system", "-"), d.get("vendor", "-"))')
	local s v
	s=$(sha "$sdev") v=$(sha "$vdev")
	local sv vv
	sv=$(version_of "$s" SYSTEM) vv=$(version_of "$v" VENDOR)
	# Both partitions of one version, and one this part of the run may boot.
	if [ "$sv" = "$vv" ] && [[ " $ALLOWED " == *" v$sv "* ]]; then
		BOOTED=v$sv
	else
		BOOTED="system $sv and vendor $vv"
		WHY="booted $BOOTED (state $STATE; only both at one of $ALLOWED may boot)"
		return 1
	fi
}
version_of() { # SHA NAME: 1, 2, 3 or "neither version"
	local n v
	for n in 1 2 3; do
		v=V${n}_$2
		[ "$1" = "${!v}" ] && { echo $n; return; }
	done
	echo "neither version"
}
# The store's state, read as `vabc update status` reports it (its JSON has one key per
# line; the top-level "state" is indented by two).
status_state() { "$VABC" update status --store "$S/mnt/vabc" --json | sed -n 's/^  "state": "\([a-z-]*\)".*/\1/p'; }
power_off() { teardown; }
# The rest of the update's life from what the first boot found.
carry_on() {
	local t0
	case $(status_state) in
	none)
		# Nothing installed (before the install began, or after the clean-up).
		[ "$BOOTED" = v2 ] && return 0
		;&
	installing)
		power_off && power_on || return 1
		"$VABC" -q update install --store "$S/mnt/vabc" "$S/mnt/bundles/u.vabc" "${B[@]}" \
			--key "$WORK/keys/pub.pem" --max-boot-attempts 3 >/dev/null 2>"$S/install.err" ||
			{ WHY="the install run again failed: $(tr '\n' ' ' <"$S/install.err")"; return 1; }
		power_off && power_on && boot_step || return 1
		[ "$BOOTED" = v2 ] || { WHY="the boot after the install ran $BOOTED"; return 1; }
		;;
	esac
	if [ "$(status_state)" = installed ]; then
		"$VABC" -q update mark-good --store "$S/mnt/vabc" --key "$WORK/keys/pub.pem" --run-dir "$S/run" >/dev/null 2>"$S/mg.err" ||
			{ WHY="mark-good failed: $(tr '\n' ' ' <"$S/mg.err")"; return 1; }
	fi
	t0=$SECONDS
	while [ "$(status_state)" = merging ]; do
		((SECONDS - t0 < 120)) || { WHY="the merge did not end"; return 1; }
		sleep 0.1
	done
	power_off && power_on && boot_step || return 1
	[ "$BOOTED" = v2 ] && [ "$(status_state)" = none ] ||
		{ WHY="after the merge: booted $BOOTED, state $(status_state)"; return 1; }
	[ "$(sha "$SYSDEV")" = "$V2_SYSTEM" ] && [ "$(sha "$VENDEV")" = "$V2_VENDOR" ] ||
		{ WHY="after the merge the bases are not version 2"; return 1; }
}
# The second update, rolled back: what the device does next from what the first boot
# found is the rollback, run again or finished; it must end in version 2.
carry_on_rollback() {
	case $(status_state) in
	installing | installed)
		"$VABC" -q update rollback --store "$S/mnt/vabc" >/dev/null 2>"$S/rb.err" ||
			{ WHY="rollback failed: $(tr '\n' ' ' <"$S/rb.err")"; return 1; }
		power_off && power_on && boot_step || return 1
		;;
	none) ;;
	*) WHY="state $(status_state) in an update that was never marked good"; return 1 ;;
	esac
	[ "$BOOTED" = v2 ] && [ "$(status_state)" = none ] ||
		{ WHY="after the rollback: booted $BOOTED, state $(status_state)"; return 1; }
	[ "$(sha "$SYSDEV")" = "$V2_SYSTEM" ] && [ "$(sha "$VENDEV")" = "$V2_VENDOR" ] ||
		{ WHY="after the rollback the bases are not version 2"; return 1; }
}
check_state() { # ID PHASE
	WHY= BOOTED= STATE= STUCK= FIRST=
	rm -rf "$S" && mkdir -p "$S/run"
	"$REPLAY" make "$LOG" --device "$DISK0" --state "$1" -o "$S/disk.img" || { WHY="cannot make the state"; return 1; }
	local r=0 next=carry_on
	ALLOWED="v1 v2"
	case $2 in rb-* | end | dm-log-writes-end) ALLOWED="v2 v3" next=carry_on_rollback ;; esac
	power_on && boot_step || r=1
	FIRST=$BOOTED
	((r == 0)) && { $next || r=1; }
	power_off
	((STUCK)) && { WHY="${WHY:+$WHY; }a daemon did not stop on SIGTERM"; r=1; }
	return $r
}

# --- A worker (--worker I): the states of plan.I, one result line each in results.I
# (id, phase, ok or FAIL, what the first boot ran, why it failed).
if [ -n "$WORKER" ]; then
	S=$WORK/state.$WORKER
	trap teardown EXIT
	while IFS=$'\t' read -r id phase; do
		if check_state "$id" "$phase" </dev/null; then
			printf '%s\t%s\tok\t%s\t\n' "$id" "$phase" "$FIRST"
		else
			printf '%s\t%s\tFAIL\t%s\t%s\n' "$id" "$phase" "$FIRST" "$WHY"
		fi
	done < <(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    s = json.loads(line)
    print(s["id"], s["phase"] or "-", sep="\t")' "$WORK/plan.$WORKER") >"$WORK/results.$WORKER"
	exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/vabc-crash.XXXXXX")
cleanup() {
	local rc=$?
	rm -f /dev/vabc-crash/system /dev/vabc-crash/vendor
	rmdir /dev/vabc-crash 2>/dev/null || true
	rm -rf "$WORK"
	exit $rc
}
# The device nodes name the partitions on both sides: one run at a time.
exec 8>"${TMPDIR:-/tmp}/vabc-crash.lock"
flock -n 8 || { say "another crash.sh runs"; exit 1; }

trap cleanup EXIT

# --- The update: two partitions of words (compressible, like a system's files),
# version 2 rewriting a third of each.
mkdir -p "$WORK/img" "$WORK/keys" "$WORK/data/bundles" "$WORK/bin"
python3 - "$WORK/img" "$SYS_BYTES" "$VEN_BYTES" "$HERE" <<-'PY'
	import sys
	d, sys_len, ven_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
	sys.dont_write_bytecode = True  # nothing written into the source tree
	sys.path.insert(0, sys.argv[4])
	from words import text
	for name, n, seed in (("system", sys_len, 1), ("vendor", ven_len, 2)):
	    v1 = bytearray(text(seed, n))
	    v2 = bytearray(v1)
	    v2[n // 3 : 2 * n // 3] = text(seed + 10, 2 * n // 3 - n // 3)
	    v3 = bytearray(v2)
	    v3[2 * n // 3 :] = text(seed + 20, n - 2 * n // 3)
	    open(f"{d}/{name}.v1", "wb").write(v1)
	    open(f"{d}/{name}.v2", "wb").write(v2)
	    open(f"{d}/{name}.v3", "wb").write(v3)
PY
V1_SYSTEM=$(sha "$WORK/img/system.v1") V2_SYSTEM=$(sha "$WORK/img/system.v2")
V1_VENDOR=$(sha "$WORK/img/vendor.v1") V2_VENDOR=$(sha "$WORK/img/vendor.v2")
V3_SYSTEM=$(sha "$WORK/img/system.v3") V3_VENDOR=$(sha "$WORK/img/vendor.v3")
openssl genpkey -algorithm ed25519 -out "$WORK/key.pem" 2>/dev/null
openssl pkey -in "$WORK/key.pem" -pubout -out "$WORK/keys/pub.pem"
BUNDLE=$WORK/data/bundles/u.vabc
"$VABC" -q bundle create -p "system=$WORK/img/system.v1,$WORK/img/system.v2" \
	-p "vendor=$WORK/img/vendor.v1,$WORK/img/vendor.v2" -o "$BUNDLE" \
	--key "$WORK/key.pem" --verity --release-version 2 >/dev/null
"$VABC" -q bundle create -p "system=$WORK/img/system.v2,$WORK/img/system.v3" \
	-p "vendor=$WORK/img/vendor.v2,$WORK/img/vendor.v3" -o "$WORK/data/bundles/u3.vabc" \
	--key "$WORK/key.pem" --verity --release-version 3 >/dev/null
"$VABC" -q update init --store "$WORK/data/vabc" >/dev/null
cat >"$WORK/layout.env" <<-EOF
	SYS_BYTES=$SYS_BYTES VEN_BYTES=$VEN_BYTES DATA_BYTES=$DATA_BYTES
	V2_SYSTEM=$V2_SYSTEM V2_VENDOR=$V2_VENDOR V3_SYSTEM=$V3_SYSTEM V3_VENDOR=$V3_VENDOR
EOF

# --- The recorded run (or the one --log holds).
if [ -n "$LOGDIR" ] && [ -e "$LOGDIR/log.img" ]; then
	say "the recorded run in $LOGDIR"
	cp "$LOGDIR/layout.env" "$WORK/layout.env"
	cp "$LOGDIR/pub.pem" "$WORK/keys/pub.pem"
	# shellcheck disable=SC1091
	source "$WORK/layout.env"
	DISK0=$LOGDIR/disk.orig LOG=$LOGDIR/log.img
	V1_SYSTEM=$(sed -n 's/^V1_SYSTEM=//p' "$LOGDIR/shas") V1_VENDOR=$(sed -n 's/^V1_VENDOR=//p' "$LOGDIR/shas")
else
	truncate -s "$DATA_BYTES" "$WORK/data.img"
	mkfs.ext4 -q -F -b 4096 -L data -E root_owner=0:0 -d "$WORK/data" "$WORK/data.img"
	DISK0=$WORK/disk.orig LOG=$WORK/log.img
	cat "$WORK/img/system.v1" "$WORK/img/vendor.v1" "$WORK/data.img" >"$DISK0"
	cp "$DISK0" "$WORK/disk.img"
	truncate -s 1G "$LOG"
	strip -o "$WORK/bin/vabc" "$VABC"
	say "recording the install and the merge in the VM"
	t0=$SECONDS
	"$HERE/run.sh" --smp 1 --timeout 900 --disk "$WORK/disk.img,cache=unsafe" \
		--disk "$LOG,cache=unsafe" --share "$WORK:rw" -- \
		bash "$HERE/guest-crash.sh" "$WORK/bin/vabc" "$WORK" "$KILLS" >"$WORK/guest.log" 2>&1 ||
		{ grep -E 'crash-guest|vabc|Oops|panic' "$WORK/guest.log" | tail -30 >&2; say "FAIL: the recorded run failed"; exit 1; }
	grep 'crash-guest:' "$WORK/guest.log" | sed 's/^/    /' >&2
	say "recorded in $((SECONDS - t0)) s"
	if [ -n "$LOGDIR" ]; then
		mkdir -p "$LOGDIR"
		cp --sparse=always "$LOG" "$LOGDIR/log.img"
		cp --sparse=always "$DISK0" "$LOGDIR/disk.orig"
		cp "$WORK/layout.env" "$LOGDIR/"
		cp "$WORK/keys/pub.pem" "$LOGDIR/"
		printf 'V1_SYSTEM=%s\nV1_VENDOR=%s\n' "$V1_SYSTEM" "$V1_VENDOR" >"$LOGDIR/shas"
	fi
fi
"$REPLAY" info "$LOG" >"$WORK/info.json"
python3 - "$WORK/info.json" >&2 <<-'PY'
	import json, sys
	i = json.load(open(sys.argv[1]))
	marks = ", ".join(f"{n} at {e}" for n, e in i["marks"])
	print(f"crash: the log: {i['entries']} entries, {i['writes']} writes ({i['written_bytes'] >> 20} MiB), "
	      f"{i['flushes']} flushes, {i['fua']} FUA writes, {i['durable_points']} durable points; marks: {marks}")
	PY


"$REPLAY" plan "$LOG" --points "$POINTS" --random "$RANDOM_STATES" --seed "$SEED" >"$WORK/plan"
say "$(wc -l <"$WORK/plan") states to check"
# Each worker gets every JOBS-th state; the device nodes (one name each, which the
# store's base paths hold) live in its own mount namespace.
((JOBS >= 1)) || JOBS=1
for ((i = 0; i < JOBS; i++)); do
	awk -v j="$JOBS" -v i=$i 'NR % j == i' "$WORK/plan" >"$WORK/plan.$i"
done
export WORK LOG DISK0 V1_SYSTEM V1_VENDOR V2_SYSTEM V2_VENDOR V3_SYSTEM V3_VENDOR SYS_BYTES VEN_BYTES DATA_BYTES VABC REPLAY
mkdir -p /dev/vabc-crash
t0=$SECONDS pids=()
for ((i = 0; i < JOBS; i++)); do
	unshare -m --propagation private sh -c 'mount -t tmpfs -o mode=0755 vabc-crash /dev/vabc-crash && exec "$@"' \
		sh "$0" --worker $i </dev/null &
	pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || say "a worker failed (exit $?)"; done
declare -A N OK V1 V2 V3 RND
FAILS=0 CHECKED=0
while IFS=$'\t' read -r id phase result first why; do
	CHECKED=$((CHECKED + 1))
	N[$phase]=$((${N[$phase]:-0} + 1))
	# Random cuts (ids r...) as against the durable points (p...).
	[[ $id == r* ]] && RND[$phase]=$((${RND[$phase]:-0} + 1))
	if [ "$result" = ok ]; then
		OK[$phase]=$((${OK[$phase]:-0} + 1))
		case $first in
		v1) V1[$phase]=$((${V1[$phase]:-0} + 1)) ;;
		v2) V2[$phase]=$((${V2[$phase]:-0} + 1)) ;;
		v3) V3[$phase]=$((${V3[$phase]:-0} + 1)) ;;
		esac
	else
		FAILS=$((FAILS + 1))
		say "FAIL: state $id (phase $phase): $why"
	fi
done < <(cat "$WORK"/results.* 2>/dev/null)
PLANNED=$(wc -l <"$WORK/plan")
say "checked $CHECKED states in $((SECONDS - t0)) s ($JOBS at a time)"
((CHECKED == PLANNED && PLANNED > 0)) || { say "FAIL: $PLANNED states planned, $CHECKED checked"; exit 1; }
printf '%-18s %7s %7s %7s %9s %9s %9s\n' phase states random ok "boots v1" "boots v2" "boots v3"
order=(- install boot mark-good merge merged cleanup rb-install rb-boot rb-rollback rb-cleanup end dm-log-writes-end)
for key in "${order[@]}" "${!N[@]}"; do
	[ -n "${N[$key]:-}" ] || continue
	printf '%-18s %7d %7d %7d %9d %9d %9d\n' "$key" "${N[$key]}" "${RND[$key]:-0}" "${OK[$key]:-0}" "${V1[$key]:-0}" "${V2[$key]:-0}" "${V3[$key]:-0}"
	unset "N[$key]"
done
if ((FAILS)); then
	say "FAIL: $FAILS states did not recover"
	exit 1
fi
say "PASS: every state booted one version of both partitions (1 or 2; 2 or 3 in the rolled-back update) and ended in version 2"
