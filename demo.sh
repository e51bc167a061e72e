#!/usr/bin/env bash
# Install everything, build vabc, and walk an OTA update end to end on real
# data: the `tiny` corpus pair (pillow 10.2.0 -> 10.3.0 in an ext4 image).
#   1. create the update on the "build host": a signed bundle (and a dm-verity tree of
#      the new image)
#   2. install it on the "device": signature and base checked, the COW written
#   3. inspect the COW, and apply the bundle offline to compare with the new image
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

step "1. Create the update on the build host: a signing key, a signed bundle, a dm-verity tree"
[ -f "$WORK/key.pem" ] || openssl genpkey -algorithm ed25519 -out "$WORK/key.pem"
openssl pkey -in "$WORK/key.pem" -pubout -out "$WORK/pub.pem"
$VABC bundle create -p "system=$OLD,$NEW" -o "$WORK/update.vabc" --key "$WORK/key.pem"
$VABC bundle info "$WORK/update.vabc"
$VABC verity format "$NEW" "$WORK/update.verity" --json >"$WORK/verity.json"
ROOT_HASH=$(python3 -c "import json; print(json.load(open('$WORK/verity.json'))['root_hash'])")
echo "verity root hash: $ROOT_HASH"

step "2. Install it on the device: signature, base and payload checked, then the COW written"
cp "$OLD" "$WORK/device.img"
rm -rf "$WORK/ota" && mkdir -p "$WORK/ota"
$VABC bundle plan "$WORK/update.vabc" -b "system=$WORK/device.img" --key "$WORK/pub.pem"
$VABC bundle install "$WORK/update.vabc" -b "system=$WORK/device.img" -o "$WORK/ota" --key "$WORK/pub.pem"
ls -l "$WORK/update.vabc" "$WORK/ota"

step "3. Inspect the COW, and apply the bundle offline (old -> new) to compare"
$VABC inspect "$WORK/ota/system.cow" --verify-merge
rm -rf "$WORK/applied" && mkdir -p "$WORK/applied"
$VABC bundle apply "$WORK/update.vabc" -b "system=$OLD" -o "$WORK/applied" --key "$WORK/pub.pem"
cmp "$WORK/applied/system.img" "$NEW" && echo "applied image == new image"

step "4. Serve old + COW as a block device and mount the NEW filesystem from it (every block verified)"
mkdir -p "$WORK/mnt"
$VABC serve --base "$WORK/device.img" --cow "$WORK/ota/system.cow" --mount "$WORK/mnt" \
	--verity-hash "$WORK/update.verity" --root-hash "$ROOT_HASH" >"$WORK/serve.log" 2>&1 &
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
$VABC merge --base "$WORK/device.img" --cow "$WORK/ota/system.cow"
sha256sum "$WORK/device.img" "$NEW"
cmp "$WORK/device.img" "$NEW" && echo "merged device == new image"
