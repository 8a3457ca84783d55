/* 8-lane float vectors - one AVX2 register, half an AVX-512 one - and the bfloat16 steps that
   cpu_kernels.c (attention where the CPU has no AVX-512) and decoder_layers.c share. Written in
   GCC's vector extensions: 16-lane vectors on an AVX2-only CPU take two registers each, and
   GCC spilled them or turned their comparisons into scalar code there. */
#ifndef GUMIHO_VECTOR8_H
#define GUMIHO_VECTOR8_H

#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

/* 8 bfloat16 values widened to float (exact: a bfloat16 is a float's upper half). */
static inline v8 widen8(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8)(__builtin_convertvector(h, v8u) << 16);
}

/* Rounded to bfloat16, nearest even (finite values: NaN is not expected where it is used). */
static inline void narrow8(uint16_t *p, v8 f) {
    v8u u = (v8u)f;
    v8h h = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, v8h);
    memcpy(p, &h, sizeof h);
}

static inline v8 splat8(float x) { return (v8){0} + x; }

/* exp(x) for x <= 0, lane by lane: Cephes' expf polynomial (cpu_kernels.c's exp16, 8 lanes). */
static inline v8 exp8_negative(v8 x) {
    v8 low = splat8(-87.0f);
    v8i below = x < low;
    x = (v8)(((v8i)low & below) | ((v8i)x & ~below));
    v8i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i);  /* round, x <= 0 */
    v8 nf = __builtin_convertvector(n, v8);
    v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8 p = splat8(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((n + 127) << 23);
}

#endif
