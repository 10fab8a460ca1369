// Block-quantized CPU kernels and Llama decoder layers for multistream's text models.
//
// Weights are in blocks of 32 input channels, GGUF's formats with fp16 scales: Q4_1 (kind 4: a
// scale d and a minimum m per block, w = q * d + m, q in 0..15) and Q8_0 (kind 8: w = q * d, q in
// -127..127). Activations are fp32 by default (acts 0): each block is dequantized in registers
// (w = q * d + m, one FMA per value, shared by every activation row of a pass) and multiplied
// with the activations by FMA, so a product is the fp32 product of the same weights to float
// rounding. acts 1 is llama.cpp's arithmetic instead: the
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
// the same values on every path; builds for different instruction sets differ by float rounding.
// Each entry point is one call of the file's own thread team (its stages separated by barriers)
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
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#define MS_THREADS 1
#endif

#define BLOCK 32
#define GROUP 4  // activation rows per pass over a weight block (prefill, batched decode)
// And in the fp32-activation kernels, WIDE_GROUP. A group's rows share each dequantized weight
// block, so a step of a pending token and its drafts (lookahead), a small batch, or prefill reads
// the weights once per WIDE_GROUP rows. Measured on a 2-core AMD EPYC with AVX2: a step of a
// token and 4 drafts took 61 ms with groups of 4, 51 with 8; with up to 9 drafts (7 on average)
// 97, 84 and 72 ms with 12 (README, "Speed on a CPU": prefill and batches gain too); groups of 16
// were no faster than 12. AVX-512 keeps 8 (measured against 4 there; wider groups were not).
#if defined(MS_AVX512)
#define WIDE_GROUP 8
#elif defined(MS_AVX2)
#define WIDE_GROUP 12
#else
#define WIDE_GROUP GROUP
#endif
_Static_assert(WIDE_GROUP == GROUP || WIDE_GROUP == 8 || WIDE_GROUP == 12, "group_rows has cases up to 4, 8 or 12 rows");
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
// The team: this file's own worker threads (pthreads), instead of OpenMP's.
//
// Why not OpenMP: libgomp spins at a barrier only while the process has no more OpenMP threads
// than CPUs. torch's pool on the thread that loaded the model plus the engine thread's pool is
// already more than 2 CPUs have, and from then on every barrier sleeps in the kernel and is woken
// (a futex round trip; tens of microseconds in a VM): a decode step's 270 barriers made 2 threads
// slower than one. The team spins at its barriers, and between calls its workers spin for up to
// TEAM_SPIN_NS (the next decode step usually comes sooner), yielding the core to any other
// runnable thread, then sleep until the next call. One call runs at a time (calls from several
// threads take turns), and a forked child starts with no workers (they are made again on use).
//
// Inside a call: `team_id`/`team_size` name this thread's part, `share_lo`/`share_hi` are a static split
// of a loop (each index computed by one thread, so no value depends on the split), `team_barrier`
// waits for all of the team. Every shared loop below is followed by a barrier.

#define TEAM_MAX 64
#define TEAM_SPIN_NS 3000000L  // how long idle workers wait for the next call before sleeping

static _Thread_local int team_id = 0, team_size = 1;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

// This thread's part [share_lo, share_hi) of `count` iterations (a static split).
static inline int64_t share_lo(int64_t count) {
    const int64_t base = count / team_size, extra = count % team_size;
    return team_id * base + (team_id < extra ? team_id : extra);
}

static inline int64_t share_hi(int64_t count) {
    return share_lo(count) + count / team_size + (team_id < count % team_size ? 1 : 0);
}

#ifdef MS_THREADS
typedef struct {
    pthread_mutex_t call_lock;   // one call at a time
    pthread_mutex_t lock;        // with `wake`: idle workers sleep here
    pthread_cond_t wake;
    unsigned first_call[TEAM_MAX];  // the `call` a worker was made before (it waits for the next)
    int started;                 // workers made so far (ids 1..started)
    void (*job)(void *);
    void *arg;
    int size;                    // threads in the current call (the caller is id 0)
    atomic_uint call;            // +1 per call: workers wait for it to change
    atomic_int finished;         // workers done with the current call
    atomic_int arrived;          // barrier: threads arrived
    atomic_uint passed;          // barrier: +1 each time all have arrived
    atomic_int stalls;           // barrier waits of the current call that outlasted the spin (see below)
} ms_team;

static ms_team team = {.call_lock = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER,
                       .wake = PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

// A wait at a barrier counts as a stall (a teammate preempted, see "Contention" below) when it
// outlasted the spin and this thread's own work since the last barrier: a preempted
// teammate's wait is a time slice (milliseconds) or, on a shared CPU, the teammate's whole share,
// while teammates that share a long stage evenly (a prefill's matmul, tens of milliseconds) still
// finish a few hundred microseconds apart. Counting spins alone (20,000, about 0.3 ms) read that
// spread as preemption, and a prefill's later calls ran on one thread: a 355-token prompt's first
// token came 30-40 % later.
static _Thread_local int64_t stage_began = 0;  // when this thread's work since its last barrier began

static void team_barrier(void) {
    if (team_size <= 1) return;
    const int64_t began = stage_began, arrived = now_ns();
    const unsigned passed = atomic_load(&team.passed);
    if (atomic_fetch_add(&team.arrived, 1) == team_size - 1) {
        atomic_store(&team.arrived, 0);
        atomic_fetch_add(&team.passed, 1);
        stage_began = arrived;
        return;
    }
    unsigned spins = 0;
    for (; atomic_load(&team.passed) == passed; spins++) {
        if (spins < 20000)
            cpu_relax();
        else
            sched_yield();  // a teammate may have been preempted: let it run
    }
    stage_began = now_ns();
    if (spins >= 20000 && stage_began - arrived > arrived - began) atomic_fetch_add(&team.stalls, 1);
}

// Contention. Another busy process on the same cores preempts a teammate for a scheduler time
// slice (milliseconds), and every barrier of the static split waits for it: with one `while True`
// process beside it, a 2-thread decode on 2 cores ran at a third of its speed, below one thread's.
// A call whose barriers stalled SOLO_STALLS times or more sends the next `solo_left` calls to the
// caller alone (the same values: no index depends on the split), SOLO_FIRST calls at first and twice
// as many each time the team stalls again right after, up to SOLO_MOST; a call without stalls halves
// the next spell. A spell of 64 calls is about 8 decode steps of the embedded model.
#define SOLO_STALLS 3
#define SOLO_FIRST 64
#define SOLO_MOST 2048
static atomic_int solo_left = 0;
static atomic_int solo_spell = SOLO_FIRST;
static atomic_llong solo_calls_total = 0, stalled_calls_total = 0;

static void *team_worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    unsigned seen = team.first_call[id];  // not team.call: this thread may start after the bump
    for (;;) {
        // Wait for the next call: spin, then yield, then sleep.
        int64_t since = 0;
        for (unsigned spins = 0; atomic_load(&team.call) == seen; spins++) {
            if (spins < 2000) {
                cpu_relax();
                continue;
            }
            if (!since) since = now_ns();
            if (now_ns() - since < TEAM_SPIN_NS) {
                sched_yield();
                continue;
            }
            pthread_mutex_lock(&team.lock);
            while (atomic_load(&team.call) == seen) pthread_cond_wait(&team.wake, &team.lock);
            pthread_mutex_unlock(&team.lock);
        }
        seen = atomic_load(&team.call);
        if (id < team.size) {
            team_id = id;
            team_size = team.size;
            stage_began = now_ns();
            team.job(team.arg);
        }
        atomic_fetch_add(&team.finished, 1);
    }
    return NULL;
}

static void team_forget(void) {  // in a forked child: the parent's workers do not exist here
    pthread_mutex_init(&team.call_lock, NULL);
    pthread_mutex_init(&team.lock, NULL);
    pthread_cond_init(&team.wake, NULL);
    team.started = 0;
}

// job(arg) on `threads` threads: the caller and threads - 1 workers (fewer if the system would
// not make more threads; the job's split adapts to team_size).
static void team_run(void (*job)(void *), void *arg, int threads) {
    if (threads > TEAM_MAX) threads = TEAM_MAX;
    if (threads > 1 && atomic_load(&solo_left) > 0) {
        atomic_fetch_sub(&solo_left, 1);
        atomic_fetch_add(&solo_calls_total, 1);
        threads = 1;
    }
    if (threads <= 1) {
        team_id = 0;
        team_size = 1;
        job(arg);
        return;
    }
    pthread_mutex_lock(&team.call_lock);
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, team_forget);
        registered = 1;
    }
    while (team.started < threads - 1) {
        team.first_call[team.started + 1] = atomic_load(&team.call);
        pthread_t worker;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&worker, &attr, team_worker, (void *)(intptr_t)(team.started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        team.started++;
    }
    if (team.started < threads - 1) threads = team.started + 1;
    team.job = job;
    team.arg = arg;
    team.size = threads;
    atomic_store(&team.finished, 0);
    atomic_store(&team.arrived, 0);
    atomic_store(&team.stalls, 0);
    const int workers = team.started;
    pthread_mutex_lock(&team.lock);
    atomic_fetch_add(&team.call, 1);
    pthread_cond_broadcast(&team.wake);
    pthread_mutex_unlock(&team.lock);
    team_id = 0;
    team_size = threads;
    stage_began = now_ns();
    job(arg);
    for (unsigned spins = 0; atomic_load(&team.finished) < workers; spins++) {
        if (spins < 20000)
            cpu_relax();
        else
            sched_yield();
    }
    team_size = 1;
    if (atomic_load(&team.stalls) >= SOLO_STALLS) {
        const int spell = atomic_load(&solo_spell);
        atomic_store(&solo_left, spell);
        atomic_store(&solo_spell, spell * 2 > SOLO_MOST ? SOLO_MOST : spell * 2);
        atomic_fetch_add(&stalled_calls_total, 1);
    } else {
        const int spell = atomic_load(&solo_spell);
        atomic_store(&solo_spell, spell / 2 < SOLO_FIRST ? SOLO_FIRST : spell / 2);
    }
    pthread_mutex_unlock(&team.call_lock);
}
#else
static void team_barrier(void) {}
static void team_run(void (*job)(void *), void *arg, int threads) {
    (void)threads;
    team_id = 0;
    team_size = 1;
    job(arg);
}
#endif

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

#ifdef MS_AVX512
// A Q8_0 block's two halves, each widened to 16 int32 lanes and converted (Q4_1 blocks: a lookup
// table, `q4_block`).
static inline void q8_floats16(const int8_t *w32, __m512 *f) {
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w32)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w32 + 16))));
}

// A fixed reduction tree (halves added, then hsum256), so every caller sums the lanes alike.
static inline float hsum512(__m512 v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
#endif
#endif

// A weight row's fp16 scales as floats (exact), 8 at a time where F16C is there: one conversion per
// scale instead of one scalar conversion in the inner loop.
static inline void row_scales(const uint16_t *s, int64_t count, float *out) {
    int64_t i = 0;
#if defined(__F16C__) && defined(MS_AVX2)
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < count; i++) out[i] = half_to_float(s[i]);
}

// Weight block b dequantized in registers, w = q * d + m (Q4_1: one FMA per lane) or q * d (Q8_0),
// once for every activation row that meets it; then each row adds its products with the block to
// its accumulator: acc + (w[0:] x[0:] + w[16:] x[16:]) per lane (AVX-512), or
// acc + ((w0 x0 + w2 x2) + (w1 x1 + w3 x3)) over 8-lane quarters (AVX2). Folding the minimum into
// the weights is the fp32 product of the dequantized weights, with no per-block sums of x.
#if defined(MS_AVX512)
static inline void q4_block(const uint8_t *packed16, float d, float mn, __m512 *w) {
    // The block's 16 possible values fma(q, d, min), q = 0..15, in one register, then each
    // weight looked up by its nibble (vpermps reads an index's low 4 bits): the same fma per
    // value as converting each nibble and scaling it, with one fma and two lookups a block
    // instead of two conversions and two fmas.
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(d), _mm512_set1_ps(mn));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)packed16));
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

static inline void q8_block(const int8_t *w32, float d, __m512 *w) {
    q8_floats16(w32, w);
    const __m512 scale = _mm512_set1_ps(d);
    w[0] = _mm512_mul_ps(w[0], scale);
    w[1] = _mm512_mul_ps(w[1], scale);
}

static inline __m512 block_acc(__m512 acc, const __m512 *w, const float *xb) {
    return _mm512_add_ps(acc, _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(xb))));
}
#define VEC __m512
#define VEC_PARTS 2
#define VEC_ZERO _mm512_setzero_ps
#define VEC_SUM hsum512
#elif defined(MS_AVX2)
static inline void q4_block(const uint8_t *packed16, float d, float mn, __m256 *w) {
    q4_floats(packed16, w);
    const __m256 scale = _mm256_set1_ps(d), low = _mm256_set1_ps(mn);
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(w[i], scale, low);
}

static inline void q8_block(const int8_t *w32, float d, __m256 *w) {
    q8_floats(w32, w);
    const __m256 scale = _mm256_set1_ps(d);
    for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(w[i], scale);
}

static inline __m256 block_acc(__m256 acc, const __m256 *w, const float *xb) {
    __m256 a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), _mm256_mul_ps(w[0], _mm256_loadu_ps(xb)));
    __m256 b = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(w[1], _mm256_loadu_ps(xb + 8)));
    return _mm256_add_ps(acc, _mm256_add_ps(a, b));
}
#define VEC __m256
#define VEC_PARTS 4
#define VEC_ZERO _mm256_setzero_ps
#define VEC_SUM hsum256
#endif

// `rows` activation rows (row r at x + r * k) against weight row j, each weight block dequantized
// once for all of them. Every caller inlines it with a constant `rows` (1, GROUP or WIDE_GROUP):
// one function, so a row's arithmetic is the same alone or in a group. The block loops are one
// per format, with the scales converted to floats beforehand (SCALE_CHUNK blocks at a time), so
// nothing is tested inside the loop that does the work: with the format and the scales' source
// tested in every block, one row cost about as much as three (measured: a one-row product was
// 1.6-1.9x slower than now, with the same values).
#define SCALE_CHUNK 512  // blocks whose scales are converted at a time (a row of 16384 inputs)
#ifdef VEC
// Blocks [b_lo, b_hi) of weight row j against `rows` activation rows, added to their accumulators
// `acc` (kept in registers for the range, in memory between ranges: storing a vector and loading it
// back changes no value, so each row's sums are those of one pass over every block in order).
static inline __attribute__((always_inline)) void dot_f32_part(const ms_qmat *m, int64_t j, const float *x,
                                                               VEC *acc, const int rows, int64_t b_lo, int64_t b_hi) {
    const int64_t k = m->k, blocks = k / BLOCK;
    float sc[2 * SCALE_CHUNK];
    VEC a[WIDE_GROUP], w[VEC_PARTS];
    for (int r = 0; r < rows; r++) a[r] = acc[r];
    for (int64_t b0 = b_lo; b0 < b_hi; b0 += SCALE_CHUNK) {
        const int64_t count = b_hi - b0 < SCALE_CHUNK ? b_hi - b0 : SCALE_CHUNK;
        const float *xb = x + b0 * BLOCK;
        if (m->kind == 4) {
            const uint8_t *q = (const uint8_t *)m->w + j * (k / 2) + b0 * 16;
            row_scales(m->s + (j * blocks + b0) * 2, 2 * count, sc);
            for (int64_t b = 0; b < count; b++, q += 16, xb += BLOCK) {
                q4_block(q, sc[2 * b], sc[2 * b + 1], w);
                for (int r = 0; r < rows; r++) a[r] = block_acc(a[r], w, xb + r * k);
            }
        } else {
            const int8_t *q = (const int8_t *)m->w + j * k + b0 * BLOCK;
            row_scales(m->s + j * blocks + b0, count, sc);
            for (int64_t b = 0; b < count; b++, q += BLOCK, xb += BLOCK) {
                q8_block(q, sc[b], w);
                for (int r = 0; r < rows; r++) a[r] = block_acc(a[r], w, xb + r * k);
            }
        }
    }
    for (int r = 0; r < rows; r++) acc[r] = a[r];
}

// The activations a group reads while it meets a tile's weight rows should stay in L1: a group of
// 12 rows of 1536 inputs is 72 KB, so each weight row read it from L2 again (on a 2-core AMD EPYC
// with AVX2, each row past the 4th of a 1536-input product cost half as much again as the first
// few). So a group whose rows exceed ACT_L1_BYTES goes through the blocks in ranges of
// ACT_CHUNK_BYTES, every weight row of the tile taking a range before the next begins; the partial
// sums wait in memory between ranges. Smaller groups take one pass, as before.
#define ACT_L1_BYTES 28672
#define ACT_CHUNK_BYTES 16384
static inline int64_t chunk_blocks(const int rows, const int64_t blocks) {
    const int64_t row_block = (int64_t)rows * BLOCK * (int64_t)sizeof(float);
#if defined(MS_AVX512)
    return blocks;  // measured only with AVX2 (groups of 12): AVX-512 keeps one pass until measured there
#endif
    if (blocks * row_block <= ACT_L1_BYTES) return blocks;
    return ACT_CHUNK_BYTES / row_block > 0 ? ACT_CHUNK_BYTES / row_block : 1;
}

// Weight rows [first, end) of one tile (at most TILE) against `rows` activation rows: y[r * n + j].
static inline __attribute__((always_inline)) void dot_f32_tile(const ms_qmat *m, const float *x, float *y,
                                                               int64_t first, int64_t end, const int rows) {
    const int64_t n = m->n, blocks = m->k / BLOCK, chunk = chunk_blocks(rows, blocks);
    if (chunk >= blocks) {  // the group's activations fit: one pass, the partial sums never leave registers
        for (int64_t j = first; j < end; j++) {
            VEC one[WIDE_GROUP];
            for (int r = 0; r < rows; r++) one[r] = VEC_ZERO();
            dot_f32_part(m, j, x, one, rows, 0, blocks);
            for (int r = 0; r < rows; r++) {
                const float v = VEC_SUM(one[r]);
                y[r * n + j] = m->bias ? v + m->bias[j] : v;
            }
        }
        return;
    }
    VEC acc[TILE][WIDE_GROUP];
    for (int64_t j = first; j < end; j++)
        for (int r = 0; r < rows; r++) acc[j - first][r] = VEC_ZERO();
    for (int64_t c0 = 0; c0 < blocks; c0 += chunk) {
        const int64_t c1 = blocks - c0 < chunk ? blocks : c0 + chunk;
        for (int64_t j = first; j < end; j++) dot_f32_part(m, j, x, acc[j - first], rows, c0, c1);
    }
    for (int64_t j = first; j < end; j++)
        for (int r = 0; r < rows; r++) {
            const float v = VEC_SUM(acc[j - first][r]);
            y[r * n + j] = m->bias ? v + m->bias[j] : v;
        }
}
#else
// Portable C: each value dequantized as q * d + m (or q * d), products summed per block.
static void dot_f32_rows(const ms_qmat *m, int64_t j, const float *x, float *out, const int rows) {
    const int64_t k = m->k, blocks = k / BLOCK;
    float sc[2 * SCALE_CHUNK];
    for (int r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int64_t b0 = 0; b0 < blocks; b0 += SCALE_CHUNK) {
            const int64_t count = blocks - b0 < SCALE_CHUNK ? blocks - b0 : SCALE_CHUNK;
            const int64_t per_block = m->kind == 4 ? 2 : 1;  // Q4_1: d and m; Q8_0: d
            row_scales(m->s + (j * blocks + b0) * per_block, per_block * count, sc);
            for (int64_t b = 0; b < count; b++) {
                const int64_t at = b0 + b;
                float t = 0.0f;
                for (int i = 0; i < BLOCK; i++) {
                    float wv;
                    if (m->kind == 4) {
                        const uint8_t byte = ((const uint8_t *)m->w)[j * (k / 2) + at * 16 + (i & 15)];
                        wv = (float)(i < 16 ? byte & 0x0F : byte >> 4) * sc[2 * b] + sc[2 * b + 1];
                    } else {
                        wv = (float)((const int8_t *)m->w)[j * k + at * BLOCK + i] * sc[b];
                    }
                    t += wv * x[r * k + at * BLOCK + i];
                }
                total += t;
            }
        }
        out[r] = total;
    }
}
#endif

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
// The matmul, as work shared by the team of the call it is in (`team_run`): y[r, j] = x[r, :] . W[j, :]
// (+ bias[j]).

// Per-row preparation: the int8 quantization (acts 1) into the scratch; fp32 rows need none.
static inline void prepare_row(const ms_qmat *m, const float *x, int64_t r, acts8 *a8) {
    const int64_t k = m->k, blocks = k / BLOCK;
    if (m->acts) quantize_row(x + r * k, k, a8->q + r * k, a8->d + r * blocks, a8->s + r * blocks);
}

static void prepare_rows(const ms_qmat *m, const float *x, int64_t rows, acts8 *a8) {
    for (int64_t r = share_lo(rows), hi = share_hi(rows); r < hi; r++) prepare_row(m, x, r, a8);
    team_barrier();
}

// Weight rows [first, end) against `g` activation rows (1 <= g <= WIDE_GROUP), each weight block
// dequantized once for all of them. The row loops are inlined with a constant count in each case.
#ifdef VEC
#define GROUP_CASE(G)                                                                                 \
    case G:                                                                                           \
        dot_f32_tile(m, x, y, first, end, G);                                                         \
        break;
#else
#define GROUP_CASE(G)                                                                                 \
    case G:                                                                                           \
        for (int64_t j = first; j < end; j++) {                                                       \
            float v[G];                                                                               \
            dot_f32_rows(m, j, x, v, G);                                                              \
            for (int i = 0; i < G; i++) y[i * m->n + j] = m->bias ? v[i] + m->bias[j] : v[i];         \
        }                                                                                             \
        break;
#endif

static void group_rows(const ms_qmat *m, const float *x, float *y, int64_t first, int64_t end, int g) {
    switch (g) {
#if WIDE_GROUP > 8
        GROUP_CASE(12)
        GROUP_CASE(11)
        GROUP_CASE(10)
        GROUP_CASE(9)
#endif
#if WIDE_GROUP > GROUP
        GROUP_CASE(8)
        GROUP_CASE(7)
        GROUP_CASE(6)
        GROUP_CASE(5)
#endif
        GROUP_CASE(4)
        GROUP_CASE(3)
        GROUP_CASE(2)
        GROUP_CASE(1)
        default: break;
    }
}
#undef GROUP_CASE

static void matmul_work(const ms_qmat *m, const float *x, int64_t rows, float *y, const acts8 *a8) {
    const int64_t k = m->k, n = m->n, blocks = k / BLOCK, tiles = (n + TILE - 1) / TILE;
    for (int64_t t = share_lo(tiles), hi = share_hi(tiles); t < hi; t++) {
        const int64_t first = t * TILE, end = (t + 1) * TILE < n ? (t + 1) * TILE : n;
        // Activation rows outside, the tile's weight rows inside: a group of rows is read from L2
        // once per tile and meets every weight row of it in L1 (the other order read the group again
        // for each weight row, and prefill ran at L2's bandwidth). Each (row, weight row) pair is
        // computed by the same code either way: the order changes no value.
        int64_t r = 0;
        if (!m->acts) {
            // Groups of WIDE_GROUP rows, then the rest (1 to WIDE_GROUP - 1 rows) as one group: a
            // pending token and its few drafts (lookahead) or a small batch read each weight block
            // once, not once per row (row by row, a 2-row step cost nearly twice a 1-row one and more
            // than a 4-row one).
            while (r < rows) {
                const int g = rows - r >= WIDE_GROUP ? WIDE_GROUP : (int)(rows - r);
                group_rows(m, x + r * k, y + r * n, first, end, g);
                r += g;
            }
        } else {
            for (; r < rows; r++)
                for (int64_t j = first; j < end; j++) {
                    float v = dot_i8(m, j, a8->q + r * k, a8->d + r * blocks, a8->s + r * blocks);
                    y[r * n + j] = m->bias ? v + m->bias[j] : v;
                }
        }
    }
    team_barrier();
}

// Scratch for a matmul of `rows` rows of width k: the int8 rows and their scales (acts 1).
static size_t scratch_bytes(int64_t rows, int64_t k) {
    return (size_t)(rows * k) + sizeof(float) * (size_t)(2 * rows * (k / BLOCK)) + 64;
}

static void scratch_split(void *base, int64_t rows, int64_t k, acts8 *a8) {
    const int64_t blocks = k / BLOCK;
    a8->d = (float *)base;
    a8->s = a8->d + rows * blocks;
    a8->q = (int8_t *)(a8->s + rows * blocks);
}

static void matmul_shared(const ms_qmat *m, const float *x, int64_t rows, float *y, void *scratch) {
    acts8 a8;
    scratch_split(scratch, rows, m->k, &a8);
    if (m->acts) prepare_rows(m, x, rows, &a8);  // ends with a barrier (every thread takes the same branch)
    matmul_work(m, x, rows, y, &a8);
}

// The same, for rows whose preparation the caller did already (prepare_scratch_row, in the loop
// that produced them: one barrier fewer).
static void matmul_prepared(const ms_qmat *m, const float *x, int64_t rows, float *y, void *scratch) {
    acts8 a8;
    scratch_split(scratch, rows, m->k, &a8);
    matmul_work(m, x, rows, y, &a8);
}

static inline void prepare_scratch_row(const ms_qmat *m, const float *x, int64_t rows, int64_t r, void *scratch) {
    acts8 a8;
    scratch_split(scratch, rows, m->k, &a8);
    prepare_row(m, x, r, &a8);
}

static int check_qmat(const ms_qmat *m) {
    if (!m || !m->w || !m->s || m->k <= 0 || m->n <= 0 || m->k % BLOCK) return -1;
    if ((m->kind != 4 && m->kind != 8) || (m->acts != 0 && m->acts != 1)) return -1;
    return 0;
}

typedef struct {
    const ms_qmat *m;
    const float *x;
    int64_t rows;
    float *y;
    void *scratch;
} matmul_call;

static void matmul_job(void *arg) {
    const matmul_call *c = (const matmul_call *)arg;
    matmul_shared(c->m, c->x, c->rows, c->y, c->scratch);
}

// Status codes: 0 ok, -1 a shape or argument the kernels do not take, -2 out of memory.
int ms_matmul(const float *x, int64_t rows, const ms_qmat *m, float *y, int threads) {
    if (check_qmat(m) || rows < 0 || !x || !y) return -1;
    if (rows == 0) return 0;
    void *scratch = malloc(scratch_bytes(rows, m->k));
    if (!scratch) return -2;
    matmul_call call = {m, x, rows, y, scratch};
    team_run(matmul_job, &call, threads);
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

#ifdef MS_AVX2
// `m` query heads (1 to 3) of 64 values that share one KV head, against its columns [first, first + n):
// each head's values exactly as attend_one computes them (each score dot_dim's two chains and hsum,
// its own max, exp and sum in column order, each output lane fma(p, v, o) column after column),
// but every key and value column is read once for the m heads instead of once per head. With
// grouped-query attention (the embedded model: 9 query heads on 3 KV heads) a long context's keys
// and values no longer fit in L2, and reading them once per query head made attention the larger
// part of a decode step. The output goes in two halves of 32 lanes (12 accumulators in registers),
// each reading its half of every value column.
static inline __attribute__((always_inline)) void attend_heads64(const float *q, const int m, const float *keys,
                                                                 const float *values, int64_t kstride,
                                                                 int64_t vstride, int64_t first, int64_t n,
                                                                 float scaling, float *scores, int64_t span,
                                                                 float *o) {
    float top[3] = {-INFINITY, -INFINITY, -INFINITY}, total[3] = {0.0f, 0.0f, 0.0f}, inv[3];
    for (int64_t j = 0; j < n; j++) {
        const float *kj = keys + (first + j) * kstride;
        __m256 s0[3], s1[3];
        for (int g = 0; g < m; g++) s0[g] = s1[g] = _mm256_setzero_ps();
        for (int i = 0; i < 64; i += 16) {
            const __m256 ka = _mm256_loadu_ps(kj + i), kb = _mm256_loadu_ps(kj + i + 8);
            for (int g = 0; g < m; g++) {
                s0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * 64 + i), ka, s0[g]);
                s1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * 64 + i + 8), kb, s1[g]);
            }
        }
        for (int g = 0; g < m; g++) {
            const float score = hsum256(_mm256_add_ps(s0[g], s1[g])) * scaling;
            scores[g * span + j] = score;
            top[g] = score > top[g] ? score : top[g];
        }
    }
    for (int g = 0; g < m; g++) exp_shifted(scores + g * span, top[g], scores + g * span, n);
    for (int64_t j = 0; j < n; j++)
        for (int g = 0; g < m; g++) total[g] += scores[g * span + j];
    for (int g = 0; g < m; g++) inv[g] = 1.0f / total[g];
    for (int half = 0; half < 64; half += 32) {
        __m256 acc[3][4];
        for (int g = 0; g < m; g++)
            for (int i = 0; i < 4; i++) acc[g][i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const float *vj = values + (first + j) * vstride + half;
            __m256 p[3];
            for (int g = 0; g < m; g++) p[g] = _mm256_set1_ps(scores[g * span + j] * inv[g]);
            for (int i = 0; i < 4; i++) {
                const __m256 v = _mm256_loadu_ps(vj + 8 * i);
                for (int g = 0; g < m; g++) acc[g][i] = _mm256_fmadd_ps(p[g], v, acc[g][i]);
            }
        }
        for (int g = 0; g < m; g++)
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + g * 64 + half + 8 * i, acc[g][i]);
    }
}
#endif

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

// The work of each of token i's attention tasks (a head, or the heads that share a KV head:
// attend_tokens): the columns the token attends to, plus one (a padding token, with none, still
// costs its call).
static inline int64_t attention_work(const ms_tokens *t, int64_t i) {
    const int64_t span = t->column[i] - t->first[i] + 1;
    return span > 0 ? span + 1 : 1;
}

// This thread's contiguous share [*lo, *hi) of the attention tasks (`per_token` a token, token by
// token), balanced by their work: in a prefill each token attends to one more column than the one
// before, and shares of equal count gave the last thread most of the work (its teammate waited at
// the barrier long enough to look preempted). Tokens of equal spans (decode) split as by count.
// Task j starts thread k's share when the work before it, times team_size, first reaches k * total.
static void attention_share(const ms_tokens *t, int64_t per_token, int64_t *lo, int64_t *hi) {
    *lo = 0;
    *hi = t->count * per_token;
    if (team_size <= 1) return;
    int64_t total = 0;
    for (int64_t i = 0; i < t->count; i++) total += attention_work(t, i) * per_token;
    const int64_t start = total * team_id, stop = total * (team_id + 1), last = team_id == team_size - 1;
    int64_t before = 0;
    *lo = team_id == 0 ? 0 : *hi;  // a share that starts past the last task is empty
    for (int64_t j = 0; j < t->count * per_token; before += attention_work(t, j / per_token), j++) {
        if (*lo == t->count * per_token && before * team_size >= start) *lo = j;
        if (!last && before * team_size >= stop) {
            *hi = j;
            return;
        }
    }
}

// Every token's heads against its columns. Where there are enough tasks for the threads, or the
// context is long, one task per (token, KV head): the query heads that share a KV head go together
// and attend_heads64 reads its columns once for them (at a context of about 2500 the layers of a
// decode step took 11.9 ms instead of 14.2, two threads). A single token with a short context keeps
// one task per (token, head): its KV heads alone would split unevenly between the threads. Both
// compute every value alike. `scores`: `group` rows of `span` floats per thread.
#define GROUPED_SPAN 1024
static void attend_tokens(const ms_shape *s, const ms_tokens *t, const float *q, const ms_kv *kv, float *out,
                          float *scores, int64_t span) {
    const int64_t heads = s->heads, kv_heads = s->kv_heads, group = s->heads / s->kv_heads, dim = s->dim;
    const int64_t per = t->count * kv_heads >= 2 * team_size || span >= GROUPED_SPAN ? group : 1;
    const int64_t tasks = heads / per;  // per token
    float *mine = scores + (int64_t)team_id * group * span;
    int64_t lo, hi;
    attention_share(t, tasks, &lo, &hi);
    for (int64_t task = lo; task < hi; task++) {
        const int64_t i = task / tasks, row = t->kv_row[i], first = t->first[i];
        int64_t h = (task % tasks) * per;
        const int64_t end = h + per, g = h / group;
        const float *keys = kv->k + row * kv->ks[0] + g * kv->ks[1], *values = kv->v + row * kv->vs[0] + g * kv->vs[1];
#ifdef MS_AVX2
        const int64_t n = t->column[i] - first + 1;
        if (dim == 64 && n > 0) {
            for (; h + 3 <= end; h += 3)
                attend_heads64(q + (i * heads + h) * dim, 3, keys, values, kv->ks[2], kv->vs[2], first, n, s->scaling,
                               mine, span, out + (i * heads + h) * dim);
            for (; h < end; h++)
                attend_heads64(q + (i * heads + h) * dim, 1, keys, values, kv->ks[2], kv->vs[2], first, n, s->scaling,
                               mine, span, out + (i * heads + h) * dim);
        }
#endif
        for (; h < end; h++)
            attend_one(q + (i * heads + h) * dim, keys, values, kv->ks[2], kv->vs[2], first, t->column[i], s->scaling,
                       dim, mine, out + (i * heads + h) * dim);
    }
    team_barrier();
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
    // attend_tokens' scores: a row of span floats per query head of a KV head's group, per thread
    const size_t scores = (size_t)(threads > 0 ? threads : 1) * (size_t)(s->heads / s->kv_heads) * (size_t)w->span;
    size_t floats = (size_t)(n * (hidden + width + width + s->heads * s->dim + 2 * hidden + 3 * s->intermediate)) +
                    scores;
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
    w->mm = (void *)(w->scores + scores);
    return base;
}

static void write_kv(const ms_shape *s, const ms_tokens *t, const ms_kv *kv, const layer_scratch *w, int64_t i);

// Stage 1 (inside a parallel region): norm, fused q/k/v, rotary: q, k, v of every token into w
// (and k, v into `kv` at the tokens' columns when it is given).
static void stage_qkv(const ms_layer *l, const ms_shape *s, const ms_tokens *t, const float *x, layer_scratch *w,
                      const ms_kv *kv) {
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->dim;
    for (int64_t i = share_lo(t->count), hi = share_hi(t->count); i < hi; i++) {
        rms_norm_row(x + i * s->hidden, l->norm1_w, l->eps1, w->normed + i * s->hidden, s->hidden);
        prepare_scratch_row(&l->qkv, w->normed, t->count, i, w->mm);
    }
    team_barrier();
    matmul_prepared(&l->qkv, w->normed, t->count, w->qkv, w->mm);
    for (int64_t i = share_lo(t->count), hi = share_hi(t->count); i < hi; i++) {
        split_rotate(s, w->qkv + i * width, t->cos + i * s->dim, t->sin + i * s->dim, w->q + i * s->heads * s->dim,
                     w->k + i * s->kv_heads * s->dim, w->v + i * s->kv_heads * s->dim);
        if (kv) write_kv(s, t, kv, w, i);
    }
    team_barrier();
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
    for (int64_t i = share_lo(n), hi = share_hi(n); i < hi; i++) {
        for (int64_t c = 0; c < hidden; c++) w->h[i * hidden + c] += x[i * hidden + c];
        rms_norm_row(w->h + i * hidden, l->norm2_w, l->eps2, w->normed2 + i * hidden, hidden);
        prepare_scratch_row(&l->gate_up, w->normed2, n, i, w->mm);
    }
    team_barrier();
    matmul_prepared(&l->gate_up, w->normed2, n, w->gu, w->mm);
    // SiLU(gate) * up, in pieces of SILU_PIECE values (split over the threads even for one token;
    // a value is the same in a vector lane or a tail).
    const int64_t pieces = (inter + SILU_PIECE - 1) / SILU_PIECE;
    for (int64_t task = share_lo(n * pieces), hi = share_hi(n * pieces); task < hi; task++) {
        const int64_t i = task / pieces, c = (task % pieces) * SILU_PIECE;
        const int64_t count = inter - c < SILU_PIECE ? inter - c : SILU_PIECE;
        silu_mul(w->gu + i * 2 * inter + c, w->gu + i * 2 * inter + inter + c, w->act + i * inter + c, count);
    }
    team_barrier();
    // `out` may be `x` itself (ms_layers_forward): x is not read after the first residual above.
    matmul_shared(&l->down, w->act, n, out, w->mm);
    for (int64_t i = share_lo(n * hidden), hi = share_hi(n * hidden); i < hi; i++) out[i] += w->h[i];
    team_barrier();
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

// Where a run of layers may stop early: before layer i (of this call, i > 0) when stop_before[i] is
// set and *pending is nonzero when the threads get there (the engine's flag: a request arrived
// that it can prefill part-way through this step). Read by one thread, the decision shared by all.
typedef struct {
    const volatile int32_t *pending;
    const uint8_t *stop_before;  // [count] or NULL
} ms_points;

// One call's arguments, for the team's job functions below.
typedef struct {
    const ms_layer *layers;
    int64_t count;  // layers
    const ms_shape *s;
    const ms_tokens *t;
    const float *x, *q;
    const ms_kv *kv;
    float *out;
    layer_scratch *w;
    const ms_points *points;  // ms_layers_forward: where it may stop (or NULL)
    int stop;                 // set by thread 0 before a barrier, read by all after it
    int64_t stopped_at;
} layers_call;

static void qkv_job(void *arg) {
    const layers_call *c = (const layers_call *)arg;
    stage_qkv(c->layers, c->s, c->t, c->x, c->w, NULL);
}

static void rest_job(void *arg) {
    const layers_call *c = (const layers_call *)arg;
    stage_rest(c->layers, c->s, c->t, c->x, c->q, c->kv, c->out, c->w);
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
    layers_call call = {.layers = l, .count = 1, .s = s, .t = t, .x = x, .w = &w};
    team_run(qkv_job, &call, threads);
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
    layers_call call = {.layers = l, .count = 1, .s = s, .t = t, .x = x, .q = q, .kv = kv, .out = out, .w = &w};
    team_run(rest_job, &call, threads);
    free(base);
    return 0;
}

static void layers_job(void *arg) {
    layers_call *c = (layers_call *)arg;
    for (int64_t i = 0; i < c->count; i++) {
        if (c->points && i > 0 && c->points->stop_before[i]) {
            if (team_id == 0 && *c->points->pending) {  // the barrier publishes the decision to every thread
                c->stop = 1;
                c->stopped_at = i;
            }
            team_barrier();
            if (c->stop) break;
        }
        const ms_layer *l = c->layers + i;
        float *x = (float *)c->x;
        stage_qkv(l, c->s, c->t, x, c->w, &l->kv);
        stage_rest(l, c->s, c->t, x, c->w->q, &l->kv, x, c->w);  // the layer's output replaces its input
    }
}

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
    layers_call call = {.layers = layers, .count = count, .s = s, .t = t, .x = x, .w = &w,
                        .points = stops ? points : NULL, .stopped_at = count};
    team_run(layers_job, &call, threads);
    *done = call.stopped_at;
    free(base);
    return 0;
}

// RMS norm of rows (the model's final norm, so every path shares this arithmetic too).
int ms_rms_norm(const float *x, int64_t rows, int64_t dim, const float *w, float eps, float *y) {
    if (!x || !w || !y || rows < 0 || dim <= 0) return -1;
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * dim, w, eps, y + r * dim, dim);
    return 0;
}

// How many activation rows share one pass over the weights (one dequantization of each block): a
// step's positions past a multiple of it start another pass (exact lookahead weighs its drafts by it).
int ms_row_group(void) {
#ifdef VEC
    return WIDE_GROUP;
#else
    return 1;
#endif
}

// How the team met contention so far: out[0] calls whose barriers stalled, out[1] calls run on
// the caller alone because of it (both 0 without threads).
void ms_team_contention(int64_t *out) {
#ifdef MS_THREADS
    out[0] = (int64_t)atomic_load(&stalled_calls_total);
    out[1] = (int64_t)atomic_load(&solo_calls_total);
#else
    out[0] = out[1] = 0;
#endif
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
