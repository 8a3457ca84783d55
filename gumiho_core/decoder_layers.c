/* A decoding pass through every layer of an int4 fast decoder in one call (and the serial
   draft head's layers, 8-bit: fast_heads.py).

   Built with cpu_kernels.c and groupwise_matmul.c (cpu_kernels.py). Why: the default model's
   one-token pass is ~14 ms on 2 cores and its layers cost ~12 Python-level calls each (the
   kernels below through ctypes, each output allocated by PyTorch, a SiLU, a product and a
   residual add in PyTorch): 30 layers x 12 calls of microseconds each is milliseconds a pass
   spent on no arithmetic. Here a layer is the same kernels called from C, in the same order,
   on the same bits:

     h = RMSNorm(x)                    add_rms_norm (the previous layer's MLP output added first)
     q, k, v = h @ Wqkv                groupwise_matmul (4-bit)
     rotary positions, k / v cached    rotate_and_store
     a = tree attention                tree_attention (each row alone: row-count invariant)
     x += a @ Wo; h = RMSNorm(x)       groupwise_matmul, add_rms_norm
     g, u = h @ Wgate_up               groupwise_matmul
     m = (SiLU(g) * u) @ Wdown         silu_times, groupwise_matmul; x += m at the next layer

   Every step computes a row alone, so a tree row's bits are the one-token pass's at its
   position, as on the per-layer path. SiLU is computed here (exp8_negative, vector8.h) where the
   per-layer path calls PyTorch's: the two may differ in a last bit now and then; plain and
   speculative decoding both take this path for their decoding passes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector8.h"

int groupwise_matmul(const uint16_t *x, int m, int k, const uint8_t *weights, int bits, const uint16_t *scales,
                     int n, void *y, int float_out);
int tree_attention(const uint16_t *q, long q_row_stride, const uint16_t *keys, const uint16_t *values,
                   long capacity, int n, int heads, int kv_heads, int d, int start,
                   const uint8_t *ancestors, float scale, uint16_t *out);
void add_rms_norm(uint16_t *x, const uint16_t *y, const uint16_t *weight, int n, int dim, float eps,
                  uint16_t *out);
void rotate_and_store(const uint16_t *qkv, const float *cos, const float *sin, int n, int heads,
                      int kv_heads, int d, long capacity, int start, uint16_t *q_out, uint16_t *keys,
                      uint16_t *values);

/* One layer's weights as the fast decoder holds them (cpu_kernels.LayerWeights mirrors it):
   norms bfloat16 (dim,), attn_norm NULL for a layer that reads its input as it is (the draft
   heads' first: fc's output); products in groupwise_matmul.c's layout with their scales. */
struct layer_weights {
    const uint16_t *attn_norm, *mlp_norm;
    const uint8_t *qkv, *out, *gate_up, *down;
    const uint16_t *qkv_scales, *out_scales, *gate_up_scales, *down_scales;
};

/* The model's shape. */
struct decoder_shape {
    int layers, dim, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int bits;  /* the products' weights: 4 (the target) or 8 (the draft heads) */
};

/* out (n, inter) = bfloat16(bfloat16(SiLU(g)) * u) for gate_up (n, 2 inter) = [g | u], the two
   roundings PyTorch's F.silu(gate) * up makes. SiLU(g) = g / (1 + e^-g), from e = exp(-|g|):
   g / (1 + e) for g >= 0, g e / (1 + e) below. inter a multiple of 8. */
static void silu_times(const uint16_t *gate_up, int n, int inter, uint16_t *out) {
    for (int r = 0; r < n; r++) {
        const uint16_t *g = gate_up + (long)r * 2 * inter, *u = g + inter;
        for (int i = 0; i < inter; i += 8) {
            v8 x = widen8(g + i);
            v8i negative = x < (v8){0};
            v8 e = exp8_negative((v8)((v8i)x | ((v8i){0} + INT32_MIN)));  /* exp(-|g|): sign bit set */
            v8 numerator = (v8)(((v8i)x & ~negative) | ((v8i)(x * e) & negative));
            uint16_t silu[8];
            narrow8(silu, numerator / (1.0f + e));
            narrow8(out + (long)r * inter + i, widen8(silu) * widen8(u + i));
        }
    }
}

/* add_rms_norm, or for a layer without an input norm (weight NULL) the residual add alone
   with out a copy of x. */
static void add_then_norm(uint16_t *x, const uint16_t *y, const uint16_t *weight, int n, int dim, float eps,
                          uint16_t *out) {
    if (weight) {
        add_rms_norm(x, y, weight, n, dim, eps, out);
        return;
    }
    if (y)
        for (long i = 0; i < (long)n * dim; i += 8) {
            v8 sum = widen8(x + i) + widen8(y + i);
            narrow8(x + i, sum);
        }
    memcpy(out, x, sizeof(uint16_t) * n * dim);
}

/* The next `count` values of a scratch buffer. */
static inline uint16_t *carve(uint16_t **next, long count) {
    uint16_t *start = *next;
    *next += count;
    return start;
}

/* x (n, dim) bfloat16, the rows' embeddings, becomes the last layer's output (before the final
   norm). cos / sin (n, head_dim) float32; keys / values the whole cache (layers, kv_heads,
   capacity, head_dim) bfloat16, the new rows written at slots start .. start + n; ancestors
   (n, n) uint8 as tree_attention takes them. Returns 0, or -1 (sizes the kernels refuse, no
   memory). */
int decoder_layers(const struct layer_weights *layers, const struct decoder_shape *s, uint16_t *x, int n,
                   const float *cos, const float *sin, uint16_t *keys, uint16_t *values, long capacity,
                   int start, const uint8_t *ancestors) {
    if (s->intermediate % 16 || s->dim % 16) return -1;
    int d = s->head_dim, width = s->heads * d, qkv_width = (s->heads + 2 * s->kv_heads) * d;
    /* Scratch rows: h and mlp (dim each), qkv, q and attn (width each), gate_up and act. */
    uint16_t *work = malloc(sizeof(uint16_t) * n * (2L * s->dim + qkv_width + 2L * width + 3L * s->intermediate));
    if (!work) return -1;
    uint16_t *next = work;
    uint16_t *h = carve(&next, (long)n * s->dim), *mlp = carve(&next, (long)n * s->dim);
    uint16_t *qkv = carve(&next, (long)n * qkv_width), *q = carve(&next, (long)n * width);
    uint16_t *attn = carve(&next, (long)n * width), *gate_up = carve(&next, 2L * n * s->intermediate);
    uint16_t *act = carve(&next, (long)n * s->intermediate);
    long layer_size = (long)s->kv_heads * capacity * d;
    int failed = 0;
    for (int i = 0; i < s->layers && !failed; i++) {
        const struct layer_weights *w = layers + i;
        add_then_norm(x, i ? mlp : NULL, w->attn_norm, n, s->dim, s->eps, h);
        failed |= groupwise_matmul(h, n, s->dim, w->qkv, s->bits, w->qkv_scales, qkv_width, qkv, 0);
        rotate_and_store(qkv, cos, sin, n, s->heads, s->kv_heads, d, capacity, start, q,
                         keys + i * layer_size, values + i * layer_size);
        failed |= tree_attention(q, width, keys + i * layer_size, values + i * layer_size, capacity, n, s->heads,
                                 s->kv_heads, d, start, ancestors, s->scale, attn);
        failed |= groupwise_matmul(attn, n, width, w->out, s->bits, w->out_scales, s->dim, h, 0);
        add_rms_norm(x, h, w->mlp_norm, n, s->dim, s->eps, h);  /* reads h into x before writing h */
        failed |= groupwise_matmul(h, n, s->dim, w->gate_up, s->bits, w->gate_up_scales, 2 * s->intermediate, gate_up, 0);
        silu_times(gate_up, n, s->intermediate, act);
        failed |= groupwise_matmul(act, n, s->intermediate, w->down, s->bits, w->down_scales, s->dim, mlp, 0);
    }
    if (!failed)  /* the last layer's residual add, rounded as PyTorch's bfloat16 x + mlp */
        for (long i = 0; i < (long)n * s->dim; i += 8) {
            v8 sum = widen8(x + i) + widen8(mlp + i);
            narrow8(x + i, sum);
        }
    free(work);
    return failed ? -1 : 0;
}

/* A whole decoding pass of the target in one call: what FastDecoder.forward did around
   decoder_layers in PyTorch (the rows' embeddings, their rotary rows, the final norm) is done
   here. Each of those small PyTorch ops ran right after a pass had streamed the weights
   through the caches, cold: ~0.3 ms a one-token pass on the AVX2 EPYC, ~4% of it.

   tokens and positions (n,) int64; embedding (vocab, dim) float32, or bfloat16 where
   embedding_bf16 (rounded to bfloat16 here as PyTorch's .to rounds); cos_table / sin_table
   (positions, head_dim) float32, a row per position (RotaryTable); norm (dim,) bfloat16;
   out (n, dim) bfloat16, the final norm's output. The rest as decoder_layers. A token outside
   the vocabulary or a position outside the tables is refused (-1), as PyTorch's indexing would. */
int decoder_pass(const struct layer_weights *layers, const struct decoder_shape *s, const int64_t *tokens,
                 const void *embedding, int embedding_bf16, long vocab, int n, const float *cos_table,
                 const float *sin_table, long table_rows, const int64_t *positions, uint16_t *keys,
                 uint16_t *values, long capacity, int start, const uint8_t *ancestors, const uint16_t *norm,
                 uint16_t *out) {
    int d = s->head_dim;
    if (s->dim % 8) return -1;
    for (int r = 0; r < n; r++)
        if (tokens[r] < 0 || tokens[r] >= vocab || positions[r] < 0 || positions[r] >= table_rows) return -1;
    uint16_t *x = malloc(sizeof(uint16_t) * n * s->dim);
    float *cos = malloc(sizeof(float) * 2L * n * d);
    if (!x || !cos) {
        free(x);
        free(cos);
        return -1;
    }
    float *sin = cos + (long)n * d;
    for (int r = 0; r < n; r++) {
        uint16_t *row = x + (long)r * s->dim;
        if (embedding_bf16) {
            memcpy(row, (const uint16_t *)embedding + tokens[r] * s->dim, sizeof(uint16_t) * s->dim);
        } else {
            const float *e = (const float *)embedding + tokens[r] * s->dim;
            for (int i = 0; i < s->dim; i += 8) {
                v8 f;
                memcpy(&f, e + i, sizeof f);
                narrow8(row + i, f);
            }
        }
        memcpy(cos + (long)r * d, cos_table + positions[r] * d, sizeof(float) * d);
        memcpy(sin + (long)r * d, sin_table + positions[r] * d, sizeof(float) * d);
    }
    int failed = decoder_layers(layers, s, x, n, cos, sin, keys, values, capacity, start, ancestors);
    if (!failed) add_rms_norm(x, NULL, norm, n, s->dim, s->eps, out);
    free(x);
    free(cos);
    return failed;
}
