/* kernels.c's exported functions against plain scalar references, for whichever instruction set this is built
 * for: each tier (SSE2, AVX2, AVX-512, NEON) compiles different code paths, and only running them shows that
 * they compute the same thing. Built with kernels.c as a second translation unit (so only what it exports is
 * seen) and run by test_kernel_tiers.py, natively or under qemu.
 *
 * References sum in double; the kernels in float32 and in other orders, so results are compared within
 * tolerances relative to the magnitude of what was summed. What the kernels promise bit for bit is compared
 * with memcmp: a product row's result whatever rows share the call, blocks (Q4_1, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K,
 * Q5_0, Q5_1) giving the results of the float32 weights they decode to (decoded here as gguf.quants.dequantize
 * rounds), and a decoding step's RMSNorm, RoPE and SiLU giving the prompt functions' results on the same rows.
 *
 * Prints one line per check, then a hash of every result's bits, then "N passed, M failed"; exits 1 on any
 * failure. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* As kernels.c (and the Python side) number and lay them out. */
enum { F32 = 0, BF16 = 1, I8 = 2, Q4_1 = 3, Q8_0 = 4, Q4_0 = 5, Q4_K = 6, Q5_K = 7, Q6_K = 8, Q5_0 = 9, Q5_1 = 10 };
enum { BLOCK = 32, SUPER = 256, TYPES = 11 };
/* by type: bytes a block of 32 (a K-quant's super-block of 256, as GGUF's files hold them); 0: not blocks */
static const long BLOCK_BYTES[] = {0, 0, 0, 20, 34, 18, 144, 176, 210, 22, 24};
static int is_super(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
static long block_size(int type) { return is_super(type) ? SUPER : BLOCK; }

void linear(const void *x, int type, int count, const void *const *w, int w_type, const float *const *scale,
            void *y, long B, const long *N, long K, int int8);
int prompt_attention(const void *q, const void *k, const void *v, void *out, int type, long B, long T, long H,
                     long KVH, long D, const long *k_stride, const long *v_stride);
void silu_mul(const void *gate, const void *up, void *out, int type, long n);
void rope_rows(const void *x, const void *cos, const void *sin, void *out, int type, long R, long heads, long D);
void norm_rows(const void *x, const void *weight, void *out, int type, long R, long C, float eps);
int repack_stripes(const void *w, long N, long K, void *out);
int repack_across(const void *w, int type, long N, long K, void *out);
int dequantize(const void *w, int w_type, float *out, long N, long K);
/* Q4_0 laid out again for kernels.c's int8 tile of blocks (repack_stripes), the K-quants for its tile of super-blocks
 * (repack_across), and with AVX2 the other block types too (repack_across), where they are built */
enum { Q4_0_STRIPES = 11, Q4_K_ACROSS = 12, Q5_K_ACROSS = 13, Q6_K_ACROSS = 14, Q8_0_EIGHTS = 15, Q4_1_EIGHTS = 16,
       Q5_0_EIGHTS = 17, Q5_1_EIGHTS = 18 };

struct block {  /* kernels.c's struct block, field for field */
    const void *attn_norm, *mlp_norm;
    const void *q_proj, *k_proj, *v_proj, *o_proj, *gate_proj, *up_proj, *down_proj;
    const float *q_proj_scale, *k_proj_scale, *v_proj_scale, *o_proj_scale, *gate_proj_scale, *up_proj_scale,
        *down_proj_scale;
    int w_type[7];
    long C, H, KVH, D, I;
    float eps;
};
struct cache {  /* kernels.c's struct cache, field for field */
    void *const *k, *const *v;
    float *const *k_scale, *const *v_scale;
    int type;
    long S, stride_b, stride_h, scale_stride_b, scale_stride_h;
};
int blocks(const struct block *w, int layers, void *x, int type, long B, long T, const void *cos, const void *sin,
           const int64_t *slots, long slot_stride, const struct cache *cache, const uint8_t *mask,
           const void *lowrank, const int32_t *adapter, int int8);

static const char *type_name[] = {"f32", "bf16", "i8", "q4_1", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q5_0",
                                  "q5_1"};
static int passed, failed;

/* ---- inputs: a fixed-seed generator, bf16 conversions ---- */

static uint64_t seed = 0x9e3779b97f4a7c15u;
static uint64_t next_random(void) {  /* splitmix64: the same numbers on every machine */
    uint64_t z = (seed += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_random() >> 40) * 0x1p-24f; }

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t to_bf16(float f) {  /* round to nearest even (no NaNs here) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static float round_bf16(float f) { return from_bf16(to_bf16(f)); }
static float rounded(int type, float f) { return type == BF16 ? round_bf16(f) : f; }

/* n random values in [lo, hi), rounded to what `type` holds: the references compute from exactly the values the
 * kernel reads. */
static float *random_values(long n, int type, float lo, float hi) {
    float *v = malloc(sizeof(float) * n);
    for (long i = 0; i < n; i++) v[i] = rounded(type, uniform(lo, hi));
    return v;
}

/* values as the kernel reads them: float32, or bf16 */
static void *as_type(const float *v, long n, int type) {
    if (type == F32) {
        float *out = malloc(sizeof(float) * n);
        memcpy(out, v, sizeof(float) * n);
        return out;
    }
    uint16_t *out = malloc(sizeof(uint16_t) * n);
    for (long i = 0; i < n; i++) out[i] = to_bf16(v[i]);
    return out;
}

static float read_value(const void *p, long i, int type) {
    return type == BF16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---- verdicts ---- */

/* got (of `type`) against ref within rel * scale[i] (the magnitude of what was summed for element i, or |ref|);
 * bf16 results also within 2^-6 |ref|: a final rounding (half an ulp) plus one more where the reference's
 * intermediate rounding lands on the other side of a tie (the kernel's float32 value being a little off). */
/* Every result compared, byte for byte, into one FNV-1a hash: builds of one tier (any -mtune, -O level or
 * compiler) must print the same, which test_kernel_tiers.py checks. */
static uint64_t bits = 0xcbf29ce484222325u;

static void add_bytes(const void *p, long n) {
    const unsigned char *byte = p;
    for (long i = 0; i < n; i++) bits = (bits ^ byte[i]) * 0x100000001b3u;
}

static void add_bits(const void *p, long n, int type) { add_bytes(p, n * (type == I8 ? 1 : type == BF16 ? 2 : 4)); }

static int same_bytes(const void *got, const void *want, long n) {  /* !memcmp, both sides hashed */
    add_bytes(got, n), add_bytes(want, n);
    return !memcmp(got, want, n);
}

static void compare(const char *name, const void *got, int type, const double *ref, const double *scale, long n,
                    double rel) {
    add_bits(got, n, type);
    double worst = 0;
    long bad = -1;
    for (long i = 0; i < n; i++) {
        double g = read_value(got, i, type), tol = rel * scale[i] + (type == BF16 ? 0x1p-6 * fabs(ref[i]) : 0);
        double ratio = fabs(g - ref[i]) / (tol > 0 ? tol : 1e-30);
        if (!(ratio <= 1)) {  /* NaN too */
            if (bad < 0) bad = i;
            ratio = isnan(ratio) ? INFINITY : ratio;
        }
        if (ratio > worst) worst = ratio;
    }
    if (bad < 0) {
        printf("ok   %s (largest error %.2g of the tolerance)\n", name, worst);
        passed++;
    } else {
        double tol = rel * scale[bad] + (type == BF16 ? 0x1p-6 * fabs(ref[bad]) : 0);
        printf("FAIL %s: element %ld is %.9g, expected %.9g (tolerance %.3g; worst error %.3g of it)\n", name, bad,
               read_value(got, bad, type), ref[bad], tol, worst);
        failed++;
    }
}

/* ---- linear ---- */

/* A weight matrix (N, K) of w_type as the kernel streams it, and the float32 values it stands for (decoded
 * blocks, or int8 integers before their per-channel scale). */
struct weights {
    void *data;
    float *values;
    float *scale;  /* I8's per output channel, else NULL */
};

/* sign (1024 + mantissa) 2^exponent, a normal float16's value (exponent -24 to 5), as its float16 bits at `at`;
 * returns the value. */
static float put_half(uint8_t *at, float sign, int mantissa, int exponent) {
    const uint16_t h = (uint16_t)((sign < 0 ? 0x8000 : 0) | (exponent + 25) << 10 | mantissa);
    memcpy(at, &h, 2);
    return sign * ldexpf((float)(1024 + mantissa), exponent);
}

static struct weights random_weights(int w_type, long N, long K) {
    struct weights w = {NULL, malloc(sizeof(float) * N * K), NULL};
    if (w_type == F32 || w_type == BF16) {
        float *v = random_values(N * K, w_type, -1, 1);
        memcpy(w.values, v, sizeof(float) * N * K);
        w.data = as_type(v, N * K, w_type);
        free(v);
    } else if (w_type == I8) {
        int8_t *q = malloc(N * K);
        w.scale = malloc(sizeof(float) * N);
        for (long i = 0; i < N * K; i++) w.values[i] = q[i] = (int8_t)(next_random() % 255 - 127);
        for (long n = 0; n < N; n++) w.scale[n] = uniform(0.005f, 0.01f);
        w.data = q;
    } else if (is_super(w_type)) {
        /* GGUF's super-blocks as they are: random bytes (all valid), then float16 d (and dmin) set to finite
         * values of either sign (dmin of one); decoded as gguf.quants.dequantize does in float32, operation by
         * operation: Q4_K, Q5_K (d * sc) * q - dmin * m, sc and m 6-bit; Q6_K (d * sc) * (q - 32), sc int8. */
        const long bytes = BLOCK_BYTES[w_type];
        uint8_t *blocks = malloc(N * K / SUPER * bytes);
        for (long b = 0; b < N * K / SUPER; b++) {
            uint8_t *block = blocks + b * bytes;
            float *values = w.values + b * SUPER;
            for (long i = 0; i < bytes; i++) block[i] = (uint8_t)next_random();
            const uint16_t sign = next_random() % 2 ? 0x8000 : 0, mantissa = (uint16_t)(next_random() % 1024);
            const uint16_t least = (uint16_t)(next_random() % 1024);
            if (w_type == Q6_K) {  /* d = (1024 + mantissa) 2^-21: float16 exponent field 4 */
                const uint16_t h = sign | 4 << 10 | mantissa;
                memcpy(block + 208, &h, 2);
                const float d = (sign ? -1.0f : 1.0f) * ldexpf((float)(1024 + mantissa), -21);
                for (int t = 0; t < SUPER; t++) {
                    const int half = t / 128, within = t % 128;
                    const int low = block[half * 64 + within % 64] >> (within / 64 * 4) & 15;
                    const int high = block[128 + half * 32 + within % 32] >> (within / 32 * 2) & 3;
                    const float scaled = d * (float)(int8_t)block[192 + t / 16];
                    values[t] = scaled * (float)((low | high << 4) - 32);
                }
                continue;
            }
            /* d = (1024 + mantissa) 2^-20, dmin = (1024 + least) 2^-19: exponent fields 5 and 6 */
            const uint16_t hd = sign | 5 << 10 | mantissa, hmin = 6 << 10 | least;
            memcpy(block, &hd, 2), memcpy(block + 2, &hmin, 2);
            const float d = (sign ? -1.0f : 1.0f) * ldexpf((float)(1024 + mantissa), -20);
            const float dmin = ldexpf((float)(1024 + least), -19);
            const uint8_t *sc = block + 4, *nibbles = block + (w_type == Q4_K ? 16 : 48);
            for (int j = 0; j < SUPER / BLOCK; j++) {
                const int scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4;
                const int min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | (sc[j] >> 6) << 4;
                const float scaled = d * (float)scale, offset = dmin * (float)min;
                for (int l = 0; l < BLOCK; l++) {
                    int q = nibbles[j / 2 * 32 + l] >> (j % 2 * 4) & 15;
                    if (w_type == Q5_K) q |= (block[16 + l] >> j & 1) << 4;
                    float product = scaled * (float)q;  /* numpy's d * q, then - dm: two roundings */
                    values[j * BLOCK + l] = product - offset;
                }
            }
        }
        w.data = blocks;
    } else {
        /* GGUF's blocks of 32 as the file holds them: float16 scale d (Q4_1, Q5_1: and min m), Q5_0's and Q5_1's
         * word of fifth bits, then the q; d and m of either sign. Each value is decoded as gguf.quants.dequantize
         * does in float32: Q4_1, Q5_1 d * q + m; Q8_0 d * q; Q4_0 d * (q - 8); Q5_0 d * (q - 16). */
        const long bytes = BLOCK_BYTES[w_type];
        uint8_t *blocks = calloc(N * K / BLOCK, bytes);
        for (long b = 0; b < N * K / BLOCK; b++) {
            uint8_t *block = blocks + b * bytes;
            float *values = w.values + b * BLOCK;
            const float sign = next_random() % 2 ? 1.0f : -1.0f;
            if (w_type == Q8_0) {
                const float d = put_half(block, 1.0f, (int)(next_random() % 1024), -17);
                for (int j = 0; j < BLOCK; j++) {
                    int8_t q = (int8_t)(next_random() % 256 - 128);
                    block[2 + j] = (uint8_t)q;
                    values[j] = d * (float)q;
                }
                continue;
            }
            int q[BLOCK];
            const int levels = w_type == Q5_0 || w_type == Q5_1 ? 32 : 16;
            for (int j = 0; j < BLOCK; j++) q[j] = (int)(next_random() % levels);
            uint8_t *nibbles = block + (w_type == Q4_0 ? 2 : w_type == Q4_1 ? 4 : w_type == Q5_0 ? 6 : 8);
            uint32_t fifth = 0;
            for (int j = 0; j < BLOCK / 2; j++)  /* byte j: weight j in its low half, j + 16 in its high */
                nibbles[j] = (uint8_t)((q[j] & 15) | (q[j + BLOCK / 2] & 15) << 4);
            for (int j = 0; j < BLOCK; j++) fifth |= (uint32_t)(q[j] >> 4 & 1) << j;  /* bit j: weight j's fifth */
            if (w_type == Q4_1) {
                const float d = put_half(block, 1.0f, (int)(next_random() % 1024), -16);
                const float m = put_half(block + 2, -1.0f, (int)(next_random() % 1024), -13);
                for (int j = 0; j < BLOCK; j++) values[j] = d * (float)q[j] + m;
            } else if (w_type == Q4_0) {
                const float d = put_half(block, sign, (int)(next_random() % 1024), -16);
                for (int j = 0; j < BLOCK; j++) values[j] = d * (float)(q[j] - 8);
            } else if (w_type == Q5_0) {
                const float d = put_half(block, sign, (int)(next_random() % 1024), -17);
                memcpy(block + 2, &fifth, 4);
                for (int j = 0; j < BLOCK; j++) values[j] = d * (float)(q[j] - 16);
            } else if (w_type == Q5_1) {
                const float d = put_half(block, 1.0f, (int)(next_random() % 1024), -17);
                const float m = put_half(block + 2, sign, (int)(next_random() % 1024), -13);
                memcpy(block + 4, &fifth, 4);
                for (int j = 0; j < BLOCK; j++) values[j] = d * (float)q[j] + m;
            }
        }
        w.data = blocks;
    }
    return w;
}

enum { COUNT = 2, MAX_B = 70 };
static const long N_OF[COUNT] = {48, 16};  /* two matrices of one input, as q and k stream together */

/* y (COUNT blocks of (B, N[m]), one after another) = rows first..first+B-1 of x against the weights */
static void *call_linear(const void *x, int x_type, long first, long B, long K, const struct weights *w,
                         int w_type) {
    const void *data[COUNT];
    const float *scale[COUNT];
    long total = 0;
    for (int m = 0; m < COUNT; m++) data[m] = w[m].data, scale[m] = w[m].scale, total += N_OF[m];
    void *y = malloc(4 * B * total);
    linear((const char *)x + first * K * (x_type == BF16 ? 2 : 4), x_type, COUNT, data, w_type, scale, y, B, N_OF,
           K, 0);
    return y;
}

/* Matrix m's output for row r, of a call on B rows: where it is in y. */
static long at(long B, int m, long r, long n) {
    long before = 0;
    for (int i = 0; i < m; i++) before += N_OF[i];
    return B * before + r * N_OF[m] + n;
}

static void check_linear(int x_type, int w_type, long K) {
    char name[160];
    const long B = MAX_B, total = N_OF[0] + N_OF[1];
    float *xv = random_values(B * K, x_type, -1, 1);
    void *x = as_type(xv, B * K, x_type);
    struct weights w[COUNT];
    for (int m = 0; m < COUNT; m++) w[m] = random_weights(w_type, N_OF[m], K);
    const char *label = type_name[x_type], *w_label = type_name[w_type];

    /* the values against double sums */
    void *y = call_linear(x, x_type, 0, B, K, w, w_type);
    double *ref = malloc(sizeof(double) * B * total), *scale = malloc(sizeof(double) * B * total);
    for (int m = 0; m < COUNT; m++)
        for (long r = 0; r < B; r++)
            for (long n = 0; n < N_OF[m]; n++) {
                double sum = 0, size = 0, s = w[m].scale ? w[m].scale[n] : 1;
                for (long k = 0; k < K; k++) {
                    double term = (double)xv[r * K + k] * w[m].values[n * K + k];
                    sum += term, size += fabs(term);
                }
                ref[at(B, m, r, n)] = sum * s, scale[at(B, m, r, n)] = size * s;
            }
    snprintf(name, sizeof name, "linear x=%s w=%s K=%ld rows=%ld: values", label, w_label, K, B);
    compare(name, y, x_type, ref, scale, B * total, 1e-5);

    /* each row's bits the same alone as among 3, 6, 9 (a first tile of 4 rows, then 2 or 4 + 1 from its widened
     * weights), among 16 (two sets), among 70 (rows 64.. in a second block) */
    void *alone[MAX_B];
    for (long r = 0; r < B; r++) alone[r] = call_linear(x, x_type, r, 1, K, w, w_type);
    const long calls[][2] = {{0, 3}, {0, 6}, {0, 9}, {0, 16}, {54, 16}, {0, B}};  /* first row, rows */
    int same = 1;
    for (int c = 0; c < 6 && same; c++) {
        void *got = call_linear(x, x_type, calls[c][0], calls[c][1], K, w, w_type);
        for (long r = 0; r < calls[c][1] && same; r++)
            for (int m = 0; m < COUNT && same; m++) {
                long size = x_type == BF16 ? 2 : 4;
                const char *row = (const char *)got + at(calls[c][1], m, r, 0) * size;
                const char *one = (const char *)alone[calls[c][0] + r] + at(1, m, 0, 0) * size;
                if (!same_bytes(row, one, N_OF[m] * size)) {
                    printf("FAIL linear x=%s w=%s K=%ld: row %ld of a %ld-row call (from row %ld) differs from "
                           "its result alone\n", label, w_label, K, r, calls[c][1], calls[c][0]);
                    failed++, same = 0;
                }
            }
        free(got);
    }
    if (same) {
        printf("ok   linear x=%s w=%s K=%ld: each row's bits alone = among 3, 6, 9, 16, 70 rows\n", label, w_label, K);
        passed++;
    }

    /* blocks stream the float32 weights they decode to: the same bits, at every row count */
    if (BLOCK_BYTES[w_type]) {
        struct weights decoded[COUNT];
        for (int m = 0; m < COUNT; m++) decoded[m] = (struct weights){w[m].values, w[m].values, NULL};
        int equal = 1;
        for (long rows = 1; rows <= B && equal; rows = rows == 1 ? 3 : rows == 3 ? 16 : rows == 16 ? B : B + 1) {
            void *want = call_linear(x, x_type, 0, rows, K, decoded, F32);
            void *got = call_linear(x, x_type, 0, rows, K, w, w_type);
            if (!same_bytes(got, want, rows * total * (x_type == BF16 ? 2 : 4))) {
                printf("FAIL linear x=%s w=%s K=%ld rows=%ld: differs from its decoded float32 weights'\n", label,
                       w_label, K, rows);
                failed++, equal = 0;
            }
            free(want), free(got);
        }
        if (equal) {
            printf("ok   linear x=%s w=%s K=%ld: the bits of its decoded float32 weights at 1, 3, 16, 70 rows\n",
                   label, w_label, K);
            passed++;
        }
    }
    for (long r = 0; r < B; r++) free(alone[r]);
    for (int m = 0; m < COUNT; m++) free(w[m].data), free(w[m].values), free(w[m].scale);
    free(xv), free(x), free(y), free(ref), free(scale);
}

/* ---- prompt_attention ---- */

/* k and v are read through strides, as a cache's first T of S slots: (B, KVH, S, D), v with more slots than k */
static void check_attention(int type, long B, long T, long H, long KVH, long D) {
    const long G = H / KVH, SK = T + 3, SV = T + 7;
    const long k_stride[3] = {KVH * SK * D, SK * D, D}, v_stride[3] = {KVH * SV * D, SV * D, D};
    float *qv = random_values(B * T * H * D, type, -1, 1), *kv = random_values(B * KVH * SK * D, type, -1, 1),
          *vv = random_values(B * KVH * SV * D, type, -1, 1);
    void *q = as_type(qv, B * T * H * D, type), *k = as_type(kv, B * KVH * SK * D, type),
         *v = as_type(vv, B * KVH * SV * D, type), *out = malloc(4 * B * T * H * D);
    char name[160];
    snprintf(name, sizeof name, "prompt_attention %s B=%ld T=%ld H=%ld KVH=%ld D=%ld", type_name[type], B, T, H,
             KVH, D);
    if (prompt_attention(q, k, v, out, type, B, T, H, KVH, D, k_stride, v_stride)) {
        printf("FAIL %s: returned out of memory\n", name);
        failed++;
        return;
    }
    double *ref = malloc(sizeof(double) * B * T * H * D), *scale = malloc(sizeof(double) * B * T * H * D),
           *p = malloc(sizeof(double) * T);
    for (long b = 0; b < B; b++)
        for (long t = 0; t < T; t++)
            for (long h = 0; h < H; h++) {  /* query t sees keys 0..t of its group's K/V head */
                const float *query = qv + ((b * T + t) * H + h) * D;
                const float *keys = kv + b * k_stride[0] + h / G * k_stride[1];
                const float *values = vv + b * v_stride[0] + h / G * v_stride[1];
                double top = -INFINITY, total = 0;
                for (long s = 0; s <= t; s++) {
                    double dot = 0;
                    for (long d = 0; d < D; d++) dot += (double)query[d] * keys[s * k_stride[2] + d];
                    p[s] = dot / sqrt((double)D);
                    top = p[s] > top ? p[s] : top;
                }
                for (long s = 0; s <= t; s++) total += p[s] = exp(p[s] - top);
                for (long d = 0; d < D; d++) {
                    double sum = 0, size = 0;
                    for (long s = 0; s <= t; s++) {
                        double value = values[s * v_stride[2] + d];
                        sum += p[s] * value, size += p[s] * fabs(value);
                    }
                    const long e = ((b * T + t) * H + h) * D + d;
                    ref[e] = sum / total, scale[e] = size / total;
                }
            }
    compare(name, out, type, ref, scale, B * T * H * D, 1e-5);
    free(qv), free(kv), free(vv), free(q), free(k), free(v), free(out), free(ref), free(scale), free(p);
}

/* ---- the elementwise steps ---- */

static void check_silu_mul(int type, long n) {
    float *gv = random_values(n, type, -6, 6), *uv = random_values(n, type, -2, 2);
    void *gate = as_type(gv, n, type), *up = as_type(uv, n, type), *out = malloc(4 * n);
    silu_mul(gate, up, out, type, n);
    double *ref = malloc(sizeof(double) * n), *scale = malloc(sizeof(double) * n);
    for (long i = 0; i < n; i++) {  /* silu rounded to the type, then the product */
        double silu = gv[i] / (1 + exp(-(double)gv[i]));
        ref[i] = (type == BF16 ? round_bf16((float)silu) : silu) * uv[i];
        scale[i] = fabs(ref[i]);
    }
    char name[160];
    snprintf(name, sizeof name, "silu_mul %s n=%ld", type_name[type], n);
    compare(name, out, type, ref, scale, n, 1e-5);
    free(gv), free(uv), free(gate), free(up), free(out), free(ref), free(scale);
}

static void check_rope_rows(int type, long R, long heads, long D) {
    const long half = D / 2;
    float *xv = random_values(R * heads * D, type, -2, 2), *cv = random_values(R * D, type, -1, 1),
          *sv = random_values(R * D, type, -1, 1);
    void *x = as_type(xv, R * heads * D, type), *cos = as_type(cv, R * D, type), *sin = as_type(sv, R * D, type),
         *out = malloc(4 * R * heads * D);
    rope_rows(x, cos, sin, out, type, R, heads, D);
    double *ref = malloc(sizeof(double) * R * heads * D), *scale = malloc(sizeof(double) * R * heads * D);
    for (long r = 0; r < R; r++)
        for (long h = 0; h < heads; h++)
            for (long i = 0; i < half; i++) {  /* each product rounded to the type, then their sum */
                const long e = (r * heads + h) * D + i, a = r * D + i;
                float x1 = xv[e], x2 = xv[e + half];
                ref[e] = (double)rounded(type, x1 * cv[a]) + rounded(type, -x2 * sv[a]);
                ref[e + half] = (double)rounded(type, x2 * cv[a + half]) + rounded(type, x1 * sv[a + half]);
                scale[e] = fabs(x1 * cv[a]) + fabs(x2 * sv[a]);
                scale[e + half] = fabs(x2 * cv[a + half]) + fabs(x1 * sv[a + half]);
            }
    char name[160];
    snprintf(name, sizeof name, "rope_rows %s R=%ld heads=%ld D=%ld", type_name[type], R, heads, D);
    compare(name, out, type, ref, scale, R * heads * D, 1e-5);
    free(xv), free(cv), free(sv), free(x), free(cos), free(sin), free(out), free(ref), free(scale);
}

static void check_norm_rows(int type, long R, long C) {
    const float eps = 1e-5f;
    float *xv = random_values(R * C, type, -3, 3), *wv = random_values(C, type, 0.5f, 1.5f);
    void *x = as_type(xv, R * C, type), *weight = as_type(wv, C, type), *out = malloc(4 * R * C);
    norm_rows(x, weight, out, type, R, C, eps);
    double *ref = malloc(sizeof(double) * R * C), *scale = malloc(sizeof(double) * R * C);
    for (long r = 0; r < R; r++) {
        double squares = 0;
        for (long c = 0; c < C; c++) squares += (double)xv[r * C + c] * xv[r * C + c];
        double inv = 1 / sqrt(squares / C + eps);
        for (long c = 0; c < C; c++) {  /* x / rms rounded to the type, then times the weight */
            double normed = xv[r * C + c] * inv;
            ref[r * C + c] = wv[c] * (type == BF16 ? round_bf16((float)normed) : normed);
            scale[r * C + c] = fabs(ref[r * C + c]);
        }
    }
    char name[160];
    snprintf(name, sizeof name, "norm_rows %s R=%ld C=%ld", type_name[type], R, C);
    compare(name, out, type, ref, scale, R * C, 1e-5);
    free(xv), free(wv), free(x), free(weight), free(out), free(ref), free(scale);
}

/* ---- blocks: one float32 layer decoding T rows of each of B sequences against a cache ---- */

enum { BH = 4, BKVH = 2, PAST = 5 };  /* heads (and a head size D); slots filled before the step */
static long BC = 64, BI = 96;  /* hidden and MLP sizes: whole K-quant super-blocks for the K-quants' layers */

static void rms_normed(const double *x, const float *weight, double *out) {
    double squares = 0;
    for (long c = 0; c < BC; c++) squares += x[c] * x[c];
    double inv = 1 / sqrt(squares / BC + 1e-5);
    for (long c = 0; c < BC; c++) out[c] = weight[c] * x[c] * inv;
}

static void matvec(const float *w, const float *scale, const double *x, long N, long K, double *y) {
    for (long n = 0; n < N; n++) {
        double sum = 0;
        for (long k = 0; k < K; k++) sum += (double)w[n * K + k] * x[k];
        y[n] = sum * (scale ? scale[n] : 1);
    }
}

static void rotated(double *x, const float *c, const float *s, long D) {  /* one head, in place */
    for (long i = 0; i < D / 2; i++) {
        double x1 = x[i], x2 = x[i + D / 2];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + D / 2] = x2 * c[i + D / 2] + x1 * s[i + D / 2];
    }
}


struct layer_run {  /* what blocks() left, of the step's type: x, and each sequence's K/V cache (B, KVH, S, D) */
    char *x, *k, *v;
};

/* blocks() on B sequences of T new rows each, from sequence `first` on of x (rows, C), cos / sin (rows, D) and
 * the caches, all of `type`; new rows go to slots PAST.., and see the slots up to theirs (no mask). */
static struct layer_run run_blocks(const struct block *layer, int type, long first, long B, long T, const void *x,
                                   const void *cosines, const void *sines, const void *k, const void *v) {
    const long D = layer->D, S = PAST + T, cache = BKVH * S * D, size = type == BF16 ? 2 : 4;
    struct layer_run run = {malloc(size * B * T * BC), malloc(size * B * cache), malloc(size * B * cache)};
    memcpy(run.x, (const char *)x + first * T * BC * size, size * B * T * BC);
    memcpy(run.k, (const char *)k + first * cache * size, size * B * cache);
    memcpy(run.v, (const char *)v + first * cache * size, size * B * cache);
    int64_t *slots = malloc(sizeof(int64_t) * B * T);
    for (long i = 0; i < B * T; i++) slots[i] = PAST + i % T;
    void *k_caches[1] = {run.k}, *v_caches[1] = {run.v};
    const struct cache layers = {k_caches, v_caches, NULL, NULL, type, S, cache, S * D, 0, 0};
    if (blocks(layer, 1, run.x, type, B, T, (const char *)cosines + first * T * D * size,
               (const char *)sines + first * T * D * size, slots, T, &layers, NULL, NULL, NULL, 0))
        free(run.x), run.x = NULL;  /* out of memory: reported by the caller */
    free(slots);
    return run;
}

static double largest(const double *v, long n) {
    double top = 0;
    for (long i = 0; i < n; i++) top = fabs(v[i]) > top ? fabs(v[i]) : top;
    return top;
}

/* Bytes of an (N, K) weight matrix of w_type. */
static long weight_bytes(int w_type, long N, long K) {
    if (BLOCK_BYTES[w_type]) return N * K / block_size(w_type) * BLOCK_BYTES[w_type];
    return N * K * (w_type == I8 ? 1 : w_type == BF16 ? 2 : 4);
}

/* The decoding step and a prompt's functions share their RMSNorm, RoPE and SiLU: the keys and values blocks()
 * cached must be the bits of norm_rows, linear and rope_rows on the same rows. With o_proj zero, attention adds
 * nothing, so the MLP's input is x itself: then x must also be the bits of norm_rows, linear, silu_mul, linear
 * and torch's x + y rounded to the type. D a multiple of 32 (rope_rows'). */
static void check_prompt_path(const char *name, const struct block *layer, int type, long B, long T, const void *x,
                              const void *cos, const void *sin, struct layer_run run, int zero_o) {
    const long R = B * T, D = layer->D, S = PAST + T, KVD = BKVH * D, size = type == BF16 ? 2 : 4;
    const long kv_sizes[1] = {KVD}, mlp_sizes[1] = {BI}, out_sizes[1] = {BC};
    void *h = malloc(size * R * BC), *k = malloc(size * R * KVD), *v = malloc(size * R * KVD),
         *roped = malloc(size * R * KVD), *gate = malloc(size * R * BI), *up = malloc(size * R * BI),
         *a = malloc(size * R * BI), *down = malloc(size * R * BC);
    norm_rows(x, layer->attn_norm, h, type, R, BC, layer->eps);
    linear(h, type, 1, &layer->k_proj, layer->w_type[1], &layer->k_proj_scale, k, R, kv_sizes, BC, 0);
    linear(h, type, 1, &layer->v_proj, layer->w_type[2], &layer->v_proj_scale, v, R, kv_sizes, BC, 0);
    rope_rows(k, cos, sin, roped, type, R, BKVH, D);
    int same = 1;
    for (long r = 0; r < R && same; r++)
        for (long head = 0; head < BKVH && same; head++) {
            const long slot = ((r / T * BKVH + head) * S + PAST + r % T) * D * size;
            const long row = (r * BKVH + head) * D * size;
            same = same_bytes(run.k + slot, (char *)roped + row, D * size) &&
                   same_bytes(run.v + slot, (char *)v + row, D * size);
        }
    if (same && zero_o) {
        norm_rows(x, layer->mlp_norm, h, type, R, BC, layer->eps);
        linear(h, type, 1, &layer->gate_proj, layer->w_type[4], &layer->gate_proj_scale, gate, R, mlp_sizes, BC, 0);
        linear(h, type, 1, &layer->up_proj, layer->w_type[5], &layer->up_proj_scale, up, R, mlp_sizes, BC, 0);
        silu_mul(gate, up, a, type, R * BI);
        linear(a, type, 1, &layer->down_proj, layer->w_type[6], &layer->down_proj_scale, down, R, out_sizes, BI, 0);
        for (long i = 0; i < R * BC && same; i++)
            same = rounded(type, read_value(x, i, type) + read_value(down, i, type)) == read_value(run.x, i, type);
    }
    if (same) printf("ok   %s: the prompt functions' bits (%s)\n", name, zero_o ? "K, V cache, x" : "K, V cache");
    else printf("FAIL %s: differs from the prompt functions on the same rows\n", name);
    same ? passed++ : failed++;
    free(h), free(k), free(v), free(roped), free(gate), free(up), free(a), free(down);
}

/* One layer (of activations `type`, weights w_type but v_proj and down_proj of vd_type, as a Q4_K_M file mixes
 * them; head size D; with zero_o, o_proj zero) against a double reference; then each sequence decoded alone, which
 * must give the same bits as among B; then against the prompt functions. */
static void check_layer(int type, int w_type, int vd_type, long B, long T, long D, int zero_o) {
    const long R = B * T, S = PAST + T, QD = BH * D, KVD = BKVH * D, cache = BKVH * S * D;
    const long size = type == BF16 ? 2 : 4;
    const long sizes[7][2] = {{QD, BC}, {KVD, BC}, {KVD, BC}, {BC, QD}, {BI, BC}, {BI, BC}, {BC, BI}};
    struct weights w[7];
    for (int i = 0; i < 7; i++) {
        w[i] = random_weights(i == 2 || i == 6 ? vd_type : w_type, sizes[i][0], sizes[i][1]);
        if (w_type == F32 || w_type == BF16) {  /* about the size of the integer types' weights times their scales */
            for (long e = 0; e < sizes[i][0] * sizes[i][1]; e++) w[i].values[e] *= 0.125f;  /* exact */
            free(w[i].data);
            w[i].data = as_type(w[i].values, sizes[i][0] * sizes[i][1], w_type);
        }
    }
    if (zero_o) {  /* every encoding's zero bytes are weights of zero (Q4_0's, Q5_0's, Q6_K's -0: sums from +0 stay
                    * +0) */
        memset(w[3].data, 0, weight_bytes(w_type, BC, QD));
        memset(w[3].values, 0, sizeof(float) * BC * QD);
    }
    float *attn_norm = random_values(BC, type, 0.5f, 1.5f), *mlp_norm = random_values(BC, type, 0.5f, 1.5f);
    float *x = random_values(R * BC, type, -1, 1), *cosines = malloc(sizeof(float) * R * D),
          *sines = malloc(sizeof(float) * R * D);
    for (long r = 0; r < R; r++)
        for (long i = 0; i < D; i++) {  /* the angles of position PAST + t, as the model's */
            double angle = (PAST + r % T) * pow(10000, -(double)(2 * (i % (D / 2))) / D);
            cosines[r * D + i] = rounded(type, (float)cos(angle));
            sines[r * D + i] = rounded(type, (float)sin(angle));
        }
    float *k = random_values(B * cache, type, -1, 1), *v = random_values(B * cache, type, -1, 1);
    for (long i = 0; i < B * cache; i++)
        if (i / D % S >= PAST) k[i] = v[i] = 0;  /* slots the step fills */
    void *norms[2] = {as_type(attn_norm, BC, type), as_type(mlp_norm, BC, type)}, *xt = as_type(x, R * BC, type),
         *cos_t = as_type(cosines, R * D, type), *sin_t = as_type(sines, R * D, type),
         *k_t = as_type(k, B * cache, type), *v_t = as_type(v, B * cache, type);
    const struct block layer = {norms[0], norms[1], w[0].data, w[1].data, w[2].data, w[3].data, w[4].data,
                                w[5].data, w[6].data, w[0].scale, w[1].scale, w[2].scale, w[3].scale, w[4].scale,
                                w[5].scale, w[6].scale, {w_type, w_type, vd_type, w_type, w_type, w_type, vd_type},
                                BC, BH, BKVH, D, BI, 1e-5f};
    char name[160], types[40];
    snprintf(types, sizeof types, vd_type == w_type ? "%s" : "%s v,down=%s", type_name[w_type], type_name[vd_type]);
    snprintf(name, sizeof name, "blocks %s w=%s B=%ld T=%ld C=%ld H=%d KVH=%d D=%ld I=%ld%s", type_name[type], types,
             B, T, BC, BH, BKVH, D, BI, zero_o ? " o=0" : "");
    struct layer_run run = run_blocks(&layer, type, 0, B, T, xt, cos_t, sin_t, k_t, v_t);
    if (!run.x) {
        printf("FAIL %s: returned out of memory\n", name);
        failed++;
        return;
    }

    /* the reference: every row's keys and values into the cache first, then attention, o, the MLP */
    double *rx = malloc(sizeof(double) * R * BC), *rk = malloc(sizeof(double) * B * cache),
           *rv = malloc(sizeof(double) * B * cache), *q = malloc(sizeof(double) * R * QD);
    double h[BC], kv[KVD], att[QD], gate[BI], up[BI], delta[BC], p[PAST + 64];
    for (long i = 0; i < R * BC; i++) rx[i] = x[i];
    for (long i = 0; i < B * cache; i++) rk[i] = k[i], rv[i] = v[i];
    for (long r = 0; r < R; r++) {
        const long b = r / T, slot = PAST + r % T;
        rms_normed(rx + r * BC, attn_norm, h);
        matvec(w[0].values, w[0].scale, h, QD, BC, q + r * QD);
        for (long head = 0; head < BH; head++) rotated(q + r * QD + head * D, cosines + r * D, sines + r * D, D);
        matvec(w[1].values, w[1].scale, h, KVD, BC, kv);
        for (long head = 0; head < BKVH; head++) {
            rotated(kv + head * D, cosines + r * D, sines + r * D, D);
            memcpy(rk + b * cache + (head * S + slot) * D, kv + head * D, sizeof(double) * D);
        }
        matvec(w[2].values, w[2].scale, h, KVD, BC, kv);
        for (long head = 0; head < BKVH; head++)
            memcpy(rv + b * cache + (head * S + slot) * D, kv + head * D, sizeof(double) * D);
    }
    for (long r = 0; r < R; r++) {
        const long b = r / T, last = PAST + r % T;
        for (long head = 0; head < BH; head++) {
            const double *keys = rk + b * cache + head / (BH / BKVH) * S * D, *values = rv + (keys - rk);
            double top = -INFINITY, total = 0;
            for (long s = 0; s <= last; s++) {
                double dot = 0;
                for (long d = 0; d < D; d++) dot += q[r * QD + head * D + d] * keys[s * D + d];
                p[s] = dot / sqrt((double)D);
                top = p[s] > top ? p[s] : top;
            }
            for (long s = 0; s <= last; s++) total += p[s] = exp(p[s] - top);
            for (long d = 0; d < D; d++) {
                double sum = 0;
                for (long s = 0; s <= last; s++) sum += p[s] * values[s * D + d];
                att[head * D + d] = sum / total;
            }
        }
        matvec(w[3].values, w[3].scale, att, BC, QD, delta);
        for (long c = 0; c < BC; c++) rx[r * BC + c] += delta[c];
        rms_normed(rx + r * BC, mlp_norm, h);
        matvec(w[4].values, w[4].scale, h, BI, BC, gate);
        matvec(w[5].values, w[5].scale, h, BI, BC, up);
        for (long i = 0; i < BI; i++) gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i];
        matvec(w[6].values, w[6].scale, gate, BC, BI, delta);
        for (long c = 0; c < BC; c++) rx[r * BC + c] += delta[c];
    }

    /* Within a share of the largest value: many steps, each summing in its own order, and in bf16 each rounded
     * (which the reference does not copy) where torch rounds. */
    const double rel = type == BF16 ? 0x1p-5 : 1e-5;
    struct { const char *what; const void *got; const double *ref; long n; } parts[3] = {
        {"x", run.x, rx, R * BC}, {"K cache", run.k, rk, B * cache}, {"V cache", run.v, rv, B * cache}};
    double *scale = malloc(sizeof(double) * B * cache);
    for (int i = 0; i < 3; i++) {
        char part[200];
        const double top = largest(parts[i].ref, parts[i].n);
        for (long e = 0; e < parts[i].n; e++) scale[e] = top;
        snprintf(part, sizeof part, "%s: %s", name, parts[i].what);
        compare(part, parts[i].got, type, parts[i].ref, scale, parts[i].n, rel);
    }

    /* each sequence's bits the same decoded alone (its products see fewer rows, its heads other groupings) */
    if (B > 1) {
        int same = 1;
        for (long b = 0; b < B && same; b++) {
            struct layer_run alone = run_blocks(&layer, type, b, 1, T, xt, cos_t, sin_t, k_t, v_t);
            same = alone.x && same_bytes(alone.x, run.x + b * T * BC * size, size * T * BC) &&
                   same_bytes(alone.k, run.k + b * cache * size, size * cache) &&
                   same_bytes(alone.v, run.v + b * cache * size, size * cache);
            if (!same) printf("FAIL %s: sequence %ld alone differs from its result among %ld\n", name, b, B);
            free(alone.x), free(alone.k), free(alone.v);
        }
        if (same) printf("ok   %s: each sequence's bits alone = among %ld\n", name, B);
        same ? passed++ : failed++;
    }
    if (D % 32 == 0) check_prompt_path(name, &layer, type, B, T, xt, cos_t, sin_t, run, zero_o);
    for (int i = 0; i < 7; i++) free(w[i].data), free(w[i].values), free(w[i].scale);
    free(attn_norm), free(mlp_norm), free(x), free(cosines), free(sines), free(k), free(v), free(norms[0]),
        free(norms[1]), free(xt), free(cos_t), free(sin_t), free(k_t), free(v_t), free(run.x), free(run.k),
        free(run.v), free(rx), free(rk), free(rv), free(q), free(scale);
}

static void check_blocks(int type, int w_type, long B, long T, long D, int zero_o) {
    check_layer(type, w_type, w_type, B, T, D, zero_o);
}

/* int8 activations (linear()'s int8: kernels.c's rows_times): 70 rows of x (a prompt's: 64, then a second
 * ROW_BLOCK) quantized as llama.cpp's quantize_row_q8_0 (a float32 scale max |x| / 127 a block of 32, x / scale
 * rounded to the nearest, ties to even), then multiplied by the decoded weights in double: within 1e-6 of the
 * terms' magnitudes; each row's bits the same alone (a decoding step's) as among the 70. */
static void check_int8_linear(int w_type, long K) {
    char name[160];
    enum { B = 70 };
    const long total = N_OF[0] + N_OF[1];
    float *xv = random_values(B * K, F32, -1, 1);
    struct weights w[COUNT];
    const void *data[COUNT];
    const float *no_scale[COUNT] = {NULL, NULL};
    for (int m = 0; m < COUNT; m++) w[m] = random_weights(w_type, N_OF[m], K), data[m] = w[m].data;
    float *y = malloc(sizeof(float) * B * total), *alone = malloc(sizeof(float) * total);
    linear(xv, F32, COUNT, data, w_type, no_scale, y, B, N_OF, K, 1);
    double *xq = malloc(sizeof(double) * B * K), *ref = malloc(sizeof(double) * B * total),
           *scale = malloc(sizeof(double) * B * total);
    for (long b = 0; b < B * K / BLOCK; b++) {
        float most = 0;
        for (int j = 0; j < BLOCK; j++) most = fmaxf(most, fabsf(xv[b * BLOCK + j]));
        const float d = most / 127.0f, inverse = d != 0 ? 1.0f / d : 0.0f;
        for (int j = 0; j < BLOCK; j++) xq[b * BLOCK + j] = (double)rintf(xv[b * BLOCK + j] * inverse) * d;
    }
    for (int m = 0; m < COUNT; m++)
        for (long r = 0; r < B; r++)
            for (long n = 0; n < N_OF[m]; n++) {
                double sum = 0, size = 0;
                for (long k = 0; k < K; k++) {
                    double term = xq[r * K + k] * w[m].values[n * K + k];
                    sum += term, size += fabs(term);
                }
                ref[at(B, m, r, n)] = sum, scale[at(B, m, r, n)] = size;
            }
    snprintf(name, sizeof name, "linear x=f32 w=%s K=%ld rows=%d, int8 activations: values", type_name[w_type], K, B);
    compare(name, y, F32, ref, scale, B * total, 1e-6);
    int same = 1;
    for (long r = 0; r < B && same; r++) {
        linear(xv + r * K, F32, COUNT, data, w_type, no_scale, alone, 1, N_OF, K, 1);
        for (int m = 0; m < COUNT && same; m++)
            same = same_bytes(y + at(B, m, r, 0), alone + at(1, m, 0, 0), sizeof(float) * N_OF[m]);
    }
    if (same) passed++;
    else failed++;
    printf("%s linear x=f32 w=%s K=%ld, int8 activations: each row's bits alone = among %d rows\n",
           same ? "ok  " : "FAIL", type_name[w_type], K, B);
    for (int m = 0; m < COUNT; m++) free(w[m].data), free(w[m].values), free(w[m].scale);
    free(xv), free(y), free(alone), free(xq), free(ref), free(scale);
}

/* Weights of `type` laid out again at load as `laid` (Q4_0 as rows of stripes, a K-quant as its _ACROSS; with AVX2
 * every block type as groups of 8 rows), where
 * kernels.c builds its tile (else nothing to check): the products of 1, 5 and 70 rows (int8 and exact: a decoding
 * step's tile, and a prompt's) and dequantize give the bits of the file's blocks. */
static void check_laid_out(int type, int laid, long K) {
    enum { B = 70 };
    const long total = N_OF[0] + N_OF[1], rows_of[] = {1, 5, B};
    struct weights w[COUNT];
    const void *blocks[COUNT], *again[COUNT];
    const float *no_scale[COUNT] = {NULL, NULL};
    int built = 1;
    for (int m = 0; m < COUNT; m++) {
        w[m] = random_weights(type, N_OF[m], K), blocks[m] = w[m].data;
        again[m] = malloc(N_OF[m] * K / block_size(type) * BLOCK_BYTES[type]);
        built &= type == Q4_0 ? repack_stripes(blocks[m], N_OF[m], K, (void *)again[m])
                              : repack_across(blocks[m], type, N_OF[m], K, (void *)again[m]);
    }
    float *x = random_values(B * K, F32, -1, 1), *want = malloc(sizeof(float) * B * total),
          *got = malloc(sizeof(float) * B * total), *values = malloc(sizeof(float) * N_OF[0] * K);
    int same = 1;
    for (int int8 = 0; built && int8 <= 1; int8++)
        for (int r = 0; r < 3; r++) {
            linear(x, F32, COUNT, blocks, type, no_scale, want, rows_of[r], N_OF, K, int8);
            linear(x, F32, COUNT, again, laid, no_scale, got, rows_of[r], N_OF, K, int8);
            same &= same_bytes(got, want, sizeof(float) * rows_of[r] * total);
        }
    for (int m = 0; built && m < COUNT; m++) {
        dequantize(again[m], laid, values, N_OF[m], K);
        same &= same_bytes(values, w[m].values, sizeof(float) * N_OF[m] * K);
    }
    if (same) passed++;
    else failed++;
    printf("%s linear x=f32 w=%s laid out again K=%ld: %s\n", same ? "ok  " : "FAIL", type_name[type], K,
           built ? "the file's blocks' bits, int8 and exact, and dequantize's" : "not built here");
    for (int m = 0; m < COUNT; m++) free(w[m].data), free(w[m].values), free(w[m].scale), free((void *)again[m]);
    free(x), free(want), free(got), free(values);
}

int main(void) {
    for (int x_type = F32; x_type <= BF16; x_type++)
        for (int w_type = F32; w_type <= Q6_K; w_type++)
            for (long K = 64; K <= 96 && !is_super(w_type); K += 32) check_linear(x_type, w_type, K);
    for (int type = F32; type <= BF16; type++) {
        const long T[] = {1, 5, 16, 17, 40, 70};  /* within one tile of keys and queries, and across them */
        for (int i = 0; i < 6; i++) check_attention(type, 1, T[i], 4, 2, 64);
        check_attention(type, 2, 33, 4, 2, 128);
        check_attention(type, 2, 20, 4, 4, 64);
        check_silu_mul(type, 16 * 37);
        check_rope_rows(type, 5, 3, 64);
        check_rope_rows(type, 4, 2, 32);
        check_norm_rows(type, 7, 96);
    }
    /* activations and weights as models have them */
    const int layers[][2] = {{F32, F32}, {F32, I8}, {F32, Q4_1}, {F32, Q8_0}, {BF16, BF16}, {BF16, I8},
                             {F32, Q4_0}};
    for (int i = 0; i < 7; i++) {
        check_blocks(layers[i][0], layers[i][1], 2, 3, 32, 0);
        check_blocks(layers[i][0], layers[i][1], 2, 3, 64, 1);
    }
    check_blocks(F32, F32, 1, 1, 32, 0);
    check_blocks(BF16, BF16, 1, 1, 32, 0);
    /* head sizes whose half is not a whole number of vectors with AVX-512: RoPE's last elements one at a time */
    for (long D = 16; D <= 48; D += 32) {
        check_blocks(F32, F32, 2, 3, D, 0);
        check_blocks(BF16, BF16, 2, 3, D, 0);
    }
    /* the types added later, last: every check above keeps its inputs */
    for (int w_type = Q5_0; w_type < TYPES; w_type++) {
        for (int x_type = F32; x_type <= BF16; x_type++)
            for (long K = 64; K <= 96; K += 32) check_linear(x_type, w_type, K);
        check_blocks(F32, w_type, 2, 3, 32, 0);
        check_blocks(F32, w_type, 2, 3, 64, 1);
    }
    check_layer(F32, Q5_0, Q8_0, 2, 3, 32, 0);  /* a Q4_K_M file's matrices of rows off super-blocks (the 135M's) */
    /* the K-quants, as the files hold them: rows of whole super-blocks */
    for (int w_type = Q4_K; w_type <= Q6_K; w_type++)
        for (int x_type = F32; x_type <= BF16; x_type++)
            for (long K = SUPER; K <= 2 * SUPER; K += SUPER) check_linear(x_type, w_type, K);
    BC = 256, BI = 512;  /* and with a head size of 64, o_proj's 256 inputs */
    for (int w_type = Q4_K; w_type <= Q6_K; w_type++) {
        check_blocks(F32, w_type, 2, 3, 64, 0);
        check_blocks(F32, w_type, 2, 3, 64, 1);
    }
    check_layer(F32, Q4_K, Q6_K, 2, 3, 64, 0);  /* a Q4_K_M file's: v_proj and down_proj Q6_K */
    check_layer(F32, Q4_K, Q6_K, 2, 3, 64, 1);
    /* int8 activations, last: every check above keeps its inputs */
    for (int w_type = Q4_1; w_type < TYPES; w_type++) check_int8_linear(w_type, is_super(w_type) ? 2 * SUPER : 96);
    /* rows of more blocks of 32 than 16, no multiple of 16: kernels.c's lanes tile reads the last 16 (a stripe) */
    for (int w_type = Q4_1; w_type < TYPES; w_type++)
        if (!is_super(w_type)) check_int8_linear(w_type, 17 * BLOCK);
    /* K-quant rows of 10 super-blocks: kernels.c's prompt tile unpacks them a CHUNK (8) at a time */
    for (int w_type = Q4_K; w_type <= Q6_K; w_type++) check_int8_linear(w_type, 10 * SUPER);
    for (long K = 3 * BLOCK; K <= 32 * BLOCK; K += 14 * BLOCK) check_laid_out(Q4_0, Q4_0_STRIPES, K);  /* 3, 17, 31 */
    for (long K = 3 * BLOCK; K <= 32 * BLOCK; K += 14 * BLOCK) check_laid_out(Q8_0, Q8_0_EIGHTS, K);
    for (int type = Q4_K; type <= Q6_K; type++)
        for (long K = SUPER; K <= 3 * SUPER; K += 2 * SUPER) check_laid_out(type, Q4_K_ACROSS + type - Q4_K, K);
    for (long K = 3 * BLOCK; K <= 32 * BLOCK; K += 14 * BLOCK) {
        check_laid_out(Q4_1, Q4_1_EIGHTS, K);
        check_laid_out(Q5_0, Q5_0_EIGHTS, K);
        check_laid_out(Q5_1, Q5_1_EIGHTS, K);
    }
    printf("bits %016llx\n", (unsigned long long)bits);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
