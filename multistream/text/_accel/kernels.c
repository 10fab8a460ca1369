// Block-quantized CPU kernels and Llama decoder layers for multistream's text models.
//
// Weights are in blocks of 32 input channels, GGUF's formats with fp16 scales: Q4_1 (kind 4: a
// scale d and a minimum m per block, w = q * d + m, q in 0..15) and Q8_0 (kind 8: w = q * d, q in
// -127..127). Activations are fp32 by default (acts 0): each block is dequantized in registers
// and multiplied with FMA, d * sum(q * x) + m * sum(x) per block, so a product equals the fp32
// product with the same weights to float rounding. acts 1 is llama.cpp's arithmetic instead: the
// activations quantized per block to int8 (GGUF's Q8_1) and products summed in int32 (an opt-in).
//
// ONE ARITHMETIC. Every value a token gets (its norms, projections, rotary embedding, attention
// over its columns, MLP) is computed by the same code in the same order whether the token is
// decoded alone, in a batch of rows, or prefilled with hundreds of others, and whatever the thread
// count: a token's logits do not depend on how it reached the model. The per-token stages below
// are shared by every entry point, row groups repeat the single-row arithmetic op for op, threads
// split work by output element (never a sum), and the file is compiled with -ffp-contract=off so
// the compiler cannot fuse a multiply and an add in one place and not in another.
//
// One plain C file, no torch headers; built by multistream at first use (multistream/text/_accel/
// kernels.py) with -march=native: AVX2 + FMA intrinsics where the compiler targets them (and the
// fp32 block products in AVX-512 where it has that too), portable C elsewhere. A build computes
// the same values on every path; builds for different instruction sets differ by float rounding. Each entry point runs one OpenMP parallel region (its stages separated by barriers)
// rather than one per matmul.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MS_AVX2 1
#if defined(__AVX512F__)
// The fp32-activation products in 16-lane registers (a block of 32 is two of them); everything
// else stays on the AVX2 code, which an AVX-512 CPU runs as well.
#define MS_AVX512 1
#endif
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK 32
#define GROUP 4  // activation rows per pass over a weight block (prefill, batched decode)
#define SILU_PIECE 64  // SiLU values per task
#define TILE 8   // output rows per task: a tile of weights stays in L1 while every activation row reads it

// ---------------------------------------------------------------------------------------------
// Parameter blocks (the same layouts as the ctypes Structures of kernels.py).

typedef struct {
    const void *w;      // Q4_1: uint8 [n, k / 2] (byte j of a block: value j low, j + 16 high); Q8_0: int8 [n, k]
    const uint16_t *s;  // fp16 scales: Q4_1 [n, k / 32, 2] (d, m); Q8_0 [n, k / 32]
    const float *bias;  // [n] or NULL
    int64_t n, k;
    int32_t kind;       // 4 or 8
    int32_t acts;       // 0: fp32 activations; 1: int8 activations (llama.cpp's arithmetic)
} ms_qmat;

typedef struct {
    float *k, *v;             // [rows, kv_heads, columns, dim] with the strides below (elements; dim contiguous)
    int64_t ks[3], vs[3];
} ms_kv;

typedef struct {
    const float *norm1_w, *norm2_w;
    float eps1, eps2;
    ms_qmat qkv, o, gate_up, down;
    ms_kv kv;                 // ms_layers_forward writes each token's k and v here
} ms_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, dim, intermediate;
    float scaling;
} ms_shape;

typedef struct {
    int64_t count;            // tokens in this call
    const float *cos, *sin;   // [count, dim]: each token's rotary embedding
    const int64_t *kv_row;    // [count]: the row of the KV buffers the token belongs to
    const int64_t *first;     // [count]: the first column it attends to
    const int64_t *column;    // [count]: its own column (its k and v go there; it attends up to it)
} ms_tokens;

// Scratch for the int8-activation path, per call.
typedef struct {
    int8_t *q;
    float *d, *s;
} acts8;

// ---------------------------------------------------------------------------------------------
// Scalars and small helpers.

static inline float half_to_float(uint16_t h) {
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

#ifdef MS_AVX2
static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

// Sum of the 32 values of each block of one activation row (the minimum's term of Q4_1).
static void block_sums(const float *x, int64_t blocks, float *sums) {
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * BLOCK;
#ifdef MS_AVX2
        __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        sums[b] = hsum256(t);
#else
        float t = 0.0f;
        for (int j = 0; j < BLOCK; j++) t += xb[j];
        sums[b] = t;
#endif
    }
}

// ---------------------------------------------------------------------------------------------
// fp32 activations: one (activation row, weight row) pair. The group forms below repeat these
// operations for each row, in the same order, with the weight block dequantized once for all.

#ifdef MS_AVX2
// A Q4_1 block's 32 values 0..15 as four vectors of floats, in order: the 16 bytes in both halves
// of a register, nibbles masked, then one byte shuffle per 8 values into 32-bit lanes (lane 0 of
// the register takes values 0..3, lane 1 values 4..7, and so on).
static inline void q4_floats(const uint8_t *packed16, __m256 *f) {
    const __m256i packed = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)packed16));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(packed, mask), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
    const char z = (char)0x80;
    const __m256i first = _mm256_setr_epi8(0, z, z, z, 1, z, z, z, 2, z, z, z, 3, z, z, z,
                                           4, z, z, z, 5, z, z, z, 6, z, z, z, 7, z, z, z);
    const __m256i second = _mm256_setr_epi8(8, z, z, z, 9, z, z, z, 10, z, z, z, 11, z, z, z,
                                            12, z, z, z, 13, z, z, z, 14, z, z, z, 15, z, z, z);
    f[0] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, first));
    f[1] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, second));
    f[2] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, first));
    f[3] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, second));
}

static inline void q8_floats(const int8_t *w32, __m256 *f) {
    for (int i = 0; i < 4; i++)
        f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w32 + 8 * i))));
}

// sum(q * x) over a block: two chains of two products, added (the same tree in every caller).
static inline __m256 block_dot(const __m256 *f, const float *xb) {
    __m256 a = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
    __m256 b = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(f[1], _mm256_loadu_ps(xb + 8)));
    return _mm256_add_ps(a, b);
}

#ifdef MS_AVX512
// The same with 16 lanes: a Q4_1 block's low nibbles (values 0..15) and high nibbles (16..31),
// each widened to 16 int32 lanes and converted; a Q8_0 block's two halves likewise.
static inline void q4_floats16(const uint8_t *packed16, __m512 *f) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)packed16), mask = _mm_set1_epi8(0x0F);
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, mask)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)));
}

static inline void q8_floats16(const int8_t *w32, __m512 *f) {
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w32)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w32 + 16))));
}

// sum(q * x) over a block, per lane i: q[i] x[i] + q[16 + i] x[16 + i] (the same tree in every caller).
static inline __m512 block_dot16(const __m512 *f, const float *xb) {
    return _mm512_fmadd_ps(f[1], _mm512_loadu_ps(xb + 16), _mm512_mul_ps(f[0], _mm512_loadu_ps(xb)));
}

// A fixed reduction tree (halves added, then hsum256), so every caller sums the lanes alike.
static inline float hsum512(__m512 v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
#endif
#endif

// A weight row's fp16 scales as floats (exact), 8 at a time where F16C is there: one conversion per
// scale instead of one scalar conversion in the inner loop.
#define MAX_ROW_SCALES 1024  // longer rows (k > 16384) convert per block instead: the same values
static inline void row_scales(const uint16_t *s, int64_t count, float *out) {
    int64_t i = 0;
#if defined(__F16C__) && defined(MS_AVX2)
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < count; i++) out[i] = half_to_float(s[i]);
}

// The scales of weight row j (Q4_1: d, m per block; Q8_0: d per block), as floats.
static inline const float *scales_of(const ms_qmat *m, int64_t j, float *buffer) {
    const int64_t per_row = (m->k / BLOCK) * (m->kind == 4 ? 2 : 1);
    const uint16_t *s = m->s + j * per_row;
    if (per_row <= MAX_ROW_SCALES) {
        row_scales(s, per_row, buffer);
        return buffer;
    }
    return NULL;
}

static inline float scale_at(const ms_qmat *m, int64_t j, const float *scales, int64_t i) {
    const int64_t per_row = (m->k / BLOCK) * (m->kind == 4 ? 2 : 1);
    return scales ? scales[i] : half_to_float(m->s[j * per_row + i]);
}

static float dot_f32(const ms_qmat *m, int64_t j, const float *x, const float *sums) {
    const int64_t blocks = m->k / BLOCK;
    float buffer[MAX_ROW_SCALES];
    const float *sc = scales_of(m, j, buffer);
#if defined(MS_AVX512)
    __m512 acc = _mm512_setzero_ps(), f[2];
    float mins = 0.0f;
    if (m->kind == 4) {
        const uint8_t *w = (const uint8_t *)m->w + j * (m->k / 2);
        for (int64_t b = 0; b < blocks; b++) {
            q4_floats16(w + b * 16, f);
            acc = _mm512_fmadd_ps(_mm512_set1_ps(scale_at(m, j, sc, 2 * b)), block_dot16(f, x + b * BLOCK), acc);
        }
        for (int64_t b = 0; b < blocks; b++) mins += scale_at(m, j, sc, 2 * b + 1) * sums[b];
    } else {
        const int8_t *w = (const int8_t *)m->w + j * m->k;
        for (int64_t b = 0; b < blocks; b++) {
            q8_floats16(w + b * BLOCK, f);
            acc = _mm512_fmadd_ps(_mm512_set1_ps(scale_at(m, j, sc, b)), block_dot16(f, x + b * BLOCK), acc);
        }
    }
    return hsum512(acc) + mins;
#elif defined(MS_AVX2)
    __m256 acc = _mm256_setzero_ps(), f[4];
    float mins = 0.0f;
    if (m->kind == 4) {
        const uint8_t *w = (const uint8_t *)m->w + j * (m->k / 2);
        for (int64_t b = 0; b < blocks; b++) {
            q4_floats(w + b * 16, f);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(scale_at(m, j, sc, 2 * b)), block_dot(f, x + b * BLOCK), acc);
        }
        for (int64_t b = 0; b < blocks; b++) mins += scale_at(m, j, sc, 2 * b + 1) * sums[b];
    } else {
        const int8_t *w = (const int8_t *)m->w + j * m->k;
        for (int64_t b = 0; b < blocks; b++) {
            q8_floats(w + b * BLOCK, f);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(scale_at(m, j, sc, b)), block_dot(f, x + b * BLOCK), acc);
        }
    }
    return hsum256(acc) + mins;
#else
    float total = 0.0f, mins = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * BLOCK;
        float t = 0.0f;
        if (m->kind == 4) {
            const uint8_t *w = (const uint8_t *)m->w + j * (m->k / 2) + b * 16;
            for (int i = 0; i < 16; i++) t += (float)(w[i] & 0x0F) * xb[i];
            for (int i = 0; i < 16; i++) t += (float)(w[i] >> 4) * xb[i + 16];
            total += scale_at(m, j, sc, 2 * b) * t;
        } else {
            const int8_t *w = (const int8_t *)m->w + j * m->k + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) t += (float)w[i] * xb[i];
            total += scale_at(m, j, sc, b) * t;
        }
    }
    if (m->kind == 4)
        for (int64_t b = 0; b < blocks; b++) mins += scale_at(m, j, sc, 2 * b + 1) * sums[b];
    return total + mins;
#endif
}

// GROUP activation rows (x: row r at x + r * k) against weight row j: dot_f32 for each row.
static void dot_f32_group(const ms_qmat *m, int64_t j, const float *x, const float *sums, float *out) {
    const int64_t k = m->k, blocks = k / BLOCK;
#if defined(MS_AVX512)
    float buffer[MAX_ROW_SCALES];
    const float *sc = scales_of(m, j, buffer);
    __m512 acc[GROUP], f[2];
    float mins[GROUP];
    for (int r = 0; r < GROUP; r++) {
        acc[r] = _mm512_setzero_ps();
        mins[r] = 0.0f;
    }
    if (m->kind == 4) {
        const uint8_t *w = (const uint8_t *)m->w + j * (k / 2);
        for (int64_t b = 0; b < blocks; b++) {
            q4_floats16(w + b * 16, f);
            __m512 d = _mm512_set1_ps(scale_at(m, j, sc, 2 * b));
            for (int r = 0; r < GROUP; r++) acc[r] = _mm512_fmadd_ps(d, block_dot16(f, x + r * k + b * BLOCK), acc[r]);
        }
        for (int r = 0; r < GROUP; r++)
            for (int64_t b = 0; b < blocks; b++) mins[r] += scale_at(m, j, sc, 2 * b + 1) * sums[r * blocks + b];
    } else {
        const int8_t *w = (const int8_t *)m->w + j * k;
        for (int64_t b = 0; b < blocks; b++) {
            q8_floats16(w + b * BLOCK, f);
            __m512 d = _mm512_set1_ps(scale_at(m, j, sc, b));
            for (int r = 0; r < GROUP; r++) acc[r] = _mm512_fmadd_ps(d, block_dot16(f, x + r * k + b * BLOCK), acc[r]);
        }
    }
    for (int r = 0; r < GROUP; r++) out[r] = hsum512(acc[r]) + mins[r];
#elif defined(MS_AVX2)
    float buffer[MAX_ROW_SCALES];
    const float *sc = scales_of(m, j, buffer);
    __m256 acc[GROUP], f[4];
    float mins[GROUP];
    for (int r = 0; r < GROUP; r++) {
        acc[r] = _mm256_setzero_ps();
        mins[r] = 0.0f;
    }
    if (m->kind == 4) {
        const uint8_t *w = (const uint8_t *)m->w + j * (k / 2);
        for (int64_t b = 0; b < blocks; b++) {
            q4_floats(w + b * 16, f);
            __m256 d = _mm256_set1_ps(scale_at(m, j, sc, 2 * b));
            for (int r = 0; r < GROUP; r++) acc[r] = _mm256_fmadd_ps(d, block_dot(f, x + r * k + b * BLOCK), acc[r]);
        }
        for (int r = 0; r < GROUP; r++)
            for (int64_t b = 0; b < blocks; b++) mins[r] += scale_at(m, j, sc, 2 * b + 1) * sums[r * blocks + b];
    } else {
        const int8_t *w = (const int8_t *)m->w + j * k;
        for (int64_t b = 0; b < blocks; b++) {
            q8_floats(w + b * BLOCK, f);
            __m256 d = _mm256_set1_ps(scale_at(m, j, sc, b));
            for (int r = 0; r < GROUP; r++) acc[r] = _mm256_fmadd_ps(d, block_dot(f, x + r * k + b * BLOCK), acc[r]);
        }
    }
    for (int r = 0; r < GROUP; r++) out[r] = hsum256(acc[r]) + mins[r];
#else
    for (int r = 0; r < GROUP; r++) out[r] = dot_f32(m, j, x + r * k, sums + r * blocks);
#endif
}

// ---------------------------------------------------------------------------------------------
// int8 activations (acts 1): llama.cpp's arithmetic, kept as an opt-in.

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

#ifdef MS_AVX2
static inline __m256i q4_nibbles(const uint8_t *packed16) {
    __m128i packed = _mm_loadu_si128((const __m128i *)packed16);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

static inline __m256 sum_u4_s8(__m256i nib, __m256i a) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(nib, a), _mm256_set1_epi16(1)));
}

static inline __m256 sum_s8_s8(__m256i w, __m256i a) {
    __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
}
#endif

static float dot_i8(const ms_qmat *m, int64_t j, const int8_t *q, const float *d, const float *s) {
    const int64_t blocks = m->k / BLOCK;
#ifdef MS_AVX2
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(q + b * BLOCK));
        if (m->kind == 4) {
            const uint16_t *dm = m->s + (j * blocks + b) * 2;
            __m256i nib = q4_nibbles((const uint8_t *)m->w + j * (m->k / 2) + b * 16);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(dm[0]) * d[b]), sum_u4_s8(nib, a), acc);
            mins += half_to_float(dm[1]) * s[b];
        } else {
            __m256i w = _mm256_loadu_si256((const __m256i *)((const int8_t *)m->w + j * m->k + b * BLOCK));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(m->s[j * blocks + b]) * d[b]), sum_s8_s8(w, a), acc);
        }
    }
    return hsum256(acc) + mins;
#else
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        int sum = 0;
        if (m->kind == 4) {
            const uint8_t *w = (const uint8_t *)m->w + j * (m->k / 2) + b * 16;
            for (int i = 0; i < 16; i++) sum += (w[i] & 0x0F) * q[b * BLOCK + i] + (w[i] >> 4) * q[b * BLOCK + i + 16];
            const uint16_t *dm = m->s + (j * blocks + b) * 2;
            total += half_to_float(dm[0]) * d[b] * (float)sum + half_to_float(dm[1]) * s[b];
        } else {
            const int8_t *w = (const int8_t *)m->w + j * m->k + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) sum += w[i] * q[b * BLOCK + i];
            total += half_to_float(m->s[j * blocks + b]) * d[b] * (float)sum;
        }
    }
    return total;
#endif
}

// ---------------------------------------------------------------------------------------------
// The matmul, as work shared by the threads of an enclosing parallel region (orphaned `omp for`s:
// each call site is inside one). y[r, j] = x[r, :] . W[j, :] (+ bias[j]).

// Per-row preparation: the block sums (fp32) or the int8 quantization (acts 1), into the scratch.
static inline void prepare_row(const ms_qmat *m, const float *x, int64_t r, float *sums, acts8 *a8) {
    const int64_t k = m->k, blocks = k / BLOCK;
    if (m->acts)
        quantize_row(x + r * k, k, a8->q + r * k, a8->d + r * blocks, a8->s + r * blocks);
    else
        block_sums(x + r * k, blocks, sums + r * blocks);
}

static void prepare_rows(const ms_qmat *m, const float *x, int64_t rows, float *sums, acts8 *a8) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) prepare_row(m, x, r, sums, a8);
}

static void matmul_work(const ms_qmat *m, const float *x, int64_t rows, float *y, const float *sums,
                        const acts8 *a8) {
    const int64_t k = m->k, n = m->n, blocks = k / BLOCK, tiles = (n + TILE - 1) / TILE;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * TILE, end = (t + 1) * TILE < n ? (t + 1) * TILE : n;
        // Activation rows outside, the tile's weight rows inside: a group of rows is read from L2
        // once per tile and meets every weight row of it in L1 (the other order read the group again
        // for each weight row, and prefill ran at L2's bandwidth). Each (row, weight row) pair is
        // computed by the same code either way: the order changes no value.
        int64_t r = 0;
        if (!m->acts) {
            for (; r + GROUP <= rows; r += GROUP)
                for (int64_t j = first; j < end; j++) {
                    float v[GROUP];
                    dot_f32_group(m, j, x + r * k, sums + r * blocks, v);
                    for (int g = 0; g < GROUP; g++) y[(r + g) * n + j] = m->bias ? v[g] + m->bias[j] : v[g];
                }
            for (; r < rows; r++)
                for (int64_t j = first; j < end; j++) {
                    float v = dot_f32(m, j, x + r * k, sums + r * blocks);
                    y[r * n + j] = m->bias ? v + m->bias[j] : v;
                }
        } else {
            for (; r < rows; r++)
                for (int64_t j = first; j < end; j++) {
                    float v = dot_i8(m, j, a8->q + r * k, a8->d + r * blocks, a8->s + r * blocks);
                    y[r * n + j] = m->bias ? v + m->bias[j] : v;
                }
        }
    }
}

// Scratch for a matmul of `rows` rows of width k: block sums (fp32) or the int8 rows and scales.
static size_t scratch_bytes(int64_t rows, int64_t k) {
    return (size_t)(rows * k) + sizeof(float) * (size_t)(3 * rows * (k / BLOCK)) + 64;
}

static void scratch_split(void *base, int64_t rows, int64_t k, float **sums, acts8 *a8) {
    const int64_t blocks = k / BLOCK;
    *sums = (float *)base;
    a8->d = *sums + rows * blocks;
    a8->s = a8->d + rows * blocks;
    a8->q = (int8_t *)(a8->s + rows * blocks);
}

static void matmul_shared(const ms_qmat *m, const float *x, int64_t rows, float *y, void *scratch) {
    float *sums;
    acts8 a8;
    scratch_split(scratch, rows, m->k, &sums, &a8);
    prepare_rows(m, x, rows, sums, &a8);  // ends with a barrier
    matmul_work(m, x, rows, y, sums, &a8);
}

// The same, for rows whose preparation the caller did already (prepare_scratch_row, in the loop
// that produced them: one barrier fewer).
static void matmul_prepared(const ms_qmat *m, const float *x, int64_t rows, float *y, void *scratch) {
    float *sums;
    acts8 a8;
    scratch_split(scratch, rows, m->k, &sums, &a8);
    matmul_work(m, x, rows, y, sums, &a8);
}

static inline void prepare_scratch_row(const ms_qmat *m, const float *x, int64_t rows, int64_t r, void *scratch) {
    float *sums;
    acts8 a8;
    scratch_split(scratch, rows, m->k, &sums, &a8);
    prepare_row(m, x, r, sums, &a8);
}

static int check_qmat(const ms_qmat *m) {
    if (!m || !m->w || !m->s || m->k <= 0 || m->n <= 0 || m->k % BLOCK) return -1;
    if ((m->kind != 4 && m->kind != 8) || (m->acts != 0 && m->acts != 1)) return -1;
    return 0;
}

// Status codes: 0 ok, -1 a shape or argument the kernels do not take, -2 out of memory.
int ms_matmul(const float *x, int64_t rows, const ms_qmat *m, float *y, int threads) {
    if (check_qmat(m) || rows < 0 || !x || !y) return -1;
    if (rows == 0) return 0;
    void *scratch = malloc(scratch_bytes(rows, m->k));
    if (!scratch) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    matmul_shared(m, x, rows, y, scratch);
    free(scratch);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// The per-token stages of a Llama decoder layer.

// exp(x) for the softmax and SiLU: Cephes' expf polynomial (about 1 ulp), as a scalar and as an
// 8-lane vector that do the same operations in the same order, so a value does not depend on
// which of the two computed it (a lane or a tail). libm's expf, one call per value, was 2 to 6 %
// of a step; inputs are clamped to where the result is a normal float.
#define EXP_HI 88.0f   // 2^n stays finite and normal at both ends
#define EXP_LO -87.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

static inline float exp_scalar(float x) {
    x = x > EXP_HI ? EXP_HI : x;
    x = x < EXP_LO ? EXP_LO : x;
    float n = nearbyintf(x * EXP_LOG2E);
    float r = x - n * EXP_C1;
    r = r - n * EXP_C2;
    float y = EXP_P0 * r + EXP_P1;
    y = y * r + EXP_P2;
    y = y * r + EXP_P3;
    y = y * r + EXP_P4;
    y = y * r + EXP_P5;
    y = y * (r * r) + r;
    y = y + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#ifdef MS_AVX2
static inline __m256 exp_vector(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C1)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(EXP_C2)));
    __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(EXP_P0), r), _mm256_set1_ps(EXP_P1));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(EXP_P2));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(EXP_P3));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(EXP_P4));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(EXP_P5));
    y = _mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// y[i] = exp(x[i] - shift) for i < count.
static void exp_shifted(const float *x, float shift, float *y, int64_t count) {
    int64_t i = 0;
#ifdef MS_AVX2
    const __m256 s = _mm256_set1_ps(shift);
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(y + i, exp_vector(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
#endif
    for (; i < count; i++) y[i] = exp_scalar(x[i] - shift);
}

// out[c] = SiLU(gate[c]) * up[c] = gate / (1 + exp(-gate)) * up, for c < count.
static void silu_mul(const float *gate, const float *up, float *out, int64_t count) {
    int64_t c = 0;
#ifdef MS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; c + 8 <= count; c += 8) {
        __m256 g = _mm256_loadu_ps(gate + c);
        __m256 e = exp_vector(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + c)));
    }
#endif
    for (; c < count; c++) {
        float g = gate[c];
        out[c] = g / (1.0f + exp_scalar(0.0f - g)) * up[c];
    }
}

static void rms_norm_row(const float *x, const float *w, float eps, float *y, int64_t dim) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) y[i] = w[i] * (x[i] * inv);
}

// rotate_half convention (transformers' apply_rotary_pos_emb): y = x * cos + rotate_half(x) * sin.
static void rotary(const float *x, const float *cos, const float *sin, float *y, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) y[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < dim; i++) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// A token's fused q/k/v row -> its rotated q, k and its v.
static void split_rotate(const ms_shape *s, const float *row, const float *cos, const float *sin, float *q, float *k,
                         float *v) {
    const int64_t dim = s->dim;
    for (int64_t h = 0; h < s->heads; h++) rotary(row + h * dim, cos, sin, q + h * dim, dim);
    for (int64_t h = 0; h < s->kv_heads; h++) {
        rotary(row + (s->heads + h) * dim, cos, sin, k + h * dim, dim);
        memcpy(v + h * dim, row + (s->heads + s->kv_heads + h) * dim, sizeof(float) * (size_t)dim);
    }
}

static inline float dot_dim(const float *a, const float *b, int64_t dim) {
#ifdef MS_AVX2
    if (dim % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        return hsum256(_mm256_add_ps(s0, s1));
    }
#endif
    float t = 0.0f;
    for (int64_t i = 0; i < dim; i++) t += a[i] * b[i];
    return t;
}

// One query (a token and a head) against columns [first, last] of its KV head: softmax(q.k * scaling) . v.
static void attend_one(const float *q, const float *keys, const float *values, int64_t kstride, int64_t vstride,
                       int64_t first, int64_t last, float scaling, int64_t dim, float *scores, float *o) {
    for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
    int64_t n = last - first + 1;
    if (n <= 0) return;  // a padding token: nothing to attend to (its output is never used)
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        scores[j] = dot_dim(q, keys + (first + j) * kstride, dim) * scaling;
        top = scores[j] > top ? scores[j] : top;
    }
    float total = 0.0f;
    exp_shifted(scores, top, scores, n);
    for (int64_t j = 0; j < n; j++) total += scores[j];
    float inv = 1.0f / total;
    for (int64_t j = 0; j < n; j++) {
        const float *vj = values + (first + j) * vstride;
        float p = scores[j] * inv;
#ifdef MS_AVX2
        if (dim % 8 == 0) {
            __m256 pv = _mm256_set1_ps(p);
            for (int64_t i = 0; i < dim; i += 8)
                _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + i), _mm256_loadu_ps(o + i)));
            continue;
        }
#endif
        for (int64_t i = 0; i < dim; i++) o[i] += p * vj[i];
    }
}

static int64_t max_span(const ms_tokens *t) {
    int64_t span = 1;
    for (int64_t i = 0; i < t->count; i++) {
        int64_t n = t->column[i] - t->first[i] + 1;
        span = n > span ? n : span;
    }
    return span;
}

// Every token's heads against its columns; `scores`: a row of `span` floats per thread.
static void attend_tokens(const ms_shape *s, const ms_tokens *t, const float *q, const ms_kv *kv, float *out,
                          float *scores, int64_t span) {
    const int64_t heads = s->heads, group = s->heads / s->kv_heads, dim = s->dim;
#ifdef _OPENMP
    float *mine = scores + (int64_t)omp_get_thread_num() * span;
#else
    float *mine = scores;
#endif
#pragma omp for schedule(static)
    for (int64_t task = 0; task < t->count * heads; task++) {
        int64_t i = task / heads, h = task % heads, g = h / group, row = t->kv_row[i];
        attend_one(q + (i * heads + h) * dim, kv->k + row * kv->ks[0] + g * kv->ks[1],
                   kv->v + row * kv->vs[0] + g * kv->vs[1], kv->ks[2], kv->vs[2], t->first[i], t->column[i],
                   s->scaling, dim, mine, out + (i * heads + h) * dim);
    }
}

// Scratch of one layer call: normed input, fused q/k/v, q/k/v, attention, h, normed h, gate/up,
// activation, matmul scratch and attention scores.
typedef struct {
    float *normed, *qkv, *q, *k, *v, *attn, *h, *normed2, *gu, *act, *scores;
    void *mm;
    int64_t span;
} layer_scratch;

static void *scratch_alloc(const ms_shape *s, const ms_tokens *t, int threads, layer_scratch *w) {
    const int64_t n = t->count, hidden = s->hidden, width = (s->heads + 2 * s->kv_heads) * s->dim;
    int64_t widest = hidden > s->intermediate ? hidden : s->intermediate;
    widest = widest > s->heads * s->dim ? widest : s->heads * s->dim;
    w->span = max_span(t);
    size_t floats = (size_t)(n * (hidden + width + width + s->heads * s->dim + 2 * hidden + 3 * s->intermediate)) +
                    (size_t)(threads > 0 ? threads : 1) * (size_t)w->span;
    size_t mm = scratch_bytes(n, widest);
    float *base = (float *)malloc(sizeof(float) * floats + mm + 64);
    if (!base) return NULL;
    w->normed = base;
    w->qkv = w->normed + n * hidden;
    w->q = w->qkv + n * width;
    w->k = w->q + n * s->heads * s->dim;
    w->v = w->k + n * s->kv_heads * s->dim;
    w->attn = w->v + n * s->kv_heads * s->dim;
    w->h = w->attn + n * s->heads * s->dim;
    w->normed2 = w->h + n * hidden;
    w->gu = w->normed2 + n * hidden;
    w->act = w->gu + n * 2 * s->intermediate;
    w->scores = w->act + n * s->intermediate;
    w->mm = (void *)(w->scores + (size_t)(threads > 0 ? threads : 1) * (size_t)w->span);
    return base;
}

static void write_kv(const ms_shape *s, const ms_tokens *t, const ms_kv *kv, const layer_scratch *w, int64_t i);

// Stage 1 (inside a parallel region): norm, fused q/k/v, rotary: q, k, v of every token into w
// (and k, v into `kv` at the tokens' columns when it is given).
static void stage_qkv(const ms_layer *l, const ms_shape *s, const ms_tokens *t, const float *x, layer_scratch *w,
                      const ms_kv *kv) {
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->dim;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < t->count; i++) {
        rms_norm_row(x + i * s->hidden, l->norm1_w, l->eps1, w->normed + i * s->hidden, s->hidden);
        prepare_scratch_row(&l->qkv, w->normed, t->count, i, w->mm);
    }
    matmul_prepared(&l->qkv, w->normed, t->count, w->qkv, w->mm);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < t->count; i++) {
        split_rotate(s, w->qkv + i * width, t->cos + i * s->dim, t->sin + i * s->dim, w->q + i * s->heads * s->dim,
                     w->k + i * s->kv_heads * s->dim, w->v + i * s->kv_heads * s->dim);
        if (kv) write_kv(s, t, kv, w, i);
    }
}

// Token i's k and v into its column of the KV buffers.
static void write_kv(const ms_shape *s, const ms_tokens *t, const ms_kv *kv, const layer_scratch *w, int64_t i) {
    const int64_t dim = s->dim, row = t->kv_row[i], col = t->column[i];
    for (int64_t h = 0; h < s->kv_heads; h++) {
        memcpy(kv->k + row * kv->ks[0] + h * kv->ks[1] + col * kv->ks[2], w->k + (i * s->kv_heads + h) * dim,
               sizeof(float) * (size_t)dim);
        memcpy(kv->v + row * kv->vs[0] + h * kv->vs[1] + col * kv->vs[2], w->v + (i * s->kv_heads + h) * dim,
               sizeof(float) * (size_t)dim);
    }
}

// Stage 3: attention, output projection, residual, norm, gated SiLU MLP, residual: out.
static void stage_rest(const ms_layer *l, const ms_shape *s, const ms_tokens *t, const float *x, const float *q,
                       const ms_kv *kv, float *out, layer_scratch *w) {
    const int64_t n = t->count, hidden = s->hidden, inter = s->intermediate;
    attend_tokens(s, t, q, kv, w->attn, w->scores, w->span);
    matmul_shared(&l->o, w->attn, n, w->h, w->mm);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t c = 0; c < hidden; c++) w->h[i * hidden + c] += x[i * hidden + c];
        rms_norm_row(w->h + i * hidden, l->norm2_w, l->eps2, w->normed2 + i * hidden, hidden);
        prepare_scratch_row(&l->gate_up, w->normed2, n, i, w->mm);
    }
    matmul_prepared(&l->gate_up, w->normed2, n, w->gu, w->mm);
    // SiLU(gate) * up, in pieces of SILU_PIECE values (split over the threads even for one token;
    // a value is the same in a vector lane or a tail).
    const int64_t pieces = (inter + SILU_PIECE - 1) / SILU_PIECE;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < n * pieces; task++) {
        const int64_t i = task / pieces, c = (task % pieces) * SILU_PIECE;
        const int64_t count = inter - c < SILU_PIECE ? inter - c : SILU_PIECE;
        silu_mul(w->gu + i * 2 * inter + c, w->gu + i * 2 * inter + inter + c, w->act + i * inter + c, count);
    }
    // `out` may be `x` itself (ms_layers_forward): x is not read after the first residual above.
    matmul_shared(&l->down, w->act, n, out, w->mm);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n * hidden; i++) out[i] += w->h[i];
}

static int check_layer(const ms_layer *l, const ms_shape *s) {
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->dim;
    if (!l || !l->norm1_w || !l->norm2_w) return -1;
    if (check_qmat(&l->qkv) || check_qmat(&l->o) || check_qmat(&l->gate_up) || check_qmat(&l->down)) return -1;
    if (l->qkv.k != s->hidden || l->qkv.n != width || l->o.k != s->heads * s->dim || l->o.n != s->hidden ||
        l->gate_up.k != s->hidden || l->gate_up.n != 2 * s->intermediate || l->down.k != s->intermediate ||
        l->down.n != s->hidden)
        return -1;
    return 0;
}

static int check_shape(const ms_shape *s, const ms_tokens *t) {
    if (!s || !t || s->hidden <= 0 || s->heads <= 0 || s->kv_heads <= 0 || s->dim <= 0 || s->dim % 2 ||
        s->heads % s->kv_heads || s->intermediate <= 0 || t->count < 0)
        return -1;
    if (t->count && (!t->cos || !t->sin || !t->kv_row || !t->first || !t->column)) return -1;
    for (int64_t i = 0; i < t->count; i++)
        if (t->kv_row[i] < 0 || t->first[i] < 0 || t->column[i] < 0) return -1;
    return 0;
}

// q, k, v of `tokens` (x [count, hidden] -> q [count, heads, dim], k and v [count, kv_heads, dim]):
// the first half of a layer, for a caller whose cache appends k and v itself (transformers' cache).
int ms_layer_qkv(const ms_layer *l, const ms_shape *s, const ms_tokens *t, const float *x, float *q, float *k,
                 float *v, int threads) {
    if (check_shape(s, t) || check_layer(l, s)) return -1;
    if (t->count == 0) return 0;
    layer_scratch w;
    void *base = scratch_alloc(s, t, threads, &w);
    if (!base) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    stage_qkv(l, s, t, x, &w, NULL);
    const int64_t n = t->count;
    memcpy(q, w.q, sizeof(float) * (size_t)(n * s->heads * s->dim));
    memcpy(k, w.k, sizeof(float) * (size_t)(n * s->kv_heads * s->dim));
    memcpy(v, w.v, sizeof(float) * (size_t)(n * s->kv_heads * s->dim));
    free(base);
    return 0;
}

// The second half: attention of each token on columns [first, column] of `kv` (which holds its own
// k and v already), then the rest of the layer: out [count, hidden].
int ms_layer_rest(const ms_layer *l, const ms_shape *s, const ms_tokens *t, const float *x, const float *q,
                  const ms_kv *kv, float *out, int threads) {
    if (check_shape(s, t) || check_layer(l, s) || !kv || !kv->k || !kv->v) return -1;
    if (t->count == 0) return 0;
    layer_scratch w;
    void *base = scratch_alloc(s, t, threads, &w);
    if (!base) return -2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    stage_rest(l, s, t, x, q, kv, out, &w);
    free(base);
    return 0;
}

// Where a run of layers may stop early: before layer i (of this call, i > 0) when stop_before[i] is
// set and *pending is nonzero when the threads get there (the engine's flag: a request arrived
// that it can prefill part-way through this step). Read by one thread, the decision shared by all.
typedef struct {
    const volatile int32_t *pending;
    const uint8_t *stop_before;  // [count] or NULL
} ms_points;

// Layers in one call, for a caller that owns the KV buffers (the engine's fast step): each layer
// computes the tokens' q, k, v, writes k and v into layers[i].kv at their columns, attends and
// finishes the layer; x [count, hidden] is updated in place. The same stages as the two calls above.
// *done: how many layers ran (count, or where `points` stopped the run; the caller goes on from
// there), so that an engine's prefill points cost one C call per step, not one per run of layers.
int ms_layers_forward(const ms_layer *layers, int64_t count, const ms_shape *s, const ms_tokens *t, float *x,
                      int threads, const ms_points *points, int64_t *done) {
    if (check_shape(s, t) || count < 0 || !done) return -1;
    for (int64_t i = 0; i < count; i++)
        if (check_layer(layers + i, s) || !layers[i].kv.k || !layers[i].kv.v) return -1;
    const int stops = points && points->pending && points->stop_before;
    *done = count;
    if (t->count == 0 || count == 0) return 0;
    layer_scratch w;
    void *base = scratch_alloc(s, t, threads, &w);
    if (!base) return -2;
    int stop = 0;
    int64_t stopped_at = count;
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < count; i++) {
        if (stops && i > 0 && points->stop_before[i]) {
#pragma omp single
            if (*points->pending) {  // the single's barrier publishes the decision to every thread
                stop = 1;
                stopped_at = i;
            }
            if (stop) break;
        }
        const ms_layer *l = layers + i;
        stage_qkv(l, s, t, x, &w, &l->kv);
        stage_rest(l, s, t, x, w.q, &l->kv, x, &w);  // the layer's output replaces its input
    }
    *done = stopped_at;
    free(base);
    return 0;
}

// RMS norm of rows (the model's final norm, so every path shares this arithmetic too).
int ms_rms_norm(const float *x, int64_t rows, int64_t dim, const float *w, float eps, float *y) {
    if (!x || !w || !y || rows < 0 || dim <= 0) return -1;
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * dim, w, eps, y + r * dim, dim);
    return 0;
}

// Which instruction set this build uses (for the log line and the tests).
const char *ms_kernel_isa(void) {
#if defined(MS_AVX512)
    return "avx512";
#elif defined(MS_AVX2)
    return "avx2";
#else
    return "portable C";
#endif
}
