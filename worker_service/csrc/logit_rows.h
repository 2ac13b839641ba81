// A scan of one row of float32 logits that the sampling kernels (sample.cpp, logprobs.cpp) share.
#pragma once

#include <immintrin.h>

#include <cmath>

#include "vector_math.h"

namespace radix {

// The row's largest logit into *best; false where the row holds a NaN or +inf or nothing above
// -inf (such rows are left to the torch path, which says what they give).
inline bool finite_max(const float* x, int cols, float* best) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
    vmax = _mm512_max_ps(vmax, v);
  }
  *best = _mm512_reduce_max_ps(vmax);
  return !bad && *best != -INFINITY;
}

}  // namespace radix
