/*
 * Memory and idle CPU of an RDMA process with N connected RC QPs (cargo xtask bench).
 *
 * Usage: qp_scale GID_INDEX N IDLE_SECONDS
 * Opens the first device, creates a PD, one CQ and N RC QPs, connects them in pairs to each
 * other through the device itself (QP 2k <-> QP 2k+1; an odd last QP to itself), sends one
 * 64-byte message over every connection to show it works, then sleeps IDLE_SECONDS and
 * measures the CPU time the whole process (all its threads) used meanwhile. Prints one line:
 *   qps=N rss_base_kib=A rss_kib=B idle_cpu_ms=C idle_s=S
 * where A is the resident memory after opening the device (PD and CQ created), B with the N
 * QPs connected. Exits 1 on any verbs error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define MSG 64

static void die(const char *what)
{
    fprintf(stderr, "qp_scale: %s\n", what);
    exit(1);
}

static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    return kib;
}

static double cpu_ms(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 +
           (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

int main(int argc, char **argv)
{
    if (argc < 4)
        die("usage: qp_scale GID_INDEX N IDLE_SECONDS");
    int gid_index = atoi(argv[1]);
    int n = atoi(argv[2]);
    int idle = atoi(argv[3]);
    if (n < 1 || idle < 0)
        die("N must be at least 1");

    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0])
        die("no RDMA device");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    if (!ctx)
        die("cannot open the device");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    size_t len = (size_t)n * 2 * MSG;
    char *buf = calloc(1, len);
    struct ibv_mr *mr = pd ? ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE) : NULL;
    struct ibv_cq *cq = ibv_create_cq(ctx, 2 * n + 16, NULL, NULL, 0);
    if (!mr || !cq)
        die("PD, MR or CQ");
    long rss_base = rss_kib();

    union ibv_gid gid;
    if (ibv_query_gid(ctx, 1, gid_index, &gid))
        die("query GID");
    struct ibv_qp **qp = calloc(n, sizeof *qp);
    for (int i = 0; i < n; i++) {
        struct ibv_qp_init_attr ia = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                      .cap = {.max_send_wr = 16, .max_recv_wr = 16,
                                              .max_send_sge = 1, .max_recv_sge = 1}};
        qp[i] = ibv_create_qp(pd, &ia);
        if (!qp[i])
            die("create QP");
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1};
        if (ibv_modify_qp(qp[i], &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                         IBV_QP_ACCESS_FLAGS))
            die("modify to INIT");
    }
    for (int i = 0; i < n; i++) {
        int peer = (i % 2 == 0) ? (i + 1 < n ? i + 1 : i) : i - 1;
        struct ibv_qp_attr rtr = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
                                  .dest_qp_num = qp[peer]->qp_num, .rq_psn = 0,
                                  .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
                                  .ah_attr = {.is_global = 1, .port_num = 1,
                                              .grh = {.dgid = gid, .sgid_index = gid_index,
                                                      .hop_limit = 1}}};
        if (ibv_modify_qp(qp[i], &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                           IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
            die("modify to RTR");
        struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
                                  .rnr_retry = 7, .sq_psn = 0, .max_rd_atomic = 1};
        if (ibv_modify_qp(qp[i], &rts, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                           IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                           IBV_QP_MAX_QP_RD_ATOMIC))
            die("modify to RTS");
    }
    /* One message over every connection: each QP receives one and sends one. */
    for (int i = 0; i < n; i++) {
        struct ibv_sge s = {(uintptr_t)buf + (size_t)i * 2 * MSG, MSG, mr->lkey};
        struct ibv_recv_wr r = {.wr_id = i, .sg_list = &s, .num_sge = 1}, *bad;
        if (ibv_post_recv(qp[i], &r, &bad))
            die("post_recv");
    }
    for (int i = 0; i < n; i++) {
        struct ibv_sge s = {(uintptr_t)buf + (size_t)i * 2 * MSG + MSG, MSG, mr->lkey};
        struct ibv_send_wr w = {.wr_id = i, .sg_list = &s, .num_sge = 1,
                                .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED},
                           *bad;
        if (ibv_post_send(qp[i], &w, &bad))
            die("post_send");
    }
    int want = 2 * n, got = 0;
    struct ibv_wc wc[32];
    for (long spins = 0; got < want; spins++) {
        int k = ibv_poll_cq(cq, 32, wc);
        if (k < 0)
            die("poll_cq");
        for (int j = 0; j < k; j++)
            if (wc[j].status != IBV_WC_SUCCESS) {
                fprintf(stderr, "qp_scale: completion %s\n", ibv_wc_status_str(wc[j].status));
                return 1;
            }
        got += k;
        if (spins > 200000000L)
            die("the messages did not all arrive");
    }
    long rss = rss_kib();

    double c0 = cpu_ms();
    sleep(idle);
    double c1 = cpu_ms();
    printf("qps=%d rss_base_kib=%ld rss_kib=%ld idle_cpu_ms=%.1f idle_s=%d\n", n, rss_base, rss,
           c1 - c0, idle);
    fflush(stdout);

    for (int i = 0; i < n; i++)
        ibv_destroy_qp(qp[i]);
    ibv_destroy_cq(cq);
    ibv_dereg_mr(mr);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    return 0;
}
