#!/usr/bin/env python3
"""Seeds the fuzz corpus with the frames of the test fixtures' captures.

Writes each frame of every classic pcap file given (default: tests/fixtures/pcap/*.pcap) to
fuzz/corpus/parse_frame/, one file per frame, named after its capture and index. Python 3
standard library only. Run from the repository root: python3 fuzz/seed_corpus.py
"""

import glob
import os
import struct
import sys

OUT = os.path.join("fuzz", "corpus", "parse_frame")


def frames(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 24:
        raise ValueError(f"{path}: too short for a pcap header")
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        endian = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        endian = ">"
    else:
        raise ValueError(f"{path}: not a classic pcap file (pcapng is not read here)")
    off = 24
    while off + 16 <= len(data):
        _, _, incl_len, _ = struct.unpack(endian + "IIII", data[off : off + 16])
        off += 16
        if off + incl_len > len(data):
            raise ValueError(f"{path}: truncated record at byte {off - 16}")
        yield data[off : off + incl_len]
        off += incl_len


def main():
    paths = sys.argv[1:] or sorted(glob.glob(os.path.join("tests", "fixtures", "pcap", "*.pcap")))
    if not paths:
        sys.exit("no captures given and none under tests/fixtures/pcap (run from the repository root)")
    os.makedirs(OUT, exist_ok=True)
    total = 0
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        for i, frame in enumerate(frames(path)):
            with open(os.path.join(OUT, f"{name}-{i:04}"), "wb") as out:
                out.write(frame)
            total += 1
    print(f"{total} frames from {len(paths)} captures in {OUT}/")


if __name__ == "__main__":
    main()
