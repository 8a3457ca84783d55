/* 4-bit weight-only products on Intel AMX: y = x @ W.T for W in groups of 32 inputs, each
   group w = q * scale + low (q in 0..15), x and y bfloat16. Built with cpu_kernels.c.

   Why: PyTorch's int4 CPU kernel converts the weights to float for every 4 rows of x, so a
   pass over 11 tree rows cost 3.8x a one-token pass (SmolLM2-135M, 2 cores) and trees barely
   paid. Here each 16 x 32 block of weights is turned into bfloat16 once and multiplied with
   up to 16 rows at a time by one AMX instruction: more rows cost almost nothing more.

   Every output element is the same sum in the same order whatever the number of rows: AMX
   computes each row of a tile alone, and the blocks are accumulated in input order (tested).

   Weight layout, chosen at load (quantize.py): for each block of 16 outputs and each group,
   the 16 x 32 tile AMX reads (row p holds, for outputs 0..15, inputs 2p and 2p + 1 side by
   side) as 16 rows of 16 bytes: byte i holds element i in its low nibble and element i + 16
   in its high one. Scales and lows: bfloat16, (output blocks, groups, 2, 16). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

/* Linux hands out AMX's tile state only to a process that asks. 0 when granted. */
int amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tile 0: the output block (rows x 16 floats); 1: x's rows at one group (rows x 32 bf16);
   2: one weight block in bfloat16 (16 x 32). */
AMX static void configure(int rows) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = rows, config.colsb[0] = 64;
    config.rows[1] = rows, config.colsb[1] = 64;
    config.rows[2] = 16, config.colsb[2] = 64;
    config.rows[3] = 16, config.colsb[3] = 64;
    _tile_loadconfig(&config);
}

AMX static inline __m512 bf16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One 16 x 32 weight block in bfloat16, in the tile's pair layout, into `tile` (1 KB). */
AMX static void unpack_block(const uint8_t *nibbles, const uint16_t *scale_and_low, uint16_t *tile) {
    __m512 scale = bf16_to_ps(_mm256_loadu_si256((const __m256i *)scale_and_low));
    __m512 low = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(scale_and_low + 16)));
    /* element j of a row is output j / 2: the first 16 elements are outputs 0..7, the next 8..15 */
    __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    __m512 scale_a = _mm512_permutexvar_ps(first, scale), scale_b = _mm512_permutexvar_ps(second, scale);
    __m512 low_a = _mm512_permutexvar_ps(first, low), low_b = _mm512_permutexvar_ps(second, low);
    __m512i mask = _mm512_set1_epi32(15);
    for (int p = 0; p < 16; p++) {
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nibbles + 16 * p)));
        __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, mask)), scale_a, low_a);
        __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), scale_b, low_b);
        _mm512_storeu_si512((void *)(tile + 32 * p), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

/* y (m, n) = x (m, k) @ W.T, all bfloat16; k a multiple of 32, n of 16. Blocks of 16 rows x 16
   outputs are shared out among OpenMP's threads (PyTorch's own, where linked with it); each
   block is computed by one thread, in one order. */
AMX int int4_matmul(const uint16_t *x, int m, int k, const uint8_t *weights, const uint16_t *scales, int n,
                    uint16_t *y) {
    if (k % 32 || n % 16) return -1;
    int groups = k / 32, output_blocks = n / 16, row_blocks = (m + 15) / 16;
    #pragma omp parallel
    {
        uint16_t tile[2][16 * 32] __attribute__((aligned(64)));
        float block[16 * 16] __attribute__((aligned(64)));
        int configured = 0;
        #pragma omp for schedule(static)
        for (int job = 0; job < row_blocks * output_blocks; job++) {
            int r0 = job / output_blocks * 16, nb = job % output_blocks;
            int rows = m - r0 < 16 ? m - r0 : 16;
            if (rows != configured) configure(rows), configured = rows;
            _tile_zero(0);
            /* Two weight buffers and tiles in turn: unpacking one block overlaps the product
               of the one before. Groups are still added in input order. */
            const uint8_t *w = weights + (long)nb * groups * 256;
            const uint16_t *s = scales + (long)nb * groups * 32, *a = x + (long)r0 * k;
            int g = 0;
            for (; g + 1 < groups; g += 2) {
                unpack_block(w + g * 256, s + g * 32, tile[0]);
                unpack_block(w + (g + 1) * 256, s + (g + 1) * 32, tile[1]);
                _tile_loadd(2, tile[0], 64);
                _tile_loadd(1, a + g * 32, k * 2);
                _tile_dpbf16ps(0, 1, 2);
                _tile_loadd(3, tile[1], 64);
                _tile_loadd(1, a + (g + 1) * 32, k * 2);
                _tile_dpbf16ps(0, 1, 3);
            }
            if (g < groups) {
                unpack_block(w + g * 256, s + g * 32, tile[0]);
                _tile_loadd(2, tile[0], 64);
                _tile_loadd(1, a + g * 32, k * 2);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, block, 64);
            for (int r = 0; r < rows; r++) {
                __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(block + 16 * r));
                _mm256_storeu_si256((__m256i *)(y + (long)(r0 + r) * n + nb * 16), out);
            }
        }
        if (configured) _tile_release();
    }
    return 0;
}
