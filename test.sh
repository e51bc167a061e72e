#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit, property, interop and
# integration tests (some mount real filesystems: run as root on Linux), the
# packages (.deb and static binary, installed in a fresh chroot), then the VM
# tier: every frontend on a stock kernel with ublk, NBD and device-mapper, the
# packaged unit under systemd, then the device scenario (boots from base + COW,
# power cuts, rollback), a real Debian system's updates under systemd and the crash
# states of a logged install and merge (tests/vm/, 20 to 28 minutes under software
# emulation; the whole suite 38 to 53 on a clean 2-core machine; each step's time is
# said at the end).
# CI runs exactly this (.ci/run). VABC_SKIP_VM=1 leaves the VM tier out (it
# then says so).
set -euo pipefail
cd "$(dirname "$0")"
# A full disk shows up as one test's ENOSPC minutes in; say it first. A clean run
# (build with line tables, no incremental caches: .ci/run) left a 1.9 GiB target
# folder (0.65 of it the static build), with the test corpus (0.4 GiB) and the
# package test's minimal Debian (0.2 GiB) besides: 4 GiB leaves room.
for dir in "${CARGO_TARGET_DIR:-target}" "${TMPDIR:-/tmp}"; do
	d=$dir
	while [ ! -d "$d" ]; do d=$(dirname "$d"); done
	free=$(df --output=avail -B1M "$d" | tail -1 | tr -d " ")
	if ((free < 4096)); then
		echo "test.sh: only $free MiB free for $dir; the suite needs about 3 GiB there, 4 to be safe" >&2
		exit 1
	fi
done
# Each step's time, said at the end (a failure's too): the suite must stay well
# inside CI's time, and a step that grew shows here first.
TIMES=() T0=$SECONDS
step() { # NAME COMMAND [ARG...]
	local name=$1 t=$SECONDS rc=0
	shift
	"$@" || rc=$?
	local note=
	((rc == 0)) || note=" (exit $rc)"
	TIMES+=("$(printf '%5d s  %s%s' $((SECONDS - t)) "$name" "$note")")
	return $rc
}
times_said() {
	local rc=$?
	echo "test.sh: time by step (exit $rc):"
	printf '    %s\n' "${TIMES[@]}"
	printf '    %5d s  in all\n' $((SECONDS - T0))
}
trap times_said EXIT
step "install the dependencies" scripts/install-deps.sh
step "cargo fmt" cargo fmt --all -- --check
step "cargo clippy" cargo clippy --workspace --all-targets --locked -- -D warnings
step "cargo test (build and run)" cargo test --workspace --locked
# The libraries as a publisher gets them: every crate's documentation without a
# warning, and every library crate packaged (cargo package's metadata checks).
# The examples are documented too: building a target that needs the
# dev-dependencies gives the dependencies the features clippy --all-targets
# checked them with, so rustdoc reuses those checks (about 30 s on a clean
# checkout, against 166 s when it checked every dependency again).
RUSTDOCFLAGS="-D warnings" step "cargo doc" cargo doc --workspace --no-deps --lib --bins --examples --locked
step "cargo package" cargo package --workspace --exclude vabc --exclude vabc-crashreplay --no-verify --locked
# The README's first command, with the binary just tested (its release build is the
# one step left out; the static build below covers a second build profile).
DEMO_DIR=$(mktemp -d "${TMPDIR:-/tmp}/vabc-demo.XXXXXX")
VABC=${CARGO_TARGET_DIR:-target}/debug/vabc DEMO_DIR=$DEMO_DIR step "./demo.sh" ./demo.sh >"$DEMO_DIR.log" 2>&1 ||
	{ tail -30 "$DEMO_DIR.log"; echo "test.sh: ./demo.sh failed (log: $DEMO_DIR.log)"; exit 1; }
rm -rf "$DEMO_DIR" "$DEMO_DIR.log"
# The library as an OTA client embeds it: the example agent downloads a bundle over
# HTTP and installs it into an update store, reporting progress through a callback.
step "the embedding example" scripts/test-embedding.sh "${CARGO_TARGET_DIR:-target}/debug/vabc"
# The packages as shipped: the .deb of the binary the tests just ran (stripped, with
# its unit and initramfs step) and the static build, installed and run in a fresh
# Debian chroot (systemd-analyze verify on every unit).
step "the .deb" scripts/package.sh deb --binary "${CARGO_TARGET_DIR:-target}/debug/vabc"
step "the static build" scripts/package.sh musl
step "the packages in a chroot" scripts/test-package.sh --musl "${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-musl/release/vabc"
if [ "${VABC_SKIP_VM:-0}" = 1 ]; then
	echo "test.sh: VABC_SKIP_VM=1: the VM tier (tests/vm/*.sh) was NOT run"
	exit 0
fi
# The binary `cargo test` just built (CARGO_TARGET_DIR respected).
VABC=${CARGO_TARGET_DIR:-target}/debug/vabc step "VM: conformance" tests/vm/conformance.sh
# The packaged unit under a real systemd (the .deb and chroot made above).
step "VM: the unit" tests/vm/unit.sh
VABC=${CARGO_TARGET_DIR:-target}/debug/vabc step "VM: the device scenario" tests/vm/device.sh
# A real Debian system (systemd as PID 1, the .deb's units and initramfs-tools
# scripts): installed, booted from base + COW, assessed good through
# boot-complete.target, merged; a failing update rolled back.
VABC=${CARGO_TARGET_DIR:-target}/debug/vabc step "VM: a real OS" tests/vm/system.sh
# Crash consistency write by write: an install and a merge of two partitions logged
# by dm-log-writes in one boot, then 24 of the disk states a power cut could leave at
# the flush points and 24 in between, each booted and carried to the end here; the
# same boot then kills the serving daemon twice while the new system reads it (SIGKILL,
# then the OOM killer), each next boot serving the update again (the full run:
# tests/vm/crash.sh --random 1000 --kills 10, bench/results/crash.md).
VABC=${CARGO_TARGET_DIR:-target}/debug/vabc VABC_CRASHREPLAY=${CARGO_TARGET_DIR:-target}/debug/vabc-crashreplay \
	step "VM: crash states" tests/vm/crash.sh --points 24 --random 24 --kills 2
