/* Interposers of the launch family (cuda_launch.def) and the compute limiter.
 *
 * Control loop (README.md, "Compute limiter"): each launch on a limited device
 * is admitted by the GCRA of limiter.h on the container's shared virtual
 * clock, charged cost/share. `cost` (GPU time per launch) is learned two ways:
 *  - from the node agent: its `util` messages give the container's measured SM
 *    utilisation u over the last interval W, in which the container made n
 *    launches (the region's counters), so cost = u*W/n. This closes the loop:
 *    if launches are admitted too often, u rises above the share and the cost,
 *    hence the charge, rises with it.
 *  - locally, without the agent: every few milliseconds one launch is
 *    bracketed by two events and its GPU time measured; the average of these
 *    samples is the cost.
 * The agent's figure is used while fresh (3 s), else the local one. Under the
 * `share` policy a device is not throttled while the agent reports that
 * nobody else uses the GPU (work-conserving); under `hard` always. Launches
 * that a stream captures into a graph run nothing and are let through. */
#include "launch.h"

#include <pthread.h>
#include <time.h>

#include "functions.h"
#include "limiter.h"
#include "log.h"
#include "state.h"

#define BURST_NS 10000000ull           /* how far ahead of its share a container may run */
#define MAX_WAIT_NS 500000000ull       /* one launch never waits longer */
#define SAMPLE_EVERY_NS 2000000ull     /* local estimate: one sampled launch per 2 ms */
#define POLL_EVERY_NS 100000ull        /* look at a pending sample at most every 100 us */
#define SAMPLE_GIVE_UP_NS 2000000000ull
#define AGENT_FRESH_NS 3000000000ull
#define OTHERS_IDLE_PERCENT 5.0

struct device {
    unsigned share; /* 1-99; 0 = not limited */
    _Atomic uint64_t local_cost_ns, agent_cost_ns, agent_until_ns;
    _Atomic int others_idle;
    /* feedback bookkeeping (relay thread only) */
    uint64_t last_feedback_ns, last_launches;
    /* local sampling, under sample_mu (never waited for: trylock) */
    pthread_mutex_t sample_mu;
    CUevent start, end;
    CUcontext events_ctx;
    int pending, broken;
    _Atomic uint64_t last_sample_ns, last_poll_ns;
    uint64_t pending_since_ns;
};

static struct device devices[VGPU_MAX_DEVICES];
static int initialised, any_limited, single_device, launch_slot = -1;
static _Atomic uint64_t throttled_ns;

static void after_fork_in_child(void)
{
    launch_slot = -1; /* counts go to the child's own slot once it has one */
}

void vgpu_launch_init(void)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        pthread_mutex_init(&devices[d].sample_mu, NULL);
        unsigned cores = vgpu_cfg.cores[d];
        devices[d].share = vgpu_cfg.policy != VGPU_COMPUTE_OFF && cores > 0 && cores < 100 ? cores
                                                                                          : 0;
        any_limited |= devices[d].share != 0;
    }
    single_device = vgpu_cfg.described_devices == 1;
    launch_slot = vgpu_slot();
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
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)
        return;
    struct device *d = &devices[dev];
    uint64_t launches = 0;
    for (int s = 0; s < VGPU_REGION_SLOTS; s++)
        if (vgpu_region->slots[s].pid)
            launches += atomic_load_explicit(&vgpu_region->slots[s].launches[dev],
                                             memory_order_relaxed);
    if (container_util >= 0) {
        atomic_store(&d->others_idle, sm_util - container_util < OTHERS_IDLE_PERCENT);
        /* Counters drop when a process's slot is freed: skip that interval. */
        if (d->last_feedback_ns && launches >= d->last_launches) {
            uint64_t cost = vgpu_cost_from_util(container_util, now - d->last_feedback_ns,
                                                launches - d->last_launches);
            if (cost) {
                atomic_store(&d->agent_cost_ns,
                             vgpu_cost_average(atomic_load(&d->agent_cost_ns), cost));
                atomic_store(&d->agent_until_ns, now + AGENT_FRESH_NS);
            }
        }
    }
    d->last_feedback_ns = now;
    d->last_launches = launches;
}

/* --- local estimate: sampled launches bracketed by events -------------------------------------- */

/* Folds in a finished sample, if one is pending and done. Never blocks. */
static void poll_sample(struct device *d, uint64_t now)
{
    if (!d->pending || now - atomic_load_explicit(&d->last_poll_ns, memory_order_relaxed) <
                           POLL_EVERY_NS)
        return;
    if (pthread_mutex_trylock(&d->sample_mu) != 0)
        return;
    atomic_store_explicit(&d->last_poll_ns, now, memory_order_relaxed);
    if (d->pending && REAL(cuEventQuery)(d->end) == CUDA_SUCCESS) {
        float ms;
        if (REAL(cuEventElapsedTime)(&ms, d->start, d->end) == CUDA_SUCCESS && ms >= 0)
            atomic_store(&d->local_cost_ns,
                         vgpu_cost_average(atomic_load(&d->local_cost_ns),
                                           (uint64_t)((double)ms * 1e6)));
        d->pending = 0;
    } else if (d->pending && now - d->pending_since_ns > SAMPLE_GIVE_UP_NS) {
        d->pending = 0;
    }
    pthread_mutex_unlock(&d->sample_mu);
}

/* Starts a sample around the coming launch: returns 1 with sample_mu held and
 * the start event recorded, else 0. */
static int begin_sample(struct device *d, CUstream stream, uint64_t now)
{
    if (d->broken || d->pending ||
        now - atomic_load_explicit(&d->last_sample_ns, memory_order_relaxed) < SAMPLE_EVERY_NS)
        return 0;
    if (pthread_mutex_trylock(&d->sample_mu) != 0)
        return 0;
    CUcontext ctx = NULL;
    vgpu_cuCtxGetCurrent_fn get_ctx = REAL(cuCtxGetCurrent);
    vgpu_cuEventCreate_fn create = REAL(cuEventCreate);
    vgpu_cuEventRecord_fn record = REAL(cuEventRecord);
    int ok = !d->pending && get_ctx && create && record && REAL(cuEventQuery) &&
             REAL(cuEventElapsedTime) && get_ctx(&ctx) == CUDA_SUCCESS && ctx;
    if (ok && !d->events_ctx) {
        ok = create(&d->start, 0) == CUDA_SUCCESS && create(&d->end, 0) == CUDA_SUCCESS;
        if (ok)
            d->events_ctx = ctx;
        else
            d->broken = 1; /* no local estimate on this device; the agent's still works */
    }
    ok = ok && d->events_ctx == ctx && record(d->start, stream) == CUDA_SUCCESS;
    if (!ok) {
        pthread_mutex_unlock(&d->sample_mu);
        return 0;
    }
    atomic_store_explicit(&d->last_sample_ns, now, memory_order_relaxed);
    return 1;
}

static void end_sample(struct device *d, CUstream stream, CUresult launched, uint64_t now)
{
    if (launched == CUDA_SUCCESS && REAL(cuEventRecord)(d->end, stream) == CUDA_SUCCESS) {
        d->pending = 1;
        d->pending_since_ns = now;
    }
    pthread_mutex_unlock(&d->sample_mu);
}

/* --- the gate every launch passes -------------------------------------------------------------- */

struct gate {
    struct device *sampling; /* non-NULL: end the sample after the launch */
    CUstream stream;
};

static int current_device_index(void)
{
    if (single_device)
        return 0;
    vgpu_cuCtxGetDevice_fn get = REAL(cuCtxGetDevice);
    CUdevice dev;
    return get && get(&dev) == CUDA_SUCCESS && dev >= 0 && dev < VGPU_MAX_DEVICES ? dev : -1;
}

static int capturing(CUstream stream)
{
    vgpu_cuStreamIsCapturing_fn is_capturing = REAL(cuStreamIsCapturing);
    CUstreamCaptureStatus status;
    /* An error (e.g. the legacy stream during a global capture): treat as capturing. */
    return !is_capturing || is_capturing(stream, &status) != CUDA_SUCCESS ||
           status != CU_STREAM_CAPTURE_STATUS_NONE;
}

static uint64_t current_cost(struct device *d, uint64_t now, int *others_idle)
{
    if (now < atomic_load_explicit(&d->agent_until_ns, memory_order_relaxed)) {
        *others_idle = atomic_load_explicit(&d->others_idle, memory_order_relaxed);
        return atomic_load_explicit(&d->agent_cost_ns, memory_order_relaxed);
    }
    *others_idle = 0; /* without the agent nobody can tell: hold the share */
    return atomic_load_explicit(&d->local_cost_ns, memory_order_relaxed);
}

static void hold(uint64_t ns)
{
    if (ns > MAX_WAIT_NS)
        ns = MAX_WAIT_NS;
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0) {
    }
    atomic_fetch_add_explicit(&throttled_ns, ns, memory_order_relaxed);
}

static void gate_enter(struct gate *g, CUstream stream)
{
    g->sampling = NULL;
    g->stream = stream;
    if (!__atomic_load_n(&initialised, __ATOMIC_ACQUIRE))
        return;
    int dev = current_device_index();
    if (dev < 0)
        return;
    if (launch_slot < 0)
        launch_slot = vgpu_slot();
    if (launch_slot >= 0)
        atomic_fetch_add_explicit(&vgpu_region->slots[launch_slot].launches[dev], 1,
                                  memory_order_relaxed);
    struct device *d = &devices[dev];
    if (!any_limited || !d->share)
        return;

    uint64_t now = vgpu_now_ns();
    poll_sample(d, now);
    if (capturing(stream))
        return;
    int others_idle;
    uint64_t cost = current_cost(d, now, &others_idle);
    if (cost && !(others_idle && vgpu_cfg.policy == VGPU_COMPUTE_SHARE)) {
        uint64_t wait = vgpu_gcra_admit(&vgpu_region->limiter_tat[dev], now,
                                        vgpu_launch_charge(cost, d->share), BURST_NS);
        if (wait)
            hold(wait), now = vgpu_now_ns();
    }
    if (begin_sample(d, stream, now))
        g->sampling = d;
}

static CUresult gate_leave(struct gate *g, CUresult rc)
{
    if (g->sampling)
        end_sample(g->sampling, g->stream, rc, vgpu_now_ns());
    return rc;
}

/* --- interposers --------------------------------------------------------------------------------- */

#define GATED(name, stream, ...)                       \
    vgpu_##name##_fn real = REAL(name);                \
    if (!real)                                         \
        return CUDA_ERROR_NOT_FOUND;                   \
    struct gate g;                                     \
    gate_enter(&g, stream);                            \
    return gate_leave(&g, real(__VA_ARGS__))

CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
                        CUstream hStream, void **params, void **extra)
{
    GATED(cuLaunchKernel, hStream, f, gx, gy, gz, bx, by, bz, shmem, hStream, params, extra);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz,
                             unsigned int shmem, CUstream hStream, void **params, void **extra)
{
    GATED(cuLaunchKernel_ptsz, hStream, f, gx, gy, gz, bx, by, bz, shmem, hStream, params,
          extra);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                          void **extra)
{
    GATED(cuLaunchKernelEx, config ? config->hStream : NULL, config, f, params, extra);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params,
                               void **extra)
{
    GATED(cuLaunchKernelEx_ptsz, config ? config->hStream : NULL, config, f, params, extra);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gx, unsigned int gy,
                                   unsigned int gz, unsigned int bx, unsigned int by,
                                   unsigned int bz, unsigned int shmem, CUstream hStream,
                                   void **params)
{
    GATED(cuLaunchCooperativeKernel, hStream, f, gx, gy, gz, bx, by, bz, shmem, hStream, params);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gx, unsigned int gy,
                                        unsigned int gz, unsigned int bx, unsigned int by,
                                        unsigned int bz, unsigned int shmem, CUstream hStream,
                                        void **params)
{
    GATED(cuLaunchCooperativeKernel_ptsz, hStream, f, gx, gy, gz, bx, by, bz, shmem, hStream,
          params);
}

/* A graph launch is one launch to the limiter; its cost is learned like any other's. */
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    GATED(cuGraphLaunch, hStream, hGraphExec, hStream);
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    GATED(cuGraphLaunch_ptsz, hStream, hGraphExec, hStream);
}
