/* dlsym interposition, so that lookups on libcuda's or libnvidia-ml's own
 * handle (dlopen + dlsym, as done by the CUDA runtime, ctypes, numba and
 * nvidia-smi) get the hook's functions, which LD_PRELOAD alone does not give.
 *
 * The difficulty is RTLD_NEXT: glibc's dlsym resolves it relative to the
 * object its *caller* is in, found from its return address. A C wrapper that
 * calls the real dlsym makes every RTLD_NEXT lookup relative to libvgpu.so:
 * another preloaded library asking for its "next" malloc would get its own,
 * and recurse. So on x86-64 the exported dlsym is a small assembly trampoline:
 * it asks vgpu_dlsym_intercept whether to answer (only for handle lookups of
 * names in the function lists that resolve to the very function the hook
 * wraps), and otherwise *jumps* to glibc's dlsym with the caller's return
 * address still on the stack, so the real one sees the original caller.
 * Elsewhere a C wrapper does the same minus that guarantee (README).
 *
 * The real dlsym is found with dlvsym, which is not interposed, in the
 * hook's constructor. Loader safety: this code runs inside the loader's own
 * critical sections (a library's constructor calling dlsym while dlopen holds
 * the loader lock), so it takes no lock of its own and never waits for
 * another thread: a lookup before the constructor ran (another preloaded
 * library's start-up) repeats the idempotent dlvsym and publishes it with an
 * atomic store. A once-lock here deadlocked: thread A inside the once waiting
 * for the loader lock, thread B holding the loader lock waiting for the once. */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "functions.h"
#include "log.h"

typedef void *(*dlsym_fn)(void *, const char *);

/* dlsym runs before anything else is set up, e.g. from the sanitizers' own
 * start-up, so the code on its path must not be instrumented. */
#define EARLY __attribute__((no_sanitize_address, no_sanitize("undefined")))

/* Used by the trampoline: hidden, but must not be optimised away. */
__attribute__((used)) dlsym_fn vgpu_real_dlsym_fn;
__attribute__((used)) void *vgpu_dlsym_intercept(void *handle, const char *name);

/* glibc's dlsym. Lock-free and idempotent: every caller that finds it unset
 * looks it up itself (all find the same function). */
EARLY static dlsym_fn real_dlsym(void)
{
    dlsym_fn fn = __atomic_load_n(&vgpu_real_dlsym_fn, __ATOMIC_ACQUIRE);
    if (fn)
        return fn;
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !fn; i++)
        fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!fn) {
        vgpu_log_error("cannot find glibc's dlsym; aborting");
        abort();
    }
    __atomic_store_n(&vgpu_real_dlsym_fn, fn, __ATOMIC_RELEASE);
    return fn;
}

/* Runs while the process is still single-threaded (preload constructors run
 * before main), so that later lookups find it already set. */
EARLY __attribute__((constructor)) static void find_real_dlsym_early(void)
{
    real_dlsym();
}

EARLY void *vgpu_real_dlsym(void *handle, const char *name)
{
    return real_dlsym()(handle, name);
}

EARLY void *vgpu_dlsym_intercept(void *handle, const char *name)
{
    dlsym_fn next = real_dlsym(); /* the trampoline jumps to it on NULL */
    /* The global scope already finds the preloaded interposers first; RTLD_NEXT
     * is left to glibc with the caller's identity (see above). */
    if (!name || handle == RTLD_NEXT || handle == RTLD_DEFAULT)
        return NULL;
    if (!(name[0] == 'c' && name[1] == 'u') && strncmp(name, "nvml", 4) != 0)
        return NULL;
    int id = vgpu_fn_by_name(name);
    if (id < 0 || !vgpu_fn_hook(id))
        return NULL;
    void *theirs = next(handle, name);
    /* Only the driver's own function is replaced: another library that
     * happens to export the same name is left alone. */
    if (!theirs || theirs != vgpu_real(id))
        return NULL;
    return vgpu_fn_hook(id);
}

#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        "dlsym:\n"
        "    .cfi_startproc\n"
        "    endbr64\n"
        "    push %rdi\n"
        "    .cfi_adjust_cfa_offset 8\n"
        "    push %rsi\n"
        "    .cfi_adjust_cfa_offset 8\n"
        "    sub $8, %rsp\n" /* 16-byte alignment for the call */
        "    .cfi_adjust_cfa_offset 8\n"
        "    call vgpu_dlsym_intercept\n"
        "    add $8, %rsp\n"
        "    .cfi_adjust_cfa_offset -8\n"
        "    pop %rsi\n"
        "    .cfi_adjust_cfa_offset -8\n"
        "    pop %rdi\n"
        "    .cfi_adjust_cfa_offset -8\n"
        "    test %rax, %rax\n"
        "    jz 1f\n"
        "    ret\n"
        "1:  jmp *vgpu_real_dlsym_fn(%rip)\n" /* tail jump: glibc sees our caller */
        "    .cfi_endproc\n"
        ".size dlsym, .-dlsym\n");
#else
/* Without the trampoline, RTLD_NEXT lookups by other objects resolve relative
 * to libvgpu.so (documented limitation on these architectures). */
VGPU_EXPORT void *dlsym(void *handle, const char *name)
{
    void *mine = vgpu_dlsym_intercept(handle, name);
    return mine ? mine : real_dlsym()(handle, name);
}
#endif
