/* Decoding kernels for the CPU: few-row matrix products, and a whole transformer block in one call.
 *
 * Decoding one token reads every weight once; a CPU does little arithmetic per weight byte, so the
 * speed is how fast the weights stream from memory. BLAS gemv/gemm is tuned for big products; for
 * bf16 and int8 weights it streams a fraction of the machine's bandwidth, and its summation order
 * depends on the number of rows. Here each output is one dot product of LANES-wide partial sums added
 * in a fixed order, whatever the number of rows: a row's result does not depend on its batch.
 *
 * Compiled on the user's machine (-march=native) with GCC/Clang vector extensions, threaded with
 * OpenMP (the runtime torch already loaded, so its threads are shared, not doubled). Each instruction-set
 * tier gets code of its own width: 16 floats a vector with AVX-512, 8 with AVX2, 4 with SSE2 and NEON, and
 * product tiles sized for its registers (32 with AVX-512 and NEON, 16 with AVX2 and SSE2). The summation
 * order follows the width, so tiers differ from each other by float rounding; within a tier, every guarantee
 * above holds bit for bit.
 *
 * Within a tier the bits must not depend on the compiler's choices either: built with -ffp-contract=off (the
 * build's flags), it fuses no multiply and add by itself, and every fused multiply-add meant here is written as
 * one (fmadd). With contraction on, where GCC fused followed its tuning for a CPU model (-mtune=znver2 keeps
 * reduction chains unfused, which it decided differently for a lone row than for a tile of rows), so a row's
 * result changed with its batch on one CPU model and not on another.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
#define REGISTERS 32
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define REGISTERS 16
#elif defined(__aarch64__)
#define LANES 4
#define REGISTERS 32
#else  /* SSE2, and any other CPU the vector extensions lower to */
#define LANES 4
#define REGISTERS 16
#endif

typedef float vf __attribute__((vector_size(4 * LANES)));  /* one register of floats */
typedef float vfu __attribute__((vector_size(4 * LANES), aligned(4)));  /* the same, at any float's address */
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vu16 __attribute__((vector_size(2 * LANES)));
typedef uint16_t vu16u __attribute__((vector_size(2 * LANES), aligned(2)));
typedef int8_t vi8u __attribute__((vector_size(LANES), aligned(1)));
typedef uint8_t vu8u __attribute__((vector_size(LANES), aligned(1)));

/* Element types, as the Python side numbers them. The block types hold GGUF's quantized weights. The K-quants
 * (Q4_K, Q5_K, Q6_K) are read as the file holds them, super-blocks of 256 weights (8 sub-blocks of 32; float16
 * scales, 6- or 8-bit sub-block scales), their scales unpacked once a super-block (unpack()). The others are GGUF's
 * blocks of 32, as the file holds them too (18-34 bytes, read unaligned), each opening with a float16 scale a
 * (its float32 value, exact: every float16 is one, looked up in HALVES below):
 *   Q4_0: a, 16 bytes of 4-bit q (byte j: weight j low, j + 16 high); a * (q - 8)
 *   Q4_1: a, float16 offset b, 16 bytes as Q4_0's; a * q + b
 *   Q5_0: a, 32 bits (bit j: weight j's fifth bit of q), 16 bytes as Q4_0's; a * (q - 16)
 *   Q5_1: a, b, 32 bits as Q5_0's, 16 bytes as Q4_0's; a * q + b
 *   Q8_0: a, 32 int8 q; a * q
 * and a K-quant's sub-block: Q4_K, Q5_K (d * sc) * q - dmin * m, Q6_K (d * sc) * (q - 32), sc of 16 weights.
 * A weight is computed exactly as the float32 value the loader decoded (gguf.quants.dequantize): the products
 * a * q of Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K need at most 22 bits and a * q of Q8_0 19, so they are exact, and so
 * is d * sc; adding b rounds once, as there (a fused multiply-add rounds a * q + b once too, the same value; Q4_K's b
 * is minus its dmin * m, whose subtraction it rounds alike); Q6_K's a * (q - 32) rounds once, its one float32
 * product there too. So streaming the blocks gives a float32 model's results from 5-9 bits a weight instead of 32. */
enum { F32 = 0, BF16 = 1, I8 = 2, Q4_1 = 3, Q8_0 = 4, Q4_0 = 5, Q4_K = 6, Q5_K = 7, Q6_K = 8, Q5_0 = 9, Q5_1 = 10,
       Q4_0_STRIPES = 11,  /* Q4_0's blocks laid out again at load for the AVX-512 VNNI tile (repack_stripes) */
       Q4_K_ACROSS = 12, Q5_K_ACROSS = 13, Q6_K_ACROSS = 14 };  /* the K-quants' q laid out again for it (repack_across) */
enum { Q8_0_EIGHTS = 15, Q4_1_EIGHTS = 16, Q5_0_EIGHTS = 17, Q5_1_EIGHTS = 18 };  /* laid out again at load
                                                                                   * for AVX2's tile (repack_across) */
enum { WIDE = 19 };  /* float32 weights already in L1 (dot_rows_of's widened copy): not prefetched */
#define BLOCK 32  /* weights a block, */
#define SUPER 256  /* and a K-quant's super-block */
enum { Q4_1_BYTES = 20, Q8_0_BYTES = 34, Q4_0_BYTES = 18, Q5_0_BYTES = 22, Q5_1_BYTES = 24,
       Q4_K_BYTES = 144, Q5_K_BYTES = 176, Q6_K_BYTES = 210 };  /* a block's, a super-block's */

/* The file's type of weights laid out again at load (the same bytes a block), else type. */
static inline int file_type(int type) {
    return type == Q4_0_STRIPES ? Q4_0 : type == Q8_0_EIGHTS ? Q8_0 : type == Q4_1_EIGHTS ? Q4_1
           : type == Q5_0_EIGHTS ? Q5_0 : type == Q5_1_EIGHTS ? Q5_1
           : type >= Q4_K_ACROSS && type <= Q6_K_ACROSS ? Q4_K + (type - Q4_K_ACROSS) : type;
}
static inline int laid_out(int type) { return type != file_type(type); }

static inline int is_super(int type) {
    return file_type(type) == Q4_K || file_type(type) == Q5_K || file_type(type) == Q6_K;
}

/* Where a K-quant super-block's 4-bit q (Q6_K's low 4 bits) start, in the file's layout and laid out again alike:
 * Q4_K's past d, dmin and the scales, Q5_K's past its fifth bits too, Q6_K's first. */
static inline int nibbles_at(int type) { return file_type(type) == Q4_K ? 16 : file_type(type) == Q5_K ? 48 : 0; }

static inline long group_bytes(int type) {  /* bytes a block (super-block) of `type`; 0 for one value an element */
    switch (file_type(type)) {
    case Q4_1: return Q4_1_BYTES;
    case Q8_0: return Q8_0_BYTES;
    case Q4_0: return Q4_0_BYTES;
    case Q5_0: return Q5_0_BYTES;
    case Q5_1: return Q5_1_BYTES;
    case Q4_K: return Q4_K_BYTES;
    case Q5_K: return Q5_K_BYTES;
    case Q6_K: return Q6_K_BYTES;
    default: return 0;
    }
}

static inline long group_size(int type) { return is_super(type) ? SUPER : BLOCK; }  /* weights a group */

#define ROWS 4  /* weight rows per inner step, times */
#define COLS (REGISTERS / 8)  /* activation rows: ROWS * COLS accumulators, ROWS weights, an input in registers */
#define HELD (LANES == 16 ? ROWS : 1)  /* weight rows whose GGUF block is unpacked at once, as registers allow */
#define MAX_HEAD_DIM 256
#define MAX_GROUP 4  /* query heads attended together against one K/V head */
/* Weights are prefetched PREFETCH bytes ahead (rows are short: the hardware prefetcher alone starts too late),
 * into L2, not L1: a prefetch into L1 holds one of a core's few L1 miss buffers for its whole trip from memory,
 * which capped a core's stream near 10 GB/s; into L2, batch-1 decoding ran 20-50% faster (Zen 4). */
#ifndef PREFETCH
#define PREFETCH 8192
#endif
/* The int8 decoding tiles (across_block, lanes_stripe) read 4 weight rows side by side, each prefetched
 * SIDE_PREFETCH bytes ahead of itself: a 1.7B's row (1-7 KB) is shorter than 8 KB, so PREFETCH landed in a row being
 * read already (asked for late). 24 KB decoded the 1.7B Q4_K_M 1.18x and Q4_0 1.07x faster (the README's int8
 * section); 32 and 64 KB were no better. */
#ifndef SIDE_PREFETCH
#define SIDE_PREFETCH 24576
#endif
/* Pins a loaded vector to a register. Without it GCC folds the activations' loads into the multiply-adds and
 * loads each weight vector again for every activation row: twice the loads, and half the products a cycle. */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__SSE2__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define IN_REGISTER(v) (void)(v)
#endif

/* Widening loads: bf16 is the top half of a float32, so widening it is a shift. GCC's generic vector
 * conversions from narrow integers can come out scalar, hence the intrinsics where the CPU has them. */
#if LANES == 16
#include <immintrin.h>
static inline vf load_f32(const float *p) { return (vf)_mm512_loadu_ps(p); }
static inline vf load_bf16(const uint16_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
static inline vf load_i8(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vi load_u8(const uint8_t *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#elif LANES == 8
#include <immintrin.h>
static inline vf load_f32(const float *p) { return (vf)_mm256_loadu_ps(p); }
static inline vf load_bf16(const uint16_t *p) {
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
static inline vf load_i8(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vi load_u8(const uint8_t *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#elif defined(__SSE2__)  /* no widening moves before SSE4.1: a narrow integer goes to a lane's top by unpacking */
#include <emmintrin.h>
static inline vf load_f32(const float *p) { return (vf)_mm_loadu_ps(p); }
static inline vf load_bf16(const uint16_t *p) {
    return (vf)_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
}
static inline vf load_i8(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    __m128i bytes = _mm_cvtsi32_si128(four), top = _mm_unpacklo_epi16(_mm_setzero_si128(),
                                                                      _mm_unpacklo_epi8(_mm_setzero_si128(), bytes));
    return _mm_cvtepi32_ps(_mm_srai_epi32(top, 24));  /* each byte at its lane's top, sign-extended down */
}
static inline vi load_u8(const uint8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    __m128i bytes = _mm_cvtsi32_si128(four);
    return (vi)_mm_unpacklo_epi16(_mm_unpacklo_epi8(bytes, _mm_setzero_si128()), _mm_setzero_si128());
}
#else  /* NEON and others: the vector extensions' conversions (widening moves on NEON) */
static inline vf load_f32(const float *p) { return *(const vfu *)p; }
static inline vf load_bf16(const uint16_t *p) {
    return (vf)(__builtin_convertvector(*(const vu16u *)p, vu) << 16);
}
static inline vf load_i8(const int8_t *p) {
    return __builtin_convertvector(__builtin_convertvector(*(const vi8u *)p, vi), vf);
}
static inline vi load_u8(const uint8_t *p) { return __builtin_convertvector(*(const vu8u *)p, vi); }
#endif

/* a * b + c, rounded once, where the tier has a fused multiply-add instruction (AVX2's FMA3, AVX-512, NEON);
 * an SSE2-only CPU has none: there, the product rounded, then the sum. */
#if LANES == 16
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif LANES == 8
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#elif defined(__aarch64__)
#include <arm_neon.h>
static inline vf fmadd(vf a, vf b, vf c) { return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b); }
#else
static inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }
#endif

/* With AVX512-BF16, a product of bf16 weights and bf16 activations multiplies 32 pairs an instruction, each
 * pair's two products (exact in float32) added into its float32 lane: twice the rate of widening both sides
 * to float32, from half the bytes of activations. The sums keep one fixed order whatever the rows. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_PAIRS 1
static inline __m512bh load_pairs(const uint16_t *p, int full) {  /* 32 bf16s, or 16 and zeros */
    return (__m512bh)(full ? _mm512_loadu_si512(p) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)p)));
}
#else
#define BF16_PAIRS 0
#endif

static inline int as_pairs(int x_type, int w_type) {  /* whether x times w multiplies bf16 pairs as they are */
    return BF16_PAIRS && x_type == BF16 && w_type == BF16;
}

static inline vf load(const void *p, long i, int type) {
    switch (type) {
    case BF16: return load_bf16((const uint16_t *)p + i);
    case I8: return load_i8((const int8_t *)p + i);
    default: return load_f32((const float *)p + i);
    }
}

#if LANES == 16
#define EACH(f) f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), f(8), f(9), f(10), f(11), f(12), f(13), f(14), f(15)
#elif LANES == 8
#define EACH(f) f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7)
#else
#define EACH(f) f(0), f(1), f(2), f(3)
#endif
#define ZERO(l) 0
#define SAME(l) l

static inline vf splat(float x) {  /* x in every lane: one broadcast (0 + x would add first, for -0's sake) */
    vf v = {x};
    return __builtin_shufflevector(v, v, EACH(ZERO));
}

static inline vf iota(void) { return (vf){EACH(SAME)}; }  /* 0, 1, 2, ... */

/* Lane l's bit of a block's 32-bit word of bits, for the weights first + l: 1 << (first + l). */
static inline vi lane_bits(int first) {
    vi bits;
    for (int l = 0; l < LANES; l++) bits[l] = (int32_t)(1u << (first + l));
    return bits;
}

/* float16 bits as the float32 of the same value (every float16 is one), as numpy's astype(np.float32): with
 * F16C's or AArch64's conversion, else bit by bit. */
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = h >> 10 & 31, m = h & 1023;
    uint32_t bits = sign | (e == 31 ? 0x7f800000 | m << 13 : (e + 112) << 23 | m << 13);
    float f;
    if (e == 0) {  /* zero and the subnormals: m * 2^-24, exact */
        f = (float)m * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* A block of 32's parts (the layouts above): its scale a and offset b (Q4_1, Q5_1; else 0), where its q start, and
 * where its word of fifth bits is (Q5_0, Q5_1). A block's float16s are looked up in HALVES, every float16's float32
 * value (half_to_float's), filled once as the library loads: converted as read, by F16C's instruction, the exact
 * one-row Q4_1 product was 30% slower with AVX-512 (1 thread, Zen 4), its scales' conversion ~2.5 cycles a block
 * and row, where a lookup is two loads, and as fast as float32 scales were. The table is 256 KiB; a matrix's scales,
 * of a few exponents, touch a few KiB of it. */
static float HALVES[1 << 16];

__attribute__((constructor)) static void fill_halves(void) {
    for (uint32_t h = 0; h < 1 << 16; h++) {
        const uint16_t bits = (uint16_t)h;
        HALVES[h] = half_to_float((const uint8_t *)&bits);
    }
}

static inline void block_scales(const uint8_t *block, int type, float *a, float *b) {
    uint16_t h[2];
    memcpy(h, block, 4);
    *a = HALVES[h[0]], *b = type == Q4_1 || type == Q5_1 ? HALVES[h[1]] : 0.0f;
}

static inline int quants_at(int type) {
    switch (type) {
    case Q4_1: return 4;
    case Q5_0: return 6;
    case Q5_1: return 8;
    default: return 2;  /* Q4_0, Q8_0 */
    }
}
static inline int fifth_at(int type) { return type == Q5_1 ? 4 : 2; }

/* A K-quant super-block's scales, unpacked once: a of each sub-block of 32, then b of each (Q6_K: a of each 16
 * weights), as gguf computes them in float32 (d * sc, -(dmin * m)), a vector at a time. */
enum { SUBS = SUPER / BLOCK };
struct scales { float a[2 * SUBS]; };  /* b of sub-block i: a[SUBS + i] */

static inline __attribute__((always_inline)) void unpack(const uint8_t *group, int type, struct scales *s) {
    if (!is_super(type)) return;  /* a block's scales are read with its q (load_block) */
    if (type == Q6_K) {  /* 16 int8 scales from byte 192, times the float16 d at 208 */
        const vf d = splat(half_to_float(group + 208));
        for (int i = 0; i < SUPER / 16; i += LANES) *(vfu *)(s->a + i) = d * load_i8((const int8_t *)group + 192 + i);
        return;
    }
    /* Q4_K, Q5_K: float16 d and dmin, then 12 bytes of 6-bit scales sc and mins m (gguf's Q4_K.get_scale_min):
     * bytes 0-3 hold sc 0-3 (their high 2 bits: sc 4-7's), 4-7 m 0-3 (m 4-7's), 8-11 the low 4 bits of sc 4-7 and
     * (high) m 4-7. As 8 bytes of sc, then 8 of m, four a word. */
    uint32_t word[3], sc_m[4];
    memcpy(word, group + 4, 12);
    sc_m[0] = word[0] & 0x3f3f3f3f;
    sc_m[1] = (word[2] & 0x0f0f0f0f) | (word[0] >> 6 & 0x03030303) << 4;
    sc_m[2] = word[1] & 0x3f3f3f3f;
    sc_m[3] = (word[2] >> 4 & 0x0f0f0f0f) | (word[1] >> 6 & 0x03030303) << 4;
    const float d = half_to_float(group), minus_dmin = -half_to_float(group + 2);
    for (int i = 0; i < 2 * SUBS; i += LANES) {  /* -(dmin * m) = -dmin * m, exactly */
        const vi scales = iota() + (float)i < (float)SUBS;  /* lanes of a: d; of b: -dmin */
        const vf factor = (vf)(((vi)splat(d) & scales) | ((vi)splat(minus_dmin) & ~scales));
        *(vfu *)(s->a + i) = factor * __builtin_convertvector(load_u8((const uint8_t *)sc_m + i), vf);
    }
}

#if LANES == 16
#define SCALES_OF_ROWS 1
/* unpack() of ROWS (4) rows' Q4_K or Q5_K super-blocks at once, the same values: their 16 bytes of d, dmin and
 * 6-bit scales in one register, each row's in a quarter of it, where unpack() takes each row's bit fields apart in
 * scalar code (a one-row Q4_K product 10-20% faster, 1 thread, Zen 4). */
static inline __attribute__((always_inline)) void unpack_rows(const uint8_t *const *group, struct scales *s) {
    typedef uint32_t v16u32 __attribute__((vector_size(64)));
    /* Not through memory: four stores read back as one load would wait for them to retire. Each quarter's index
     * written out: the instruction takes a constant, which Clang requires of the source (GCC of the unrolled code). */
    __m512i rows = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)group[0]));
    rows = _mm512_inserti32x4(rows, _mm_loadu_si128((const __m128i *)group[1]), 1);
    rows = _mm512_inserti32x4(rows, _mm_loadu_si128((const __m128i *)group[2]), 2);
    rows = _mm512_inserti32x4(rows, _mm_loadu_si128((const __m128i *)group[3]), 3);
    const v16u32 h = (v16u32)rows;
    /* words 1-3 of a row are unpack()'s word[0..2]: into its sc_m[0..3], the four words of a quarter */
    const v16u32 a = __builtin_shufflevector(h, h, 1, 3, 2, 3, 5, 7, 6, 7, 9, 11, 10, 11, 13, 15, 14, 15),
                 b = __builtin_shufflevector(h, h, 1, 1, 2, 2, 5, 5, 6, 6, 9, 9, 10, 10, 13, 13, 14, 14),
                 shift = {0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4},
                 mask = {0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f,
                         0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f,
                         0x3f3f3f3f, 0x0f0f0f0f},
                 high = {0, ~0u, 0, ~0u, 0, ~0u, 0, ~0u, 0, ~0u, 0, ~0u, 0, ~0u, 0, ~0u};
    const __m512i sc_m = (__m512i)((a >> shift & mask) | ((b >> 6 & 0x03030303) << 4 & high));
    const __m256 halves = _mm256_cvtph_ps((__m128i)__builtin_shufflevector(h, h, 0, 4, 8, 12));  /* d, dmin a row */
    const vf sign = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};  /* -(dmin * m) = -dmin * m */
#define SCALES_OF_ROW(j)                                                                                      \
    *(vfu *)s[j].a = sign * (vf)_mm512_permutexvar_ps(_mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1,        \
        2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j,   \
        2 * j), _mm512_castps256_ps512(halves)) *                                                             \
        (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(sc_m, j)))
    SCALES_OF_ROW(0), SCALES_OF_ROW(1), SCALES_OF_ROW(2), SCALES_OF_ROW(3);
#undef SCALES_OF_ROW
}
#else
#define SCALES_OF_ROWS 0
#endif

/* unpack() of ROWS rows' groups (the exact and the int8 products' loops alike). */
static inline __attribute__((always_inline)) void unpack_each(const uint8_t *const *group, int type,
                                                              struct scales *s) {
#if SCALES_OF_ROWS
    if (ROWS == 4 && (type == Q4_K || type == Q5_K)) {
        unpack_rows(group, s);
        return;
    }
#endif
    for (int j = 0; j < ROWS; j++) unpack(group[j], type, &s[j]);
}

/* `width` bits of bytes (widened: 0-255) from bit `first` at bit `to`, the others 0: a shift, and a mask unless
 * the shift leaves none but them (the byte's top bits, brought down to bit 0). */
static inline vi bits_of(vi bytes, int first, int width, int to) {
    const vi moved = first >= to ? bytes >> (first - to) : bytes << (to - first);
    return first + width == 8 && to == 0 ? moved : moved & (((1 << width) - 1) << to);
}

/* Sub-block `base + part` of a group (a block: 0 + 0) as BLOCK / LANES vectors of its 32 weights, its scales s
 * unpacked (the layouts above). A block's bytes of 4-bit q hold weights j (low 4 bits) and j + 16 (high): a
 * vector of bytes gives LANES weights of each half. Q4_0's and Q4_1's (Q4_K's) weights take only 16 values, so with
 * AVX-512 each weight is a lane permutation of those values by its q. Q5_0's and Q5_1's fifth bits are tested lane
 * by lane against the word of bits (a mask, then the bit's value: no variable shifts, which SSE2 lacks). A
 * K-quant's bits of a sub-block are at one shift in every byte (GGUF's order): vectors of bytes, each shifted
 * alike. */
static inline __attribute__((always_inline)) void load_block(const uint8_t *block, int base, const int part,
                                                             int type, const struct scales *s, vf *out) {
    const int sub = base + part;  /* base a multiple of 4: part, a constant, gives the shifts */
    float a, b;
    if (is_super(type)) a = s->a[type == Q6_K ? 0 : sub], b = s->a[SUBS + (type == Q6_K ? 0 : sub)];
    else block_scales(block, type, &a, &b);
    if (type == Q8_0) {
        for (int v = 0; v < BLOCK / LANES; v++)
            out[v] = splat(a) * load_i8((const int8_t *)block + quants_at(type) + v * LANES);
        return;
    }
    if (type == Q4_0 || type == Q4_1) {
        const uint8_t *q = block + quants_at(type);
#if LANES == 16
        __m512 values = (__m512)(type == Q4_0 ? splat(a) * (iota() - 8.0f) : splat(a) * iota() + b);
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        out[0] = (vf)_mm512_permutexvar_ps(bytes, values);  /* it reads each lane's low 4 bits */
        out[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
#else
        for (int v = 0; v < 16 / LANES; v++) {  /* a byte's two weights from one widened load */
            vi bytes = load_u8(q + v * LANES);
            if (type == Q4_0) {
                out[v] = splat(a) * __builtin_convertvector((bytes & 15) - 8, vf);
                out[v + 16 / LANES] = splat(a) * __builtin_convertvector((bytes >> 4) - 8, vf);
            } else {
                out[v] = fmadd(splat(a), __builtin_convertvector(bytes & 15, vf), splat(b));
                out[v + 16 / LANES] = fmadd(splat(a), __builtin_convertvector(bytes >> 4, vf), splat(b));
            }
        }
#endif
        return;
    }
    if (type == Q4_K || type == Q5_K) {  /* q's low 4 bits: sub-blocks 2p and 2p + 1 share 32 bytes, low and high */
        const uint8_t *q = block + nibbles_at(type) + sub / 2 * 32, *fifth = block + 16;
        const int shift = part % 2 * 4;
#if LANES == 16
        if (type == Q4_K) {
            const __m512 values = (__m512)(splat(a) * iota() + b);  /* an exact product: as one multiply-add */
            for (int v = 0; v < 2; v++)  /* the permutation reads each lane's low 4 bits */
                out[v] = (vf)_mm512_permutexvar_ps((__m512i)(load_u8(q + v * LANES) >> shift), values);
            return;
        }
#endif
        for (int v = 0; v < BLOCK / LANES; v++) {
            vi qv = bits_of(load_u8(q + v * LANES), shift, 4, 0);
            if (type == Q5_K) qv |= bits_of(load_u8(fifth + v * LANES) >> base, part, 1, 4);  /* bit sub of byte j */
            out[v] = fmadd(splat(a), __builtin_convertvector(qv, vf), splat(b));
        }
        return;
    }
    if (type == Q6_K) {  /* 128 bytes of q's low 4 bits, then 64 of its high 2 */
        const uint8_t *low = block + sub / 4 * 64 + sub % 2 * 32, *high = block + 128 + sub / 4 * 32;
        const int low_shift = part / 2 * 4, high_shift = part * 2;
        for (int v = 0; v < BLOCK / LANES; v++) {
            vi qv = bits_of(load_u8(low + v * LANES), low_shift, 4, 0) |
                    bits_of(load_u8(high + v * LANES), high_shift, 2, 4);
            out[v] = splat(s->a[2 * sub + v * LANES / 16]) * __builtin_convertvector(qv - 32, vf);
        }
        return;
    }
    const uint8_t *q = block + quants_at(type);  /* Q5_0, Q5_1 */
    uint32_t fifth;
    memcpy(&fifth, block + fifth_at(type), 4);
    for (int v = 0; v < 16 / LANES; v++) {
        vi bytes = load_u8(q + v * LANES), low = bytes & 15, high = bytes >> 4;
        const vi low_bits = lane_bits(v * LANES), high_bits = lane_bits(16 + v * LANES);
        low |= ((low_bits & (int32_t)fifth) != 0) & 16, high |= ((high_bits & (int32_t)fifth) != 0) & 16;
        if (type == Q5_0) {
            out[v] = splat(a) * __builtin_convertvector(low - 16, vf);
            out[v + 16 / LANES] = splat(a) * __builtin_convertvector(high - 16, vf);
        } else {
            out[v] = fmadd(splat(a), __builtin_convertvector(low, vf), splat(b));
            out[v + 16 / LANES] = fmadd(splat(a), __builtin_convertvector(high, vf), splat(b));
        }
    }
}

/* Lanes added pairwise, halves first: a fixed order. */
static inline float sum_lanes(vf v) {
#if LANES == 16
    typedef float half __attribute__((vector_size(32)));
    half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif LANES == 8
    vf a = v;
#endif
#if LANES >= 8
    typedef float quarter __attribute__((vector_size(16)));
    quarter b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
    vf b = v;
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* sum_lanes of LANES vectors, lane i of the result from v[i]: each step adds the same pairs as sum_lanes, two
 * vectors' halves at a time (for ROWS * COLS = LANES accumulators). */
#if LANES == 16
#define SUM_ALL 1
_Static_assert(ROWS * COLS == LANES, "one lane a tile's accumulator");
static inline vf sum_lanes_of(const vf *v) {
    vf a[8], b[4], c[2];
    for (int p = 0; p < 8; p++)
        a[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * p], v[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int p = 0; p < 4; p++)
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * p], b[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif LANES == 8
#define SUM_ALL 1
_Static_assert(ROWS * COLS == LANES, "one lane a tile's accumulator");
static inline vf sum_lanes_of(const vf *v) {
    vf b[4], c[2];
    for (int p = 0; p < 4; p++)
        b[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(v[2 * p], v[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int p = 0; p < 2; p++)
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(b[2 * p], b[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#else
#define SUM_ALL 0
#endif
/* e^x in every lane, for softmax and SiLU: e^x = 2^n e^r with x = n ln2 + r, |r| <= ln2/2, and e^r a degree-6
 * polynomial (Cephes' expf), within 1 ulp of e^x (measured over [-87.3, 88]); 0 below -87.3, near the smallest
 * normal, and e^88 above 88 (finite: 2^n stays a float). expf one lane at a time was a third of batch-16
 * attention. */
static inline vf exp_lanes(vf x) {
    vi seen = x >= -87.3f, big = x > 88.0f;
    x = (vf)((vi)x & seen);  /* the lanes below (-inf: masked slots) compute e^0, then become 0 */
    x = (vf)(((vi)x & ~big) | ((vi)splat(88.0f) & big));
    /* round to nearest: adding 1.5 * 2^23 drops the fraction */
    vf n = fmadd(x, splat(1.44269504f), splat(12582912.0f)) - 12582912.0f;
    vf r = fmadd(n, splat(2.12194440e-4f), fmadd(n, splat(-0.693359375f), x));  /* x - n ln2, ln2 in two parts */
    vf e = splat(1.9875691500e-4f);
    e = fmadd(e, r, splat(1.3981999507e-3f));
    e = fmadd(e, r, splat(8.3334519073e-3f));
    e = fmadd(e, r, splat(4.1665795894e-2f));
    e = fmadd(e, r, splat(1.6666665459e-1f));
    e = fmadd(e, r, splat(5.0000001201e-1f));
    e = fmadd(e * r, r, r) + 1.0f;
    vf two_to_n = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return (vf)((vi)(e * two_to_n) & seen);
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

static inline void store(void *dst, long i, int type, float value) {
    if (type == BF16) ((uint16_t *)dst)[i] = f32_to_bf16(value);
    else ((float *)dst)[i] = value;
}

static inline float round_to(int type, float value) { return type == BF16 ? bf16_to_f32(f32_to_bf16(value)) : value; }

static inline vf round_lanes(int type, vf v) {  /* round_to, a vector at a time */
    if (type != BF16) return v;
    vu u = (vu)v, nan = (vu)(v != v);
    u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
    return (vf)((u & ~nan) | (0x7fc00000u & nan));
}

static inline void store_lanes(void *dst, long i, int type, vf v) {  /* store, a vector at a time */
    if (type == BF16) *(vu16u *)((uint16_t *)dst + i) = __builtin_convertvector((vu)round_lanes(BF16, v) >> 16, vu16);
    else *(vfu *)((float *)dst + i) = v;
}

static inline long padded(long n) { return (n + LANES - 1) / LANES * LANES; }

static inline long size_of(int type) { return type == I8 ? 1 : type == BF16 ? 2 : 4; }

static inline long offset_of(long i, int type) {  /* where element i's bytes (its group's) are */
    return group_bytes(type) ? i / group_size(type) * group_bytes(type) : i * size_of(type);
}

static inline void prefetch_weights(const void *w, long i, int w_type) {  /* ahead of element i, into L2 */
    if (w_type != WIDE) __builtin_prefetch((const char *)w + offset_of(i, w_type) + PREFETCH, 0, 1);  /* prefetcht2 */
}

/* Where weight row j's elements k..k + LANES - 1 (k a multiple of LANES) are in a widened copy (dot_rows_of's, of
 * ROWS rows): the rows' vectors side by side, so that its loop steps one address, not ROWS (GCC kept some of them
 * on the stack). */
static inline long wide_at(int j, long k) { return k * ROWS + j * LANES; }

/* Sums of weight rows 0..ROWS-1 of w against activation rows 0..c-1 of x, into sums (c, LANES), its first ROWS
 * columns; the weights as float32 also into `keep` (ROWS rows of K, wide_at's layout), unless NULL. Inlined with
 * constant c and types, so the accumulators live in registers and the loads are specialized. */
static inline __attribute__((always_inline)) void dot_block(const void *x, const int x_type, const void *w,
                                                            const int w_type, const int c, long K, float *sums,
                                                            float *keep) {
    vf acc[COLS][ROWS] = {{{0}}};
    if (group_bytes(w_type)) {  /* a block at a time: each lane's sums in the float32 weights' order */
        const long G = group_size(w_type);
        for (long k = 0; k < K; k += G) {  /* a group's scales unpacked once for its blocks */
            const uint8_t *group[ROWS];
            struct scales s[ROWS];
            for (int j = 0; j < ROWS; j++) {
                group[j] = (const uint8_t *)w + offset_of(j * K + k, w_type);
                for (long at = 0; at < group_bytes(w_type); at += 64)  /* each cache line of it, ahead */
                    __builtin_prefetch(group[j] + at + PREFETCH, 0, 1);  /* prefetcht2 */
            }
            unpack_each(group, w_type, s);
            const int parts = G / BLOCK < 4 ? G / BLOCK : 4;  /* sub-blocks base + part */
            for (int base = 0; base < G / BLOCK; base += parts)
#pragma GCC unroll 4
                for (int part = 0; part < parts; part++)  /* unrolled: constant shifts */
                    for (int j0 = 0; j0 < ROWS; j0 += HELD) {
                        const long at = k + (base + part) * BLOCK;
                        vf wv[HELD][BLOCK / LANES];
                        for (int j = 0; j < HELD; j++) {
                            load_block(group[j0 + j], base, part, w_type, &s[j0 + j], wv[j]);
                            if (keep)
                                for (int v = 0; v < BLOCK / LANES; v++)
                                    *(vf *)(keep + wide_at(j0 + j, at + v * LANES)) = wv[j][v];
                        }
                        for (int i = 0; i < c; i++)
                            for (int v = 0; v < BLOCK / LANES; v++) {
                                vf xv = load(x, i * K + at + v * LANES, x_type);
                                IN_REGISTER(xv);
                                for (int j = 0; j < HELD; j++)
                                    acc[i][j0 + j] = fmadd(xv, wv[j][v], acc[i][j0 + j]);
                            }
                    }
        }
#if BF16_PAIRS
    } else if (as_pairs(x_type, w_type)) {  /* no widening: the CPU multiplies bf16 pairs itself */
        for (long k = 0; k < K; k += 2 * LANES) {
            const int full = k + 2 * LANES <= K;
            __m512bh wv[ROWS];
            for (int j = 0; j < ROWS; j++) {
                prefetch_weights(w, j * K + k, w_type);
                wv[j] = load_pairs((const uint16_t *)w + j * K + k, full);
            }
            for (int i = 0; i < c; i++) {
                __m512bh xv = load_pairs((const uint16_t *)x + i * K + k, full);
                for (int j = 0; j < ROWS; j++) acc[i][j] = (vf)_mm512_dpbf16_ps((__m512)acc[i][j], xv, wv[j]);
            }
        }
#endif
    } else {
        for (long k = 0; k < K; k += LANES) {
            vf wv[ROWS];
            for (int j = 0; j < ROWS; j++) {
                prefetch_weights(w, j * K + k, w_type);
                wv[j] = w_type == WIDE ? load_f32((const float *)w + wide_at(j, k)) : load(w, j * K + k, w_type);
                IN_REGISTER(wv[j]);
                if (keep) *(vf *)(keep + wide_at(j, k)) = wv[j];
            }
            for (int i = 0; i < c; i++) {
                vf xv = load(x, i * K + k, x_type);
                IN_REGISTER(xv);
                for (int j = 0; j < ROWS; j++) acc[i][j] = fmadd(xv, wv[j], acc[i][j]);
            }
        }
    }
#if SUM_ALL
    if (c == COLS) {  /* all at once: the same additions as sum_lanes, in a third of the instructions */
        vf all = sum_lanes_of((const vf *)acc);
        for (int i = 0; i < c; i++) memcpy(sums + i * LANES, (const float *)&all + i * ROWS, sizeof(float) * ROWS);
        return;
    }
#endif
    for (int i = 0; i < c; i++)
        for (int j = 0; j < ROWS; j++) sums[i * LANES + j] = sum_lanes(acc[i][j]);
}

static void dot_wide(const void *x, int x_type, const float *wide, long B, long K, float *sums);

/* sums (B, LANES), its first ROWS columns: every activation row of x (B, K) against weight rows 0..ROWS-1 of w. */
static inline __attribute__((always_inline)) void dot_rows_of(const void *x, const int x_type, const void *w,
                                                              const int w_type, long B, long K, float *sums) {
    const long row = K * size_of(x_type);
    if (w_type != F32 && w_type != WIDE && B > COLS && !as_pairs(x_type, w_type)) {
        /* Widened once for the whole batch, not once per COLS activation rows: by the first COLS rows, whose
         * multiply-adds hide the widening, and kept in L1 for the others (the same values, so the same sums). */
        float wide[ROWS * K] __attribute__((aligned(64)));
        dot_block(x, x_type, w, w_type, COLS, K, sums, wide);
        dot_wide((const char *)x + COLS * row, x_type, wide, B - COLS, K, sums + COLS * LANES);
        return;
    }
    long b = 0;
    for (; b + COLS <= B; b += COLS)  /* this block of weights stays in L1 across the batch */
        dot_block((const char *)x + b * row, x_type, w, w_type, COLS, K, sums + b * LANES, NULL);
    switch (B - b) {  /* the rest, fewer than COLS */
    case 1: dot_block((const char *)x + b * row, x_type, w, w_type, 1, K, sums + b * LANES, NULL); break;
#if COLS == 4
    case 2: dot_block((const char *)x + b * row, x_type, w, w_type, 2, K, sums + b * LANES, NULL); break;
    case 3: dot_block((const char *)x + b * row, x_type, w, w_type, 3, K, sums + b * LANES, NULL); break;
#endif
    }
}

/* dot_rows_of for widened weights (ROWS, K), whatever their type was: a prompt's products spend most of their time
 * here. A function of its own: compiled inside each type's, with the unpacking code beside it, its loop kept two
 * addresses and a weight vector on the stack and reloaded them every step (~10% slower). */
static __attribute__((noinline)) void dot_wide(const void *x, int x_type, const float *wide, long B, long K,
                                               float *sums) {
    if (x_type == BF16) dot_rows_of(x, BF16, wide, WIDE, B, K, sums);
    else dot_rows_of(x, F32, wide, WIDE, B, K, sums);
}

/* sums (B, LANES): every activation row of x (B, K) of type X against weight rows n..n+LANES-1 of type W, ROWS
 * at a time; a function for each pair of types. Inlined all into one function (150 KB of code once the block
 * types came), GCC compiled the Q4_1 prompt products' loop 8-13% slower: each is compiled on its own. */
#define DOT_ROWS_AS(X, W)                                                                                      \
    static __attribute__((noinline)) void dot_rows_##X##_##W(const void *x, const void *w, long B, long n,      \
                                                            long K, float *sums) {                            \
        for (int j = 0; j < LANES; j += ROWS)                                                                  \
            dot_rows_of(x, X, (const char *)w + offset_of((n + j) * K, W), W, B, K, sums + j);                 \
    }
#define DOT_ROWS_OF_ALL(X) DOT_ROWS_AS(X, F32) DOT_ROWS_AS(X, BF16) DOT_ROWS_AS(X, I8) DOT_ROWS_AS(X, Q4_1)       \
    DOT_ROWS_AS(X, Q8_0) DOT_ROWS_AS(X, Q4_0) DOT_ROWS_AS(X, Q4_K) DOT_ROWS_AS(X, Q5_K) DOT_ROWS_AS(X, Q6_K)      \
    DOT_ROWS_AS(X, Q5_0) DOT_ROWS_AS(X, Q5_1)
DOT_ROWS_OF_ALL(F32)
DOT_ROWS_OF_ALL(BF16)

/* sums (B, LANES): every activation row of x (B, K) against weight rows n..n+LANES-1. */
static void dot_rows(const void *x, int x_type, const void *w, int w_type, long B, long n, long K, float *sums) {
#define DOT_ROWS(X)                                                                \
    switch (w_type) {                                                              \
    case F32: dot_rows_##X##_F32(x, w, B, n, K, sums); break;                      \
    case BF16: dot_rows_##X##_BF16(x, w, B, n, K, sums); break;                    \
    case I8: dot_rows_##X##_I8(x, w, B, n, K, sums); break;                        \
    case Q4_1: dot_rows_##X##_Q4_1(x, w, B, n, K, sums); break;                    \
    case Q8_0: dot_rows_##X##_Q8_0(x, w, B, n, K, sums); break;                    \
    case Q4_0: dot_rows_##X##_Q4_0(x, w, B, n, K, sums); break;                    \
    case Q4_K: dot_rows_##X##_Q4_K(x, w, B, n, K, sums); break;                    \
    case Q5_K: dot_rows_##X##_Q5_K(x, w, B, n, K, sums); break;                    \
    case Q6_K: dot_rows_##X##_Q6_K(x, w, B, n, K, sums); break;                    \
    case Q5_0: dot_rows_##X##_Q5_0(x, w, B, n, K, sums); break;                    \
    case Q5_1: dot_rows_##X##_Q5_1(x, w, B, n, K, sums); break;                    \
    }
    if (x_type == BF16) DOT_ROWS(BF16) else DOT_ROWS(F32)
#undef DOT_ROWS
}

/* ---- Opt-in: activations quantized to 8 bits, integer dot products (llama.cpp's way; not exact) ----
 * The exact products above decode every weight to its float32 value and multiply-add it with a float32
 * activation: for the K-quants that decoding, not memory, bounds a decoding step. Asked for (linear()'s and
 * blocks()' int8), each product input's rows are quantized once, in blocks of 32 as llama.cpp's
 * quantize_row_q8_0 does (a float32 scale d = max |x| / 127, q = x / d rounded to the nearest, ties to even), and
 * each weight block (a K-quant's sub-block) of 32 is multiplied with the matching activations' block in integers:
 * sum q_w q_x, exact in int32, then scaled in float32, a d (sum q_w q_x) + b d (sum q_x) for a weight a q_w + b
 * (a signed q_w goes as an unsigned u - o, the - o (sum q_x) added in int32: int8_offset).
 * A row's result depends on its own activations only, as the exact products': none on its batch. Weight types
 * without code here (float32, bf16, int8 with scales) keep the exact products. */
typedef int8_t v32i8 __attribute__((vector_size(32)));
typedef int8_t v32i8u __attribute__((vector_size(32), aligned(1)));
typedef uint8_t v32u8 __attribute__((vector_size(32)));
typedef uint8_t v32u8u __attribute__((vector_size(32), aligned(1)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint8_t v16u8u __attribute__((vector_size(16), aligned(1)));
typedef int32_t v8i32 __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));

/* Two 16-byte halves as one 32: a shuffle where a register holds 32 bytes (one insert on AVX2; through memory, a
 * union's two stores then one load would stall the load), else a union (GCC makes that shuffle a byte at a time on
 * SSE2). */
union halves {
    v32u8 whole;
    v16u8 half[2];
};
static inline v32u8 joined(v16u8 low, v16u8 high) {
#if defined(__AVX2__)  /* vinserti128 itself: GCC's code for the vectors' shuffle moved each half first (3 uops) */
    return (v32u8)_mm256_inserti128_si256(_mm256_castsi128_si256((__m128i)low), (__m128i)high, 1);
#else
    return (union halves){.half = {low, high}}.whole;
#endif
}

#if LANES == 16 && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define ACROSS 1  /* the K-quants' tile below, a 32-bit lane for each sub-block (across_block) */
#else
#define ACROSS 0
#endif

#if LANES == 16 && defined(__AVX512VNNI__)
#define LANE_BLOCKS 1  /* the blocks of 32's tile below, a 32-bit lane for each block (lanes_block, lanes_rows) */
#else
#define LANE_BLOCKS 0
#endif
#if LANES == 8 && defined(__F16C__)
#define EIGHT_ROWS 1  /* AVX2: Q4_0, Q8_0 and the K-quants laid out 8 rows side by side (eights_block) */
#else
#define EIGHT_ROWS 0
#endif
enum { EIGHTS = 8 };  /* EIGHT_ROWS: rows laid out together, a group */
enum { STRIPE = 16 * BLOCK };  /* LANE_BLOCKS: 16 blocks of a row, one a lane */
static inline long stripes_of(long K) { return (K / BLOCK + 15) / 16; }

/* A product input's rows (R, K) quantized: q (R, K), and for each block of 32, its scale d and d * (sum of its q).
 * With ACROSS, where K is whole super-blocks, `across` holds q again in across_block's order: each 256 values as 4
 * steps of 64 bytes, step u's 32-bit lane l the 4 values 4 (2u + l / 8).. of block l % 8, and `minus32` of each 256
 * values -32 (sum of q) of each block's first 16 in lane b, of its last 16 in lane b + 8 (Q6_K's q - 32, in
 * halves_added's order: an activation row's, once for every weight row). With LANE_BLOCKS, `sum`
 * holds each block's sum of q, and `lanes` q + 128 (unsigned) in lanes_rows' order: each stripe of 16 blocks (the
 * last padded with zeros) as 8 steps of 64 bytes, step u's lane l the 4 values 4u.. of block BLOCK_OF(l). */
struct int8_rows {
    int8_t *q;
    float *d, *s;
    int8_t *across;
    int32_t *sum;
    uint8_t *lanes;  /* stripes_of(K) * STRIPE bytes a row */
    vi *minus32;  /* K / SUPER vectors a row */
};

#if ACROSS
static inline vi dpbusd_of(vi acc, vi u, vi x) {  /* acc + 4 products of unsigned u and signed x a lane */
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)x);
}

static inline vi dpbusd(vi acc, vi u, const int8_t *x) { return dpbusd_of(acc, u, (vi)_mm512_loadu_si512(x)); }

/* Sub-blocks' integer sums in lanes 0-7 from u's 16 lanes and in lanes 8-15 from v's, lanes k and k + 8 of each
 * added (across_ints' two quarters of a sub-block's weights, or of Q6_K's 16 of one scale): exact, in int32. So
 * that the float work (a convert, a d, a multiply-add) is done once for two weight rows (Q4_K, Q5_K) or for a
 * Q6_K row's 16 scales, not once for each half: on Zen 4 it shares its pipes with dpbusd. */
static inline vi halves_added(vi u, vi v) {
    return (vi)_mm512_mask_blend_epi32(0xff00, (__m512i)u, (__m512i)v) +  /* u's lanes 0-7, v's 8-15 */
           (vi)_mm512_shuffle_i64x2((__m512i)u, (__m512i)v, 0x4e);        /* u's lanes 8-15, v's 0-7 */
}

/* n quantized values (whole super-blocks) into across_block's order: of each 256, 64 words of 4 (block b's at 8b..),
 * step u's lane l the word 8 (l % 8) + 2u + l / 8, blocks 0-3 from the first 128 bytes and 4-7 from the last 128:
 * a permutation of each and a blend a step, where it was 16 copies of 4 bytes. */
static void across_order(const int8_t *q, long n, int8_t *across, vi *minus32) {
    const vi l = __builtin_convertvector(iota(), vi), first = (l & 3) * 8 + (l >> 3);
    for (long at = 0; at < n; at += SUPER) {
        const int8_t *steps = across + at;
        const __m512i a0 = _mm512_loadu_si512(q + at), a1 = _mm512_loadu_si512(q + at + 64),
                      a2 = _mm512_loadu_si512(q + at + 128), a3 = _mm512_loadu_si512(q + at + 192);
        for (int u = 0; u < 4; u++) {
            const __m512i word = (__m512i)(first + 2 * u);
            _mm512_storeu_si512(across + at + 64 * u,
                                _mm512_mask_blend_epi32(0xf0f0, _mm512_permutex2var_epi32(a0, word, a1),
                                                        _mm512_permutex2var_epi32(a2, word, a3)));
        }
        const vi o = (vi)_mm512_set1_epi8(32);
        minus32[at / SUPER] = -halves_added(dpbusd(dpbusd((vi){0}, o, steps), o, steps + 64),
                                            dpbusd(dpbusd((vi){0}, o, steps + 128), o, steps + 192));
    }
}
#endif

#if LANE_BLOCKS
/* The blocks of 32 with AVX-512 and VNNI take 16 blocks of a row (a stripe) at a time, one a 32-bit lane, so that
 * one convert and one multiply-add scale 16 blocks' integer sums at once. Lane l holds block BLOCK_OF(l) of its
 * stripe, the order that comes of adding each block's 4 lanes of a register of 4 blocks (block_sums) and of their
 * transposition (to_lanes); its scales and sums are permuted to it (in_lanes). */
#define BLOCK_OF(l) (4 * ((l) % 4) + (l) / 4)
static inline __m512i block_order(void) {
    return _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
}

static inline __mmask16 first_lanes(int n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }

/* Stripe g of a row of `blocks` starts at block stripe_first: 16g, but a row's last stripe ends at its end,
 * overlapping the one before where blocks is no multiple of 16 (so that every stripe is 16 blocks, read whole,
 * but in rows of fewer than 16), its lanes of blocks before 16g left out (stripe_lanes). */
static inline long stripe_first(long blocks, long g) {
    return blocks >= 16 && 16 * g + 16 > blocks ? blocks - 16 : 16 * g;
}
static inline int stripe_valid(long blocks) { return blocks < 16 ? (int)blocks : 16; }  /* blocks a stripe reads */

static inline __mmask16 stripe_lanes(long blocks, long g) {  /* the lanes stripe g counts: blocks 16g.. */
    const long first = stripe_first(blocks, g);
    return _mm512_cmpge_epi32_mask(block_order(), _mm512_set1_epi32((int)(16 * g - first))) &
           _mm512_cmplt_epi32_mask(block_order(), _mm512_set1_epi32(stripe_valid(blocks)));
}

static inline int quad_valid(int valid, int m) {  /* blocks of a stripe's quad m (4m..4m + 3) among its first valid */
    return valid - 4 * m < 0 ? 0 : valid - 4 * m > 4 ? 4 : valid - 4 * m;
}

/* 16 values a block of a stripe whose first `valid` blocks are (zeros for the others, unread), into lane order. */
static inline vi in_lanes(const void *p, int valid) {
    return (vi)_mm512_permutexvar_epi32(block_order(), _mm512_maskz_loadu_epi32(first_lanes(valid), p));
}

/* Blocks 0..3 of quantized activations q (those from `valid` on zeros, unread) as the halves of a register of 4
 * blocks, 128-bit lane k block k's: lo its values 0-15, hi its 16-31 (the weights' layout, quad_ints). */
static inline void quad_halves(const int8_t *q, int valid, vi *lo, vi *hi) {
    const __m512i two = _mm512_maskz_loadu_epi64(valid >= 2 ? 0xff : valid == 1 ? 0x0f : 0, q),
                  next = _mm512_maskz_loadu_epi64(valid >= 4 ? 0xff : valid == 3 ? 0x0f : 0, q + 2 * BLOCK);
    *lo = (vi)_mm512_permutex2var_epi64(two, _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0), next);
    *hi = (vi)_mm512_permutex2var_epi64(two, _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2), next);
}

/* 4 registers of 4 blocks (r[m]'s 128-bit lane k: block 4m + k, 4 words) as 4 steps in lane order: out[s]'s lane
 * 4k + m word s of r[m]'s lane k (a 4 x 4 transposition in each 128-bit lane). */
static inline void to_lanes(const vi *r, vi *out) {
    const __m512i t0 = _mm512_unpacklo_epi32((__m512i)r[0], (__m512i)r[1]),
                  t1 = _mm512_unpackhi_epi32((__m512i)r[0], (__m512i)r[1]),
                  t2 = _mm512_unpacklo_epi32((__m512i)r[2], (__m512i)r[3]),
                  t3 = _mm512_unpackhi_epi32((__m512i)r[2], (__m512i)r[3]);
    out[0] = (vi)_mm512_unpacklo_epi64(t0, t2), out[1] = (vi)_mm512_unpackhi_epi64(t0, t2);
    out[2] = (vi)_mm512_unpacklo_epi64(t1, t3), out[3] = (vi)_mm512_unpackhi_epi64(t1, t3);
}

/* A row of K quantized values into lanes order, + 128 (unsigned, as lanes_rows multiplies them). */
static void lanes_order(const int8_t *q, long K, uint8_t *lanes) {
    const long blocks = K / BLOCK;
    for (long g = 0; g < stripes_of(K); g++, lanes += STRIPE) {
        vi lo[4], hi[4], steps[8];
        for (int m = 0; m < 4; m++)
            quad_halves(q + (stripe_first(blocks, g) + 4 * m) * BLOCK, quad_valid(stripe_valid(blocks), m), &lo[m],
                        &hi[m]);
        to_lanes(lo, steps), to_lanes(hi, steps + 4);
        for (int u = 0; u < 8; u++) _mm512_storeu_si512(lanes + 64 * u, (__m512i)(steps[u] ^ (int32_t)0x80808080));
    }
}
#endif

/* x (R, K) of x_type into `out`, a block of 32 at a time; with `across` (weights that across_block multiplies),
 * and where K is whole super-blocks, q in its order too; with `lanes` (weights of 32-blocks, LANE_BLOCKS), q in
 * lanes order. */
static void quantize_rows(const void *x, int x_type, long R, long K, const struct int8_rows *out, int across,
                          int lanes) {
    const vf magic = splat(0x1.8p23f);  /* v + magic - magic: v rounded to the nearest integer, ties to even */
    for (long i = 0; i < R * K / BLOCK; i++) {
        vf v[BLOCK / LANES], most = {0};
        for (int l = 0; l < BLOCK / LANES; l++) {
            v[l] = load(x, i * BLOCK + l * LANES, x_type);
            const vf size = (vf)((vi)v[l] & 0x7fffffff);
            const vi larger = size > most;  /* a NaN is never larger, as fmaxf leaves it out */
            most = (vf)((larger & (vi)size) | (~larger & (vi)most));
        }
        float largest = 0;
        for (int l = 0; l < LANES; l++) largest = most[l] > largest ? most[l] : largest;
        const float d = largest / 127.0f, inverse = d != 0 ? 1.0f / d : 0.0f;
        vi sum = {0}, first = {0};  /* of all 32 q, of the first 16 */
        for (int l = 0; l < BLOCK / LANES; l++) {  /* within +-127: |v| <= largest */
            const vi q = __builtin_convertvector((v[l] * splat(inverse) + magic) - magic, vi);
            *(vi8u *)(out->q + i * BLOCK + l * LANES) = __builtin_convertvector(q, vi8u), sum += q;
            if (l < BLOCK / LANES / 2) first += q;
        }
        int total = 0, half = 0;
        for (int l = 0; l < LANES; l++) total += sum[l], half += first[l];
        out->d[i] = d, out->s[i] = d * (float)total;
        /* with AVX2's eights_block, the two 16s' sums as int16s (|.| <= 16 x 127) */
        if (out->sum)
            out->sum[i] = EIGHT_ROWS ? (int32_t)((uint32_t)(half & 0xffff) | (uint32_t)(total - half) << 16) : total;
    }
#if ACROSS
    if (across && out->across && K % SUPER == 0) across_order(out->q, R * K, out->across, out->minus32);
#else
    (void)across;
#endif
#if LANE_BLOCKS
    for (long r = 0; lanes && out->lanes && r < R; r++)
        lanes_order(out->q + r * K, K, out->lanes + r * stripes_of(K) * STRIPE);
#else
    (void)lanes;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define VNNI 1  /* dpbusd: 4 products of unsigned and signed bytes added into int32 at once, none rounded or capped */
#else
#define VNNI 0
#endif

/* acc + the sum of 4 consecutive products w[j] x[j] in each of 8 int32 lanes (lane l: j = 4l..4l+3), x int8, w
 * unsigned bytes (below 128 without VNNI) or, `is_signed`, int8. x86's instructions multiply unsigned bytes by
 * signed ones: a signed w goes as |w| times x with w's sign (llama.cpp's way), within their range (|x| <= 127:
 * AVX2's pairs of products, added in 16 bits, stay below 2^15). */
static inline v8i32 dot32(v8i32 acc, v32i8 w, v32i8 x, const int is_signed) {
#if defined(__AVX2__)
    __m256i u = (__m256i)w, v = (__m256i)x;
    if (is_signed) v = _mm256_sign_epi8(v, u), u = _mm256_abs_epi8(u);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (v8i32)_mm256_dpbusd_epi32((__m256i)acc, u, v);
#elif defined(__AVXVNNI__)
    return (v8i32)_mm256_dpbusd_avx_epi32((__m256i)acc, u, v);
#else
    return acc + (v8i32)_mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
#elif defined(__SSE2__)  /* each half's bytes to 16 bits (unpacked, then shifted down with their sign), pmaddwd's
                         * pairs of products in 32, then pairs of those (GCC's code for the lines below is scalar) */
    (void)is_signed;
    const union halves u = {.whole = (v32u8)w}, v = {.whole = (v32u8)x};
    __m128i four[2];
    for (int h = 0; h < 2; h++) {
        const __m128i a = (__m128i)u.half[h], b = (__m128i)v.half[h];
        const __m128i low = _mm_madd_epi16(_mm_srai_epi16(_mm_unpacklo_epi8(a, a), 8),
                                           _mm_srai_epi16(_mm_unpacklo_epi8(b, b), 8)),
                      high = _mm_madd_epi16(_mm_srai_epi16(_mm_unpackhi_epi8(a, a), 8),
                                            _mm_srai_epi16(_mm_unpackhi_epi8(b, b), 8));
        four[h] = _mm_add_epi32((__m128i)_mm_shuffle_ps((__m128)low, (__m128)high, _MM_SHUFFLE(2, 0, 2, 0)),
                                (__m128i)_mm_shuffle_ps((__m128)low, (__m128)high, _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return acc + (v8i32)joined((v16u8)four[0], (v16u8)four[1]);
#else  /* NEON, others: the vector extensions, in 16 bits (|w x| <= 2^14), then pairs of pairs in 32 */
    typedef int16_t v32i16 __attribute__((vector_size(64)));
    typedef int16_t v16i16 __attribute__((vector_size(32)));
    typedef int32_t v16i32 __attribute__((vector_size(64)));
    (void)is_signed;
    const v32i16 p = __builtin_convertvector(w, v32i16) * __builtin_convertvector(x, v32i16);
    const v16i16 even = __builtin_shufflevector(p, p, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                 odd = __builtin_shufflevector(p, p, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const v16i32 pairs = __builtin_convertvector(even, v16i32) + __builtin_convertvector(odd, v16i32);
    return acc + __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* ints_of's integers u of a weight a (u - o) + b are unsigned, o this: sum (u - o) x = sum u x - o (sum x), the
 * second term once an activation block for every weight row, and no sign juggling a weight row. Q8_0's q go as
 * q + 128 where dpbusd takes them (AVX2's 16-bit pairs would overflow): signed elsewhere. */
static inline int int8_offset(int type) {
    switch (type) {
    case Q4_0: case Q4_0_STRIPES: return 8;
    case Q5_0: return 16;
    case Q6_K: return 32;
    case Q8_0: return VNNI ? 128 : 0;
    default: return 0;
    }
}

static inline int signed_weights(int type) { return type == Q8_0 && !VNNI; }

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline float sum8(v8f v) {  /* halves first, as sum_lanes */
    typedef float v4f __attribute__((vector_size(16)));
    const v4f h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* 16 bytes of two 4-bit q each (GGUF's layout): the low ones (weights 0-15), then the high ones (16-31). */
static inline v32u8 nibbles(const uint8_t *p) {
    const v16u8 b = *(const v16u8u *)p;
    return joined(b & 15, b >> 4);
}

/* A 32-bit word of fifth bits (bit j: weight j's) as 16 in byte j where set, else 0. Without AVX-512's mask
 * registers: the word in every 4 bytes, then byte j takes the byte of it holding bit j, from within its own 16
 * bytes (one byte shuffle on x86). */
static inline v32u8 fifth_bits(const uint8_t *p) {
    uint32_t word;
    memcpy(&word, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return (v32u8)_mm256_movm_epi8(word) & 16;  /* the word as a mask register: bit j sets byte j */
#elif !defined(__AVX2__) && defined(__SSE2__)
    /* no byte shuffle before SSSE3 (GCC's for the one below came out a byte at a time): each byte of the word
     * doubled by unpacking, to 8 copies, then each copy's own bit */
    const __m128i twice = _mm_unpacklo_epi8(_mm_cvtsi32_si128((int)word), _mm_cvtsi32_si128((int)word)),
                  four = _mm_unpacklo_epi16(twice, twice);
    const __m128i bit = _mm_set1_epi64x(0x8040201008040201LL), sixteen = _mm_set1_epi8(16);
    const __m128i low = _mm_unpacklo_epi32(four, four), high = _mm_unpackhi_epi32(four, four);
    const __m128i lo = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(low, bit), bit), sixteen),
                  hi = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(high, bit), bit), sixteen);
    return joined((v16u8)lo, (v16u8)hi);
#else
    typedef uint32_t v8u32 __attribute__((vector_size(32)));
    const v32u8 words = (v32u8)(v8u32){word, word, word, word, word, word, word, word};
    const v32u8 bytes = __builtin_shufflevector(words, words, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 18, 18,
                                                18, 18, 18, 18, 18, 18, 19, 19, 19, 19, 19, 19, 19, 19);
    const v32u8 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                       1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return (v32u8)((bytes & bit) != 0) & 16;
#endif
}

static inline v32u8 load32(const uint8_t *p) { return *(const v32u8u *)p; }

/* Bytes shifted left by `by` (right where negative) as 16-bit lanes: one instruction where a byte shift takes
 * three on x86; for bits that stay within their byte. */
static inline v32u8 shift16(v32u8 v, const int by) {
    typedef uint16_t v16u16 __attribute__((vector_size(32)));
    return (v32u8)(by >= 0 ? (v16u16)v << by : (v16u16)v >> -by);
}

/* A weight block (a K-quant's sub-block base + part) as the integers u of its 32 weights a (u - o) + b, o its
 * int8_offset; the layouts of load_block (base a multiple of 4: part, a constant, gives the shifts). */
static inline __attribute__((always_inline)) v32i8 ints_of(const uint8_t *group, const int type, int base,
                                                           const int part) {
    const int sub = base + part;
    switch (type) {
    case Q8_0: return VNNI ? (v32i8)(load32(group + 2) ^ 128) : *(const v32i8u *)(group + 2);  /* past a */
    case Q4_0: case Q4_1: return (v32i8)nibbles(group + quants_at(type));
    case Q5_0: case Q5_1: return (v32i8)(nibbles(group + quants_at(type)) | fifth_bits(group + fifth_at(type)));
    case Q4_K: return (v32i8)(load32(group + 16 + sub / 2 * 32) >> (part % 2 * 4) & 15);
    case Q5_K:  /* bit sub of each byte to bit 4: one 16-bit shift, no byte's bit crossing into the other */
        return (v32i8)((load32(group + 48 + sub / 2 * 32) >> (part % 2 * 4) & 15) |
                       (v32u8)shift16(load32(group + 16) & (uint8_t)(1 << sub), 4 - sub));
    default: {  /* Q6_K: 128 bytes of q's low 4 bits, then 64 of its high 2 (bits 2 part, 2 part + 1 to 4, 5) */
        const v32u8 low = load32(group + sub / 4 * 64 + sub % 2 * 32) >> (part / 2 * 4) & 15;
        return (v32i8)(low | (v32u8)shift16(load32(group + 128 + sub / 4 * 32) & (uint8_t)(3 << (part * 2)),
                                            4 - part * 2));
    }
    }
}

/* A group's scales against one activation row's (d: its blocks' scales, ds: d (sum q_x)): into ad, a d of each
 * sub-block (Q6_K: of each 16 weights); added to offsets, the b d (sum q_x) of each sub-block (a block: lane 0). */
static inline __attribute__((always_inline)) void group_scales(float a, float b, const int type,
                                                               const struct scales *s, const float *d,
                                                               const float *ds, float *ad, v8f *offsets) {
    if (!is_super(type)) {  /* a block's a and b (block_scales) */
        ad[0] = a * d[0];
        if (type == Q4_1 || type == Q5_1) (*offsets)[0] += b * ds[0];
        return;
    }
    const v8f dv = *(const v8fu *)d;
    if (type == Q6_K) {
        *(v8fu *)ad = *(const v8fu *)s->a * __builtin_shufflevector(dv, dv, 0, 0, 1, 1, 2, 2, 3, 3);
        *(v8fu *)(ad + 8) = *(const v8fu *)(s->a + 8) * __builtin_shufflevector(dv, dv, 4, 4, 5, 5, 6, 6, 7, 7);
        return;
    }
    *(v8fu *)ad = *(const v8fu *)s->a * dv;
    *offsets += *(const v8fu *)(s->a + SUBS) * *(const v8fu *)ds;
}


/* a * b + c, rounded once where the tier has a fused multiply-add (as fmadd), 8 lanes. */
static inline v8f fmadd8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

#if ACROSS
/* The K-quants with AVX-512 and VNNI: a super-block's 8 sub-blocks side by side, 32-bit lane l of a 64-byte step
 * holding 4 weights of sub-block l % 8 (int8_rows' across order), so that 4 dpbusd sum a whole super-block in
 * integers, each lane within one sub-block. Lanes k and k + 8 (the same sub-block) are then added in int32 and two
 * weight rows' 8 sums share a vector (halves_added), which one convert and two multiply-adds scale by a d and add
 * b d (sum q_x) to (scaled_pairs): 4 dpbusd and 3.5 more vector instructions a row's 256 weights against an
 * activation row (1.5 of them on the pipes dpbusd runs on, Zen 4), where a sub-block at a time (int8_block) takes
 * 3 for 32. Q6_K's scales of 16 weights: steps 0-1 hold each sub-block's first 16, 2-3 its last 16, each pair's
 * halves added, the first 16's sums in lanes 0-7, the last 16's in 8-15, scaled at once. The weights go into that
 * order as they are read: a lane permutation picks each lane's 4 bytes, a shift a lane its bits; or they were laid
 * out so at load. */
static inline vi lane_ints(const uint8_t *p, vi at, vi shift, int mask) {  /* lane l: bytes 4 at[l].. of p (< 128) */
    const vi bytes = (vi)_mm512_permutex2var_epi32(_mm512_loadu_si512(p), (__m512i)at, _mm512_loadu_si512(p + 64));
    return (vi)_mm512_srlv_epi32((__m512i)bytes, (__m512i)shift) & mask;
}

/* A K-quant's super-blocks laid out again once, at load (repack_across), so that across_ints' steps are loads: read
 * as the file holds them, each step's lanes are picked out of 128 bytes (a two-register permutation), then shifted
 * by a variable per lane, Q5_K's fifth bits and Q6_K's high 2 picked and shifted apart again, 4 steps a super-block
 * and a weight row. Laid out again, each super-block keeps its bytes (its scales and d where the file has them:
 * unpack reads them as they are) and only its q move, as step u's 64 bytes (lane l: 4 bytes, as across_ints gives):
 *   Q4_K_ACROSS: 128 bytes at 16, byte i of the 64 at 16 + 64r step 2r's byte i (low 4 bits), step 2r + 1's (high);
 *   Q5_K_ACROSS: their low 4 bits so at 48, and at 16 + 8u step u's fifth bits, bit i of the 64 byte i's;
 *   Q6_K_ACROSS: their low 4 bits so at 0, and their high 2 in the 64 bytes at 128, byte i step 0's at bit 4, step
 *     1's at 6, step 2's at 0, step 3's at 2 (each a shift from bit 4 and a mask).
 * The same integers, so the same bits as the file's blocks give; the exact products and dequantize put a row back as
 * the file's first (across_relayout). */

/* Step u of a K-quant super-block's integers (of weights a (u - o) + b): lane l the 4 of sub-block l % 8 from its
 * weight 4 (2u + l / 8) (load_block's layouts, or those laid out again above). */
static inline __attribute__((always_inline)) vi across_ints(const uint8_t *group, const int type, const int u) {
    if (laid_out(type)) {
        const vu bytes = (vu)_mm512_loadu_si512(group + nibbles_at(type) + 64 * (u / 2));
        vi q = (vi)(u % 2 ? bytes >> 4 : bytes) & 0x0f0f0f0f;
        if (type == Q5_K_ACROSS) {  /* the 64 bits a mask register: + 16 in the bytes whose bit is set */
            uint64_t fifth;
            memcpy(&fifth, group + 16 + 8 * u, 8);
            q = (vi)_mm512_mask_add_epi8((__m512i)q, _cvtu64_mask64(fifth), (__m512i)q, _mm512_set1_epi8(16));
        }
        if (type == Q6_K_ACROSS) {
            const vu high = (vu)_mm512_loadu_si512(group + 128);
            q |= (vi)(u == 0 ? high : u == 1 ? high >> 2 : u == 2 ? high << 4 : high << 2) & 0x30303030;
        }
        return q;
    }
    const vi l = __builtin_convertvector(iota(), vi), sub = l & 7, at = 2 * u + (l >> 3);
    if (type == Q6_K) {  /* low 4 bits: 32 bytes at 64 (s / 4) + 32 (s % 2), at bit 4 (s % 4 / 2); high 2 bits: 32
                          * bytes at 128 + 32 (s / 4), at bit 2 (s % 4) */
        const vi low = lane_ints(group, (sub >> 2) * 16 + (sub & 1) * 8 + at, (sub & 3) >> 1 << 2, 0x0f0f0f0f);
        const vi high = (vi)_mm512_srlv_epi32(_mm512_permutexvar_epi32((__m512i)((sub >> 2) * 8 + at),
                                                                       _mm512_loadu_si512(group + 128)),
                                              (__m512i)((sub & 3) << 1)) & 0x03030303;
        return low | high << 4;
    }
    /* Q4_K, Q5_K: sub-blocks 2p and 2p + 1 share 32 bytes, the low and the high 4 bits */
    vi q = lane_ints(group + nibbles_at(type), (sub >> 1) * 8 + at, (sub & 1) << 2, 0x0f0f0f0f);
    if (type == Q5_K) {  /* bit s of byte j of 32 at 16: weight j's fifth bit of sub-block s */
        const vi fifth = (vi)_mm512_permutexvar_epi32(
            (__m512i)at, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(group + 16))));
        q |= ((vi)_mm512_srlv_epi32((__m512i)fifth, (__m512i)sub) & 0x01010101) << 4;
    }
    return q;
}

/* One super-block of weight rows 2p and 2p + 1 (Q4_K, Q5_K), lanes 0-7 and 8-15, against an activation row: to
 * acc + sum q_w q_x (T, halves_added's) times a d, then + b d (sum q_x) (ds), each sub-block's, as a lane's two
 * multiply-adds (scaled_pairs). Q6_K (no b): to acc + T a d (scaled). The prompt's tile and a decoding step's
 * alike, so the same bits. */
static inline vf scaled(vi T, vf a, vf d, vf acc) { return fmadd(__builtin_convertvector(T, vf), a * d, acc); }
static inline vf scaled_pairs(vi T, vf a, vf d, vf b, vf ds, vf acc) { return fmadd(b, ds, scaled(T, a, d, acc)); }

/* The integers T those take, from a super-block's 4 steps of activations x (across order): of weight rows q[0]
 * and q[1] (Q4_K, Q5_K: each across_ints' 4 steps), or of one Q6_K row q[0], its - 32 (sum x) (minus32) added. */
static inline vi pair_sums(const vi (*q)[4], const vi *x) {
    vi sum[2];
    for (int h = 0; h < 2; h++) {
        sum[h] = dpbusd_of((vi){0}, q[h][0], x[0]);
        for (int u = 1; u < 4; u++) sum[h] = dpbusd_of(sum[h], q[h][u], x[u]);
    }
    return halves_added(sum[0], sum[1]);
}
static inline vi q6_k_sums(const vi *q, const vi *x, vi minus32) {
    return halves_added(dpbusd_of(dpbusd_of((vi){0}, q[0], x[0]), q[1], x[1]),
                        dpbusd_of(dpbusd_of((vi){0}, q[2], x[2]), q[3], x[3])) + minus32;
}

/* sum8 of each half of 8 vectors (COLS activation rows' ROWS / 2 pairs of weight rows, v[i * ROWS / 2 + p]'s
 * half h weight row 2p + h of row i), into lane i * ROWS + j: each step adds the same pairs as sum8, two vectors at
 * a time (as sum_lanes_of). */
static inline vf sum8_of(const vf *v) {
    vf a[4], b[2];
    for (int p = 0; p < 4; p++)  /* lanes k and k + 4 of each half */
        a[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(v[2 * p], v[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int p = 0; p < 2; p++)  /* then k and k + 2 */
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* The sums of c activation rows' accumulators into sums (c, LANES), its first ROWS columns: Q4_K and Q5_K's
 * pairs[i][p] (weight rows 2p, 2p + 1 in halves: sum8 each), Q6_K's rows[i][j] (sum_lanes), COLS rows at once
 * with the same additions. */
static inline void across_sums(const vf (*pairs)[ROWS / 2], const vf (*rows)[ROWS], const int type, const int c,
                               float *sums) {
    if (c == COLS) {
        const vf all = type == Q6_K ? sum_lanes_of((const vf *)rows) : sum8_of((const vf *)pairs);
        for (int i = 0; i < c; i++)
            for (int j = 0; j < ROWS; j++) sums[i * LANES + j] = all[i * ROWS + j];
        return;
    }
    if (type == Q6_K) {
        for (int i = 0; i < c; i++)
            for (int j = 0; j < ROWS; j++) sums[i * LANES + j] = sum_lanes(rows[i][j]);
        return;
    }
    for (int i = 0; i < c; i++)
        for (int p = 0; p < ROWS / 2; p++) {
            sums[i * LANES + 2 * p] = sum8(__builtin_shufflevector(pairs[i][p], pairs[i][p], 0, 1, 2, 3, 4, 5, 6, 7));
            sums[i * LANES + 2 * p + 1] =
                sum8(__builtin_shufflevector(pairs[i][p], pairs[i][p], 8, 9, 10, 11, 12, 13, 14, 15));
        }
}

/* Q6_K's a of each sub-block's first 16 weights (2s) in lane s, of its last 16 (2s + 1) in lane s + 8: as
 * halves_added puts its steps 0-1 and 2-3. */
static inline vf q6_k_a(const struct scales *s) {
    return (vf)_mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0),
                                     _mm512_loadu_ps(s->a));
}

/* Q4_K, Q5_K: the a (b) of rows 2p and 2p + 1's sub-blocks in lanes 0-7 and 8-15 */
static inline vf pair_a(const struct scales *s) {
    return (vf)_mm512_shuffle_f32x4(_mm512_loadu_ps(s[0].a), _mm512_loadu_ps(s[1].a), 0x44);
}
static inline vf pair_b(const struct scales *s) {
    return (vf)_mm512_shuffle_f32x4(_mm512_loadu_ps(s[0].a), _mm512_loadu_ps(s[1].a), 0xee);
}

/* int8_block for a K-quant (its contract), as the file holds it or laid out again (`layout`). */
static inline __attribute__((always_inline)) void across_block(const struct int8_rows *x, long first, const int c,
                                                               const void *w, const int layout, long K,
                                                               float *sums) {
    const int type = file_type(layout);
    const long blocks = K / BLOCK;
    vf pairs[COLS][ROWS / 2] = {{{0}}};  /* Q4_K, Q5_K */
    vf rows[COLS][ROWS] = {{{0}}};       /* Q6_K */
    for (long k = 0; k < K; k += SUPER) {
        const uint8_t *group[ROWS];
        struct scales s[ROWS];
        for (int j = 0; j < ROWS; j++) {
            group[j] = (const uint8_t *)w + offset_of(j * K + k, type);
            for (long at = 0; at < group_bytes(type); at += 64)
                __builtin_prefetch(group[j] + at + SIDE_PREFETCH, 0, 1);
        }
        unpack_each(group, type, s);
        vi xv[COLS][4], minus32[COLS];
        vf d[COLS], ds[COLS];
        for (int i = 0; i < c; i++) {
            for (int u = 0; u < 4; u++) xv[i][u] = (vi)_mm512_loadu_si512(x->across + (first + i) * K + k + 64 * u);
            const long at = (first + i) * blocks + k / BLOCK;
            d[i] = (vf)_mm512_broadcast_f32x8(_mm256_loadu_ps(x->d + at));
            if (type == Q6_K) minus32[i] = x->minus32[((first + i) * K + k) / SUPER];
            else ds[i] = (vf)_mm512_broadcast_f32x8(_mm256_loadu_ps(x->s + at));
        }
        if (type == Q6_K) {  /* sum (q - 32) x = sum q x - 32 sum x (int8_rows' minus32) */
            for (int j = 0; j < ROWS; j++) {
                vi q[4];
                for (int u = 0; u < 4; u++) q[u] = across_ints(group[j], layout, u);
                const vf a = q6_k_a(&s[j]);
                for (int i = 0; i < c; i++) rows[i][j] = scaled(q6_k_sums(q, xv[i], minus32[i]), a, d[i], rows[i][j]);
            }
            continue;
        }
        for (int p = 0; p < ROWS / 2; p++) {
            vi q[2][4];
            for (int h = 0; h < 2; h++)
                for (int u = 0; u < 4; u++) q[h][u] = across_ints(group[2 * p + h], layout, u);
            const vf a = pair_a(&s[2 * p]), b = pair_b(&s[2 * p]);
            for (int i = 0; i < c; i++)
                pairs[i][p] = scaled_pairs(pair_sums((const vi (*)[4])q, xv[i]), a, d[i], b, ds[i], pairs[i][p]);
        }
    }
    across_sums((const vf (*)[ROWS / 2])pairs, (const vf (*)[ROWS])rows, type, c, sums);
}
#endif

#if LANE_BLOCKS
/* The blocks of 32 with AVX-512 and VNNI: a stripe of 16 blocks of a weight row at a time, each block's 32 products
 * summed in one int32 lane (block BLOCK_OF(l) in lane l), then one convert and one multiply-add by the 16 blocks' a d
 * take the stripe to float32 (Q4_1, Q5_1: and one multiply-add by their b and d (sum q_x)), lane l's float sums in
 * the stripes' order, the lanes added at the end as sum_lanes adds them. A decoding step's row (lanes_block) reads
 * the weights as the file holds them: 4 blocks a register, each 128 bits one block's 16 weights of a half (a Q4_0
 * block's 16 bytes give both halves, a mask and a shift), against the activations' same halves, two dpbusd a
 * register; then each block's 4 lanes added across the 4 registers (block_sums: a transposition's adds) and the
 * - o (sum q_x) of each activation block (int8_rows' sum) added once for all the weight rows; the 16 blocks' float16
 * scales are gathered and converted at once. A prompt's rows (lanes_rows) take the weights unpacked once into the
 * lanes order, where each step is a dpbusd alone. Both give each block's exact integer sum to the same float32
 * steps, so a row's bits are the same either way. */

/* Blocks 0..3 of a weight row (those from `valid` on read as block valid - 1: their lanes are dropped later) as the
 * integers u of their weights a (u - o) + b, o its int8_offset (ints_of's), each 128-bit lane k block k's: lo its
 * weights 0-15, hi its 16-31. */
static inline __attribute__((always_inline)) void quad_ints(const uint8_t *block, const int type, const int valid,
                                                            vi *lo, vi *hi) {
    const long bytes = group_bytes(type);
    const uint8_t *at[4];
    for (int k = 0; k < 4; k++) at[k] = block + (k < valid ? k : valid - 1) * bytes;
    if (type == Q8_0) {  /* q + 128, unsigned; two blocks' 32 bytes a register, then their halves */
#define TWO(k) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(at[k] + 2))),      \
                                  _mm256_loadu_si256((const __m256i *)(at[(k) + 1] + 2)), 1)
        const __m512i first = TWO(0), last = TWO(2);
#undef TWO
        *lo = (vi)_mm512_shuffle_i64x2(first, last, _MM_SHUFFLE(2, 0, 2, 0)) ^ (int32_t)0x80808080;
        *hi = (vi)_mm512_shuffle_i64x2(first, last, _MM_SHUFFLE(3, 1, 3, 1)) ^ (int32_t)0x80808080;
        return;
    }
#define QUANTS(k) _mm_loadu_si128((const __m128i *)(at[k] + quants_at(type)))
    const __m512i bytes4 = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(
                               QUANTS(0)), QUANTS(1), 1), QUANTS(2), 2), QUANTS(3), 3);  /* nibbles() of each */
#undef QUANTS
    *lo = (vi)bytes4 & 0x0f0f0f0f, *hi = (vi)_mm512_srli_epi16(bytes4, 4) & 0x0f0f0f0f;
    if (type == Q5_0 || type == Q5_1) {  /* fifth_bits() of each: bit j of a block's word sets its byte j */
        uint64_t low = 0, high = 0;
        for (int k = 0; k < 4; k++) {
            uint32_t fifth;
            memcpy(&fifth, at[k] + fifth_at(type), 4);
            low |= (uint64_t)(fifth & 0xffff) << 16 * k, high |= (uint64_t)(fifth >> 16) << 16 * k;
        }
        *lo |= (vi)_mm512_movm_epi8(low) & 0x10101010, *hi |= (vi)_mm512_movm_epi8(high) & 0x10101010;
    }
}

/* Lane 4k + m (block BLOCK_OF of it, 4m + k): the 4 lanes of v[m]'s 128-bit lane k added. */
static inline vi block_sums(const vi *v) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32((__m512i)v[0], (__m512i)v[1]),
                                         _mm512_unpackhi_epi32((__m512i)v[0], (__m512i)v[1])),
                  t23 = _mm512_add_epi32(_mm512_unpacklo_epi32((__m512i)v[2], (__m512i)v[3]),
                                         _mm512_unpackhi_epi32((__m512i)v[2], (__m512i)v[3]));
    return (vi)_mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}

/* The a (and b: Q4_1, Q5_1) of a stripe's first `valid` blocks (from `block`) in lane order, the other lanes 0:
 * each block's first 4 bytes put in its lane's place (a gather was slower), their float16s converted at once (F16C:
 * the float32 value HALVES holds). */
static inline __attribute__((always_inline)) void stripe_scales(const uint8_t *block, const int type, int valid,
                                                                vf *a, vf *b) {
    uint32_t each[16];
    for (int l = 0; l < 16; l++)
        memcpy(each + l, block + (BLOCK_OF(l) < valid ? BLOCK_OF(l) : 0) * group_bytes(type), 4);
    const __m512i words =
        _mm512_maskz_loadu_epi32(_mm512_cmplt_epi32_mask(block_order(), _mm512_set1_epi32(valid)), each);
    *a = (vf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
    if (type == Q4_1 || type == Q5_1) *b = (vf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
}

/* Where a quad of 4 blocks fits 128 bytes (all but Q8_0), it is read as two 64-byte windows, its first 64 bytes and
 * its last 64, and its parts picked from them by byte and word permutations: window byte t of a quad is its byte t
 * (t < 64), else byte t - 64 + 4 bytes - 64. */
#if defined(__AVX512VBMI__)
#define WINDOWS 1  /* vpermb is AVX512-VBMI's: Cascade Lake has VNNI without it, and reads each block (quad_ints) */
#else
#define WINDOWS 0
#endif
static inline int windowed(int type) { return WINDOWS && 4 * group_bytes(type) <= 128; }

#if WINDOWS
static inline int window_at(int type, int p) { return p < 64 ? p : p - (4 * (int)group_bytes(type) - 64) + 64; }

/* The permutations' indices for each type, filled once as the library loads (computed where used, they were
 * stored and loaded again every stripe). WINDOW_BYTES: byte 16k + i the window byte of the quad's block k's q byte
 * i; WINDOW_WORDS[m]: word l (and 16 + l: b) of lane 4k + m the window word of quad m's block k's a (b). */
typedef int8_t v64i8 __attribute__((vector_size(64)));
typedef int16_t v32i16 __attribute__((vector_size(64)));
static v64i8 WINDOW_BYTES[Q5_1 + 1];
static v32i16 WINDOW_WORDS[Q5_1 + 1][4];

__attribute__((constructor)) static void fill_windows(void) {
    const int types[] = {Q4_0, Q4_1, Q5_0, Q5_1};
    for (int i = 0; i < 4; i++) {
        const int type = types[i], bytes = (int)group_bytes(type);
        for (int t = 0; t < 64; t++)
            WINDOW_BYTES[type][t] = (int8_t)window_at(type, t / 16 * bytes + quants_at(type) + t % 16);
        for (int m = 0; m < 4; m++)
            for (int l = m; l < 32; l += 4)
                WINDOW_WORDS[type][m][l] = (int16_t)(window_at(type, l % 16 / 4 * bytes + l / 16 * 2) / 2);
    }
}

/* quad_ints of the quad m of a whole stripe (from `quad`), and its a (b) into words (window_words' places). */
static inline __attribute__((always_inline)) void quad_window(const uint8_t *quad, const int type, int m, vi *lo,
                                                              vi *hi, __m512i *words) {
    const long bytes = group_bytes(type);
    const __m512i first = _mm512_loadu_si512(quad), last = _mm512_loadu_si512(quad + 4 * bytes - 64);
    const __m512i nibbles = _mm512_permutex2var_epi8(first, (__m512i)WINDOW_BYTES[type], last);
    *lo = (vi)nibbles & 0x0f0f0f0f, *hi = (vi)_mm512_srli_epi16(nibbles, 4) & 0x0f0f0f0f;
    const __mmask32 lanes = (0x11111111u << m) & (type == Q4_1 || type == Q5_1 ? ~0u : 0xffffu);
    *words = _mm512_or_si512(*words,
                             _mm512_maskz_permutex2var_epi16(lanes, first, (__m512i)WINDOW_WORDS[type][m], last));
    if (type == Q5_0 || type == Q5_1) {  /* fifth_bits() of each: bit j of a block's word sets its byte j */
        uint64_t low = 0, high = 0;
        for (int k = 0; k < 4; k++) {
            uint32_t fifth;
            memcpy(&fifth, quad + k * bytes + fifth_at(type), 4);
            low |= (uint64_t)(fifth & 0xffff) << 16 * k, high |= (uint64_t)(fifth >> 16) << 16 * k;
        }
        *lo |= (vi)_mm512_movm_epi8(low) & 0x10101010, *hi |= (vi)_mm512_movm_epi8(high) & 0x10101010;
    }
}
#endif

/* The stripe of a weight row from `block` (its first `valid` blocks; 0 for the quads past them): quad_ints of its
 * quads, and its a (and b) in lane order (stripe_scales'). */
static inline __attribute__((always_inline)) void stripe_ints(const uint8_t *block, const int type, const int valid,
                                                              vi *lo, vi *hi, vf *a, vf *b) {
    const long bytes = group_bytes(type);
#if WINDOWS
    if (windowed(type) && valid == 16) {  /* a row of fewer blocks is read block by block (below): no window past it */
        __m512i words = _mm512_setzero_si512();
        for (int m = 0; m < 4; m++) quad_window(block + 4 * m * bytes, type, m, &lo[m], &hi[m], &words);
        *a = (vf)_mm512_cvtph_ps(_mm512_castsi512_si256(words));
        if (type == Q4_1 || type == Q5_1) *b = (vf)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(words, 1));
        return;
    }
#endif
    for (int m = 0; m < 4; m++) {
        lo[m] = hi[m] = (vi){0};
        if (quad_valid(valid, m)) quad_ints(block + 4 * m * bytes, type, quad_valid(valid, m), &lo[m], &hi[m]);
    }
    stripe_scales(block, type, valid, a, b);
}

/* The stripe of blocks b.. (its first `valid` read; lanes `kept` counted, the others 0) of weight rows w (each its
 * row's block 0) against activation row `row`, into acc. */
static inline __attribute__((always_inline)) void lanes_stripe(const struct int8_rows *x, long row, long b,
                                                               const uint8_t *const *w, const int type,
                                                               const int valid, __mmask16 kept, long K, vf *acc) {
    const long bytes = group_bytes(type), at = row * (K / BLOCK) + b;
    const int o = int8_offset(type), has_b = type == Q4_1 || type == Q5_1;
    vi xlo[4], xhi[4];  /* the activations' halves, for every weight row */
    for (int m = 0; m < 4; m++) {
        quad_halves(x->q + (at + 4 * m) * BLOCK, quad_valid(valid, m), &xlo[m], &xhi[m]);
        IN_REGISTER(xlo[m]);
        IN_REGISTER(xhi[m]);
    }
    const vf d = (vf)in_lanes(x->d + at, valid), s = has_b ? (vf)in_lanes(x->s + at, valid) : (vf){0};
    const vi minus = o ? -(in_lanes(x->sum + at, valid) << __builtin_ctz(o)) : (vi){0};  /* - o (sum q_x) */
#pragma GCC unroll 4
    for (int j = 0; j < ROWS; j++) {
        const uint8_t *block = w[j] + b * bytes;
        for (long p = 0; p < 16 * bytes; p += 64) __builtin_prefetch(block + p + SIDE_PREFETCH, 0, 1);  /* prefetcht2 */
        vi lo[4], hi[4], v[4];
        vf a, offset;
        stripe_ints(block, type, valid, lo, hi, &a, &offset);
        for (int m = 0; m < 4; m++)
            v[m] = quad_valid(valid, m) ? (vi)_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(
                                              _mm512_setzero_si512(), (__m512i)lo[m], (__m512i)xlo[m]),
                                              (__m512i)hi[m], (__m512i)xhi[m])
                                        : (vi){0};
        vi sum = block_sums(v) + minus;
        if (kept != 0xffff) {  /* as lanes_unpack leaves them: no integers, no scales */
            sum = (vi)_mm512_maskz_mov_epi32(kept, (__m512i)sum);
            a = (vf)_mm512_maskz_mov_ps(kept, (__m512)a), offset = (vf)_mm512_maskz_mov_ps(kept, (__m512)offset);
        }
        acc[j] = fmadd(__builtin_convertvector(sum, vf), a * d, acc[j]);
        if (has_b) acc[j] = fmadd(offset, s, acc[j]);
    }
}

/* int8_block for a block of 32, activation row `row` alone (its contract). */
static inline __attribute__((always_inline)) void lanes_block(const struct int8_rows *x, long row, const void *w,
                                                              const int type, long K, float *sums) {
    const long blocks = K / BLOCK;
    const uint8_t *rows[ROWS];
    for (int j = 0; j < ROWS; j++) rows[j] = (const uint8_t *)w + j * blocks * group_bytes(type);
    vf acc[ROWS] = {{0}};
    if (blocks < 16) lanes_stripe(x, row, 0, rows, type, (int)blocks, stripe_lanes(blocks, 0), K, acc);
    else  /* whole stripes: constant shapes */
        for (long g = 0; g < stripes_of(K); g++)
            lanes_stripe(x, row, stripe_first(blocks, g), rows, type, 16, stripe_lanes(blocks, g), K, acc);
    for (int j = 0; j < ROWS; j++) sums[j] = sum_lanes(acc[j]);
}

/* Q4_0 laid out again once, at load (repack_stripes), for this tile: read as the file holds it, a stripe of a row is
 * 288 bytes whose quads are picked out of 64-byte windows (a byte and a word permutation each), then each block's 4
 * lanes added across 4 registers (block_sums): some 50 vector instructions a stripe and a weight row, which kept the
 * 2-thread decoding step of the 1.7B's Q4_0 under llama.cpp's. Laid out as the activations' lanes order, a stripe is
 * 4 loads, 12 masks and shifts and 8 dpbusd, each lane its block's sum at once, and its scales a load and a convert.
 * A row of `blocks` (Q4_0_STRIPES, the same 18 bytes a block as the file's):
 *   its stripes' 4-bit q, 256 bytes a stripe (stripe_first's blocks): 4 steps of 64 bytes, step p's lane l the
 *     bytes 4p..4p + 3 of block BLOCK_OF(l)'s 16 (their low 4 bits its weights 4p.., their high 16 + 4p..); a row's
 *     last stripe where it overlaps the one before (or a row of fewer than 16 blocks) holds the lanes it counts
 *     (stripe_lanes) alone, in lane order, 4 bytes each a step;
 *   then each stripe's float16 a in lane order (a last stripe's: the lanes it counts), 2 bytes a block.
 * The same integers against the same activations in the same lanes as lanes_block's, so the same bits; the exact
 * products and dequantize put a row back as the file's blocks first (stripes_restore). */
static inline __attribute__((always_inline)) const uint8_t *stripe_q(const uint8_t *row, long g) {
    return row + STRIPE / 2 * g;
}
static inline __attribute__((always_inline)) const uint8_t *stripe_a(const uint8_t *row, long blocks, long g) {
    return row + blocks * BLOCK / 2 + 32 * g;
}

/* The 4 steps of stripe g of a row of stripes as they are stored (the lanes not counted 0), and its float16 a, one a
 * 32-bit lane (the others 0). */
static inline __attribute__((always_inline)) void stripe_raw(const uint8_t *row, long blocks, long g, __m512i *raw,
                                                             __m512i *halves) {
    const __mmask16 kept = stripe_lanes(blocks, g);
    const uint8_t *q = stripe_q(row, g), *a = stripe_a(row, blocks, g);
    if (kept == 0xffff) {
        for (int p = 0; p < 4; p++) raw[p] = _mm512_loadu_si512(q + 64 * p);
        *halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)a));
        return;
    }
    const int n = __builtin_popcount(kept);
    for (int p = 0; p < 4; p++)  /* a load and an expansion: an expanding load was the slower (Zen 4) */
        raw[p] = _mm512_maskz_expand_epi32(kept, _mm512_maskz_loadu_epi32(first_lanes(n), q + 4 * n * p));
    *halves = _mm512_maskz_expand_epi32(kept, _mm512_cvtepu16_epi32(_mm512_castsi512_si256(
                                                  _mm512_maskz_loadu_epi16((__mmask32)first_lanes(n), a))));
}

/* Stripe g of a row of stripes as lanes_unpack's steps before the offset: u unsigned, step u the weights 4u.. of each
 * lane's block; and its a in lane order (0 in the lanes not counted). */
static inline __attribute__((always_inline)) void stripe_steps(const uint8_t *row, long blocks, long g, vi *steps,
                                                               vf *a) {
    __m512i raw[4], halves;
    stripe_raw(row, blocks, g, raw, &halves);
    for (int p = 0; p < 4; p++)
        steps[p] = (vi)raw[p] & 0x0f0f0f0f, steps[p + 4] = (vi)_mm512_srli_epi16(raw[p], 4) & 0x0f0f0f0f;
    *a = (vf)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves));
}

/* lanes_block for a row of stripes (its contract): the activations' lanes order (int8_rows' lanes, signed again). */
static inline __attribute__((always_inline)) void stripes_block(const struct int8_rows *x, long row, const void *w,
                                                                long K, float *sums) {
    const long blocks = K / BLOCK, stripes = stripes_of(K);
    vf acc[ROWS] = {{0}};
    for (long g = 0; g < stripes; g++) {
        const long at = row * blocks + stripe_first(blocks, g);
        const int valid = stripe_valid(blocks);
        const __mmask16 kept = stripe_lanes(blocks, g);
        vi xv[8];  /* for every weight row */
        for (int u = 0; u < 8; u++) {
            xv[u] = (vi)_mm512_loadu_si512(x->lanes + (row * stripes + g) * STRIPE + 64 * u) ^ (int32_t)0x80808080;
            IN_REGISTER(xv[u]);
        }
        const vf d = (vf)in_lanes(x->d + at, valid);
        const vi minus = -(in_lanes(x->sum + at, valid) << 3);  /* - 8 (sum q_x) */
#pragma GCC unroll 4
        for (int j = 0; j < ROWS; j++) {
            const uint8_t *rowj = (const uint8_t *)w + j * blocks * Q4_0_BYTES;
            for (long p = 0; p < STRIPE / 2; p += 64)  /* prefetcht2: its q, and its a (the row's bytes all) */
                __builtin_prefetch(stripe_q(rowj, g) + p + SIDE_PREFETCH, 0, 1);
            __builtin_prefetch(stripe_a(rowj, blocks, g) + SIDE_PREFETCH, 0, 1);
            vi steps[8];
            vf a;
            stripe_steps(rowj, blocks, g, steps, &a);
            __m512i sum = (__m512i)minus;
            for (int u = 0; u < 8; u++) sum = _mm512_dpbusd_epi32(sum, (__m512i)steps[u], (__m512i)xv[u]);
            if (kept != 0xffff) sum = _mm512_maskz_mov_epi32(kept, sum);  /* as lanes_stripe leaves them */
            acc[j] = fmadd(__builtin_convertvector((vi)sum, vf), a * d, acc[j]);
        }
    }
    for (int j = 0; j < ROWS; j++) sums[j] = sum_lanes(acc[j]);
}

/* A prompt's rows against ROWS weight rows of a block of 32: lanes_block's arithmetic, each (activation row, weight
 * row) pair's the same (the same integer sums, the same float32 steps in the same order, so the same bits as a row
 * gets alone), but the weights unpacked once for all the rows, into a scratch in lanes order (ROWS x K bytes and a
 * few vectors a stripe): as signed w = u - o against the activations + 128 (int8_rows' lanes), whose sum
 * (x + 128) w = sum x w + 128 sum w, the last a weights' term, taken out once a weight row (`start`). A stripe
 * against a row is then 8 dpbusd, a convert, a multiply and a multiply-add. */
enum { LANE_ROWS = 2 };  /* activation rows a step (lanes_span): 4 spilled its sums */

struct lane_weights {  /* ROWS weight rows' stripes unpacked, each (ROWS, stripes, ...) */
    const vi *q;  /* 8 steps a stripe, w = u - o */
    const vi *start;  /* - 128 (sum w) of each block */
    const vf *a, *b;  /* each block's a, b (Q4_1, Q5_1) */
};

static inline __attribute__((always_inline)) void lanes_unpack(const void *w, const int type, long K, vi *q,
                                                               vi *start, vf *a, vf *b) {
    const long blocks = K / BLOCK, stripes = stripes_of(K), bytes = group_bytes(type);
    for (int j = 0; j < ROWS; j++)
        for (long g = 0; g < stripes; g++) {
            const uint8_t *row = (const uint8_t *)w + j * blocks * bytes;
            const long at = j * stripes + g;
            const __mmask16 kept = stripe_lanes(blocks, g);
            vi *steps = q + at * 8;
            if (type == Q4_0_STRIPES) {
                for (long p = 0; p < STRIPE / 2; p += 64) __builtin_prefetch(stripe_q(row, g) + p + PREFETCH, 0, 1);
                __builtin_prefetch(stripe_a(row, blocks, g) + PREFETCH, 0, 1);
                stripe_steps(row, blocks, g, steps, &a[at]);
            } else {
                const uint8_t *block = row + stripe_first(blocks, g) * bytes;
                for (long p = 0; p < 16 * bytes; p += 64) __builtin_prefetch(block + p + PREFETCH, 0, 1);
                vi lo[4], hi[4];
                stripe_ints(block, type, stripe_valid(blocks), lo, hi, &a[at], &b[at]);
                to_lanes(lo, steps), to_lanes(hi, steps + 4);
            }
            __m512i sum = _mm512_setzero_si512();
            for (int u = 0; u < 8; u++) {  /* w = u - o; 0 in the lanes left out */
                steps[u] = (vi)_mm512_maskz_mov_epi32(kept, _mm512_sub_epi8((__m512i)steps[u],
                                                                            _mm512_set1_epi8((char)int8_offset(type))));
                sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8((char)0x80), (__m512i)steps[u]);
            }
            start[at] = -(vi)sum;
            a[at] = (vf)_mm512_maskz_mov_ps(kept, (__m512)a[at]);
            if (type == Q4_1 || type == Q5_1) b[at] = (vf)_mm512_maskz_mov_ps(kept, (__m512)b[at]);
        }
}

/* acc[i][j]: the float32 sums (lanes not yet added) of activation row first + i (i < c) against w's row j. A stripe's
 * 8 steps go one at a time, each step's c activation vectors and ROWS weight vectors loaded for c * ROWS dpbusd
 * into as many integer sums: with its float32 sums that is 2 * c * ROWS + c + 1 registers. Holding every step of
 * the activations in registers instead (8 c of them) left too few for the float32 sums, which the compiler kept
 * in memory: a 128-row product of the 360M's 960-wide Q4_0 ran at 0.7x this (the same bits: integer sums are exact
 * in any order, and each pair's float32 steps are the same ones in the same order). */
static inline __attribute__((always_inline)) void lanes_span(const struct int8_rows *x, long first, const int c,
                                                             const struct lane_weights *w, const int type, long K,
                                                             vf (*acc)[ROWS]) {
    const long blocks = K / BLOCK, stripes = stripes_of(K);
    const int has_b = type == Q4_1 || type == Q5_1;
    vf sum_of[LANE_ROWS][ROWS] = {{{0}}};
    for (long g = 0; g < stripes; g++) {
        const int valid = stripe_valid(blocks);
        const uint8_t *lanes[LANE_ROWS];
        vf d[LANE_ROWS], s[LANE_ROWS];
        for (int i = 0; i < c; i++) {
            lanes[i] = x->lanes + ((first + i) * stripes + g) * STRIPE;
            const long at = (first + i) * blocks + stripe_first(blocks, g);
            d[i] = (vf)in_lanes(x->d + at, valid), s[i] = has_b ? (vf)in_lanes(x->s + at, valid) : (vf){0};
        }
        __m512i sum[LANE_ROWS][ROWS];
        for (int j = 0; j < ROWS; j++)
            for (int i = 0; i < c; i++) sum[i][j] = (__m512i)w->start[j * stripes + g];
        for (int u = 0; u < 8; u++) {
            __m512i xv[LANE_ROWS];
            for (int i = 0; i < c; i++) xv[i] = _mm512_loadu_si512(lanes[i] + 64 * u);
            for (int j = 0; j < ROWS; j++) {
                const __m512i q = (__m512i)w->q[(j * stripes + g) * 8 + u];
                for (int i = 0; i < c; i++) sum[i][j] = _mm512_dpbusd_epi32(sum[i][j], xv[i], q);
            }
        }
        for (int j = 0; j < ROWS; j++) {
            const long at = j * stripes + g;
            for (int i = 0; i < c; i++) {
                sum_of[i][j] = fmadd(__builtin_convertvector((vi)sum[i][j], vf), w->a[at] * d[i], sum_of[i][j]);
                if (has_b) sum_of[i][j] = fmadd(w->b[at], s[i], sum_of[i][j]);
            }
        }
    }
    for (int i = 0; i < c; i++)
        for (int j = 0; j < ROWS; j++) acc[i][j] = sum_of[i][j];
}

/* int8_block of activation rows 0..B-1 against w's first ROWS rows, for a block of 32 (lanes_span's way). */
static inline __attribute__((always_inline)) void lanes_rows(const struct int8_rows *x, long B, const void *w,
                                                             const int type, long K, float *sums) {
    const long stripes = stripes_of(K);
    vi q[ROWS * stripes * 8], start[ROWS * stripes];
    vf a[ROWS * stripes], b[ROWS * stripes];
    lanes_unpack(w, type, K, q, start, a, b);
    const struct lane_weights unpacked = {q, start, a, b};
    long i = 0;
    for (; i + COLS <= B; i += COLS) {  /* COLS rows' sums at once (sum_lanes_of: the same additions as sum_lanes) */
        vf acc[COLS][ROWS];
        for (int at = 0; at < COLS; at += LANE_ROWS) lanes_span(x, i + at, LANE_ROWS, &unpacked, type, K, acc + at);
        const vf all = sum_lanes_of((const vf *)acc);
        for (int r = 0; r < COLS; r++)
            for (int j = 0; j < ROWS; j++) sums[(i + r) * LANES + j] = all[r * ROWS + j];
    }
    for (; i < B; i++) {
        vf acc[1][ROWS];
        lanes_span(x, i, 1, &unpacked, type, K, acc);
        for (int j = 0; j < ROWS; j++) sums[i * LANES + j] = sum_lanes(acc[0][j]);
    }
}

/* A row of stripes put back as the file's blocks, into `out` (its 18 bytes a block): each stripe's steps transposed
 * back (to_lanes is its own inverse: register m's 128-bit lane k is then block 4m + k's 16 bytes) and its a put in
 * block order (BLOCK_OF is its own inverse too); of a last stripe, the blocks it counts. */
static void stripes_restore(const uint8_t *row, long blocks, uint8_t *out) {
    for (long g = 0; g < stripes_of(blocks * BLOCK); g++) {
        __m512i raw[4], halves;
        stripe_raw(row, blocks, g, raw, &halves);
        vi quads[4];
        to_lanes((const vi *)raw, quads);
        uint8_t q[16][16];
        uint32_t a[16];
        for (int m = 0; m < 4; m++) _mm512_storeu_si512(q[4 * m], (__m512i)quads[m]);
        _mm512_storeu_si512(a, _mm512_permutexvar_epi32(block_order(), halves));
        const long first = stripe_first(blocks, g);
        for (long b = 16 * g; b < first + stripe_valid(blocks); b++) {  /* the blocks it counts: first <= 16g */
            memcpy(out + b * Q4_0_BYTES, &a[b - first], 2);
            memcpy(out + b * Q4_0_BYTES + 2, q[b - first], 16);
        }
    }
}
#endif


#if EIGHT_ROWS
/* AVX2's tile for every block type (Q4_0, Q8_0 and the K-quants first; then Q4_1, Q5_0 and Q5_1, whose int8_block cost
 * 0.045-0.070 ns a weight at 1 row against 0.019-0.027 here: benchmarks/int8_costs.c, rows of 1024 and 2048). A row's
 * block in 8 lanes, each lane 4 of its weights (int8_block's way), took a step 8 products' sums, 8 conversions and 8
 * multiply-adds a block of 4 rows (~23 instructions a row's block), and the 1.7B decoded at 0.75-0.85x llama.cpp at
 * AVX2, which lays these out again at load as 8 rows side by side. Laid out the same way (Q4_0_STRIPES, Q8_0_EIGHTS,
 * Q4_K_ACROSS.. here: eights_move), a group of 8 rows' block (super-block) is its q, each 32 bytes a step, step w's
 * 32-bit lane r row r's bytes 4w..4w+3 of the block's q; then its scales, of all 8 rows. A step's integers are 4
 * weights of each of the 8 rows (eights_ints) against one broadcast word of the activations, and their products' pairs
 * add up in 16 bits, exactly, as many as fit (4-bit q: a 32-weight block's 8; Q5_K's 4, Q5_0's and Q5_1's 4 (2 steps
 * of both 16s), Q6_K's 2, Q8_0's 1): then one widening to 32 bits, one conversion and one or two multiply-adds a block
 * for all 8 rows (~6 instructions a row's block). The same operations for an activation row whatever rows come with
 * it, so a prompt's rows get their bits alone. */
#ifndef EIGHTS_PREFETCH
/* Bytes ahead of the q read, and of the scales read (a group's scales follow its q: prefetching ahead of the q
 * alone left a ninth of the bytes to the hardware prefetcher; with them, 1.7B-shaped products out of cache, 2
 * threads, ran 1.05x (Q8_0), 1.16x (Q4_0), 1.2x (Q4_K) and 1.2-1.4x (Q6_K) as fast). At 8192 (PREFETCH) the 1.7B's
 * products out of cache were 0.73-0.80x as fast (Q4_0; Q4_K 0.81-0.96x); at 16384 and 65536, the same. */
#define EIGHTS_PREFETCH 32768
#endif
#ifndef EIGHTS_COLS
#define EIGHTS_COLS 4  /* activation rows a step at most: a group's block unpacked once for them */
#endif

/* A row's block (super-block): where its q start, and its bytes of q (Q5_0's, Q5_1's and Q5_K's: the fifth bits,
 * then the 4-bit q; Q6_K's: the low 4 bits, then the high 2) */
static inline int eights_q_at(int type) {
    return type == Q4_0 || type == Q8_0 || type == Q5_0 ? 2 : type == Q4_1 || type == Q5_1 ? 4 : type == Q6_K ? 0 : 16;
}
static inline long eights_q_bytes(int type) {
    return type == Q4_0 || type == Q4_1 ? 16 : type == Q5_0 || type == Q5_1 ? 20 : type == Q8_0 ? 32
           : type == Q4_K ? 128 : type == Q5_K ? 160 : 192;
}
static inline long eights_q(int type) { return EIGHTS * eights_q_bytes(file_type(type)); }  /* a group's q */

/* Whether eights_block multiplies weights of `type` (as the file's blocks or laid out again). */
static inline int eights(int type) { return is_super(type) || group_bytes(type); }  /* every block type */

/* A 32-weight block's (Q5_0's, Q5_1's) fifth bits, weight j's bit j, laid out as eights_ints reads them (`back`: put
 * back): byte i bit t weight 4t + i's (t < 4: of the first 16, the rest of the last 16), so that one shift and one
 * mask a step put the 4 weights of each half it multiplies at bit 4 of their bytes. A transpose of 8 nibbles into 4
 * bytes: each nibble's 4 bits spread 8 apart by one multiplication (no carries: its 4 shifted copies do not overlap),
 * as the file's blocks laid out on the stack a call need it fast; put back a bit at a time. */
static uint32_t fifths_order(uint32_t bits, int back) {
    uint32_t out = 0;
    for (int t = 0; !back && t < 8; t++) out |= ((bits >> 4 * t & 15) * 0x00204081u & 0x01010101u) << t;
    for (int i = 0; back && i < 4; i++)
        for (int t = 0; t < 8; t++) out |= (bits >> (8 * i + t) & 1) << (4 * t + i);
    return out;
}

/* Blocks (super-blocks) k0..k0 + n - 1 of 8 rows of the file's blocks of any type (`row` bytes apart) laid out as a
 * group (q: n * eights_q bytes, a: n * 8 * group_bytes - that), or with `back`, put back. q: Q5_0's and Q5_1's fifth
 * bits first (fifths_order's), then their 4-bit q. a: Q4_0's, Q5_0's and Q8_0's, the 8 rows' float16 a (16 bytes);
 * Q4_1's and Q5_1's, their a, then their b; Q4_K's and Q5_K's, their d, their dmin, then each of the 12 bytes of
 * scales of the 8 rows; Q6_K's, each of the 16 scales of the 8 rows (8 bytes), then their d. */
static void eights_move(int type, uint8_t *rows, long row, long k0, long n, uint8_t *q, uint8_t *a, int back) {
    const long Q = eights_q(type), A = EIGHTS * group_bytes(type) - Q;
    const int k4 = type == Q4_K || type == Q5_K;  /* d, dmin and 12 bytes of scales */
    const int halves = k4 || type == Q4_1 || type == Q5_1 ? 2 : 1, half_at = type == Q6_K ? 208 : 0,
              a_half = type == Q6_K ? 128 : 0,
              bytes = k4 ? 12 : type == Q6_K ? 16 : 0, byte_at = k4 ? 4 : 192, a_byte = k4 ? 32 : 0;
#define MOVE(file, ours, size) (back ? memcpy(file, ours, size) : memcpy(ours, file, size))
    for (long k = 0; k < n; k++)
        for (int r = 0; r < EIGHTS; r++) {
            uint8_t *block = rows + r * row + (k0 + k) * group_bytes(type), *to = a + A * k;
            for (long w = 0; w < Q / EIGHTS / 4; w++)
                MOVE(block + eights_q_at(type) + 4 * w, q + Q * k + 32 * w + 4 * r, 4);
            if (type == Q5_0 || type == Q5_1) {  /* their fifth bits in eights_ints' order */
                uint32_t bits;
                memcpy(&bits, back ? block + eights_q_at(type) : q + Q * k + 4 * r, 4);
                bits = fifths_order(bits, back);
                memcpy(back ? block + eights_q_at(type) : q + Q * k + 4 * r, &bits, 4);
            }
            for (int h = 0; h < halves; h++) MOVE(block + half_at + 2 * h, to + a_half + 16 * h + 2 * r, 2);
            for (int p = 0; p < bytes; p++) MOVE(block + byte_at + p, to + a_byte + 8 * p + r, 1);
        }
#undef MOVE
}

static inline v8i32 word_of(const int8_t *p) {  /* 4 bytes at p in every 32-bit lane: one broadcast */
    int32_t v;
    memcpy(&v, p, 4);
    return (v8i32){v, v, v, v, v, v, v, v};
}

typedef int16_t v16i16 __attribute__((vector_size(32)));

/* pairs + products of 4 weights of the 8 rows (u, unsigned) with activations' word at x, in 16-bit pairs */
static inline v16i16 eights_pairs(v16i16 pairs, v32u8 u, const int8_t *x) {
    return pairs + (v16i16)_mm256_maddubs_epi16((__m256i)u, (__m256i)word_of(x));
}

static inline v8f eights_floats(v16i16 pairs) {  /* the pairs' sums in 32 bits, as floats (exact: < 2^24) */
    return __builtin_convertvector((v8i32)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(1)), v8f);
}

/* Q4_K's scales of a group's super-block at a (eights_move's): d sc of each sub-block (8 rows a vector), then
 * -(dmin m), exactly (as unpack's: 6-bit sc, m from the 12 bytes, times float16 d, dmin). */
static inline __attribute__((always_inline)) void eights_scales(const uint8_t *a, v8f *sc, v8f *m) {
    const v32u8 low = load32(a + 32), mid = load32(a + 64), high = load32(a + 96);  /* bytes 0-3, 4-7, 8-11 */
    uint8_t bytes[4][32];  /* sc 0-3, sc 4-7, m 0-3, m 4-7 of the 8 rows */
    *(v32u8u *)bytes[0] = low & 63;
    *(v32u8u *)bytes[1] = (high & 15) | (shift16(low, -2) & 0x30);
    *(v32u8u *)bytes[2] = mid & 63;
    *(v32u8u *)bytes[3] = (shift16(high, -4) & 15) | (shift16(mid, -2) & 0x30);
    const v8f d = (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a)),
              dmin = -(v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + 16)));
    for (int s = 0; s < SUBS; s++) {
        sc[s] = d * __builtin_convertvector(load_u8(bytes[s / 4] + 8 * (s % 4)), v8f);
        m[s] = dmin * __builtin_convertvector(load_u8(bytes[2 + s / 4] + 8 * (s % 4)), v8f);
    }
}

/* A step's integers u of the 8 rows (4 weights each) of sub-block s (a block: its first 16 weights, and with `high`
 * its last 16): Q4_0's and Q4_1's low nibbles (high ones), Q5_0's and Q5_1's with their fifth bits, Q4_K's of pair s /
 * 2, the nibbles s % 2 (Q5_K's, and their fifth bits, bit s of the first 32 bytes a row, to bit 4); Q6_K's low 4 bits
 * of half s / 4, quarter s % 4, and its 2 high bits (from the 4 a byte at 128 bytes a row on) to bits 4 and 5. */
static inline __attribute__((always_inline)) v32u8 eights_ints(const int type, const uint8_t *q, int s, int t,
                                                               int high) {
    if (type == Q8_0) return load32(q + 32 * t);  /* int8 */
    if (type == Q4_0 || type == Q4_1) return (high ? shift16(load32(q + 32 * t), -4) : load32(q + 32 * t)) & 15;
    if (type == Q5_0 || type == Q5_1) {  /* past the fifth bits (fifths_order's: the half's t to bit 4) */
        const v32u8 low = (high ? shift16(load32(q + 32 + 32 * t), -4) : load32(q + 32 + 32 * t)) & 15;
        return low | (shift16(load32(q), high ? -t : 4 - t) & 16);
    }
    if (type == Q4_K || type == Q5_K) {
        const int at = type == Q5_K ? EIGHTS * 32 : 0;  /* Q5_K: past the fifth bits */
        const v32u8 bytes = load32(q + at + EIGHTS * 32 * (s / 2) + 32 * t),
                    u = (s % 2 ? shift16(bytes, -4) : bytes) & 15;
        return type == Q4_K ? u : u | (v32u8)shift16(load32(q + 32 * t) & (uint8_t)(1 << s), 4 - s);
    }
    const int n = s / 4, m = s % 4;
    const v32u8 low = load32(q + EIGHTS * (64 * n + 32 * (m % 2)) + 32 * t),
                top = load32(q + EIGHTS * (128 + 32 * n) + 32 * t);
    return ((m / 2 ? shift16(low, -4) : low) & 15) | (shift16(top, 4 - 2 * m) & 0x30);
}

static inline v8i32 splat32(int32_t v) { return (v8i32){v, v, v, v, v, v, v, v}; }

/* 8 int8 scales as int16 pairs: (sc, sc) in each 32-bit lane (for a pair of products), or with `next`, (sc, next) */
static inline v8i32 scale_pairs(const uint8_t *sc, const uint8_t *next) {
    const v8i32 a = (v8i32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
                b = (v8i32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)next));
    return (a & 0xffff) | (b << 16);
}

/* Whether a step of eights_block multiplies both 16s of a 32-weight block (4 weights of each): the 4- and 5-bit q. */
static inline int eights_halves(int type) { return !is_super(type) && type != Q8_0; }

enum { EIGHTS_HELD = SUBS * 8 * 32 };  /* bytes: a K-quant super-block's every step's integers (eights_hold) */

/* A group's K-quant super-block at q, its every step's integers (eights_ints), step t of sub-block s at 32 (8s + t)
 * bytes of held; the super-block prefetched on. */
static inline __attribute__((always_inline)) void eights_hold(const int type, const uint8_t *q, uint8_t *held) {
    for (long at = 0; at < EIGHTS * group_bytes(type); at += 64) __builtin_prefetch(q + at + EIGHTS_PREFETCH, 0, 1);
    for (int s = 0; s < SUBS; s++)
        for (int t = 0; t < 8; t++) *(v32u8u *)(held + 32 * (8 * s + t)) = eights_ints(type, q, s, t, 0);
}

/* sums (c, LANES) += a group's 8 rows (lane r row r) of `type` against quantized activation rows first..first+c-1
 * of x, over blocks (super-blocks) k0..k0 + n - 1 of its rows (of `blocks` blocks of 32), their q and a at q and a
 * (eights_move's). A row's sum is one chain of multiply-adds, a block of 32 at a time:
 *   Q4_0 (sum u x - 8 sum x), Q8_0 (sum q x), in int32, times a d_x (rounded once);
 *   Q4_K, Q5_K (sum u x) times d sc d_x, then -(dmin m) times d_x (sum x);
 *   Q6_K (sum of sc (sum (u - 32) x) over its two 16s), in int32 (|.| < 2^24: exact as a float), times d d_x.
 * x->sum holds each block's sums of its first and last 16 q as int16s. With `held` (a K-quant's super-block, n 1:
 * eights_hold's), its integers are read from there, not unpacked (nor prefetched) again. Inlined with constant c and
 * type. */
static inline __attribute__((always_inline)) void eights_block(const struct int8_rows *x, long first, const int c,
                                                               const int type, const uint8_t *q, const uint8_t *a,
                                                               long blocks, long k0, long n, float *sums,
                                                               const uint8_t *held) {
    const long Q = eights_q(type), A = EIGHTS * group_bytes(type) - Q;
    const int subs = is_super(type) ? SUBS : 1;
    v8f acc[EIGHTS_COLS];
    for (int i = 0; i < c; i++) acc[i] = *(const v8fu *)(sums + i * LANES);
    for (long k = 0; k < n; k++) {
        for (long at = 0; !held && at < Q; at += 64) __builtin_prefetch(q + Q * k + at + EIGHTS_PREFETCH, 0, 1);
        for (long at = 0; !held && at < A; at += 64) __builtin_prefetch(a + A * k + at + EIGHTS_PREFETCH, 0, 1);
        v8f sc[SUBS], m[SUBS];
        if (type == Q4_K || type == Q5_K) eights_scales(a + A * k, sc, m);
        else sc[0] = (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + A * k + (type == Q6_K ? 128 : 0))));
        if (type == Q4_1 || type == Q5_1)  /* their b */
            m[0] = (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + A * k + 16)));
#pragma GCC unroll 8
        for (int s = 0; s < subs; s++) {  /* Q4_0: its one block; the K-quants: sub-block s (unrolled: shifts fixed) */
            v16i16 pairs[EIGHTS_COLS] = {{0}};
            v8i32 ints[EIGHTS_COLS] = {{0}}, scales[3];  /* Q6_K's: (sc, sc) of each 16, (sc first, sc last) */
            if (type == Q6_K) {
                const uint8_t *at = a + A * k + 16 * s;
                scales[0] = scale_pairs(at, at), scales[1] = scale_pairs(at + 8, at + 8);
                scales[2] = scale_pairs(at, at + 8);
            }
            const int8_t *xs[EIGHTS_COLS];  /* each activation row's block: held, not worked out again a step (the
                                             * prompts' Q5_K and Q6_K products 1.1-1.3x as fast, Q4_0 1.07x) */
            for (int i = 0; i < c; i++) xs[i] = x->q + ((first + i) * blocks + (k0 + k) * subs + s) * BLOCK;
            const int halves = eights_halves(type);
            for (int t = 0; t < (halves ? 4 : 8); t++) {
                const v32u8 u = held ? load32(held + 32 * (8 * s + t)) : eights_ints(type, q + Q * k, s, t, 0);
                const __m256i size = _mm256_abs_epi8((__m256i)u);  /* Q8_0's |q| */
                for (int i = 0; i < c; i++) {
                    const int8_t *xq = xs[i] + 4 * t;
                    if (type == Q8_0) {  /* |q| times x with q's sign (|q x| <= 127 x 127: a pair a 16-bit lane) */
                        const __m256i signed_x = _mm256_sign_epi8((__m256i)word_of(xq), (__m256i)u);
                        ints[i] += (v8i32)_mm256_madd_epi16(_mm256_maddubs_epi16(size, signed_x), _mm256_set1_epi16(1));
                        continue;
                    }
                    pairs[i] = eights_pairs(pairs[i], u, xq);
                    if (halves) pairs[i] = eights_pairs(pairs[i], eights_ints(type, q + Q * k, s, t, 1), xq + 16);
                    if ((type == Q5_0 || type == Q5_1) && t % 2) {  /* 2 steps' (|u x| <= 31 x 127, 4 pairs) */
                        ints[i] += (v8i32)_mm256_madd_epi16((__m256i)pairs[i], _mm256_set1_epi16(1));
                        pairs[i] = (v16i16){0};
                    }
                    if (type == Q6_K && t % 2) {  /* 2 steps' pairs (|u x| <= 63 x 127) a 16-bit lane */
                        ints[i] += (v8i32)_mm256_madd_epi16((__m256i)pairs[i], (__m256i)scales[t / 4]);
                        pairs[i] = (v16i16){0};
                    }
                    if (type == Q5_K && t % 4 == 3) {  /* 4 steps' (|u x| <= 31 x 127) */
                        ints[i] += (v8i32)_mm256_madd_epi16((__m256i)pairs[i], _mm256_set1_epi16(1));
                        pairs[i] = (v16i16){0};
                    }
                }
            }
            for (int i = 0; i < c; i++) {
                const long at = (first + i) * blocks + (k0 + k) * subs + s;
                const v8i32 sums_x = splat32(x->sum[at]);  /* first 16's sum of x and last 16's */
                if (type == Q4_K || type == Q5_K || type == Q4_1 || type == Q5_1) {
                    const v8f u = type == Q4_K || type == Q4_1 ? eights_floats(pairs[i])
                                                               : __builtin_convertvector(ints[i], v8f);
                    acc[i] = fmadd8(u, sc[s] * splat8(x->d[at]), acc[i]);
                    acc[i] = fmadd8(m[s], splat8(x->s[at]), acc[i]);
                    continue;
                }
                const v8i32 sum = type == Q4_0
                    ? (v8i32)_mm256_madd_epi16((__m256i)pairs[i], _mm256_set1_epi16(1)) -
                          (v8i32)_mm256_madd_epi16((__m256i)sums_x, _mm256_set1_epi16(8))
                    : type == Q5_0 ? ints[i] - (v8i32)_mm256_madd_epi16((__m256i)sums_x, _mm256_set1_epi16(16))
                    : type == Q8_0 ? ints[i]
                    : ints[i] - ((v8i32)_mm256_madd_epi16((__m256i)sums_x, (__m256i)scales[2]) << 5);
                acc[i] = fmadd8(__builtin_convertvector(sum, v8f), sc[0] * splat8(x->d[at]), acc[i]);
            }
        }
    }
    for (int i = 0; i < c; i++) *(v8fu *)(sums + i * LANES) = acc[i];
}

/* eights_block of activation rows 0..B-1, EIGHTS_COLS at a time. */
static inline __attribute__((always_inline)) void eights_rows(const struct int8_rows *x, long B, const int type,
                                                              const uint8_t *q, const uint8_t *a, long blocks,
                                                              long k0, long n, float *sums) {
    const long Q = eights_q(type), A = EIGHTS * group_bytes(type) - Q;
    /* A prompt's rows: a super-block's integers unpacked once for all of them, the same values (in L2, 64 rows: Q5_K
     * 1.15-1.23x, Q6_K 1.13-1.15x, Q4_K 1.00x as fast; 16 rows 1.03-1.06x; 8 rows and 32-weight blocks: 0.91x) */
    if (is_super(type) && B >= 4 * EIGHTS_COLS) {
        uint8_t held[EIGHTS_HELD] __attribute__((aligned(32)));
        for (long k = 0; k < n; k++) {
            eights_hold(type, q + Q * k, held);
            long b = 0;
            for (; b + EIGHTS_COLS <= B; b += EIGHTS_COLS)
                eights_block(x, b, EIGHTS_COLS, type, q + Q * k, a + A * k, blocks, k0 + k, 1, sums + b * LANES, held);
            for (; b < B; b++)
                eights_block(x, b, 1, type, q + Q * k, a + A * k, blocks, k0 + k, 1, sums + b * LANES, held);
        }
        return;
    }
    long b = 0;
    for (; b + EIGHTS_COLS <= B; b += EIGHTS_COLS)
        eights_block(x, b, EIGHTS_COLS, type, q, a, blocks, k0, n, sums + b * LANES, NULL);
    for (; b < B; b++) eights_block(x, b, 1, type, q, a, blocks, k0, n, sums + b * LANES, NULL);
}

enum { EIGHTS_SPAN = 36 << 10 };  /* bytes of the file's rows laid out at a time on the stack */

/* sums (B, LANES): activation rows 0..B-1 against weight rows n..n+LANES-1 (a group) of type W, laid out or the
 * file's: laid out on the stack first, EIGHTS_SPAN bytes at a time (the same operations: the same bits). */
#define EIGHTS_AS(W)                                                                                           \
    static __attribute__((noinline)) void eights_##W(const struct int8_rows *x, const void *w, int laid, long B, \
                                                     long n, long K, float *sums) {                           \
        const long groups = K / group_size(W), Q = eights_q(W), bytes = EIGHTS * group_bytes(W);              \
        uint8_t *group = (uint8_t *)w + offset_of(n * K, W);                                                   \
        memset(sums, 0, B * LANES * sizeof(float));                                                            \
        if (laid) {                                                                                            \
            eights_rows(x, B, W, group, group + groups * Q, K / BLOCK, 0, groups, sums);                       \
            return;                                                                                            \
        }                                                                                                      \
        uint8_t q[EIGHTS_SPAN] __attribute__((aligned(32)));                                                   \
        const long span = EIGHTS_SPAN / bytes;                                                                 \
        for (long k0 = 0; k0 < groups; k0 += span) {                                                           \
            const long n = groups - k0 < span ? groups - k0 : span;                                            \
            eights_move(W, group, offset_of(K, W), k0, n, q, q + n * Q, 0);                                    \
            eights_rows(x, B, W, q, q + n * Q, K / BLOCK, k0, n, sums);                                        \
        }                                                                                                      \
    }
EIGHTS_AS(Q4_0) EIGHTS_AS(Q8_0) EIGHTS_AS(Q4_K) EIGHTS_AS(Q5_K) EIGHTS_AS(Q6_K) EIGHTS_AS(Q4_1) EIGHTS_AS(Q5_0)
EIGHTS_AS(Q5_1)
#endif

/* Q4_0 weights w (N, K) laid out again (Q4_0_STRIPES) into `out` (as many bytes), where a tile for it is built
 * (AVX-512 VNNI, AVX2: 1; elsewhere 0, nothing written). With AVX-512 VNNI, as rows of stripes: each row's blocks'
 * 16 bytes of q transposed in 4-byte words (to_lanes) and its a permuted into lane order, the inverse of
 * stripes_restore. With AVX2, as groups of 8 rows (eights_move; N a multiple of 8). */
int repack_stripes(const void *w, long N, long K, void *out) {
#if LANE_BLOCKS
    const long blocks = K / BLOCK;
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        const uint8_t *row = (const uint8_t *)w + n * blocks * Q4_0_BYTES;
        uint8_t *to = (uint8_t *)out + n * blocks * Q4_0_BYTES;
        for (long g = 0; g < stripes_of(K); g++) {
            const long first = stripe_first(blocks, g);
            const __mmask16 kept = stripe_lanes(blocks, g);
            const int n_kept = __builtin_popcount(kept);
            uint8_t q[16][16] = {{0}};
            uint32_t a[16] = {0};
            for (long b = 16 * g; b < first + stripe_valid(blocks); b++) {  /* as stripes_restore */
                memcpy(&a[b - first], row + b * Q4_0_BYTES, 2);
                memcpy(q[b - first], row + b * Q4_0_BYTES + 2, 16);
            }
            vi quads[4], steps[4];
            for (int m = 0; m < 4; m++) quads[m] = (vi)_mm512_loadu_si512(q[4 * m]);
            to_lanes(quads, steps);
            const __m512i halves = _mm512_permutexvar_epi32(block_order(), _mm512_loadu_si512(a));
            for (int p = 0; p < 4; p++)
                _mm512_mask_compressstoreu_epi32(to + STRIPE / 2 * g + 4 * n_kept * p, kept, (__m512i)steps[p]);
            _mm512_mask_storeu_epi16(to + blocks * BLOCK / 2 + 32 * g, (__mmask32)first_lanes(n_kept),
                                     _mm512_castsi256_si512(_mm512_cvtepi32_epi16(
                                         _mm512_maskz_compress_epi32(kept, halves))));
        }
    }
    return 1;
#elif EIGHT_ROWS
    const long row = offset_of(K, Q4_0);
#pragma omp parallel for schedule(static)
    for (long g = 0; g < N / EIGHTS; g++) {
        uint8_t *to = (uint8_t *)out + g * EIGHTS * row;
        eights_move(Q4_0, (uint8_t *)w + g * EIGHTS * row, row, 0, K / BLOCK, to, to + K / BLOCK * eights_q(Q4_0), 0);
    }
    return 1;
#else
    (void)w, (void)N, (void)K, (void)out;
    return 0;
#endif
}

/* ROWS weight rows' integers and scales taken out of their blocks once, where a prompt's rows reuse them (held_rows):
 * q, a sub-block's integers u - o (ints_of, less int8_offset: |q| <= 32, signed; (K / BLOCK, ROWS)); with AVX2,
 * minus, - 128 (sum of q) of each of its 32-bit lanes (held_dot); s, a K-quant's unpacked scales ((ROWS, K / SUPER));
 * a and b, a block's (block_scales: (K / BLOCK, ROWS)). A step's values side by side: one address a step, not one a
 * row (GCC kept those on the stack). */
struct held_ints {
    v32i8 *q;
    v8i32 *minus;
    struct scales *s;
    float *a, *b;
};

/* dot32(minus, u, x) of a held weight's q = u - o: the same integers (sum q x = sum u x - o sum x), without the
 * - o (sum x) of each activation row. AVX2 multiplies unsigned bytes by signed ones: x goes as x + 128, and the
 * weight row's - 128 (sum q) is added back (pairs of products stay below 2^15: 255 x 32 x 2); with VNNI that is one
 * dpbusd. Elsewhere dot32 multiplies signed bytes as they are. Where o is 0, u x as it is (Q8_0's signed q without
 * VNNI: dot32's sign trick). */
static inline __attribute__((always_inline)) v8i32 held_dot(v32i8 q, v8i32 minus, v32i8 x, const int type) {
    if (!int8_offset(type)) return dot32((v8i32){0}, q, x, signed_weights(type));
#if defined(__AVX2__)
    return dot32(minus, (v32i8)((v32u8)x ^ 128), q, 0);
#else
    (void)minus;
    return dot32((v8i32){0}, q, x, 0);
#endif
}

/* Whether held_rows multiplies `type`: as int8_block does, from its own integers (not across_block's, lanes_block's,
 * stripes_block's). */
static inline int holds(int type) {
    return !(ACROSS && is_super(type)) && !(LANE_BLOCKS && (type == Q4_0_STRIPES || !is_super(type)));
}

/* int8_block's products for a block type whose weights `held` has: each block's step, its scales read as they are
 * (one address a block; the group loop's bookkeeping a block cost as much as its products). */
static inline __attribute__((always_inline)) void held_blocks(const struct int8_rows *x, long first, const int c,
                                                              const struct held_ints *held, const int type, long K,
                                                              v8f (*acc)[ROWS], v8f (*offsets)[ROWS]) {
    typedef float v4f __attribute__((vector_size(16)));
    typedef float v4fu __attribute__((vector_size(16), aligned(4)));
    _Static_assert(ROWS == 4, "a block's scales of ROWS rows as one vector");
    const long blocks = K / BLOCK;
    for (long k = 0; k < blocks; k++) {
        v32i8 xq[COLS];
        v4f ad[COLS];  /* group_scales' products, a vector a row */
        for (int i = 0; i < c; i++) {
            xq[i] = *(const v32i8u *)(x->q + ((first + i) * blocks + k) * BLOCK);
            ad[i] = *(const v4fu *)(held->a + k * ROWS) * x->d[(first + i) * blocks + k];
        }
        for (int j = 0; j < ROWS; j++) {
            const v32i8 q = held->q[k * ROWS + j];
            const v8i32 minus = held->minus && int8_offset(type) ? held->minus[k * ROWS + j] : (v8i32){0};
            for (int i = 0; i < c; i++)
                acc[i][j] = fmadd8(__builtin_convertvector(held_dot(q, minus, xq[i], type), v8f), splat8(ad[i][j]),
                                   acc[i][j]);
        }
        for (int j = 0; (type == Q4_1 || type == Q5_1) && j < ROWS; j++)
            for (int i = 0; i < c; i++) offsets[i][j][0] += held->b[k * ROWS + j] * x->s[(first + i) * blocks + k];
    }
}

/* Sums of weight rows 0..ROWS-1 of w against quantized activation rows first..first+c-1 of x, into sums (c, LANES),
 * its first ROWS columns; each (activation row, weight row) pair's sums on their own, in one order whatever c.
 * The weights' integers and scales are unpacked from w, or read where `held` has them (the same values).
 * Inlined with constant c and type. */
static inline __attribute__((always_inline)) void int8_block(const struct int8_rows *x, long first, const int c,
                                                             const void *w, const int type, long K, float *sums,
                                                             const struct held_ints *held) {
#if ACROSS
    if (is_super(type)) {
        across_block(x, first, c, w, type, K, sums);
        return;
    }
#endif
#if LANE_BLOCKS
    if (type == Q4_0_STRIPES) {
        for (int i = 0; i < c; i++) stripes_block(x, first + i, w, K, sums + i * LANES);
        return;
    }
    if (!is_super(type)) {
        for (int i = 0; i < c; i++) lanes_block(x, first + i, w, type, K, sums + i * LANES);
        return;
    }
#endif
    const int is_signed = signed_weights(type), o = int8_offset(type);
    v8f acc[COLS][ROWS] = {{{0}}}, offsets[COLS][ROWS] = {{{0}}};  /* the a d (sum q_w q_x), b d (sum q_x) terms */
    const long G = group_size(type), blocks = K / BLOCK;
    if (held && !is_super(type)) held_blocks(x, first, c, held, type, K, acc, offsets);
    for (long k = 0; k < K && !(held && !is_super(type)); k += G) {
        const uint8_t *group[ROWS];
        float ad[COLS][ROWS][2 * SUBS], a[ROWS] = {0}, b[ROWS] = {0};  /* a block's (block_scales) */
        struct scales unpacked[ROWS];
        const struct scales *s[ROWS];
        if (held) {
            for (int j = 0; j < ROWS; j++) s[j] = held->s + j * (K / SUPER) + k / SUPER;  /* a K-quant's */
        } else {
            for (int j = 0; j < ROWS; j++) {
                group[j] = (const uint8_t *)w + offset_of(j * K + k, type);
                for (long at = 0; at < group_bytes(type); at += 64) __builtin_prefetch(group[j] + at + PREFETCH, 0, 1);
            }
            unpack_each(group, type, unpacked);
            for (int j = 0; j < ROWS; j++) {
                s[j] = &unpacked[j];
                if (!is_super(type)) block_scales(group[j], type, &a[j], &b[j]);
            }
        }
        for (int j = 0; j < ROWS; j++)
            for (int i = 0; i < c; i++) {
                const long at = (first + i) * blocks + k / BLOCK;
                group_scales(a[j], b[j], type, s[j], x->d + at, x->s + at, ad[i][j], &offsets[i][j]);
            }
        const int parts = G / BLOCK < 4 ? G / BLOCK : 4;  /* sub-blocks base + part */
        for (int base = 0; base < G / BLOCK; base += parts)
#pragma GCC unroll 4
            for (int part = 0; part < parts; part++) {
                const int sub = base + part;
                v32i8 xq[COLS];
                v8i32 minus[COLS];  /* - o (sum x), 4 x's a lane as the products', once for every weight row */
                for (int i = 0; i < c; i++) {
                    xq[i] = *(const v32i8u *)(x->q + ((first + i) * blocks + k / BLOCK + sub) * BLOCK);
                    minus[i] = o && !held ? -dot32((v8i32){0}, (v32i8)((v32u8){0} + (uint8_t)o), xq[i], 0)
                                          : (v8i32){0};
                }
                for (int j = 0; j < ROWS; j++) {
                    const long at = (k / BLOCK + sub) * ROWS + j;
                    const v32i8 q = held ? held->q[at] : ints_of(group[j], type, base, part);
                    const v8i32 held_minus = held && held->minus && o ? held->minus[at] : (v8i32){0};
                    for (int i = 0; i < c; i++) {
                        const float *f = ad[i][j] + (type == Q6_K ? 2 * sub : sub);
                        const v8f scale = type == Q6_K ? (v8f){f[0], f[0], f[0], f[0], f[1], f[1], f[1], f[1]}
                                                       : splat8(f[0]);
                        const v8i32 sum = held ? held_dot(q, held_minus, xq[i], type) : dot32(minus[i], q, xq[i], is_signed);
                        acc[i][j] = fmadd8(__builtin_convertvector(sum, v8f), scale, acc[i][j]);
                    }
                }
            }
    }
    for (int i = 0; i < c; i++)
        for (int j = 0; j < ROWS; j++) sums[i * LANES + j] = sum8(acc[i][j]) + sum8(offsets[i][j]);
}

/* int8_block of activation rows 0..B-1 against w's first ROWS rows, their integers and scales unpacked once for all
 * of them (into `held`, on the stack: 4 K bytes, with AVX2 8 K, and a few floats a block), not once every COLS rows.
 * The same operations a pair, so the same bits as a row gets alone. */
static inline __attribute__((always_inline)) void held_rows(const struct int8_rows *x, long B, const void *w,
                                                            const int type, long K, float *sums) {
    const long G = group_size(type), blocks = K / BLOCK, supers = is_super(type) ? K / SUPER : 1;
    v32i8 q[ROWS * blocks];
#if defined(__AVX2__)
    v8i32 minus[ROWS * blocks];
#else
    v8i32 *minus = NULL;
#endif
    struct scales s[ROWS * supers];
    float a[ROWS * blocks], b[ROWS * blocks];
    for (int j = 0; j < ROWS; j++)
        for (long k = 0; k < K; k += G) {
            const uint8_t *group = (const uint8_t *)w + offset_of(j * K + k, type);
            if (is_super(type)) unpack(group, type, &s[j * supers + k / SUPER]);
            else block_scales(group, type, &a[k / BLOCK * ROWS + j], &b[k / BLOCK * ROWS + j]);
            const int parts = G / BLOCK < 4 ? G / BLOCK : 4;
            for (int base = 0; base < G / BLOCK; base += parts)
#pragma GCC unroll 4
                for (int part = 0; part < parts; part++) {
                    const long at = (k / BLOCK + base + part) * ROWS + j;
                    q[at] = ints_of(group, type, base, part) - (int8_t)int8_offset(type);
                    if (minus && int8_offset(type)) minus[at] = -dot32((v8i32){0}, (v32i8)((v32u8){0} + 128), q[at], 0);
                }
        }
    const struct held_ints held = {q, minus, s, a, b};
    long first = 0;
    for (; first + COLS <= B; first += COLS) int8_block(x, first, COLS, w, type, K, sums + first * LANES, &held);
    for (; first < B; first++) int8_block(x, first, 1, w, type, K, sums + first * LANES, &held);
}

#if ACROSS
/* A prompt's rows against ROWS weight rows of a K-quant: across_block's arithmetic, each (activation row, weight
 * row) pair's operations the same and in the same order (so the same bits as a row gets alone), but the weights'
 * integers and scales unpacked once for all the prompt's rows, not once every COLS of them: into a scratch of
 * ROWS x K bytes and a few floats a super-block (L1 or L2), after which each step is loads, dpbusd, halves_added
 * and scaled_pairs' multiply-adds. across_block spent most of its time unpacking (benchmarks/int8_costs.c). */
enum { SPAN = 2 };  /* activation rows a step: their accumulators and inputs in registers */

struct across_weights {  /* ROWS weight rows' super-blocks g0..g0 + n - 1 unpacked, each (ROWS, n, ...) */
    long g0, n;
    const vi *q;  /* across_ints' 4 steps */
    const vf *a;  /* Q4_K, Q5_K: pair_a of rows 2p, 2p + 1 ((ROWS / 2, n)); Q6_K: q6_k_a of each row */
    const vf *b;  /* Q4_K, Q5_K: pair_b of rows 2p, 2p + 1 */
};

/* Activation rows first..first + c - 1 (c <= SPAN) against w's rows' super-blocks, added to pairs[i][p] (Q4_K,
 * Q5_K) or rows[i][j] (Q6_K) in across_block's order. */
static inline __attribute__((always_inline)) void across_span(const struct int8_rows *x, long first, const int c,
                                                              const struct across_weights *w, const int type,
                                                              long K, vf (*pairs)[ROWS / 2], vf (*rows)[ROWS]) {
    const long supers = K / SUPER, blocks = K / BLOCK, n = w->n;
    vf pair_of[SPAN][ROWS / 2], row_of[SPAN][ROWS];
    for (int i = 0; i < c; i++) {
        for (int p = 0; type != Q6_K && p < ROWS / 2; p++) pair_of[i][p] = pairs[i][p];
        for (int j = 0; type == Q6_K && j < ROWS; j++) row_of[i][j] = rows[i][j];
    }
    for (long g = 0; g < n; g++) {
        vi xv[SPAN][4], minus32[SPAN];  /* the activations in registers, each weight vector loaded once for them */
        vf d[SPAN], ds[SPAN];
        for (int i = 0; i < c; i++) {
            const int8_t *xq = x->across + (first + i) * K + (w->g0 + g) * SUPER;
            for (int u = 0; u < 4; u++) {
                xv[i][u] = (vi)_mm512_loadu_si512(xq + 64 * u);
                IN_REGISTER(xv[i][u]);
            }
            const long at = (first + i) * blocks + (w->g0 + g) * SUBS;
            d[i] = (vf)_mm512_broadcast_f32x8(_mm256_loadu_ps(x->d + at));
            if (type == Q6_K) minus32[i] = x->minus32[(first + i) * supers + w->g0 + g];
            else ds[i] = (vf)_mm512_broadcast_f32x8(_mm256_loadu_ps(x->s + at));
        }
        if (type == Q6_K) {
            for (int j = 0; j < ROWS; j++) {
                vi q[4];
                for (int u = 0; u < 4; u++) {
                    q[u] = w->q[(j * n + g) * 4 + u];
                    IN_REGISTER(q[u]);
                }
                const vf a = w->a[j * n + g];
                for (int i = 0; i < c; i++) row_of[i][j] = scaled(q6_k_sums(q, xv[i], minus32[i]), a, d[i], row_of[i][j]);
            }
            continue;
        }
        for (int p = 0; p < ROWS / 2; p++) {
            vi q[2][4];
            for (int h = 0; h < 2; h++)
                for (int u = 0; u < 4; u++) {
                    q[h][u] = w->q[((2 * p + h) * n + g) * 4 + u];
                    IN_REGISTER(q[h][u]);
                }
            const vf a = w->a[p * n + g], b = w->b[p * n + g];
            for (int i = 0; i < c; i++)
                pair_of[i][p] = scaled_pairs(pair_sums((const vi (*)[4])q, xv[i]), a, d[i], b, ds[i], pair_of[i][p]);
        }
    }
    for (int i = 0; i < c; i++) {
        for (int p = 0; type != Q6_K && p < ROWS / 2; p++) pairs[i][p] = pair_of[i][p];
        for (int j = 0; type == Q6_K && j < ROWS; j++) rows[i][j] = row_of[i][j];
    }
}

/* Super-blocks g0..g0 + n - 1 of w's first ROWS rows (of K) unpacked for across_span into q, a and b (their room). */
static inline __attribute__((always_inline)) struct across_weights across_unpack(const void *w, const int layout,
                                                                                long K, long g0, long n, vi *q,
                                                                                vf *a, vf *b) {
    const int type = file_type(layout);
    for (long g = 0; g < n; g++) {
        const uint8_t *group[ROWS];
        struct scales s[ROWS];
        for (int j = 0; j < ROWS; j++) {
            group[j] = (const uint8_t *)w + offset_of(j * K + (g0 + g) * SUPER, type);
            for (long at = 0; at < group_bytes(type); at += 64)  /* as across_block: rows come from memory */
                __builtin_prefetch(group[j] + at + PREFETCH, 0, 1);
        }
        unpack_each(group, type, s);
        for (int j = 0; j < ROWS; j++) {
            for (int u = 0; u < 4; u++) q[(j * n + g) * 4 + u] = across_ints(group[j], layout, u);
            if (type == Q6_K) a[j * n + g] = q6_k_a(&s[j]);
        }
        for (int p = 0; type != Q6_K && p < ROWS / 2; p++) {
            a[p * n + g] = pair_a(&s[2 * p]);
            b[p * n + g] = pair_b(&s[2 * p]);
        }
    }
    return (struct across_weights){g0, n, q, a, b};
}

/* int8_block of activation rows 0..B-1 against w's first ROWS rows, for a K-quant (across_span's way), as the file
 * holds it or laid out again (`layout`). Rows of up to CHUNK super-blocks are unpacked whole (across_whole), each
 * COLS activation rows' accumulators in registers. Longer ones (an MLP's 8192) CHUNK super-blocks at a time
 * (across_chunks), so that those stay in L1 with SPAN activation rows' (unpacked whole, they were read from L2:
 * 0.0100 ns a weight a row where 2048 took 0.0081, 1 thread, Zen 4), every row's accumulators kept between chunks:
 * the same additions in the same order. Each a function of its own for each layout: inlined together into
 * int8_rows' function, GCC's code for the whole rows ran 5-10% slower. */
enum { CHUNK = 8 };
static inline __attribute__((always_inline)) void across_whole(const struct int8_rows *x, long B, const void *w,
                                                               const int layout, long K, float *sums) {
    const int type = file_type(layout);
    vi q[ROWS * CHUNK * 4];
    vf a[ROWS * CHUNK], b[ROWS / 2 * CHUNK];
    const struct across_weights unpacked = across_unpack(w, layout, K, 0, K / SUPER, q, a, b);
    long i = 0;
    for (; i + COLS <= B; i += COLS) {  /* COLS rows' sums at once (across_sums: the same additions as one's) */
        vf pairs[COLS][ROWS / 2] = {{{0}}}, rows[COLS][ROWS] = {{{0}}};
        for (int at = 0; at < COLS; at += SPAN) across_span(x, i + at, SPAN, &unpacked, type, K, pairs + at, rows + at);
        across_sums((const vf (*)[ROWS / 2])pairs, (const vf (*)[ROWS])rows, type, COLS, sums + i * LANES);
    }
    for (; i < B; i++) {
        vf pairs[1][ROWS / 2] = {{{0}}}, rows[1][ROWS] = {{{0}}};
        across_span(x, i, 1, &unpacked, type, K, pairs, rows);
        across_sums((const vf (*)[ROWS / 2])pairs, (const vf (*)[ROWS])rows, type, 1, sums + i * LANES);
    }
}

static inline __attribute__((always_inline)) void across_chunks(const struct int8_rows *x, long B, const void *w,
                                                                const int layout, long K, float *sums) {
    const int type = file_type(layout);
    const long supers = K / SUPER;
    vi q[ROWS * CHUNK * 4];
    vf a[ROWS * CHUNK], b[ROWS / 2 * CHUNK];
    enum { GROUP = 64 };  /* activation rows a pass */
    vf pairs[GROUP][ROWS / 2], rows[GROUP][ROWS];
    for (long first = 0; first < B; first += GROUP) {
        const long R = B - first < GROUP ? B - first : GROUP;
        memset(pairs, 0, sizeof(vf) * R * (ROWS / 2)), memset(rows, 0, sizeof(vf) * R * ROWS);
        for (long g0 = 0; g0 < supers; g0 += CHUNK) {
            const long n = supers - g0 < CHUNK ? supers - g0 : CHUNK;
            const struct across_weights unpacked = across_unpack(w, layout, K, g0, n, q, a, b);
            long i = 0;
            for (; i + SPAN <= R; i += SPAN) across_span(x, first + i, SPAN, &unpacked, type, K, pairs + i, rows + i);
            for (; i < R; i++) across_span(x, first + i, 1, &unpacked, type, K, pairs + i, rows + i);
        }
        long i = 0;
        for (; i + COLS <= R; i += COLS)
            across_sums((const vf (*)[ROWS / 2])(pairs + i), (const vf (*)[ROWS])(rows + i), type, COLS,
                        sums + (first + i) * LANES);
        for (; i < R; i++)
            across_sums((const vf (*)[ROWS / 2])(pairs + i), (const vf (*)[ROWS])(rows + i), type, 1,
                        sums + (first + i) * LANES);
    }
}

#define ACROSS_ROWS_AS(W)                                                                                      \
    static __attribute__((noinline)) void across_whole_##W(const struct int8_rows *x, long B, const void *w,  \
                                                           long K, float *sums) {                             \
        across_whole(x, B, w, W, K, sums);                                                                     \
    }                                                                                                          \
    static __attribute__((noinline)) void across_chunks_##W(const struct int8_rows *x, long B, const void *w, \
                                                            long K, float *sums) {                            \
        across_chunks(x, B, w, W, K, sums);                                                                    \
    }
ACROSS_ROWS_AS(Q4_K) ACROSS_ROWS_AS(Q5_K) ACROSS_ROWS_AS(Q6_K)
ACROSS_ROWS_AS(Q4_K_ACROSS) ACROSS_ROWS_AS(Q5_K_ACROSS) ACROSS_ROWS_AS(Q6_K_ACROSS)

static inline __attribute__((always_inline)) void across_rows(const struct int8_rows *x, long B, const void *w,
                                                              const int layout, long K, float *sums) {
    const int whole = K / SUPER <= CHUNK;
#define ACROSS_CASE(W)                                                                                         \
    case W: (whole ? across_whole_##W : across_chunks_##W)(x, B, w, K, sums); return;
    switch (layout) {
    ACROSS_CASE(Q4_K) ACROSS_CASE(Q5_K) ACROSS_CASE(Q6_K)
    ACROSS_CASE(Q4_K_ACROSS) ACROSS_CASE(Q5_K_ACROSS) ACROSS_CASE(Q6_K_ACROSS)
    }
#undef ACROSS_CASE
}

/* A super-block's 4 steps (across_ints') stored as `type` lays out its q: the file's (GGUF's layouts), or laid out
 * again (across_ints' layouts); its other bytes untouched. */
static inline __attribute__((always_inline)) void across_store(const vi *step, const int type, uint8_t *group) {
    if (laid_out(type)) {
        for (int r = 0; r < 2; r++)
            _mm512_storeu_si512(group + nibbles_at(type) + 64 * r,
                                (__m512i)((step[2 * r] & 0x0f0f0f0f) | (step[2 * r + 1] & 0x0f0f0f0f) << 4));
        for (int u = 0; type == Q5_K_ACROSS && u < 4; u++) {
            const uint64_t fifth = _cvtmask64_u64(_mm512_test_epi8_mask((__m512i)step[u], _mm512_set1_epi8(16)));
            memcpy(group + 16 + 8 * u, &fifth, 8);
        }
        if (type == Q6_K_ACROSS) {
            const vu high[4] = {(vu)step[0] & 0x30303030, (vu)step[1] & 0x30303030, (vu)step[2] & 0x30303030,
                                (vu)step[3] & 0x30303030};
            _mm512_storeu_si512(group + 128, (__m512i)(high[0] | high[1] << 2 | high[2] >> 4 | high[3] >> 2));
        }
        return;
    }
    /* the file's: first the 256 integers in the weights' order (across_order's inverse: word 16k + i of them is step
     * (i % 8) / 2's word 2k + i / 8 + 8 (i % 2), of steps 0-1 where i % 8 < 4) */
    uint8_t v[SUPER] __attribute__((aligned(64)));
    const vi i = __builtin_convertvector(iota(), vi), pick = (i & 7) >> 1 & 1;
    for (int k = 0; k < 4; k++) {
        const __m512i word = (__m512i)(pick * 16 + 2 * k + (i >> 3) + (i & 1) * 8);
        _mm512_store_si512(v + 64 * k,
                           _mm512_mask_blend_epi32(0xf0f0, _mm512_permutex2var_epi32((__m512i)step[0], word,
                                                                                      (__m512i)step[1]),
                                                   _mm512_permutex2var_epi32((__m512i)step[2], word,
                                                                             (__m512i)step[3])));
    }
    if (type == Q6_K) {  /* of each 128 weights, 64 bytes of low 4 bits (weights j, j + 64 in byte j), 32 of high 2 */
        for (int h = 0; h < 2; h++) {
            const uint8_t *q = v + 128 * h;
            for (int p = 0; p < 2; p++)
                *(v32u8u *)(group + 64 * h + 32 * p) = (load32(q + 32 * p) & 15) | (load32(q + 64 + 32 * p) & 15) << 4;
            *(v32u8u *)(group + 128 + 32 * h) = load32(q) >> 4 | load32(q + 32) >> 4 << 2 | load32(q + 64) >> 4 << 4 |
                                                 load32(q + 96) >> 4 << 6;
        }
        return;
    }
    /* Q4_K, Q5_K: sub-blocks 2p and 2p + 1 in the low and high 4 bits of 32 bytes; Q5_K's fifth bits, bit s of byte j
     * sub-block s's weight j */
    for (int p = 0; p < 4; p++)
        *(v32u8u *)(group + nibbles_at(type) + 32 * p) =
            (load32(v + 64 * p) & 15) | (load32(v + 64 * p + 32) & 15) << 4;
    v32u8 fifth = {0};
    for (int s = 0; type == Q5_K && s < SUBS; s++) fifth |= (load32(v + 32 * s) >> 4 & 1) << s;
    if (type == Q5_K) *(v32u8u *)(group + 16) = fifth;
}

/* n super-blocks of `from` into `to` (as many bytes) with their q laid out as `to_type` does (another layout of
 * from_type's file type): a copy, then each super-block's steps stored again. */
static inline __attribute__((always_inline)) void across_relayout(const uint8_t *from, const int from_type,
                                                                  uint8_t *to, const int to_type, long n) {
    const long bytes = group_bytes(from_type);
    memcpy(to, from, n * bytes);
    for (long g = 0; g < n; g++) {
        vi step[4];
        for (int u = 0; u < 4; u++) step[u] = across_ints(from + g * bytes, from_type, u);
        across_store(step, to_type, to + g * bytes);
    }
}

/* n super-blocks of a K-quant `type` into `to` in its other layout: the file's laid out again, or back (each
 * specialized). */
static void across_other(const uint8_t *from, int type, uint8_t *to, long n) {
    switch (type) {
    case Q4_K: across_relayout(from, Q4_K, to, Q4_K_ACROSS, n); break;
    case Q5_K: across_relayout(from, Q5_K, to, Q5_K_ACROSS, n); break;
    case Q6_K: across_relayout(from, Q6_K, to, Q6_K_ACROSS, n); break;
    case Q4_K_ACROSS: across_relayout(from, Q4_K_ACROSS, to, Q4_K, n); break;
    case Q5_K_ACROSS: across_relayout(from, Q5_K_ACROSS, to, Q5_K, n); break;
    case Q6_K_ACROSS: across_relayout(from, Q6_K_ACROSS, to, Q6_K, n); break;
    }
}
#endif

#ifndef PROMPT_ROWS
#define PROMPT_ROWS 8  /* rows from which across_rows' unpacking once pays */
#endif
#ifndef HELD_ROWS
#define HELD_ROWS (2 * COLS)  /* rows past which held_rows' unpacking once pays (at 4 it was a wash) */
#endif
enum { HELD_WIDTH = 1 << 15 };  /* the widest rows held_rows holds: 8 K bytes on a thread's stack (256 KiB); wider
                                 * ones, which a file can declare, are multiplied unheld */
/* int8_block of activation rows 0..B-1 against ROWS weight rows w of type W, where a prompt's tile multiplies them
 * (across_rows): whether it did. */
static inline __attribute__((always_inline)) int prompt_rows(const struct int8_rows *x, long B, const void *w,
                                                             const int type, long K, float *sums) {
#if ACROSS
    if (is_super(type) && B >= PROMPT_ROWS) {
        across_rows(x, B, w, type, K, sums);
        return 1;
    }
#endif
#if LANE_BLOCKS
    if (!is_super(type) && B > 1) {  /* its unpacking once pays from 2 rows */
        lanes_rows(x, B, w, type, K, sums);
        return 1;
    }
#endif
#if !(LANE_BLOCKS && ACROSS)  /* compiled only where it can run: its dead code made GCC's Q8_0 tile 0.72x as fast */
    if (holds(type) && B > HELD_ROWS && K <= HELD_WIDTH) {
        held_rows(x, B, w, type, K, sums);
        return 1;
    }
#endif
    return 0;
}

/* sums (B, LANES): quantized activation rows 0..B-1 of x against weight rows n..n+LANES-1 of type W, ROWS at a time,
 * COLS activation rows at a time (the weights' block stays in L1 across them), or a prompt's tile (prompt_rows); a
 * function for each type. */
#define INT8_ROWS_AS(W)                                                                                        \
    static __attribute__((noinline)) void int8_rows_##W(const struct int8_rows *x, const void *w, long B,     \
                                                        long n, long K, float *sums) {                        \
        for (int j = 0; j < LANES; j += ROWS) {                                                                \
            const void *rows = (const char *)w + offset_of((n + j) * K, W);                                    \
            if (prompt_rows(x, B, rows, W, K, sums + j)) continue;                                             \
            long b = 0;                                                                                        \
            for (; b + COLS <= B; b += COLS) int8_block(x, b, COLS, rows, W, K, sums + b * LANES + j, NULL);       \
            for (; b < B; b++) int8_block(x, b, 1, rows, W, K, sums + b * LANES + j, NULL);                     \
        }                                                                                                      \
    }
INT8_ROWS_AS(Q4_1)
INT8_ROWS_AS(Q5_0) INT8_ROWS_AS(Q5_1)
#if !EIGHT_ROWS
INT8_ROWS_AS(Q8_0) INT8_ROWS_AS(Q4_0) INT8_ROWS_AS(Q4_K) INT8_ROWS_AS(Q5_K) INT8_ROWS_AS(Q6_K)
#endif
#if LANE_BLOCKS
INT8_ROWS_AS(Q4_0_STRIPES)
#endif
#if ACROSS
INT8_ROWS_AS(Q4_K_ACROSS) INT8_ROWS_AS(Q5_K_ACROSS) INT8_ROWS_AS(Q6_K_ACROSS)
#endif

#if LANE_BLOCKS || EIGHT_ROWS
/* N rows of K of weights laid out again at load (Q4_0_STRIPES, the K-quants' _ACROSS) put back as the file's
 * blocks (of file_type(type)) into `out`; with AVX2, N a multiple of 8 (whole groups). */
static void restore_rows(const void *w, int type, long N, long K, uint8_t *out) {
    const long row = offset_of(K, type);
#if EIGHT_ROWS
    const long groups = K / group_size(type), Q = eights_q(type);
    for (long g = 0; g < N / EIGHTS; g++) {
        uint8_t *group = (uint8_t *)w + g * EIGHTS * row;
        eights_move(file_type(type), out + g * EIGHTS * row, row, 0, groups, group, group + groups * Q, 1);
    }
#else
    for (long n = 0; n < N; n++) {
        const uint8_t *from = (const uint8_t *)w + n * row;
#if ACROSS
        if (is_super(type)) {
            across_other(from, type, out + n * row, K / SUPER);
            continue;
        }
#endif
        stripes_restore(from, K / BLOCK, out + n * row);
    }
#endif
}
#endif

/* K-quant weights w (N, K) of `type` (Q4_K, Q5_K, Q6_K) laid out again (its type's _ACROSS), or with AVX2 Q8_0's
 * (Q8_0_EIGHTS), into `out` (as many bytes), where a tile for it is built (1; elsewhere 0, nothing written): for
 * across_block with AVX-512 VNNI and DQ, each row; for eights_block with AVX2, as groups of 8 rows (eights_move; N
 * a multiple of 8). */
int repack_across(const void *w, int type, long N, long K, void *out) {
#if ACROSS
    if (!is_super(type)) return 0;
    const long row = offset_of(K, type);
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) across_other((const uint8_t *)w + n * row, type, (uint8_t *)out + n * row, K / SUPER);
    return 1;
#elif EIGHT_ROWS
    if (type == Q4_0 || !eights(type)) return 0;  /* Q4_0's: repack_stripes */
    const long row = offset_of(K, type), groups = K / group_size(type);
#pragma omp parallel for schedule(static)
    for (long g = 0; g < N / EIGHTS; g++) {
        uint8_t *to = (uint8_t *)out + g * EIGHTS * row;
        eights_move(type, (uint8_t *)w + g * EIGHTS * row, row, 0, groups, to, to + groups * eights_q(type), 0);
    }
    return 1;
#else
    (void)w, (void)type, (void)N, (void)K, (void)out;
    return 0;
#endif
}

/* sums (B, LANES): every activation row of x (B, K) against weight rows n..n+LANES-1, from x's quantized rows xq
 * where given and the weights' type has integer code here, else exactly (dot_rows). */
static void rows_times(const struct int8_rows *xq, const void *x, int x_type, const void *w, int w_type, long B,
                       long n, long K, float *sums) {
#if LANE_BLOCKS || EIGHT_ROWS
    if (laid_out(w_type) && !xq) {  /* exactly: the rows put back as the file's blocks, then the file type's code */
        uint8_t restored[offset_of(LANES * K, w_type)];
        restore_rows((const uint8_t *)w + offset_of(n * K, w_type), w_type, LANES, K, restored);
        dot_rows(x, x_type, restored, file_type(w_type), B, 0, K, sums);
        return;
    }
#endif
    switch (xq ? w_type : F32) {
#if EIGHT_ROWS  /* the file's blocks, or laid out again */
    case Q4_1: case Q4_1_EIGHTS: eights_Q4_1(xq, w, laid_out(w_type), B, n, K, sums); break;
    case Q5_0: case Q5_0_EIGHTS: eights_Q5_0(xq, w, laid_out(w_type), B, n, K, sums); break;
    case Q5_1: case Q5_1_EIGHTS: eights_Q5_1(xq, w, laid_out(w_type), B, n, K, sums); break;
    case Q8_0: case Q8_0_EIGHTS: eights_Q8_0(xq, w, laid_out(w_type), B, n, K, sums); break;
    case Q4_0: case Q4_0_STRIPES: eights_Q4_0(xq, w, laid_out(w_type), B, n, K, sums); break;
    case Q4_K: case Q4_K_ACROSS: eights_Q4_K(xq, w, laid_out(w_type), B, n, K, sums); break;
    case Q5_K: case Q5_K_ACROSS: eights_Q5_K(xq, w, laid_out(w_type), B, n, K, sums); break;
    case Q6_K: case Q6_K_ACROSS: eights_Q6_K(xq, w, laid_out(w_type), B, n, K, sums); break;
#else
    case Q4_1: int8_rows_Q4_1(xq, w, B, n, K, sums); break;
    case Q5_0: int8_rows_Q5_0(xq, w, B, n, K, sums); break;
    case Q5_1: int8_rows_Q5_1(xq, w, B, n, K, sums); break;
    case Q8_0: int8_rows_Q8_0(xq, w, B, n, K, sums); break;
    case Q4_0: int8_rows_Q4_0(xq, w, B, n, K, sums); break;
    case Q4_K: int8_rows_Q4_K(xq, w, B, n, K, sums); break;
    case Q5_K: int8_rows_Q5_K(xq, w, B, n, K, sums); break;
    case Q6_K: int8_rows_Q6_K(xq, w, B, n, K, sums); break;
#endif
#if LANE_BLOCKS
    case Q4_0_STRIPES: int8_rows_Q4_0_STRIPES(xq, w, B, n, K, sums); break;
#endif
#if ACROSS
    case Q4_K_ACROSS: int8_rows_Q4_K_ACROSS(xq, w, B, n, K, sums); break;
    case Q5_K_ACROSS: int8_rows_Q5_K_ACROSS(xq, w, B, n, K, sums); break;
    case Q6_K_ACROSS: int8_rows_Q6_K_ACROSS(xq, w, B, n, K, sums); break;
#endif
    default: dot_rows(x, x_type, w, w_type, B, n, K, sums);
    }
}

/* Whether any of `count` weight types is multiplied by across_block (its inputs' q wanted in its order too). */
static int any_across(const int *w_type, int count) {
    int any = 0;
    for (int m = 0; m < count; m++) any |= ACROSS && is_super(w_type[m]);
    return any;
}

/* Whether R rows against any of `count` weight types go through lanes_rows, or stripes_block (their q wanted in
 * lanes order). */
static int any_lanes(const int *w_type, int count, long R) {
    int any = 0;
    for (int m = 0; m < count; m++)
        any |= LANE_BLOCKS && (R > 1 || w_type[m] == Q4_0_STRIPES) && group_bytes(w_type[m]) && !is_super(w_type[m]);
    return any;
}

/* xq, x (R, K) quantized into it for `count` weights of w_type, or NULL where not asked (xq NULL) or K is not whole
 * blocks (then no weights of a block type either). In a decoding step each thread quantizes a product's whole
 * input (a few rows) into a copy of its own: the threads that split the product's outputs then need no barrier. */
static const struct int8_rows *quantized(const struct int8_rows *xq, const void *x, int x_type, long R, long K,
                                         const int *w_type, int count) {
    if (!xq || K % BLOCK) return NULL;
    quantize_rows(x, x_type, R, K, xq, any_across(w_type, count), any_lanes(w_type, count, R));
    return xq;
}

/* Room for R rows of K quantized (struct int8_rows) in one allocation, or NULL out of memory. */
static struct int8_rows int8_rows_for(long R, long K) {
    const long q = R * K, across = ACROSS ? R * K : 0, lanes = LANE_BLOCKS ? R * stripes_of(K) * STRIPE : 0,
               blocks = R * (K / BLOCK), minus32 = ACROSS ? R * (K / SUPER) * (long)sizeof(vi) : 0;
    const long scales_bytes = (2 * sizeof(float) + (LANE_BLOCKS || EIGHT_ROWS ? sizeof(int32_t) : 0)) * blocks,
               vectors = (q + across + lanes + scales_bytes + 63) / 64 * 64;  /* minus32's, aligned as vi is */
    void *room;
    if (posix_memalign(&room, 64, vectors + minus32)) return (struct int8_rows){NULL};
    float *scales = (float *)((char *)room + q + across + lanes);
    return (struct int8_rows){(int8_t *)room, scales, scales + blocks, ACROSS ? (int8_t *)room + q : NULL,
                              LANE_BLOCKS || EIGHT_ROWS ? (int32_t *)(scales + 2 * blocks) : NULL,
                              LANE_BLOCKS ? (uint8_t *)room + q + across : NULL,
                              ACROSS ? (vi *)((char *)room + vectors) : NULL};
}

/* Rows first.. of quantized rows of K. */
static struct int8_rows int8_rows_from(const struct int8_rows *x, long first, long K) {
    return (struct int8_rows){x->q + first * K, x->d + first * (K / BLOCK), x->s + first * (K / BLOCK),
                              x->across ? x->across + first * K : NULL,
                              x->sum ? x->sum + first * (K / BLOCK) : NULL,
                              x->lanes ? x->lanes + first * stripes_of(K) * STRIPE : NULL,
                              x->minus32 ? x->minus32 + first * (K / SUPER) : NULL};
}

/* LoRA adapters' low-rank updates to a decoding step's linear layers (generation/adapters.py stacks them): per
 * layer and linear layer (struct block's order), the step's adapters' A stacked, a (n, r, in), and their scaled B
 * transposed, b (n, r, out), float32, every rank zero-padded to r; a NULL: no row's adapter adapts it. */
struct lowrank {
    const float *a[7], *b[7];
    long r[7];
};

/* The updates of `count` matrices of one products() call (those of u from `first` on): row i (of T a sequence)
 * of adapter adapter[i / T] >= 0 adds b_adapter^T t_i, its t_i = a_adapter x_i (lowrank_inputs()) at t + (m * R
 * + i) * rmax. */
struct updates {
    const struct lowrank *u;
    int first;
    const int32_t *adapter;
    long T, R, rmax;
    const float *t;
};

/* Row i's adapter for matrix m of d's products, or -1: none (a base row, or a layer no adapter adapts). */
static inline int adapter_of(const struct updates *d, int m, long i) {
    return d && d->u->a[d->first + m] ? d->adapter[i / d->T] : -1;
}

/* LANES outputs n.. of row i's update for matrix m: b_a^T t_i, its r products added in order (fmadd). */
static inline vf update(const struct updates *d, int m, int a, long i, long n, long N) {
    const long r = d->u->r[d->first + m];
    const float *b = d->u->b[d->first + m] + a * r * N + n, *t = d->t + (m * d->R + i) * d->rmax;
    vf acc = {0};
    for (long j = 0; j < r; j++) acc = fmadd(splat(t[j]), load_f32(b + j * N), acc);
    return acc;
}

/* Inside a parallel region: t for each adapted row of `count` matrices of one input x (R, K) of x_type, every
 * a_adapter's r dot products with the row (fmadd in LANES partial sums, as the base products), rounded to the
 * step's `type` as torch's x @ A^T would be. */
static void lowrank_inputs(const struct updates *d, int count, const void *x, int x_type, int type, long K) {
    int adapted = 0;  /* the same for every thread: none of them meets the loop's barrier, or all do */
    for (int m = 0; m < count; m++) adapted |= d->u->a[d->first + m] != NULL;
    if (!adapted) return;
#pragma omp for schedule(static)
    for (long k = 0; k < count * d->R * d->rmax; k++) {
        const int m = k / (d->R * d->rmax);
        const long i = k / d->rmax % d->R, j = k % d->rmax, a = adapter_of(d, m, i), r = d->u->r[d->first + m];
        if (a < 0 || j >= r) continue;
        const float *row = d->u->a[d->first + m] + (a * r + j) * K;
        vf acc = {0};
        for (long c = 0; c < K; c += LANES) acc = fmadd(load(x, i * K + c, x_type), load_f32(row + c), acc);
        ((float *)d->t)[(m * d->R + i) * d->rmax + j] = round_to(type, sum_lanes(acc));
    }
}

/* Inside a parallel region, each thread its share of output rows: y[m] (B, N[m]) = x (B, K) @ w[m] (N[m], K)^T,
 * w[m] of w_type[m], times scale[m] (N[m],) per output channel where given (int8 weights), for `count` matrices
 * of one input (q, k and v: one pass). x is of x_type, y of `type`; with `add`, y += the product, each rounded as
 * torch's y + product would be. With d (else NULL), an adapted row's product, rounded, then gets its update added
 * (rounded), as torch's base(x) + update; the other rows' bits are the same as without. With xq (else NULL), x's
 * rows quantized to 8 bits: the weights of types with integer code are multiplied by those (rows_times). With
 * `wait`, the threads wait for each other at the end (y is read next); without, each goes on past its share: a
 * thread's share is the same output rows in every call of one shape (below), so linear()'s calls for its
 * blocks of rows follow one another with no barrier between them (a barrier a 64-row block was 32 for a 16x128
 * prefill's product, each a wait for the slower thread, and a long one where other processes share the cores). */
static void products(const void *x, int x_type, int type, int count, const void *const *w, const int *w_type,
                     const float *const *scale, void *const *y, int add, long B, const long *N, long K,
                     const struct updates *d, const struct int8_rows *xq, int wait) {
    /* Each thread's share: consecutive rows holding about as many of the weights' bytes as each other thread's,
     * the same rows every call of one shape. By rows alone, a Q4_K_M layer's q and k beside its Q6_K v gave one
     * thread 1.3x the other's bytes to read while the other waited. */
    long total = 0, bytes = 0;
    for (int m = 0; m < count; m++) total += N[m], bytes += N[m] * offset_of(K, w_type[m]);
    const long threads = omp_get_num_threads(), t = omp_get_thread_num();
    const long from = bytes * t / threads, to = bytes * (t + 1) / threads;  /* its rows' bytes start in here */
    for (long row = 0, next = 0; row < total; row += LANES) {  /* next: the bytes of the rows up to row's end */
        int m = 0;
        long n = row;
        while (n >= N[m]) n -= N[m++];
        const long at = next;
        next += LANES * offset_of(K, w_type[m]);
        if (at < from) continue;
        if (at >= to) break;
        float sums[B * LANES];
        rows_times(xq, x, x_type, w[m], w_type[m], B, n, K, sums);
        for (long b = 0; b < B; b++) {
            vf value = load_f32(sums + b * LANES);
            if (scale[m]) value *= load_f32(scale[m] + n);
            const int a = adapter_of(d, m, b);
            if (a >= 0)
                value = round_lanes(type, round_lanes(type, value) + round_lanes(type, update(d, m, a, b, n, N[m])));
            if (add) value = load(y[m], b * N[m] + n, type) + round_lanes(type, value);
            store_lanes(y[m], b * N[m] + n, type, value);
        }
    }
    if (wait) {
#pragma omp barrier
    }
}

/* y (B, sum N) = x (B, K) @ w[m]^T for each of `count` matrices, their outputs one after another. x and y
 * are F32 or BF16, the weights F32, BF16, I8 (with float32 scales) or a block type; K is a multiple of 16 (of
 * BLOCK for block types, of SUPER for the K-quants), each N[m] of 16. A prompt's many rows go ROW_BLOCK at a
 * time: a block's activations stay in L2 while every weight row streams past them. With int8, x's rows are
 * quantized to 8 bits first and multiplied in integers (rows_times; exactly, should their room not be had). */
#ifndef ROW_BLOCK
#define ROW_BLOCK 64
#endif
void linear(const void *x, int type, int count, const void *const *w, int w_type, const float *const *scale,
            void *y, long B, const long *N, long K, int int8) {
    /* Several rows of bf16: widened once here, not once per ROWS weight rows (the same values); unless the
     * CPU multiplies them with bf16 weights as they are. */
    float *wide = type == BF16 && B > COLS && !as_pairs(type, w_type) ? malloc(sizeof(float) * B * K) : NULL;
    for (long i = 0; wide && i < B * K; i++) wide[i] = element(x, i, BF16);
    const int x_type = wide ? F32 : type;
    int types[count];
    for (int m = 0; m < count; m++) types[m] = w_type;
    /* x quantized once, each thread its share of the rows (a prompt's many: each thread quantizing all of them was
     * a tenth of a 512-row product's time), then a barrier */
    const struct int8_rows xq = int8 && K % BLOCK == 0 ? int8_rows_for(B, K) : (struct int8_rows){NULL};
    const int across = any_across(&w_type, 1), lanes = any_lanes(&w_type, 1, B);
#pragma omp parallel
    {
        if (xq.q) {
#pragma omp for schedule(static)
            for (long r = 0; r < B; r++) {
                const struct int8_rows row = int8_rows_from(&xq, r, K);
                quantize_rows((const char *)x + r * K * size_of(type), type, 1, K, &row, across, lanes);
            }
        }
        for (long b = 0; b < B; b += ROW_BLOCK) {
            const long rows = B - b < ROW_BLOCK ? B - b : ROW_BLOCK;
            void *ys[count];
            for (int m = 0, before = 0; m < count; before += N[m++])
                ys[m] = (char *)y + (B * before + b * N[m]) * size_of(type);
            const struct int8_rows part = xq.q ? int8_rows_from(&xq, b, K) : xq;
            products((const char *)(wide ? wide : x) + b * K * size_of(x_type), x_type, type, count, w, types,
                     scale, ys, 0, rows, N, K, NULL, xq.q ? &part : NULL, 0);
        }
    }
    free(wide), free(xq.q);
}

/* Whether int8 mode's products of weights of w_type at a prompt's many rows cost less than the exact ones (ops.py
 * asks): where across_rows or lanes_rows multiplies them; with AVX2's 8 lanes where eights_block does, every block
 * type (laid out at load: benchmarks/int8_costs.c at 64 rows, ns a weight a row, int8 / exact: Q4_0 0.016 / 0.030,
 * Q4_K 0.016 / 0.029, Q5_K 0.020 / 0.031, Q6_K 0.021 / 0.032, Q8_0 0.020 / 0.032, Q4_1 0.015 / 0.030, Q5_0 and Q5_1
 * 0.014 / 0.030-0.037), and where held_rows does and the weights' offset is taken out there (AVX2 without F16C).
 * Elsewhere the integer products cost what the exact ones do or more (SSE2 1.7x, AVX-512 without VNNI 1.0-1.9x),
 * which run at the CPU's float32 multiply-add rate, and prompts stay exact. */
int int8_prompts(int w_type) {
    if (LANE_BLOCKS || ACROSS) return is_super(w_type) ? ACROSS : LANE_BLOCKS && group_bytes(w_type);
#if EIGHT_ROWS
    if (eights(w_type)) return 1;
#endif
    return LANES == 8 && holds(w_type) && (is_super(w_type) || int8_offset(w_type));  /* AVX2 and FMA: held_rows' */
}

/* A transformer block's weights, as the Python side fills them in (same order). */
struct block {
    const void *attn_norm, *mlp_norm;  /* (C,), in the activations' type */
    const void *q_proj, *k_proj, *v_proj, *o_proj, *gate_proj, *up_proj, *down_proj;  /* (out, in) */
    const float *q_proj_scale, *k_proj_scale, *v_proj_scale, *o_proj_scale, *gate_proj_scale, *up_proj_scale,
        *down_proj_scale;  /* or NULL */
    int w_type[7];  /* each matrix's type, in the order above: a GGUF file mixes them (Q4_K_M's Q6_K ones) */
    long C, H, KVH, D, I;  /* hidden size, query and K/V heads, head size, MLP size */
    float eps;
};

/* One row (C,): out = weight * (x / rms(x)), rms in float32 from LANES partial sums of squares; in bf16 rounded
 * where torch rounds: the normed x, then its product with the weight. out is of out_type, holding values of
 * `type`. The decoding step (layer()) and a prompt's rows (norm_rows) both call this, so a row gets the same
 * bits either way. */
static void norm_row(const void *x, const void *weight, void *out, int out_type, int type, long C, float eps) {
    vf squares = {0};
    for (long c = 0; c < C; c += LANES) {
        vf v = load(x, c, type);
        squares = fmadd(v, v, squares);
    }
    float inv = 1.0f / sqrtf(sum_lanes(squares) / C + eps);
    for (long c = 0; c < C; c += LANES)
        store_lanes(out, c, out_type,
                    round_lanes(type, load(weight, c, type) * round_lanes(type, load(x, c, type) * inv)));
}

/* Inside a parallel region: out (R, C) = norm_row of each row of x (R, C). */
static void rms_norm(const void *x, const void *weight, void *out, int out_type, int type, long R, long C,
                     float eps) {
#pragma omp for schedule(static)
    for (long r = 0; r < R; r++)
        norm_row((const char *)x + r * C * size_of(type), weight, (char *)out + r * C * size_of(out_type), out_type,
                 type, C, eps);
}

/* A product as torch leaves it: rounded to `type`, and in float32 too (never fused with the addition that
 * follows, as contraction is off: torch's x * cos + rotate_half(x) * sin rounds three times). */
static inline vf product(int type, vf a, vf b) { return round_lanes(type, a * b); }

static inline float product1(int type, float a, float b) { return round_to(type, a * b); }  /* one element */

/* One head (D,) into out (may be x itself): halves (i, i + D/2) rotated by the angles whose cos and sin are
 * (D,), rounded as torch's x * cos + rotate_half(x) * sin. A vector at a time; D/2 need not be a multiple of
 * LANES (decoding takes head sizes of 16, 48, ...), the rest one element at a time, rounded alike. The
 * decoding step and rope_rows both call this. */
static void rope_head(const void *x, const void *cos, const void *sin, void *out, int type, long D) {
    const long half = D / 2;
    long d = 0;
    for (; d + LANES <= half; d += LANES) {
        vf x1 = load(x, d, type), x2 = load(x, d + half, type);
        store_lanes(out, d, type, product(type, x1, load(cos, d, type)) + product(type, -x2, load(sin, d, type)));
        store_lanes(out, d + half, type, product(type, x2, load(cos, d + half, type)) +
                                             product(type, x1, load(sin, d + half, type)));
    }
    for (; d < half; d++) {
        float x1 = element(x, d, type), x2 = element(x, d + half, type);
        store(out, d, type, product1(type, x1, element(cos, d, type)) + product1(type, -x2, element(sin, d, type)));
        store(out, d + half, type, product1(type, x2, element(cos, d + half, type)) +
                                       product1(type, x1, element(sin, d + half, type)));
    }
}

/* silu(gate) * up, a vector of `type`'s values: silu's result rounded to `type`, then the product, as torch's
 * F.silu(gate) * up. The decoding step's SwiGLU and silu_mul both call this. */
static inline vf silu_times(int type, vf gate, vf up) {
    return round_lanes(type, round_lanes(type, gate / (1.0f + exp_lanes(-gate))) * up);  /* g / (1 + e^-g) */
}

/* LANES keys or values of a cache slot as the model's `type` reads them (KVCache.update): widened from kv_type;
 * int8 times the slot's scale, rounded to `type`. */
static inline vf cached(const void *kv, long i, const int kv_type, const int type, float scale) {
    return kv_type == I8 ? round_lanes(type, load(kv, i, I8) * splat(scale)) : load(kv, i, kv_type);
}

/* n query heads (n, D) of one row, of `type`, against their shared K/V head's slots, of kv_type (int8: times
 * k_scale[s] / v_scale[s]): scores into p (n, S), then the weighted sums of V, in float32; p holds MAX_GROUP *
 * padded(S) floats. Each slot's key and value are read once for all n queries: at batch 16 the cache, not the
 * weights, is most of what a step reads. Slot s is seen where seen[s] != 0, or with no mask up to `last`.
 * Inlined with constant kv_type, type (for int8's rounding), D and n, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const void *q, const void *k, const void *v,
                                                         const float *k_scale, const float *v_scale, void *out,
                                                         int out_type, const int type, const int kv_type, long S,
                                                         const long D, const int n, long last, const uint8_t *seen,
                                                         float *p, float *qv) {
    const float scale = 1.0f / sqrtf((float)D);
    const long P = padded(S);  /* p's rows, whole vectors: the slots past S score -inf */
    for (long d = 0; d < n * D; d++) qv[d] = element(q, d, type);
    for (int j = 0; j < n; j++)
        for (long s = S; s < P; s++) p[j * P + s] = -INFINITY;
    float top[MAX_GROUP], total[MAX_GROUP] = {0};
    for (int j = 0; j < n; j++) top[j] = -INFINITY;
    for (long s = 0; s < S; s++) {
        if (seen ? !seen[s] : s > last) {
            for (int j = 0; j < n; j++) p[j * P + s] = -INFINITY;
            continue;
        }
        vf acc[MAX_GROUP] = {{0}};
        for (long d = 0; d < D; d += LANES) {
            vf key = cached(k, s * D + d, kv_type, type, kv_type == I8 ? k_scale[s] : 0);
            for (int j = 0; j < n; j++) acc[j] = fmadd(load_f32(qv + j * D + d), key, acc[j]);
        }
        for (int j = 0; j < n; j++) {
            float score = p[j * P + s] = sum_lanes(acc[j]) * scale;
            if (score > top[j]) top[j] = score;
        }
    }
    for (int j = 0; j < n; j++) {
        vf sum = {0};
        for (long s = 0; s < P; s += LANES) {
            vf e = exp_lanes(load_f32(p + j * P + s) - top[j]);
            *(vfu *)(p + j * P + s) = e;
            sum += e;
        }
        total[j] = sum_lanes(sum);
    }
    vf o[MAX_GROUP][MAX_HEAD_DIM / LANES] = {{{0}}};
    for (long s = 0; s < S; s++) {
        if (seen ? !seen[s] : s > last) continue;
        for (long d = 0; d < D; d += LANES) {
            vf value = cached(v, s * D + d, kv_type, type, kv_type == I8 ? v_scale[s] : 0);
            for (int j = 0; j < n; j++) o[j][d / LANES] = fmadd(splat(p[j * P + s]), value, o[j][d / LANES]);
        }
    }
    for (int j = 0; j < n; j++)
        for (long d = 0; d < D; d++)
            store(out, j * D + d, out_type, round_to(type, o[j][d / LANES][d % LANES] / total[j]));
}

#define ATTEND_AS(n, type, kv_type)                                                                    \
    (D == 64 ? attend(q, k, v, k_scale, v_scale, out, out_type, type, kv_type, S, 64, n, last, seen, p, qv) \
             : attend(q, k, v, k_scale, v_scale, out, out_type, type, kv_type, S, D, n, last, seen, p, qv))
/* Only int8 rounds to the model's type as it reads: float32 and bf16 caches hold values of it already. */
#define ATTEND(n)                                                                                  \
    (kv_type == I8 ? (type == BF16 ? ATTEND_AS(n, BF16, I8) : ATTEND_AS(n, F32, I8))               \
                   : kv_type == BF16 ? ATTEND_AS(n, type, BF16) : ATTEND_AS(n, type, F32))

static void attend_any(const void *q, const void *k, const void *v, const float *k_scale, const float *v_scale,
                       void *out, int out_type, int type, int kv_type, long S, long D, int n, long last,
                       const uint8_t *seen, float *p, float *qv) {
    switch (n) {
    case 1: ATTEND(1); break;
    case 2: ATTEND(2); break;
    case 3: ATTEND(3); break;
    default: ATTEND(MAX_GROUP); break;
    }
}

/* Every layer's KV cache, as the Python side fills it in (same order): layer l's keys k[l] and values v[l],
 * (B, KVH, S, D) of `type` (F32, BF16 or I8); with I8, their scales k_scale[l] and v_scale[l], (B, KVH, S): a
 * key is its int8 values times its slot's scale. */
struct cache {
    void *const *k, *const *v;
    float *const *k_scale, *const *v_scale;  /* NULL unless I8 */
    int type;
    long S, stride_b, stride_h;  /* the slots seen; the row and head strides of k and v (elements) */
    long scale_stride_b, scale_stride_h;  /* and of the scales (their slots are contiguous) */
};

/* One head's D keys or values of `type` into a cache slot of kv_type, rounded as KVCache.update rounds them:
 * to bf16; or to int8 of scale (into *scale) their largest magnitude / 127, each x / scale rounded to the
 * nearest (ties to even, as torch.round) within +-127. */
static void to_cache(const void *x, int type, void *slot, int kv_type, float *scale, long D) {
    if (kv_type != I8) {
        for (long d = 0; d < D; d += LANES) store_lanes(slot, d, kv_type, load(x, d, type));
        return;
    }
    float most = 0;
    for (long d = 0; d < D; d++) most = fmaxf(most, fabsf(element(x, d, type)));
    *scale = most / 127.0f;
    const float divisor = most == 0 ? 1.0f : *scale;
    for (long d = 0; d < D; d++) ((int8_t *)slot)[d] = (int8_t)fmaxf(-127.0f, fminf(127.0f,
                                                                       rintf(element(x, d, type) / divisor)));
}

/* What every layer of one decoding step shares: the rows, their rotary angles, slots and mask. */
struct step {
    void *x;  /* (B, T, C), the residual stream, updated in place */
    int type;
    long B, T;
    const void *cos, *sin;  /* (B * T, D): the rotary angles of each row */
    const int64_t *slots;  /* row (b, t) goes to cache slot slots[b * slot_stride + t] */
    long slot_stride;
    const struct cache *cache;
    const uint8_t *mask;  /* (B, T, S): query t of row b sees slot s where nonzero; NULL: causal */
    const struct lowrank *lowrank;  /* each layer's, or NULL: no adapter rows */
    const int32_t *adapter;  /* (B,): row b's adapter in lowrank's stacks, or -1: the base's */
    int int8;  /* the products' inputs quantized to 8 bits (rows_times) */
};

/* Scratch for a layer's intermediate activations: queries, keys and values of the step's type; the products'
 * inputs (room for float32), read many times. */
struct scratch {
    char *q, *k, *v, *h, *att, *a;
    float *t;  /* the low-rank updates' t, (7, R, rmax) */
    long rmax;
    struct int8_rows xq;  /* with int8: each thread's copy of a product's input quantized, room for the largest */
    long widest;
};

/* One transformer block, inside a parallel region (every thread calls it):
 *     x += o(attention(rope(q(norm x)), the cache with rope(k(norm x)) and v(norm x) written in));
 *     x += down(silu(gate(h)) * up(h)), h = norm x
 * every step rounded as the torch model rounds it, into layer l of the cache; slots contiguous. p:
 * this thread's scores, MAX_GROUP * (padded(S) + D) floats, or NULL when it could not have them (its heads are
 * then skipped). */
static void layer(const struct block *w, const struct step *s, int l, const struct scratch *m, float *p) {
    const int type = s->type;
    const struct cache *c = s->cache;
    const long R = s->B * s->T, T = s->T, S = c->S, C = w->C, H = w->H, KVH = w->KVH, D = w->D, I = w->I;
    const long size = size_of(type), kv_size = size_of(c->type);

    /* The products' inputs: bf16 where the CPU multiplies bf16 weights by them as they are, else float32
     * holding values of the step's type, widened once. */
    const int in = as_pairs(type, w->w_type[0]) ? BF16 : F32;  /* bf16 models' matrices are all bf16 */
    /* Adapter rows' updates, of the linear layers from q_proj (0), o_proj (3), gate_proj (4), down_proj (6) on */
    const struct updates *d[7] = {NULL};
    struct updates all[7];
    for (int j = 0; s->lowrank && j < 7; j++)
        all[j] = (struct updates){s->lowrank + l, j, s->adapter, T, R, m->rmax, m->t + j * R * m->rmax},
        d[j] = all + j;
    const struct int8_rows mine = s->int8 ? int8_rows_from(&m->xq, omp_get_thread_num() * R, m->widest) : m->xq;
    const struct int8_rows *xq = s->int8 ? &mine : NULL;  /* room for this thread's copy of a product's input */
    rms_norm(s->x, w->attn_norm, m->h, in, type, R, C, w->eps);
    if (d[0]) lowrank_inputs(d[0], 3, m->h, in, type, C);
    products(m->h, in, type, 3, (const void *[]){w->q_proj, w->k_proj, w->v_proj}, w->w_type,
             (const float *[]){w->q_proj_scale, w->k_proj_scale, w->v_proj_scale}, (void *[]){m->q, m->k, m->v}, 0,
             R, (const long[]){H * D, KVH * D, KVH * D}, C, d[0], quantized(xq, m->h, in, R, C, w->w_type, 3), 1);

    /* RoPE on every query and key head; keys and values then go to their cache slots. */
#pragma omp for schedule(static)
    for (long i = 0; i < R * (H + KVH); i++) {
        long r = i / (H + KVH), head = i % (H + KVH);
        const char *cos = (const char *)s->cos + r * D * size, *sin = (const char *)s->sin + r * D * size;
        if (head < H) {
            char *query = m->q + (r * H + head) * D * size;
            rope_head(query, cos, sin, query, type, D);
            continue;
        }
        head -= H;
        char *key = m->k + (r * KVH + head) * D * size;
        rope_head(key, cos, sin, key, type, D);
        long b = r / T, slot = s->slots[b * s->slot_stride + r % T];
        long to = (b * c->stride_b + head * c->stride_h + slot * D) * kv_size;
        long scale = b * c->scale_stride_b + head * c->scale_stride_h + slot;
        to_cache(key, type, (char *)c->k[l] + to, c->type, c->type == I8 ? c->k_scale[l] + scale : NULL, D);
        to_cache(m->v + (r * KVH + head) * D * size, type, (char *)c->v[l] + to, c->type,
                 c->type == I8 ? c->v_scale[l] + scale : NULL, D);
    }

    /* Attention: heads share K/V in groups of H / KVH, attended n at a time (one read of K/V for n queries),
     * or one at a time when there are too few groups to keep every thread busy (batch 1). */
    const long G = H / KVH, n = R * KVH >= 2 * omp_get_num_threads() ? (G < MAX_GROUP ? G : MAX_GROUP) : 1;
    const long parts = (G + n - 1) / n;
#pragma omp for schedule(static)
    for (long i = 0; i < R * KVH * parts; i++) {
        if (!p) continue;
        long r = i / (KVH * parts), kv_head = i / parts % KVH, first = kv_head * G + i % parts * n;
        long count = first + n <= (kv_head + 1) * G ? n : (kv_head + 1) * G - first;
        long b = r / T, kv = (b * c->stride_b + kv_head * c->stride_h) * kv_size, at = (r * H + first) * D * size;
        long scale = b * c->scale_stride_b + kv_head * c->scale_stride_h;
        attend_any(m->q + at, (char *)c->k[l] + kv, (char *)c->v[l] + kv,
                   c->type == I8 ? c->k_scale[l] + scale : NULL, c->type == I8 ? c->v_scale[l] + scale : NULL,
                   m->att + at / size * size_of(in), in, type, c->type, S, D, count, S - T + r % T,
                   s->mask ? s->mask + r * S : NULL, p, p + MAX_GROUP * padded(S));
    }

    if (d[3]) lowrank_inputs(d[3], 1, m->att, in, type, H * D);
    products(m->att, in, type, 1, (const void *[]){w->o_proj}, w->w_type + 3, (const float *[]){w->o_proj_scale},
             (void *[]){s->x}, 1, R, (const long[]){C}, H * D, d[3],
             quantized(xq, m->att, in, R, H * D, w->w_type + 3, 1), 1);
    rms_norm(s->x, w->mlp_norm, m->h, in, type, R, C, w->eps);
    if (d[4]) lowrank_inputs(d[4], 2, m->h, in, type, C);
    const struct int8_rows *hq = quantized(xq, m->h, in, R, C, w->w_type + 4, 2);

    /* SwiGLU: gate and up streamed together, silu(gate) * up rounded where torch rounds. */
#pragma omp for schedule(static)
    for (long n = 0; n < I; n += LANES) {
        float g[R * LANES], u[R * LANES];
        rows_times(hq, m->h, in, w->gate_proj, w->w_type[4], R, n, C, g);
        rows_times(hq, m->h, in, w->up_proj, w->w_type[5], R, n, C, u);
        for (long r = 0; r < R; r++) {
            vf gv = load_f32(g + r * LANES), uv = load_f32(u + r * LANES);
            if (w->gate_proj_scale) gv *= load_f32(w->gate_proj_scale + n);
            if (w->up_proj_scale) uv *= load_f32(w->up_proj_scale + n);
            const int ga = adapter_of(d[4], 0, r), ua = adapter_of(d[4], 1, r);  /* as products() adds them */
            if (ga >= 0)
                gv = round_lanes(type, round_lanes(type, gv) + round_lanes(type, update(d[4], 0, ga, r, n, I)));
            if (ua >= 0)
                uv = round_lanes(type, round_lanes(type, uv) + round_lanes(type, update(d[4], 1, ua, r, n, I)));
            store_lanes(m->a, r * I + n, in, silu_times(type, round_lanes(type, gv), round_lanes(type, uv)));
        }
    }

    if (d[6]) lowrank_inputs(d[6], 1, m->a, in, type, I);
    products(m->a, in, type, 1, (const void *[]){w->down_proj}, w->w_type + 6, (const float *[]){w->down_proj_scale},
             (void *[]){s->x}, 1, R, (const long[]){C}, I, d[6], quantized(xq, m->a, in, R, I, w->w_type + 6, 1), 1);
}

/* `layers` transformer blocks w[0..layers-1] on B * T rows decoding against a KV cache, x (B, T, C) of
 * `type` updated in place; one parallel region for all of them, so the threads never go back to sleep
 * between layers. cache: every layer's keys and values (struct cache), of any cache type; the rest as struct
 * step; lowrank (each layer's, or NULL) and adapter (B,) the LoRA adapters' updates of the adapter rows; int8:
 * the products' inputs quantized to 8 bits (rows_times). D is a multiple of 16 up to MAX_HEAD_DIM, C and I
 * multiples of 16. Returns 0, or -1 out of memory. */
int blocks(const struct block *w, int layers, void *x, int type, long B, long T, const void *cos, const void *sin,
           const int64_t *slots, long slot_stride, const struct cache *cache, const uint8_t *mask,
           const struct lowrank *lowrank, const int32_t *adapter, int int8) {
    const struct step s = {x, type, B, T, cos, sin, slots, slot_stride, cache, mask, lowrank, adapter, int8};
    const long S = cache->S;
    const long R = B * T, size = size_of(type);
    long C = 0, QD = 0, KVD = 0, I = 0, D = 0;  /* the largest of any layer */
    for (int l = 0; l < layers; l++) {
        C = w[l].C > C ? w[l].C : C, I = w[l].I > I ? w[l].I : I, D = w[l].D > D ? w[l].D : D;
        QD = w[l].H * w[l].D > QD ? w[l].H * w[l].D : QD, KVD = w[l].KVH * w[l].D > KVD ? w[l].KVH * w[l].D : KVD;
    }
    long rmax = 0;  /* the largest rank */
    for (int l = 0; lowrank && l < layers; l++)
        for (int j = 0; j < 7; j++) rmax = lowrank[l].a[j] && lowrank[l].r[j] > rmax ? lowrank[l].r[j] : rmax;
    char *buffer = malloc(size * R * (QD + 2 * KVD) + sizeof(float) * R * (C + QD + I + 7 * rmax));
    if (!buffer) return -1;
    struct scratch m;
    m.h = buffer, m.att = m.h + sizeof(float) * R * C, m.a = m.att + sizeof(float) * R * QD;
    m.t = (float *)(m.a + sizeof(float) * R * I), m.rmax = rmax;
    m.q = (char *)(m.t + 7 * R * rmax), m.k = m.q + size * R * QD, m.v = m.k + size * R * KVD;
    const long widest = C > QD ? (C > I ? C : I) : (QD > I ? QD : I);  /* a product's most inputs */
    m.xq = int8 ? int8_rows_for(omp_get_max_threads() * R, widest) : (struct int8_rows){NULL}, m.widest = widest;
    if (int8 && !m.xq.q) return free(buffer), -1;
    int failed = 0;
#pragma omp parallel
    {
        float *p = malloc(sizeof(float) * MAX_GROUP * (padded(S) + D));
        if (!p) failed = 1;  /* any thread's failure is a failure: a benign race */
        for (int l = 0; l < layers; l++) layer(&w[l], &s, l, &m, p);
        free(p);
    }
    free(buffer), free(m.xq.q);
    return failed ? -1 : 0;
}

/* A prompt's causal self-attention: every query sees the keys up to its own position. torch's kernel scores a
 * prompt of up to 512 tokens against all of its keys, then masks half of them; here only the seen half is
 * computed. Scores are outer products: a query's element times KEYS vectors of keys' (K transposed once, to
 * (D, slots); in bf16 with AVX512-BF16, a pair of elements times 64 keys' pairs), so no dot product is summed across
 * lanes; softmax and the weighted sum of V in float32, as in attend(). */
#define Q_TILE 32  /* query rows (of one K/V head's group of heads) a thread takes at a time */
#define KEYS COLS  /* vectors of keys (of V's elements) a tile of 4 query rows takes at once: 4 * KEYS sums */

/* Element i of a head's row as one 32-bit word: a float32, or with bf16 pairs, elements i and i + 1. */
static inline float word_at(const void *p, long i, int type, int pairs) {
    if (!pairs) return element(p, i, type);
    float word;
    memcpy(&word, (const uint16_t *)p + i, sizeof word);
    return word;
}

/* p (4, P) from column s on: 4 query rows (4, W) against nv * LANES keys' columns of kt (W, P), times scale. W
 * words of D elements: floats, or with `pairs` bf16 pairs, each pair of products added by the CPU at once. */
static inline __attribute__((always_inline)) void score_tile(const float *qf, const float *kt, long P, long W,
                                                             long s, const int nv, float scale, float *p,
                                                             const int pairs) {
    vf acc[4][KEYS] = {{{0}}};
    for (long d = 0; d < W; d++) {
        vf key[KEYS];
        for (int c = 0; c < nv; c++) {
            key[c] = load_f32(kt + d * P + s + c * LANES);
            if (!pairs) IN_REGISTER(key[c]);  /* else GCC loads each key vector once per query row */
        }
        for (int r = 0; r < 4; r++) {
#if BF16_PAIRS
            if (pairs) {
                int32_t word;
                memcpy(&word, qf + r * W + d, sizeof word);
                __m512i query = _mm512_set1_epi32(word);
                IN_REGISTER(query);  /* Clang 16 crashed (VectorCombine) folding this broadcast into a bf16 vector */
                for (int c = 0; c < nv; c++)
                    acc[r][c] = (vf)_mm512_dpbf16_ps((__m512)acc[r][c], (__m512bh)query, (__m512bh)(__m512i)key[c]);
                continue;
            }
#endif
            vf query = splat(qf[r * W + d]);
            for (int c = 0; c < nv; c++) acc[r][c] = fmadd(query, key[c], acc[r][c]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < nv; c++) *(vfu *)(p + r * P + s + c * LANES) = acc[r][c] * scale;
}

/* out (B, T, H, D) = causal attention of q (B, T, H, D) over k, v (B, KVH, T, D) with element strides
 * k_stride / v_stride (row, head, slot; D contiguous), query t at slot t; heads share K/V in groups of
 * H / KVH. All of `type`; D a multiple of 64 up to MAX_HEAD_DIM. Returns 0, or -1 out of memory. */
int prompt_attention(const void *q, const void *k, const void *v, void *out, int type, long B, long T, long H,
                     long KVH, long D, const long *k_stride, const long *v_stride) {
    const long G = H / KVH, rows = T * G, tiles = (rows + Q_TILE - 1) / Q_TILE, P = padded(T), size = size_of(type);
    const float scale = 1.0f / sqrtf((float)D);
    const int pairs = as_pairs(type, type);  /* scores from bf16 pairs: W = D / 2 words a row */
    const long W = pairs ? D / 2 : D;
    float *kt = malloc(sizeof(float) * B * KVH * W * P);  /* each head's K transposed, (W, P): zeros past T */
    if (!kt) return -1;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (long i = 0; i < B * KVH * W; i++) {  /* row d of head (b, g)'s K transposed: whole lines written */
            long b = i / (KVH * W), g = i / W % KVH, d = i % W * (D / W);
            float *row = kt + i * P;
            for (long s = 0; s < P; s++)
                row[s] = s < T ? word_at(k, b * k_stride[0] + g * k_stride[1] + s * k_stride[2] + d, type, pairs) : 0;
        }
        float *qf = malloc(sizeof(float) * Q_TILE * W), *p = malloc(sizeof(float) * Q_TILE * P);
        if (!qf || !p) failed = 1;  /* a benign race, as in blocks() */
#pragma omp for schedule(dynamic)
        for (long i = 0; i < B * KVH * tiles; i++) {
            if (!qf || !p) continue;
            /* Rows r0.. of this group: row r is query t = r / G of head g * G + r % G. */
            long b = i / (KVH * tiles), g = i / tiles % KVH, r0 = i % tiles * Q_TILE;
            long n = rows - r0 < Q_TILE ? rows - r0 : Q_TILE, seen = padded((r0 + n - 1) / G + 1);
            const float *kt_head = kt + (b * KVH + g) * W * P;
            for (long r = 0; r < Q_TILE; r++)
                for (long d = 0; d < W; d++)
                    qf[r * W + d] = r < n ? word_at(q, ((b * T + (r0 + r) / G) * H + g * G + (r0 + r) % G) * D
                                                           + d * (D / W), type, pairs)
                                          : 0;
            float total[Q_TILE];
            long s = 0;  /* keys outer: their block of kt stays in L1 for all the rows */
            for (; s + KEYS * LANES <= seen; s += KEYS * LANES)
                for (long r = 0; r < Q_TILE; r += 4)
                    pairs ? score_tile(qf + r * W, kt_head, P, W, s, KEYS, scale, p + r * P, 1)
                          : score_tile(qf + r * W, kt_head, P, W, s, KEYS, scale, p + r * P, 0);
            for (; s < seen; s += LANES)
                for (long r = 0; r < Q_TILE; r += 4)
                    pairs ? score_tile(qf + r * W, kt_head, P, W, s, 1, scale, p + r * P, 1)
                          : score_tile(qf + r * W, kt_head, P, W, s, 1, scale, p + r * P, 0);
            const vf slot = iota();
            for (long r = 0; r < n; r++) {  /* softmax over the keys up to the query's position */
                const float t = (float)((r0 + r) / G);  /* exact: T is far below 2^24 */
                float *row = p + r * P;
                const vi minus_inf = (vi)splat(-INFINITY);
                vi most = minus_inf;
                for (long s = 0; s < seen; s += LANES) {
                    vi unseen = slot + (float)s > t;
                    vi score = ((vi)load_f32(row + s) & ~unseen) | (minus_inf & unseen);
                    *(vfu *)(row + s) = (vf)score;
                    vi bigger = (vf)score > (vf)most;
                    most = (score & bigger) | (most & ~bigger);
                }
                float top = ((vf)most)[0];
                for (int l = 1; l < LANES; l++) top = ((vf)most)[l] > top ? ((vf)most)[l] : top;
                vf sum = {0};
                for (long s = 0; s < seen; s += LANES) {
                    vf e = exp_lanes(load_f32(row + s) - top);
                    *(vfu *)(row + s) = e;
                    sum += e;
                }
                total[r] = sum_lanes(sum);
            }
            const char *v_head = (const char *)v + (b * v_stride[0] + g * v_stride[1]) * size;
            for (long r = 0; r < n; r += 4)  /* 4 rows' weighted sums of V, KEYS * LANES of D at a time */
                for (long d0 = 0; d0 < D; d0 += KEYS * LANES) {
                    vf acc[4][KEYS] = {{{0}}};
                    long last = (r0 + (r + 3 < n ? r + 3 : n - 1)) / G;
                    for (long s = 0; s <= last; s++) {
                        vf value[KEYS];
                        for (int c = 0; c < KEYS; c++) value[c] = load(v_head, s * v_stride[2] + d0 + c * LANES, type);
                        for (int j = 0; j < 4; j++) {
                            vf weight = splat(p[(r + j) * P + s]);
                            for (int c = 0; c < KEYS; c++) acc[j][c] = fmadd(weight, value[c], acc[j][c]);
                        }
                    }
                    for (int j = 0; j < 4 && r + j < n; j++) {
                        long row = r0 + r + j, at = ((b * T + row / G) * H + g * G + row % G) * D + d0;
                        for (int c = 0; c < KEYS; c++) store_lanes(out, at + c * LANES, type, acc[j][c] / total[r + j]);
                    }
                }
        }
        free(qf), free(p);
    }
    free(kt);
    return failed ? -1 : 0;
}

/* A prompt's elementwise steps, a vector at a time in one pass each, where torch makes several (each its own
 * pass over memory and its own thread wake-up). Rounded where torch rounds; n a multiple of 16. */

/* out = silu(gate) * up, as silu_times. */
void silu_mul(const void *gate, const void *up, void *out, int type, long n) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i += LANES)
        store_lanes(out, i, type, silu_times(type, load(gate, i, type), load(up, i, type)));
}

/* out (R, heads, D) = rope_head of each head, each row's (D,) angles shared by its heads. D a multiple of 32. */
void rope_rows(const void *x, const void *cos, const void *sin, void *out, int type, long R, long heads, long D) {
    const long size = size_of(type);
#pragma omp parallel for schedule(static)
    for (long i = 0; i < R * heads; i++)
        rope_head((const char *)x + i * D * size, (const char *)cos + i / heads * D * size,
                  (const char *)sin + i / heads * D * size, (char *)out + i * D * size, type, D);
}

/* out (R, C) = norm_row of each row of x (R, C). */
void norm_rows(const void *x, const void *weight, void *out, int type, long R, long C, float eps) {
#pragma omp parallel
    rms_norm(x, weight, out, type, type, R, C, eps);
}

/* out (N, K) = the float32 weights of w's blocks of w_type (GGUF's layouts), each the value the products use
 * (load_block), which is gguf.quants.dequantize's bit for bit: what torch code reads from a weight held as its
 * blocks (held.py), decoded a vector at a time, not in torch's several passes of a few operations each. An
 * embedding's rows looked up (a token's, a prompt's) one thread decodes alone: a parallel region waits for every
 * thread, and on a loaded machine one descheduled took a time slice (a 1-row lookup of the 1.7B's tied Q6_K_ACROSS
 * embedding 12 ms, against 12 us alone; 128 rows 23 ms, against 0.14 ms; 2 threads, load ~3). */
#define ALONE (1 << 20)  /* weights under which one thread decodes them alone (~2 ms): an embedding's rows looked up */
static inline __attribute__((always_inline)) void dequantize_as(const void *w, const int w_type, float *out, long N,
                                                                long K) {
    const long G = group_size(w_type);
    const int parts = G / BLOCK < 4 ? G / BLOCK : 4;
#pragma omp parallel for schedule(static) if (N * K >= ALONE)
    for (long n = 0; n < N; n++)
        for (long k = 0; k < K; k += G) {
            const uint8_t *group = (const uint8_t *)w + offset_of(n * K + k, w_type);
            struct scales s;
            unpack(group, w_type, &s);
            for (int base = 0; base < G / BLOCK; base += parts)
#pragma GCC unroll 4
                for (int part = 0; part < parts; part++) {  /* unrolled: constant shifts */
                    vf v[BLOCK / LANES];
                    load_block(group, base, part, w_type, &s, v);
                    for (int i = 0; i < BLOCK / LANES; i++)
                        *(vfu *)(out + n * K + k + (base + part) * BLOCK + i * LANES) = v[i];
                }
        }
}

int dequantize(const void *w, int w_type, float *out, long N, long K) {  /* 0, or -1: out of memory */
    switch (w_type) {  /* each type's code specialized, as the products' */
    case Q4_1: dequantize_as(w, Q4_1, out, N, K); return 0;
    case Q8_0: dequantize_as(w, Q8_0, out, N, K); return 0;
    case Q4_0: dequantize_as(w, Q4_0, out, N, K); return 0;
    case Q4_K: dequantize_as(w, Q4_K, out, N, K); return 0;
    case Q5_K: dequantize_as(w, Q5_K, out, N, K); return 0;
    case Q6_K: dequantize_as(w, Q6_K, out, N, K); return 0;
    case Q5_0: dequantize_as(w, Q5_0, out, N, K); return 0;
    case Q5_1: dequantize_as(w, Q5_1, out, N, K); return 0;
    }
#if LANE_BLOCKS || EIGHT_ROWS
    if (laid_out(w_type)) {  /* put back as the file's blocks first, a copy of them for the while */
        const long row = offset_of(K, w_type), rows = EIGHT_ROWS ? EIGHTS : 1;  /* restored at a time */
        uint8_t *blocks = malloc(N * row);
        if (!blocks) return -1;
#pragma omp parallel for schedule(static) if (N * K >= ALONE)
        for (long n = 0; n < N; n += rows)
            restore_rows((const uint8_t *)w + n * row, w_type, rows, K, blocks + n * row);
        dequantize(blocks, file_type(w_type), out, N, K);
        free(blocks);
    }
#endif
    return 0;
}
