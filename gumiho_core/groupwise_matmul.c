/* Weight-only products with 4- or 8-bit weights in groups of 32 inputs, on AVX512-VNNI and
   Intel AMX: y = x @ W.T, each group w = q * scale + low (q in 0..15 or 0..255), x and y
   bfloat16. Built with cpu_kernels.c (cpu_kernels.py).

   Why: PyTorch's int4 CPU kernel converts the weights to float for every 4 rows of x, so a
   pass over 11 tree rows cost 3.8x a one-token pass (SmolLM2-135M, 2 cores) and trees barely
   paid. Here the weights go to the CPU's integer dot-product units as bytes: VNNI for a few
   rows, AMX (one instruction: a group of 16 outputs with up to 16 rows) for many. x is
   quantized for it, as llama.cpp does (Q4_1 x Q8_1): each row's group of 32 becomes int8 with
   its own scale (round(x / s), s = max |x| / 127), and
   sum(w * x) = scale * s * sum(q * xq) + low * sum(x), the last sum taken from x itself.

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
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

extern int amx_from_rows;

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

/* Tile 0: one group's int32 sums (rows x 16 outputs); 1: the rows' quantized group (rows x 32
   int8); 2: the weights' group (32 inputs x 16 outputs, as 8 rows of 64 bytes). */
AMX static void configure(int rows) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = rows, config.colsb[0] = 64;
    config.rows[1] = rows, config.colsb[1] = 32;
    config.rows[2] = 8, config.colsb[2] = 64;
    config.rows[3] = rows, config.colsb[3] = 64;  /* tiles 3 and 4: a second output block */
    config.rows[4] = 8, config.colsb[4] = 64;
    _tile_loadconfig(&config);
}

AMX static inline __m512 bf16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One row of x (k bfloat16) as int8 groups of 32: quantized values (rounded to nearest
   even), each group's scale and the sum of its unquantized values. */
AMX static void quantize_row(const uint16_t *x, int k, int8_t *q, float *scale, float *sum) {
    __m512 sign = _mm512_set1_ps(-0.0f);
    for (int g = 0; g < k / 32; g++) {
        __m512 a = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(x + 32 * g)));
        __m512 b = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(x + 32 * g + 16)));
        float biggest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        float lanes[16];
        _mm512_storeu_ps(lanes, _mm512_add_ps(a, b));
        float total = 0.0f;  /* the 16 lane sums in a fixed order */
        for (int i = 0; i < 16; i++) total += lanes[i];
        __m512 inverse = _mm512_set1_ps(biggest > 0 ? 127.0f / biggest : 0.0f);
        _mm_storeu_si128((__m128i *)(q + 32 * g), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inverse))));
        _mm_storeu_si128((__m128i *)(q + 32 * g + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inverse))));
        scale[g] = biggest / 127.0f, sum[g] = total;
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

/* A group's exact int32 sums (16 outputs of one row) into the row's float sums: the one
   place the float arithmetic happens, whichever unit computed the integers. */
AMX static inline __m512 add_group(__m512 acc, __m512i sums, __m512 scale, __m512 low, float x_scale,
                                   float x_sum) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(x_scale)), acc);
    return _mm512_fmadd_ps(low, _mm512_set1_ps(x_sum), acc);
}

/* The quantized rows, their groups' scales and sums. */
struct rows_q8 {
    const int8_t *q;
    const float *scale, *sum;
    int k, groups, bits;  /* bits: of the weights, 4 or 8 */
};

/* 16 outputs (block nb) of `rows` rows from r0, with AVX512-VNNI: the few-row passes. */
AMX static void block_vnni(const struct rows_q8 *x, int r0, int rows, const uint8_t *weights,
                           const uint16_t *scales, int nb, __m512 *acc) {
    for (int g = 0; g < x->groups; g++) {
        long at = (long)nb * x->groups + g;
        __m512i w[8];
        unpack_group(weights, x->bits, at, w);
        __m512 scale = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(scales + at * 32)));
        __m512 low = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(scales + at * 32 + 16)));
        for (int r = 0; r < rows; r++) {
            const int32_t *xq = (const int32_t *)(x->q + (long)(r0 + r) * x->k + 32 * g);
            __m512i sums = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) sums = _mm512_dpbusd_epi32(sums, w[p], _mm512_set1_epi32(xq[p]));
            long rg = (long)(r0 + r) * x->groups + g;
            acc[r] = add_group(acc[r], sums, scale, low, x->scale[rg], x->sum[rg]);
        }
    }
}

/* The same with AMX, two blocks of 16 outputs (nb, nb + 1) at once: one tile instruction per
   group and block for up to 16 rows; the two blocks' instructions are independent, so one
   runs while the other's sums are read back. */
AMX static void blocks_amx(const struct rows_q8 *x, int r0, int rows, const uint8_t *weights,
                           const uint16_t *scales, int nb, __m512 *acc, __m512 *acc_next) {
    uint8_t tiles[2][512] __attribute__((aligned(64)));
    int32_t sums[2][16 * 16] __attribute__((aligned(64)));
    for (int g = 0; g < x->groups; g++) {
        long at = (long)nb * x->groups + g, next = at + x->groups;
        __m512i w[8];
        unpack_group(weights, x->bits, at, w);
        for (int p = 0; p < 8; p++) _mm512_store_si512((void *)(tiles[0] + 64 * p), w[p]);
        unpack_group(weights, x->bits, next, w);
        for (int p = 0; p < 8; p++) _mm512_store_si512((void *)(tiles[1] + 64 * p), w[p]);
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, x->q + (long)r0 * x->k + g * 32, x->k);
        _tile_loadd(2, tiles[0], 64);
        _tile_loadd(4, tiles[1], 64);
        _tile_dpbsud(0, 1, 2);
        _tile_dpbsud(3, 1, 4);
        _tile_stored(0, sums[0], 64);
        _tile_stored(3, sums[1], 64);
        for (int b = 0; b < 2; b++) {
            long block = b ? next : at;
            __m512 scale = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(scales + block * 32)));
            __m512 low = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(scales + block * 32 + 16)));
            __m512 *into = b ? acc_next : acc;
            for (int r = 0; r < rows; r++) {
                long rg = (long)(r0 + r) * x->groups + g;
                __m512i row_sums = _mm512_load_si512((const void *)(sums[b] + 16 * r));
                into[r] = add_group(into[r], row_sums, scale, low, x->scale[rg], x->sum[rg]);
            }
        }
    }
}

/* y (m, n) = x (m, k) @ W.T, x and y bfloat16; k a multiple of 32, n of 16. Blocks of 16 rows
   x 16 outputs are shared out among OpenMP's threads (PyTorch's own: see cpu_kernels.py);
   each block is computed by one thread. A block of fewer than AMX_ROWS rows takes VNNI, the
   rest AMX: both sum integers exactly, so a row's bits are the same either way.
   Returns 0, or -1 for sizes it does not take or no memory. */
int amx_from_rows = 1 << 30;  /* no AMX until amx_enable grants it */

AMX int groupwise_matmul(const uint16_t *x, int m, int k, const uint8_t *weights, int bits, const uint16_t *scales,
                    int n, uint16_t *y) {
    if (k % 32 || n % 16 || (bits != 4 && bits != 8)) return -1;
    int groups = k / 32, output_blocks = n / 16, row_blocks = (m + 15) / 16;
    uint8_t *work = malloc((size_t)m * k + 8 * (size_t)m * groups);  /* x quantized, its scales and sums */
    if (!work) return -1;
    struct rows_q8 q = { (int8_t *)work, (float *)(work + (long)m * k), (float *)(work + (long)m * k) + (long)m * groups,
                         k, groups, bits };
    for (int r = 0; r < m; r++)
        quantize_row(x + (long)r * k, k, (int8_t *)q.q + (long)r * k, (float *)q.scale + (long)r * groups,
                     (float *)q.sum + (long)r * groups);
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
                for (int b = 0; b <= both; b++) block_vnni(&q, r0, rows, weights, scales, nb + b, acc[b]);
            } else {
                if (rows != configured) configure(rows), configured = rows;
                blocks_amx(&q, r0, rows, weights, scales, nb, acc[0], acc[1]);
            }
            for (int b = 0; b <= both; b++)
                for (int r = 0; r < rows; r++) {
                    __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[b][r]);
                    _mm256_storeu_si256((__m256i *)(y + (long)(r0 + r) * n + (nb + b) * 16), out);
                }
        }
        if (configured) _tile_release();
    }
    free(work);
    return 0;
}
