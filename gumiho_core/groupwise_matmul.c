/* Weight-only products with 4- or 8-bit weights in groups of 32 inputs, on AVX512-VNNI and
   Intel AMX: y = x @ W.T, each group w = q * scale + low (q in 0..15 or 0..255), x and y
   bfloat16. Built with cpu_kernels.c (cpu_kernels.py).

   Why: PyTorch's int4 CPU kernel converts the weights to float for every 4 rows of x, so a
   pass over 11 tree rows cost 3.8x a one-token pass (SmolLM2-135M, 2 cores) and trees barely
   paid. Here the weights go to the CPU's integer dot-product units as bytes: VNNI for a few
   rows, AMX (one instruction: a group of 16 outputs with up to 16 rows) for many. x is
   quantized for it in two int8 parts: each row's group of 32 becomes hi = round(x / s)
   (s = max |x| / 127, as llama.cpp's Q8 activations) and lo = round((x - s * hi) / (s / 256)),
   so x ~ s / 256 * (256 hi + lo) to 1 part in ~32000 of the group's largest value - finer
   than bfloat16 itself (one int8 part alone parted the default model's greedy answers from
   float32's after ~8 tokens, against ~20 with bfloat16 activations). Then
   sum(w * x) = scale * s / 256 * (256 sum(q * hi) + sum(q * lo)) + low * sum(x), the last
   sum taken from x itself.

   Every output element is the same sum in the same order whatever the number of rows: each
   row is quantized alone, the integer sums are exact (VNNI and AMX agree), and one float
   step adds each group's sum, in input order (tested).

   Weight layout, chosen at load (quantize.groupwise_layout): for each block of 16 outputs and
   each group, the 32 x 16 block as AMX's int8 tile reads it (8 rows; row p holds, for outputs
   0..15, inputs 4p .. 4p + 3 side by side: element 64 p + 4 out + i): 512 bytes in 8 bits;
   256 in 4 bits, byte j holding element j in its low nibble and element j + 256 in its high
   one. Scales and lows: bfloat16, (output blocks, groups, 2, 16). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vnni")))

/* The same sums on AVX2 (no AVX-512): CPUs such as AMD's Zen 1-3 and many laptops. */
#define AVX2 __attribute__((target("avx2,fma")))

extern int amx_from_rows;
/* 1 where the CPU has AVX512-VNNI and AVX512-BF16 (cpu_kernels.py sets it), else AVX2 runs:
   the same integer sums and the same float steps, so the same bits (tested). */
int use_avx512 = 0;

/* Linux hands out AMX's tile state only to a process that asks. 0 when granted: from then on
   blocks of `from_rows` rows or more take AMX (measured on SmolLM2-135M's layers, 2 cores:
   VNNI is as fast up to 8 rows, AMX from 9 on). */
int amx_enable(int from_rows) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    amx_from_rows = from_rows;
    return 0;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 1 and 5: the rows' quantized group, hi and lo parts (rows x 32 int8); 2 and 4: two
   output blocks' weights for the group (32 inputs x 16 outputs, as 8 rows of 64 bytes);
   0, 6 and 3, 7: the int32 sums of hi and lo for the two blocks (rows x 16 outputs). */
AMX static void configure(int rows) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = rows, config.colsb[t] = 64;
    config.colsb[1] = config.colsb[5] = 32;
    config.rows[2] = config.rows[4] = 8;
    _tile_loadconfig(&config);
}

AMX static inline __m512 bf16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One group of 16 values in two int8 parts: hi = round(x * inverse), lo = round((x - hi *
   step) * 256 / step), clamped (|lo| may round to 128). */
AMX static inline void split16(__m512 x, __m512 inverse, __m512 step, __m512 fine, int8_t *hi, int8_t *lo) {
    __m512i whole = _mm512_cvtps_epi32(_mm512_mul_ps(x, inverse));
    __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(whole), step, x);
    __m512i part = _mm512_cvtps_epi32(_mm512_mul_ps(rest, fine));
    _mm_storeu_si128((__m128i *)hi, _mm512_cvtsepi32_epi8(whole));
    _mm_storeu_si128((__m128i *)lo, _mm512_cvtsepi32_epi8(part));
}

/* One row of x (k bfloat16) in int8 groups of 32, two parts each (see the top), each group's
   scale s / 256 and the sum of its unquantized values. */
AMX static void quantize_row(const uint16_t *x, int k, int8_t *hi, int8_t *lo, float *scale, float *sum) {
    __m512 sign = _mm512_set1_ps(-0.0f);
    for (int g = 0; g < k / 32; g++) {
        __m512 a = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(x + 32 * g)));
        __m512 b = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(x + 32 * g + 16)));
        float biggest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        float lanes[16];
        _mm512_storeu_ps(lanes, _mm512_add_ps(a, b));
        float total = 0.0f;  /* the 16 lane sums in a fixed order */
        for (int i = 0; i < 16; i++) total += lanes[i];
        float step = biggest / 127.0f;
        __m512 inverse = _mm512_set1_ps(biggest > 0 ? 127.0f / biggest : 0.0f);
        __m512 fine = _mm512_set1_ps(biggest > 0 ? 256.0f / step : 0.0f);
        split16(a, inverse, _mm512_set1_ps(step), fine, hi + 32 * g, lo + 32 * g);
        split16(b, inverse, _mm512_set1_ps(step), fine, hi + 32 * g + 16, lo + 32 * g + 16);
        scale[g] = step / 256.0f, sum[g] = total;
    }
}

/* One group's 16 x 32 weights as bytes, in the tile's layout (8 rows of 64): 8-bit weights
   as they lie (512 bytes a group), 4-bit ones split from their nibbles (256 bytes). */
AMX static inline void unpack_group(const uint8_t *weights, int bits, long at, __m512i rows[8]) {
    if (bits == 8) {
        for (int p = 0; p < 8; p++) rows[p] = _mm512_loadu_si512((const void *)(weights + at * 512 + 64 * p));
        return;
    }
    const uint8_t *nibbles = weights + at * 256;
    __m512i mask = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_loadu_si512((const void *)(nibbles + 64 * c));
        rows[c] = _mm512_and_si512(v, mask);
        rows[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
}

/* A group's exact integer sums of hi and lo (16 outputs of one row) into the row's float sums:
   the one place the float arithmetic happens, whichever unit computed the integers.
   |256 hi_sum + lo_sum| < 32 * 255 * 32639 < 2^31: exact in int32. */
AMX static inline __m512 add_group(__m512 acc, __m512i hi_sums, __m512i lo_sums, __m512 scale, __m512 low,
                                   float x_scale, float x_sum) {
    __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(hi_sums, 8), lo_sums);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(x_scale)), acc);
    return _mm512_fmadd_ps(low, _mm512_set1_ps(x_sum), acc);
}

/* The quantized rows: hi and lo parts (m, k), their groups' scales and sums (m, k / 32). */
struct rows_q8 {
    const int8_t *hi, *lo;
    const float *scale, *sum;
    int k, groups, bits;  /* bits: of the weights, 4 or 8 */
};

AMX static inline __m512 group_scale(const uint16_t *scales, long at) {
    return bf16_to_ps(_mm256_loadu_si256((const __m256i *)(scales + at * 32)));
}

AMX static inline __m512 group_low(const uint16_t *scales, long at) {
    return bf16_to_ps(_mm256_loadu_si256((const __m256i *)(scales + at * 32 + 16)));
}

/* 16 outputs (block nb) of `rows` rows from r0, with AVX512-VNNI: the few-row passes. */
AMX static void block_vnni(const struct rows_q8 *x, int r0, int rows, const uint8_t *weights,
                           const uint16_t *scales, int nb, __m512 *acc) {
    for (int g = 0; g < x->groups; g++) {
        long at = (long)nb * x->groups + g;
        __m512i w[8];
        unpack_group(weights, x->bits, at, w);
        __m512 scale = group_scale(scales, at), low = group_low(scales, at);
        for (int r = 0; r < rows; r++) {
            long row = (long)(r0 + r) * x->k + 32 * g;
            const int32_t *hi = (const int32_t *)(x->hi + row), *lo = (const int32_t *)(x->lo + row);
            __m512i hi_sums = _mm512_setzero_si512(), lo_sums = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) {
                hi_sums = _mm512_dpbusd_epi32(hi_sums, w[p], _mm512_set1_epi32(hi[p]));
                lo_sums = _mm512_dpbusd_epi32(lo_sums, w[p], _mm512_set1_epi32(lo[p]));
            }
            long rg = (long)(r0 + r) * x->groups + g;
            acc[r] = add_group(acc[r], hi_sums, lo_sums, scale, low, x->scale[rg], x->sum[rg]);
        }
    }
}

/* The same with AMX, two blocks of 16 outputs (nb, nb + 1) at once: per group and block one
   tile instruction for each part, for up to 16 rows. */
AMX static void blocks_amx(const struct rows_q8 *x, int r0, int rows, const uint8_t *weights,
                           const uint16_t *scales, int nb, __m512 *acc, __m512 *acc_next) {
    uint8_t tiles[2][512] __attribute__((aligned(64)));
    int32_t sums[4][16 * 16] __attribute__((aligned(64)));  /* hi, lo of block nb; hi, lo of nb + 1 */
    for (int g = 0; g < x->groups; g++) {
        long at = (long)nb * x->groups + g, next = at + x->groups;
        __m512i w[8];
        unpack_group(weights, x->bits, at, w);
        for (int p = 0; p < 8; p++) _mm512_store_si512((void *)(tiles[0] + 64 * p), w[p]);
        unpack_group(weights, x->bits, next, w);
        for (int p = 0; p < 8; p++) _mm512_store_si512((void *)(tiles[1] + 64 * p), w[p]);
        _tile_zero(0);
        _tile_zero(6);
        _tile_zero(3);
        _tile_zero(7);
        _tile_loadd(1, x->hi + (long)r0 * x->k + g * 32, x->k);
        _tile_loadd(5, x->lo + (long)r0 * x->k + g * 32, x->k);
        _tile_loadd(2, tiles[0], 64);
        _tile_loadd(4, tiles[1], 64);
        _tile_dpbsud(0, 1, 2);
        _tile_dpbsud(6, 5, 2);
        _tile_dpbsud(3, 1, 4);
        _tile_dpbsud(7, 5, 4);
        _tile_stored(0, sums[0], 64);
        _tile_stored(6, sums[1], 64);
        _tile_stored(3, sums[2], 64);
        _tile_stored(7, sums[3], 64);
        for (int b = 0; b < 2; b++) {
            long block = b ? next : at;
            __m512 scale = group_scale(scales, block), low = group_low(scales, block);
            __m512 *into = b ? acc_next : acc;
            for (int r = 0; r < rows; r++) {
                long rg = (long)(r0 + r) * x->groups + g;
                __m512i hi_sums = _mm512_load_si512((const void *)(sums[2 * b] + 16 * r));
                __m512i lo_sums = _mm512_load_si512((const void *)(sums[2 * b + 1] + 16 * r));
                into[r] = add_group(into[r], hi_sums, lo_sums, scale, low, x->scale[rg], x->sum[rg]);
            }
        }
    }
}

/* ---- AVX2: 8 outputs a register, the same arithmetic lane by lane as the AVX-512 code ---- */

AVX2 static inline __m256 bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 int32 to int8 with signed saturation, as _mm512_cvtsepi32_epi8 does (in two steps). */
AVX2 static inline void store8_s8(int8_t *out, __m256i v) {
    __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)out, _mm_packs_epi16(s16, s16));
}

AVX2 static inline void split8(__m256 x, __m256 inverse, __m256 step, __m256 fine, int8_t *hi, int8_t *lo) {
    __m256i whole = _mm256_cvtps_epi32(_mm256_mul_ps(x, inverse));
    __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(whole), step, x);
    store8_s8(hi, whole);
    store8_s8(lo, _mm256_cvtps_epi32(_mm256_mul_ps(rest, fine)));
}

/* quantize_row's twin: the same maximum, the same 16 lane sums added in the same order. */
AVX2 static void quantize_row_avx2(const uint16_t *x, int k, int8_t *hi, int8_t *lo, float *scale, float *sum) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < k / 32; g++) {
        __m256 v[4], biggest8 = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = bf16x8_to_ps(x + 32 * g + 8 * i);
            biggest8 = _mm256_max_ps(biggest8, _mm256_andnot_ps(sign, v[i]));
        }
        float lanes[16], maxima[8], biggest = 0.0f, total = 0.0f;
        _mm256_storeu_ps(maxima, biggest8);
        for (int i = 0; i < 8; i++) biggest = maxima[i] > biggest ? maxima[i] : biggest;
        _mm256_storeu_ps(lanes, _mm256_add_ps(v[0], v[2]));  /* lane i: x[i] + x[16 + i] */
        _mm256_storeu_ps(lanes + 8, _mm256_add_ps(v[1], v[3]));
        for (int i = 0; i < 16; i++) total += lanes[i];
        float step = biggest / 127.0f;
        __m256 inverse = _mm256_set1_ps(biggest > 0 ? 127.0f / biggest : 0.0f);
        __m256 fine = _mm256_set1_ps(biggest > 0 ? 256.0f / step : 0.0f);
        for (int i = 0; i < 4; i++)
            split8(v[i], inverse, _mm256_set1_ps(step), fine, hi + 32 * g + 8 * i, lo + 32 * g + 8 * i);
        scale[g] = step / 256.0f, sum[g] = total;
    }
}

/* 8-bit weights would saturate those 16-bit pair sums, so they take 16-bit products
   (vpmaddwd): the weights widened to 16 bits, w[64 p + 16 c ..]: tile row p of outputs
   4c .. 4c + 3, and x's two parts in one 16-bit number, 256 hi + lo. The sum of
   q * (256 hi + lo) is exact in int32 (|.| <= 32 x 255 x 32640 < 2^31): the integer the
   other paths form from their two sums. */
AVX2 static inline void widen_group(const uint8_t *weights, long at, int16_t *w) {
    for (int j = 0; j < 32; j++)
        _mm256_store_si256((__m256i *)(w + 16 * j),
                           _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(weights + at * 512 + 16 * j))));
}

/* s[c] holds two partial sums of each of outputs 4c .. 4c + 3: their totals, in output order. */
AVX2 static inline void pair_up(const __m256i s[4], __m256i out[2]) {
    out[0] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(s[0], s[1]), 0xD8);
    out[1] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(s[2], s[3]), 0xD8);
}

/* x's two parts of a group (32 inputs) in one 16-bit number each, 256 hi + lo. */
AVX2 static inline void join_parts(const int8_t *hi, const int8_t *lo, int16_t x16[32]) {
    for (int i = 0; i < 32; i += 16) {
        __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(hi + i)));
        __m256i l = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(lo + i)));
        _mm256_storeu_si256((__m256i *)(x16 + i), _mm256_add_epi16(_mm256_slli_epi16(h, 8), l));
    }
}

AVX2 static inline void sums_16bit(const int16_t *w, const int8_t *hi, const int8_t *lo, __m256i out[2]) {
    int16_t x16[32] __attribute__((aligned(32)));
    join_parts(hi, lo, x16);
    __m256i s[4] = { _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256() };
    for (int p = 0; p < 8; p++) {
        __m256i xp = _mm256_set1_epi64x(*(const int64_t *)(x16 + 4 * p));
        for (int c = 0; c < 4; c++)
            s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(_mm256_load_si256((const __m256i *)(w + 64 * p + 16 * c)), xp));
    }
    pair_up(s, out);
}

/* A group's sums (int32, 256 x hi's + lo's) for 8 outputs into a row's float sums, given the
   outputs' scales and lows: the one place AVX2 takes the float steps, add_group's lane by lane. */
AVX2 static inline __m256 add_sums8(__m256 acc, __m256i sums, __m256 scale, __m256 low, float x_scale, float x_sum) {
    __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, _mm256_set1_ps(x_scale)), acc);
    return _mm256_fmadd_ps(low, _mm256_set1_ps(x_sum), a);
}

/* The same for 16 outputs (both halves), their scales and lows read from the group's. */
AVX2 static inline void add_group_avx2(__m256 acc[2], const __m256i sums[2], const uint16_t *scales, long at,
                                       float x_scale, float x_sum) {
    for (int h = 0; h < 2; h++)
        acc[h] = add_sums8(acc[h], sums[h], bf16x8_to_ps(scales + at * 32 + 8 * h),
                           bf16x8_to_ps(scales + at * 32 + 16 + 8 * h), x_scale, x_sum);
}

/* One half (outputs 8h .. 8h + 7) of a group's 4-bit weights in 8 registers, tile rows 0..7:
   the low nibbles of loads h, 2 + h, 4 + h, 6 + h hold rows 0..3, their high nibbles rows 4..7. */
AVX2 static inline void unpack_half_avx2(const uint8_t *weights, long at, int h, __m256i w[8]) {
    __m256i mask = _mm256_set1_epi8(15);
    const uint8_t *nibbles = weights + at * 256;
    for (int p = 0; p < 4; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(nibbles + 32 * (2 * p + h)));
        w[p] = _mm256_and_si256(v, mask);
        w[4 + p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
}

/* 256 hi + lo sums of one row's group for 8 outputs, from the half's 8 weight registers. */
AVX2 static inline __m256i half_sums_avx2(const __m256i w[8], const int32_t *hi, const int32_t *lo) {
    __m256i hi_pairs = _mm256_setzero_si256(), lo_pairs = _mm256_setzero_si256();
    for (int p = 0; p < 8; p++) {
        hi_pairs = _mm256_add_epi16(hi_pairs, _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(hi[p])));
        lo_pairs = _mm256_add_epi16(lo_pairs, _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(lo[p])));
    }
    __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi_pairs, ones), 8), _mm256_madd_epi16(lo_pairs, ones));
}

/* 4-bit weights: 8 outputs at a time, so the half's weights, two pair sums and the row's
   broadcasts fit AVX2's 16 registers (all 16 outputs at once spilled on every row). */
AVX2 static void block4_avx2(const struct rows_q8 *x, int r0, int rows, const uint8_t *weights,
                             const uint16_t *scales, int nb, __m256 (*acc)[2]) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < x->groups; g++) {
            long at = (long)nb * x->groups + g;
            __m256i w[8];
            unpack_half_avx2(weights, at, h, w);
            __m256 scale = bf16x8_to_ps(scales + at * 32 + 8 * h), low = bf16x8_to_ps(scales + at * 32 + 16 + 8 * h);
            for (int r = 0; r < rows; r++) {
                long row = (long)(r0 + r) * x->k + 32 * g, rg = (long)(r0 + r) * x->groups + g;
                __m256i sums = half_sums_avx2(w, (const int32_t *)(x->hi + row), (const int32_t *)(x->lo + row));
                acc[r][h] = add_sums8(acc[r][h], sums, scale, low, x->scale[rg], x->sum[rg]);
            }
        }
}

/* 16 outputs (block nb) of `rows` rows from r0 into acc[r][0..1] (outputs 0..7, 8..15). */
AVX2 static void block_avx2(const struct rows_q8 *x, int r0, int rows, const uint8_t *weights,
                            const uint16_t *scales, int nb, __m256 (*acc)[2]) {
    if (x->bits == 4) {
        block4_avx2(x, r0, rows, weights, scales, nb, acc);
        return;
    }
    int16_t wide[512] __attribute__((aligned(32)));
    for (int g = 0; g < x->groups; g++) {
        long at = (long)nb * x->groups + g;
        widen_group(weights, at, wide);
        for (int r = 0; r < rows; r++) {
            long row = (long)(r0 + r) * x->k + 32 * g, rg = (long)(r0 + r) * x->groups + g;
            __m256i sums[2];
            sums_16bit(wide, x->hi + row, x->lo + row, sums);
            add_group_avx2(acc[r], sums, scales, at, x->scale[rg], x->sum[rg]);
        }
    }
}

/* The one-row loops read each weight once, in order: asking for the group PREFETCH_GROUPS
   ahead made a one-token pass ~6% faster here (8.66 -> 8.14 ms, context 300, four runs) than
   the hardware prefetcher alone; 2 to 16 groups ahead did alike, and so did keeping the lines
   in every cache level (_MM_HINT_T0) rather than marking them as read once (NTA). A prefetch
   past the last block reads nothing and cannot fault. */
#define PREFETCH_GROUPS 4

AVX2 static inline void prefetch_ahead(const uint8_t *weights, int bytes, const uint16_t *scales) {
    for (int c = 0; c < bytes; c += 64) _mm_prefetch((const char *)(weights + c), _MM_HINT_NTA);
    _mm_prefetch((const char *)scales, _MM_HINT_NTA);
}

/* One row, as a one-token pass has (plain decoding's every step). block4_avx2 keeps 16 rows'
   sums in memory and reads and writes them back at every group, with the weights' registers
   spilled around them: for one row that traffic, not the multiplies, was most of the time
   (perf, SmolLM2-135M's layers). Here the row's 16 sums stay in registers, with
   block4_avx2's own unpacking and pair sums. The integer sums are exact in any order and the float steps are
   add_sums8's, group by group: the same bits as among many rows (tested: row invariance).
   (Two rows at a time this way were slower than block4_avx2 from 2 rows on: it unpacks a
   group's weights once for all its rows.) */
AVX2 static void row4_avx2(const struct rows_q8 *x, int r, const uint8_t *weights, const uint16_t *scales,
                           int nb, __m256 acc[2]) {
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int g = 0; g < x->groups; g++) {
        long at = (long)nb * x->groups + g, row = (long)r * x->k + 32 * g, rg = (long)r * x->groups + g;
        const int32_t *hi = (const int32_t *)(x->hi + row), *lo = (const int32_t *)(x->lo + row);
        prefetch_ahead(weights + (at + PREFETCH_GROUPS) * 256, 256, scales + (at + PREFETCH_GROUPS) * 32);
        for (int h = 0; h < 2; h++) {
            __m256i w[8];
            unpack_half_avx2(weights, at, h, w);
            __m256i sums = half_sums_avx2(w, hi, lo);
            __m256 scale = bf16x8_to_ps(scales + at * 32 + 8 * h), low = bf16x8_to_ps(scales + at * 32 + 16 + 8 * h);
            if (h) sum1 = add_sums8(sum1, sums, scale, low, x->scale[rg], x->sum[rg]);
            else sum0 = add_sums8(sum0, sums, scale, low, x->scale[rg], x->sum[rg]);
        }
    }
    acc[0] = sum0, acc[1] = sum1;
}

/* The same for 8-bit weights: widened to 16 bits as they are loaded (block_avx2 widens a group
   once for all its rows). */
AVX2 static void row8_avx2(const struct rows_q8 *x, int r, const uint8_t *weights, const uint16_t *scales,
                           int nb, __m256 acc[2]) {
    int16_t x16[32] __attribute__((aligned(32)));
    __m256 sums[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() };
    for (int g = 0; g < x->groups; g++) {
        long at = (long)nb * x->groups + g, row = (long)r * x->k + 32 * g, rg = (long)r * x->groups + g;
        prefetch_ahead(weights + (at + PREFETCH_GROUPS) * 512, 512, scales + (at + PREFETCH_GROUPS) * 32);
        join_parts(x->hi + row, x->lo + row, x16);
        __m256i s[4] = { _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256() };
        for (int p = 0; p < 8; p++) {
            __m256i xp = _mm256_set1_epi64x(*(const int64_t *)(x16 + 4 * p));
            for (int c = 0; c < 4; c++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(weights + at * 512 + 64 * p + 16 * c));
                s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(_mm256_cvtepu8_epi16(bytes), xp));
            }
        }
        __m256i paired[2];
        pair_up(s, paired);
        add_group_avx2(sums, paired, scales, at, x->scale[rg], x->sum[rg]);
    }
    acc[0] = sums[0], acc[1] = sums[1];
}

/* Round to nearest even as _mm512_cvtneps_pbh does, which also flushes denormals to zero. */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);  /* NaN */
    if ((v.u & 0x7f800000u) == 0) return (uint16_t)((v.u >> 16) & 0x8000u);  /* denormal: signed zero */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* groupwise_matmul on AVX2: the same jobs (16 rows x 2 output blocks), each by one thread. */
AVX2 static int groupwise_matmul_avx2(const struct rows_q8 *q, int m, const uint8_t *weights,
                                      const uint16_t *scales, int n, void *y, int float_out) {
    int output_blocks = n / 16, row_blocks = (m + 15) / 16, pairs = (output_blocks + 1) / 2;
    #pragma omp parallel for schedule(static)
    for (int job = 0; job < row_blocks * pairs; job++) {
        int r0 = job / pairs * 16, nb = job % pairs * 2, both = nb + 1 < output_blocks;
        int rows = m - r0 < 16 ? m - r0 : 16;
        __m256 acc[16][2];
        for (int b = 0; b <= both; b++) {
            for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            if (rows > 1) block_avx2(q, r0, rows, weights, scales, nb + b, acc);
            else if (q->bits == 4) row4_avx2(q, r0, weights, scales, nb + b, acc[0]);
            else row8_avx2(q, r0, weights, scales, nb + b, acc[0]);
            for (int r = 0; r < rows; r++) {
                float out[16];
                long at = (long)(r0 + r) * n + (nb + b) * 16;
                _mm256_storeu_ps(out, acc[r][0]);
                _mm256_storeu_ps(out + 8, acc[r][1]);
                if (float_out) memcpy((float *)y + at, out, sizeof out);
                else for (int i = 0; i < 16; i++) ((uint16_t *)y)[at + i] = float_to_bf16(out[i]);
            }
        }
    }
    return 0;
}

/* The AVX-512 jobs: blocks of 16 rows x 2 blocks of 16 outputs shared out among OpenMP's
   threads (PyTorch's own: see cpu_kernels.py), each computed by one. A block of fewer than
   amx_from_rows rows takes VNNI, the rest AMX: both sum integers exactly, so a row's bits are
   the same either way. */
int amx_from_rows = 1 << 30;  /* no AMX until amx_enable grants it */

AMX static void groupwise_matmul_avx512(const struct rows_q8 *q, int m, const uint8_t *weights,
                                        const uint16_t *scales, int n, void *y, int float_out) {
    int output_blocks = n / 16, row_blocks = (m + 15) / 16;
    int pairs = (output_blocks + 1) / 2;  /* jobs of two output blocks (the last may be one) */
    #pragma omp parallel
    {
        int configured = 0;
        #pragma omp for schedule(static)
        for (int job = 0; job < row_blocks * pairs; job++) {
            int r0 = job / pairs * 16, nb = job % pairs * 2, both = nb + 1 < output_blocks;
            int rows = m - r0 < 16 ? m - r0 : 16;
            __m512 acc[2][16];
            for (int r = 0; r < rows; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
            if (rows < amx_from_rows || !both) {
                for (int b = 0; b <= both; b++) block_vnni(q, r0, rows, weights, scales, nb + b, acc[b]);
            } else {
                if (rows != configured) configure(rows), configured = rows;
                blocks_amx(q, r0, rows, weights, scales, nb, acc[0], acc[1]);
            }
            for (int b = 0; b <= both; b++)
                for (int r = 0; r < rows; r++) {
                    long at = (long)(r0 + r) * n + (nb + b) * 16;
                    if (float_out)
                        _mm512_storeu_ps((float *)y + at, acc[b][r]);
                    else
                        _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), (__m256i)_mm512_cvtneps_pbh(acc[b][r]));
                }
        }
        if (configured) _tile_release();
    }
}

/* y (m, n) = x (m, k) @ W.T, x bfloat16, y bfloat16 or (float_out) float32; k a multiple of
   32, n of 16. On AVX-512 (use_avx512) or AVX2. Returns 0, or -1 for sizes it does not take
   or no memory. */
int groupwise_matmul(const uint16_t *x, int m, int k, const uint8_t *weights, int bits, const uint16_t *scales,
                     int n, void *y, int float_out) {
    if (k % 32 || n % 16 || (bits != 4 && bits != 8)) return -1;
    int groups = k / 32;
    uint8_t *work = malloc(2 * (size_t)m * k + 8 * (size_t)m * groups);  /* x's parts, scales, sums */
    if (!work) return -1;
    float *x_scale = (float *)(work + 2 * (long)m * k), *x_sum = x_scale + (long)m * groups;
    struct rows_q8 q = { (int8_t *)work, (int8_t *)work + (long)m * k, x_scale, x_sum, k, groups, bits };
    for (int r = 0; r < m; r++) {
        int8_t *hi = (int8_t *)q.hi + (long)r * k, *lo = (int8_t *)q.lo + (long)r * k;
        if (use_avx512)
            quantize_row(x + (long)r * k, k, hi, lo, x_scale + (long)r * groups, x_sum + (long)r * groups);
        else
            quantize_row_avx2(x + (long)r * k, k, hi, lo, x_scale + (long)r * groups, x_sum + (long)r * groups);
    }
    if (use_avx512)
        groupwise_matmul_avx512(&q, m, weights, scales, n, y, float_out);
    else
        groupwise_matmul_avx2(&q, m, weights, scales, n, y, float_out);
    free(work);
    return 0;
}
