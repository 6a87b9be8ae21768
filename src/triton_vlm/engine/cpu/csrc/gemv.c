/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for 1-4 rows, W packed by oneDNN as [ceil(N / 64)][Kp][64]
   (`gemv.py`: the layout is checked before this runs). Each output is one multiply-add chain over k in
   ascending order from 0, whatever the vector width: the bits do not depend on the ISA's vector width. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define BLOCK 64        /* outputs per block of the packed layout */
#define SUB (4 * VW)    /* outputs per pass over a block: 4 accumulators a row, so 4 rows fit the registers */

#define DEFINE_GEMV(MR)                                                                                    \
static void gemv_##MR(const float *x, int64_t ldx, int64_t K, const float *w, int64_t Kp, int64_t N,        \
                      const float *bias, float *y, int64_t ldy) {                                          \
    int64_t nblocks = (N + BLOCK - 1) / BLOCK;                                                             \
    for (int64_t nb = 0; nb < nblocks; nb++)                                                               \
        for (int64_t s = 0; s < BLOCK; s += SUB) {                                                         \
            int64_t n0 = nb * BLOCK + s;                                                                   \
            if (n0 >= N) break;                                                                            \
            vf acc[MR][4];                                                                                 \
            for (int m = 0; m < MR; m++)                                                                   \
                for (int j = 0; j < 4; j++) acc[m][j] = (vf){0};                                           \
            const float *wb = w + nb * Kp * BLOCK + s;                                                     \
            for (int64_t k = 0; k < K; k++) {                                                              \
                vf wv[4];                                                                                  \
                for (int j = 0; j < 4; j++) memcpy(&wv[j], wb + k * BLOCK + VW * j, sizeof(vf));           \
                for (int m = 0; m < MR; m++) {                                                             \
                    vf xv = (vf){0} + x[m * ldx + k];                                                      \
                    for (int j = 0; j < 4; j++) acc[m][j] += xv * wv[j];                                   \
                }                                                                                          \
            }                                                                                              \
            int64_t count = N - n0 < SUB ? N - n0 : SUB;                                                   \
            for (int m = 0; m < MR; m++) {                                                                 \
                float out[SUB];                                                                            \
                memcpy(out, acc[m], sizeof(out));                                                          \
                if (bias)                                                                                  \
                    for (int64_t i = 0; i < count; i++) out[i] += bias[n0 + i];                            \
                memcpy(y + m * ldy + n0, out, count * sizeof(float));                                      \
            }                                                                                              \
        }                                                                                                  \
}

DEFINE_GEMV(1)
DEFINE_GEMV(2)
DEFINE_GEMV(3)
DEFINE_GEMV(4)

int triton_vlm_gemv(const float *x, int64_t rows, int64_t ldx, int64_t K, const float *w, int64_t Kp,
                    int64_t N, const float *bias, float *y, int64_t ldy) {
    switch (rows) {
    case 1: gemv_1(x, ldx, K, w, Kp, N, bias, y, ldy); return 0;
    case 2: gemv_2(x, ldx, K, w, Kp, N, bias, y, ldy); return 0;
    case 3: gemv_3(x, ldx, K, w, Kp, N, bias, y, ldy); return 0;
    case 4: gemv_4(x, ldx, K, w, Kp, N, bias, y, ldy); return 0;
    default: return -1;
    }
}
