/* IEEE half precision and bfloat16 on the host, for the GPU tests'
 * references: exact decoding and round-to-nearest-even encoding. */
#ifndef KILN_TESTS_F16_HOST_H
#define KILN_TESTS_F16_HOST_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The value of an f16 bit pattern (NaN and infinities included). */
static inline float h2f(uint16_t h)
{
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 31)
        u = s | 0x7f800000u | (m << 13);
    else if (e)
        u = s | ((e + 112) << 23) | (m << 13);
    else if (!m)
        u = s;
    else {
        float v = ldexpf((float)m, -24);
        return s ? -v : v;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x rounded to the nearest f16, ties to even; past the range, infinity. */
static inline uint16_t f2h(double x)
{
    uint16_t s = x < 0 || (x == 0 && signbit(x)) ? 0x8000 : 0;
    double a = fabs(x);
    if (a >= 65520.0)
        return s | 0x7c00;
    if (a < ldexp(1, -14)) /* subnormal: multiples of 2^-24 (rounding up to 2^-14 gives its encoding) */
        return s | (uint16_t)nearbyint(a * ldexp(1, 24));
    int e;
    frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    double q = nearbyint(ldexp(a, 11 - e)); /* 11 significant bits */
    if (q >= 2048) {
        q /= 2;
        e++;
    }
    return s | (uint16_t)(((e + 14) << 10) | ((uint16_t)q & 1023));
}

/* The value of a bf16 bit pattern: the high 16 bits of an f32. */
static inline float kiln_test_bf16_to_f32(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* x rounded to the nearest bf16, ties to even (cvt.rn.bf16.f32's rounding);
 * NaN stays a (quiet) NaN. */
static inline uint16_t kiln_test_bf16_from_f32(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

#endif
