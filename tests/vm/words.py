#!/usr/bin/env python3
"""Deterministic text of words, the VM scenarios' partition contents.

  words.py SEED BYTES   writes BYTES bytes of seed SEED's words to stdout

Words compress like a system's files, so a bundle stays small while the merge
still has whole blocks to write. Also imported (text(seed, n)) by the scenarios'
image makers.
"""
import random
import sys


def text(seed, n):
    r = random.Random(seed)
    words = [bytes(r.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 9))) for _ in range(4096)]
    out = bytearray()
    while len(out) < n:
        out += r.choice(words) + b" "
    return bytes(out[:n])


if __name__ == "__main__":
    sys.stdout.buffer.write(text(int(sys.argv[1]), int(sys.argv[2])))
