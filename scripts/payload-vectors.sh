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
	"testdata/cycle_nodes_product.bin 0042934c93a461f697e501de8fa65878857f21ed"
	"testdata/cycle_nodes_product_no_xor.bin 44ed4fc844c62c3e1354b0444cc209c609cb7ca7"
	"testdata/cycle_nodes_system.bin d1fc0be65024ada61f16a726f5a2fd38d781d8b2"
	"testdata/cycle_nodes_system_dlkm.bin 1e6bdb70de8c06c2a8f84be1530e8a377e9c842b"
	"testdata/cycle_nodes_system_ext.bin 80ab0494745e53b6a70d619bd422000610f3c75a"
	"testdata/cycle_nodes_vendor.bin a5f72d953dedfe096548bd43edf2c7eaf95f0717"
	"testdata/cycle_nodes_vendor_dlkm.bin 88e6afcc5f5e272af079a2ea985a6c96d0e8ce8d"
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
