#!/usr/bin/env bash
# Build vabc for shipping:
#   scripts/package.sh deb [--binary FILE]
#       a Debian package, target/debian/vabc_VERSION_ARCH.deb: the binary (stripped),
#       manual pages, shell completions, the units (vabc-serve@, and the boot
#       assessment's vabc-health-check, vabc-mark-good and vabc-merge, enabled by its
#       postinst), the initramfs step (/usr/share/vabc/vabc-boot.sh) with its
#       initramfs-tools hook and scripts and its dracut module, the docs.
#       The binary is a release build, or FILE (the suite packages the binary its
#       tests ran, saving a second build). scripts/test-package.sh installs it.
#   scripts/package.sh musl
#       a static binary, target/x86_64-unknown-linux-musl/release/vabc, stripped
#       (needs the rustup target and musl-tools, both installed here if missing).
# The package is assembled with dpkg-deb, Debian's own tool, from the control file
# packaging/deb/control: nothing to build first (cargo-deb took a 3-minute compile
# of its own on every CI run, for what is a file list).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-deb}
shift || true
BIN=
while (($#)); do
	case $1 in
	--binary) BIN=$2; shift 2 ;;
	*) sed -n '2,17p' "$0" >&2; exit 2 ;;
	esac
done
case $what in
deb) ;;
musl)
	rustup target list --installed | grep -qx x86_64-unknown-linux-musl ||
		rustup target add x86_64-unknown-linux-musl
	command -v musl-gcc >/dev/null ||
		apt-get -o DPkg::Lock::Timeout=300 install -y -qq musl-tools >/dev/null
	CC_x86_64_unknown_linux_musl=musl-gcc \
		cargo build --release --locked -p vabc --target x86_64-unknown-linux-musl
	B=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-musl/release/vabc
	strip "$B"
	file "$B" 2>/dev/null || true
	ls -l "$B"
	exit 0
	;;
*) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
if [ -z "$BIN" ]; then
	cargo build --release --locked -p vabc
	BIN=${CARGO_TARGET_DIR:-target}/release/vabc
fi
VERSION=$("$BIN" --version | awk '{print $2}')
ARCH=$(dpkg --print-architecture)
T=target/package
rm -rf "$T"
R=$T/root
install -d "$R/DEBIAN" "$R/usr/bin" "$R/usr/share/man/man1" "$R/usr/share/vabc" \
	"$R/usr/share/bash-completion/completions" "$R/usr/share/zsh/vendor-completions" \
	"$R/usr/share/fish/vendor_completions.d" "$R/usr/lib/systemd/system" \
	"$R/usr/share/initramfs-tools/hooks" "$R/usr/share/doc/vabc/docs"
# Stripped: the build keeps line tables for backtraces (profile.release debug = 1),
# 7 times the size of the code.
strip -o "$R/usr/bin/vabc" "$BIN"
"$BIN" man "$R/usr/share/man/man1" >/dev/null
gzip -9n "$R"/usr/share/man/man1/*.1
"$BIN" completions bash >"$R/usr/share/bash-completion/completions/vabc"
"$BIN" completions zsh >"$R/usr/share/zsh/vendor-completions/_vabc"
"$BIN" completions fish >"$R/usr/share/fish/vendor_completions.d/vabc.fish"
install -m 644 packaging/systemd/*.service "$R/usr/lib/systemd/system/"
install -m 755 packaging/systemd/health-check.sh packaging/initramfs/vabc-boot.sh "$R/usr/share/vabc/"
install -m 755 packaging/initramfs/initramfs-tools-hook "$R/usr/share/initramfs-tools/hooks/vabc"
install -D -m 755 packaging/initramfs/initramfs-tools-local-top \
	"$R/usr/share/initramfs-tools/scripts/local-top/vabc"
install -D -m 755 packaging/initramfs/initramfs-tools-local-bottom \
	"$R/usr/share/initramfs-tools/scripts/local-bottom/vabc"
install -d "$R/usr/lib/dracut/modules.d/90vabc"
install -m 755 packaging/dracut/90vabc/* "$R/usr/lib/dracut/modules.d/90vabc/"
install -m 755 packaging/deb/postinst packaging/deb/postrm "$R/DEBIAN/"
install -m 644 packaging/deb/triggers "$R/DEBIAN/"
install -m 644 README.md "$R/usr/share/doc/vabc/"
install -m 644 docs/*.md "$R/usr/share/doc/vabc/docs/"
echo "vabc developers, Apache-2.0" >"$R/usr/share/doc/vabc/copyright"
SIZE=$(du -sk --exclude=DEBIAN "$R" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$SIZE/" \
	packaging/deb/control >"$R/DEBIAN/control"
mkdir -p target/debian
OUT=target/debian/vabc_${VERSION}_$ARCH.deb
rm -f target/debian/vabc_*.deb
dpkg-deb --root-owner-group -Zxz --build "$R" "$OUT" >/dev/null
ls -l "$OUT"
echo "package: binary $(stat -c %s "$R/usr/bin/vabc") bytes stripped (from $(stat -c %s "$BIN"))"
