#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit, property, interop and
# integration tests (some mount real filesystems: run as root on Linux).
# CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
