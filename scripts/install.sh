#!/usr/bin/env bash
# Install vabc: the binary, its manual pages (man vabc, man vabc-diff, ...) and shell
# completions (bash, zsh, fish), under PREFIX (default /usr/local).
#   scripts/install.sh [PREFIX]
# Builds the release binary first, unless VABC names one to install.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=${1:-/usr/local}
if [ -z "${VABC:-}" ]; then
	echo "install: building the release binary (cargo build --release; several minutes the first time)" >&2
	cargo build --release --locked -p vabc
	VABC=${CARGO_TARGET_DIR:-target}/release/vabc
fi
install -D -m 0755 "$VABC" "$PREFIX/bin/vabc"
man1=$PREFIX/share/man/man1
mkdir -p "$man1"
"$PREFIX/bin/vabc" man "$man1" >/dev/null
"$PREFIX/bin/vabc" completions bash | install -D -m 0644 /dev/stdin "$PREFIX/share/bash-completion/completions/vabc"
"$PREFIX/bin/vabc" completions zsh | install -D -m 0644 /dev/stdin "$PREFIX/share/zsh/site-functions/_vabc"
"$PREFIX/bin/vabc" completions fish | install -D -m 0644 /dev/stdin "$PREFIX/share/fish/vendor_completions.d/vabc.fish"
echo "installed $("$PREFIX/bin/vabc" --version) in $PREFIX (binary, $(ls "$man1" | grep -c '^vabc') manual pages, completions)"
