/* Decoding kernels for the CPU: few-row matrix products and one-query attention.
 *
 * Decoding one token reads every weight once; a CPU does little arithmetic per weight byte, so the
 * speed is how fast the weights stream from memory. BLAS gemv/gemm is tuned for big products; for
 * bf16 and int8 weights it streams a fraction of the machine's bandwidth, and its summation order
 * depends on the number of rows. Here each output is one dot product of 16-lane partial sums added
 * in a fixed order, whatever the number of rows: a row's result does not depend on its batch.
 *
 * Compiled on the user's machine (-march=native) with GCC/Clang vector extensions, threaded with
 * OpenMP (the runtime torch already loaded, so its threads are shared, not doubled).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16u __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

enum { F32 = 0, BF16 = 1, I8 = 2 };  /* element types, as the Python side names them */
#define LANES 16
#define ROWS 4  /* weight rows per inner step, */
#define COLS 4  /* times activation rows: 16 accumulators stay in registers */
#define MAX_HEAD_DIM 256
#ifndef PREFETCH
#define PREFETCH 4096  /* bytes ahead: rows are short, the hardware prefetcher alone starts too late */
#endif

/* Widening loads: bf16 is the top half of a float32, so widening it is a shift. GCC's generic vector
 * conversions from narrow integers come out scalar, hence the intrinsics where the CPU has them. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
static inline f32x16 load_f32(const float *p) { return (f32x16)_mm512_loadu_ps(p); }
static inline f32x16 load_bf16(const uint16_t *p) {
    return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline f32x16 load_i8(const int8_t *p) {
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
typedef union { f32x16 v; __m256 half[2]; } halves;
static inline f32x16 load_f32(const float *p) { return *(const f32x16u *)p; }
static inline f32x16 load_bf16(const uint16_t *p) {
    halves r;
    for (int i = 0; i < 2; i++)
        r.half[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8 * i))), 16));
    return r.v;
}
static inline f32x16 load_i8(const int8_t *p) {
    halves r;
    for (int i = 0; i < 2; i++)
        r.half[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
    return r.v;
}
#else
static inline f32x16 load_f32(const float *p) { return *(const f32x16u *)p; }
static inline f32x16 load_bf16(const uint16_t *p) {
    return (f32x16)(__builtin_convertvector(*(const u16x16u *)p, u32x16) << 16);
}
static inline f32x16 load_i8(const int8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const i8x16u *)p, i32x16), f32x16);
}
#endif

static inline f32x16 load(const void *p, long i, int type) {
    switch (type) {
    case BF16: return load_bf16((const uint16_t *)p + i);
    case I8: return load_i8((const int8_t *)p + i);
    default: return load_f32((const float *)p + i);
    }
}

static inline float sum_lanes(f32x16 v) {  /* halves added pairwise: a fixed order */
    f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float element(const void *p, long i, int type) {
    return type == BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void to_f32(const void *src, int type, float *dst, long n) {
    for (long i = 0; i < n; i++) dst[i] = element(src, i, type);
}

static inline void store(void *dst, long i, int type, float value) {
    if (type == BF16) ((uint16_t *)dst)[i] = f32_to_bf16(value);
    else ((float *)dst)[i] = value;
}

/* Sums of weight rows n..n+ROWS-1 against activation rows b..b+c-1, into sums (B, ROWS). Inlined with
 * constant c and w_type, so the accumulators live in registers and the loads are specialized. */
static inline __attribute__((always_inline)) void dot_block(const float *x, const void *w, const int w_type, long b,
                                                            const int c, long n, long K, float *sums) {
    const int size = w_type == I8 ? 1 : w_type == BF16 ? 2 : 4;
    f32x16 acc[COLS][ROWS] = {{{0}}};
    for (long k = 0; k < K; k += LANES) {
        f32x16 wv[ROWS];
        for (int j = 0; j < ROWS; j++) {
            __builtin_prefetch((const char *)w + ((n + j) * K + k) * size + PREFETCH);
            wv[j] = load(w, (n + j) * K + k, w_type);
        }
        for (int i = 0; i < c; i++) {
            f32x16 xv = load_f32(x + (b + i) * K + k);
            for (int j = 0; j < ROWS; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < c; i++)
        for (int j = 0; j < ROWS; j++) sums[(b + i) * ROWS + j] = sum_lanes(acc[i][j]);
}

static inline __attribute__((always_inline)) void dot_rows_of(const float *x, const void *w, const int w_type, long B,
                                                              long n, long K, float *sums) {
    long b = 0;
    for (; b + COLS <= B; b += COLS)  /* this block of weights stays in L1 across the batch */
        dot_block(x, w, w_type, b, COLS, n, K, sums);
    switch (B - b) {
    case 1: dot_block(x, w, w_type, b, 1, n, K, sums); break;
    case 2: dot_block(x, w, w_type, b, 2, n, K, sums); break;
    case 3: dot_block(x, w, w_type, b, 3, n, K, sums); break;
    }
}

/* sums (B, ROWS): every activation row against weight rows n..n+ROWS-1. */
static void dot_rows(const float *x, const void *w, int w_type, long B, long n, long K, float *sums) {
    switch (w_type) {
    case F32: dot_rows_of(x, w, F32, B, n, K, sums); break;
    case BF16: dot_rows_of(x, w, BF16, B, n, K, sums); break;
    case I8: dot_rows_of(x, w, I8, B, n, K, sums); break;
    }
}

/* x (B, K) as float32: itself, or widened into *widened (freed by the caller). */
static const float *as_f32(const void *x, int x_type, long n, float **widened) {
    *widened = NULL;
    if (x_type == F32) return x;
    if ((*widened = malloc(sizeof(float) * n))) to_f32(x, x_type, *widened, n);
    return *widened;
}

/* y[m] (B, N[m]) = x (B, K) @ w[m] (N[m], K)^T, times scale[m] (N[m],) per output channel where given
 * (int8 weights), for `count` matrices in one pass (q/k/v: one input, three outputs), the outputs one
 * after another from y. x and y are F32 or BF16, the weights F32, BF16 or I8; K is a multiple of 16,
 * each N[m] of ROWS. Returns 0, or -1 out of memory. */
int linear(const void *x_in, int x_type, int count, const void *const *w, int w_type, const float *const *scale,
           void *y, int y_type, long B, const long *N, long K) {
    float *widened;
    const float *x = as_f32(x_in, x_type, B * K, &widened);
    if (!x) return -1;
    long total = 0;
    for (int m = 0; m < count; m++) total += N[m];
#pragma omp parallel for schedule(static)
    for (long row = 0; row < total; row += ROWS) {
        int m = 0;
        long n = row, before = 0;  /* output rows of the matrices before m */
        while (n >= N[m]) n -= N[m], before += N[m++];
        float sums[B * ROWS];
        dot_rows(x, w[m], w_type, B, n, K, sums);
        for (long b = 0; b < B; b++)
            for (int j = 0; j < ROWS; j++) {
                float value = sums[b * ROWS + j];
                store(y, B * before + b * N[m] + n + j, y_type, scale[m] ? value * scale[m][n + j] : value);
            }
    }
    free(widened);
    return 0;
}

static inline float round_to(int type, float value) { return type == BF16 ? bf16_to_f32(f32_to_bf16(value)) : value; }

/* The SwiGLU MLP's first half, y (B, N) = silu(x @ gate^T) * (x @ up^T), its two products streamed
 * together; in bf16 rounded where torch rounds. Types and scales as linear(). */
int swiglu(const void *x_in, int x_type, const void *gate, const void *up, int w_type, const float *gate_scale,
           const float *up_scale, void *y, int y_type, long B, long N, long K) {
    float *widened;
    const float *x = as_f32(x_in, x_type, B * K, &widened);
    if (!x) return -1;
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n += ROWS) {
        float g[B * ROWS], u[B * ROWS];
        dot_rows(x, gate, w_type, B, n, K, g);
        dot_rows(x, up, w_type, B, n, K, u);
        for (long b = 0; b < B; b++)
            for (int j = 0; j < ROWS; j++) {
                float gv = round_to(y_type, gate_scale ? g[b * ROWS + j] * gate_scale[n + j] : g[b * ROWS + j]);
                float uv = round_to(y_type, up_scale ? u[b * ROWS + j] * up_scale[n + j] : u[b * ROWS + j]);
                store(y, b * N + n + j, y_type, round_to(y_type, gv / (1.0f + expf(-gv))) * uv);
            }
    }
    free(widened);
    return 0;
}

/* One query head against its K/V head's slots: scores into p (S,), then the weighted sum of V. Inlined
 * with constant type and D, so the head's accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const void *q, const void *k, const void *v, void *out,
                                                         const int type, long S, const long D, long last,
                                                         const uint8_t *seen, float *p, float *qv) {
    const float scale = 1.0f / sqrtf((float)D);
    to_f32(q, type, qv, D);
    float top = -INFINITY;
    for (long s = 0; s < S; s++) {
        if (seen ? !seen[s] : s > last) { p[s] = -INFINITY; continue; }
        f32x16 acc = {0};
        for (long d = 0; d < D; d += LANES) acc += load_f32(qv + d) * load(k, s * D + d, type);
        p[s] = sum_lanes(acc) * scale;
        if (p[s] > top) top = p[s];
    }
    float total = 0;
    for (long s = 0; s < S; s++) total += (p[s] = expf(p[s] - top));
    f32x16 o[MAX_HEAD_DIM / LANES] = {{0}};
    for (long s = 0; s < S; s++)
        if (p[s] != 0)
            for (long d = 0; d < D; d += LANES) o[d / LANES] += p[s] * load(v, s * D + d, type);
    for (long d = 0; d < D; d++) store(out, d, type, o[d / LANES][d % LANES] / total);
}

/* Attention of T new queries per row against a KV cache, in float32 whatever the storage type.
 * q, out: (B, T, H, D) contiguous; k, v: (B, KVH, S, D) with row stride kv_stride_b and head stride
 * kv_stride_h (elements), the slots contiguous. Query t of row b sees slot s where mask[b, t, s] != 0
 * (mask: (B, T, S)); with no mask, causally, the queries being the last T slots. Heads share K/V in
 * groups of H / KVH. D is a multiple of 16, at most MAX_HEAD_DIM. Returns 0, or -1 out of memory. */
int attention(const void *q, const void *k, const void *v, void *out, int type, long B, long T, long H, long KVH,
              long S, long D, long kv_stride_b, long kv_stride_h, const uint8_t *mask) {
    const long size = type == BF16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * S), *qv = malloc(sizeof(float) * D);
        if (!p || !qv) failed = 1;  /* any thread's failure is a failure: a benign race */
#pragma omp for collapse(3) schedule(static)
        for (long b = 0; b < B; b++)
            for (long t = 0; t < T; t++)
                for (long h = 0; h < H; h++) {
                    if (!p || !qv) continue;
                    const uint8_t *seen = mask ? mask + (b * T + t) * S : NULL;
                    long last = S - T + t;  /* causal: the last slot this query may see */
                    long kv = (b * kv_stride_b + (h / (H / KVH)) * kv_stride_h) * size;
                    long qo = ((b * T + t) * H + h) * D * size;
                    const char *kh = (const char *)k + kv, *vh = (const char *)v + kv, *qh = (const char *)q + qo;
                    char *oh = (char *)out + qo;
                    if (type == BF16 && D == 64) attend(qh, kh, vh, oh, BF16, S, 64, last, seen, p, qv);
                    else if (type == BF16) attend(qh, kh, vh, oh, BF16, S, D, last, seen, p, qv);
                    else if (D == 64) attend(qh, kh, vh, oh, F32, S, 64, last, seen, p, qv);
                    else attend(qh, kh, vh, oh, F32, S, D, last, seen, p, qv);
                }
        free(p);
        free(qv);
    }
    return failed ? -1 : 0;
}

/* out (R, C) = weight * (x / rms(x)), rms in float32; in bf16 rounded where torch rounds: the normed
 * x, then its product with the weight. */
void rms_norm(const void *x, const void *weight, void *out, int type, long R, long C, float eps) {
#pragma omp parallel for schedule(static) if (R * C > 65536)
    for (long r = 0; r < R; r++) {
        float squares = 0;
        for (long c = 0; c < C; c++) squares += element(x, r * C + c, type) * element(x, r * C + c, type);
        float inv = 1.0f / sqrtf(squares / C + eps);
        for (long c = 0; c < C; c++)
            store(out, r * C + c, type, element(weight, c, type) * round_to(type, element(x, r * C + c, type) * inv));
    }
}

/* Rotary embedding in place: x (R, H, D), each head's halves (i, i + D/2) rotated by the angles whose
 * cos and sin are (R, D) in x's type; the products and the sum rounded as torch's x*cos + rot(x)*sin. */
void rope(void *x, const void *cos, const void *sin, int type, long R, long H, long D) {
    long half = D / 2;
#pragma omp parallel for collapse(2) schedule(static) if (R * H * D > 65536)
    for (long r = 0; r < R; r++)
        for (long h = 0; h < H; h++) {
            long at = (r * H + h) * D;
            for (long i = 0; i < half; i++) {
                float x1 = element(x, at + i, type), x2 = element(x, at + i + half, type);
                float c1 = element(cos, r * D + i, type), s1 = element(sin, r * D + i, type);
                float c2 = element(cos, r * D + i + half, type), s2 = element(sin, r * D + i + half, type);
                store(x, at + i, type, round_to(type, x1 * c1) + round_to(type, -x2 * s1));
                store(x, at + i + half, type, round_to(type, x2 * c2) + round_to(type, x1 * s2));
            }
        }
}
