#include "relay.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fork.h"
#include "functions.h"
#include "launch.h"
#include "log.h"
#include "relay_msg.h"
#include "state.h"

#define MIB (1024ull * 1024ull)
#define REPORT_EVERY_MS 250
#define LOOK_EVERY_MS 50 /* how often it checks for changes worth reporting at once */
#define RECONNECT_EVERY_MS 1000
#define EXIT_WAIT_MS 100

static pthread_t thread;
static int started, wake[2] = {-1, -1};
static _Atomic int stopping;

struct relay {
    int fd, devices;
    uint64_t next_connect_ms, next_report_ms, last_used[VGPU_MAX_DEVICES];
    char out[2 * VGPU_RELAY_MAX_LINE];
    size_t out_len;
    char in[2 * VGPU_RELAY_MAX_LINE];
    size_t in_len;
    int discarding; /* inside an oversized incoming line */
};

static uint64_t now_ms(void)
{
    return vgpu_now_ns() / 1000000ull;
}

static void disconnect(struct relay *r)
{
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
    r->out_len = r->in_len = 0;
    r->discarding = 0;
}

/* Sends what is queued, as far as the socket takes it without waiting. */
static void flush(struct relay *r)
{
    while (r->fd >= 0 && r->out_len > 0) {
        ssize_t n = send(r->fd, r->out, r->out_len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            memmove(r->out, r->out + n, r->out_len - (size_t)n);
            r->out_len -= (size_t)n;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            return;
        } else if (!(n < 0 && errno == EINTR)) {
            disconnect(r);
        }
    }
}

/* Queues a line unless an earlier one is still partly unsent: then this
 * report is dropped, as the protocol allows. */
static void queue(struct relay *r, const char *line, int len)
{
    if (r->fd < 0 || len <= 0 || r->out_len > 0)
        return;
    memcpy(r->out, line, (size_t)len);
    r->out_len = (size_t)len;
    flush(r);
}

static void read_comm(char *comm, size_t len)
{
    snprintf(comm, len, "?");
    FILE *f = fopen("/proc/self/comm", "re");
    if (!f)
        return;
    if (fgets(comm, (int)len, f))
        comm[strcspn(comm, "\n")] = '\0';
    fclose(f);
}

static void send_hello(struct relay *r)
{
    struct vgpu_hello_device d[VGPU_MAX_DEVICES];
    char comm[80], line[VGPU_RELAY_MAX_LINE];
    read_comm(comm, sizeof comm);
    for (int i = 0; i < r->devices; i++)
        d[i] = (struct vgpu_hello_device){i, vgpu_cfg.uuid[i], vgpu_cfg.memory_mib[i],
                                          vgpu_cfg.cores[i]};
    queue(r, line, vgpu_msg_hello(line, sizeof line, getpid(), comm, d, r->devices));
}

static uint64_t to_mib(uint64_t bytes)
{
    return (bytes + MIB - 1) / MIB;
}

static void send_usage(struct relay *r)
{
    struct vgpu_usage_device d[VGPU_MAX_DEVICES];
    char line[VGPU_RELAY_MAX_LINE];
    int slot = vgpu_slot();
    for (int i = 0; i < r->devices; i++) {
        d[i] = (struct vgpu_usage_device){
            i, to_mib(vgpu_region_used(vgpu_region, i)),
            to_mib(vgpu_region_slot_used(vgpu_region, slot, i)),
            vgpu_cfg.virtual_memory[i] ? (int64_t)to_mib(vgpu_region_spilled(vgpu_region, i))
                                       : -1};
        r->last_used[i] = vgpu_region_slot_used(vgpu_region, slot, i);
    }
    queue(r, line,
          vgpu_msg_usage(line, sizeof line, getpid(), now_ms(), d, r->devices,
                         vgpu_launch_count(), vgpu_throttled_ns() / 1000000ull));
}

static int usage_changed(struct relay *r)
{
    int slot = vgpu_slot();
    for (int i = 0; i < r->devices; i++)
        if (vgpu_region_slot_used(vgpu_region, slot, i) != r->last_used[i])
            return 1;
    return 0;
}

static void try_connect(struct relay *r)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(addr.sun_path, sizeof addr.sun_path, "%s/relay.sock", vgpu_cfg.state_dir) >=
        sizeof addr.sun_path)
        return; /* too long for a unix socket: no agent can be reached */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0 && errno != EINPROGRESS) {
        close(fd);
        return;
    }
    r->fd = fd;
    send_hello(r);
    send_usage(r);
}

static void handle_line(const char *line, size_t len)
{
    struct vgpu_util u[VGPU_MAX_DEVICES];
    int n = vgpu_msg_parse_util(line, len, u, VGPU_MAX_DEVICES);
    uint64_t now = vgpu_now_ns();
    for (int i = 0; i < n; i++)
        vgpu_launch_feedback(u[i].index, u[i].sm_util, u[i].container_sm_util, now);
}

static void receive(struct relay *r)
{
    for (;;) {
        ssize_t n = recv(r->fd, r->in + r->in_len, sizeof r->in - r->in_len, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            disconnect(r);
            return;
        }
        if (n < 0)
            return;
        r->in_len += (size_t)n;
        char *start = r->in, *nl;
        while ((nl = memchr(start, '\n', r->in_len - (size_t)(start - r->in)))) {
            if (!r->discarding)
                handle_line(start, (size_t)(nl - start));
            r->discarding = 0;
            start = nl + 1;
        }
        r->in_len -= (size_t)(start - r->in);
        memmove(r->in, start, r->in_len);
        if (r->in_len >= VGPU_RELAY_MAX_LINE) { /* oversized: skip to its end */
            r->discarding = 1;
            r->in_len = 0;
        }
    }
}

static void *run(void *arg)
{
    (void)arg;
    struct relay r = {.fd = -1};
    r.devices = vgpu_cfg.described_devices > 0 ? vgpu_cfg.described_devices : 0;
    if (r.devices == 0) {
        vgpu_cuDeviceGetCount_fn get_count = REAL(cuDeviceGetCount);
        int n = 0;
        if (get_count && get_count(&n) == CUDA_SUCCESS)
            r.devices = n < VGPU_MAX_DEVICES ? n : VGPU_MAX_DEVICES;
    }
    while (!atomic_load(&stopping)) {
        uint64_t now = now_ms();
        if (r.fd < 0 && now >= r.next_connect_ms) {
            r.next_connect_ms = now + RECONNECT_EVERY_MS;
            try_connect(&r);
            r.next_report_ms = now + REPORT_EVERY_MS;
        } else if (r.fd >= 0 && (now >= r.next_report_ms || usage_changed(&r))) {
            send_usage(&r);
            r.next_report_ms = now + REPORT_EVERY_MS;
        }
        flush(&r);
        struct pollfd p[2] = {{.fd = wake[0], .events = POLLIN}, {.fd = r.fd, .events = POLLIN}};
        if (poll(p, r.fd >= 0 ? 2 : 1, LOOK_EVERY_MS) > 0 && r.fd >= 0 && (p[1].revents != 0))
            receive(&r);
    }
    char line[128];
    flush(&r);
    queue(&r, line, vgpu_msg_exit(line, sizeof line, getpid()));
    disconnect(&r);
    return NULL;
}

/* At exit: tell the thread to say goodbye, and wait for it a little. */
static void stop(void)
{
    if (!started)
        return;
    atomic_store(&stopping, 1);
    if (write(wake[1], "x", 1) < 0) {
        /* the thread notices `stopping` within LOOK_EVERY_MS anyway */
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += EXIT_WAIT_MS * 1000000L;
    deadline.tv_sec += deadline.tv_nsec / 1000000000L;
    deadline.tv_nsec %= 1000000000L;
    pthread_timedjoin_np(thread, NULL, &deadline);
}

/* A forked child has no relay thread; it must not wait for its parent's. */
void vgpu_relay_after_fork_in_child(void)
{
    started = 0;
}

void vgpu_relay_start(void)
{
    if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        vgpu_log_error("cannot start the relay to the node agent: %s", strerror(errno));
        return;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    /* The thread must not take signals meant for the application. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&thread, &attr, run, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        vgpu_log_error("cannot start the relay to the node agent: %s", strerror(rc));
        return;
    }
    started = 1;
    atexit(stop);
}
