#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Helpers for test-attach.sh (Python 3 standard library only).

  xdptest.py frames IFACE DST_MAC REPEAT
      Send hand-made Ethernet frames on IFACE through an AF_PACKET socket
      (run it inside the sending namespace): RoCEv2 frames the program must
      steer, frames it must pass, and malformed ones. Prints the number sent
      per expected class as `roce=N passed=N malformed=N`.
  xdptest.py counters MAP_ID
      Sum the per-CPU "counters" map over CPUs (via `bpftool -j map dump`) and
      print `redirected=N passed=N malformed=N dropped_by_knob=N
      roce_no_socket=N`.
  xdptest.py udp-send ADDR PORT COUNT SIZE
      Send COUNT UDP datagrams of SIZE bytes to ADDR:PORT (unconnected
      sendto, so ICMP errors do not abort the loop; paced lightly so the
      veth ring never overflows).
  xdptest.py udp-listen PORT OUT_FILE
      Count UDP datagrams received on PORT (IPv4 and IPv6) and rewrite
      OUT_FILE with the count after each one. Runs until killed.
  xdptest.py tcp-echo ADDR PORT
      Accept one TCP connection, read one line, answer "echo: LINE", exit.
"""

import json
import os
import socket
import struct
import subprocess
import sys
import time

# Keep in step with xroce_xdp_maps.h.
COUNTER_NAMES = ["redirected", "passed", "malformed", "dropped_by_knob", "roce_no_socket"]

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_ARP = 0x0806
ETH_P_8021Q = 0x8100
ETH_P_8021AD = 0x88A8
ROCE_PORT = 4791

# Addresses of the hand-made frames: in the test's prefixes but assigned to no
# interface, so the receiving kernel discards the frames the program passes
# (they must not reach the test's UDP listener and skew its count).
SRC4 = bytes([10, 99, 0, 253])
DST4 = bytes([10, 99, 0, 254])
SRC6 = bytes.fromhex("fd0000990000ffff0000000000000001")
DST6 = bytes.fromhex("fd0000990000ffff0000000000000002")

# A fake BTH (RC SEND ONLY, QP 0x11, PSN 1) + 16 bytes of payload + 4-byte "ICRC".
ROCE_PAYLOAD = bytes([0x04, 0x40, 0xFF, 0xFF, 0, 0, 0, 0x11, 0, 0, 0, 1]) + bytes(16) + b"ICRC"


def csum16(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return (~total) & 0xFFFF


def mac(text):
    return bytes(int(part, 16) for part in text.split(":"))


def eth(dst, src, ethertype, tags=()):
    """Ethernet header; tags is a sequence of (tpid, vid) outermost first."""
    header = dst + src
    for tpid, vid in tags:
        header += struct.pack("!HH", tpid, vid & 0x0FFF)
    return header + struct.pack("!H", ethertype)


def udp(sport, dport, payload):
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def ipv4(proto, payload, ihl=5, frag_off=0x4000, version=4, options=None):
    if options is None:
        options = b"\x01" * (ihl * 4 - 20)  # NOPs
    total = 20 + len(options) + len(payload)
    header = struct.pack(
        "!BBHHHBBH4s4s", (version << 4) | ihl, 0, total, 0x1234, frag_off, 64, proto, 0, SRC4, DST4
    ) + options
    header = header[:10] + struct.pack("!H", csum16(header)) + header[12:]
    return header + payload


def ipv6(nexthdr, payload, version=6):
    return struct.pack("!IHBB16s16s", version << 28, len(payload), nexthdr, 64, SRC6, DST6) + payload


def cases(dst, src):
    """(name, expected class, frame)."""
    roce_udp = udp(49152, ROCE_PORT, ROCE_PAYLOAD)
    q = (ETH_P_8021Q, 100)
    ad = (ETH_P_8021AD, 200)
    e4 = lambda tags=(): eth(dst, src, ETH_P_IP, tags)  # noqa: E731
    e6 = lambda tags=(): eth(dst, src, ETH_P_IPV6, tags)  # noqa: E731
    hop_by_hop = bytes([17, 0, 1, 4, 0, 0, 0, 0])  # next=UDP, len 0, PadN
    fragment_hdr = struct.pack("!BBHI", 17, 0, 0, 0x1234)
    return [
        # Steered to xsks_map (or the kernel when no socket): RoCEv2.
        ("ipv4 udp/4791", "roce", e4() + ipv4(17, roce_udp)),
        ("ipv4 ihl=6 udp/4791", "roce", e4() + ipv4(17, roce_udp, ihl=6)),
        ("ipv4 ihl=15 udp/4791", "roce", e4() + ipv4(17, roce_udp, ihl=15)),
        ("802.1Q ipv4 udp/4791", "roce", e4([q]) + ipv4(17, roce_udp)),
        ("802.1ad+802.1Q ipv4 udp/4791", "roce", e4([ad, q]) + ipv4(17, roce_udp)),
        ("802.1Q+802.1Q ipv4 udp/4791", "roce", e4([q, q]) + ipv4(17, roce_udp)),
        ("ipv6 udp/4791", "roce", e6() + ipv6(17, roce_udp)),
        ("802.1Q ipv6 udp/4791", "roce", e6([q]) + ipv6(17, roce_udp)),
        ("802.1ad+802.1Q ipv6 udp/4791", "roce", e6([ad, q]) + ipv6(17, roce_udp)),
        # Returned to the kernel, not ours.
        ("ipv4 udp/4792", "passed", e4() + ipv4(17, udp(49152, 4792, ROCE_PAYLOAD))),
        ("ipv4 udp src 4791 dst 5000", "passed", e4() + ipv4(17, udp(4791, 5000, ROCE_PAYLOAD))),
        ("ipv4 tcp/4791", "passed", e4() + ipv4(6, struct.pack("!HHIIHHHH", 49152, 4791, 0, 0, 0x5002, 0, 0, 0))),
        ("ipv4 first fragment (MF) udp/4791", "passed", e4() + ipv4(17, roce_udp, frag_off=0x2000)),
        ("ipv4 later fragment (offset 8) udp-like/4791", "passed", e4() + ipv4(17, roce_udp, frag_off=0x0001)),
        ("ipv6 hop-by-hop then udp/4791", "passed", e6() + ipv6(0, hop_by_hop + roce_udp)),
        ("ipv6 fragment header then udp/4791", "passed", e6() + ipv6(44, fragment_hdr + roce_udp)),
        ("3 vlan tags ipv4 udp/4791", "passed", e4([ad, q, q]) + ipv4(17, roce_udp)),
        ("arp", "passed", eth(dst, src, ETH_P_ARP) + bytes(28)),
        ("ethertype 0x88b5", "passed", eth(dst, src, 0x88B5) + bytes(46)),
        # Malformed: too short for a header the program reads, or bad version/IHL.
        ("ipv4 ethertype, no ip header", "malformed", e4()),
        ("802.1Q tag cut short", "malformed", eth(dst, src, ETH_P_8021Q)[:12] + struct.pack("!HH", ETH_P_8021Q, 100)),
        ("second tag cut short", "malformed", (eth(dst, src, 0, [ad]))[:16] + struct.pack("!HH", ETH_P_8021Q, 100)),
        ("ipv4 header cut short", "malformed", e4() + ipv4(17, roce_udp)[:19]),
        ("ipv4 ihl=4", "malformed", e4() + ipv4(17, roce_udp, ihl=4, options=b"")),
        ("ipv4 ethertype with version 6", "malformed", e4() + ipv4(17, roce_udp, version=6)),
        ("ipv4 ihl=15, udp header missing", "malformed", e4() + ipv4(17, b"", ihl=15) + roce_udp[:4]),
        ("ipv4 udp header cut short", "malformed", e4() + ipv4(17, roce_udp[:7])),
        ("ipv6 header cut short", "malformed", e6() + ipv6(17, roce_udp)[:39]),
        ("ipv6 ethertype with version 4", "malformed", e6() + ipv6(17, roce_udp, version=4)),
        ("ipv6 udp header cut short", "malformed", e6() + ipv6(17, roce_udp[:7])),
    ]


def cmd_frames(iface, dst_mac, repeat):
    with open("/sys/class/net/%s/address" % iface) as f:
        src = mac(f.read().strip())
    dst = mac(dst_mac)
    sent = {"roce": 0, "passed": 0, "malformed": 0}
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    sock.bind((iface, 0))
    for _ in range(int(repeat)):
        for name, cls, frame in cases(dst, src):
            n = sock.send(frame)
            if n != len(frame):
                sys.exit("short send for %s: %d of %d" % (name, n, len(frame)))
            sent[cls] += 1
    sock.close()
    print(" ".join("%s=%d" % kv for kv in sent.items()))


def cmd_counters(map_id):
    out = subprocess.run(
        ["bpftool", "-j", "map", "dump", "id", str(map_id)], check=True, capture_output=True, text=True, timeout=10
    ).stdout
    totals = [0] * len(COUNTER_NAMES)
    for entry in json.loads(out):
        key = int.from_bytes(bytes(int(b, 16) for b in entry["key"]), "little")
        for per_cpu in entry["values"]:
            if key < len(totals):
                totals[key] += int.from_bytes(bytes(int(b, 16) for b in per_cpu["value"]), "little")
    print(" ".join("%s=%d" % (n, v) for n, v in zip(COUNTER_NAMES, totals)))


def cmd_udp_send(addr, port, count, size):
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    payload = bytes(int(size))
    for i in range(int(count)):
        sock.sendto(payload, (addr, int(port)))
        if i % 32 == 31:
            time.sleep(0.002)
    sock.close()


def write_count(out_file, count):
    with open(out_file + ".tmp", "w") as f:
        f.write("%d\n" % count)
    os.replace(out_file + ".tmp", out_file)


def cmd_udp_listen(port, out_file):
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # v4-mapped too
    SO_RCVBUFFORCE = 33  # root: not capped by net.core.rmem_max
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    sock.bind(("::", int(port)))
    count = 0
    write_count(out_file, count)
    while True:
        sock.recv(65535)
        count += 1
        while True:  # drain what is queued, then write the count once
            try:
                sock.recv(65535, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            count += 1
        write_count(out_file, count)


def cmd_tcp_echo(addr, port):
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, int(port)))
    srv.listen(1)
    conn, _ = srv.accept()
    conn.settimeout(10)
    line = conn.makefile("rb").readline()
    conn.sendall(b"echo: " + line)
    conn.close()
    srv.close()


def main(argv):
    commands = {
        "frames": (cmd_frames, 3),
        "counters": (cmd_counters, 1),
        "udp-send": (cmd_udp_send, 4),
        "udp-listen": (cmd_udp_listen, 2),
        "tcp-echo": (cmd_tcp_echo, 2),
    }
    if len(argv) < 2 or argv[1] not in commands or len(argv) - 2 != commands[argv[1]][1]:
        sys.exit(__doc__)
    func, _ = commands[argv[1]]
    func(*argv[2:])


if __name__ == "__main__":
    main(sys.argv)
