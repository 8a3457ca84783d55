/* Attention for the fast decoder's decoding passes (one token, or a draft tree), on the CPU.

   Compiled once per machine by cpu_kernels.py (cc -O3 -march=native). Why a kernel of our
   own: a one-token pass of a 135M model spent ~20 PyTorch operations per layer on attention,
   each costing microseconds of dispatch for a few microseconds of arithmetic.

   Every (row, query head) is computed alone, by the same code in the same order, whatever
   else shares the pass: its keys in the order of its own sequence (the cache before the
   pass, then its ancestors in the tree, itself last), one dot product per key, the maximum,
   the weights, and the weighted values summed key by key. So a tree row's result has the
   same bits as the one-token pass at its position (blocked_attention.py explains why that
   matters under bfloat16).

   Layout: queries bfloat16 (rows strided by q_row_stride elements, heads by d); one layer's
   cache keys and values bfloat16 (kv_heads, capacity, d); the output bfloat16 (n, heads * d).
   Sums are float32 throughout. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector8.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } x = { .u = (uint32_t)h << 16 };
    return x.f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as PyTorch does */
    union { float f; uint32_t u; } x = { .f = f };
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);  /* NaN */
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

/* 16 bfloat16 values widened to float (exact: a bfloat16 is a float's upper half). */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
static inline v16 load16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, v16u) << 16);
}
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }

/* The 16 lanes added as a fixed tree: 8 + 8, 4 + 4, 2 + 2, 1 + 1. */
static inline float lane_sum(v16 v) {
    typedef float v4 __attribute__((vector_size(16)));
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (scores minus their maximum), lane by lane: vector8.h's Cephes polynomial
   on each half, within a couple of ulps. A lane's result depends on that lane alone. */
static inline v16 exp16(v16 x) {
    v8 low = exp8_negative(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
    v8 high = exp8_negative(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

#define MAX_GROUP 8  /* query heads per KV head handled together (more: in several groups) */

/* Query heads sharing one KV head (q: group x d floats, already scaled), each over the keys
   at slots[0..count): every key is read once for the group; each head's arithmetic is its
   own, the same for any group size. scores: room for group x (count + 16). */
static inline __attribute__((always_inline)) void attend_group(const float *q, int group, const uint16_t *keys, const uint16_t *values,
                         const int32_t *slots, int count, int d, float *scores, uint16_t *out) {
    int chunks = d / 16, stride = count + 16;
    v16 qv[MAX_GROUP][16], acc[MAX_GROUP][16];
    float best[MAX_GROUP], total[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        for (int c = 0; c < chunks; c++) qv[g][c] = load16(q + g * d + 16 * c);
        best[g] = -3.0e38f;
    }
    for (int j = 0; j < count; j++) {
        const uint16_t *k = keys + (long)slots[j] * d;
        for (int g = 0; g < group; g++) {
            v16 dot = qv[g][0] * load16_bf16(k);
            for (int c = 1; c < chunks; c++) dot += qv[g][c] * load16_bf16(k + 16 * c);
            float score = lane_sum(dot);
            scores[g * stride + j] = score;
            best[g] = score > best[g] ? score : best[g];
        }
    }
    for (int g = 0; g < group; g++) {
        float *s = scores + g * stride;
        for (int j = count; j % 16; j++) s[j] = best[g];  /* padding lanes: computed, never used */
        for (int j = 0; j < count; j += 16) store16(s + j, exp16(load16(s + j) - best[g]));
        total[g] = 0.0f;
        for (int c = 0; c < chunks; c++) acc[g][c] = splat(0.0f);
    }
    for (int j = 0; j < count; j++) {
        const uint16_t *v = values + (long)slots[j] * d;
        for (int g = 0; g < group; g++) {
            float weight = scores[g * stride + j];
            total[g] += weight;
            for (int c = 0; c < chunks; c++) acc[g][c] += splat(weight) * load16_bf16(v + 16 * c);
        }
    }
    for (int g = 0; g < group; g++) {
        float result[256];
        for (int c = 0; c < chunks; c++) store16(result + 16 * c, acc[g][c] / total[g]);
        for (int i = 0; i < d; i++) out[g * d + i] = to_bf16(result[i]);
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* attend_group on a CPU with AVX2 and no AVX-512, one query head at a time: its 16-lane
   vectors take two 8-lane registers each there, and a group's queries and sums no longer fit
   the 16 registers (GCC spilled them to memory on every key: a pass's attention cost as much
   as its weight products). A head's arithmetic is attend_group's, lane by lane. */
#include <immintrin.h>

static inline __m256 bf16x8(const uint16_t *p) {  /* widen8 as intrinsics: GCC's code for it was slower here */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* One query head (q: d floats, scaled) over the keys at slots[0..count); scores: room for
   count + 8 floats. Lanes 0-7 and 8-15 of each 16 inputs in two registers, added as lane_sum. */
static inline __attribute__((always_inline)) void attend_head(const float *q, const uint16_t *keys,
        const uint16_t *values, const int32_t *slots, int count, int d, float *scores, uint16_t *out) {
    int chunks = d / 16;
    __m256 q_low[16], q_high[16], acc_low[16], acc_high[16];
    for (int c = 0; c < chunks; c++) q_low[c] = _mm256_loadu_ps(q + 16 * c), q_high[c] = _mm256_loadu_ps(q + 16 * c + 8);
    float best = -3.0e38f;
    for (int j = 0; j < count; j++) {
        const uint16_t *k = keys + (long)slots[j] * d;
        __m256 low = _mm256_mul_ps(q_low[0], bf16x8(k)), high = _mm256_mul_ps(q_high[0], bf16x8(k + 8));
        for (int c = 1; c < chunks; c++) {
            low = _mm256_fmadd_ps(q_low[c], bf16x8(k + 16 * c), low);
            high = _mm256_fmadd_ps(q_high[c], bf16x8(k + 16 * c + 8), high);
        }
        __m256 a = _mm256_add_ps(low, high);
        __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        float lanes[4];
        _mm_storeu_ps(lanes, b);
        float score = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
        scores[j] = score;
        best = score > best ? score : best;
    }
    for (int j = count; j % 8; j++) scores[j] = best;  /* padding lanes: computed, never used */
    for (int j = 0; j < count; j += 8)
        _mm256_storeu_ps(scores + j, (__m256)exp8_negative((v8)_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(best))));
    float total = 0.0f;
    for (int c = 0; c < chunks; c++) acc_low[c] = acc_high[c] = _mm256_setzero_ps();
    for (int j = 0; j < count; j++) {
        const uint16_t *v = values + (long)slots[j] * d;
        __m256 weight = _mm256_set1_ps(scores[j]);
        total += scores[j];
        for (int c = 0; c < chunks; c++) {
            acc_low[c] = _mm256_fmadd_ps(weight, bf16x8(v + 16 * c), acc_low[c]);
            acc_high[c] = _mm256_fmadd_ps(weight, bf16x8(v + 16 * c + 8), acc_high[c]);
        }
    }
    float result[256];
    for (int c = 0; c < chunks; c++) {
        _mm256_storeu_ps(result + 16 * c, _mm256_div_ps(acc_low[c], _mm256_set1_ps(total)));
        _mm256_storeu_ps(result + 16 * c + 8, _mm256_div_ps(acc_high[c], _mm256_set1_ps(total)));
    }
    for (int i = 0; i < d; i++) out[i] = to_bf16(result[i]);
}

static void attend(const float *q, int group, const uint16_t *keys, const uint16_t *values,
                   const int32_t *slots, int count, int d, float *scores, uint16_t *out) {
    for (int g = 0; g < group; g++)
        if (d == 64)  /* the usual head size, unrolled by the compiler */
            attend_head(q + g * d, keys, values, slots, count, 64, scores, out + g * d);
        else
            attend_head(q + g * d, keys, values, slots, count, d, scores, out + g * d);
}
#else
static void attend(const float *q, int group, const uint16_t *keys, const uint16_t *values,
                   const int32_t *slots, int count, int d, float *scores, uint16_t *out) {
    if (d == 64)  /* the usual head size, unrolled by the compiler */
        attend_group(q, group, keys, values, slots, count, 64, scores, out);
    else
        attend_group(q, group, keys, values, slots, count, d, scores, out);
}
#endif

/* n rows at cache slots start .. start + n; row r sees the cache before `start` and the rows
   a with ancestors[r * n + a] != 0 (itself included; rows are numbered in depth order).
   Returns 0, or -1 when d is not a multiple of 16 up to 256 or memory runs out. */
int tree_attention(const uint16_t *q, long q_row_stride, const uint16_t *keys, const uint16_t *values,
                   long capacity, int n, int heads, int kv_heads, int d, int start,
                   const uint8_t *ancestors, float scale, uint16_t *out) {
    if (d % 16 || d > 256 || heads % kv_heads) return -1;
    int rep = heads / kv_heads, failed = 0;
    /* (row, KV head) pairs shared out among OpenMP's threads; each pair computed by one. */
    #pragma omp parallel if ((long)n * kv_heads * (start + n) >= 512)
    {
        int32_t *slots = malloc(sizeof(int32_t) * (size_t)(start + n));
        float *scores = malloc(sizeof(float) * MAX_GROUP * (size_t)(start + n + 16));
        float qf[MAX_GROUP * 256];
        for (int j = 0; slots && j < start; j++) slots[j] = j;
        #pragma omp for schedule(static)
        for (int job = 0; job < n * kv_heads; job++) {
            if (!slots || !scores) { failed = 1; continue; }
            int r = job / kv_heads, kv = job % kv_heads, count = start;
            for (int a = 0; a < n; a++)
                if (ancestors[(long)r * n + a]) slots[count++] = start + a;
            long head_offset = (long)kv * capacity * d;
            const uint16_t *k = keys + head_offset, *v = values + head_offset;
            for (int h0 = kv * rep; h0 < (kv + 1) * rep; h0 += MAX_GROUP) {
                int group = (kv + 1) * rep - h0 < MAX_GROUP ? (kv + 1) * rep - h0 : MAX_GROUP;
                for (int g = 0; g < group; g++) {
                    const uint16_t *qh = q + r * q_row_stride + (long)(h0 + g) * d;
                    for (int i = 0; i < d; i++) qf[g * d + i] = from_bf16(qh[i]) * scale;
                }
                uint16_t *o = out + ((long)r * heads + h0) * d;
                attend(qf, group, k, v, slots, count, d, scores, o);
            }
        }
        free(slots);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* x (n, dim) bfloat16, plus y (n, dim) when y is not NULL (rounded once, in place: the
   residual stream), then out = x / rms(x) * weight, in float32 rounded once to bfloat16. */
void add_rms_norm(uint16_t *x, const uint16_t *y, const uint16_t *weight, int n, int dim, float eps,
                  uint16_t *out) {
    for (int r = 0; r < n; r++) {
        uint16_t *row = x + (long)r * dim;
        if (y)
            for (int i = 0; i < dim; i++) row[i] = to_bf16(from_bf16(row[i]) + from_bf16(y[(long)r * dim + i]));
        float lanes[16] = {0};
        int i = 0;
        for (; i + 16 <= dim; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += from_bf16(row[i + l]) * from_bf16(row[i + l]);
        for (; i < dim; i++) lanes[0] += from_bf16(row[i]) * from_bf16(row[i]);
        v16 all;
        memcpy(&all, lanes, sizeof all);
        float inverse = 1.0f / __builtin_sqrtf(lane_sum(all) / (float)dim + eps);
        for (i = 0; i < dim; i++) out[(long)r * dim + i] = to_bf16(from_bf16(row[i]) * inverse * from_bf16(weight[i]));
    }
}

/* Rotary positions (transformers' half-split layout) on the queries and keys of a fused
   q/k/v output, qkv (n, heads + 2 kv_heads, d) bfloat16, with cos / sin (n, d) float32.
   Rotated queries go to q_out (n, heads, d) bfloat16; keys (rotated, rounded to bfloat16)
   and values to one layer's cache (kv_heads, capacity, d) bfloat16 at slots start .. start + n. */
void rotate_and_store(const uint16_t *qkv, const float *cos, const float *sin, int n, int heads,
                      int kv_heads, int d, long capacity, int start, uint16_t *q_out, uint16_t *keys,
                      uint16_t *values) {
    int half = d / 2;
    for (int r = 0; r < n; r++) {
        const float *c = cos + (long)r * d, *s = sin + (long)r * d;
        for (int h = 0; h < heads + 2 * kv_heads; h++) {
            const uint16_t *x = qkv + ((long)r * (heads + 2 * kv_heads) + h) * d;
            float rotated[512];
            for (int i = 0; i < d; i++) {
                float other = i < half ? -from_bf16(x[i + half]) : from_bf16(x[i - half]);
                rotated[i] = from_bf16(x[i]) * c[i] + other * s[i];
            }
            if (h < heads) {
                for (int i = 0; i < d; i++) q_out[((long)r * heads + h) * d + i] = to_bf16(rotated[i]);
            } else if (h < heads + kv_heads) {
                uint16_t *k = keys + ((long)(h - heads) * capacity + start + r) * d;
                for (int i = 0; i < d; i++) k[i] = to_bf16(rotated[i]);
            } else {
                uint16_t *v = values + ((long)(h - heads - kv_heads) * capacity + start + r) * d;
                for (int i = 0; i < d; i++) v[i] = x[i];
            }
        }
    }
}
