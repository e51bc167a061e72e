#!/usr/bin/env bash
# The embedding example (crates/ota/examples/agent.rs) as an OTA client would run
# it: a signed bundle with dm-verity, served over HTTP by a server that ignores
# ranges, downloaded and installed into a fresh update store; the store must then
# hold the installed update, and a second run against a wrong base must be refused
# with exit 3 and change nothing.
#   scripts/test-embedding.sh [VABC]   (default: target/debug/vabc)
set -euo pipefail
cd "$(dirname "$0")/.."
VABC=${1:-${CARGO_TARGET_DIR:-target}/debug/vabc}
# As `cargo test --workspace` built it (the same profile and features: a no-op after the
# suite's build, where the dev profile or `-p vabc-ota` would compile crates again).
cargo build --locked --profile test --workspace --examples
AGENT=${CARGO_TARGET_DIR:-target}/debug/examples/agent
W=$(mktemp -d "${TMPDIR:-/tmp}/vabc-embed.XXXXXX")
SERVER=
cleanup() {
	[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null || true
	rm -rf "$W"
}
trap cleanup EXIT
fail() {
	echo "test-embedding.sh: FAIL: $*" >&2
	exit 1
}
# An old image and a new one that differs in some blocks (deterministic).
head -c 8388608 /dev/zero | tr '\0' 'a' >"$W/old.img"
cp "$W/old.img" "$W/new.img"
for off in 1 7 100 1000 1500; do
	printf 'changed block %d' "$off" | dd of="$W/new.img" bs=4096 seek="$off" conv=notrunc status=none
done
openssl genpkey -algorithm ed25519 -out "$W/key.pem"
openssl pkey -in "$W/key.pem" -pubout -out "$W/pub.pem"
mkdir "$W/www"
"$VABC" bundle create -p "system=$W/old.img,$W/new.img" --verity --key "$W/key.pem" \
	-o "$W/www/update.vabc" >/dev/null
"$VABC" update init --store "$W/store" >/dev/null
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 --directory "$W/www" "$PORT" >"$W/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 50); do
	python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/')" 2>/dev/null && break
	sleep 0.1
done
URL=http://127.0.0.1:$PORT/update.vabc
# A wrong base: refused (exit 3), the store untouched.
cp "$W/new.img" "$W/wrong.img"
set +e
"$AGENT" --store "$W/store" --key "$W/pub.pem" --base "system=$W/wrong.img" "$URL" >"$W/wrong.out" 2>"$W/wrong.err"
rc=$?
set -e
[ "$rc" = 3 ] || fail "a wrong base: exit $rc, want 3 ($(cat "$W/wrong.err"))"
grep -q "is not the base" "$W/wrong.err" || fail "a wrong base: $(cat "$W/wrong.err")"
state=$("$VABC" update status --store "$W/store" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
[ "$state" = none ] || fail "a refused install left state $state"
# The right one: installed, with progress reported through the callback.
"$AGENT" --store "$W/store" --key "$W/pub.pem" --base "system=$W/old.img" "$URL" >"$W/ok.out" 2>"$W/ok.err" ||
	fail "install: $(cat "$W/ok.err")"
grep -q "signature, bases and space checked: 1 partition" "$W/ok.err" || fail "no checked event: $(cat "$W/ok.err")"
grep -q "100%" "$W/ok.err" || fail "no progress: $(cat "$W/ok.err")"
grep -q "partition system installed" "$W/ok.err" || fail "no installed event: $(cat "$W/ok.err")"
python3 - "$W/ok.out" <<'PY' || fail "report: $(cat "$W/ok.out")"
import json, sys
r = json.loads(open(sys.argv[1]).read())
assert r["event"] == "installed" and r["state"] == "installed", r
assert r["partitions"] == ["system"], r
PY
state=$("$VABC" update status --store "$W/store" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
[ "$state" = installed ] || fail "the store says $state after the agent's install"
echo "test-embedding.sh: PASS (the agent downloaded over HTTP, reported progress, installed; a wrong base was refused with exit 3)"
