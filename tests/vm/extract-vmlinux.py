#!/usr/bin/env python3
"""Extract the ELF vmlinux from an x86 bzImage.

The bzImage's setup header says where the compressed kernel lies (payload_offset and
payload_length, boot protocol 2.08+); its first bytes say how it is compressed. The
ELF inside carries the PVH entry note, so QEMU can boot it directly with -kernel.
Usage: extract-vmlinux.py BZIMAGE OUT
"""
import gzip
import os
import lzma
import struct
import subprocess
import sys


def main() -> int:
    src, out = sys.argv[1], sys.argv[2]
    img = open(src, "rb").read()
    if img[0x202:0x206] != b"HdrS":
        sys.exit(f"{src}: not a bzImage (no HdrS setup header at offset 0x202)")
    setup_sects = img[0x1F1] or 4
    off, length = struct.unpack_from("<II", img, 0x248)
    start = (setup_sects + 1) * 512 + off
    payload = img[start : start + length]
    if payload.startswith(b"\xfd7zXZ"):
        # The kernel's xz stream has a CRC32 check and may be followed by padding.
        data = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    elif payload.startswith(b"\x28\xb5\x2f\xfd"):
        # The build appends the uncompressed size (4 bytes), which zstd would take for a
        # truncated frame.
        data = subprocess.run(["zstd", "-dcq"], input=payload[:-4], capture_output=True, check=True).stdout
    elif payload.startswith(b"\x1f\x8b"):
        data = gzip.decompress(payload)
    elif payload.startswith(b"\x5d\x00\x00"):
        data = lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(payload)
    else:
        sys.exit(f"{src}: unknown compression at offset {start}: {payload[:4].hex()}")
    if not data.startswith(b"\x7fELF"):
        sys.exit(f"{src}: the decompressed payload is not an ELF file")
    with open(out + ".tmp", "wb") as f:
        f.write(data)


    os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
