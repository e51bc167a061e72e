#!/usr/bin/env bash
# The VM tier's conformance suite: every frontend (ublk at its defaults, NBD through
# the kernel's nbd-client, the FUSE file under a loop device) on a stock Debian kernel,
# against ext4 and EROFS corpus images, one guest boot for all of it.
#
#   tests/vm/conformance.sh [--pairs "tiny"] [--fs "ext4 erofs"] [--frontends "ublk nbd fuse"]
#
# On the host it makes each update (vabc diff --verity), a second COW that serves one
# block wrong (made from the new image with that block altered, so that it decodes
# cleanly and only dm-verity can tell), and the facts the guest checks against; the
# guest (guest-conformance.sh) runs the same body for each frontend and prints one
# PASS/FAIL line per check. Exit status: 0 when every check passed.
# Env: VABC (the binary; default target/debug/vabc, as `cargo test` builds it),
#      VABC_CORPUS (corpus images; built there on first use), TMPDIR.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PAIRS=tiny FSES="ext4 erofs" FRONTENDS="ublk nbd fuse"
while (($#)); do
	case $1 in
	--pairs) PAIRS=$2; shift 2 ;;
	--fs) FSES=$2; shift 2 ;;
	--frontends) FRONTENDS=$2; shift 2 ;;
	*) sed -n '2,16p' "$0" >&2; exit 2 ;;
	esac
done
VABC=$(realpath "${VABC:-$ROOT/target/debug/vabc}")
[ -x "$VABC" ] || { echo "conformance: no vabc binary at $VABC (build it first)" >&2; exit 1; }
CORPUS=${VABC_CORPUS:-${TMPDIR:-/tmp}/corpus}

rc=0
for PAIR in $PAIRS; do
	WORK=$(mktemp -d "${TMPDIR:-/tmp}/vabc-conformance.XXXXXX")
	trap 'rm -rf "$WORK"' EXIT
	for FS in $FSES; do
		[ -e "$CORPUS/$PAIR/new.$FS.img" ] || bash "$ROOT/../shared/corpus/make-corpus.sh" -p "$PAIR" -o "$CORPUS" >&2
		OLD=$CORPUS/$PAIR/old.$FS.img NEW=$CORPUS/$PAIR/new.$FS.img
		"$VABC" diff "$OLD" "$NEW" -o "$WORK/$FS.cow" --verity --json >"$WORK/$FS.json"
		read -r SIZE ROOT_HASH < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["new_size"], d["verity"]["root_hash"])' "$WORK/$FS.json")
		# The bad block: the middle one of those the update changes, altered in a copy of
		# NEW (a data block, away from the superblock and the image's ends).
		BAD=$(python3 - "$OLD" "$NEW" <<-'PY'
			import sys
			a, b = (open(p, "rb").read() for p in sys.argv[1:3])
			n = min(len(a), len(b)) // 4096
			changed = [i for i in range(1, n - 1) if a[i * 4096:(i + 1) * 4096] != b[i * 4096:(i + 1) * 4096]]
			print(changed[len(changed) // 2])
		PY
		)
		cp "$NEW" "$WORK/$FS.bad.img"
		printf 'corrupted by the conformance suite' |
			dd of="$WORK/$FS.bad.img" bs=1 seek=$((BAD * 4096 + 100)) conv=notrunc status=none
		"$VABC" diff "$OLD" "$WORK/$FS.bad.img" -o "$WORK/$FS.bad.cow" >/dev/null
		rm "$WORK/$FS.bad.img"
		cat >"$WORK/$FS.env" <<-ENV
			SIZE=$SIZE
			SHA=$(sha256sum "$NEW" | cut -d' ' -f1)
			ROOT_HASH=$ROOT_HASH
			BAD_BLOCK=$BAD
			FSTYPE=$FS
			OLD_IMG=$OLD
			NEW_IMG=$NEW
		ENV
	done
	echo "conformance: pair $PAIR, file systems $FSES, frontends $FRONTENDS" >&2
	# A guest that died before the suite said anything never ran vabc: the emulator's
	# fault (software emulation of a stock kernel with two vCPUs panics in early boot,
	# about one boot in a few dozen). That boot is made again, at most twice, and said.
	for attempt in 1 2 3; do
		r=0
		"$HERE/run.sh" --share "$WORK:rw" --share "$CORPUS/$PAIR" --share "$(dirname "$VABC")" -- \
			bash "$HERE/guest-conformance.sh" "$VABC" "$WORK" "$FRONTENDS" "$FSES" 2>&1 |
			tee "$WORK/guest.log" || r=$?
		if ((attempt < 3)) && ! grep -qE '^(PASS|FAIL) ' "$WORK/guest.log" &&
			grep -q 'Kernel panic' "$WORK/guest.log"; then
			echo "conformance: the guest kernel panicked before the suite ran (attempt $attempt); booting again" >&2
			continue
		fi
		break
	done
	((r == 0)) || rc=$r
	rm -rf "$WORK"
done
exit $rc
