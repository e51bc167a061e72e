#!/usr/bin/env bash
# Install everything, build vabc, and walk through an update end to end on a
# small generated image pair: write a COW with the library, inspect it,
# apply it (base + COW -> new image) and check the result.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh
cargo build --release -q -p vabc
cargo build --release -q -p cow --example make_bench_cow
VABC=target/release/vabc
WORK=${DEMO_DIR:-${TMPDIR:-/tmp}/vabc-demo}
rm -rf "$WORK"
mkdir -p "$WORK"

step() { printf '\n== %s\n' "$*"; }

step "1. Generate an old image and a new one (16 MiB), and a COW (v3, lz4, 64 KiB units) between them"
target/release/examples/make_bench_cow "$WORK" 16 lz4

step "2. Inspect the COW"
$VABC inspect "$WORK/update-lz4.cow" --verify-merge

step "3. Apply it: the snapshot view (old + COW) written to new.img"
$VABC apply --base "$WORK/base.img" --cow "$WORK/update-lz4.cow" -o "$WORK/applied.img"

step "4. Compare with the expected new image"
sha256sum "$WORK/new.img" "$WORK/applied.img"
cmp "$WORK/new.img" "$WORK/applied.img" && echo "identical: the update reproduces the new image"
