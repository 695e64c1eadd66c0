/* Scalar helpers shared by the native kernels: bf16 <-> float32 and exp, written so that the
 * compiler vectorises them (branch-free, the same bits in every lane). */
#ifndef SPECEDGE_BF16_MATH_H
#define SPECEDGE_BF16_MATH_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* Round to nearest even, as torch's float -> bf16 (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

/* exp(x) = 2^k * p(r): Cody-Waite reduction and a degree-6 polynomial (~1 ulp); x clamped
 * to [-87, 88] by the callers below. Returns p; *k the power of two. */
static inline float exp_poly(float x, float *k) {
    *k = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    float r = fmaf(*k, -0.693145751953125f, x);
    r = fmaf(*k, -1.428606765330187045e-06f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    return fmaf(p * r, r, r) + 1.0f;
}

/* exp(x) for x <= 0 (softmax after subtracting the max). */
static inline float exp_neg(float x) {
    float k;
    const float p = exp_poly(x < -87.0f ? -87.0f : x, &k);
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)k + 127) << 23;
    return p * c.f;
}

/* exp(x) for any x; 2^k in two halves so k = 128 (x near 88.7) does not overflow the
 * exponent field. */
static inline float exp_any(float x) {
    float k;
    const float p = exp_poly(x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x), &k);
    const int32_t ki = (int32_t)k, k1 = ki >> 1, k2 = ki - k1;
    union { uint32_t u; float f; } a, b;
    a.u = (uint32_t)(k1 + 127) << 23;
    b.u = (uint32_t)(k2 + 127) << 23;
    return p * a.f * b.f;
}

#endif
