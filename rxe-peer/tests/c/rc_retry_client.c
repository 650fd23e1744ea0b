/*
 * A client for an unmodified `ibv_rc_pingpong -s 1024` server (same TCP exchange, 1024-byte
 * SENDs: one packet each at path MTU 1024) that connects its QP with a finite retry count, so that a server that
 * disappears mid-transfer ends in IBV_WC_RETRY_EXC_ERR rather than in ibv_rc_pingpong's
 * infinite retries (retry_cnt 7 means "forever" to rdma_rxe and xroce).
 *
 * Usage: rc_retry_client GID_INDEX SERVER [TIMEOUT RETRY_CNT]
 * Sends until a completion fails, always with one SEND in flight; then prints
 *   "failed status N (text) after K sends, M ms after the last SEND was posted"
 * where M counts from just before the ibv_post_send call: the retransmission timer cannot
 * start before that, so M is a lower bound the settings fix, whatever the scheduler does.
 * destroys the QP, CQ, MR and PD, closes the device, prints "closed cleanly" (or "teardown
 * failed") and exits 0 if the status was IBV_WC_RETRY_EXC_ERR and the teardown worked, 1
 * otherwise. Exits 2 on setup errors, 3 if nothing failed within 120 s.
 */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

/* One packet per SEND, and one SEND in flight: the server then never sees a PSN beyond the one
 * it expects, so it never answers with a sequence NAK. A sequence NAK consumes the retry count
 * just as a timeout does (in rdma_rxe as in xroce); with multi-packet SENDs rdma_rxe sends one
 * when a SEND's tail arrives after it RNR-NAKed its head, and one just before the peer died
 * would make the error come one timeout early. */
#define SIZE 1024
#define PORT 18515

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void die(const char *what)
{
    fprintf(stderr, "rc_retry_client: %s\n", what);
    exit(2);
}

int main(int argc, char **argv)
{
    if (argc < 3)
        die("usage: rc_retry_client GID_INDEX SERVER [TIMEOUT RETRY_CNT]");
    int gid_index = atoi(argv[1]);
    const char *server = argv[2];
    int timeout = argc > 3 ? atoi(argv[3]) : 12;
    int retry_cnt = argc > 4 ? atoi(argv[4]) : 3;

    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0])
        die("no RDMA device");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    if (!ctx)
        die("cannot open the device");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    char *buf = calloc(1, 2 * SIZE);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 2 * SIZE, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                  .cap = {.max_send_wr = 8, .max_recv_wr = 64,
                                          .max_send_sge = 1, .max_recv_sge = 1}};
    struct ibv_qp *qp = pd && mr && cq ? ibv_create_qp(pd, &ia) : NULL;
    if (!qp)
        die("cannot create PD, MR, CQ or QP");
    struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT, .port_num = 1};
    if (ibv_modify_qp(qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                     IBV_QP_ACCESS_FLAGS))
        die("modify to INIT");
    union ibv_gid gid;
    if (ibv_query_gid(ctx, 1, gid_index, &gid))
        die("query GID");

    /* ibv_rc_pingpong's exchange: "LID:QPN:PSN:GID" with the GID as 32 hex digits. */
    char msg[sizeof "0000:000000:000000:00000000000000000000000000000000"];
    char wgid[33];
    for (int i = 0; i < 16; i++)
        sprintf(&wgid[i * 2], "%02x", gid.raw[i]);
    int my_psn = 0x1234;
    sprintf(msg, "%04x:%06x:%06x:%s", 0, qp->qp_num, my_psn, wgid);
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
    char port[8];
    snprintf(port, sizeof port, "%d", PORT);
    if (getaddrinfo(server, port, &hints, &res))
        die("resolve server");
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, res->ai_addr, res->ai_addrlen))
        die("connect to the server");
    if (write(s, msg, sizeof msg) != sizeof msg ||
        recv(s, msg, sizeof msg, MSG_WAITALL) != sizeof msg)
        die("exchange");
    if (write(s, "done", sizeof "done") != sizeof "done")
        die("exchange (done)");
    unsigned lid, rqpn, rpsn;
    char rgid_hex[33];
    if (sscanf(msg, "%x:%x:%x:%32s", &lid, &rqpn, &rpsn, rgid_hex) != 4)
        die("parse the server's address");
    union ibv_gid rgid;
    for (int i = 0; i < 16; i++) {
        unsigned v;
        sscanf(&rgid_hex[i * 2], "%2x", &v);
        rgid.raw[i] = v;
    }

    struct ibv_qp_attr rtr = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
                              .dest_qp_num = rqpn, .rq_psn = rpsn, .max_dest_rd_atomic = 1,
                              .min_rnr_timer = 12,
                              .ah_attr = {.is_global = 1, .port_num = 1,
                                          .grh = {.dgid = rgid, .sgid_index = gid_index,
                                                  .hop_limit = 1}}};
    if (ibv_modify_qp(qp, &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                    IBV_QP_MIN_RNR_TIMER))
        die("modify to RTR");
    struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS, .timeout = timeout,
                              .retry_cnt = retry_cnt, .rnr_retry = 7, .sq_psn = my_psn,
                              .max_rd_atomic = 1};
    if (ibv_modify_qp(qp, &rts, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        die("modify to RTS");

    struct ibv_sge rsge = {(uintptr_t)buf, SIZE, mr->lkey};
    struct ibv_recv_wr rwr = {.wr_id = 1, .sg_list = &rsge, .num_sge = 1}, *rbad;
    for (int i = 0; i < 32; i++)
        if (ibv_post_recv(qp, &rwr, &rbad))
            die("post_recv");
    struct ibv_sge ssge = {(uintptr_t)buf + SIZE, SIZE, mr->lkey};
    struct ibv_send_wr swr = {.wr_id = 2, .sg_list = &ssge, .num_sge = 1,
                              .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED},
                       *sbad;
    /* Unlike ibv_rc_pingpong's client, which waits for the server's message before it sends
     * the next one, this one posts its next SEND as soon as the last one completes: a SEND is
     * in flight (or about to be) at every moment, so a peer that dies is noticed whenever it
     * dies. (Waiting for a receive with nothing outstanding would wait forever: nothing times
     * out.) The server's receives are reposted as it consumes them; its own replies are
     * consumed here the same way. */
    long sends = 0;
    double start = now_ms(), last_post = start;
    int outstanding = 0;
    while (now_ms() - start < 120000) {
        if (!outstanding) {
            /* Before the call, not after: the provider may transmit (and start the timer)
             * inside it, and this thread may be descheduled before it could read the clock
             * again (CI saw the error 264 ms "after" a post whose timer chain was 268 ms). */
            last_post = now_ms();
            if (ibv_post_send(qp, &swr, &sbad))
                die("post_send");
            outstanding = 1;
        }
        struct ibv_wc wc;
        int n = ibv_poll_cq(cq, 1, &wc);
        if (n < 0)
            die("poll_cq");
        if (n == 0)
            continue;
        if (wc.status != IBV_WC_SUCCESS) {
            printf("failed status %d (%s) after %ld sends, %.1f ms after the last SEND was "
                   "posted\n",
                   wc.status, ibv_wc_status_str(wc.status), sends, now_ms() - last_post);
            /* The QP is in ERROR now; everything is torn down as after a normal run. */
            int torn = ibv_destroy_qp(qp) || ibv_destroy_cq(cq) || ibv_dereg_mr(mr) ||
                       ibv_dealloc_pd(pd) || ibv_close_device(ctx);
            ibv_free_device_list(list);
            printf("%s\n", torn ? "teardown failed" : "closed cleanly");
            fflush(stdout);
            return wc.status == IBV_WC_RETRY_EXC_ERR && !torn ? 0 : 1;
        }
        if (wc.wr_id == 1) {
            if (ibv_post_recv(qp, &rwr, &rbad))
                die("post_recv");
        } else {
            sends++;
            outstanding = 0;
        }
    }
    printf("no failure within 120 s (%ld sends)\n", sends);
    return 3;
}
