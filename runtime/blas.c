/* cuBLASLt, loaded when the first stream is created: the library is large
 * (hundreds of MB), and a process that never touches a GPU (the CLI, prewarm)
 * should not pay for mapping it. */
#include <cublasLt.h>
#include <dlfcn.h>
#include <stdio.h>

#include "runtime/internal.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static kiln__blas blas;
static const kiln__blas *loaded;
static char why_not[512];

static void load(void)
{
    static const char *const names[] = {"libcublasLt.so.13", "libcublasLt.so"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(why_not, sizeof why_not, "cuBLASLt (libcublasLt.so.13) cannot be loaded: %s", e ? e : "not found");
        return;
    }
#define KILN__BLAS_LOAD(name)                                                                                       \
    if (!(blas.name = (__typeof__(blas.name))dlsym(lib, #name))) {                                                \
        snprintf(why_not, sizeof why_not, "libcublasLt.so lacks %s", #name);                                      \
        return;                                                                                                     \
    }
    KILN__BLAS_FUNCS(KILN__BLAS_LOAD)
#undef KILN__BLAS_LOAD
    loaded = &blas;
}

const kiln__blas *kiln__blas_get(const char **why)
{
    pthread_once(&once, load);
    if (!loaded && why)
        *why = why_not;
    return loaded;
}
