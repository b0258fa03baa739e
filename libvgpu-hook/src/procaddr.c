/* cuGetProcAddress and cuGetProcAddress_v2: the CUDA runtime (12+) fetches
 * nearly every driver function this way, so the answer must be the hook's
 * function wherever the hook intercepts the variant the driver picked,
 * including for cuGetProcAddress itself.
 *
 * The driver is asked first (it knows which variant a base name and version
 * mean, and whether it has it). Its answer is then matched by identity
 * against the real functions the hook wraps. If the driver answered with a
 * pointer the hook does not know (a driver whose table differs from its
 * exports), the variant is chosen by name with the driver's rules instead:
 * the newest variant of that base name introduced at or before the asked
 * version, per-thread (_ptsz/_ptds) ones when the per-thread flag is given. */
#include <string.h>

#include "functions.h"

/* Length of the base name: without _ptsz/_ptds, then without _v<digits>. */
static size_t base_length(const char *name)
{
    size_t n = strlen(name);
    if (n > 5 && (strcmp(name + n - 5, "_ptsz") == 0 || strcmp(name + n - 5, "_ptds") == 0))
        n -= 5;
    size_t d = n;
    while (d > 0 && name[d - 1] >= '0' && name[d - 1] <= '9')
        d--;
    if (d < n && d >= 2 && name[d - 1] == 'v' && name[d - 2] == '_')
        n = d - 2;
    return n;
}

static int per_thread(const char *name)
{
    size_t n = strlen(name);
    return n > 5 && (strcmp(name + n - 5, "_ptsz") == 0 || strcmp(name + n - 5, "_ptds") == 0);
}

static void *by_name(const char *symbol, int version, cuuint64_t flags)
{
    int want_pt = flags == CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, best = -1;
    size_t len = strlen(symbol);
    for (int i = 0; i < VGPU_FN_COUNT; i++) {
        const char *name = vgpu_fn_name(i);
        int since = vgpu_fn_since(i), pt = per_thread(name);
        if (!since || base_length(name) != len || strncmp(name, symbol, len) != 0)
            continue;
        if (since > version || (pt && !want_pt))
            continue;
        if (best < 0 || pt > per_thread(vgpu_fn_name(best)) ||
            (pt == per_thread(vgpu_fn_name(best)) && since > vgpu_fn_since(best)))
            best = i;
    }
    return best >= 0 ? vgpu_fn_hook(best) : NULL;
}

/* The function to hand out for what the driver answered. */
static void *substitute(const char *symbol, void *fn, int version, cuuint64_t flags)
{
    for (int i = 0; i < VGPU_FN_COUNT; i++)
        if (vgpu_fn_since(i) && vgpu_real(i) == fn)
            return vgpu_fn_hook(i) ? vgpu_fn_hook(i) : fn;
    void *mine = by_name(symbol, version, flags);
    return mine ? mine : fn;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus)
{
    vgpu_cuGetProcAddress_v2_fn real = REAL(cuGetProcAddress_v2);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn)
        *pfn = substitute(symbol, *pfn, cudaVersion, flags);
    return rc;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    vgpu_cuGetProcAddress_fn real = REAL(cuGetProcAddress);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = real(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && symbol && pfn && *pfn)
        *pfn = substitute(symbol, *pfn, cudaVersion, flags);
    return rc;
}
