#!/usr/bin/env bash
# Build vabc for shipping:
#   scripts/package.sh deb    a Debian package: target/debian/vabc_VERSION_ARCH.deb
#                             (binary, manual pages, completions, unit template, docs;
#                             cargo-deb, installed with `cargo install` if missing);
#                             scripts/test-package.sh installs it into a fresh chroot
#   scripts/package.sh musl   a static binary: target/x86_64-unknown-linux-musl/release/vabc
#                             (needs the rustup target and musl-tools, both installed
#                             here if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-deb} in
deb) ;;
musl)
	rustup target list --installed | grep -qx x86_64-unknown-linux-musl ||
		rustup target add x86_64-unknown-linux-musl
	command -v musl-gcc >/dev/null ||
		apt-get -o DPkg::Lock::Timeout=300 install -y -qq musl-tools >/dev/null
	CC_x86_64_unknown_linux_musl=musl-gcc \
		cargo build --release --locked -p vabc --target x86_64-unknown-linux-musl
	B=target/x86_64-unknown-linux-musl/release/vabc
	file "$B" 2>/dev/null || true
	ls -l "$B"
	exit 0
	;;
*) echo "usage: scripts/package.sh deb|musl" >&2; exit 2 ;;
esac
command -v cargo-deb >/dev/null || cargo install --locked cargo-deb
cargo build --release --locked -p vabc
T=target/package
rm -rf "$T"
mkdir -p "$T/man" "$T/completions"
target/release/vabc man "$T/man" >/dev/null
gzip -9n "$T"/man/*.1
target/release/vabc completions bash >"$T/completions/vabc.bash"
target/release/vabc completions zsh >"$T/completions/_vabc"
target/release/vabc completions fish >"$T/completions/vabc.fish"
# The binary is built above with debug info (profile.release debug = 1); the package
# ships it stripped (cargo-deb strips by default).
cargo deb --no-build -p vabc
ls -l target/debian/*.deb
