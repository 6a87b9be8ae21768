/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for 1-4 rows, W held as float8_e4m3fn bytes packed as
   [ceil(N / 64)][K][64] (`gemv_fp8.py`: outputs past N zero) with fp32 scales [ceil(N / bm)][ceil(K / bn)]
   (block-wise FP8: weight_block_size [bm, bn]; per channel: [1, K]; per tensor: [N, K]).

   Each weight is dequantized in registers exactly as `quant/dequant.py` does once at load: w = float(q) * s,
   one fp32 rounding (float(q) is exact: e4m3 -> fp32 by moving the bits, (b & 0x7f) << 20 | sign << 31, then
   * 2^120, exact for normal and subnormal e4m3 alike as long as denormals are not flushed: `check` compares all
   256 codes but the two NaNs, which the packer refuses). Each output is then the same multiply-add chain over k
   ascending from 0 as `gemv.c`, so the result has the bits of `gemv.c` on the dequantized fp32 weight. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 64
#define SUB (4 * VW)

typedef int8_t vb __attribute__((vector_size(VW)));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));

/* VW bytes sign-extended to int32 lanes (gcc's generic conversion goes byte by byte through scalar registers) */
static inline vi widen(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vb b;
    memcpy(&b, p, sizeof(vb));
    return __builtin_convertvector(b, vi);
#endif
}

/* the code's sign and low 7 bits moved into an fp32's sign and bits 20-26, times 2^120: sign-extended, shifted
   left by 20, the sign bit (bit 31, as the extension copies it there) and bits 20-26 kept (3 vector operations) */
static inline vf e4m3_to_f32(const uint8_t *p) {
    vu bits = ((vu)widen(p) << 20) & 0x87F00000u;  /* (unsigned: no shift of a negative value) */
    vf f;
    memcpy(&f, &bits, sizeof(vf));
    return f * 0x1p120f;
}

#define DEFINE_GEMV_FP8(MR)                                                                                \
static void gemv_fp8_##MR(const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,              \
                          const float *scale, int64_t bm, int64_t bn, const float *bias, float *y,          \
                          int64_t ldy) {                                                                    \
    int64_t nblocks = (N + BLOCK - 1) / BLOCK, scols = (K + bn - 1) / bn;                                   \
    for (int64_t nb = 0; nb < nblocks; nb++)                                                                \
        for (int64_t s = 0; s < BLOCK; s += SUB) {                                                          \
            int64_t n0 = nb * BLOCK + s;                                                                    \
            if (n0 >= N) break;                                                                             \
            vf acc[MR][4];                                                                                  \
            for (int m = 0; m < MR; m++)                                                                    \
                for (int j = 0; j < 4; j++) acc[m][j] = (vf){0};                                            \
            const uint8_t *wb = w + nb * K * BLOCK + s;                                                     \
            for (int64_t kb = 0; kb < scols; kb++) {                                                        \
                vf sv[4];                                                                                   \
                for (int j = 0; j < 4; j++) {                                                               \
                    float lane[VW];                                                                         \
                    for (int i = 0; i < VW; i++) {                                                          \
                        int64_t n = n0 + VW * j + i;                                                        \
                        lane[i] = n < N ? scale[(n / bm) * scols + kb] : 0.0f;                              \
                    }                                                                                       \
                    memcpy(&sv[j], lane, sizeof(vf));                                                       \
                }                                                                                           \
                int64_t kend = (kb + 1) * bn < K ? (kb + 1) * bn : K;                                       \
                for (int64_t k = kb * bn; k < kend; k++) {                                                  \
                    vf wv[4];                                                                               \
                    for (int j = 0; j < 4; j++) wv[j] = e4m3_to_f32(wb + k * BLOCK + VW * j) * sv[j];       \
                    for (int m = 0; m < MR; m++) {                                                          \
                        vf xv = (vf){0} + x[m * ldx + k];                                                   \
                        for (int j = 0; j < 4; j++) acc[m][j] += xv * wv[j];                                \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
            int64_t count = N - n0 < SUB ? N - n0 : SUB;                                                    \
            for (int m = 0; m < MR; m++) {                                                                  \
                float out[SUB];                                                                             \
                memcpy(out, acc[m], sizeof(out));                                                           \
                if (bias)                                                                                   \
                    for (int64_t i = 0; i < count; i++) out[i] += bias[n0 + i];                             \
                memcpy(y + m * ldy + n0, out, count * sizeof(float));                                       \
            }                                                                                               \
        }                                                                                                   \
}

DEFINE_GEMV_FP8(1)
DEFINE_GEMV_FP8(2)
DEFINE_GEMV_FP8(3)
DEFINE_GEMV_FP8(4)

int triton_vlm_gemv_fp8(const float *x, int64_t rows, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
                        const float *scale, int64_t bm, int64_t bn, const float *bias, float *y, int64_t ldy) {
    if (bm < 1 || bn < 1) return -2;
    switch (rows) {
    case 1: gemv_fp8_1(x, ldx, K, w, N, scale, bm, bn, bias, y, ldy); return 0;
    case 2: gemv_fp8_2(x, ldx, K, w, N, scale, bm, bn, bias, y, ldy); return 0;
    case 3: gemv_fp8_3(x, ldx, K, w, N, scale, bm, bn, bias, y, ldy); return 0;
    case 4: gemv_fp8_4(x, ldx, K, w, N, scale, bm, bn, bias, y, ldy); return 0;
    default: return -1;
    }
}

/* the 256 codes as this build converts them (unscaled), for `check` */
void triton_vlm_e4m3_table(float *out) {
    uint8_t codes[VW];
    for (int c = 0; c < 256; c += VW) {
        for (int i = 0; i < VW; i++) codes[i] = (uint8_t)(c + i);
        vf f = e4m3_to_f32(codes);
        memcpy(out + c, &f, sizeof(vf));
    }
}

/* out[k][n - nb0 * 64] = float(q[n][k]) * s for the outputs n of 64-row blocks nb0 <= nb < nb1 (the dequantized
   weight's columns transposed, [K][(nb1 - nb0) * 64], outputs past N 0): one chunk of a prefill product's weight,
   converted here at the kernel's speed (torch's e4m3 cast is scalar); the caller never holds the whole fp32 matrix.
   Row by row of `out` (contiguous writes: the chunk is made in the caches the product then reads it from), each
   column's scale read from a table of the chunk's scales, [ceil(K / bn)][columns], made first. */
#include <stdlib.h>

int triton_vlm_fp8_dequantize_t(const uint8_t *w, int64_t K, int64_t N, const float *scale, int64_t bm,
                                int64_t bn, int64_t nb0, int64_t nb1, float *out) {
    int64_t scols = (K + bn - 1) / bn, ld = (nb1 - nb0) * BLOCK;
    float *table = malloc(sizeof(float) * scols * ld);
    if (!table) return -6;
    for (int64_t kb = 0; kb < scols; kb++)
        for (int64_t c = 0; c < ld; c++) {
            int64_t n = nb0 * BLOCK + c;
            table[kb * ld + c] = n < N ? scale[(n / bm) * scols + kb] : 0.0f;
        }
    for (int64_t k = 0; k < K; k++) {
        const float *srow = table + (k / bn) * ld;
        float *dst = out + k * ld;
        for (int64_t nb = nb0; nb < nb1; nb++) {
            const uint8_t *src = w + nb * K * BLOCK + k * BLOCK;
            int64_t c0 = (nb - nb0) * BLOCK;
            for (int64_t s = 0; s < BLOCK; s += VW) {
                vf sv, v;
                memcpy(&sv, srow + c0 + s, sizeof(vf));
                v = e4m3_to_f32(src + s) * sv;
                memcpy(dst + c0 + s, &v, sizeof(vf));
            }
        }
    }
    free(table);
    return 0;
}
