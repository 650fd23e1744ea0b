/*
 * Completion channels must lose no wake-ups (urdma's known deadlock was a lost one).
 *
 * Two processes, each with THREADS threads; thread k of the client and thread k of the server
 * own a connected RC QP pair and play ping-pong, each side sleeping in ibv_get_cq_event on its
 * own completion channel for every message. Every receive is armed (ibv_req_notify_cq) before
 * the message that completes it can be sent, so each round must produce exactly one event on
 * each side. A wake-up that never comes is reported after 10 s instead of hanging.
 *
 * Usage: comp_channel_stress [-t THREADS] [-n ROUNDS] [-g GID_INDEX] [-p PORT] [SERVER_IP]
 * Prints "events N" (delivered on this side) and exits 0 when all THREADS*ROUNDS arrived.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define MSG 64
#define MAX_THREADS 64

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static int gid_index = 1;
static int threads = 4;
static long rounds = 1000;
static int is_server;
static union ibv_gid my_gid, peer_gid;

struct worker {
    int idx;
    struct ibv_comp_channel *channel;
    struct ibv_cq *scq, *rcq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    char *buf;
    uint32_t peer_qpn;
    long events;
    const char *error;
    pthread_t thread;
};

static struct worker workers[MAX_THREADS];

static void die(const char *what)
{
    fprintf(stderr, "comp_channel_stress: %s (%s)\n", what, strerror(errno));
    exit(2);
}

static int post_recv(struct worker *w)
{
    struct ibv_sge sge = {(uintptr_t)w->buf, MSG, w->mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1}, *bad;
    return ibv_post_recv(w->qp, &wr, &bad);
}

static int post_send(struct worker *w)
{
    struct ibv_sge sge = {(uintptr_t)w->buf + MSG, MSG, w->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = 2, .sg_list = &sge, .num_sge = 1,
                             .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_INLINE},
                       *bad;
    return ibv_post_send(w->qp, &wr, &bad);
}

/* Sleeps until the receive CQ's event arrives (10 s bound), then takes the completion. */
static const char *await_message(struct worker *w)
{
    struct pollfd p = {.fd = w->channel->fd, .events = POLLIN};
    int r;
    do
        r = poll(&p, 1, 10000);
    while (r < 0 && errno == EINTR);
    if (r == 0)
        return "no completion event within 10 s (lost wake-up)";
    struct ibv_cq *ev_cq;
    void *ev_ctx;
    if (ibv_get_cq_event(w->channel, &ev_cq, &ev_ctx))
        return "ibv_get_cq_event failed";
    if (ev_cq != w->rcq || ev_ctx != w)
        return "event for the wrong CQ";
    ibv_ack_cq_events(w->rcq, 1);
    w->events++;
    struct ibv_wc wc;
    int n = ibv_poll_cq(w->rcq, 1, &wc);
    if (n != 1)
        return "event without a completion";
    if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RECV || wc.byte_len != MSG)
        return "bad receive completion";
    if (ibv_poll_cq(w->rcq, 1, &wc) != 0)
        return "more completions than messages";
    return NULL;
}

static void *run(void *arg)
{
    struct worker *w = arg;
    for (long i = 0; i < rounds; i++) {
        if (is_server) {
            /* Armed and posted (before the first round: in setup) before replying. */
            if ((w->error = await_message(w)))
                return NULL;
            if (post_recv(w) || ibv_req_notify_cq(w->rcq, 0)) {
                w->error = "re-arming failed";
                return NULL;
            }
            if (post_send(w)) {
                w->error = "post_send failed";
                return NULL;
            }
        } else {
            if (ibv_req_notify_cq(w->rcq, 0) || post_send(w)) {
                w->error = "arming or post_send failed";
                return NULL;
            }
            if ((w->error = await_message(w)))
                return NULL;
            if (post_recv(w)) {
                w->error = "post_recv failed";
                return NULL;
            }
        }
    }
    return NULL;
}

static void setup(struct worker *w)
{
    w->channel = ibv_create_comp_channel(ctx);
    if (!w->channel)
        die("ibv_create_comp_channel");
    w->scq = ibv_create_cq(ctx, 16, w, NULL, 0);
    w->rcq = ibv_create_cq(ctx, 16, w, w->channel, 0);
    w->buf = calloc(1, 2 * MSG);
    w->mr = ibv_reg_mr(pd, w->buf, 2 * MSG, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_qp_init_attr a = {
        .send_cq = w->scq, .recv_cq = w->rcq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
        .cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1,
                .max_inline_data = MSG}};
    w->qp = ibv_create_qp(pd, &a);
    if (!w->scq || !w->rcq || !w->mr || !w->qp)
        die("creating CQs, MR or QP");
    struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT, .port_num = 1};
    if (ibv_modify_qp(w->qp, &init,
                      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        die("modify to INIT");
    if (post_recv(w) || ibv_req_notify_cq(w->rcq, 0))
        die("first receive");
}

static void connect_qp(struct worker *w)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = w->peer_qpn,
        .max_dest_rd_atomic = 1, .min_rnr_timer = 1,
        .ah_attr = {.is_global = 1, .port_num = 1,
                    .grh = {.dgid = peer_gid, .sgid_index = gid_index, .hop_limit = 1}}};
    if (ibv_modify_qp(w->qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                          IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        die("modify to RTR");
    struct ibv_qp_attr s = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
                            .rnr_retry = 7, .max_rd_atomic = 1};
    if (ibv_modify_qp(w->qp, &s,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        die("modify to RTS");
}

/* Exchanges GID and QPNs over TCP; the returned socket is the start/finish barrier. */
static int exchange(const char *server, int port)
{
    int fd;
    if (!server) {
        int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
        if (bind(l, (void *)&sa, sizeof(sa)) || listen(l, 1))
            die("listen");
        fd = accept(l, NULL, NULL);
        close(l);
    } else {
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
        inet_pton(AF_INET, server, &sa.sin_addr);
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (void *)&sa, sizeof(sa)))
            die("connect");
    }
    if (fd < 0)
        die("accept");
    struct {
        union ibv_gid gid;
        uint32_t qpn[MAX_THREADS];
    } mine = {.gid = my_gid}, theirs;
    for (int i = 0; i < threads; i++)
        mine.qpn[i] = workers[i].qp->qp_num;
    if (write(fd, &mine, sizeof(mine)) != sizeof(mine) ||
        recv(fd, &theirs, sizeof(theirs), MSG_WAITALL) != sizeof(theirs))
        die("exchange");
    peer_gid = theirs.gid;
    for (int i = 0; i < threads; i++)
        workers[i].peer_qpn = theirs.qpn[i];
    return fd;
}

static void barrier(int fd)
{
    char c = 'x';
    if (write(fd, &c, 1) != 1 || recv(fd, &c, 1, MSG_WAITALL) != 1)
        die("barrier");
}

int main(int argc, char **argv)
{
    int port = 18520, opt;
    while ((opt = getopt(argc, argv, "t:n:g:p:")) != -1) {
        switch (opt) {
        case 't': threads = atoi(optarg); break;
        case 'n': rounds = atol(optarg); break;
        case 'g': gid_index = atoi(optarg); break;
        case 'p': port = atoi(optarg); break;
        default: fprintf(stderr, "usage: %s [-t T] [-n N] [-g GID] [-p PORT] [SERVER]\n", argv[0]);
                 return 2;
        }
    }
    if (threads < 1 || threads > MAX_THREADS || rounds < 1)
        die("bad -t or -n");
    const char *server = optind < argc ? argv[optind] : NULL;
    is_server = server == NULL;
    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0])
        die("no RDMA device");
    ctx = ibv_open_device(list[0]);
    if (!ctx || !(pd = ibv_alloc_pd(ctx)) || ibv_query_gid(ctx, 1, gid_index, &my_gid))
        die("opening the device");
    for (int i = 0; i < threads; i++) {
        workers[i].idx = i;
        setup(&workers[i]);
    }
    int fd = exchange(server, port);
    for (int i = 0; i < threads; i++)
        connect_qp(&workers[i]);
    barrier(fd); /* both sides connected and armed */
    for (int i = 0; i < threads; i++)
        pthread_create(&workers[i].thread, NULL, run, &workers[i]);
    long events = 0;
    int failed = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(workers[i].thread, NULL);
        events += workers[i].events;
        if (workers[i].error) {
            fprintf(stderr, "thread %d after %ld events: %s\n", i, workers[i].events,
                    workers[i].error);
            failed = 1;
        }
    }
    barrier(fd); /* neither side tears down while the other still runs */
    printf("events %ld\n", events);
    for (int i = 0; i < threads; i++) {
        ibv_destroy_qp(workers[i].qp);
        ibv_destroy_cq(workers[i].rcq);
        ibv_destroy_cq(workers[i].scq);
        ibv_dereg_mr(workers[i].mr);
        ibv_destroy_comp_channel(workers[i].channel);
    }
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    return failed || events != threads * rounds;
}
