/*
 * An application whose device failed opens it again, as after IBV_EVENT_DEVICE_FATAL on an
 * RDMA NIC, while its first context is still open: once the cause is gone, the new context
 * must get a working device, not the failed one.
 *
 * Talks with the test over stdin and stdout (every wait is bounded):
 *   prints "ready" once its first context has a protection domain and a QP (its engine runs);
 *   prints "fatal" when IBV_EVENT_DEVICE_FATAL reaches that context;
 *   then waits for a line on stdin (the cause is gone), opens the device a second time,
 *   connects two RC QPs of the new context to each other (loopback) and SENDs a message
 *   between them; prints "reopened ok" when it arrived intact, then closes both contexts.
 * Exits 0 only when all of it worked; says why on stdout otherwise.
 *
 * Usage: reopen_after_fatal GID_INDEX
 */
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int fail(const char *why)
{
    printf("FAIL %s\n", why);
    fflush(stdout);
    return 1;
}

/* Waits up to 20 s for IBV_EVENT_DEVICE_FATAL on `ctx`, acknowledging other events. */
static int wait_fatal(struct ibv_context *ctx)
{
    double end = now_s() + 20;
    while (now_s() < end) {
        struct pollfd p = {.fd = ctx->async_fd, .events = POLLIN};
        if (poll(&p, 1, 500) != 1)
            continue;
        struct ibv_async_event ev;
        if (ibv_get_async_event(ctx, &ev))
            return 0;
        int fatal = ev.event_type == IBV_EVENT_DEVICE_FATAL;
        ibv_ack_async_event(&ev);
        if (fatal)
            return 1;
    }
    return 0;
}

static int connect_qp(struct ibv_qp *qp, uint32_t dest_qpn, union ibv_gid *gid, int gid_index)
{
    struct ibv_qp_attr i = {
        .qp_state = IBV_QPS_INIT,
        .port_num = 1,
        .qp_access_flags = IBV_ACCESS_LOCAL_WRITE,
    };
    if (ibv_modify_qp(qp, &i, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return -1;
    struct ibv_qp_attr r = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = IBV_MTU_1024,
        .dest_qp_num = dest_qpn,
        .min_rnr_timer = 1,
        .ah_attr = {.is_global = 1, .port_num = 1,
                    .grh = {.dgid = *gid, .sgid_index = gid_index, .hop_limit = 1}},
    };
    if (ibv_modify_qp(qp, &r,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                          IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return -1;
    struct ibv_qp_attr s = {
        .qp_state = IBV_QPS_RTS,
        .timeout = 14,
        .retry_cnt = 7,
        .rnr_retry = 7,
    };
    return ibv_modify_qp(qp, &s,
                         IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                             IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

static struct ibv_qp *create_rc(struct ibv_pd *pd, struct ibv_cq *cq)
{
    struct ibv_qp_init_attr a = {
        .send_cq = cq,
        .recv_cq = cq,
        .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
    };
    return ibv_create_qp(pd, &a);
}

/* On a second context of `dev`: a SEND between two QPs connected to each other. */
static int loopback_send(struct ibv_device *dev, int gid_index)
{
    struct ibv_context *ctx = ibv_open_device(dev);
    if (!ctx)
        return fail("cannot open the device again");
    union ibv_gid gid;
    if (ibv_query_gid(ctx, 1, gid_index, &gid))
        return fail("no GID at that index on the second context");
    static char buf[256];
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_mr *mr = pd ? ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE) : NULL;
    struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
    if (!pd || !mr || !cq)
        return fail("no PD, MR or CQ on the second context");
    struct ibv_qp *a = create_rc(pd, cq), *b = create_rc(pd, cq);
    if (!a || !b)
        return fail("no QPs on the second context");
    if (connect_qp(a, b->qp_num, &gid, gid_index) || connect_qp(b, a->qp_num, &gid, gid_index))
        return fail("cannot connect QPs on the second context");
    strcpy(buf, "after the fatal event");
    memset(buf + 128, 0, 128);
    struct ibv_sge rs = {.addr = (uintptr_t)(buf + 128), .length = 128, .lkey = mr->lkey};
    struct ibv_recv_wr rwr = {.wr_id = 2, .sg_list = &rs, .num_sge = 1}, *bad_r;
    struct ibv_sge ss = {.addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey};
    struct ibv_send_wr swr = {.wr_id = 1, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
                              .send_flags = IBV_SEND_SIGNALED},
                       *bad_s;
    if (ibv_post_recv(b, &rwr, &bad_r) || ibv_post_send(a, &swr, &bad_s))
        return fail("cannot post on the second context");
    int done = 0;
    double end = now_s() + 10;
    while (done < 2 && now_s() < end) {
        struct ibv_wc wc;
        int n = ibv_poll_cq(cq, 1, &wc);
        if (n < 0)
            return fail("ibv_poll_cq failed on the second context");
        if (n == 1) {
            if (wc.status != IBV_WC_SUCCESS) {
                printf("FAIL completion %llu: %s\n", (unsigned long long)wc.wr_id,
                       ibv_wc_status_str(wc.status));
                return 1;
            }
            done++;
        }
    }
    if (done < 2)
        return fail("the SEND on the second context did not complete within 10 s");
    if (memcmp(buf, buf + 128, 64))
        return fail("the SEND on the second context arrived damaged");
    printf("reopened ok\n");
    fflush(stdout);
    if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_cq(cq) || ibv_dereg_mr(mr) ||
        ibv_dealloc_pd(pd) || ibv_close_device(ctx))
        return fail("cannot tear down the second context");
    return 0;
}

int main(int argc, char **argv)
{
    int gid_index = argc > 1 ? atoi(argv[1]) : 1;
    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0])
        return fail("no device");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    struct ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : NULL;
    struct ibv_cq *cq = ctx ? ibv_create_cq(ctx, 8, NULL, NULL, 0) : NULL;
    struct ibv_qp *qp = pd && cq ? create_rc(pd, cq) : NULL;
    if (!qp)
        return fail("cannot set up the first context");
    printf("ready\n");
    fflush(stdout);
    if (!wait_fatal(ctx))
        return fail("no IBV_EVENT_DEVICE_FATAL within 20 s");
    printf("fatal\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return fail("stdin closed before the go-ahead");
    int r = loopback_send(list[0], gid_index);
    /* The first context's objects go as on a failed NIC: destroying them still works. */
    if (ibv_destroy_qp(qp) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
        r = fail("cannot tear down the failed context");
    ibv_free_device_list(list);
    return r;
}
