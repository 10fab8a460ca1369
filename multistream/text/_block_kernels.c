// Block-quantized matrix products for a CPU: weights in blocks of 32 (GGUF's Q4_1 and Q8_0
// formats, fp16 scales), activations quantized per block of 32 to int8 at each call (GGUF's Q8_1), products
// summed in int32 per block. It is llama.cpp's arithmetic, kept plain: one file, no torch headers,
// built by multistream at first use (multistream/text/_native.py).
//
// Every output element is computed by one thread in a fixed order, from its row's activations
// only: row i of a batch equals the row alone, bit for bit, whatever the batch or thread count.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define BLOCK 32

// Weight scales are fp16, as in GGUF files (half the bytes of fp32 to read at each token).
static inline float half(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {  // subnormal: normalise
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        float scale = amax / 127.0f;
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            int v = (int)nearbyintf(xb[j] * inv);
            q[b * BLOCK + j] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
}

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// A Q4_1 block's 16 bytes as 32 values 0..15, in order (byte j: value j low, value j + 16 high).
static inline __m256i nibbles(const uint8_t *packed16) {
    __m128i packed = _mm_loadu_si128((const __m128i *)packed16);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

// Sum of 32 products u4 x s8 as 8 partial sums in float (maddubs: unsigned times signed).
static inline __m256 block_sum_u4(__m256i nib, __m256i a) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(nib, a), _mm256_set1_epi16(1)));
}

// Sum of 32 products s8 x s8: |w| times a with w's sign (maddubs takes its first operand unsigned).
static inline __m256 block_sum_s8(__m256i w, __m256i a) {
    __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
}
#endif

// One Q4_1 weight row (nibbles: byte j holds element j low and j + 16 high; dm: scale, min per
// block) times one quantized activation row.
static inline float dot_q4(const uint8_t *w, const uint16_t *dm, const int8_t *q, const float *d, const float *s,
                           int64_t blocks) {
#ifdef __AVX2__
    // One accumulator: two (even and odd blocks) measured no faster here; four rows at once do help
    // (dot_q4_group).
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(q + b * BLOCK));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(dm[2 * b]) * d[b]), block_sum_u4(nibbles(w + b * 16), a), acc);
        mins += half(dm[2 * b + 1]) * s[b];
    }
    return hsum256(acc) + mins;
#else
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) {
            sum += (w[b * 16 + j] & 0x0F) * q[b * BLOCK + j];
            sum += (w[b * 16 + j] >> 4) * q[b * BLOCK + j + 16];
        }
        total += half(dm[2 * b]) * d[b] * (float)sum + half(dm[2 * b + 1]) * s[b];
    }
    return total;
#endif
}

// One Q8_0 weight row (int8 values, a scale per block) times one quantized activation row.
static inline float dot_q8(const int8_t *w, const uint16_t *dw, const int8_t *q, const float *d, int64_t blocks) {
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * BLOCK));
        __m256i a = _mm256_loadu_si256((const __m256i *)(q + b * BLOCK));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half(dw[b]) * d[b]), block_sum_s8(wv, a), acc);
    }
    return hsum256(acc);
#else
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) sum += w[b * BLOCK + j] * q[b * BLOCK + j];
        total += half(dw[b]) * d[b] * (float)sum;
    }
    return total;
#endif
}

// Four activation rows against one weight row: the weights are unpacked once for the four. Each
// row's arithmetic is dot_q4's / dot_q8's, op for op, so a row's result does not depend on whether
// it was computed in a group of four or alone (a stream in a batch equals it alone).
#define GROUP 4

static inline void dot_q4_group(const uint8_t *w, const uint16_t *dm, const int8_t *q, const float *d,
                                const float *s, int64_t k, int64_t blocks, float *out) {
#ifdef __AVX2__
    __m256 acc[GROUP];
    float mins[GROUP];
    for (int r = 0; r < GROUP; r++) {
        acc[r] = _mm256_setzero_ps();
        mins[r] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        __m256i nib = nibbles(w + b * 16);
        float scale = half(dm[2 * b]), minimum = half(dm[2 * b + 1]);
        for (int r = 0; r < GROUP; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(q + r * k + b * BLOCK));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale * d[r * blocks + b]), block_sum_u4(nib, a), acc[r]);
            mins[r] += minimum * s[r * blocks + b];
        }
    }
    for (int r = 0; r < GROUP; r++) out[r] = hsum256(acc[r]) + mins[r];
#else
    for (int r = 0; r < GROUP; r++) out[r] = dot_q4(w, dm, q + r * k, d + r * blocks, s + r * blocks, blocks);
#endif
}

static inline void dot_q8_group(const int8_t *w, const uint16_t *dw, const int8_t *q, const float *d, int64_t k,
                                int64_t blocks, float *out) {
#ifdef __AVX2__
    __m256 acc[GROUP];
    for (int r = 0; r < GROUP; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * BLOCK));
        float scale = half(dw[b]);
        for (int r = 0; r < GROUP; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(q + r * k + b * BLOCK));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale * d[r * blocks + b]), block_sum_s8(wv, a), acc[r]);
        }
    }
    for (int r = 0; r < GROUP; r++) out[r] = hsum256(acc[r]);
#else
    for (int r = 0; r < GROUP; r++) out[r] = dot_q8(w, dw, q + r * k, d + r * blocks, blocks);
#endif
}

// Rows of output computed per task: a tile of weights stays in L1 while every activation row reads it.
#define TILE 8

// y[m, n] = x[m, :] . W[n, :] (+ bias[n]), W in Q4_1 (kind 4) or Q8_0 (kind 8).
static int matmul(int kind, const float *x, const void *w, const uint16_t *scales, const float *bias, float *y,
                  int64_t m, int64_t k, int64_t n, int threads) {
    if (k % BLOCK) return -1;
    const int64_t blocks = k / BLOCK;
    // The activations, quantized once per call (a few KB while decoding).
    int8_t *q = (int8_t *)malloc((size_t)(m * k));
    float *d = (float *)malloc(sizeof(float) * (size_t)(2 * m * blocks));
    if (!q || !d) {
        free(q);
        free(d);
        return -2;
    }
    float *s = d + m * blocks;
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1 && threads > 1)
    for (int64_t i = 0; i < m; i++) quantize_row(x + i * k, k, q + i * k, d + i * blocks, s + i * blocks);
    const int64_t tiles = (n + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t end = (t + 1) * TILE < n ? (t + 1) * TILE : n;
        for (int64_t j = t * TILE; j < end; j++) {
            const uint8_t *w4 = (const uint8_t *)w + j * (k / 2);
            const int8_t *w8 = (const int8_t *)w + j * k;
            const uint16_t *sj = scales + j * blocks * (kind == 4 ? 2 : 1);
            int64_t i = 0;
            for (; i + GROUP <= m; i += GROUP) {
                float v[GROUP];
                if (kind == 4)
                    dot_q4_group(w4, sj, q + i * k, d + i * blocks, s + i * blocks, k, blocks, v);
                else
                    dot_q8_group(w8, sj, q + i * k, d + i * blocks, k, blocks, v);
                for (int r = 0; r < GROUP; r++) y[(i + r) * n + j] = bias ? v[r] + bias[j] : v[r];
            }
            for (; i < m; i++) {
                float v = kind == 4 ? dot_q4(w4, sj, q + i * k, d + i * blocks, s + i * blocks, blocks)
                                    : dot_q8(w8, sj, q + i * k, d + i * blocks, blocks);
                y[i * n + j] = bias ? v + bias[j] : v;
            }
        }
    }
    free(q);
    free(d);
    return 0;
}

int ms_matmul_q4(const float *x, const uint8_t *w, const uint16_t *dm, const float *bias, float *y, int64_t m,
                 int64_t k, int64_t n, int threads) {
    return matmul(4, x, w, dm, bias, y, m, k, n, threads);
}

int ms_matmul_q8(const float *x, const int8_t *w, const uint16_t *d, const float *bias, float *y, int64_t m,
                 int64_t k, int64_t n, int threads) {
    return matmul(8, x, w, d, bias, y, m, k, n, threads);
}

// Which instruction set this build uses (for the log line and the tests).
const char *ms_kernel_isa(void) {
#ifdef __AVX2__
    return "avx2";
#else
    return "portable C";
#endif
}

// -- a Llama decoder layer for one new token per row -------------------------------------------
//
// The layer in two calls around the KV cache's append (which the caller does, in its own cache):
// ms_layer_qkv (norm, q/k/v projections, rotary embedding), then ms_layer_rest (attention on each
// row's columns, output projection, residual, norm, gated MLP, residual). transformers' own forward
// of a layer calls the same two functions (multistream/text/_native_layers.py), so the engine's
// stream and the model's generate() compute the same numbers.

typedef struct {
    const void *w;      // Q4_1 packed weights (uint8 [n, k / 2]) or Q8_0 (int8 [n, k])
    const uint16_t *s;  // their scales (fp16)
    int64_t n, k;
    int kind;           // 4 or 8
} qmat;

static void rms_norm(const float *x, const float *w, float eps, float *y, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = w[i] * (xr[i] * inv);
    }
}

static int qmatmul(const qmat *m, const float *x, float *y, int64_t rows, int threads) {
    return matmul(m->kind, x, m->w, m->s, NULL, y, rows, m->k, m->n, threads);
}

// rotate_half convention (transformers' apply_rotary_pos_emb): y = x * cos + rotate_half(x) * sin.
static void rotary(const float *x, const float *cos, const float *sin, float *y, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < dim; i++) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// x [rows, hidden] -> q [rows, heads, dim], k and v [rows, kv_heads, dim]; cos, sin [rows, dim].
int ms_layer_qkv(const float *x, int64_t rows, int64_t hidden, const float *norm_w, float eps,
                 const void *qkv_w, const uint16_t *qkv_s, int qkv_kind, const float *cos, const float *sin,
                 int64_t heads, int64_t kv_heads, int64_t dim, float *q, float *k, float *v, int threads) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
    float *normed = (float *)malloc(sizeof(float) * (size_t)(rows * (hidden + width)));
    if (!normed) return -2;
    float *qkv = normed + rows * hidden;
    rms_norm(x, norm_w, eps, normed, rows, hidden);
    qmat m = {qkv_w, qkv_s, width, hidden, qkv_kind};
    int status = qmatmul(&m, normed, qkv, rows, threads);
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++) {
            const float *row = qkv + r * width;
            for (int64_t h = 0; h < heads; h++)
                rotary(row + h * dim, cos + r * dim, sin + r * dim, q + (r * heads + h) * dim, dim);
            for (int64_t h = 0; h < kv_heads; h++) {
                rotary(row + (heads + h) * dim, cos + r * dim, sin + r * dim, k + (r * kv_heads + h) * dim, dim);
                memcpy(v + (r * kv_heads + h) * dim, row + (heads + kv_heads + h) * dim, sizeof(float) * (size_t)dim);
            }
        }
    }
    free(normed);
    return status;
}

// One query per row and head against the row's columns [start, columns) of its KV heads.
static void attend(const float *q, const float *keys, const float *values, const int64_t *ks, const int64_t *vs,
                   int64_t columns, const int64_t *starts, float scaling, int64_t rows, int64_t heads,
                   int64_t kv_heads, int64_t dim, float *out, int threads) {
    const int64_t group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * heads > 1)
    for (int64_t task = 0; task < rows * heads; task++) {
        int64_t r = task / heads, h = task % heads, g = h / group;
        const float *qr = q + (r * heads + h) * dim;
        const float *kr = keys + r * ks[0] + g * ks[1];
        const float *vr = values + r * vs[0] + g * vs[1];
        int64_t first = starts ? starts[r] : 0;
        int64_t n = columns - first;
        float *scores = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
        float *o = out + (r * heads + h) * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
        if (!scores || n <= 0) {
            free(scores);
            continue;
        }
        float top = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            const float *kj = kr + (first + j) * ks[2];
            float dot = 0.0f;
            for (int64_t i = 0; i < dim; i++) dot += qr[i] * kj[i];
            scores[j] = dot * scaling;
            top = scores[j] > top ? scores[j] : top;
        }
        float total = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            scores[j] = expf(scores[j] - top);
            total += scores[j];
        }
        float inv = 1.0f / total;
        for (int64_t j = 0; j < n; j++) {
            const float *vj = vr + (first + j) * vs[2];
            float p = scores[j] * inv;
            for (int64_t i = 0; i < dim; i++) o[i] += p * vj[i];
        }
        free(scores);
    }
}

// The rest of the layer: out = h + down(silu(gate) * up) with h = x + o_proj(attention), the MLP
// reading norm2(h). keys/values: [rows, kv_heads, columns, dim] with strides ks/vs (elements, the
// last dimension contiguous); starts: each row's first real column (NULL: all from 0).
int ms_layer_rest(const float *x, const float *q, int64_t rows, int64_t hidden, const float *keys,
                  const float *values, const int64_t *ks, const int64_t *vs, int64_t columns, const int64_t *starts,
                  float scaling, int64_t heads, int64_t kv_heads, int64_t dim, const void *o_w, const uint16_t *o_s,
                  int o_kind, const float *norm_w, float eps, const void *gu_w, const uint16_t *gu_s, int gu_kind,
                  const void *down_w, const uint16_t *down_s, int down_kind, int64_t intermediate, float *out,
                  int threads) {
    const int64_t width = heads * dim;
    size_t floats = (size_t)(rows * (width + 2 * hidden + 3 * intermediate));
    float *attn = (float *)malloc(sizeof(float) * floats);
    if (!attn) return -2;
    float *h = attn + rows * width, *normed = h + rows * hidden, *gu = normed + rows * hidden;
    float *act = gu + rows * 2 * intermediate;
    attend(q, keys, values, ks, vs, columns, starts, scaling, rows, heads, kv_heads, dim, attn, threads);
    qmat o = {o_w, o_s, hidden, width, o_kind};
    qmat gate_up = {gu_w, gu_s, 2 * intermediate, hidden, gu_kind};
    qmat down = {down_w, down_s, hidden, intermediate, down_kind};
    int status = qmatmul(&o, attn, h, rows, threads);
    if (status == 0) {
        for (int64_t i = 0; i < rows * hidden; i++) h[i] += x[i];
        rms_norm(h, norm_w, eps, normed, rows, hidden);
        status = qmatmul(&gate_up, normed, gu, rows, threads);
    }
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++) {
            const float *g = gu + r * 2 * intermediate, *u = g + intermediate;
            for (int64_t i = 0; i < intermediate; i++) act[r * intermediate + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        status = qmatmul(&down, act, out, rows, threads);
    }
    if (status == 0)
        for (int64_t i = 0; i < rows * hidden; i++) out[i] += h[i];
    free(attn);
    return status;
}

// The whole layer in one call, for a caller that owns its KV buffers (the engine's fast step):
// ms_layer_qkv, the new k and v written at column `length` of kbuf/vbuf (strides ks/vs, elements),
// then ms_layer_rest on columns [start, length]. The same arithmetic as the two calls.
int ms_layer_decode(const float *x, int64_t rows, int64_t hidden, const float *norm1_w, float eps1,
                    const void *qkv_w, const uint16_t *qkv_s, int qkv_kind, const float *cos, const float *sin,
                    int64_t heads, int64_t kv_heads, int64_t dim, float *kbuf, float *vbuf, const int64_t *ks,
                    const int64_t *vs, int64_t length, const int64_t *starts, float scaling, const void *o_w,
                    const uint16_t *o_s, int o_kind, const float *norm2_w, float eps2, const void *gu_w,
                    const uint16_t *gu_s, int gu_kind, const void *down_w, const uint16_t *down_s, int down_kind,
                    int64_t intermediate, float *out, int threads) {
    float *q = (float *)malloc(sizeof(float) * (size_t)(rows * (heads + 2 * kv_heads) * dim));
    if (!q) return -2;
    float *k = q + rows * heads * dim, *v = k + rows * kv_heads * dim;
    int status = ms_layer_qkv(x, rows, hidden, norm1_w, eps1, qkv_w, qkv_s, qkv_kind, cos, sin, heads, kv_heads,
                              dim, q, k, v, threads);
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < kv_heads; h++) {
                memcpy(kbuf + r * ks[0] + h * ks[1] + length * ks[2], k + (r * kv_heads + h) * dim,
                       sizeof(float) * (size_t)dim);
                memcpy(vbuf + r * vs[0] + h * vs[1] + length * vs[2], v + (r * kv_heads + h) * dim,
                       sizeof(float) * (size_t)dim);
            }
        status = ms_layer_rest(x, q, rows, hidden, kbuf, vbuf, ks, vs, length + 1, starts, scaling, heads, kv_heads,
                               dim, o_w, o_s, o_kind, norm2_w, eps2, gu_w, gu_s, gu_kind, down_w, down_s, down_kind,
                               intermediate, out, threads);
    }
    free(q);
    return status;
}

// Several layers in one call (the engine's fast step between two of its prefill points): each
// layer as ms_layer_decode, hidden states in place in x.
typedef struct {
    const float *norm1_w, *norm2_w;
    const void *qkv_w, *o_w, *gu_w, *down_w;
    const uint16_t *qkv_s, *o_s, *gu_s, *down_s;
    float *kbuf, *vbuf;
    int64_t ks[3], vs[3];
    float eps1, eps2;
    int32_t qkv_kind, o_kind, gu_kind, down_kind;
} ms_layer;

int ms_layers_decode(const ms_layer *layers, int64_t count, float *x, int64_t rows, int64_t hidden,
                     const float *cos, const float *sin, int64_t heads, int64_t kv_heads, int64_t dim,
                     int64_t intermediate, float scaling, int64_t length, const int64_t *starts, int threads) {
    float *out = (float *)malloc(sizeof(float) * (size_t)(rows * hidden));
    if (!out) return -2;
    int status = 0;
    for (int64_t i = 0; i < count && status == 0; i++) {
        const ms_layer *l = layers + i;
        status = ms_layer_decode(x, rows, hidden, l->norm1_w, l->eps1, l->qkv_w, l->qkv_s, l->qkv_kind, cos, sin,
                                 heads, kv_heads, dim, l->kbuf, l->vbuf, l->ks, l->vs, length, starts, scaling,
                                 l->o_w, l->o_s, l->o_kind, l->norm2_w, l->eps2, l->gu_w, l->gu_s, l->gu_kind,
                                 l->down_w, l->down_s, l->down_kind, intermediate, out, threads);
        if (status == 0) memcpy(x, out, sizeof(float) * (size_t)(rows * hidden));
    }
    free(out);
    return status;
}
