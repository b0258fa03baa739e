/* A small coverage-guided fuzzer for gcc, which has the instrumentation
 * (-fsanitize-coverage=trace-pc) but no engine like clang's libFuzzer.
 *
 * The code under test is built with trace-pc, so every basic block calls
 * __sanitizer_cov_trace_pc(); that records the edge (previous block, this
 * block) with a hit count in a 64 KiB map, as AFL does. An input that reaches
 * an edge, or an edge's hit-count class, never seen before joins the corpus,
 * and new inputs are mutations of corpus entries (bit flips, byte changes,
 * insertions, deletions, the harness's dictionary tokens, splices of two
 * entries). Crashes are found by the sanitizers the harness is built with:
 * before the process dies, the input that killed it is written to
 * <artifacts>crash-<hash> so that `fuzz_limits FILE` replays it.
 *
 * The harness defines vgpu_fuzz_one(), vgpu_fuzz_dictionary and vgpu_fuzz_seeds.
 *
 *   fuzz_limits [-runs=N] [-seconds=S] [-seed=N] [-corpus=DIR] [-artifacts=PREFIX]
 *   fuzz_limits FILE...      (replays inputs)
 */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fuzz.h"

#define MAP_SIZE (1u << 16)
#define FUZZ_MAX_INPUT 4096
#define MAX_CORPUS 8192

/* --- coverage (called from instrumented code: keep it tiny) -------------------------------- */

static uint8_t hits[MAP_SIZE] __attribute__((aligned(64)));
static uintptr_t previous_block;

void __sanitizer_cov_trace_pc(void);
void __sanitizer_cov_trace_pc(void)
{
    uintptr_t pc = (uintptr_t)__builtin_return_address(0);
    uintptr_t block = (pc ^ (pc >> 16)) * 0x9e3779b1u;
    hits[(block ^ previous_block) & (MAP_SIZE - 1)]++;
    previous_block = block >> 1;
}

/* Hit counts fall in classes (1, 2, 3, 4-7, 8-15, 16-31, 32-127, 128+): a
 * loop that runs more often in a class not seen before is new behaviour. */
static uint8_t count_class(uint8_t n)
{
    if (n <= 3)
        return n ? (uint8_t)(1u << (n - 1)) : 0;
    if (n < 8)
        return 8;
    if (n < 16)
        return 16;
    if (n < 32)
        return 32;
    return n < 128 ? 64 : 128;
}

static uint8_t seen[MAP_SIZE]; /* the classes each edge has shown so far */
static unsigned edges;

/* Folds the last run's hits into `seen`; 1 if anything was new. Reads the map
 * a word at a time: most of it is zero. */
static int absorb_coverage(void)
{
    int fresh = 0;
    uint64_t *words = (uint64_t *)(void *)hits;
    for (unsigned w = 0; w < MAP_SIZE / 8; w++) {
        if (!words[w])
            continue;
        for (unsigned i = w * 8; i < w * 8 + 8; i++) {
            if (!hits[i])
                continue;
            uint8_t c = count_class(hits[i]);
            if (!(seen[i] & c)) {
                edges += !seen[i];
                seen[i] |= c;
                fresh = 1;
            }
        }
        words[w] = 0;
    }
    return fresh;
}

/* --- the input that is running, written out if it kills the process -------------------------- */

static const uint8_t *running;
static size_t running_len;
static const char *artifacts = "";

static uint64_t fnv1a(const uint8_t *d, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ d[i]) * 1099511628211ull;
    return h;
}

static void write_file(const char *path, const uint8_t *d, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return;
    fwrite(d, 1, n, f);
    fclose(f);
}

/* Called by the sanitizers' runtime before it exits on an error. */
void __sanitizer_set_death_callback(void (*callback)(void));

static void save_crash(void)
{
    if (!running || !artifacts)
        return;
    char path[4096];
    snprintf(path, sizeof path, "%scrash-%016llx", artifacts,
             (unsigned long long)fnv1a(running, running_len));
    write_file(path, running, running_len);
    fprintf(stderr, "vgpu-fuzz: input that failed written to %s\n", path);
}

void vgpu_fuzz_fail(const char *what)
{
    fprintf(stderr, "vgpu-fuzz: %s\n", what);
    save_crash();
    running = NULL; /* the sanitizers' runtime must not save it twice */
    abort();
}

static void run_one(const uint8_t *d, size_t n)
{
    running = d, running_len = n;
    previous_block = 0;
    vgpu_fuzz_one(d, n);
    running = NULL;
}

/* --- the corpus and mutations ----------------------------------------------------------------- */

struct entry {
    uint8_t *data;
    size_t len;
};
static struct entry corpus[MAX_CORPUS];
static unsigned corpus_size;
static const char *corpus_dir;

static uint64_t rng_state;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}
static size_t below(size_t n) { return n ? (size_t)(rnd() % n) : 0; }

static void keep(const uint8_t *d, size_t n)
{
    if (corpus_size == MAX_CORPUS)
        return;
    uint8_t *copy = malloc(n ? n : 1);
    if (!copy)
        return;
    memcpy(copy, d, n);
    corpus[corpus_size++] = (struct entry){copy, n};
    if (corpus_dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%016llx", corpus_dir, (unsigned long long)fnv1a(d, n));
        write_file(path, d, n);
    }
}

static const uint8_t interesting[] = {0, 1, '\n', '\r', '=', '#', ' ', '\t', '.', '-', '0', '9', 0x7f, 0xff};

static size_t insert(uint8_t *buf, size_t len, size_t at, const uint8_t *d, size_t n)
{
    if (len + n > FUZZ_MAX_INPUT)
        n = FUZZ_MAX_INPUT - len;
    memmove(buf + at + n, buf + at, len - at);
    memcpy(buf + at, d, n);
    return len + n;
}

static size_t mutate(uint8_t *buf, size_t len)
{
    unsigned dictionary_size = 0;
    while (vgpu_fuzz_dictionary[dictionary_size])
        dictionary_size++;
    for (int rounds = 1 + (int)below(4); rounds > 0; rounds--) {
        size_t at = below(len + 1);
        switch (below(8)) {
        case 0: /* flip a bit */
            if (len)
                buf[below(len)] ^= (uint8_t)(1u << below(8));
            break;
        case 1: /* a byte to a random value */
            if (len)
                buf[below(len)] = (uint8_t)rnd();
            break;
        case 2: /* a byte to an interesting value */
            if (len)
                buf[below(len)] = interesting[below(sizeof interesting)];
            break;
        case 3: { /* delete a run of bytes */
            if (!len)
                break;
            size_t from = below(len), n = 1 + below(len - from < 16 ? len - from : 16);
            memmove(buf + from, buf + from + n, len - from - n);
            len -= n;
            break;
        }
        case 4: { /* insert random bytes */
            uint8_t bytes[8];
            size_t n = 1 + below(sizeof bytes);
            for (size_t i = 0; i < n; i++)
                bytes[i] = (uint8_t)rnd();
            len = insert(buf, len, at, bytes, n);
            break;
        }
        case 5:
        case 6: { /* insert or overwrite with a dictionary token */
            const char *token = vgpu_fuzz_dictionary[below(dictionary_size)];
            size_t n = strlen(token);
            if (below(2) && at + n <= len)
                memcpy(buf + at, token, n);
            else
                len = insert(buf, len, at, (const uint8_t *)token, n);
            break;
        }
        case 7: { /* splice in a piece of another corpus entry */
            const struct entry *other = &corpus[below(corpus_size)];
            if (!other->len)
                break;
            size_t from = below(other->len), n = 1 + below(other->len - from);
            len = insert(buf, len, at, other->data + from, n);
            break;
        }
        }
    }
    return len;
}

/* --- driver ----------------------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    uint8_t *buf = malloc(FUZZ_MAX_INPUT);
    *len = buf ? fread(buf, 1, FUZZ_MAX_INPUT, f) : 0;
    fclose(f);
    return buf;
}

static void load_corpus_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) && corpus_size < MAX_CORPUS) {
        if (e->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        size_t len;
        uint8_t *data = read_file(path, &len);
        if (!data)
            continue;
        run_one(data, len);
        if (absorb_coverage())
            corpus[corpus_size++] = (struct entry){data, len};
        else
            free(data);
    }
    closedir(d);
}

int main(int argc, char **argv)
{
    unsigned long long runs = 0, max_runs = 0;
    double seconds = 10;
    rng_state = 0x2545f4914f6cdd1dull;
    int replay = 0;
    __sanitizer_set_death_callback(save_crash);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strncmp(a, "-runs=", 6))
            max_runs = strtoull(a + 6, NULL, 10);
        else if (!strncmp(a, "-seconds=", 9))
            seconds = strtod(a + 9, NULL);
        else if (!strncmp(a, "-seed=", 6))
            rng_state = strtoull(a + 6, NULL, 10) * 0x9e3779b97f4a7c15ull + 1;
        else if (!strncmp(a, "-corpus=", 8))
            corpus_dir = a + 8;
        else if (!strncmp(a, "-artifacts=", 11))
            artifacts = a + 11;
        else if (a[0] == '-') {
            fprintf(stderr, "vgpu-fuzz: unknown option %s\n", a);
            return 2;
        } else { /* replay a file (a failure is reported, not saved again) */
            size_t len;
            uint8_t *data = read_file(a, &len);
            if (!data) {
                fprintf(stderr, "vgpu-fuzz: %s: %s\n", a, strerror(errno));
                return 2;
            }
            artifacts = NULL;
            run_one(data, len);
            free(data);
            replay = 1;
        }
    }
    if (replay) {
        printf("replayed without failure\n");
        return 0;
    }
    for (const char *const *seed = vgpu_fuzz_seeds; *seed; seed++) {
        run_one((const uint8_t *)*seed, strlen(*seed));
        absorb_coverage();
        keep((const uint8_t *)*seed, strlen(*seed));
    }
    if (corpus_dir)
        load_corpus_dir(corpus_dir);
    unsigned seed_entries = corpus_size, seed_edges = edges;
    static uint8_t buf[FUZZ_MAX_INPUT];
    double start = now_s(), deadline = start + seconds;
    while ((!max_runs || runs < max_runs) && ((runs & 255) || now_s() < deadline)) {
        const struct entry *parent = &corpus[below(corpus_size)];
        memcpy(buf, parent->data, parent->len);
        size_t len = mutate(buf, parent->len);
        run_one(buf, len);
        runs++;
        if (absorb_coverage())
            keep(buf, len);
    }
    double took = now_s() - start;
    printf("runs=%llu seconds=%.1f execs_per_second=%.0f corpus=%u seeds=%u edges=%u "
           "seed_edges=%u\n",
           runs, took, took > 0 ? (double)runs / took : 0.0, corpus_size, seed_entries, edges,
           seed_edges);
    return 0;
}
