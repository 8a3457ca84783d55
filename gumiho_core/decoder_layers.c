/* A decoding pass through every layer of an int4 fast decoder in one call.

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
   position, as on the per-layer path. SiLU is computed here (exp16, cpu_kernels.c) where the
   per-layer path calls PyTorch's: the two may differ in a last bit now and then; plain and
   speculative decoding both take this path for their decoding passes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
   norms bfloat16 (dim,); products in groupwise_matmul.c's 4-bit layout with their scales. */
struct layer_weights {
    const uint16_t *attn_norm, *mlp_norm;
    const uint8_t *qkv, *out, *gate_up, *down;
    const uint16_t *qkv_scales, *out_scales, *gate_up_scales, *down_scales;
};

/* The model's shape. */
struct decoder_shape {
    int layers, dim, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
};

/* 8 lanes: one AVX2 register (half an AVX-512 one), so that GCC keeps every step in vector
   instructions on either kind of CPU. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8 widen(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8)(__builtin_convertvector(h, v8u) << 16);
}

/* Round to nearest even (no NaN here: SiLU and sums of finite bfloat16). */
static inline void narrow(uint16_t *p, v8 f) {
    v8u u = (v8u)f;
    v8h h = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, v8h);
    memcpy(p, &h, sizeof h);
}

/* exp(x) for x <= 0, as cpu_kernels.c's exp16 (Cephes' polynomial, a couple of ulps). */
static inline v8 exp_negative(v8 x) {
    v8 low = (v8){0} - 87.0f;
    x = (v8)(((v8i)low & (x < low)) | ((v8i)x & ~(x < low)));
    v8i n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i);
    v8 nf = __builtin_convertvector(n, v8);
    v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8 p = (v8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((n + 127) << 23);
}

/* out (n, inter) = bfloat16(bfloat16(SiLU(g)) * u) for gate_up (n, 2 inter) = [g | u], the two
   roundings PyTorch's F.silu(gate) * up makes. SiLU(g) = g / (1 + e^-g), from e = exp(-|g|):
   g / (1 + e) for g >= 0, g e / (1 + e) below. inter a multiple of 16. */
static void silu_times(const uint16_t *gate_up, int n, int inter, uint16_t *out) {
    for (int r = 0; r < n; r++) {
        const uint16_t *g = gate_up + (long)r * 2 * inter, *u = g + inter;
        for (int i = 0; i < inter; i += 8) {
            v8 x = widen(g + i);
            v8i negative = x < (v8){0};
            v8 e = exp_negative((v8)((v8i)x | ((v8i){0} + INT32_MIN)));  /* exp(-|g|): sign bit set */
            v8 numerator = (v8)(((v8i)x & ~negative) | ((v8i)(x * e) & negative));
            uint16_t silu[8];
            narrow(silu, numerator / (1.0f + e));
            narrow(out + (long)r * inter + i, widen(silu) * widen(u + i));
        }
    }
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
    long sizes[] = { s->dim, qkv_width, width, width, 2L * s->intermediate, s->intermediate, s->dim };
    long total = 0;
    for (int i = 0; i < 7; i++) total += sizes[i] * n;
    uint16_t *work = malloc(sizeof(uint16_t) * total);
    if (!work) return -1;
    uint16_t *h = work, *qkv = h + (long)n * s->dim, *q = qkv + (long)n * qkv_width, *attn = q + (long)n * width,
             *gate_up = attn + (long)n * width, *act = gate_up + 2L * n * s->intermediate,
             *mlp = act + (long)n * s->intermediate;
    long layer_size = (long)s->kv_heads * capacity * d;
    int failed = 0;
    for (int i = 0; i < s->layers && !failed; i++) {
        const struct layer_weights *w = layers + i;
        add_rms_norm(x, i ? mlp : NULL, w->attn_norm, n, s->dim, s->eps, h);
        failed |= groupwise_matmul(h, n, s->dim, w->qkv, 4, w->qkv_scales, qkv_width, qkv, 0);
        rotate_and_store(qkv, cos, sin, n, s->heads, s->kv_heads, d, capacity, start, q,
                         keys + i * layer_size, values + i * layer_size);
        failed |= tree_attention(q, width, keys + i * layer_size, values + i * layer_size, capacity, n, s->heads,
                                 s->kv_heads, d, start, ancestors, s->scale, attn);
        failed |= groupwise_matmul(attn, n, width, w->out, 4, w->out_scales, s->dim, h, 0);
        add_rms_norm(x, h, w->mlp_norm, n, s->dim, s->eps, h);  /* reads h into x before writing h */
        failed |= groupwise_matmul(h, n, s->dim, w->gate_up, 4, w->gate_up_scales, 2 * s->intermediate, gate_up, 0);
        silu_times(gate_up, n, s->intermediate, act);
        failed |= groupwise_matmul(act, n, s->intermediate, w->down, 4, w->down_scales, s->dim, mlp, 0);
    }
    if (!failed)  /* the last layer's residual add, rounded as PyTorch's bfloat16 x + mlp */
        for (long i = 0; i < (long)n * s->dim; i += 8) {
            v8 sum = widen(x + i) + widen(mlp + i);
            narrow(x + i, sum);
        }
    free(work);
    return failed ? -1 : 0;
}
