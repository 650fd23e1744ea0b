/* SPDX-License-Identifier: MIT OR Apache-2.0 */
/*
 * xroce_xdp_maps.h - the contract between the XDP steering program
 * (xroce_xdp.c) and whatever loads it and reads its maps (the Rust
 * `cargo xtask xdp` loader and the AF_XDP engine).
 *
 * Plain C preprocessor constants only, no includes and no types, so that the
 * BPF program, a userspace C tool and a hand-written Rust mirror can all use
 * the same numbers. If you change anything here, change the Rust mirror in
 * the same commit: map names, sizes and counter indices are ABI.
 *
 * Maps (all looked up by name in the object / by the names bpftool shows):
 *
 *   "xsks_map"     BPF_MAP_TYPE_XSKMAP, key u32 = receive queue index,
 *                  value u32 = AF_XDP socket fd (written by userspace),
 *                  XROCE_XSKS_MAP_ENTRIES entries. Frames arriving on a queue
 *                  >= XROCE_XSKS_MAP_ENTRIES, or on a queue whose slot is
 *                  empty, go to the kernel (XDP_PASS).
 *
 *   "counters"     BPF_MAP_TYPE_PERCPU_ARRAY, key u32 = XROCE_CNT_*,
 *                  value u64 frame count per CPU (sum over CPUs to read).
 *                  XROCE_CNT_MAX entries. Every frame the program sees
 *                  increments exactly one counter, so the sum of all
 *                  counters is the number of frames the program has run on.
 *
 *   "drop_config"  BPF_MAP_TYPE_ARRAY, 1 entry, key u32 = 0, value u32 N:
 *                  TEST-ONLY fault injection. When N != 0 each RoCEv2 frame
 *                  (and only those) is dropped with probability 1/N
 *                  (bpf_get_prandom_u32() % N == 0) before the redirect.
 *                  N = 0 (the value after load) never drops. N = 100 drops
 *                  about 1 %, N = 1 drops every RoCEv2 frame.
 *
 *   "local_addrs"  BPF_MAP_TYPE_HASH, key 16 bytes = a destination address
 *                  of this interface's xroce device (an IPv6 address, or an
 *                  IPv4 address as ::ffff:a.b.c.d), value u32 (ignored),
 *                  XROCE_LOCAL_ADDRS_ENTRIES entries. Written by the engine:
 *                  its GID table, kept up to date as addresses change.
 *
 *   "local_list"   BPF_MAP_TYPE_ARRAY, 1 entry, key u32 = 0, value: u32
 *                  count, u32 reserved (0), then XROCE_LOCAL_LIST_ENTRIES
 *                  addresses of 16 bytes (as local_addrs keys them), the
 *                  first `count` of them in use. Written by the engine with
 *                  the same addresses as local_addrs when they fit; the
 *                  program looks there instead of local_addrs only while
 *                  XROCE_STEER_BY_LIST is set.
 *
 *   "steer_config" BPF_MAP_TYPE_ARRAY, 1 entry, key u32 = 0, value u32
 *                  flags. XROCE_STEER_ONLY_LOCAL: a RoCEv2 frame whose
 *                  destination address is not in local_addrs goes to the
 *                  kernel (counted PASSED): RoCE for a macvlan or VLAN device
 *                  on this interface, for an address on another device, or
 *                  routed through this host is not the engine's. 0 (the
 *                  value after load) steers every RoCEv2 frame, as raw
 *                  AF_XDP users of the program expect; an engine sets the
 *                  flag once it has filled local_addrs. XROCE_STEER_BY_LIST
 *                  (with XROCE_STEER_ONLY_LOCAL): local_list holds every
 *                  address of local_addrs, and the program compares the
 *                  destination with those instead of hashing it for
 *                  local_addrs. An engine sets it after writing local_list,
 *                  and writes the flags without it before local_list stops
 *                  holding them all. Whoever writes plain
 *                  XROCE_STEER_ONLY_LOCAL (an xroce from before the list)
 *                  gets local_addrs looked up for every frame, as before.
 */
#ifndef XROCE_XDP_MAPS_H
#define XROCE_XDP_MAPS_H

/* RoCEv2 well-known UDP destination port (IANA). */
#define XROCE_ROCE_UDP_PORT 4791

/* VLAN tags (802.1Q 0x8100 or 802.1ad 0x88A8, in any order) skipped before
 * the IP header. A frame with more tags than this is passed to the kernel. */
#define XROCE_MAX_VLAN_TAGS 2

/* Map names, as in the object file and as bpftool shows them. */
#define XROCE_XSKS_MAP_NAME "xsks_map"
#define XROCE_COUNTERS_MAP_NAME "counters"
#define XROCE_DROP_CONFIG_MAP_NAME "drop_config"
#define XROCE_LOCAL_ADDRS_MAP_NAME "local_addrs"
#define XROCE_STEER_CONFIG_MAP_NAME "steer_config"
#define XROCE_LOCAL_LIST_MAP_NAME "local_list"

/* local_addrs size: the addresses of one interface (a GID table's worth). */
#define XROCE_LOCAL_ADDRS_ENTRIES 64

/* local_list size: addresses compared one by one; more go by local_addrs alone. */
#define XROCE_LOCAL_LIST_ENTRIES 8

/* xsks_map size: queue indices 0 .. 63 can be steered. */
#define XROCE_XSKS_MAP_ENTRIES 64

/*
 * Counter indices in "counters". Each frame increments exactly one:
 *
 * 0 REDIRECTED      RoCEv2 frame (UDP dst 4791) for which bpf_redirect_map()
 *                   found an AF_XDP socket in xsks_map[rx_queue_index] and
 *                   returned XDP_REDIRECT. This counts frames *handed to* the
 *                   socket layer; if the socket then cannot take the frame
 *                   (RX ring or fill ring empty, frame larger than a UMEM
 *                   chunk without XDP_USE_SG, socket bound to another queue)
 *                   the kernel drops it and counts it in the socket's
 *                   XDP_STATISTICS (rx_dropped, rx_ring_full, ...), not here.
 * 1 PASSED          Frame that is not RoCEv2 and was returned to the kernel
 *                   (XDP_PASS): non-IP, IPv4 fragments, IPv6 with extension
 *                   headers, non-UDP, UDP to another port, more than
 *                   XROCE_MAX_VLAN_TAGS tags; and, with
 *                   XROCE_STEER_ONLY_LOCAL, RoCEv2 to an address not in
 *                   local_addrs.
 * 2 MALFORMED       Frame too short for a header the program had to read
 *                   (Ethernet, a VLAN tag, IPv4, IPv6, UDP), or an IPv4 header
 *                   with version != 4 or IHL < 5, or IPv6 with version != 6.
 *                   Returned to the kernel (XDP_PASS), which drops it.
 * 3 DROPPED_BY_KNOB RoCEv2 frame dropped (XDP_DROP) by the drop_config
 *                   test knob.
 * 4 ROCE_NO_SOCKET  RoCEv2 frame for which xsks_map[rx_queue_index] held no
 *                   socket (none bound, engine exited, queue >= 64), so
 *                   bpf_redirect_map() fell back to XDP_PASS and the kernel
 *                   got the frame (where rdma_rxe, a UDP socket on 4791, or
 *                   an ICMP port unreachable handles it).
 *
 * "RoCEv2 frames seen" = REDIRECTED + DROPPED_BY_KNOB + ROCE_NO_SOCKET.
 * "Frames returned to the kernel" = PASSED + MALFORMED + ROCE_NO_SOCKET.
 */
#define XROCE_CNT_REDIRECTED 0
#define XROCE_CNT_PASSED 1
#define XROCE_CNT_MALFORMED 2
#define XROCE_CNT_DROPPED_BY_KNOB 3
#define XROCE_CNT_ROCE_NO_SOCKET 4
#define XROCE_CNT_MAX 5

/* The single key of drop_config. */
#define XROCE_DROP_CONFIG_KEY 0

/* The single key of steer_config, and its flags. */
#define XROCE_STEER_CONFIG_KEY 0
#define XROCE_STEER_ONLY_LOCAL 1
#define XROCE_STEER_BY_LIST 2

/* The single key of local_list. */
#define XROCE_LOCAL_LIST_KEY 0

/*
 * Program names and ELF sections of the two builds of xroce_xdp.c.
 * The names are at most 15 characters (BPF_OBJ_NAME_LEN - 1) so the kernel
 * keeps them whole, and `bpftool prog show` / `status` can tell which build
 * is attached.
 *
 *   plain build (xroce_xdp.o):        section "xdp",       name "xroce_xdp"
 *   frags build (xroce_xdp_frags.o):  section "xdp.frags", name "xroce_xdp_frags"
 *
 * The plain build is refused (ERANGE) on a veth whose peer MTU exceeds 3506
 * and on drivers whose single-buffer XDP limit is below the MTU; the frags
 * build (BPF_F_XDP_HAS_FRAGS) attaches at any MTU the driver supports.
 */
#define XROCE_PROG_NAME_PLAIN "xroce_xdp"
#define XROCE_PROG_SEC_PLAIN "xdp"
#define XROCE_PROG_NAME_FRAGS "xroce_xdp_frags"
#define XROCE_PROG_SEC_FRAGS "xdp.frags"

#endif /* XROCE_XDP_MAPS_H */
