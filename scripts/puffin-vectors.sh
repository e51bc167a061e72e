#!/usr/bin/env bash
# Makes the PUFFDIFF reference vectors the payload tests read
# (crates/payload/tests/vectors/puffin/, PROVENANCE.md there) with puffin's own
# code, so that what is committed is what Android's puffin makes, not what vabc
# thinks it makes. From a puffin checkout (or bare git dir) at commit
# 35a231b2e5c0fa098f8fffbf264bbfcb837ba0a7 it:
#   1. builds puffin's command-line tool (src/main.cc) out of tree in a temp dir,
#      against a small generated shim for AOSP's bsdiff library (see below);
#   2. makes deterministic inputs with python3 (gzip, zip, raw deflate: fixed
#      mtimes, a seeded xorshift generator, no downloads);
#   3. runs the tool's puffdiff and puff on each case and checks with the same
#      tool that puffpatch gives back the new file, that puffhuff and huff give
#      back both files, and that the patch header agrees with the tool's own
#      --verbose extents; any mismatch fails the script;
#   4. copies puffin's unit-test vectors out of src/unittest_common.h (checking
#      the files' git blob ids) and checks the tool against them too;
#   5. writes cases.txt, extents.txt, SHA256SUMS and PROVENANCE.md.
# Run by hand when the vectors change; the tests build and fetch nothing.
#
#   git clone -b lineage-16.0 https://github.com/LineageOS/android_external_puffin puffin
#   scripts/puffin-vectors.sh puffin [OUTDIR]
#
# OUTDIR defaults to crates/payload/tests/vectors/puffin; it is replaced whole
# (it must be empty, absent, or an earlier output of this script).
#
# Needs these Debian packages (no root needed once they are installed):
#   g++ make protobuf-compiler libprotobuf-dev libgoogle-glog-dev libgflags-dev
#   zlib1g-dev bsdiff python3
# puffin links AOSP's C++ bsdiff library (bsdiff::bsdiff, bsdiff::bspatch),
# which Debian does not ship. The shim below implements those two functions by
# running Debian's bsdiff/bspatch programs (the same BSDIFF40 patch format), so
# every byte of puffing, huffing, the PUF1 header and the puff streams is still
# puffin's code; only the inner bsdiff patch may differ from what AOSP's
# bsdiff would pick. Its output is also run through Debian's bspatch directly.
# Debian's bsdiff cannot map an empty file, so the shim writes a patch to an
# empty file itself, as AOSP's does (only the check against kPatch8ToEmpty).
#
# Porting fixes to puffin (all in the temp copy, none changes behaviour):
#   - main.cc: the fixed temp path "/tmp/patch.tmp" for the inner bsdiff patch
#     is moved into the script's temp dir (no clash with other users of /tmp);
#   - built with -std=c++17 -DZLIB_CONST (Android.bp sets ZLIB_CONST; utils.cc
#     needs it) against Debian's protobuf-lite, glog and gflags (puffin's own
#     non-brillo mode, as in its Makefile).
set -euo pipefail

usage="usage: scripts/puffin-vectors.sh PUFFIN_CHECKOUT_OR_GIT_DIR [OUTDIR]"
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "$usage" >&2; exit 2; }
die() { echo "puffin-vectors: $*" >&2; exit 1; }

PUFFIN=$(cd "$1" && pwd) || die "no such directory: $1"
if [ $# -ge 2 ]; then
	mkdir -p "$2"
	OUT=$(cd "$2" && pwd)
fi
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/crates/payload/tests/vectors/puffin}

if [ -n "$(ls -A "$OUT" 2>/dev/null)" ] && [ ! -f "$OUT/cases.txt" ]; then
	die "$OUT is not empty and not an earlier output of this script; not replacing it"
fi

COMMIT=35a231b2e5c0fa098f8fffbf264bbfcb837ba0a7
BLOBS=(
	"src/unittest_common.h c03aea4813748d1aa11e5e535fbb0d4387c1da60"
	"src/unittest_common.cc b542740f43dbc8a27234cd937185d59deb86d298"
	"src/patching_unittest.cc d6327cf1e72edaf74277b71802f3f9c1888c988c"
	"LICENSE 8bafca303a770b67bf798c803ebb39d41bdfbd8f"
)

for tool in git g++ make protoc bsdiff bspatch python3 sha256sum cmp tar; do
	command -v "$tool" >/dev/null || die "missing '$tool' (see the packages in this script's header)"
done
for header in google/protobuf/message_lite.h glog/logging.h gflags/gflags.h zlib.h; do
	echo "#include <$header>" | g++ -std=c++17 -x c++ -fsyntax-only - 2>/dev/null ||
		die "missing C++ header <$header> (see the packages in this script's header)"
done

# A checkout or a bare git dir: git -C finds either.
head=$(git -C "$PUFFIN" rev-parse --verify HEAD^{commit}) || die "$PUFFIN is not a git repository"
[ "$head" = "$COMMIT" ] || die "$PUFFIN is at $head, not $COMMIT"
for v in "${BLOBS[@]}"; do
	read -r path blob <<<"$v"
	got=$(git -C "$PUFFIN" rev-parse "$COMMIT:$path")
	[ "$got" = "$blob" ] || die "$path at $COMMIT is blob $got, not $blob"
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/puffin-vectors.XXXXXX")
# KEEP_WORK=1 keeps the temp dir (the built tool is $WORK/build/puffin).
trap 'if [ -n "${KEEP_WORK:-}" ]; then echo "puffin-vectors: kept $WORK" >&2; else rm -rf "$WORK"; fi' EXIT
SRC=$WORK/puffin # puffin at $COMMIT; its `puffin -> .` symlink resolves the "puffin/src/..." includes
B=$WORK/build
V=$WORK/out # the vectors, copied to $OUT when all checks pass
mkdir -p "$SRC" "$B/shim/bsdiff" "$B/gen" "$B/obj" "$V/unittest" "$WORK/tmp"
git -C "$PUFFIN" archive "$COMMIT" | tar -x -C "$SRC"
[ -L "$SRC/puffin" ] || die "puffin's 'puffin -> .' symlink is missing"

# --- build -------------------------------------------------------------------

grep -q '"/tmp/patch.tmp"' "$SRC/src/main.cc" || die "main.cc: temp patch path not found"
sed -i "s|\"/tmp/patch.tmp\"|\"$WORK/tmp/puffdiff.bsdiff\"|" "$SRC/src/main.cc"

# The shim: just the declarations puffdiff.cc and puffpatch.cc use, with AOSP
# bsdiff's signatures; the work is done by Debian's bsdiff/bspatch programs.
cat >"$B/shim/bsdiff/file_interface.h" <<'EOF'
// Shim for AOSP bsdiff's FileInterface (generated by scripts/puffin-vectors.sh).
#ifndef PUFFIN_VECTORS_SHIM_FILE_INTERFACE_H_
#define PUFFIN_VECTORS_SHIM_FILE_INTERFACE_H_
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
namespace bsdiff {
class FileInterface {
 public:
  virtual ~FileInterface() = default;
  virtual bool Read(void* buf, size_t count, size_t* bytes_read) = 0;
  virtual bool Write(const void* buf, size_t count, size_t* bytes_written) = 0;
  virtual bool Seek(off_t pos) = 0;
  virtual bool Close() = 0;
  virtual bool GetSize(uint64_t* size) = 0;

 protected:
  FileInterface() = default;
};
}  // namespace bsdiff
#endif
EOF
cat >"$B/shim/bsdiff/bsdiff.h" <<'EOF'
// Shim for AOSP bsdiff's bsdiff() (generated by scripts/puffin-vectors.sh).
#ifndef PUFFIN_VECTORS_SHIM_BSDIFF_H_
#define PUFFIN_VECTORS_SHIM_BSDIFF_H_
#include <stddef.h>
#include <stdint.h>
namespace bsdiff {
class SuffixArrayIndexInterface;
// Writes a BSDIFF40 patch from |old_buf| to |new_buf| into |patch_filename|;
// 0 on success. |sai_cache| must be null (puffin passes null).
int bsdiff(const uint8_t* old_buf, size_t oldsize, const uint8_t* new_buf,
           size_t newsize, const char* patch_filename,
           SuffixArrayIndexInterface** sai_cache);
}  // namespace bsdiff
#endif
EOF
cat >"$B/shim/bsdiff/bspatch.h" <<'EOF'
// Shim for AOSP bsdiff's bspatch() (generated by scripts/puffin-vectors.sh).
#ifndef PUFFIN_VECTORS_SHIM_BSPATCH_H_
#define PUFFIN_VECTORS_SHIM_BSPATCH_H_
#include <memory>
#include "bsdiff/file_interface.h"
namespace bsdiff {
// Applies the BSDIFF40 patch |patch_data| to all of |old_file|, writing the
// result to |new_file|; 0 on success.
int bspatch(const std::unique_ptr<FileInterface>& old_file,
            const std::unique_ptr<FileInterface>& new_file,
            const uint8_t* patch_data, size_t patch_size);
}  // namespace bsdiff
#endif
EOF
cat >"$B/shim/bsdiff_shim.cc" <<'EOF'
// Shim for AOSP bsdiff (generated by scripts/puffin-vectors.sh): runs Debian's
// bsdiff/bspatch programs on temp files.
#include <errno.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "bsdiff/bsdiff.h"
#include "bsdiff/bspatch.h"

extern char** environ;

namespace bsdiff {
namespace {

bool WriteFile(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  bool ok = size == 0 || fwrite(data, 1, size, f) == size;
  return fclose(f) == 0 && ok;
}

bool ReadFile(const std::string& path, std::vector<uint8_t>* data) {
  FILE* f = fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  data->clear();
  uint8_t buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) data->insert(data->end(), buf, buf + n);
  bool ok = !ferror(f);
  fclose(f);
  return ok;
}

// Runs |argv| (searched in PATH); true if it exited with status 0.
bool Run(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(&a[0]);
  argv.push_back(nullptr);
  pid_t pid;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
    fprintf(stderr, "bsdiff shim: cannot run %s\n", argv[0]);
    return false;
  }
  int status;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return false;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "bsdiff shim: %s failed\n", argv[0]);
    return false;
  }
  return true;
}

struct TempDir {
  std::string path;
  TempDir() {
    const char* t = getenv("TMPDIR");
    std::string tmpl = std::string(t != nullptr && *t != '\0' ? t : "/tmp") + "/bsdiff-shim.XXXXXX";
    if (mkdtemp(&tmpl[0]) != nullptr) path = tmpl;
  }
  ~TempDir() {
    if (path.empty()) return;
    for (const char* name : {"/old", "/new", "/patch"}) unlink((path + name).c_str());
    rmdir(path.c_str());
  }
};

}  // namespace

int bsdiff(const uint8_t* old_buf, size_t oldsize, const uint8_t* new_buf,
           size_t newsize, const char* patch_filename,
           SuffixArrayIndexInterface** sai_cache) {
  if (sai_cache != nullptr) return 1;
  if (newsize == 0) {
    // Debian's bsdiff cannot mmap an empty file. A patch to nothing has no
    // control tuples: write it as AOSP's bsdiff does (puffin's kPatch8ToEmpty),
    // the header and three empty bzip2 streams.
    static const uint8_t kEmptyBz2[14] = {'B', 'Z', 'h', '9', 0x17, 0x72, 0x45,
                                          0x38, 0x50, 0x90, 0, 0, 0, 0};
    std::vector<uint8_t> p = {'B', 'S', 'D', 'I', 'F', 'F', '4', '0'};
    for (uint64_t v : {uint64_t{sizeof(kEmptyBz2)}, uint64_t{sizeof(kEmptyBz2)}, uint64_t{0}})
      for (int i = 0; i < 8; i++) p.push_back(static_cast<uint8_t>(v >> (8 * i)));
    for (int i = 0; i < 3; i++) p.insert(p.end(), kEmptyBz2, kEmptyBz2 + sizeof(kEmptyBz2));
    return WriteFile(patch_filename, p.data(), p.size()) ? 0 : 1;
  }
  TempDir dir;
  if (dir.path.empty()) return 1;
  if (!WriteFile(dir.path + "/old", old_buf, oldsize) ||
      !WriteFile(dir.path + "/new", new_buf, newsize))
    return 1;
  unlink(patch_filename);
  return Run({"bsdiff", dir.path + "/old", dir.path + "/new", patch_filename}) ? 0 : 1;
}

int bspatch(const std::unique_ptr<FileInterface>& old_file,
            const std::unique_ptr<FileInterface>& new_file,
            const uint8_t* patch_data, size_t patch_size) {
  TempDir dir;
  if (dir.path.empty()) return 1;
  uint64_t old_size;
  if (!old_file->GetSize(&old_size) || !old_file->Seek(0)) return 1;
  std::vector<uint8_t> old_data(old_size);
  size_t done = 0;
  while (done < old_data.size()) {
    size_t n = 0;
    if (!old_file->Read(old_data.data() + done, old_data.size() - done, &n) || n == 0) return 1;
    done += n;
  }
  std::vector<uint8_t> new_data;
  if (!WriteFile(dir.path + "/old", old_data.data(), old_data.size()) ||
      !WriteFile(dir.path + "/patch", patch_data, patch_size) ||
      !Run({"bspatch", dir.path + "/old", dir.path + "/new", dir.path + "/patch"}) ||
      !ReadFile(dir.path + "/new", &new_data))
    return 1;
  done = 0;
  while (done < new_data.size()) {
    size_t n = 0;
    if (!new_file->Write(new_data.data() + done, new_data.size() - done, &n) || n == 0) return 1;
    done += n;
  }
  return old_file->Close() && new_file->Close() ? 0 : 1;
}

}  // namespace bsdiff
EOF

(cd "$SRC" && protoc --cpp_out="$B/gen" puffin/src/puffin.proto)

PUFFIN_SOURCES="bit_reader bit_writer extent_stream file_stream huffer huffman_table
	memory_stream puff_reader puff_writer puffdiff puffer puffin_stream puffpatch utils main"
{
	echo "CXX ?= g++"
	echo "CXXFLAGS = -O2 -std=c++17 -Wall -Wno-deprecated-declarations -D_FILE_OFFSET_BITS=64 -DZLIB_CONST"
	echo "CPPFLAGS = -I$SRC -I$SRC/src/include -I$B/gen -I$B/shim"
	echo "OBJS = $(for s in $PUFFIN_SOURCES; do printf 'obj/%s.o ' "$s"; done)obj/puffin.pb.o obj/bsdiff_shim.o"
	echo "puffin: \$(OBJS)"
	printf '\t$(CXX) $(CXXFLAGS) -o $@ $(OBJS) -lgflags -lglog -lprotobuf-lite -lz -lpthread\n'
	echo "obj/%.o: $SRC/src/%.cc gen/puffin/src/puffin.pb.h"
	printf '\t$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c -o $@ $<\n'
	echo "obj/puffin.pb.o: gen/puffin/src/puffin.pb.cc"
	printf '\t$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c -o $@ $<\n'
	echo "obj/bsdiff_shim.o: shim/bsdiff_shim.cc"
	printf '\t$(CXX) $(CPPFLAGS) $(CXXFLAGS) -c -o $@ $<\n'
} >"$B/Makefile"
echo "puffin-vectors: building puffin $COMMIT" >&2
make -C "$B" -s -j"${JOBS:-2}" puffin >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log" >&2; die "build failed"; }
PUFFIN_TOOL=$B/puffin
export TMPDIR=$WORK/tmp # for the shim's temp files

# --- puffin's unit-test vectors ------------------------------------------------

git -C "$PUFFIN" show "$COMMIT:LICENSE" >"$V/LICENSE.puffin"
python3 - "$SRC/src/unittest_common.h" "$V/unittest" <<'EOF'
# Writes each `const Buffer kX = {...};` of puffin's unittest_common.h as
# kX.bin and each extent vector as a line of extents.txt.
import re, sys
src, out = sys.argv[1], sys.argv[2]
text = open(src).read()
text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
text = re.sub(r"//[^\n]*", "", text)
n_buf = n_ext = 0
for m in re.finditer(r"const Buffer (\w+) = \{([^;]*)\};", text):
    vals = [int(v, 0) for v in re.findall(r"0[xX][0-9A-Fa-f]+|\d+", m.group(2))]
    assert all(0 <= v <= 255 for v in vals), m.group(1)
    open(f"{out}/{m.group(1)}.bin", "wb").write(bytes(vals))
    n_buf += 1
lines = [
    "# Extent vectors of puffin's src/unittest_common.h, one per line:",
    "# NAME offset:length ... (kSubblockDeflateExtents*: bits; kDeflateExtents*,",
    "# kPuffExtents*: bytes). An empty vector is a line with the name alone.",
]
for m in re.finditer(r"const std::vector<(Byte|Bit)Extent> (\w+) = \{(.*?)\};", text, flags=re.S):
    pairs = re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", m.group(3))
    lines.append(" ".join([m.group(2)] + [f"{o}:{l}" for o, l in pairs]))
    n_ext += 1
open(f"{out}/extents.txt", "w").write("\n".join(lines) + "\n")
assert n_buf >= 30 and n_ext == 8, (n_buf, n_ext)
EOF

# ext NAME: the extents named NAME in unittest/extents.txt, as the tool's
# comma-separated flag value.
ext() { awk -v n="$1" '$1 == n { for (i = 2; i <= NF; i++) printf "%s%s", $i, (i < NF ? "," : "") }' "$V/unittest/extents.txt"; }
U=$V/unittest
T=$WORK/tmp
# The tool opens its outputs without O_TRUNC: always write to a fresh name.
tool() { "$PUFFIN_TOOL" "$@" 2>"$T/tool.log" || { cat "$T/tool.log" >&2; die "puffin $* failed"; }; }
same() { cmp -s "$1" "$2" || die "$3: $1 and $2 differ"; }

for n in 8 9 11; do
	if [ "$n" = 11 ]; then d=$U/kDeflate11.bin p=$U/kPuff11.bin; else d=$U/kDeflates$n.bin p=$U/kPuffs$n.bin; fi
	rm -f "$T/u.puff" "$T/u.huff"
	tool --operation=puff --src_file="$d" --dst_file="$T/u.puff" --src_file_type=raw \
		--src_deflates_bit="$(ext "kSubblockDeflateExtents$n")"
	same "$T/u.puff" "$p" "puff of unit-test deflates $n"
	tool --operation=puffhuff --src_file="$d" --dst_file="$T/u.huff" --src_file_type=raw \
		--src_deflates_bit="$(ext "kSubblockDeflateExtents$n")"
	same "$T/u.huff" "$d" "puffhuff of unit-test deflates $n"
done
# The single deflates kDeflateN (used by puff_io_unittest.cc): puffing each whole file (type deflate)
# gives kPuffN, then one raw byte holding the last byte's unused bits when the
# deflate ends inside a byte.
for n in 1 1_1 2 3 4 7 7_2 7_3 7_4 10; do
	rm -f "$T/u.puff" "$T/u.huff"
	tool --operation=puff --src_file="$U/kDeflate$n.bin" --dst_file="$T/u.puff" --src_file_type=deflate
	python3 - "$T/u.puff" "$U/kPuff$n.bin" <<'EOF' || die "puff of kDeflate$n is not kPuff$n"
import sys
got, want = (open(p, "rb").read() for p in sys.argv[1:])
sys.exit(not (got[:len(want)] == want and len(got) - len(want) in (0, 1)))
EOF
	tool --operation=puffhuff --src_file="$U/kDeflate$n.bin" --dst_file="$T/u.huff" --src_file_type=deflate
	same "$T/u.huff" "$U/kDeflate$n.bin" "puffhuff of kDeflate$n"
done
printf '\x0b\x16\x21\x2c' >"$T/nodeflate.bin" # patching_unittest.cc's Patching8ToNoDeflateTest
: >"$T/empty.bin"
for p in "8To9 kDeflates8 kDeflates9 8 9" "9To8 kDeflates9 kDeflates8 9 8" \
	"8ToEmpty kDeflates8 - 8 -" "8ToNoDeflate kDeflates8 + 8 -"; do
	read -r name s d se de <<<"$p"
	src=$U/$s.bin
	case $d in -) dst=$T/empty.bin ;; +) dst=$T/nodeflate.bin ;; *) dst=$U/$d.bin ;; esac
	dbits=""
	[ "$de" = - ] || dbits=$(ext "kSubblockDeflateExtents$de")
	rm -f "$T/u.out" "$T/u.patch"
	# puffin's own patch applies (its inner bsdiff is AOSP's, run by Debian's bspatch).
	tool --operation=puffpatch --src_file="$src" --dst_file="$T/u.out" --patch_file="$U/kPatch$name.bin"
	same "$T/u.out" "$dst" "puffpatch of kPatch$name"
	# The tool's puffdiff writes the same PUF1 header as puffin's unit test expects.
	tool --operation=puffdiff --src_file="$src" --dst_file="$dst" --patch_file="$T/u.patch" \
		--src_file_type=raw --dst_file_type=raw \
		--src_deflates_bit="$(ext "kSubblockDeflateExtents$se")" --dst_deflates_bit="$dbits"
	python3 - "$T/u.patch" "$U/kPatch$name.bin" "$name" >>"$WORK/unitpatches.txt" <<'EOF' || die "kPatch$name: PUF1 header differs"
import struct, sys
a, b = (open(p, "rb").read() for p in sys.argv[1:3])
def head(p): return p[:8 + struct.unpack(">I", p[4:8])[0]]
if head(a) != head(b):
    sys.exit(1)
note = ""
if sys.argv[3] == "8ToEmpty":
    note = " (Debian's bsdiff cannot map an empty file: the shim writes this inner patch itself)"
print("`kPatch%s`: %s%s" % (sys.argv[3], "the whole patch is byte-identical" if a == b else
      "same header; the inner patch differs (%d bytes; puffin's has %d)"
      % (len(a) - len(head(a)), len(b) - len(head(b))), note))
EOF
done
echo "puffin-vectors: the tool agrees with puffin's unit-test vectors" >&2

# --- inputs --------------------------------------------------------------------

python3 - "$V" "$U" <<'EOF'
# Deterministic inputs: pseudo-random text from a seeded xorshift64* generator
# (no dependence on Python's random module), compressed with this python3's
# zlib. gzip members and zip archives have fixed times and attributes.
import struct, sys, zipfile, zlib
out, unit = sys.argv[1], sys.argv[2]
M = (1 << 64) - 1

class Rng:
    def __init__(self, seed):
        self.s = seed & M or 1
    def next(self):
        x = self.s
        x ^= x >> 12
        x ^= (x << 25) & M
        x ^= x >> 27
        self.s = x
        return (x * 0x2545F4914F6CDD1D) & M
    def below(self, n):
        return (self.next() >> 11) % n
    def bytes(self, n):
        return bytes(self.next() >> 56 for _ in range(n))

SYLLABLES = ("ka lo mi ne ru sa to vi pe du an el or is um ba ce fi go hu ja ke li mo nu "
             "pa qu re si te ul ve wo xa yo ze tra pli sto gre").split()

def vocabulary(rng, n):
    words = []
    while len(words) < n:
        w = "".join(SYLLABLES[rng.below(len(SYLLABLES))] for _ in range(1 + rng.below(4)))
        if w not in words:
            words.append(w)
    return words

def text(rng, words, size):
    lines, line, sentence_left = [], [], 0
    total = 0
    while total < size:
        if sentence_left == 0:
            sentence_left = 4 + rng.below(11)
            w = words[rng.below(len(words))].capitalize()
        else:
            w = words[rng.below(len(words))]
        sentence_left -= 1
        if sentence_left == 0:
            w += "." if rng.below(5) else "!"
        elif rng.below(9) == 0:
            w += ","
        if sum(len(x) + 1 for x in line) + len(w) > 72:
            lines.append(" ".join(line))
            total += len(lines[-1]) + 1
            line = []
            if rng.below(8) == 0:
                lines.append("")
                total += 1
        line.append(w)
    return ("\n".join(lines) + "\n").encode()[:size]

def edit(rng, words, data, n):
    """n edits: replace, insert or delete a short run at pseudo-random places."""
    data = bytearray(data)
    for _ in range(n):
        pos = rng.below(len(data))
        kind = rng.below(3)
        new = text(rng, words, 20 + rng.below(200))
        if kind == 0:
            data[pos:pos + len(new)] = new
        elif kind == 1:
            data[pos:pos] = new
        else:
            del data[pos:pos + 10 + rng.below(300)]
    return bytes(data)

def deflate(data, level, mem_level=8):
    c = zlib.compressobj(level, zlib.DEFLATED, -15, mem_level)
    return c.compress(data) + c.flush()

def gzip_member(data, level, mem_level=8, name=None, comment=None, extra=None, xfl=0):
    flags = (4 if extra is not None else 0) | (8 if name is not None else 0) | (16 if comment is not None else 0)
    h = struct.pack("<BBBBIBB", 0x1F, 0x8B, 8, flags, 0, xfl, 3)  # mtime 0, OS 3 (Unix)
    if extra is not None:
        h += struct.pack("<H", len(extra)) + extra
    if name is not None:
        h += name + b"\0"
    if comment is not None:
        h += comment + b"\0"
    return h + deflate(data, level, mem_level) + struct.pack("<II", zlib.crc32(data), len(data) & 0xFFFFFFFF)

def zip_archive(entries):
    import io
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, method, level, data in entries:
            zi = zipfile.ZipInfo(name, date_time=(2019, 8, 22, 0, 0, 0))
            zi.compress_type = method
            zi.create_system = 3
            zi.external_attr = 0o100644 << 16
            zf.writestr(zi, data, compresslevel=level)
    return buf.getvalue()

def put(name, src, dst):
    open(f"{out}/{name}.src", "wb").write(src)
    open(f"{out}/{name}.dst", "wb").write(dst)

# a. gzip: ~60 KB of text at level 6, edited at level 9; memLevel 5 (blocks of
# at most 2 K symbols) so that each has several dynamic blocks.
rng = Rng(0x9E3779B97F4A7C15)
words = vocabulary(rng, 300)
old = text(rng, words, 60000)
new = edit(rng, words, old, 6)
put("gzip",
    gzip_member(old, 6, mem_level=5, name=b"story.txt"),
    gzip_member(new, 9, mem_level=5, name=b"story.txt", comment=b"edited", xfl=2))

# b. zip: a stored entry, tiny deflated entries (fixed Huffman; one empty),
# larger dynamic ones; the new archive changes some, adds one, removes one.
rng = Rng(0xD1B54A32D192ED03)
words = vocabulary(rng, 400)
a, b, c = text(rng, words, 3000), text(rng, words, 9000), text(rng, words, 1500)
D, S = zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED
zip_old, zip_new = (
    zip_archive([("META-INF/MANIFEST.MF", S, None, a),
                 ("tiny.txt", D, 6, b"hello, puffin\n"),
                 ("empty.txt", D, 6, b""),
                 ("res/large.txt", D, 6, b),
                 ("res/removed.txt", D, 6, c)]),
    zip_archive([("META-INF/MANIFEST.MF", S, None, edit(rng, words, a, 2)),
                 ("tiny.txt", D, 6, b"hello again, puffin\n"),
                 ("empty.txt", D, 6, b""),
                 ("res/large.txt", D, 9, edit(rng, words, b, 4)),
                 ("res/added.txt", D, 6, text(rng, words, 5000))]))
put("zip", zip_old, zip_new)

# c. stored blocks: random bytes between text; zlib stores the blocks that are
# only random (memLevel 5: blocks of at most 2 K symbols). The new file has a
# changed random run, edited text, and a second gzip member.
rng = Rng(0x2545F4914F6CDD1D)
words = vocabulary(rng, 300)
t1, t2, t3 = text(rng, words, 2000), text(rng, words, 2000), text(rng, words, 1500)
r1, r2 = rng.bytes(6000), rng.bytes(2500)
r1_new = r1[:3000] + rng.bytes(400) + r1[3400:]
put("stored",
    gzip_member(t1 + r1 + t2 + r2 + t3, 6, mem_level=5),
    gzip_member(edit(rng, words, t1, 2) + r1_new + t2 + r2 + t3, 6, mem_level=5)
    + gzip_member(b"second member\n", 9, name=b"second.txt", xfl=2))

# d. a raw deflate stream whose blocks end and start mid-byte: Z_BLOCK flushes
# (no byte alignment) around text, a tiny run (fixed Huffman) and a random run
# (a stored block at an odd bit offset), a Z_PARTIAL_FLUSH (empty fixed block)
# and a Z_SYNC_FLUSH (empty stored block).
def flushed(parts, level):
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    out = b""
    for data, mode in parts:
        out += c.compress(data) + c.flush(mode)
    return out
rng = Rng(0x853C49E6748FEA9B)
words = vocabulary(rng, 500)
d1, d2, d3, d4 = (text(rng, words, n) for n in (4000, 2500, 3000, 1500))
rnd = rng.bytes(1500)
Z = zlib
put("deflate",
    flushed([(d1, Z.Z_BLOCK), (b"tiny run", Z.Z_BLOCK), (rnd, Z.Z_BLOCK),
             (d2, Z.Z_PARTIAL_FLUSH), (d3, Z.Z_SYNC_FLUSH), (d4, Z.Z_FINISH)], 6),
    flushed([(edit(rng, words, d1, 2), Z.Z_BLOCK), (b"tiny run!", Z.Z_BLOCK), (rnd, Z.Z_BLOCK),
             (d2, Z.Z_BLOCK), (d3, Z.Z_PARTIAL_FLUSH), (edit(rng, words, d4, 1), Z.Z_FINISH)], 9))

# e. deflates with gaps of a few bits between them, located by explicit bit
# extents: puffin's own kDeflate11 (non-final fixed blocks, odd gaps, one
# zero-length extent) to its kDeflates9.
put("bitgaps", open(f"{unit}/kDeflate11.bin", "rb").read(), open(f"{unit}/kDeflates9.bin", "rb").read())

# f. what update_engine diffs: a file's whole blocks, so the patch makes every
# byte of the operation's destination. The archives of case b, each padded with
# zeros to a multiple of 4096 bytes.
def whole_blocks(d):
    return d + bytes(-len(d) % 4096)
put("blocks", whole_blocks(zip_old), whole_blocks(zip_new))
EOF

# --- cases ---------------------------------------------------------------------

# NAME TYPE [SRC_BITS DST_BITS]: for type raw the deflates are given as bit extents.
CASES=(
	"gzip gzip"
	"zip zip"
	"stored gzip"
	"deflate deflate"
	"bitgaps raw kSubblockDeflateExtents11 kSubblockDeflateExtents9"
	"blocks zip"
)
: >"$V/cases.txt"
: >"$WORK/extents.txt"
for c in "${CASES[@]}"; do
	read -r name type sbits dbits <<<"$c"
	for side in src dst; do
		args=(--src_file_type="$type")
		if [ "$type" = raw ]; then
			[ "$side" = src ] && bits=$sbits || bits=$dbits
			args+=(--src_deflates_bit="$(ext "$bits")")
		fi
		f=$V/$name.$side
		tool --operation=puff --src_file="$f" --dst_file="$f.puff" "${args[@]}" --verbose
		cp "$T/tool.log" "$T/$name.$side.puff.log"
		rm -f "$T/h"
		tool --operation=puffhuff --src_file="$f" --dst_file="$T/h" "${args[@]}"
		same "$T/h" "$f" "$name: puffhuff of $side"
	done
	args=(--src_file_type="$type" --dst_file_type="$type")
	[ "$type" != raw ] || args+=(--src_deflates_bit="$(ext "$sbits")" --dst_deflates_bit="$(ext "$dbits")")
	tool --operation=puffdiff --src_file="$V/$name.src" --dst_file="$V/$name.dst" \
		--patch_file="$V/$name.patch" "${args[@]}" --verbose
	cp "$T/tool.log" "$T/$name.diff.log"
	rm -f "$T/p"
	tool --operation=puffpatch --src_file="$V/$name.src" --dst_file="$T/p" --patch_file="$V/$name.patch"
	same "$T/p" "$V/$name.dst" "$name: puffpatch"
	# The header against the tool's --verbose extents and the .puff files; writes
	# the extents, the huff flags, and the inner bsdiff patch.
	python3 - "$name" "$V" "$T" >>"$WORK/extents.txt" <<'EOF' || die "$name: patch header check failed"
import re, struct, sys
name, v, t = sys.argv[1:]
patch = open(f"{v}/{name}.patch", "rb").read()
assert patch[:4] == b"PUF1", "magic"
hlen = struct.unpack(">I", patch[4:8])[0]
hdr, inner = patch[8:8 + hlen], patch[8 + hlen:]
assert inner[:8] == b"BSDIFF40", "inner patch is not BSDIFF40"

def varint(b, i):
    r = s = 0
    while True:
        c = b[i]; i += 1
        r |= (c & 0x7F) << s; s += 7
        if c < 0x80:
            return r, i

def fields(b):
    """(field number, wire type, value) of a protobuf message."""
    i, out = 0, []
    while i < len(b):
        key, i = varint(b, i)
        if key & 7 == 0:
            val, i = varint(b, i)
        elif key & 7 == 2:
            n, i = varint(b, i)
            val, i = b[i:i + n], i + n
        else:
            raise ValueError("wire type %d" % (key & 7))
        out.append((key >> 3, key & 7, val))
    return out

def extent(b):
    f = dict((k, v) for k, _, v in fields(b))
    return (f.get(1, 0), f.get(2, 0))

def stream_info(b):
    d, p, n = [], [], 0
    for k, _, v in fields(b):
        if k == 1: d.append(extent(v))
        elif k == 2: p.append(extent(v))
        elif k == 3: n = v
        else: raise ValueError("StreamInfo field %d" % k)
    return d, p, n

version, info = 0, {"src": ([], [], 0), "dst": ([], [], 0)}
for k, _, val in fields(hdr):
    if k == 1: version = val
    elif k == 2: info["src"] = stream_info(val)
    elif k == 3: info["dst"] = stream_info(val)
    else: raise ValueError("PatchHeader field %d" % k)
assert version == 1, version

def logged(path, key):
    m = re.findall(r"\] %s: (.*)$" % key, open(path).read(), flags=re.M)
    assert len(m) == 1, (path, key)
    return [tuple(int(x) for x in e.split(":")) for e in m[0].split(",") if e]

def fmt(es): return " ".join("%d:%d" % e for e in es)
diff_log = f"{t}/{name}.diff.log"
print(f"{name} version {version}")
for side in ("src", "dst"):
    deflates, puffs_bits, puff_len = info[side]
    assert all(o % 8 == 0 and l % 8 == 0 for o, l in puffs_bits), "puff extents not whole bytes"
    puffs = [(o // 8, l // 8) for o, l in puffs_bits]
    assert deflates == logged(diff_log, side + "_deflates_bit"), side + " deflates vs --verbose"
    puff_log = f"{t}/{name}.{side}.puff.log"
    assert deflates == logged(puff_log, "src_deflates_bit"), side + " deflates vs puff"
    assert puffs == logged(puff_log, "dst_puffs"), side + " puffs vs puff"
    assert puff_len == len(open(f"{v}/{name}.{side}.puff", "rb").read()), side + " puff_length"
    print(f"{name} {side}_deflates_bit {fmt(deflates)}".rstrip())
    print(f"{name} {side}_puffs_byte {fmt(puffs)}".rstrip())
    print(f"{name} {side}_puff_length {puff_len}")
    with open(f"{t}/{name}.{side}.huffargs", "w") as f:
        f.write(f"--src_puffs={','.join('%d:%d' % e for e in puffs)}\n")
        f.write(f"--dst_deflates_bit={','.join('%d:%d' % e for e in deflates)}\n")
print(f"{name} bsdiff_offset {8 + hlen}")
open(f"{t}/{name}.bsdiff", "wb").write(inner)
EOF
	# huff each committed .puff back with the header's extents.
	for side in src dst; do
		mapfile -t huffargs <"$T/$name.$side.huffargs"
		rm -f "$T/h"
		tool --operation=huff --src_file="$V/$name.$side.puff" --dst_file="$T/h" "${huffargs[@]}"
		same "$T/h" "$V/$name.$side" "$name: huff of $side.puff"
	done
	# The inner patch is plain BSDIFF40 from src.puff to dst.puff.
	bspatch "$V/$name.src.puff" "$T/q" "$T/$name.bsdiff" || die "$name: bspatch of the inner patch failed"
	same "$T/q" "$V/$name.dst.puff" "$name: inner bspatch"
	rm -f "$T/q"
	echo "$name $(sha256sum <"$V/$name.src" | cut -d' ' -f1) $(sha256sum <"$V/$name.dst" | cut -d' ' -f1)" >>"$V/cases.txt"
	echo "puffin-vectors: case $name ok" >&2
done
{
	echo "# Extents puffin's tool used, read from each NAME.patch header and checked"
	echo "# against its --verbose output. One line per value: NAME FIELD VALUE...;"
	echo "# extents as offset:length. deflates are in bits; puffs are in bytes (the"
	echo "# header stores them multiplied by 8); bsdiff_offset is where the inner"
	echo "# BSDIFF40 patch starts in NAME.patch."
	cat "$WORK/extents.txt"
} >"$V/extents.txt"

# --- provenance ------------------------------------------------------------------

pkgver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo unknown; }
(cd "$V" && find . -type f ! -name SHA256SUMS ! -name PROVENANCE.md | sed 's|^\./||' | LC_ALL=C sort |
	xargs sha256sum) >"$V/SHA256SUMS"
{
	cat <<EOF
# PUFFDIFF vectors made by puffin

Made by \`scripts/puffin-vectors.sh\`, which builds the \`puffin\` command-line tool
(\`src/main.cc\`) of Android's puffin at commit \`$COMMIT\`
(LineageOS \`android_external_puffin\`, branch \`lineage-16.0\`, 2019-08-22) and runs it;
vabc's code makes none of these bytes. Regenerate with the script; it checks
every round trip with the same tool and fails on any mismatch.

## Cases

Each case NAME has \`NAME.src\` and \`NAME.dst\` (inputs made by the script's
python3 with its zlib $(python3 -c 'import zlib; print(zlib.ZLIB_RUNTIME_VERSION)'), fixed times and a seeded
generator), \`NAME.patch\` (\`puffin --operation=puffdiff\` with the file types
below), and \`NAME.src.puff\` / \`NAME.dst.puff\` (\`puffin --operation=puff\`).
\`cases.txt\` has one line per case, \`NAME src_sha256 dst_sha256\`;
\`extents.txt\` the deflate and puff extents of each patch header.

| case | file type | what |
|---|---|---|
| \`gzip\` | \`gzip\` | 60 000 bytes of pseudo-random text, level 6, memLevel 5 (several dynamic blocks), gzip header with FNAME; new: 6 edits, level 9, FNAME and FCOMMENT |
| \`zip\` | \`zip\` | zip (python zipfile): stored entry, tiny deflated entry (fixed Huffman), empty deflated entry, 9 KB dynamic entry, one to remove; new: stored and tiny and large entries changed (large at level 9), one removed, one added |
| \`stored\` | \`gzip\` | text with random runs, level 6, memLevel 5, so zlib emits stored blocks for the random runs; new: a changed random run, edited text, and a second gzip member |
| \`deflate\` | \`deflate\` | a raw deflate stream with Z_BLOCK flushes: blocks end mid-byte, a stored block starts at an odd bit offset, a fixed block, an empty fixed block (Z_PARTIAL_FLUSH), an empty stored block (Z_SYNC_FLUSH) |
| \`bitgaps\` | \`raw\` + bit extents | puffin's own \`kDeflate11\` (deflates separated by gaps of a few bits, one zero-length extent; \`kSubblockDeflateExtents11\`) to its \`kDeflates9\` (\`kSubblockDeflateExtents9\`), passed as \`--src_deflates_bit\`/\`--dst_deflates_bit\` |
| \`blocks\` | \`zip\` | the archives of \`zip\`, each padded with zeros to whole 4096-byte blocks, as update_engine passes a file's blocks: the patch makes every byte of the destination |

For every case the script checks, with the tool: \`puffpatch\` of \`NAME.patch\` on
\`NAME.src\` gives \`NAME.dst\`; \`puffhuff\` of each side gives it back; \`huff\` of
each \`.puff\` with the header's extents gives the side back; the header's
extents equal the tool's \`--verbose\` ones and its \`puff_length\` the \`.puff\` sizes;
and Debian's \`bspatch\` of the inner patch turns \`NAME.src.puff\` into \`NAME.dst.puff\`.

What puffin does, as these show: its puffdiff splits every deflate stream the
locators find into its blocks, so the header's deflate extents are per-block
bit extents (adjacent, mostly not byte-aligned), and the puffs of adjacent
blocks follow each other with no byte between; bytes outside the deflates (gzip
headers and trailers, zip headers and stored entries) stay raw bytes of the
puff stream, and a byte in which a deflate ends and no adjacent deflate starts
becomes one raw byte holding its unused bits (so a gzip member's puff stream
has one more byte before its trailer); the header's puff extents are byte
extents multiplied by 8; \`version\` is 1.

## The inner bsdiff

puffin links AOSP's C++ bsdiff library, which is not packaged for Debian. The
script builds puffin against a shim (\`bsdiff::bsdiff\`, \`bsdiff::bspatch\` and
\`bsdiff::FileInterface\` with AOSP's signatures) that runs Debian's \`bsdiff\`
$(pkgver bsdiff) programs (classic bsdiff 4.3, BSDIFF40 with bzip2: the same
format AOSP's \`bsdiff()\` writes for puffin). So only the bytes after the PUF1
header, the inner bsdiff patch of the two puff streams, are Debian's choice of
matches rather than AOSP's; the puff streams, the deflate and puff extents, the
header and the re-huffed deflates are all puffin's code. A reader of these
patches must accept any valid BSDIFF40 inner patch, so the vectors lose
nothing for puff/huff. puffin's own \`kPatch*\` (below, inner patches by
AOSP's bsdiff) are applied by the same build, and its puffdiff writes PUF1
headers byte-identical to theirs.

Porting, in the script's temp copy only: \`main.cc\`'s fixed temp path
\`/tmp/patch.tmp\` moved into the script's temp dir; built with
\`-std=c++17 -DZLIB_CONST\` against Debian's protobuf-lite, glog and gflags
(puffin's non-brillo mode). Tools: $(g++ --version | head -n1); $(protoc --version);
libprotobuf-dev $(pkgver libprotobuf-dev); libgoogle-glog-dev $(pkgver libgoogle-glog-dev);
libgflags-dev $(pkgver libgflags-dev); zlib1g-dev $(pkgver zlib1g-dev); bsdiff $(pkgver bsdiff).

## puffin's unit-test vectors

\`unittest/\` holds every \`const Buffer\` of puffin's \`src/unittest_common.h\`
(blob \`c03aea4813748d1aa11e5e535fbb0d4387c1da60\`; its \`src/unittest_common.cc\`,
blob \`b542740f43dbc8a27234cd937185d59deb86d298\`, holds no vectors) as \`NAME.bin\`: \`kDeflates8/9\`,
\`kPuffs8/9\`, \`kPatch8To9\`, \`kPatch9To8\`, \`kPatch8ToEmpty\`, \`kPatch8ToNoDeflate\`,
and the small \`kRawN\`/\`kDeflateN\`/\`kPuffN\` sets (\`kDeflate5\` and \`kDeflate6\` are
invalid on purpose, as puffin's comments say), and \`unittest/extents.txt\` its
extent vectors. \`src/patching_unittest.cc\`
(blob \`d6327cf1e72edaf74277b71802f3f9c1888c988c\`) uses them as
\`kDeflates8\` → \`kDeflates9\` (\`kPatch8To9\`), back (\`kPatch9To8\`), to an empty
file (\`kPatch8ToEmpty\`) and to the 4 bytes \`0B 16 21 2C\` with no deflates
(\`kPatch8ToNoDeflate\`), the deflates given as \`kSubblockDeflateExtents8/9\`.
The script checks the built tool against them: \`puff\` gives \`kPuffs8\`, \`kPuffs9\`,
\`kPuff11\` (deflates given as the \`kSubblockDeflateExtents\`), and for each small
\`kDeflateN\` puffed as a whole file \`kPuffN\` followed, when the deflate ends
inside a byte, by one raw byte holding that byte's unused bits; \`puffpatch\` of each \`kPatch*\` gives its target; \`puffdiff\` writes the
same PUF1 header. The tool's own puffdiff of the same inputs (inner patch by
Debian's bsdiff) gives:

$(sed 's/^/- /' "$WORK/unitpatches.txt")

## License

puffin is under a BSD-style license (Copyright 2017 The Chromium OS Authors),
copied here as \`LICENSE.puffin\` (puffin's \`LICENSE\`, blob
\`8bafca303a770b67bf798c803ebb39d41bdfbd8f\`). The unit-test vectors are copied
from puffin's sources under it; the other files are the output of its tool.

## Files

\`SHA256SUMS\` has the same list, for \`sha256sum -c\`.

| file | bytes | sha256 |
|---|---|---|
EOF
	while read -r sum file; do
		echo "| \`$file\` | $(wc -c <"$V/$file") | \`$sum\` |"
	done <"$V/SHA256SUMS"
} >"$V/PROVENANCE.md"

# --- install ---------------------------------------------------------------------

mkdir -p "$OUT"
find "$OUT" -mindepth 1 -delete
cp -R "$V/." "$OUT/"
echo "puffin-vectors: wrote $(find "$OUT" -type f | wc -l) files ($(du -sk --apparent-size "$OUT" | cut -f1) KB) to $OUT" >&2
