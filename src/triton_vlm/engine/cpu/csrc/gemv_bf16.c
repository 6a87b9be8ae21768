/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for 1-4 rows, W held as 16-bit floats (kind 0: bfloat16,
   kind 1: float16) packed as [ceil(N / 64)][K][64] (`gemv_bf16.py`: outputs past N zero).

   Each weight is widened to fp32 in registers, exactly (bf16: its bits moved into the top half of an fp32;
   fp16: the F16C conversion, or the bit arithmetic below, exact for every code: `check` compares all 65536
   with torch's), and each output is then the same multiply-add chain over k ascending from 0 as `gemv.c`, so
   the result has the bits of `gemv.c` on the weight upcast to fp32 once. */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define BLOCK 64
#define SUB (4 * VW)

typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));

/* VW bfloat16 values -> fp32: zero-extended to 32 bits, shifted into the top half */
static inline vf bf16_to_f32(const uint16_t *p) {
    vu bits;
#if defined(__AVX512F__)
    bits = (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__)
    bits = (vu)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    vh h;
    memcpy(&h, p, sizeof(vh));
    bits = __builtin_convertvector(h, vu);
#endif
    bits <<= 16;
    vf f;
    memcpy(&f, &bits, sizeof(vf));
    return f;
}

/* one float16 -> fp32 by its bits (exact: subnormals are m * 2^-24, m < 1024) */
static inline float half_bits(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f;
        return s ? -f : f;
    }
    bits = s | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline vf f16_to_f32(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX__) && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float lane[VW];
    for (int i = 0; i < VW; i++) lane[i] = half_bits(p[i]);
    vf f;
    memcpy(&f, lane, sizeof(vf));
    return f;
#endif
}

#define DEFINE_GEMV16(MR, KIND, CONV)                                                                      \
static void gemv16_##KIND##_##MR(const float *x, int64_t ldx, int64_t K, const uint16_t *w, int64_t N,     \
                                 const float *bias, float *y, int64_t ldy) {                               \
    int64_t nblocks = (N + BLOCK - 1) / BLOCK;                                                             \
    for (int64_t nb = 0; nb < nblocks; nb++)                                                               \
        for (int64_t s = 0; s < BLOCK; s += SUB) {                                                         \
            int64_t n0 = nb * BLOCK + s;                                                                   \
            if (n0 >= N) break;                                                                            \
            vf acc[MR][4];                                                                                 \
            for (int m = 0; m < MR; m++)                                                                   \
                for (int j = 0; j < 4; j++) acc[m][j] = (vf){0};                                           \
            const uint16_t *wb = w + nb * K * BLOCK + s;                                                   \
            for (int64_t k = 0; k < K; k++) {                                                              \
                vf wv[4];                                                                                  \
                for (int j = 0; j < 4; j++) wv[j] = CONV(wb + k * BLOCK + VW * j);                         \
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

DEFINE_GEMV16(1, bf, bf16_to_f32)
DEFINE_GEMV16(2, bf, bf16_to_f32)
DEFINE_GEMV16(3, bf, bf16_to_f32)
DEFINE_GEMV16(4, bf, bf16_to_f32)
DEFINE_GEMV16(1, hf, f16_to_f32)
DEFINE_GEMV16(2, hf, f16_to_f32)
DEFINE_GEMV16(3, hf, f16_to_f32)
DEFINE_GEMV16(4, hf, f16_to_f32)

int triton_vlm_gemv16(const float *x, int64_t rows, int64_t ldx, int64_t K, const uint16_t *w, int64_t N,
                      int64_t kind, const float *bias, float *y, int64_t ldy) {
    if (kind == 0) switch (rows) {
        case 1: gemv16_bf_1(x, ldx, K, w, N, bias, y, ldy); return 0;
        case 2: gemv16_bf_2(x, ldx, K, w, N, bias, y, ldy); return 0;
        case 3: gemv16_bf_3(x, ldx, K, w, N, bias, y, ldy); return 0;
        case 4: gemv16_bf_4(x, ldx, K, w, N, bias, y, ldy); return 0;
        default: return -1;
    }
    if (kind == 1) switch (rows) {
        case 1: gemv16_hf_1(x, ldx, K, w, N, bias, y, ldy); return 0;
        case 2: gemv16_hf_2(x, ldx, K, w, N, bias, y, ldy); return 0;
        case 3: gemv16_hf_3(x, ldx, K, w, N, bias, y, ldy); return 0;
        case 4: gemv16_hf_4(x, ldx, K, w, N, bias, y, ldy); return 0;
        default: return -1;
    }
    return -2;
}

/* n 16-bit codes of `kind` as this build widens them, for `check` (n a multiple of VW) */
void triton_vlm_widen16(const uint16_t *codes, int64_t n, int64_t kind, float *out) {
    for (int64_t i = 0; i < n; i += VW) {
        vf f = kind ? f16_to_f32(codes + i) : bf16_to_f32(codes + i);
        memcpy(out + i, &f, sizeof(vf));
    }
}

/* out[k][n - nb0 * 64] = float(W[n][k]) for the outputs n of 64-row blocks nb0 <= nb < nb1 (the widened weight's
   columns transposed, [K][(nb1 - nb0) * 64], outputs past N 0): one chunk of a prefill product's weight */
void triton_vlm_widen16_t(const uint16_t *w, int64_t K, int64_t kind, int64_t nb0, int64_t nb1, float *out) {
    int64_t ld = (nb1 - nb0) * BLOCK;
    for (int64_t k = 0; k < K; k++)
        for (int64_t nb = nb0; nb < nb1; nb++) {
            const uint16_t *src = w + nb * K * BLOCK + k * BLOCK;
            float *dst = out + k * ld + (nb - nb0) * BLOCK;
            for (int64_t s = 0; s < BLOCK; s += VW) {
                vf v = kind ? f16_to_f32(src + s) : bf16_to_f32(src + s);
                memcpy(dst + s, &v, sizeof(vf));
            }
        }
}
