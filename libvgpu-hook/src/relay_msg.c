#include "relay_msg.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- building ------------------------------------------------------------------------------- */

struct out {
    char *buf;
    size_t len, used;
    int overflow;
};

static void put(struct out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct out *o, const char *fmt, ...)
{
    if (o->overflow)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->buf + o->used, o->len - o->used, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= o->len - o->used)
        o->overflow = 1;
    else
        o->used += (size_t)n;
}

/* A JSON string, escaped, cut to at most max bytes of input. */
static void put_string(struct out *o, const char *s, size_t max)
{
    put(o, "\"");
    for (size_t i = 0; s[i] && i < max; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            put(o, "\\%c", c);
        else if (c < 0x20)
            put(o, "\\u%04x", c);
        else
            put(o, "%c", c);
    }
    put(o, "\"");
}

static int finish(struct out *o)
{
    put(o, "\n");
    return o->overflow || o->used > VGPU_RELAY_MAX_LINE ? -1 : (int)o->used;
}

int vgpu_msg_hello(char *buf, size_t len, int pid, const char *comm,
                   const struct vgpu_hello_device *d, int n)
{
    struct out o = {buf, len, 0, 0};
    put(&o, "{\"v\":1,\"type\":\"hello\",\"pid\":%d,\"comm\":", pid);
    put_string(&o, comm, 64);
    put(&o, ",\"devices\":[");
    for (int i = 0; i < n; i++) {
        put(&o, "%s{\"index\":%d,\"uuid\":", i ? "," : "", d[i].index);
        put_string(&o, d[i].uuid, 127);
        put(&o, ",\"limit_mib\":%llu,\"cores\":%u}", (unsigned long long)d[i].limit_mib,
            d[i].cores);
    }
    put(&o, "]}");
    return finish(&o);
}

int vgpu_msg_usage(char *buf, size_t len, int pid, uint64_t ts_ms,
                   const struct vgpu_usage_device *d, int n, uint64_t launches,
                   uint64_t throttled_ms)
{
    struct out o = {buf, len, 0, 0};
    put(&o, "{\"v\":1,\"type\":\"usage\",\"pid\":%d,\"ts_ms\":%llu,\"devices\":[", pid,
        (unsigned long long)ts_ms);
    for (int i = 0; i < n; i++) {
        put(&o, "%s{\"index\":%d,\"used_mib\":%llu,\"process_used_mib\":%llu", i ? "," : "",
            d[i].index, (unsigned long long)d[i].used_mib,
            (unsigned long long)d[i].process_used_mib);
        if (d[i].spilled_mib >= 0)
            put(&o, ",\"spilled_mib\":%lld", (long long)d[i].spilled_mib);
        put(&o, "}");
    }
    put(&o, "],\"launches\":%llu,\"throttled_ms\":%llu}", (unsigned long long)launches,
        (unsigned long long)throttled_ms);
    return finish(&o);
}

int vgpu_msg_exit(char *buf, size_t len, int pid)
{
    struct out o = {buf, len, 0, 0};
    put(&o, "{\"v\":1,\"type\":\"exit\",\"pid\":%d}", pid);
    return finish(&o);
}

/* --- reading: a small JSON reader for the subset the agent sends ------------------------------ */

struct cur {
    const char *p, *end;
};

static void ws(struct cur *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\r' || *c->p == '\n'))
        c->p++;
}

static int eat(struct cur *c, char ch)
{
    ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A string into out (escapes other than \" and \\ kept as '?'); -1 if malformed. */
static int string(struct cur *c, char *out, size_t cap)
{
    size_t n = 0;
    if (!eat(c, '"'))
        return -1;
    while (c->p < c->end && *c->p != '"') {
        char ch = *c->p++;
        if ((unsigned char)ch < 0x20)
            return -1;
        if (ch == '\\') {
            if (c->p >= c->end)
                return -1;
            char e = *c->p++;
            if (e == 'u') {
                for (int i = 0; i < 4; i++, c->p++)
                    if (c->p >= c->end || !strchr("0123456789abcdefABCDEF", *c->p))
                        return -1;
                ch = '?';
            } else if (strchr("\"\\/bfnrt", e)) {
                ch = e == '"' || e == '\\' || e == '/' ? e : '?';
            } else {
                return -1;
            }
        }
        if (out && n + 1 < cap)
            out[n++] = ch;
    }
    if (out && cap)
        out[n] = '\0';
    return eat(c, '"') ? 0 : -1;
}

static int number(struct cur *c, double *out)
{
    char tmp[64];
    size_t n = 0;
    ws(c);
    while (c->p < c->end && strchr("+-0123456789.eE", *c->p) && n + 1 < sizeof tmp)
        tmp[n++] = *c->p++;
    tmp[n] = '\0';
    char *end;
    double v = strtod(tmp, &end);
    if (n == 0 || *end)
        return -1;
    if (out)
        *out = v;
    return 0;
}

static int literal(struct cur *c, const char *word)
{
    size_t n = strlen(word);
    ws(c);
    if ((size_t)(c->end - c->p) < n || strncmp(c->p, word, n) != 0)
        return -1;
    c->p += n;
    return 0;
}

static int skip_value(struct cur *c, int depth)
{
    ws(c);
    if (c->p >= c->end || depth > 16)
        return -1;
    char ch = *c->p;
    if (ch == '"')
        return string(c, NULL, 0);
    if (ch == 't')
        return literal(c, "true");
    if (ch == 'f')
        return literal(c, "false");
    if (ch == 'n')
        return literal(c, "null");
    if (ch == '[' || ch == '{') {
        char close = ch == '[' ? ']' : '}';
        c->p++;
        if (eat(c, close))
            return 0;
        do {
            if (ch == '{' && (string(c, NULL, 0) != 0 || !eat(c, ':')))
                return -1;
            if (skip_value(c, depth + 1) != 0)
                return -1;
        } while (eat(c, ','));
        return eat(c, close) ? 0 : -1;
    }
    return number(c, NULL);
}

/* One element of "devices". */
static int util_device(struct cur *c, struct vgpu_util *u)
{
    int have = 0;
    char key[64];
    double v;
    if (!eat(c, '{'))
        return -1;
    if (!eat(c, '}')) {
        do {
            if (string(c, key, sizeof key) != 0 || !eat(c, ':'))
                return -1;
            int field = strcmp(key, "index") == 0               ? 1
                        : strcmp(key, "sm_util_percent") == 0   ? 2
                        : strcmp(key, "container_sm_util_percent") == 0 ? 4
                                                                        : 0;
            if (!field) {
                if (skip_value(c, 1) != 0)
                    return -1;
                continue;
            }
            if (number(c, &v) != 0)
                return -1;
            have |= field;
            if (field == 1)
                u->index = v >= 0 && v < 1 << 20 && v == (int)v ? (int)v : -1;
            else if (field == 2)
                u->sm_util = v;
            else
                u->container_sm_util = v;
        } while (eat(c, ','));
        if (!eat(c, '}'))
            return -1;
    }
    return have == 7 && u->index >= 0 ? 0 : -1;
}

int vgpu_msg_parse_util(const char *line, size_t len, struct vgpu_util *out, int max)
{
    struct cur c = {line, line + len};
    char key[64], type[32] = "";
    double version = 0;
    int n = 0, have_devices = 0;
    if (!eat(&c, '{'))
        return -1;
    do {
        if (string(&c, key, sizeof key) != 0 || !eat(&c, ':'))
            return -1;
        if (strcmp(key, "v") == 0) {
            if (number(&c, &version) != 0)
                return -1;
        } else if (strcmp(key, "type") == 0) {
            if (string(&c, type, sizeof type) != 0)
                return -1;
        } else if (strcmp(key, "devices") == 0) {
            have_devices = 1;
            if (!eat(&c, '['))
                return -1;
            if (!eat(&c, ']')) {
                do {
                    struct vgpu_util u;
                    if (util_device(&c, &u) != 0)
                        return -1;
                    if (n < max)
                        out[n++] = u;
                } while (eat(&c, ','));
                if (!eat(&c, ']'))
                    return -1;
            }
        } else if (skip_value(&c, 1) != 0) {
            return -1;
        }
    } while (eat(&c, ','));
    if (!eat(&c, '}'))
        return -1;
    ws(&c);
    if (c.p != c.end || version != 1 || strcmp(type, "util") != 0 || !have_devices)
        return -1;
    return n;
}
