/* What the kernels' products cost a weight when memory is out of it: a 512 x 2048 matrix of each block type (its
 * blocks random bytes, scales set finite), small enough to stay in L2, through linear() over and over; ns a weight
 * a row, the thread's CPU time (other processes' time on a shared machine is not counted), best of 30 calls. Rows
 * 1, 4 and 16 with int8 activations (decoding), then 64 rows both ways (a prompt: int8 / exact), and 128 rows in
 * int8 (two of linear()'s ROW_BLOCKs). Types named on the command line, else every one; those laid out again at
 * load (Q4_0_STRIPES, Q4_K_ACROSS, ...) are the file type's random blocks laid out so first. K=8192 in the
 * environment: rows as long as an MLP's down projection's (that matrix outgrows the L2: a prompt's rows read it
 * once a 64-row block, decoding's every call).
 *
 *     cc -O3 -march=native -fopenmp -fno-math-errno -ffp-contract=off -Isrc/smollm2/kernels \
 *         benchmarks/int8_costs.c -o int8_costs -lm && OMP_NUM_THREADS=1 [K=8192] ./int8_costs [Q5_K Q6_K ...]
 *
 * (-march=x86-64-v3 for the AVX2 build.) The build's flags are kernels/build.py's. */
#include "kernels.c"

#include <stdio.h>
#include <time.h>

enum { N = 512, CALLS = 30 };
static long K = 2048;  /* a row's weights: a multiple of 256 */

static double cpu_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ns a weight a row of y = x @ w^T, B rows, int8 activations or exact: the best of CALLS calls */
static double cost(const uint8_t *w, int type, long B, int int8) {
    float *x = malloc(sizeof(float) * B * K), *y = malloc(sizeof(float) * B * N);
    for (long i = 0; i < B * K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    const void *ws[1] = {w};
    const float *no_scale[1] = {NULL};
    const long outputs[1] = {N};
    double best = 1e9;
    for (int call = 0; call < CALLS; call++) {
        const double start = cpu_seconds();
        linear(x, F32, 1, ws, type, no_scale, y, B, outputs, K, int8);
        const double took = cpu_seconds() - start;
        best = took < best ? took : best;
    }
    free(x), free(y);
    return best * 1e9 / ((double)N * K * B);
}

int main(int argc, char **argv) {  /* the types named (Q5_K ...), or every one */
    if (getenv("K")) K = atol(getenv("K"));
    if (K <= 0 || K % 256) {
        fprintf(stderr, "K=%ld: a row's weights must be a positive multiple of 256\n", K);
        return 2;
    }
    const int types[] = {Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q4_1, Q5_0, Q5_1, Q4_0_STRIPES, Q4_K_ACROSS, Q5_K_ACROSS,
                         Q6_K_ACROSS, Q8_0_EIGHTS, Q4_1_EIGHTS, Q5_0_EIGHTS, Q5_1_EIGHTS};
    const char *names[] = {"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "Q4_0_STRIPES",
                           "Q4_K_ACROSS", "Q5_K_ACROSS", "Q6_K_ACROSS", "Q8_0_EIGHTS", "Q4_1_EIGHTS",
                           "Q5_0_EIGHTS", "Q5_1_EIGHTS"};  /* from Q4_0_STRIPES: laid
                                                                                          * out again at load */
    printf("ns a weight a row   int8: 1 row   4 rows  16 rows   64 rows: int8 / exact  128 rows: int8\n");
    for (int t = 0; t < (int)(sizeof types / sizeof *types); t++) {
        const int type = file_type(types[t]);
        int named = argc == 1;
        for (int a = 1; a < argc; a++) named |= strcmp(argv[a], names[t]) == 0;
        if (!named) continue;
        const long groups = (long)N * K / group_size(type), bytes = group_bytes(type);
        uint8_t *w = malloc(groups * bytes);
        for (long i = 0; i < groups * bytes; i++) w[i] = (uint8_t)rand();
        for (long g = 0; g < groups; g++) {  /* finite float16 scales where GGUF's blocks have them (and minima) */
            uint8_t *group = w + g * bytes;
            const uint16_t half = 0x1000 + (rand() & 0x3ff);
            if (type == Q6_K) memcpy(group + 208, &half, 2);
            else memcpy(group, &half, 2);
            if (type == Q4_K || type == Q5_K || type == Q4_1 || type == Q5_1) memcpy(group + 2, &half, 2);
        }
        uint8_t *laid = malloc(groups * bytes);  /* as the loader lays it out again, where it is built */
        const int built = types[t] == Q4_0_STRIPES ? repack_stripes(w, N, K, laid)
                          : laid_out(types[t])     ? repack_across(w, type, N, K, laid)
                                                   : 0;
        if (laid_out(types[t]) && !built) {
            printf("%-20s not built here\n", names[t]);
            free(w), free(laid);
            continue;
        }
        const uint8_t *m = built ? laid : w;
        printf("%-20s %13.3f %8.3f %8.3f %9.3f / %.3f %9.3f\n", names[t], cost(m, types[t], 1, 1),
               cost(m, types[t], 4, 1), cost(m, types[t], 16, 1), cost(m, types[t], 64, 1), cost(m, types[t], 64, 0),
               cost(m, types[t], 128, 1));
        free(w), free(laid);
    }
    return 0;
}
