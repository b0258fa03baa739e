/* Interposers of the launch family (cuda_launch.def) and the compute limiter.
 *
 * Each launch on a limited device passes a gate (README.md, "Compute limiter"):
 *  1. Its cost is its kernel signature's measured GPU time (function + grid +
 *     block, or the graph), from a per-process table (limiter.h); a signature
 *     not measured yet is charged the device's running average provisionally.
 *  2. It is admitted on the container's virtual clock (limiter.h: no banked
 *     credit beyond the burst, debt bounded), charged cost*100/share. A thread
 *     that launches often reserves the shared clock in chunks and spends them
 *     locally, so the fast path touches no shared cache line that others write.
 *  3. Measurement: each thread brackets about one launch per millisecond (and
 *     every launch of a signature not measured yet) with two events. The start
 *     event is stamped when the device reaches it, i.e. after whatever other
 *     tenants queued before it, so the bracket holds this kernel's own GPU time
 *     (less the host gap when the device was idle). The finished sample updates
 *     the signature's cost and settles the difference between what the launch
 *     was charged and what it used on the clock.
 * Under the `share` policy a device is not throttled while the node agent
 * reports that nobody else uses the GPU (work-conserving); under `hard` always.
 * Launches that a stream captures into a graph run nothing and are let through
 * (checked when a thread reserves or samples: the fast path spends tokens). */
#include "launch.h"

#include <pthread.h>
#include <string.h>
#include <time.h>

#include "functions.h"
#include "limiter.h"
#include "log.h"
#include "state.h"

#define MS 1000000ull
#define BURST_NS (20 * MS)          /* how far ahead of its share a container may run */
#define MAX_DEBT_NS (2000 * MS)     /* the clock is never further ahead: the longest hold */
#define TOKEN_CHUNK_NS (1 * MS)     /* a busy thread reserves the shared clock this much at once */
#define TOKEN_TTL_NS (2 * MS)       /* a thread reserving again within this takes a chunk */
#define SAMPLE_EVERY_COST_NS (2 * MS) /* per thread: one sample per ~2 ms of GPU time charged */
#define SAMPLE_EVERY_LAUNCHES 1024  /* ... or per ~1024 launches, whichever comes first */
#define SAMPLE_SLOTS 32             /* event pairs in flight per process */
#define POLL_EVERY_COST_NS (100 * 1000ull) /* per thread, while samples are pending: look */
#define POLL_EVERY_LAUNCHES 16             /* at them after 100 us of GPU time or 16 launches */
#define SAMPLE_GIVE_UP_NS (2000 * MS)
#define DRAIN_MAX_NS (100 * MS)     /* a sampled launch waits at most this for its stream */
#define DRAIN_EVERY_NS (500 * MS)   /* per process, besides every signature's first sample */
#define DRAIN_POLL_NS (50 * 1000ull)
#define MAX_SAMPLE_NS (3600000 * MS)
#define AGENT_FRESH_NS (3000 * MS)
#define OTHERS_IDLE_PERCENT 5.0
#define COUNT_FLUSH 256 /* launches a thread counts before adding them to the region */

struct device {
    unsigned share; /* 1-99; 0 = not limited */
    uint64_t charge_q16; /* 100 / share in 16.16 fixed point: no division per launch */
    _Atomic uint64_t mean_cost_ns; /* provisional cost of a signature not measured yet */
    _Atomic uint64_t agent_until_ns;
    _Atomic int others_idle;
};

enum { SAMPLE_EMPTY, SAMPLE_READY, SAMPLE_BUSY, SAMPLE_PENDING };

/* One event pair. EMPTY: no events; READY: events of `ctx`, free; BUSY: owned by
 * one thread; PENDING: recorded around a launch, waiting for the GPU. */
struct sample {
    _Atomic int state;
    CUevent start, end;
    CUcontext ctx;
    int dev, charged, exact;
    uint64_t key, cost_ns, idle_gap_ns, since_ns;
};

/* What a thread keeps to itself, so that a launch writes no shared memory: its
 * unflushed launch counts, the clock it reserved and has not spent yet, and
 * how much it launched since it last sampled and polled. The fast path reads
 * no clock either: time is read only to reserve, sample or poll. */
struct thread_state {
    uint64_t launches[VGPU_MAX_DEVICES];
    unsigned unflushed;
    uint64_t launched; /* by this thread, ever */
    int registered;
    uint64_t tokens_ns[VGPU_MAX_DEVICES], reserved_at_ns[VGPU_MAX_DEVICES];
    /* Launches and GPU time left before this thread next polls its pending
     * samples and next samples a launch; the launch path counts down only the
     * nearer of the two ("quiet"), from `span` (launch_events settles both). */
    int64_t poll_launches_left, poll_cost_left, sample_launches_left, sample_cost_left;
    int64_t quiet_launches, quiet_cost, span_launches, span_cost;
    uint64_t rng;
    /* The last known signature this thread launched and its cost: a kernel
     * launched over and over skips the finaliser and the table. Forgotten when
     * the thread samples, so a cost the table has re-learned reaches it. */
    uint64_t memo_signature, memo_key, memo_cost;
    int memo_dev, memo_valid;
};

static struct device devices[VGPU_MAX_DEVICES];
static struct vgpu_cost_table costs;
static struct sample samples[SAMPLE_SLOTS];
static _Atomic int pending_samples, events_broken, polling;
static _Atomic uint64_t next_drain_ns;
/* Driver entry points the gate calls on every launch, looked up once. */
static vgpu_cuStreamIsCapturing_fn is_capturing_fn;
static vgpu_cuCtxGetDevice_fn get_device_fn;
static int initialised, any_limited, single_device, launch_slot = -1;
static _Atomic uint64_t throttled_ns;
static pthread_key_t thread_key;
static int thread_key_ok;
/* initial-exec: the hook is loaded at start-up (LD_PRELOAD, /etc/ld.so.preload), so
 * its thread-local block is static and reached without a call. */
static _Thread_local struct thread_state me __attribute__((tls_model("initial-exec")));

static void flush_counts(struct thread_state *t)
{
    if (launch_slot < 0)
        launch_slot = vgpu_slot();
    for (int d = 0; d < VGPU_MAX_DEVICES && launch_slot >= 0; d++)
        if (t->launches[d])
            atomic_fetch_add_explicit(&vgpu_region->slots[launch_slot].launches[d],
                                      t->launches[d], memory_order_relaxed);
    memset(t->launches, 0, sizeof t->launches);
    t->unflushed = 0;
}

/* At thread exit: count what it launched, give back the clock it did not use. */
static void thread_exit(void *p)
{
    struct thread_state *t = p;
    flush_counts(t);
    uint64_t now = vgpu_now_ns();
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (t->tokens_ns[d] && devices[d].share)
            vgpu_clock_take(&vgpu_region->limiter_tat[d], now, 0, t->tokens_ns[d], BURST_NS,
                            MAX_DEBT_NS);
}

static void after_fork_in_child(void)
{
    launch_slot = -1; /* counts go to the child's own slot once it has one */
    memset(&me, 0, sizeof me); /* the parent's counts and tokens are the parent's */
    for (int i = 0; i < SAMPLE_SLOTS; i++) /* the parent's events are not the child's */
        atomic_store(&samples[i].state, SAMPLE_EMPTY);
    atomic_store(&pending_samples, 0);
}

void vgpu_launch_init(void)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        unsigned cores = vgpu_cfg.cores[d];
        devices[d].share = vgpu_cfg.policy != VGPU_COMPUTE_OFF && cores > 0 && cores < 100 ? cores
                                                                                          : 0;
        any_limited |= devices[d].share != 0;
        if (devices[d].share)
            devices[d].charge_q16 = (100ull << 16) / devices[d].share;
    }
    single_device = vgpu_cfg.described_devices == 1;
    is_capturing_fn = REAL(cuStreamIsCapturing);
    get_device_fn = REAL(cuCtxGetDevice);
    launch_slot = vgpu_slot();
    thread_key_ok = pthread_key_create(&thread_key, thread_exit) == 0;
    pthread_atfork(NULL, NULL, after_fork_in_child);
    __atomic_store_n(&initialised, 1, __ATOMIC_RELEASE);
}

uint64_t vgpu_launch_count(void)
{
    uint64_t n = 0;
    if (launch_slot >= 0)
        for (int d = 0; d < VGPU_MAX_DEVICES; d++)
            n += atomic_load_explicit(&vgpu_region->slots[launch_slot].launches[d],
                                      memory_order_relaxed);
    return n;
}

uint64_t vgpu_throttled_ns(void)
{
    return atomic_load_explicit(&throttled_ns, memory_order_relaxed);
}

void vgpu_launch_feedback(int dev, double sm_util, double container_util, uint64_t now)
{
    if (dev < 0 || dev >= VGPU_MAX_DEVICES || container_util < 0)
        return;
    struct device *d = &devices[dev];
    atomic_store(&d->others_idle, sm_util - container_util < OTHERS_IDLE_PERCENT);
    atomic_store(&d->agent_until_ns, now + AGENT_FRESH_NS);
}

/* --- measurement: sampled launches bracketed by events ------------------------------------------ */

static uint64_t next_random(struct thread_state *t)
{
    if (!t->rng)
        t->rng = (uint64_t)(uintptr_t)t ^ vgpu_now_ns() ^ 0x9e3779b97f4a7c15ull;
    t->rng ^= t->rng << 13, t->rng ^= t->rng >> 7, t->rng ^= t->rng << 17;
    return t->rng;
}

/* Puts a measured launch into the cost table and settles its charge at the
 * signature's updated average (robust to a sample another tenant inflated). */
static void settle(struct sample *s, uint64_t cost, uint64_t now)
{
    struct device *d = &devices[s->dev];
    cost = vgpu_cost_learn(&costs, s->key, cost, s->exact); /* settled at the robust average */
    atomic_store_explicit(&d->mean_cost_ns,
                          vgpu_cost_average(atomic_load_explicit(&d->mean_cost_ns,
                                                                 memory_order_relaxed),
                                            cost),
                          memory_order_relaxed);
    if (!s->charged || !d->share)
        return;
    uint64_t used = vgpu_launch_charge(cost, d->share);
    uint64_t charged = vgpu_launch_charge(s->cost_ns, d->share);
    if (used != charged)
        vgpu_clock_take(&vgpu_region->limiter_tat[s->dev], now, used > charged ? used - charged : 0,
                        charged > used ? charged - used : 0, BURST_NS, MAX_DEBT_NS);
}

/* Folds in finished samples; one thread of the process at a time. Never blocks. */
static void poll_samples(void)
{
    if (atomic_exchange_explicit(&polling, 1, memory_order_acquire))
        return;
    uint64_t now = vgpu_now_ns();
    for (int i = 0; i < SAMPLE_SLOTS; i++) {
        struct sample *s = &samples[i];
        int expected = SAMPLE_PENDING;
        if (atomic_load_explicit(&s->state, memory_order_relaxed) != SAMPLE_PENDING ||
            !atomic_compare_exchange_strong(&s->state, &expected, SAMPLE_BUSY))
            continue;
        CUresult q = REAL(cuEventQuery)(s->end);
        if (q == CUDA_ERROR_NOT_READY && now - s->since_ns < SAMPLE_GIVE_UP_NS) {
            atomic_store(&s->state, SAMPLE_PENDING);
            continue;
        }
        float ms;
        if (q == CUDA_SUCCESS &&
            REAL(cuEventElapsedTime)(&ms, s->start, s->end) == CUDA_SUCCESS && ms >= 0) {
            uint64_t elapsed = (uint64_t)((double)ms * 1e6);
            settle(s, vgpu_sample_cost(elapsed > MAX_SAMPLE_NS ? MAX_SAMPLE_NS : elapsed,
                                       s->idle_gap_ns),
                   now);
        }
        atomic_fetch_sub(&pending_samples, 1);
        atomic_store(&s->state, SAMPLE_READY);
    }
    atomic_store_explicit(&polling, 0, memory_order_release);
}

/* Takes an event pair of ctx (making one if needed); NULL if none is free. */
static struct sample *claim_sample(CUcontext ctx)
{
    struct sample *empty = NULL;
    for (int i = 0; i < SAMPLE_SLOTS; i++) {
        struct sample *s = &samples[i];
        int st = atomic_load_explicit(&s->state, memory_order_relaxed);
        if (st == SAMPLE_READY && s->ctx == ctx &&
            atomic_compare_exchange_strong(&s->state, &st, SAMPLE_BUSY))
            return s;
        if (st == SAMPLE_EMPTY && !empty)
            empty = s;
    }
    int st = SAMPLE_EMPTY;
    if (!empty || !atomic_compare_exchange_strong(&empty->state, &st, SAMPLE_BUSY))
        return NULL;
    vgpu_cuEventCreate_fn create = REAL(cuEventCreate);
    if (create(&empty->start, 0) != CUDA_SUCCESS) {
        atomic_store(&events_broken, 1); /* no measurement: signatures keep the mean */
        atomic_store(&empty->state, SAMPLE_EMPTY);
        return NULL;
    }
    if (create(&empty->end, 0) != CUDA_SUCCESS) {
        REAL(cuEventDestroy_v2)(empty->start);
        atomic_store(&events_broken, 1);
        atomic_store(&empty->state, SAMPLE_EMPTY);
        return NULL;
    }
    empty->ctx = ctx;
    return empty;
}

/* --- the gate every launch passes -------------------------------------------------------------- */

struct gate {
    struct sample *sample; /* non-NULL: recorded its start event; finish it after the launch */
    CUstream stream;
    uint64_t start_recorded_ns, launching_ns;
};

static inline int current_device_index(void)
{
    if (single_device)
        return 0;
    vgpu_cuCtxGetDevice_fn get = get_device_fn;
    CUdevice dev;
    return get && get(&dev) == CUDA_SUCCESS && dev >= 0 && dev < VGPU_MAX_DEVICES ? dev : -1;
}

static int capturing(CUstream stream)
{
    vgpu_cuStreamIsCapturing_fn is_capturing = is_capturing_fn;
    CUstreamCaptureStatus status;
    /* An error (e.g. the legacy stream during a global capture): treat as capturing. */
    return !is_capturing || is_capturing(stream, &status) != CUDA_SUCCESS ||
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

static uint64_t hold(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0) {
    }
    atomic_fetch_add_explicit(&throttled_ns, ns, memory_order_relaxed);
    return vgpu_now_ns();
}

/* Admits a launch charged `charge` of wall time on device dev. A launch into a
 * stream capturing a graph runs nothing and is let through; that is checked
 * only when the thread has to reserve (a captured launch may spend tokens the
 * thread holds: at most one chunk per capture). The thread first
 * spends what it reserved before (at most one chunk: the only credit a thread
 * keeps besides the container's burst); a thread that reserved within the last
 * TOKEN_TTL reserves at least a chunk, one that did not exactly its charge
 * (and gives back what it had left). */
static __attribute__((noinline)) void reserve(int dev, uint64_t charge, CUstream stream)
{
    uint64_t *tokens = &me.tokens_ns[dev];
    if (capturing(stream))
        return;
    uint64_t now = vgpu_now_ns();
    int recent = now - me.reserved_at_ns[dev] < TOKEN_TTL_NS;
    uint64_t refund = recent ? 0 : *tokens, have = recent ? *tokens : 0;
    uint64_t need = charge - have;
    uint64_t want = recent && need < TOKEN_CHUNK_NS ? TOKEN_CHUNK_NS : need;
    uint64_t wait = vgpu_clock_take(&vgpu_region->limiter_tat[dev], now, want, refund, BURST_NS,
                                    MAX_DEBT_NS);
    *tokens = have + want - charge;
    if (wait) {
        flush_counts(&me);
        now = hold(wait);
    }
    me.reserved_at_ns[dev] = now;
}

static inline void admit(int dev, uint64_t charge, CUstream stream)
{
    if (me.tokens_ns[dev] >= charge)
        me.tokens_ns[dev] -= charge; /* the fast path: no clock, no shared memory */
    else
        reserve(dev, charge, stream);
}

/* Called when the thread's quiet span ends (or for a signature not measured
 * yet, which polls and samples at every launch): polls pending samples after
 * POLL_EVERY_* of this thread's launches, and says whether this launch is its
 * next regular sample, due after about SAMPLE_EVERY_COST_NS of GPU time or
 * SAMPLE_EVERY_LAUNCHES launches, each drawn at random around its mean so that
 * no launch pattern aliases with it. */
static __attribute__((noinline)) int launch_events(uint64_t cost, int known)
{
    int64_t launches = me.span_launches - me.quiet_launches; /* this one included */
    int64_t spent = me.span_cost - me.quiet_cost + (int64_t)cost;
    me.poll_launches_left -= launches, me.poll_cost_left -= spent;
    me.sample_launches_left -= launches, me.sample_cost_left -= spent;
    if (!known || me.poll_launches_left <= 0 || me.poll_cost_left <= 0) {
        me.poll_launches_left = POLL_EVERY_LAUNCHES, me.poll_cost_left = POLL_EVERY_COST_NS;
        if (atomic_load_explicit(&pending_samples, memory_order_relaxed))
            poll_samples();
    }
    int due = me.sample_launches_left <= 0 || me.sample_cost_left <= 0;
    if (due) {
        uint64_t r = next_random(&me);
        me.sample_launches_left = SAMPLE_EVERY_LAUNCHES / 2 + (int64_t)(r % SAMPLE_EVERY_LAUNCHES);
        me.sample_cost_left = SAMPLE_EVERY_COST_NS / 2 + (int64_t)((r >> 32) % SAMPLE_EVERY_COST_NS);
    }
    me.span_launches = me.quiet_launches = me.poll_launches_left < me.sample_launches_left
                                               ? me.poll_launches_left
                                               : me.sample_launches_left;
    me.span_cost = me.quiet_cost = me.poll_cost_left < me.sample_cost_left ? me.poll_cost_left
                                                                           : me.sample_cost_left;
    return due || !known;
}

/* Whether this launch polls or samples: the thread's count down, inline. */
static inline int launch_sample_due(uint64_t cost, int known)
{
    if (--me.quiet_launches > 0 && known && (int64_t)cost < me.quiet_cost) {
        me.quiet_cost -= (int64_t)cost;
        return 0;
    }
    return launch_events(cost, known);
}

/* Waits (polling, never blocking in the driver) until the stream has run
 * everything queued before; 0 if that takes longer than DRAIN_MAX_NS. A start
 * event recorded behind the stream's own queued work is stamped when that work
 * ends, and the kernel may start later, after another tenant's work: the pair
 * would count that work as this kernel's. On an idle stream the start event is
 * stamped as the kernel starts. A bounded poll cannot deadlock on work that
 * waits for something this thread has yet to do. */
static int drain(CUstream stream)
{
    vgpu_cuStreamQuery_fn query = REAL(cuStreamQuery);
    CUresult q = query ? query(stream) : CUDA_ERROR_NOT_FOUND;
    if (q != CUDA_ERROR_NOT_READY)
        return q == CUDA_SUCCESS;
    uint64_t give_up = vgpu_now_ns() + DRAIN_MAX_NS;
    struct timespec ts = {0, (long)DRAIN_POLL_NS};
    while ((q = query(stream)) == CUDA_ERROR_NOT_READY && vgpu_now_ns() < give_up)
        nanosleep(&ts, NULL);
    return q == CUDA_SUCCESS;
}

static __attribute__((noinline)) void begin_sample(struct gate *g, int dev, uint64_t key, uint64_t cost, int known,
                         int charged, CUstream stream)
{
    vgpu_cuCtxGetCurrent_fn get_ctx = REAL(cuCtxGetCurrent);
    vgpu_cuEventRecord_fn record = REAL(cuEventRecord);
    CUcontext ctx = NULL;
    if (atomic_load_explicit(&events_broken, memory_order_relaxed) || !get_ctx || !record ||
        !REAL(cuEventCreate) || !REAL(cuEventQuery) || !REAL(cuEventElapsedTime) ||
        !REAL(cuEventDestroy_v2) || get_ctx(&ctx) != CUDA_SUCCESS || !ctx)
        return;
    struct sample *s = claim_sample(ctx);
    if (!s)
        return;
    /* Drained (exact) samples: a signature's first, and one every DRAIN_EVERY_NS. */
    uint64_t now = vgpu_now_ns(), due = atomic_load_explicit(&next_drain_ns, memory_order_relaxed);
    int exact = !known || (now >= due && atomic_compare_exchange_strong(&next_drain_ns, &due,
                                                                        now + DRAIN_EVERY_NS));
    s->exact = exact && drain(stream);
    s->dev = dev, s->key = key, s->cost_ns = cost, s->charged = charged;
    g->start_recorded_ns = vgpu_now_ns();
    if (record(s->start, stream) != CUDA_SUCCESS) {
        atomic_store(&s->state, SAMPLE_READY);
        return;
    }
    g->sample = s;
}

static inline __attribute__((always_inline)) void gate_enter(struct gate *g, CUstream stream,
                                                             uint64_t signature)
{
    g->sample = NULL;
    g->stream = stream;
    if (!__atomic_load_n(&initialised, __ATOMIC_ACQUIRE))
        return;
    int dev = current_device_index();
    if (dev < 0)
        return;
    if (!me.registered) { /* the count of a thread that exits is flushed then */
        me.registered = 1;
        if (thread_key_ok)
            pthread_setspecific(thread_key, &me);
    }
    me.launches[dev]++;
    /* Flushed every COUNT_FLUSH, and at 1, 2, 4, ... before: a short-lived
     * thread's first launches show without waiting for its exit. */
    ++me.launched;
    if (++me.unflushed >= COUNT_FLUSH ||
        (me.launched < COUNT_FLUSH && !(me.launched & (me.launched - 1))))
        flush_counts(&me);
    struct device *dv = &devices[dev];
    if (!any_limited || !dv->share)
        return;

    uint64_t key, cost;
    int known;
    if (me.memo_valid && me.memo_signature == signature && me.memo_dev == dev) {
        key = me.memo_key, cost = me.memo_cost, known = 1;
    } else {
        key = vgpu_cost_finish(signature ^ ((uint64_t)dev * 0x9e3779b97f4a7c15ull)); /* per device */
        cost = vgpu_cost_lookup(&costs, key, &known);
        if (known)
            me.memo_signature = signature, me.memo_dev = dev, me.memo_key = key,
            me.memo_cost = cost, me.memo_valid = 1;
        else
            cost = atomic_load_explicit(&dv->mean_cost_ns, memory_order_relaxed);
    }
    int free = vgpu_cfg.policy == VGPU_COMPUTE_SHARE &&
               atomic_load_explicit(&dv->others_idle, memory_order_relaxed) &&
               vgpu_now_ns() < atomic_load_explicit(&dv->agent_until_ns, memory_order_relaxed);
    if (!free && cost)
        admit(dev,
              cost < (1ull << 40) ? (cost * dv->charge_q16) >> 16
                                  : vgpu_launch_charge(cost, dv->share),
              stream);
    if (launch_sample_due(cost, known) && !capturing(stream)) { /* learning: every launch */
        me.memo_valid = 0;
        begin_sample(g, dev, key, cost, known, !free, stream);
        g->launching_ns = vgpu_now_ns();
    }
}

static __attribute__((noinline)) CUresult finish_sample(struct gate *g, CUresult rc)
{
    struct sample *s = g->sample;
    if (rc == CUDA_SUCCESS && REAL(cuEventRecord)(s->end, g->stream) == CUDA_SUCCESS) {
        /* Start event already passed: the device was idle when it was stamped, so
         * the pair also spans the host's time from recording it to launching. */
        s->idle_gap_ns = REAL(cuEventQuery)(s->start) == CUDA_SUCCESS
                             ? g->launching_ns - g->start_recorded_ns
                             : 0;
        s->since_ns = vgpu_now_ns();
        atomic_fetch_add(&pending_samples, 1);
        atomic_store(&s->state, SAMPLE_PENDING);
    } else {
        atomic_store(&s->state, SAMPLE_READY);
    }
    return rc;
}

static inline CUresult gate_leave(struct gate *g, CUresult rc)
{
    return g->sample ? finish_sample(g, rc) : rc;
}

/* --- interposers --------------------------------------------------------------------------------- */

/* A kernel's signature for the cost table (before the finaliser): function,
 * grid, block, shared memory. */
static uint64_t grid_key(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shmem)
{
    return vgpu_cost_mix((uint64_t)(uintptr_t)f, ((uint64_t)gx << 32) | gy,
                         ((uint64_t)gz << 32) | shmem,
                         ((uint64_t)bx << 32) ^ ((uint64_t)by << 16) ^ bz);
}

static uint64_t config_key(const CUlaunchConfig *c, CUfunction f)
{
    return c ? grid_key(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                        c->blockDimZ, c->sharedMemBytes)
             : vgpu_cost_mix((uint64_t)(uintptr_t)f, 0, 0, 0);
}

static uint64_t graph_key(CUgraphExec exec)
{
    return vgpu_cost_mix((uint64_t)(uintptr_t)exec, 1, 0, 0);
}

/* The real entry point is looked up once (NULL is not kept: asked again). */
#define GATED(name, stream, key, ...)                                                  \
    static _Atomic(vgpu_##name##_fn) cached;                                           \
    vgpu_##name##_fn real = atomic_load_explicit(&cached, memory_order_relaxed);       \
    if (!real && (real = REAL(name)))                                                  \
        atomic_store_explicit(&cached, real, memory_order_relaxed);                    \
    if (!real)                                                                         \
        return CUDA_ERROR_NOT_FOUND;                                                   \
    struct gate g; /* the signature is only worked out where a device is limited */   \
    gate_enter(&g, stream, any_limited ? (key) : 0);                                   \
    return gate_leave(&g, real(__VA_ARGS__))

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                        CUstream hStream, void **params, void **extra)
{
    GATED(cuLaunchKernel, hStream, grid_key(f, gx, gy, gz, bx, by, bz, shmem), f, gx, gy, gz, bx,
          by, bz, shmem, hStream, params, extra);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz,
                             unsigned int shmem, CUstream hStream, void **params, void **extra)
{
    GATED(cuLaunchKernel_ptsz, hStream, grid_key(f, gx, gy, gz, bx, by, bz, shmem), f, gx, gy,
          gz, bx, by, bz, shmem, hStream, params, extra);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                          void **extra)
{
    GATED(cuLaunchKernelEx, config ? config->hStream : NULL, config_key(config, f), config, f,
          params, extra);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params,
                               void **extra)
{
    GATED(cuLaunchKernelEx_ptsz, config ? config->hStream : NULL, config_key(config, f), config,
          f, params, extra);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                   unsigned int gz, unsigned int bx, unsigned int by,
                                   unsigned int bz, unsigned int shmem, CUstream hStream,
                                   void **params)
{
    GATED(cuLaunchCooperativeKernel, hStream, grid_key(f, gx, gy, gz, bx, by, bz, shmem), f, gx,
          gy, gz, bx, by, bz, shmem, hStream, params);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                        unsigned int gz, unsigned int bx, unsigned int by,
                                        unsigned int bz, unsigned int shmem, CUstream hStream,
                                        void **params)
{
    GATED(cuLaunchCooperativeKernel_ptsz, hStream, grid_key(f, gx, gy, gz, bx, by, bz, shmem), f,
          gx, gy, gz, bx, by, bz, shmem, hStream, params);
}

/* A graph launch is one launch to the limiter; its signature is the executable graph. */
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    GATED(cuGraphLaunch, hStream, graph_key(hGraphExec), hGraphExec,
          hStream);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    GATED(cuGraphLaunch_ptsz, hStream, graph_key(hGraphExec), hGraphExec,
          hStream);
}
