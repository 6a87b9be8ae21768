/* Vectors as wide as the ISA the file is compiled for, so no function passes or returns a vector wider than
   its registers (gcc's -Wpsabi "AVX512F vector return without AVX512F enabled changes the ABI"): 64 bytes with
   AVX-512, 32 with AVX/AVX2, 16 otherwise (SSE2 on any x86-64, NEON on aarch64, which every 64-bit ABI passes
   in registers as they are).

   The kernels work on logical rows of LANES = 16 floats, NV vectors of VW floats each: a lane's sums run in
   the same order whatever the width, so the AVX2, AVX-512 and 16-byte builds give the same bits. */
#ifndef TRITON_VLM_VEC_H
#define TRITON_VLM_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

#define LANES 16
#define NV (LANES / VW)

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

typedef float v4f __attribute__((vector_size(4 * sizeof(float)))); /* a quarter of a logical row, on any ISA */

/* the 16 lanes of acc[NV] summed as a tree (4 dependent adds, not 16), the same order at every width:
   l[i] += l[i + w] for w = 8, 4, 2, 1, in quarter vectors (lanes 4k..4k+3) so that the first two levels are
   vector adds and nothing goes through memory (a 16-float store and 16 scalar loads cost more than the sum) */
static inline float lanes_sum(const vf acc[NV]) {
    v4f q[LANES / 4];
    memcpy(q, acc, sizeof(q));
    v4f s = (q[0] + q[2]) + (q[1] + q[3]); /* w = 8: lanes 0-3 and 4-7; then w = 4 */
    return (s[0] + s[2]) + (s[1] + s[3]);  /* w = 2, then w = 1 */
}

#endif
