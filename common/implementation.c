/* The implementation fingerprint: what this build's kernels are made of. */
#include "common/internal.h"
#include <string.h>
#include "jit/embedded.h"

void kiln__implementation_digest(const char *provider_versions, uint8_t out[32])
{
    kiln__hasher *h = kiln__hasher_new();
    if (!h) {
        memset(out, 0, 32);
        return;
    }
    kiln__hasher_str(h, "kiln-implementation-1");
    for (size_t i = 0; i < kiln__embedded_count; i++) {
        kiln__hasher_str(h, kiln__embedded_files[i].name);
        kiln__hasher_part(h, kiln__embedded_files[i].data, kiln__embedded_files[i].size);
    }
    kiln__hasher_str(h, provider_versions);
    if (kiln__hasher_final(h, out) != 0)
        memset(out, 0, 32);
}
