#!/usr/bin/env bash
# Install everything, build vabc, and walk an OTA update end to end on real
# data: the `tiny` corpus pair (pillow 10.2.0 -> 10.3.0 in an ext4 image).
#   1. create the update (vabc diff, with a dm-verity tree of the new image)
#   2. inspect it
#   3. apply it offline and compare with the new image
#   4. serve base + COW: mount the new filesystem, verified, before any merge
#   5. merge it in place: the old image becomes the new one (sha256)
# Env: DEMO_DIR (work folder, default $TMPDIR/vabc-demo), VABC_CORPUS (corpus images,
# default $TMPDIR/corpus), VABC (a vabc binary to use instead of building one, e.g. the
# static one of `scripts/package.sh musl`). Downloads: Debian packages, crates, and two
# wheels from PyPI.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
scripts/install-deps.sh
if [ -z "${VABC:-}" ]; then
	echo "== building vabc (cargo build --release: about 5 minutes on 2 cores the first time)"
	cargo build --release --locked -p vabc
	VABC=${CARGO_TARGET_DIR:-$ROOT/target}/release/vabc
fi
VABC=$(realpath "$VABC")
WORK=${DEMO_DIR:-${TMPDIR:-/tmp}/vabc-demo}
CORPUS=${VABC_CORPUS:-${TMPDIR:-/tmp}/corpus}
mkdir -p "$WORK"
step() { printf '\n== %s\n' "$*"; }

step "0. Build the tiny corpus pair (ext4 images of two pillow wheels downloaded from PyPI; cached in $CORPUS)"
[ -e "$CORPUS/tiny/new.ext4.img" ] || bash "$ROOT/../shared/corpus/make-corpus.sh" -p tiny -o "$CORPUS"
OLD=$CORPUS/tiny/old.ext4.img
NEW=$CORPUS/tiny/new.ext4.img
ls -l "$OLD" "$NEW"

step "1. Create the update: vabc diff OLD NEW -o update.cow --verity"
$VABC diff "$OLD" "$NEW" -o "$WORK/update.cow" --verity --json >"$WORK/diff.json"
python3 - "$WORK/diff.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({k: d[k] for k in d if k not in ("verity",)}, indent=1)[:1500])
print("verity root hash:", d["verity"]["root_hash"])
PY
ROOT_HASH=$(python3 -c "import json; print(json.load(open('$WORK/diff.json'))['verity']['root_hash'])")

step "2. Inspect it"
$VABC inspect "$WORK/update.cow" --verify-merge

step "3. Apply it offline (old + COW -> new) and compare"
$VABC apply --base "$OLD" --cow "$WORK/update.cow" -o "$WORK/applied.img"
cmp "$WORK/applied.img" "$NEW" && echo "applied image == new image"

step "4. Serve old + COW as a block device and mount the NEW filesystem from it (every block verified)"
cp "$OLD" "$WORK/device.img"
mkdir -p "$WORK/mnt"
$VABC serve --base "$WORK/device.img" --cow "$WORK/update.cow" --mount "$WORK/mnt" \
	--verity-hash "$WORK/update.cow.verity" --root-hash "$ROOT_HASH" >"$WORK/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 100); do grep -q ready "$WORK/serve.log" 2>/dev/null && break; sleep 0.1; done
cat "$WORK/serve.log"
echo "--- build.prop of the mounted (new) system:"
cat "$WORK/mnt/build.prop"
ls "$WORK/mnt/lib/python3.11/site-packages" | head
kill -TERM $SERVE
wait $SERVE
grep -q " $WORK/mnt " /proc/mounts && { echo "still mounted!"; exit 1; }
echo "unmounted; device.img is still the old image: $(cmp -s "$WORK/device.img" "$OLD" && echo yes)"

step "5. Merge in place (io_uring, crash-safe): the old image becomes the new one"
$VABC merge --base "$WORK/device.img" --cow "$WORK/update.cow"
sha256sum "$WORK/device.img" "$NEW"
cmp "$WORK/device.img" "$NEW" && echo "merged device == new image"
