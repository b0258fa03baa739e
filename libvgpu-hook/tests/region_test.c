/* Unit tests of the shared accounting region (src/region.c) with real
 * processes, no interception.
 *
 *   region_test                      run the tests (in a fresh temporary directory)
 *   region_test hold-lock-and-die <region file>
 *                                    take the region's lock and SIGKILL itself holding it
 *   region_test used <region file> <dev>
 *                                    print the container's total on dev: used=<bytes> */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "region.h"

static char dir[] = "/tmp/vgpu-region-XXXXXX";
static char path[128];

static struct vgpu_region *open_region(void)
{
    char err[256];
    struct vgpu_region *r = vgpu_region_open(path, 1, err, sizeof err);
    if (!r)
        fprintf(stderr, "%s\n", err);
    return r;
}

static void test_reserve_and_limit(struct vgpu_region *r)
{
    int s = vgpu_region_attach(r, getpid());
    uint64_t used = 99;
    CHECK(s >= 0);
    CHECK(vgpu_region_reserve(r, s, 0, 600, 1000, &used) == 0 && used == 0);
    CHECK(vgpu_region_reserve(r, s, 0, 400, 1000, &used) == 0 && used == 600); /* exactly full */
    CHECK(vgpu_region_reserve(r, s, 0, 1, 1000, &used) == -1 && used == 1000);
    CHECK(vgpu_region_used(r, 0) == 1000 && vgpu_region_slot_used(r, s, 0) == 1000);
    CHECK(vgpu_region_used(r, 1) == 0);                           /* devices are separate */
    CHECK(vgpu_region_reserve(r, s, 1, 5000, 0, NULL) == 0);        /* 0 = unlimited */
    CHECK(vgpu_region_reserve(r, s, 2, UINT64_MAX, 1000, NULL) == -1); /* no wrap-around */
    CHECK(vgpu_region_reserve(r, s, VGPU_MAX_DEVICES, 1, 0, NULL) == -1);
    vgpu_region_release(r, s, 0, 1000);
    vgpu_region_release(r, s, 1, 9999); /* more than held: stops at zero */
    CHECK(vgpu_region_used(r, 0) == 0 && vgpu_region_used(r, 1) == 0);
    vgpu_region_detach(r, s);
}

/* A child holds memory and dies without detaching: it is reaped when a
 * reservation would otherwise fail, and what it held is given back. */
static void test_dead_process_is_reaped(struct vgpu_region *r)
{
    pid_t child = fork();
    if (child == 0) {
        struct vgpu_region *cr = open_region();
        int s = cr ? vgpu_region_attach(cr, getpid()) : -1;
        _exit(s >= 0 && vgpu_region_reserve(cr, s, 0, 700, 1000, NULL) == 0 ? 0 : 1);
    }
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(vgpu_region_used(r, 0) == 700); /* still charged: nobody looked yet */
    int s = vgpu_region_attach(r, getpid()); /* attaching reaps */
    CHECK(vgpu_region_used(r, 0) == 0);
    CHECK(vgpu_region_reserve(r, s, 0, 1000, 1000, NULL) == 0);
    vgpu_region_detach(r, s);
    CHECK(vgpu_region_used(r, 0) == 0);
}

/* Virtual device memory: spilled bytes are bounded by the host limit over all devices,
 * given back with unspill, and a dead process's spill is reaped with its slot. */
static void test_spill(struct vgpu_region *r)
{
    int s = vgpu_region_attach(r, getpid());
    CHECK(vgpu_region_spill(r, s, 0, 600, 1000) == 0);
    CHECK(vgpu_region_spill(r, s, 1, 400, 1000) == 0); /* the bound covers every device */
    CHECK(vgpu_region_spill(r, s, 1, 1, 1000) == -1);
    CHECK(vgpu_region_spill(r, s, 2, 1, 0) == -1);      /* 0: nothing may spill */
    CHECK(vgpu_region_spill(r, s, 2, UINT64_MAX, UINT64_MAX - 1) == -1); /* no wrap-around */
    CHECK(vgpu_region_spilled(r, 0) == 600 && vgpu_region_spilled(r, 1) == 400);
    vgpu_region_unspill(r, s, 0, 600);
    vgpu_region_unspill(r, s, 1, 9999); /* more than held: stops at zero */
    CHECK(vgpu_region_spilled(r, 0) == 0 && vgpu_region_spilled(r, 1) == 0);
    vgpu_region_detach(r, s);

    pid_t child = fork();
    if (child == 0) {
        struct vgpu_region *cr = open_region();
        int c = cr ? vgpu_region_attach(cr, getpid()) : -1;
        _exit(c >= 0 && vgpu_region_spill(cr, c, 0, 900, 1000) == 0 ? 0 : 1);
    }
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(vgpu_region_spilled(r, 0) == 900); /* nobody looked yet */
    s = vgpu_region_attach(r, getpid());   /* attaching reaps */
    CHECK(vgpu_region_spilled(r, 0) == 0);
    CHECK(vgpu_region_spill(r, s, 0, 1000, 1000) == 0);
    vgpu_region_detach(r, s);
    CHECK(vgpu_region_spilled(r, 0) == 0);
}

/* Two processes draw on one budget. */
static void test_shared_budget(struct vgpu_region *r)
{
    int s = vgpu_region_attach(r, getpid());
    CHECK(vgpu_region_reserve(r, s, 3, 600, 1000, NULL) == 0);
    pid_t child = fork();
    if (child == 0) {
        struct vgpu_region *cr = open_region();
        int cs = cr ? vgpu_region_attach(cr, getpid()) : -1;
        int ok = cs >= 0 && vgpu_region_reserve(cr, cs, 3, 500, 1000, NULL) == -1 &&
                 vgpu_region_reserve(cr, cs, 3, 400, 1000, NULL) == 0;
        vgpu_region_detach(cr, cs);
        _exit(ok ? 0 : 1);
    }
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(vgpu_region_used(r, 3) == 600);
    vgpu_region_detach(r, s);
}

/* A process killed holding the lock does not block the next locker. */
static void test_robust_lock(struct vgpu_region *r)
{
    int s = vgpu_region_attach(r, getpid());
    CHECK(vgpu_region_reserve(r, s, 0, 100, 0, NULL) == 0);
    r->used[0] = 12345; /* a half-done update the dead owner left behind */
    pid_t child = fork();
    if (child == 0) {
        vgpu_region_lock(r);
        raise(SIGKILL);
    }
    int status;
    waitpid(child, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    alarm(10); /* a deadlock fails the test instead of hanging it */
    CHECK(vgpu_region_reserve(r, s, 0, 50, 0, NULL) == 0);
    alarm(0);
    CHECK(vgpu_region_used(r, 0) == 150); /* recomputed from the slots on recovery */
    vgpu_region_detach(r, s);
}

static void test_exports(struct vgpu_region *r)
{
    int s = vgpu_region_attach(r, getpid());
    vgpu_region_export_add(r, s, 0x1234);
    CHECK(vgpu_region_export_known(r, 0x1234));
    CHECK(!vgpu_region_export_known(r, 0x9999));
    vgpu_region_export_remove(r, 0x1234);
    CHECK(!vgpu_region_export_known(r, 0x1234));
    vgpu_region_export_add(r, s, 0x55);
    vgpu_region_detach(r, s); /* a process's exports go with it */
    CHECK(!vgpu_region_export_known(r, 0x55));
}

/* A shared allocation is charged once, to one holder; the charge moves to another holder when
 * that one lets go (or dies), and goes when the last one lets go. */
static void test_shared_allocations(struct vgpu_region *r)
{
    int a = vgpu_region_attach(r, getpid()), dev = -1;
    uint64_t bytes = 0;
    pid_t child = fork();
    if (child == 0) {
        pause(); /* a live second process of the container */
        _exit(0);
    }
    int b = vgpu_region_attach(r, child);
    CHECK(a >= 0 && b >= 0 && a != b);
    CHECK(vgpu_region_reserve(r, a, 0, 600, 1000, NULL) == 0);
    CHECK(vgpu_region_share_add(r, a, 0xabc, 0, 600) == 0);
    CHECK(vgpu_region_share_alias(r, 0xabc, 0xdef) == 0);
    CHECK(!vgpu_region_share_join(r, b, 0x777, &dev, &bytes)); /* unknown key */
    CHECK(vgpu_region_share_join(r, b, 0xdef, &dev, &bytes) && dev == 0 && bytes == 600);
    CHECK(vgpu_region_used(r, 0) == 600); /* once, not twice */
    vgpu_region_share_leave(r, a, 0xabc);  /* the holder of the charge lets go... */
    CHECK(vgpu_region_used(r, 0) == 600);  /* ...b still holds it */
    CHECK(vgpu_region_slot_used(r, a, 0) == 0 && vgpu_region_slot_used(r, b, 0) == 600);
    CHECK(vgpu_region_share_join(r, a, 0xabc, &dev, &bytes)); /* a takes it again */
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    CHECK(vgpu_region_reap(r) == 1); /* b died holding the charge: it moves to a */
    CHECK(vgpu_region_used(r, 0) == 600 && vgpu_region_slot_used(r, a, 0) == 600);
    vgpu_region_share_leave(r, a, 0xdef); /* the last holder */
    CHECK(vgpu_region_used(r, 0) == 0);
    CHECK(!vgpu_region_share_join(r, a, 0xabc, &dev, &bytes)); /* forgotten */
    vgpu_region_detach(r, a);
}

static void test_incompatible_file(void)
{
    char other[160], err[256];
    snprintf(other, sizeof other, "%s/other", dir);
    FILE *f = fopen(other, "w");
    fputs("not a region", f);
    fclose(f);
    CHECK(vgpu_region_open(other, 1, err, sizeof err) == NULL);
    CHECK(strstr(err, "neither the node agent's 16-byte header nor") != NULL);
    unlink(other);
}

/* Writes len bytes of data (zeros past it) to name in the test directory. */
static void put_file(const char *name, const void *data, size_t len, size_t total)
{
    char p[160];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    fwrite(data, 1, len, f);
    for (size_t i = len; i < total; i++)
        fputc(0, f);
    fclose(f);
}

static struct vgpu_region *open_named(const char *name, int create, char *err, size_t errlen)
{
    char p[160];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return vgpu_region_open(p, create, err, errlen);
}

/* What the node agent makes, and what a container might plant instead. */
static void test_headers(void)
{
    char err[512];
    uint64_t agent_header[2] = {VGPU_REGION_MAGIC, 0}; /* layout 0, size 0 */
    put_file("agent", agent_header, sizeof agent_header, sizeof agent_header);
    struct vgpu_region *r = open_named("agent", 0, err, sizeof err);
    CHECK(r && vgpu_region_intact(r)); /* grown to the layout, lock made */
    CHECK(r && r->layout == VGPU_REGION_LAYOUT);
    uint64_t other_layout[2] = {VGPU_REGION_MAGIC, (uint64_t)(VGPU_REGION_LAYOUT + 1)};
    put_file("other-layout", other_layout, sizeof other_layout, sizeof other_layout);
    CHECK(open_named("other-layout", 0, err, sizeof err) == NULL);
    CHECK(strstr(err, "has layout") != NULL);
    if (r) {
        int s = vgpu_region_attach(r, getpid());
        CHECK(vgpu_region_reserve(r, s, 0, 10, 100, NULL) == 0);
        r->magic = 0; /* a process of the container zeroes it while in use */
        CHECK(vgpu_region_reserve(r, s, 0, 10, 100, NULL) == -1);
    }

    put_file("zeroed", "", 0, sizeof(struct vgpu_region));
    CHECK(open_named("zeroed", 0, err, sizeof err) == NULL);
    CHECK(strstr(err, "its header is zeroed") != NULL);
    CHECK(open_named("zeroed", 1, err, sizeof err) == NULL); /* not even on a bare host */

    uint64_t foreign[2] = {0x1122334455667788ull, 7};
    put_file("foreign", foreign, sizeof foreign, sizeof(struct vgpu_region));
    CHECK(open_named("foreign", 0, err, sizeof err) == NULL);
    CHECK(strstr(err, "was not written for this hook") != NULL);
    put_file("foreign-header", foreign, sizeof foreign, sizeof foreign);
    CHECK(open_named("foreign-header", 0, err, sizeof err) == NULL);

    CHECK(open_named("missing", 0, err, sizeof err) == NULL);
    CHECK(strstr(err, "does not exist (the node agent creates it)") != NULL);

    char target[160], link[160];
    snprintf(target, sizeof target, "%s/agent", dir);
    snprintf(link, sizeof link, "%s/link", dir);
    CHECK(symlink(target, link) == 0);
    CHECK(open_named("link", 0, err, sizeof err) == NULL);
    CHECK(strstr(err, "is a symbolic link") != NULL);
    const char *names[] = {"agent", "zeroed", "foreign", "foreign-header", "link",
                           "other-layout"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char p[160];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "hold-lock-and-die") == 0) {
        snprintf(path, sizeof path, "%s", argv[2]);
        struct vgpu_region *r = open_region();
        if (!r)
            return 2;
        vgpu_region_lock(r);
        raise(SIGKILL);
        return 2;
    }
    if (argc == 4 && strcmp(argv[1], "used") == 0) {
        snprintf(path, sizeof path, "%s", argv[2]);
        struct vgpu_region *r = open_region();
        if (!r)
            return 2;
        printf("used=%llu\n", (unsigned long long)vgpu_region_used(r, atoi(argv[3])));
        return 0;
    }
    if (!mkdtemp(dir))
        return perror("mkdtemp"), 2;
    snprintf(path, sizeof path, "%s/%s", dir, VGPU_REGION_FILE);
    struct vgpu_region *r = open_region(), *again = open_region();
    CHECK(r && again);
    if (r && again) {
        test_reserve_and_limit(r);
        test_dead_process_is_reaped(r);
        test_spill(r);
        test_shared_budget(r);
        test_robust_lock(again); /* any mapping of the file sees the same lock */
        test_exports(r);
        test_shared_allocations(r);
        test_incompatible_file();
        test_headers();
    }
    unlink(path);
    rmdir(dir);
    return check_report("region_test");
}
