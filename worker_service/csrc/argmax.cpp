// The argmax of each row of float32 logits, for greedy sampling: PyTorch's CPU argmax along the
// last dimension took 457 us for 32 rows of SmolLM2's 49,152 logits here (2 threads), where its
// max alone (`amax`) took 42; this is that max, then the first index holding it, 16 lanes at a
// time. The first index of the maximum on ties, as torch.argmax; a row holding a NaN is left to
// the caller (torch.argmax returns the NaN's index), reported by the return value.

#ifndef __AVX512F__
#error "the argmax kernel needs AVX-512"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vector_math.h"

namespace {

using namespace radix;

constexpr int64_t kParallelValues = 1 << 16;  // fewer values: one thread, a team costs more

// The row's argmax into *out; false if the row holds a NaN (then *out is not set).
bool argmax_row(const float* x, int cols, int64_t* out) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int i = 0;
  for (; i + 16 <= cols; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  if (i < cols) {
    const __mmask16 tail = lanes_from(cols - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  if (nan) return false;
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  for (i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, x + i), m, _CMP_EQ_OQ);
    if (hit) {
      *out = i + __builtin_ctz(hit);
      return true;
    }
  }
  *out = 0;  // unreachable: the maximum is one of the values
  return true;
}

}  // namespace

extern "C" {

// out[r] = the argmax of row r of x (rows `row_stride` floats apart, `cols` each). 0: done; 1: some
// row holds a NaN (out is then incomplete: the caller takes torch's argmax instead).
int radix_argmax_rows(const float* x, int64_t row_stride, int32_t rows, int32_t cols, int64_t* out,
                      int32_t num_threads) {
  int status = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (int64_t{rows} * cols >= kParallelValues) \
    reduction(| : status)
  for (int r = 0; r < rows; ++r)
    if (!argmax_row(x + r * row_stride, cols, out + r)) status |= 1;
  return status;
}

}  // extern "C"
