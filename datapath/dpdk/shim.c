/* SPDX-License-Identifier: MIT OR Apache-2.0
 *
 * xroce's calls into DPDK, for the DPDK port (cargo feature `dpdk`).
 *
 * DPDK's receive, transmit and mbuf calls are static inline functions in its headers, which
 * Rust cannot call; each one the port needs is wrapped here, with the port's set-up and
 * teardown. Nothing here keeps state: the Rust side owns the port, its pool and its mbufs.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <rte_bus_vdev.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>

/* Starts DPDK's environment abstraction layer. rte_eal_init pins the calling thread to the
 * main lcore's CPUs; the thread is an application's (a verb's caller), so its affinity is put
 * back afterwards. Returns 0, or -rte_errno. */
int xroce_dpdk_eal_init(int argc, char **argv)
{
	cpu_set_t saved;
	int have = pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0;
	int ret = rte_eal_init(argc, argv);
	int err = rte_errno;

	if (have)
		pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
	if (ret >= 0)
		return 0;
	return err > 0 ? -err : -EINVAL;
}

const char *xroce_dpdk_strerror(int err)
{
	return rte_strerror(err < 0 ? -err : err);
}

/* Creates the virtual device `name` with `args` (e.g. "iface=eth0,framesz=4608"), a pool of
 * `mbufs` buffers of `data_room` bytes each, and starts the device with one receive and one
 * transmit queue. Returns 0, or a negative errno with `what` naming the step that failed. */
int xroce_dpdk_open(const char *name, const char *args, const char *pool_name, unsigned mbufs,
		    uint16_t data_room, uint16_t *port_out, struct rte_mempool **pool_out,
		    const char **what)
{
	struct rte_eth_conf conf;
	struct rte_mempool *pool = NULL;
	uint16_t port, rx_desc = 1024, tx_desc = 1024;
	int ret;

	/* The pool first: a device probed and then given up keeps its packet sockets open (the
	 * driver closes them only when a started device stops). */
	*what = "create the buffer pool";
	pool = rte_pktmbuf_pool_create(pool_name, mbufs, 0, 0,
				       (uint16_t)(RTE_PKTMBUF_HEADROOM + data_room), SOCKET_ID_ANY);
	if (pool == NULL)
		return rte_errno > 0 ? -rte_errno : -ENOMEM;
	*what = "create the virtual device";
	ret = rte_vdev_init(name, args);
	if (ret < 0)
		goto free_pool;
	*what = "find the device's port";
	ret = rte_eth_dev_get_port_by_name(name, &port);
	if (ret < 0)
		goto uninit;
	memset(&conf, 0, sizeof(conf));
	*what = "configure the device";
	ret = rte_eth_dev_configure(port, 1, 1, &conf);
	if (ret < 0)
		goto close;
	ret = rte_eth_dev_adjust_nb_rx_tx_desc(port, &rx_desc, &tx_desc);
	if (ret < 0)
		goto close;
	*what = "set up the receive queue";
	ret = rte_eth_rx_queue_setup(port, 0, rx_desc, SOCKET_ID_ANY, NULL, pool);
	if (ret < 0)
		goto close;
	*what = "set up the transmit queue";
	ret = rte_eth_tx_queue_setup(port, 0, tx_desc, SOCKET_ID_ANY, NULL);
	if (ret < 0)
		goto close;
	*what = "start the device";
	ret = rte_eth_dev_start(port);
	if (ret < 0)
		goto close;
	*port_out = port;
	*pool_out = pool;
	return 0;

close:
	/* Started and stopped, so that the driver closes its packet sockets. DPDK refuses to start
	 * a device whose configuration failed, which then keeps them (net_af_packet's
	 * configuration does not fail with the arguments the port gives). */
	if (rte_eth_dev_start(port) == 0)
		rte_eth_dev_stop(port);
	rte_eth_dev_close(port);
uninit:
	/* (Only if the device just made has no port, which DPDK does not let happen.) */
	rte_vdev_uninit(name);
free_pool:
	rte_mempool_free(pool);
	return ret < 0 ? ret : -EIO;
}

/* Stops and removes what xroce_dpdk_open made. */
void xroce_dpdk_close(const char *name, uint16_t port, struct rte_mempool *pool)
{
	rte_eth_dev_stop(port);
	rte_eth_dev_close(port);
	rte_vdev_uninit(name);
	rte_mempool_free(pool);
}

uint16_t xroce_dpdk_rx(uint16_t port, struct rte_mbuf **bufs, uint16_t n)
{
	return rte_eth_rx_burst(port, 0, bufs, n);
}

uint16_t xroce_dpdk_tx(uint16_t port, struct rte_mbuf **bufs, uint16_t n)
{
	return rte_eth_tx_burst(port, 0, bufs, n);
}

/* The first segment's bytes; `*pkt_len` is the whole packet's length (more than `*len` when the
 * packet is chained over several segments: see xroce_dpdk_read). */
const uint8_t *xroce_dpdk_data(const struct rte_mbuf *m, uint32_t *len, uint32_t *pkt_len)
{
	*len = rte_pktmbuf_data_len(m);
	*pkt_len = rte_pktmbuf_pkt_len(m);
	return rte_pktmbuf_mtod(m, const uint8_t *);
}

/* Copies a chained packet's `len` bytes into `out`. Returns 0, or -1 when it has fewer. */
int xroce_dpdk_read(const struct rte_mbuf *m, uint32_t len, uint8_t *out)
{
	const void *p = rte_pktmbuf_read(m, 0, len, out);

	if (p == NULL)
		return -1;
	if (p != out)
		memcpy(out, p, len);
	return 0;
}

/* A fresh buffer, `*data` pointing at its `*room` writable bytes; NULL when the pool is empty. */
struct rte_mbuf *xroce_dpdk_alloc(struct rte_mempool *pool, uint8_t **data, uint32_t *room)
{
	struct rte_mbuf *m = rte_pktmbuf_alloc(pool);

	if (m == NULL)
		return NULL;
	*data = rte_pktmbuf_mtod(m, uint8_t *);
	*room = rte_pktmbuf_tailroom(m);
	return m;
}

void xroce_dpdk_set_len(struct rte_mbuf *m, uint32_t len)
{
	m->data_len = (uint16_t)len;
	m->pkt_len = len;
}

void xroce_dpdk_free(struct rte_mbuf *m)
{
	rte_pktmbuf_free(m);
}

/* Frames the device dropped: for want of room (`missed`), of buffers (`no_mbuf`), or otherwise. */
int xroce_dpdk_rx_drops(uint16_t port, uint64_t *missed, uint64_t *no_mbuf, uint64_t *errors)
{
	struct rte_eth_stats stats;
	int ret = rte_eth_stats_get(port, &stats);

	if (ret != 0)
		return ret;
	*missed = stats.imissed;
	*no_mbuf = stats.rx_nombuf;
	*errors = stats.ierrors;
	return 0;
}
