/*
 * Bad input from an application must get the verbs error, never a crash or a hang.
 *
 * Runs on the first device libibverbs lists (under `xroce exec`, an xroce device), with RC QPs
 * connected to each other on the same device (loopback). Prints one line per check, "ok NAME"
 * or "FAIL NAME: why", and exits 0 only when every check passed. Every wait is bounded.
 *
 * Usage: verbs_errors GID_INDEX
 */
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>
#include <infiniband/verbs.h>

static int failures;

#define CHECK(name, cond, ...)                                                                     \
    do {                                                                                           \
        if (cond) {                                                                                \
            printf("ok %s\n", name);                                                               \
        } else {                                                                                   \
            printf("FAIL %s: ", name);                                                             \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
            failures++;                                                                            \
        }                                                                                          \
        fflush(stdout);                                                                            \
    } while (0)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static union ibv_gid gid;
static int gid_index;

/* Threads of this process, from /proc/self/status; -1 when it cannot be read. */
static int count_threads(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int n = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1)
            break;
    if (f)
        fclose(f);
    return n;
}

/* Open file descriptors of this process; -1 when /proc/self/fd cannot be read. */
static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* Polls `cq` until one completion arrives or 5 s pass; returns 1 when one was read. */
static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
    double end = now_s() + 5;
    while (now_s() < end) {
        int n = ibv_poll_cq(cq, 1, wc);
        if (n < 0)
            return 0;
        if (n == 1)
            return 1;
    }
    return 0;
}

static struct ibv_qp *create_rc(struct ibv_cq *scq, struct ibv_cq *rcq, uint32_t max_send_wr,
                                uint32_t max_inline)
{
    struct ibv_qp_init_attr a = {
        .send_cq = scq,
        .recv_cq = rcq,
        .cap = {.max_send_wr = max_send_wr, .max_recv_wr = 16, .max_send_sge = 2,
                .max_recv_sge = 2, .max_inline_data = max_inline},
        .qp_type = IBV_QPT_RC,
    };
    return ibv_create_qp(pd, &a);
}

/* An RC QP whose receives come from `srq`. */
static struct ibv_qp *create_srq_rc(struct ibv_cq *cq, struct ibv_srq *srq)
{
    struct ibv_qp_init_attr a = {
        .send_cq = cq,
        .recv_cq = cq,
        .srq = srq,
        .cap = {.max_send_wr = 16, .max_send_sge = 1},
        .qp_type = IBV_QPT_RC,
    };
    return ibv_create_qp(pd, &a);
}

static int to_init(struct ibv_qp *qp)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_INIT,
        .pkey_index = 0,
        .port_num = 1,
        .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                           IBV_ACCESS_REMOTE_ATOMIC,
    };
    return ibv_modify_qp(qp, &a,
                         IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int to_rtr_rts(struct ibv_qp *qp, uint32_t dest_qpn)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = IBV_MTU_1024,
        .dest_qp_num = dest_qpn,
        .rq_psn = 0,
        .max_dest_rd_atomic = 1,
        .min_rnr_timer = 1,
        .ah_attr = {.is_global = 1, .port_num = 1,
                    .grh = {.dgid = gid, .sgid_index = gid_index, .hop_limit = 1}},
    };
    int r = ibv_modify_qp(qp, &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (r)
        return r;
    struct ibv_qp_attr s = {
        .qp_state = IBV_QPS_RTS,
        .timeout = 14,
        .retry_cnt = 7,
        .rnr_retry = 7,
        .sq_psn = 0,
        .max_rd_atomic = 1,
    };
    return ibv_modify_qp(qp, &s,
                         IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                             IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

/* Two RC QPs on one device, connected to each other. */
struct pair {
    struct ibv_cq *cq;
    struct ibv_qp *a, *b;
};

static int make_pair(struct pair *p, uint32_t max_send_wr)
{
    p->cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    if (!p->cq)
        return -1;
    p->a = create_rc(p->cq, p->cq, max_send_wr, 64);
    p->b = create_rc(p->cq, p->cq, max_send_wr, 64);
    if (!p->a || !p->b)
        return -1;
    if (to_init(p->a) || to_init(p->b))
        return -1;
    if (to_rtr_rts(p->a, p->b->qp_num) || to_rtr_rts(p->b, p->a->qp_num))
        return -1;
    return 0;
}

static void free_pair(struct pair *p)
{
    ibv_destroy_qp(p->a);
    ibv_destroy_qp(p->b);
    ibv_destroy_cq(p->cq);
}

static int post_write(struct ibv_qp *qp, void *addr, uint32_t len, uint32_t lkey,
                      uint64_t raddr, uint32_t rkey, int flags)
{
    struct ibv_sge sge = {.addr = (uintptr_t)addr, .length = len, .lkey = lkey};
    struct ibv_send_wr wr = {
        .wr_id = 7,
        .sg_list = &sge,
        .num_sge = 1,
        .opcode = IBV_WR_RDMA_WRITE,
        .send_flags = IBV_SEND_SIGNALED | flags,
        .wr.rdma = {.remote_addr = raddr, .rkey = rkey},
    };
    struct ibv_send_wr *bad = NULL;
    return ibv_post_send(qp, &wr, &bad);
}

/* Waits (bounded) for an asynchronous event of type `type`; returns 1 when it came. */
static int wait_async(enum ibv_event_type type, void *element)
{
    double end = now_s() + 5;
    while (now_s() < end) {
        struct pollfd p = {.fd = ctx->async_fd, .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        struct ibv_async_event ev;
        if (ibv_get_async_event(ctx, &ev))
            return 0;
        int match = ev.event_type == type && (element == NULL || ev.element.cq == element);
        ibv_ack_async_event(&ev);
        if (match)
            return 1;
    }
    return 0;
}

/* A context opened on a thread of its own, and what its first verbs made. */
struct opener {
    struct ibv_device *dev;
    pthread_barrier_t *start;
    /* How long to wait after the barrier before the first verb. */
    int delay_ms;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
};

/* Opens the device, then (together with the other threads at the barrier) makes a PD and a
 * CQ: the first verbs that need the device's engine. */
static void *open_and_use(void *arg)
{
    struct opener *o = arg;
    o->ctx = ibv_open_device(o->dev);
    pthread_barrier_wait(o->start);
    if (o->delay_ms)
        usleep(o->delay_ms * 1000);
    o->pd = o->ctx ? ibv_alloc_pd(o->ctx) : NULL;
    o->cq = o->ctx ? ibv_create_cq(o->ctx, 8, NULL, NULL, 0) : NULL;
    return NULL;
}

static void close_opened(struct opener *o)
{
    if (o->cq)
        ibv_destroy_cq(o->cq);
    if (o->pd)
        ibv_dealloc_pd(o->pd);
    if (o->ctx)
        ibv_close_device(o->ctx);
    o->ctx = NULL;
    o->pd = NULL;
    o->cq = NULL;
}

/* Closes `n` opened contexts once the barrier lets it go. */
struct closer {
    pthread_barrier_t *start;
    struct opener *opened;
    int n;
};

static void *close_all(void *arg)
{
    struct closer *c = arg;
    pthread_barrier_wait(c->start);
    for (int i = 0; i < c->n; i++)
        close_opened(&c->opened[i]);
    return NULL;
}

/* Starts a thread, or ends the program: a check whose threads cannot start cannot run, and
 * the threads already started would wait at their barrier for good. */
static void start_thread(pthread_t *t, void *(*f)(void *), void *arg)
{
    int r = pthread_create(t, NULL, f, arg);
    if (r) {
        printf("FAIL setup: pthread_create: %s\n", strerror(r));
        exit(1);
    }
}

static void init_barrier(pthread_barrier_t *b, unsigned count)
{
    int r = pthread_barrier_init(b, NULL, count);
    if (r) {
        printf("FAIL setup: pthread_barrier_init: %s\n", strerror(r));
        exit(1);
    }
}

/* A 64-byte WRITE between two QPs of the opened context (its device's loopback); 1 when it
 * completed and landed. */
static int write_works(struct opener *o)
{
    if (!o->ctx || !o->pd || !o->cq)
        return 0;
    char *src = aligned_alloc(4096, 4096), *dst = aligned_alloc(4096, 4096);
    if (!src || !dst) {
        free(src);
        free(dst);
        return 0;
    }
    memset(src, 0x5c, 4096);
    memset(dst, 0, 4096);
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    struct ibv_mr *ms = ibv_reg_mr(o->pd, src, 4096, access);
    struct ibv_mr *md = ibv_reg_mr(o->pd, dst, 4096, access);
    struct ibv_qp_init_attr a = {
        .send_cq = o->cq,
        .recv_cq = o->cq,
        .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
        .qp_type = IBV_QPT_RC,
    };
    struct ibv_qp *qa = ibv_create_qp(o->pd, &a), *qb = ibv_create_qp(o->pd, &a);
    struct ibv_wc wc;
    int ok = ms && md && qa && qb && !to_init(qa) && !to_init(qb) &&
             !to_rtr_rts(qa, qb->qp_num) && !to_rtr_rts(qb, qa->qp_num) &&
             post_write(qa, src, 64, ms->lkey, (uintptr_t)dst, md->rkey, 0) == 0 &&
             poll_one(o->cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS &&
             memcmp(src, dst, 64) == 0;
    if (qa)
        ibv_destroy_qp(qa);
    if (qb)
        ibv_destroy_qp(qb);
    if (ms)
        ibv_dereg_mr(ms);
    if (md)
        ibv_dereg_mr(md);
    free(src);
    free(dst);
    return ok;
}

/* A completion channel, a CQ on it and an RC QP on that CQ moved to the error state, where a
 * posted receive completes at once (flushed) and raises the CQ's event if it is armed. */
struct flushing_qp {
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    int in_error;
};

static struct flushing_qp make_flushing_qp(void)
{
    struct flushing_qp f = {0};
    struct ibv_qp_attr qa = {.qp_state = IBV_QPS_ERR};
    f.ch = ibv_create_comp_channel(ctx);
    f.cq = f.ch ? ibv_create_cq(ctx, 16, NULL, f.ch, 0) : NULL;
    f.qp = f.cq ? create_rc(f.cq, f.cq, 4, 0) : NULL;
    f.in_error = f.qp && !to_init(f.qp) && !ibv_modify_qp(f.qp, &qa, IBV_QP_STATE);
    return f;
}

static void free_flushing_qp(struct flushing_qp *f)
{
    if (f->qp)
        ibv_destroy_qp(f->qp);
    if (f->cq)
        ibv_destroy_cq(f->cq);
    if (f->ch)
        ibv_destroy_comp_channel(f->ch);
}

/* A thread blocked in ibv_get_cq_event, and what the call returned. */
struct cq_event_waiter {
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    int rc;
    int err;
    volatile int done;
    pthread_t thread;
};

static void *wait_for_cq_event(void *arg)
{
    struct cq_event_waiter *w = arg;
    void *cq_ctx;
    w->rc = ibv_get_cq_event(w->ch, &w->cq, &cq_ctx);
    w->err = errno;
    __sync_synchronize();
    w->done = 1;
    return NULL;
}

/* Cleanup handler of a cancelled waiter. */
static void mark_cancelled(void *arg)
{
    struct cq_event_waiter *w = arg;
    w->err = ECANCELED;
    __sync_synchronize();
    w->done = 1;
}

static void *wait_for_cq_event_until_cancelled(void *arg)
{
    struct cq_event_waiter *w = arg;
    pthread_cleanup_push(mark_cancelled, w);
    void *cq_ctx;
    w->rc = ibv_get_cq_event(w->ch, &w->cq, &cq_ctx);
    pthread_cleanup_pop(0);
    w->err = 0;
    __sync_synchronize();
    w->done = 1;
    return NULL;
}

/* Waits (bounded) for the waiter to return; 1 when it did. */
static int waiter_returned(struct cq_event_waiter *w, int ms)
{
    for (int i = 0; i < ms / 10 && !w->done; i++)
        usleep(10 * 1000);
    return w->done;
}

static void on_sigusr1(int sig)
{
    (void)sig;
}

/* SIGUSR1's handler, restarting interrupted system calls or not. */
static void handle_sigusr1(int restart)
{
    struct sigaction sa = {.sa_handler = on_sigusr1, .sa_flags = restart ? SA_RESTART : 0};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
}

int main(int argc, char **argv)
{
    /* As many servers do: a write to a pipe whose reader has gone then fails with EPIPE
     * instead of killing the process. xroce's messages on stderr must not turn such a failed
     * write into an abort. */
    signal(SIGPIPE, SIG_IGN);
    gid_index = argc > 1 ? atoi(argv[1]) : 1;
    struct ibv_device **list = ibv_get_device_list(NULL);
    if (!list || !list[0]) {
        printf("FAIL setup: no RDMA device\n");
        return 1;
    }
    ctx = ibv_open_device(list[0]);
    if (!ctx || ibv_query_gid(ctx, 1, gid_index, &gid)) {
        printf("FAIL setup: cannot open %s or read GID %d\n", ibv_get_device_name(list[0]),
               gid_index);
        return 1;
    }
    pd = ibv_alloc_pd(ctx);
    size_t len = 65536;
    char *buf = aligned_alloc(4096, len);
    char *other = aligned_alloc(4096, len);
    memset(buf, 0xab, len);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, len / 2,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                       IBV_ACCESS_REMOTE_READ);
    if (!pd || !mr) {
        printf("FAIL setup: pd or mr\n");
        return 1;
    }
    struct ibv_wc wc;
    struct pair p;

    /* Registration: remote write without local write is refused by verbs. */
    errno = 0;
    struct ibv_mr *bad_mr = ibv_reg_mr(pd, other, 4096, IBV_ACCESS_REMOTE_WRITE);
    CHECK("reg_mr_remote_write_without_local_write", bad_mr == NULL && errno == EINVAL,
          "got %p errno %d", (void *)bad_mr, errno);

    /* Posting on a QP in the wrong state: RESET and INIT cannot send, RESET cannot receive. */
    {
        struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
        struct ibv_qp *qp = create_rc(cq, cq, 16, 64);
        struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
        struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND};
        struct ibv_send_wr *bad = NULL;
        struct ibv_recv_wr rwr = {.sg_list = &sge, .num_sge = 1};
        struct ibv_recv_wr *rbad = NULL;
        int r = ibv_post_send(qp, &wr, &bad);
        CHECK("post_send_in_reset", r == EINVAL && bad == &wr, "returned %d", r);
        r = ibv_post_recv(qp, &rwr, &rbad);
        CHECK("post_recv_in_reset", r == EINVAL && rbad == &rwr, "returned %d", r);
        to_init(qp);
        bad = NULL;
        r = ibv_post_send(qp, &wr, &bad);
        CHECK("post_send_in_init", r == EINVAL && bad == &wr, "returned %d", r);
        r = ibv_post_recv(qp, &rwr, &rbad);
        CHECK("post_recv_in_init_allowed", r == 0, "returned %d", r);

        /* An illegal transition (INIT -> RTS) is refused and changes nothing. */
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTS};
        r = ibv_modify_qp(qp, &a, IBV_QP_STATE);
        struct ibv_qp_attr q;
        struct ibv_qp_init_attr qi;
        ibv_query_qp(qp, &q, IBV_QP_STATE, &qi);
        CHECK("modify_qp_illegal_transition", r == EINVAL && q.qp_state == IBV_QPS_INIT,
              "returned %d, state now %d", r, q.qp_state);

        /* Destroying a CQ a QP still uses. */
        r = ibv_destroy_cq(cq);
        CHECK("destroy_cq_in_use", r == EBUSY, "returned %d", r);
        ibv_destroy_qp(qp);
        r = ibv_destroy_cq(cq);
        CHECK("destroy_cq_after_qp", r == 0, "returned %d", r);
    }

    /* Queue limits: inline data above max_inline_data, more SGEs than max_send_sge, more
     * outstanding WRs than the send queue holds, an unknown opcode. */
    if (make_pair(&p, 4) == 0) {
        struct ibv_qp_attr qa;
        struct ibv_qp_init_attr qi;
        ibv_query_qp(p.a, &qa, IBV_QP_CAP, &qi);
        uint32_t inline_max = qi.cap.max_inline_data;
        char *stack = malloc(inline_max + 1);
        memset(stack, 1, inline_max + 1);
        struct ibv_sge sge = {.addr = (uintptr_t)stack, .length = inline_max + 1};
        struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                                 .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED,
                                 .wr.rdma = {.remote_addr = (uintptr_t)buf, .rkey = mr->rkey}};
        struct ibv_send_wr *bad = NULL;
        int r = ibv_post_send(p.a, &wr, &bad);
        CHECK("inline_above_limit", r == EINVAL && bad == &wr, "returned %d (limit %u)", r,
              inline_max);
        sge.length = inline_max;
        r = ibv_post_send(p.a, &wr, &bad);
        int ok = r == 0 && poll_one(p.cq, &wc) && wc.status == IBV_WC_SUCCESS;
        CHECK("inline_at_limit", ok, "returned %d, status %d", r, wc.status);
        free(stack);

        /* One SGE more than the QP reports (as rdma_rxe, the limit fills the send WQE that
         * max_inline_data sized: 4 SGEs for 64 inline bytes, though 2 were asked for). */
        uint32_t sge_max = qi.cap.max_send_sge;
        struct ibv_sge over[33];
        for (uint32_t i = 0; i <= sge_max && i < 33; i++)
            over[i] = (struct ibv_sge){(uintptr_t)buf + 8 * i, 8, mr->lkey};
        struct ibv_send_wr wover = {.sg_list = over, .num_sge = (int)sge_max + 1,
                                    .opcode = IBV_WR_RDMA_WRITE,
                                    .wr.rdma = {.remote_addr = (uintptr_t)buf, .rkey = mr->rkey}};
        r = sge_max < 32 ? ibv_post_send(p.a, &wover, &bad) : -1;
        CHECK("more_sges_than_max_send_sge", r == EINVAL && sge_max == 4,
              "returned %d (limit %u, 4 expected for 64 inline bytes)", r, sge_max);

        struct ibv_send_wr wop = {.sg_list = over, .num_sge = 1, .opcode = 0x7f};
        r = ibv_post_send(p.a, &wop, &bad);
        CHECK("unknown_opcode", r == EINVAL, "returned %d", r);

        /* Fill the send queue with a chain: the first WR that does not fit is reported. The
         * QP sends to a QPN nobody owns, so nothing is acknowledged and the WRs stay queued;
         * moving the QP to ERROR then flushes exactly those. */
        struct ibv_qp *deaf = create_rc(p.cq, p.cq, 4, 64);
        if (!deaf || to_init(deaf) || to_rtr_rts(deaf, 0xfffff0)) {
            CHECK("connect_to_absent_qpn", 0, "cannot set up the QP");
            return 1;
        }
        ibv_query_qp(deaf, &qa, IBV_QP_CAP, &qi);
        uint32_t depth = qi.cap.max_send_wr;
        struct ibv_send_wr *chain = calloc(depth + 1, sizeof(*chain));
        struct ibv_sge one = {(uintptr_t)buf, 8, mr->lkey};
        for (uint32_t i = 0; i <= depth; i++) {
            chain[i] = (struct ibv_send_wr){
                .wr_id = i, .sg_list = &one, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                .send_flags = IBV_SEND_SIGNALED,
                .wr.rdma = {.remote_addr = (uintptr_t)buf + 4096, .rkey = mr->rkey},
                .next = i < depth ? &chain[i + 1] : NULL};
        }
        bad = NULL;
        r = ibv_post_send(deaf, chain, &bad);
        CHECK("more_wrs_than_the_queue_holds", r == ENOMEM && bad == &chain[depth],
              "returned %d, bad_wr at %ld of depth %u", r, bad ? (long)(bad - chain) : -1L, depth);
        struct ibv_qp_attr err = {.qp_state = IBV_QPS_ERR};
        ibv_modify_qp(deaf, &err, IBV_QP_STATE);
        int got = 0;
        while (got < (int)depth && poll_one(p.cq, &wc) && wc.status == IBV_WC_WR_FLUSH_ERR &&
               wc.wr_id == (uint64_t)got)
            got++;
        CHECK("queued_wrs_flush_in_order", got == (int)depth, "%d of %u", got, depth);
        ibv_destroy_qp(deaf);
        free(chain);
        free_pair(&p);
    } else {
        CHECK("connect_loopback_pair", 0, "cannot connect two QPs on the device");
    }

    /* An invalid lkey: accepted by post_send, completed with a local protection error. */
    if (make_pair(&p, 16) == 0) {
        int r = post_write(p.a, buf, 64, mr->lkey ^ 0x5a5a5a5a, (uintptr_t)buf + 8192, mr->rkey,
                           0);
        int ok = r == 0 && poll_one(p.cq, &wc) && wc.status == IBV_WC_LOC_PROT_ERR &&
                 wc.wr_id == 7;
        CHECK("invalid_lkey", ok, "post returned %d, status %d (%s)", r, wc.status,
              ibv_wc_status_str(wc.status));
        free_pair(&p);
    }

    /* An SGE reaching beyond its MR (registered: the first half of `buf`). */
    if (make_pair(&p, 16) == 0) {
        int r = post_write(p.a, buf + len / 2 - 32, 64, mr->lkey, (uintptr_t)buf + 8192,
                           mr->rkey, 0);
        int ok = r == 0 && poll_one(p.cq, &wc) && wc.status == IBV_WC_LOC_PROT_ERR;
        CHECK("sge_beyond_mr", ok, "post returned %d, status %d (%s)", r, wc.status,
              ibv_wc_status_str(wc.status));
        free_pair(&p);
    }

    /* A WRITE to a bad rkey and one past the end of the remote MR: remote access errors. */
    if (make_pair(&p, 16) == 0) {
        int r = post_write(p.a, buf, 64, mr->lkey, (uintptr_t)buf + 8192, mr->rkey ^ 0x1234, 0);
        int ok = r == 0 && poll_one(p.cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR;
        CHECK("invalid_rkey", ok, "post returned %d, status %d (%s)", r, wc.status,
              ibv_wc_status_str(wc.status));
        free_pair(&p);
    }
    if (make_pair(&p, 16) == 0) {
        int r = post_write(p.a, buf, 64, mr->lkey, (uintptr_t)buf + len / 2 - 16, mr->rkey, 0);
        int ok = r == 0 && poll_one(p.cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR;
        CHECK("remote_write_beyond_mr", ok, "post returned %d, status %d (%s)", r, wc.status,
              ibv_wc_status_str(wc.status));
        free_pair(&p);
    }

    /* A CQ holds what rdma_rxe's would: 4 asked for, 7 held (a power-of-two queue less one
     * slot). Completions beyond that raise IBV_EVENT_CQ_ERR for the CQ and are lost; as on
     * rdma_rxe, the QP whose completion did not fit goes on, and its next completion is
     * stored once there is room. */
    {
        struct ibv_cq *small = ibv_create_cq(ctx, 4, NULL, NULL, 0);
        CHECK("create_cq_rounds_up_as_rdma_rxe", small && small->cqe == 7, "cqe %d",
              small ? small->cqe : -1);
        struct ibv_cq *other_cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
        struct ibv_qp *a = create_rc(small, other_cq, 64, 64);
        struct ibv_qp *b = create_rc(other_cq, other_cq, 64, 64);
        int conn = small && a && b && !to_init(a) && !to_init(b) &&
                   !to_rtr_rts(a, b->qp_num) && !to_rtr_rts(b, a->qp_num);
        /* One more than it holds: the last WRITE's completion is the overrun, so all of them
         * have completed once CQ_ERR is in. */
        int posted = 0;
        for (int i = 0; conn && i < small->cqe + 1; i++)
            posted += post_write(a, buf, 8, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, 0) == 0;
        int ev = conn && wait_async(IBV_EVENT_CQ_ERR, small);
        CHECK("cq_overflow_raises_cq_err", ev, "connected %d, posted %d to a CQ of %d", conn,
              posted, small ? small->cqe : -1);
        /* What was stored is read back whole; then the QP completes its next WRITE. */
        int stored = 0;
        struct ibv_wc wcs[16];
        for (int n; conn && (n = ibv_poll_cq(small, 16, wcs)) > 0;)
            for (int i = 0; i < n; i++)
                stored += wcs[i].status == IBV_WC_SUCCESS;
        struct ibv_qp_attr qa = {0};
        struct ibv_qp_init_attr qi;
        ibv_query_qp(a, &qa, IBV_QP_STATE, &qi);
        int again = conn &&
                    post_write(a, buf, 8, mr->lkey, (uintptr_t)buf + 4096, mr->rkey, 0) == 0 &&
                    poll_one(small, &wc) && wc.status == IBV_WC_SUCCESS;
        CHECK("cq_overflow_qp_goes_on",
              stored == (small ? small->cqe : -1) && qa.qp_state == IBV_QPS_RTS && again,
              "%d completions stored, QP state %d, next WRITE completed %d (status %d)", stored,
              qa.qp_state, again, wc.status);
        ibv_destroy_qp(a);
        ibv_destroy_qp(b);
        ibv_destroy_cq(small);
        ibv_destroy_cq(other_cq);
    }

    /* An SRQ armed with a limit raises IBV_EVENT_SRQ_LIMIT_REACHED for that SRQ once SENDs
     * have taken it below the limit (8 receives, limit 4, 5 SENDs). */
    {
        struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
        struct ibv_srq_init_attr si = {.attr = {.max_wr = 16, .max_sge = 1}};
        struct ibv_srq *srq = ibv_create_srq(pd, &si);
        struct ibv_qp *a = cq ? create_rc(cq, cq, 16, 64) : NULL;
        struct ibv_qp *b = srq ? create_srq_rc(cq, srq) : NULL;
        int conn = a && b && !to_init(a) && !to_init(b) && !to_rtr_rts(a, b->qp_num) &&
                   !to_rtr_rts(b, a->qp_num);
        int recvs = 0;
        for (int i = 0; conn && i < 8; i++) {
            struct ibv_sge sge = {.addr = (uintptr_t)buf + 16384 + 64 * i, .length = 64,
                                  .lkey = mr->lkey};
            struct ibv_recv_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1}, *bad;
            recvs += ibv_post_srq_recv(srq, &wr, &bad) == 0;
        }
        struct ibv_srq_attr limit = {.srq_limit = 4};
        int armed = conn && ibv_modify_srq(srq, &limit, IBV_SRQ_LIMIT) == 0;
        int sent = 0;
        for (int i = 0; armed && i < 5; i++) {
            struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
            struct ibv_send_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1,
                                     .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED},
                               *bad;
            sent += ibv_post_send(a, &wr, &bad) == 0;
        }
        /* The SENDs' and receives' completions: the receives are taken from the SRQ. */
        int done = 0;
        for (int i = 0; i < 2 * sent && poll_one(cq, &wc); i++)
            done += wc.status == IBV_WC_SUCCESS;
        int ev = armed && wait_async(IBV_EVENT_SRQ_LIMIT_REACHED, srq);
        CHECK("srq_limit_event", ev, "connected %d, receives %d, armed %d, sent %d, done %d",
              conn, recvs, armed, sent, done);
        if (a)
            ibv_destroy_qp(a);
        if (b)
            ibv_destroy_qp(b);
        if (srq)
            ibv_destroy_srq(srq);
        if (cq)
            ibv_destroy_cq(cq);
    }

    /* A destroyed CQ's unread completion event is dropped, and the events of the other CQs
     * on its channel stay: ibv_get_cq_event must never hand out a freed CQ (the kernel's
     * uverbs drops a destroyed CQ's unread events too). Destroying a CQ whose events were all
     * acknowledged does not wait. */
    {
        struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
        struct ibv_cq *stays = ch ? ibv_create_cq(ctx, 16, NULL, ch, 0) : NULL;
        struct ibv_cq *gone = ch ? ibv_create_cq(ctx, 16, NULL, ch, 0) : NULL;
        struct ibv_qp *a = stays ? create_rc(stays, stays, 16, 64) : NULL;
        struct ibv_qp *b = gone ? create_rc(gone, gone, 16, 64) : NULL;
        int conn = a && b && !to_init(a) && !to_init(b) && !to_rtr_rts(a, b->qp_num) &&
                   !to_rtr_rts(b, a->qp_num);
        int armed = conn && ibv_req_notify_cq(stays, 0) == 0 && ibv_req_notify_cq(gone, 0) == 0;
        /* One completion on each CQ: both CQs' event records are now in the channel. */
        int written = armed &&
                      post_write(a, buf, 64, mr->lkey, (uintptr_t)buf + 8192, mr->rkey, 0) == 0 &&
                      poll_one(stays, &wc) && wc.status == IBV_WC_SUCCESS &&
                      post_write(b, buf, 64, mr->lkey, (uintptr_t)buf + 8192, mr->rkey, 0) == 0 &&
                      poll_one(gone, &wc) && wc.status == IBV_WC_SUCCESS;
        if (a)
            ibv_destroy_qp(a);
        if (b)
            ibv_destroy_qp(b);
        int destroyed = gone && ibv_destroy_cq(gone) == 0;
        struct pollfd pf = {.fd = ch ? ch->fd : -1, .events = POLLIN};
        struct ibv_cq *ev_cq = NULL;
        void *ev_ctx;
        int first = destroyed && poll(&pf, 1, 2000) == 1 && ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0;
        if (first)
            ibv_ack_cq_events(ev_cq, 1);
        pf.revents = 0;
        int then_none = first && poll(&pf, 1, 200) == 0;
        CHECK("destroyed_cq_events_dropped", written && ev_cq == stays && then_none,
              "connected %d, armed %d, written %d, destroyed %d, event for %s, more %d", conn,
              armed, written, destroyed,
              ev_cq == stays ? "the live CQ" : ev_cq ? "ANOTHER CQ" : "none", !then_none);
        int freed = stays && ibv_destroy_cq(stays) == 0;
        CHECK("destroy_cq_after_its_events_were_acknowledged", freed, "destroy failed");
        if (ch)
            ibv_destroy_comp_channel(ch);
    }

    /* A destroyed QP's unread asynchronous event is dropped: an SRQ's QP moved to ERROR
     * raises IBV_EVENT_QP_LAST_WQE_REACHED; destroyed before the event is read, the event
     * must not reach ibv_get_async_event (which would read the freed QP). */
    {
        struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
        struct ibv_srq_init_attr si = {.attr = {.max_wr = 16, .max_sge = 1}};
        struct ibv_srq *srq = ibv_create_srq(pd, &si);
        struct ibv_qp *qp = cq && srq ? create_srq_rc(cq, srq) : NULL;
        struct ibv_qp_attr err = {.qp_state = IBV_QPS_ERR};
        int errored = qp && !to_init(qp) && ibv_modify_qp(qp, &err, IBV_QP_STATE) == 0;
        struct pollfd pf = {.fd = ctx->async_fd, .events = POLLIN};
        int pending = errored && poll(&pf, 1, 2000) == 1;
        void *gone = qp;
        int destroyed = qp && ibv_destroy_qp(qp) == 0;
        /* Whatever else the context hears meanwhile (a GID or port event) is read and
         * acknowledged; an event for the destroyed QP is only looked at, never acknowledged
         * (that would lock its freed mutex). */
        int stale = 0;
        while (destroyed) {
            pf.revents = 0;
            if (poll(&pf, 1, 200) != 1)
                break;
            struct ibv_async_event ev;
            if (ibv_get_async_event(ctx, &ev))
                break;
            if (ev.element.qp == gone) {
                stale++;
                break;
            }
            ibv_ack_async_event(&ev);
        }
        CHECK("destroyed_qp_async_events_dropped", pending && destroyed && !stale,
              "errored %d, event pending %d, destroyed %d, events for the freed QP %d", errored,
              pending, destroyed, stale);
        if (srq)
            ibv_destroy_srq(srq);
        if (cq)
            ibv_destroy_cq(cq);
    }

    /* Registering memory that is not mapped, or read-only memory for writing, fails with
     * EFAULT as on rdma_rxe (which pins the pages): otherwise a peer's WRITE into it would
     * crash the process. Read-only memory registered for reading, and the huge-page hint,
     * are fine. */
    {
        long page = sysconf(_SC_PAGESIZE);
        char *hole = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (hole != MAP_FAILED)
            munmap(hole, 2 * page);
        errno = 0;
        struct ibv_mr *m = hole != MAP_FAILED
                               ? ibv_reg_mr(pd, hole, 2 * page, IBV_ACCESS_LOCAL_WRITE)
                               : NULL;
        CHECK("reg_mr_unmapped_memory", !m && errno == EFAULT, "mr %p errno %d", (void *)m,
              errno);
        if (m)
            ibv_dereg_mr(m);
        char *ro = mmap(NULL, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        errno = 0;
        m = ro != MAP_FAILED ? ibv_reg_mr(pd, ro, page, IBV_ACCESS_REMOTE_WRITE |
                                                          IBV_ACCESS_LOCAL_WRITE)
                             : NULL;
        CHECK("reg_mr_read_only_for_writing", !m && errno == EFAULT, "mr %p errno %d",
              (void *)m, errno);
        if (m)
            ibv_dereg_mr(m);
        m = ro != MAP_FAILED ? ibv_reg_mr(pd, ro, page, IBV_ACCESS_REMOTE_READ) : NULL;
        CHECK("reg_mr_read_only_for_reading", m != NULL, "errno %d", errno);
        if (m)
            ibv_dereg_mr(m);
        if (ro != MAP_FAILED)
            munmap(ro, page);
        m = ibv_reg_mr(pd, other, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_HUGETLB);
        CHECK("reg_mr_hugetlb_hint", m != NULL, "errno %d", errno);
        if (m)
            ibv_dereg_mr(m);
    }

    /* Deregistering an MR and then using its key. */
    if (make_pair(&p, 16) == 0) {
        struct ibv_mr *gone = ibv_reg_mr(pd, other, 4096, IBV_ACCESS_LOCAL_WRITE);
        uint32_t lkey = gone->lkey;
        ibv_dereg_mr(gone);
        int r = post_write(p.a, other, 64, lkey, (uintptr_t)buf + 8192, mr->rkey, 0);
        int ok = r == 0 && poll_one(p.cq, &wc) && wc.status == IBV_WC_LOC_PROT_ERR;
        CHECK("deregistered_lkey", ok, "post returned %d, status %d (%s)", r, wc.status,
              ibv_wc_status_str(wc.status));
        free_pair(&p);
    }

    /* An address handle without a GRH cannot address anything on RoCE: refused (xroce also
     * says why on stderr). */
    {
        struct ibv_ah_attr no_grh = {.is_global = 0, .port_num = 1};
        errno = 0;
        struct ibv_ah *a = ibv_create_ah(pd, &no_grh);
        CHECK("create_ah_without_grh", a == NULL && errno == EINVAL, "got %p errno %d",
              (void *)a, errno);
        if (a)
            ibv_destroy_ah(a);
    }

    /* A UD send names an AH of another PD: refused (verbs wants the QP's PD; rdma_rxe fails
     * such a request), with bad_wr pointing at it. */
    {
        struct ibv_pd *other_pd = ibv_alloc_pd(ctx);
        struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
        struct ibv_qp_init_attr ia = {
            .send_cq = cq,
            .recv_cq = cq,
            .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
            .qp_type = IBV_QPT_UD,
        };
        struct ibv_qp *qp = cq ? ibv_create_qp(pd, &ia) : NULL;
        struct ibv_qp_attr qa = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x11111111};
        int ready = qp && !ibv_modify_qp(qp, &qa,
                                         IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                             IBV_QP_QKEY);
        qa.qp_state = IBV_QPS_RTR;
        ready = ready && !ibv_modify_qp(qp, &qa, IBV_QP_STATE);
        qa.qp_state = IBV_QPS_RTS;
        qa.sq_psn = 0;
        ready = ready && !ibv_modify_qp(qp, &qa, IBV_QP_STATE | IBV_QP_SQ_PSN);
        struct ibv_ah_attr aa = {
            .is_global = 1,
            .port_num = 1,
            .grh = {.dgid = gid, .sgid_index = gid_index, .hop_limit = 64},
        };
        struct ibv_ah *foreign = other_pd ? ibv_create_ah(other_pd, &aa) : NULL;
        struct ibv_ah *own = ibv_create_ah(pd, &aa);
        struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
        struct ibv_send_wr wr = {.sg_list = &sge,
                                 .num_sge = 1,
                                 .opcode = IBV_WR_SEND,
                                 .send_flags = IBV_SEND_SIGNALED,
                                 .wr.ud = {.ah = foreign, .remote_qpn = 1, .remote_qkey = 1}};
        struct ibv_send_wr *bad = NULL;
        int r = ready && foreign ? ibv_post_send(qp, &wr, &bad) : -1;
        /* The same request with the QP's own PD's AH goes (to a QPN nobody has: dropped). */
        wr.wr.ud.ah = own;
        int r_own = ready && own ? ibv_post_send(qp, &wr, &bad) : -1;
        int sent = r_own == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS;
        CHECK("ud_ah_of_another_pd", r == EINVAL && bad == &wr && sent,
              "ready %d, returned %d (own PD's AH: %d, completed %d)", ready, r, r_own, sent);
        if (own)
            ibv_destroy_ah(own);
        if (foreign)
            ibv_destroy_ah(foreign);
        if (qp)
            ibv_destroy_qp(qp);
        if (cq)
            ibv_destroy_cq(cq);
        if (other_pd)
            ibv_dealloc_pd(other_pd);
    }

    /* A receive posted to a QP in the error state completes at once, flushed; an application
     * waiting on its completion channel hears of it (nothing else happens on the device to
     * carry the event along). */
    {
        struct flushing_qp f = make_flushing_qp();
        struct ibv_comp_channel *ch = f.ch;
        struct ibv_cq *cq = f.cq;
        struct ibv_qp *qp = f.qp;
        int in_error = f.in_error;
        int armed = in_error && ibv_req_notify_cq(cq, 0) == 0;
        /* Long enough for the engine's progress thread to have gone to sleep. */
        usleep(200 * 1000);
        struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
        struct ibv_recv_wr rwr = {.wr_id = 7, .sg_list = &sge, .num_sge = 1};
        struct ibv_recv_wr *rbad = NULL;
        int posted = armed && ibv_post_recv(qp, &rwr, &rbad) == 0;
        struct pollfd pf = {.fd = ch ? ch->fd : -1, .events = POLLIN};
        struct ibv_cq *ev_cq = NULL;
        void *ev_ctx;
        /* The event is written during ibv_post_recv: the channel is readable when it returns
         * (not only after the engine's next wake-up of its own). */
        int heard = posted && poll(&pf, 1, 0) == 1 &&
                    ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq;
        if (heard)
            ibv_ack_cq_events(ev_cq, 1);
        int flushed = heard && ibv_poll_cq(cq, 1, &wc) == 1 && wc.wr_id == 7 &&
                      wc.status == IBV_WC_WR_FLUSH_ERR;
        CHECK("post_recv_in_error_notifies_the_channel", flushed,
              "in error %d, armed %d, posted %d, event %d, flushed %d", in_error, armed, posted,
              heard, flushed);
        /* A chain whose last WR points back into it (an application's bug) ends with ENOMEM
         * on a QP in error too, whose WRs complete at once and never fill the queue. Last
         * among the checks on this QP: its CQ overflows. */
        struct ibv_recv_wr loop_b = {.wr_id = 9, .sg_list = &sge, .num_sge = 1};
        struct ibv_recv_wr loop_a = {.wr_id = 8, .sg_list = &sge, .num_sge = 1, .next = &loop_b};
        loop_b.next = &loop_a;
        rbad = NULL;
        int r = in_error ? ibv_post_recv(qp, &loop_a, &rbad) : -1;
        CHECK("cyclic_wr_chain_on_a_qp_in_error_ends", r == ENOMEM && rbad != NULL,
              "returned %d", r);
        free_flushing_qp(&f);
    }

    /* A signal interrupts ibv_get_cq_event as it interrupts the read(2) of libibverbs' own
     * definition: only when its handler lacks SA_RESTART. (xroce's definition waits in
     * poll(2), which every handled signal interrupts, while it takes the engine's frames.) */
    {
        struct flushing_qp f = make_flushing_qp();
        struct ibv_comp_channel *ch = f.ch;
        struct ibv_cq *cq = f.cq;
        struct ibv_qp *qp = f.qp;
        int in_error = f.in_error;
        struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
        struct ibv_recv_wr rwr = {.wr_id = 11, .sg_list = &sge, .num_sge = 1};
        struct ibv_recv_wr *rbad = NULL;
        for (int restart = 1; restart >= 0; restart--) {
            struct cq_event_waiter w = {.ch = ch};
            int armed = in_error && ibv_req_notify_cq(cq, 0) == 0;
            handle_sigusr1(restart);
            int started = armed && pthread_create(&w.thread, NULL, wait_for_cq_event, &w) == 0;
            /* Long enough for the waiter to be blocked. */
            usleep(200 * 1000);
            int returned = 0;
            /* Again and again (until it returns, for at most 0.3 s with SA_RESTART and 2 s
             * without): a signal that came before the waiter blocked in poll(2) interrupted
             * nothing (a loaded machine may keep the waiter off its core past the sleep). */
            for (int i = 0; started && i < (restart ? 6 : 40) && !returned; i++) {
                pthread_kill(w.thread, SIGUSR1);
                returned = waiter_returned(&w, 50);
            }
            /* The flushed receive raises the event: a waiter still waiting takes it. */
            int posted = in_error && ibv_post_recv(qp, &rwr, &rbad) == 0;
            int ended = started && waiter_returned(&w, 2000);
            if (ended)
                pthread_join(w.thread, NULL);
            if (w.done && w.rc == 0)
                ibv_ack_cq_events(w.cq, 1);
            else if (posted) {
                /* The event is waiting in the channel: taken, so that the next round starts
                 * from an empty channel. */
                struct ibv_cq *ev_cq;
                void *ev_ctx;
                struct pollfd pf = {.fd = ch->fd, .events = POLLIN};
                if (poll(&pf, 1, 2000) == 1 && ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0)
                    ibv_ack_cq_events(ev_cq, 1);
            }
            while (cq && ibv_poll_cq(cq, 1, &wc) == 1)
                ;
            if (restart)
                CHECK("a_signal_with_sa_restart_leaves_get_cq_event_waiting",
                      started && !returned && posted && ended && w.rc == 0 && w.cq == cq,
                      "armed %d, started %d, returned on the signal %d, event %d (rc %d, %s)",
                      armed, started, returned, ended, w.rc, strerror(w.err));
            else
                CHECK("a_signal_without_sa_restart_interrupts_get_cq_event",
                      started && returned && w.rc == -1 && w.err == EINTR,
                      "armed %d, started %d, returned on the signal %d (rc %d, %s)", armed,
                      started, returned, w.rc, strerror(w.err));
            if (started && !ended) {
                printf("FAIL setup: a thread stays blocked in ibv_get_cq_event\n");
                return 1;
            }
        }
        signal(SIGUSR1, SIG_DFL);
        free_flushing_qp(&f);
    }

    /* A thread cancelled while it waits in ibv_get_cq_event ends there, as it does in the
     * read(2) of libibverbs' own definition (rping cancels its CQ thread so); the process goes
     * on. */
    {
        struct flushing_qp f = make_flushing_qp();
        struct cq_event_waiter w = {.ch = f.ch};
        int armed = f.in_error && ibv_req_notify_cq(f.cq, 0) == 0;
        int started =
            armed && pthread_create(&w.thread, NULL, wait_for_cq_event_until_cancelled, &w) == 0;
        /* Long enough for the waiter to be blocked. */
        usleep(200 * 1000);
        int asked = started && !w.done && pthread_cancel(w.thread) == 0;
        int ended = asked && waiter_returned(&w, 2000);
        void *ret = NULL;
        if (ended)
            pthread_join(w.thread, &ret);
        CHECK("a_thread_waiting_for_a_cq_event_can_be_cancelled",
              ended && ret == PTHREAD_CANCELED && w.err == ECANCELED,
              "armed %d, started %d, cancel asked %d, ended %d (rc %d)", armed, started, asked,
              ended, w.rc);
        if (started && !ended) {
            printf("FAIL setup: a cancelled thread stays blocked in ibv_get_cq_event\n");
            return 1;
        }
        free_flushing_qp(&f);
    }

    /* A completion vector the context does not have is refused, as the kernel refuses one
     * at or beyond num_comp_vectors. */
    {
        errno = 0;
        struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, ctx->num_comp_vectors);
        int err = errno;
        CHECK("create_cq_comp_vector_out_of_range", cq == NULL && err == EINVAL,
              "cq %p errno %d (num_comp_vectors %d)", (void *)cq, err, ctx->num_comp_vectors);
        if (cq)
            ibv_destroy_cq(cq);
    }

    /* RESET -> ERR is a legal transition (Linux's table; teardown code moves every QP to ERR
     * whatever its state), and a receive posted then is flushed. */
    {
        struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
        struct ibv_qp *qp = cq ? create_rc(cq, cq, 4, 0) : NULL;
        struct ibv_qp_attr qa = {.qp_state = IBV_QPS_ERR};
        int r = qp ? ibv_modify_qp(qp, &qa, IBV_QP_STATE) : -1;
        struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
        struct ibv_recv_wr rwr = {.wr_id = 5, .sg_list = &sge, .num_sge = 1};
        struct ibv_recv_wr *rbad = NULL;
        int posted = r == 0 && ibv_post_recv(qp, &rwr, &rbad) == 0;
        int flushed = posted && poll_one(cq, &wc) == 1 && wc.wr_id == 5 &&
                      wc.status == IBV_WC_WR_FLUSH_ERR;
        CHECK("modify_qp_reset_to_err", r == 0 && flushed, "modify returned %d, posted %d",
              r, posted);
        if (qp)
            ibv_destroy_qp(qp);
        if (cq)
            ibv_destroy_cq(cq);
    }

    /* Attributes rdma_rxe users meet from the kernel: an address naming a port the device
     * does not have is refused (uverbs checks it before any driver), as are alternate paths
     * (Linux bans them on RoCE), while the migration state is kept and reported back. */
    {
        struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
        struct ibv_qp *qp = cq ? create_rc(cq, cq, 4, 0) : NULL;
        int init = qp && to_init(qp) == 0;
        struct ibv_qp_attr a = {
            .qp_state = IBV_QPS_RTR,
            .path_mtu = IBV_MTU_1024,
            .dest_qp_num = qp ? qp->qp_num : 0,
            .max_dest_rd_atomic = 1,
            .min_rnr_timer = 1,
            .ah_attr = {.is_global = 1, .port_num = 2,
                        .grh = {.dgid = gid, .sgid_index = gid_index, .hop_limit = 1}},
        };
        int rtr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                       IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        int wrong_port = init ? ibv_modify_qp(qp, &a, rtr_mask) : -1;
        a.ah_attr.port_num = 1;
        a.alt_ah_attr = a.ah_attr;
        a.alt_port_num = 1;
        int alt = init ? ibv_modify_qp(qp, &a, rtr_mask | IBV_QP_ALT_PATH) : -1;
        int rtr = init ? ibv_modify_qp(qp, &a, rtr_mask) : -1;
        struct ibv_qp_attr s = {.qp_state = IBV_QPS_RTS,
                                .timeout = 14,
                                .retry_cnt = 7,
                                .rnr_retry = 7,
                                .max_rd_atomic = 1,
                                .path_mig_state = IBV_MIG_REARM};
        int rts = rtr == 0 ? ibv_modify_qp(qp, &s,
                                           IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                               IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                               IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_PATH_MIG_STATE)
                           : -1;
        struct ibv_qp_attr q = {.path_mig_state = IBV_MIG_MIGRATED};
        struct ibv_qp_init_attr qi;
        int queried = rts == 0 && ibv_query_qp(qp, &q, IBV_QP_STATE | IBV_QP_PATH_MIG_STATE,
                                               &qi) == 0;
        CHECK("modify_qp_av_port_out_of_range", wrong_port == EINVAL, "returned %d",
              wrong_port);
        CHECK("modify_qp_alt_path_refused", alt == EINVAL, "returned %d", alt);
        CHECK("modify_qp_path_mig_state_kept",
              rtr == 0 && rts == 0 && queried && q.qp_state == IBV_QPS_RTS &&
                  q.path_mig_state == IBV_MIG_REARM,
              "rtr %d rts %d queried %d state %d path_mig_state %d", rtr, rts, queried,
              q.qp_state, q.path_mig_state);
        struct ibv_ah_attr aa = {.is_global = 1,
                                 .port_num = 0,
                                 .grh = {.dgid = gid, .sgid_index = gid_index, .hop_limit = 64}};
        errno = 0;
        struct ibv_ah *ah = ibv_create_ah(pd, &aa);
        int err = errno;
        CHECK("create_ah_port_out_of_range", ah == NULL && err == EINVAL, "got %p errno %d",
              (void *)ah, err);
        if (ah)
            ibv_destroy_ah(ah);
        if (qp)
            ibv_destroy_qp(qp);
        if (cq)
            ibv_destroy_cq(cq);
    }

    /* An AV outside the move to RTR carries its port (uverbs adds IBV_QP_PORT): UC's SQD->SQD
     * takes an AV but no port, so Linux refuses it there, while RC's takes both. */
    {
        struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
        struct ibv_qp_init_attr ia = {
            .send_cq = cq,
            .recv_cq = cq,
            .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
            .qp_type = IBV_QPT_UC,
        };
        struct ibv_qp *uc = cq ? ibv_create_qp(pd, &ia) : NULL;
        struct ibv_qp *rc = cq ? create_rc(cq, cq, 4, 0) : NULL;
        struct ibv_ah_attr av = {.is_global = 1, .port_num = 1,
                                 .grh = {.dgid = gid, .sgid_index = gid_index, .hop_limit = 1}};
        struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                                .port_num = 1,
                                .qp_access_flags = IBV_ACCESS_REMOTE_WRITE};
        int uc_sqd = uc && !ibv_modify_qp(uc, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
                                                      IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
        a.qp_state = IBV_QPS_RTR;
        a.path_mtu = IBV_MTU_1024;
        a.dest_qp_num = uc ? uc->qp_num : 0;
        a.ah_attr = av;
        uc_sqd = uc_sqd && !ibv_modify_qp(uc, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                                      IBV_QP_DEST_QPN | IBV_QP_RQ_PSN);
        a.qp_state = IBV_QPS_RTS;
        uc_sqd = uc_sqd && !ibv_modify_qp(uc, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
        a.qp_state = IBV_QPS_SQD;
        uc_sqd = uc_sqd && !ibv_modify_qp(uc, &a, IBV_QP_STATE);
        int rc_sqd = rc && !to_init(rc) && !to_rtr_rts(rc, rc->qp_num) &&
                     !ibv_modify_qp(rc, &a, IBV_QP_STATE);
        int uc_av = uc_sqd ? ibv_modify_qp(uc, &a, IBV_QP_AV) : -1;
        int rc_av = rc_sqd ? ibv_modify_qp(rc, &a, IBV_QP_AV) : -1;
        CHECK("modify_qp_av_in_sqd_carries_its_port", uc_av == EINVAL && rc_av == 0,
              "UC in SQD %d: %d; RC in SQD %d: %d", uc_sqd, uc_av, rc_sqd, rc_av);
        if (uc)
            ibv_destroy_qp(uc);
        if (rc)
            ibv_destroy_qp(rc);
        if (cq)
            ibv_destroy_cq(cq);
    }

    /* An SRQ made with max_sge 0 takes receives of one SGE, as rdma_rxe raises max_sge to
     * one; the values in effect are written back. */
    {
        struct ibv_srq_init_attr si = {.attr = {.max_wr = 16, .max_sge = 0}};
        struct ibv_srq *srq = ibv_create_srq(pd, &si);
        struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
        struct ibv_recv_wr rwr = {.wr_id = 6, .sg_list = &sge, .num_sge = 1};
        struct ibv_recv_wr *rbad = NULL;
        int r = srq ? ibv_post_srq_recv(srq, &rwr, &rbad) : -1;
        CHECK("create_srq_with_no_sge_takes_one", srq && r == 0 && si.attr.max_sge == 1,
              "srq %p, post_srq_recv returned %d, max_sge written back %u", (void *)srq, r,
              si.attr.max_sge);
        if (srq)
            ibv_destroy_srq(srq);
    }

    /* Closing a context destroys what its application left on it, also while another context
     * keeps the device's engine running: a peer no longer reaches its QP, nor through the
     * R_Key the memory the application may now free. */
    {
        struct ibv_context *ctx2 = ibv_open_device(list[0]);
        struct ibv_pd *pd2 = ctx2 ? ibv_alloc_pd(ctx2) : NULL;
        char *target = aligned_alloc(4096, 4096);
        if (target)
            memset(target, 0, 4096);
        struct ibv_mr *mr2 =
            pd2 && target
                ? ibv_reg_mr(pd2, target, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
                : NULL;
        struct ibv_cq *cq2 = ctx2 ? ibv_create_cq(ctx2, 4, NULL, NULL, 0) : NULL;
        struct ibv_qp_init_attr qa2 = {
            .send_cq = cq2,
            .recv_cq = cq2,
            .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1},
            .qp_type = IBV_QPT_RC,
        };
        struct ibv_qp *qp2 = cq2 && pd2 ? ibv_create_qp(pd2, &qa2) : NULL;
        struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
        struct ibv_qp *qp = cq ? create_rc(cq, cq, 4, 0) : NULL;
        int up = qp && qp2 && mr2 && !to_init(qp) && !to_init(qp2) &&
                 !to_rtr_rts(qp, qp2->qp_num) && !to_rtr_rts(qp2, qp->qp_num);
        uint32_t rkey = mr2 ? mr2->rkey : 0;
        int before = up && post_write(qp, buf, 64, mr->lkey, (uintptr_t)target, rkey, 0) == 0 &&
                     poll_one(cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS &&
                     memcmp(target, buf, 64) == 0;
        if (target)
            memset(target, 0, 4096);
        if (ctx2)
            ibv_close_device(ctx2);
        int posted = before &&
                     post_write(qp, buf, 64, mr->lkey, (uintptr_t)target, rkey, 0) == 0;
        /* Nothing answers for the QP any more: the WRITE is retried (its completion, an
         * error, may come after this wait), and the memory is never written. */
        int completed = 0;
        double end = now_s() + 1;
        while (posted && !completed && now_s() < end)
            completed = ibv_poll_cq(cq, 1, &wc) == 1;
        int untouched = target && target[0] == 0 && memcmp(target, target + 64, 64) == 0;
        CHECK("close_device_destroys_what_it_left",
              posted && untouched && !(completed && wc.status == IBV_WC_SUCCESS),
              "connected %d, write before the close %d, after it: completed %d (%s), memory "
              "untouched %d",
              up, before, completed, completed ? ibv_wc_status_str(wc.status) : "-", untouched);
        if (qp)
            ibv_destroy_qp(qp);
        if (cq)
            ibv_destroy_cq(cq);
        free(target);
    }

    /* A forked child that closes the device context it inherited (as its exit handlers may)
     * ends cleanly, told meanwhile that the context is not its own to use; and the parent's
     * device goes on working. The child used to abort, joining threads that are only the
     * parent's, after stopping the parent's port watcher. The parent's objects are refused
     * too (EIO): the child would write into the parent's rings, or wait for good on a lock
     * a parent's thread held at the fork; destroying one in the child leaves it to the
     * parent. The child's exit status has a bit for each check that failed. */
    {
        struct pair inh = {0};
        int inh_ok = make_pair(&inh, 4) == 0;
        fflush(stdout);
        pid_t child = fork();
        if (child == 0) {
            if (!inh_ok)
                _exit(32); /* the parent's pair was not made */
            int failed = 0;
            errno = 0;
            struct ibv_pd *cpd = ibv_alloc_pd(ctx);
            if (!(cpd == NULL && errno == EIO))
                failed |= 1;
            struct ibv_wc cwc;
            if (!(ibv_poll_cq(inh.cq, 1, &cwc) < 0))
                failed |= 2;
            struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey};
            struct ibv_send_wr wr = {.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND};
            struct ibv_send_wr *bad = NULL;
            if (!(ibv_post_send(inh.a, &wr, &bad) == EIO && bad == &wr))
                failed |= 4;
            errno = 0;
            struct ibv_mr *cmr = ibv_reg_mr(pd, buf, 64, IBV_ACCESS_LOCAL_WRITE);
            if (!(cmr == NULL && errno == EIO))
                failed |= 8;
            if (ibv_destroy_qp(inh.a) || ibv_destroy_qp(inh.b) || ibv_destroy_cq(inh.cq))
                failed |= 16;
            ibv_close_device(ctx);
            _exit(failed);
        }
        /* Bounded: a child still there after 20 s is killed (and the check fails). */
        int status = -1;
        pid_t waited = -1;
        double until = now_s() + 20;
        while (child > 0 && waited == -1 && now_s() < until) {
            pid_t w = waitpid(child, &status, WNOHANG);
            if (w == child)
                waited = w;
            else
                usleep(10 * 1000);
        }
        if (child > 0 && waited == -1) {
            kill(child, SIGKILL);
            waitpid(child, NULL, 0);
        }
        /* The child's destroys left the parent's objects be. */
        int inh_works = inh_ok &&
                        post_write(inh.a, buf, 64, mr->lkey, (uintptr_t)(buf + 4096), mr->rkey,
                                   0) == 0 &&
                        poll_one(inh.cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS;
        if (inh_ok)
            free_pair(&inh);
        struct pair fp = {0};
        int works = inh_works && make_pair(&fp, 4) == 0 &&
                    post_write(fp.a, buf, 64, mr->lkey, (uintptr_t)(buf + 4096), mr->rkey, 0) ==
                        0 &&
                    poll_one(fp.cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS;
        if (fp.a)
            ibv_destroy_qp(fp.a);
        if (fp.b)
            ibv_destroy_qp(fp.b);
        if (fp.cq)
            ibv_destroy_cq(fp.cq);
        int clean = child > 0 && waited == child && WIFEXITED(status) &&
                    WEXITSTATUS(status) == 0;
        CHECK("forked_child_closes_the_inherited_context", clean && works,
              "child %d: %s %d (status bits: 1 alloc_pd, 2 poll_cq, 4 post_send, 8 reg_mr, "
              "16 destroy, 32 no pair made); the parent's objects afterwards: %s; its device: %s",
              (int)child,
              waited != child ? "did not end within 20 s, or no child:"
              : WIFEXITED(status) ? "exit status"
                                  : "killed by signal",
              waited != child ? 0 : WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
              inh_works ? "work" : "FAILED", works ? "works" : "FAILED");
    }

    /* A PD still holding an MR cannot be freed. */
    {
        int r = ibv_dealloc_pd(pd);
        CHECK("dealloc_pd_in_use", r == EBUSY, "returned %d", r);
    }

    ibv_dereg_mr(mr);
    ibv_dealloc_pd(pd);
    /* Objects an application never destroyed do not keep the device busy: closing the
     * context ends the engine (as closing a kernel device's file would), and the device opens
     * and works again. */
    struct ibv_cq *leaked = ibv_create_cq(ctx, 4, NULL, NULL, 0);
    ibv_close_device(ctx);
    ctx = ibv_open_device(list[0]);
    pd = ctx ? ibv_alloc_pd(ctx) : NULL;
    struct ibv_cq *again = ctx ? ibv_create_cq(ctx, 4, NULL, NULL, 0) : NULL;
    CHECK("reopen_after_leaked_objects", leaked && pd && again, "leaked %p pd %p cq %p",
          (void *)leaked, (void *)pd, (void *)again);
    if (again)
        ibv_destroy_cq(again);
    if (pd)
        ibv_dealloc_pd(pd);
    if (ctx)
        ibv_close_device(ctx);
    /* A program that leaks a CQ per session and opens the device again and again: each
     * closed context's engine stops although the leaked CQ keeps it, and its threads go with
     * the stop (a neighbour keep-alive thread per session used to stay until the process
     * ended). A few descriptors per session still stay with the stopped engine. */
    {
        int threads_before = count_threads(), fds_before = count_fds();
        for (int i = 0; i < 8; i++) {
            struct ibv_context *c = ibv_open_device(list[0]);
            if (!c || !ibv_create_cq(c, 4, NULL, NULL, 0)) {
                threads_before = -100;
                break;
            }
            ibv_close_device(c);
        }
        /* A stopped engine's helper thread ends on its own, a moment after the stop. */
        int threads = 0, fds = 0;
        for (double end = now_s() + 5; now_s() < end; usleep(10 * 1000)) {
            threads = count_threads();
            fds = count_fds();
            if (threads <= threads_before)
                break;
        }
        CHECK("closed_contexts_with_leaked_objects_leave_no_threads", threads <= threads_before,
              "threads %d -> %d, descriptors %d -> %d after 8 sessions", threads_before, threads,
              fds_before, fds);
    }
    /* The first verbs of several contexts at once: one of them starts the device's engine,
     * the others wait for that start and join it (a second engine on the device's queue
     * would fail with EBUSY). Then, round after round, the last context closes while another
     * opens: the new one either joins before the stop and keeps the engine, or waits for the
     * stop and starts a new one. Either way its QPs carry a WRITE. The new context's first
     * verb comes later from round to round, so that some land while the old engine stops (for
     * a while: the QPs destroyed just before linger to answer resends). */
    {
        enum { OPENERS = 4, ROUNDS = 6 };
        struct opener first[OPENERS], next[ROUNDS];
        pthread_t t[OPENERS], closing;
        pthread_barrier_t start;
        init_barrier(&start, OPENERS);
        for (int i = 0; i < OPENERS; i++) {
            first[i] = (struct opener){.dev = list[0], .start = &start};
            start_thread(&t[i], open_and_use, &first[i]);
        }
        for (int i = 0; i < OPENERS; i++)
            pthread_join(t[i], NULL);
        pthread_barrier_destroy(&start);
        int opened = 0;
        for (int i = 0; i < OPENERS; i++)
            opened += first[i].ctx && first[i].pd && first[i].cq;
        int carried = write_works(&first[0]) && write_works(&first[OPENERS - 1]);
        CHECK("concurrent_first_verbs_share_one_engine", opened == OPENERS && carried,
              "%d of %d contexts got a PD and a CQ, WRITEs %s", opened, OPENERS,
              carried ? "carried" : "failed");
        struct opener *previous = first;
        int previous_n = OPENERS, rounds_ok = 0;
        for (int r = 0; r < ROUNDS; r++) {
            init_barrier(&start, 2);
            static const int delays_ms[ROUNDS] = {0, 2, 10, 30, 50, 80};
            next[r] = (struct opener){.dev = list[0], .start = &start, .delay_ms = delays_ms[r]};
            struct closer c = {.start = &start, .opened = previous, .n = previous_n};
            start_thread(&closing, close_all, &c);
            start_thread(&t[0], open_and_use, &next[r]);
            pthread_join(closing, NULL);
            pthread_join(t[0], NULL);
            pthread_barrier_destroy(&start);
            rounds_ok += write_works(&next[r]);
            previous = &next[r];
            previous_n = 1;
        }
        close_opened(previous);
        CHECK("a_context_opened_as_the_last_closes_works", rounds_ok == ROUNDS,
              "%d of %d rounds carried a WRITE", rounds_ok, ROUNDS);
    }
    ibv_free_device_list(list);
    printf("%s: %d failed\n", failures ? "FAILED" : "passed", failures);
    return failures ? 1 : 0;
}
