#!/usr/bin/env bash
# Copies the update_engine vectors the payload tests read
# (crates/payload/tests/vectors/update_engine/, PROVENANCE.md there) from a checkout
# of Android's update_engine, checking each file's git blob id, so that what is
# committed is exactly what update_engine's own tools made. Run by hand when the
# vectors change; the tests fetch nothing.
#
#   git clone https://android.googlesource.com/platform/system/update_engine ue
#   scripts/payload-vectors.sh ue [COMMIT]
set -euo pipefail
cd "$(dirname "$0")/.."
UE=${1:?usage: scripts/payload-vectors.sh UPDATE_ENGINE_CHECKOUT [COMMIT]}
COMMIT=${2:-HEAD}
OUT=crates/payload/tests/vectors/update_engine
VECTORS=(
	"sample_images/sample_payloads.tar.xz eb589ba69937c84aa122e210ff8d710fb63ecba5"
	"sample_images/sample_images.tar.bz2 7965d8b5c12adbf105135aef1b6a438a16694dae"
	"scripts/update_payload/payload-test-key.pem 342e9237681686c4b4ee9a7ddd33ddc966807df2"
	"scripts/update_payload/payload-test-key.pub fdae963e9f649ddf61110abfe4c7b514c549916c"
	"unittest_key_EC.pem 9e65a68a3693ec8feb91b6e836409a2d498586a9"
)
for v in "${VECTORS[@]}"; do
	read -r path blob <<<"$v"
	got=$(git -C "$UE" rev-parse "$COMMIT:$path")
	if [ "$got" != "$blob" ]; then
		echo "payload-vectors: $path at $COMMIT is blob $got, not $blob" >&2
		exit 1
	fi
	git -C "$UE" cat-file blob "$blob" >"$OUT/$(basename "$path").tmp"
	mv "$OUT/$(basename "$path").tmp" "$OUT/$(basename "$path")"
	echo "payload-vectors: $OUT/$(basename "$path") ($blob)"
done
