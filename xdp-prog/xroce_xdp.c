// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * xroce_xdp.c - XDP program that steers RoCEv2 frames to AF_XDP sockets.
 *
 * For every received frame:
 *
 *   Ethernet, then up to two VLAN tags (802.1Q 0x8100 / 802.1ad 0x88A8,
 *   in any order), then
 *     IPv4: any IHL (options skipped to find the port; the engine then
 *           drops such frames, whose ICRC rdma_rxe would not match either,
 *           as it computes it over a 20-byte header); fragments (MF set or non-zero
 *           offset) are not steered, since only the first fragment carries
 *           the UDP header and xroce sends with DF anyway;
 *     IPv6: the fixed header only; a next header other than UDP (including
 *           any extension header) is not steered;
 *   then UDP with destination port 4791 (RoCEv2) and, once the engine has
 *   set XROCE_STEER_ONLY_LOCAL in steer_config, a destination address in
 *   local_addrs, or in local_list while XROCE_STEER_BY_LIST is set (the xroce
 *   device's own; RoCE for other devices and hosts stays the kernel's):
 *     -> bpf_redirect_map(&xsks_map, ctx->rx_queue_index, XDP_PASS)
 *        i.e. to the AF_XDP socket registered for the receive queue, or to
 *        the kernel (XDP_PASS) when that slot is empty.
 *   Everything else -> XDP_PASS: the kernel keeps ARP, ND, ICMP, TCP, ...
 *
 * The program only checks what it reads; the userspace parser validates the
 * rest of a steered frame (lengths, checksums, ICRC).
 *
 * Maps, counter indices and the test-only drop knob are described in
 * xroce_xdp_maps.h, which loaders mirror. In short: "xsks_map" (XSKMAP, 64
 * entries, key = rx queue), "counters" (per-CPU array, index 0 redirected,
 * 1 passed, 2 malformed, 3 dropped_by_knob, 4 roce_no_socket; each frame
 * bumps exactly one), "drop_config" (array, 1 u32: drop 1 in N RoCEv2
 * frames, 0 = never), "local_addrs" (hash of the device's addresses),
 * "local_list" (array, 1 entry: the same addresses as a short list, when they
 * fit) and "steer_config" (array, 1 u32 of flags).
 *
 * Two builds come from this file (see build.sh):
 *   default       SEC("xdp")        program "xroce_xdp"
 *   -DXROCE_FRAGS SEC("xdp.frags")  program "xroce_xdp_frags"
 * The frags build may be attached where frames span several buffers
 * (veth peer MTU above 3506, jumbo frames on multi-buffer drivers). It only
 * parses the first buffer (ctx->data .. ctx->data_end). Drivers put the
 * start of the frame there (veth: up to a page; NICs: at least the headers),
 * and the headers read here are at most 70 bytes (14 + 2 * 4 + 40 + 8); a
 * frame whose first buffer is shorter than its headers would count as
 * malformed and go to the kernel.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/types.h>
#include <linux/udp.h>

#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "xroce_xdp_maps.h"

/*
 * Licence string. The kernel lets a BPF program call GPL-only helpers (for
 * example bpf_trace_printk, handy when debugging this file) only when this
 * string is one of the GPL-compatible ones it knows ("GPL", "Dual BSD/GPL",
 * "Dual MIT/GPL", ...). The helpers used today (bpf_redirect_map,
 * bpf_map_lookup_elem, bpf_get_prandom_u32) are not GPL-only, but a
 * compatible string keeps that door open and costs nothing.
 * "Dual MIT/GPL" is on the kernel's list, and its MIT half is the MIT option
 * of this project's "MIT OR Apache-2.0": MIT-licensed code may be combined
 * with and redistributed under the GPL, so the string is a true statement
 * about this source.
 */
char LICENSE[] SEC("license") = "Dual MIT/GPL";

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, XROCE_XSKS_MAP_ENTRIES);
	__type(key, __u32);
	__type(value, __u32);
} xsks_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XROCE_CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* Test-only fault injection: drop 1 in N RoCEv2 frames, 0 = never. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} drop_config SEC(".maps");

/* The xroce device's addresses (IPv4 as ::ffff:a.b.c.d), written by its engine.
 * Also seen as two 8-byte words, so that two compare in two steps. */
struct xroce_addr {
	union {
		__u8 bytes[16];
		__u64 words[2];
	};
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XROCE_LOCAL_ADDRS_ENTRIES);
	__type(key, struct xroce_addr);
	__type(value, __u32);
} local_addrs SEC(".maps");

/* Flags (XROCE_STEER_ONLY_LOCAL, XROCE_STEER_BY_LIST), 0 after load. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} steer_config SEC(".maps");

/*
 * The addresses of local_addrs again, as a list, when there are at most
 * XROCE_LOCAL_LIST_ENTRIES of them (a device's usual one to four): comparing
 * a destination with each is cheaper than hashing it for local_addrs (about
 * 15 ns of the program's 43-45 per frame on a veth pair, bpf_stats).
 */
struct xroce_local_list {
	__u32 count;
	__u32 reserved;
	struct xroce_addr addrs[XROCE_LOCAL_LIST_ENTRIES];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct xroce_local_list);
} local_list SEC(".maps");

/* 802.1Q / 802.1ad tag as it follows the outer EtherType (not in uapi). */
struct xroce_vlan_hdr {
	__be16 tci;
	__be16 encap_proto;
};

/* IPv4 frag_off bits (kernel-internal in include/net/ip.h). */
#define XROCE_IP_MF 0x2000
#define XROCE_IP_OFFSET 0x1fff

enum xroce_class {
	XROCE_CLASS_ROCE,
	XROCE_CLASS_OTHER,
	XROCE_CLASS_MALFORMED,
};

static __always_inline void xroce_count(__u32 index)
{
	__u64 *value = bpf_map_lookup_elem(&counters, &index);

	/* Per-CPU slot, and XDP does not nest on one CPU: no atomic needed. */
	if (value)
		*value += 1;
}

/* Classifies the frame; for RoCEv2 also fills *dst with its destination. */
static __always_inline enum xroce_class xroce_classify(struct xdp_md *ctx,
						       struct xroce_addr *dst)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct udphdr *udp;
	void *cursor;
	__be16 proto;

	if ((void *)(eth + 1) > data_end)
		return XROCE_CLASS_MALFORMED;
	proto = eth->h_proto;
	cursor = eth + 1;

#pragma unroll
	for (int i = 0; i < XROCE_MAX_VLAN_TAGS; i++) {
		struct xroce_vlan_hdr *vlan = cursor;

		if (proto != bpf_htons(ETH_P_8021Q) &&
		    proto != bpf_htons(ETH_P_8021AD))
			break;
		if ((void *)(vlan + 1) > data_end)
			return XROCE_CLASS_MALFORMED;
		proto = vlan->encap_proto;
		cursor = vlan + 1;
	}

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = cursor;

		if ((void *)(ip + 1) > data_end)
			return XROCE_CLASS_MALFORMED;
		if (ip->version != 4 || ip->ihl < 5)
			return XROCE_CLASS_MALFORMED;
		if (ip->frag_off & bpf_htons(XROCE_IP_MF | XROCE_IP_OFFSET))
			return XROCE_CLASS_OTHER;
		if (ip->protocol != IPPROTO_UDP)
			return XROCE_CLASS_OTHER;
		/* ihl is 4 bits: the offset is 20..60, which the verifier
		 * tracks; the UDP bounds check below covers the options. */
		cursor = (void *)ip + ip->ihl * 4;
		dst->bytes[10] = 0xff;
		dst->bytes[11] = 0xff;
		__builtin_memcpy(&dst->bytes[12], &ip->daddr, 4);
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = cursor;

		if ((void *)(ip6 + 1) > data_end)
			return XROCE_CLASS_MALFORMED;
		if (ip6->version != 6)
			return XROCE_CLASS_MALFORMED;
		if (ip6->nexthdr != IPPROTO_UDP)
			return XROCE_CLASS_OTHER;
		cursor = ip6 + 1;
		__builtin_memcpy(dst->bytes, &ip6->daddr, 16);
	} else {
		/* ARP, LLDP, a third VLAN tag, ...: not ours. */
		return XROCE_CLASS_OTHER;
	}

	udp = cursor;
	if ((void *)(udp + 1) > data_end)
		return XROCE_CLASS_MALFORMED;
	if (udp->dest != bpf_htons(XROCE_ROCE_UDP_PORT))
		return XROCE_CLASS_OTHER;
	return XROCE_CLASS_ROCE;
}

/* True when the test-only knob says to drop this RoCEv2 frame. */
static __always_inline int xroce_knob_drops(void)
{
	__u32 key = XROCE_DROP_CONFIG_KEY;
	__u32 *config = bpf_map_lookup_elem(&drop_config, &key);
	__u32 n;

	if (!config)
		return 0;
	n = *config; /* read once: userspace may change it concurrently */
	if (n == 0)
		return 0;
	return bpf_get_prandom_u32() % n == 0;
}

/* True when dst is one of the list's addresses. */
static __always_inline int xroce_in_list(const struct xroce_local_list *list,
					 const struct xroce_addr *dst)
{
	__u32 count = list->count;

	for (__u32 i = 0; i < XROCE_LOCAL_LIST_ENTRIES; i++) {
		if (i >= count)
			break;
		if (list->addrs[i].words[0] == dst->words[0] &&
		    list->addrs[i].words[1] == dst->words[1])
			return 1;
	}
	return 0;
}

/* False when the engine asked for its own addresses only and dst is not one. */
static __always_inline int xroce_for_engine(const struct xroce_addr *dst)
{
	__u32 key = XROCE_STEER_CONFIG_KEY;
	__u32 *config = bpf_map_lookup_elem(&steer_config, &key);
	struct xroce_local_list *list;
	__u32 flags;

	if (!config)
		return 1;
	flags = *(volatile __u32 *)config; /* read once: an engine writes it */
	if (!(flags & XROCE_STEER_ONLY_LOCAL))
		return 1;
	if (flags & XROCE_STEER_BY_LIST) {
		key = XROCE_LOCAL_LIST_KEY;
		list = bpf_map_lookup_elem(&local_list, &key);
		if (list)
			return xroce_in_list(list, dst);
	}
	return bpf_map_lookup_elem(&local_addrs, dst) != NULL;
}

static __always_inline int xroce_steer(struct xdp_md *ctx)
{
	struct xroce_addr dst = {};
	long action;

	switch (xroce_classify(ctx, &dst)) {
	case XROCE_CLASS_MALFORMED:
		xroce_count(XROCE_CNT_MALFORMED);
		return XDP_PASS;
	case XROCE_CLASS_OTHER:
		xroce_count(XROCE_CNT_PASSED);
		return XDP_PASS;
	case XROCE_CLASS_ROCE:
		break;
	}

	if (!xroce_for_engine(&dst)) {
		xroce_count(XROCE_CNT_PASSED);
		return XDP_PASS;
	}

	if (xroce_knob_drops()) {
		xroce_count(XROCE_CNT_DROPPED_BY_KNOB);
		return XDP_DROP;
	}

	/* The low bits of the flags argument are the action returned when
	 * xsks_map has no socket at this key (or the key is out of range). */
	action = bpf_redirect_map(&xsks_map, ctx->rx_queue_index, XDP_PASS);
	if (action == XDP_REDIRECT)
		xroce_count(XROCE_CNT_REDIRECTED);
	else
		xroce_count(XROCE_CNT_ROCE_NO_SOCKET);
	return (int)action;
}

#ifdef XROCE_FRAGS
SEC("xdp.frags")
int xroce_xdp_frags(struct xdp_md *ctx)
{
	return xroce_steer(ctx);
}
#else
SEC("xdp")
int xroce_xdp(struct xdp_md *ctx)
{
	return xroce_steer(ctx);
}
#endif
