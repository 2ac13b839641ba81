// RMSNorm for half-precision models on x86 CPUs with AVX-512: one pass over each row instead of
// PyTorch's chain of kernels (in bfloat16 eight: casts, pow, mean, add, rsqrt, two muls), each of
// which reads and writes the whole activation. Built into the same library as paged_attention.cpp
// (see native.py). (A fused SwiGLU was tried too: 8.5 -> 6.4 us at one row, but slower than
// PyTorch's at 2,048 rows, 1,620 -> 1,972 us; it was left out.)
//
// Rounding follows the reference Llama/Qwen2 code as PyTorch runs it: normalise in float32, round
// to the model dtype, then multiply by the weight and round again. Only the sum of squares is taken
// in another order, so a result may differ from PyTorch's by one step of the dtype.

#ifndef __AVX512F__
#error "the RMSNorm kernel needs AVX-512 (PyTorch's ops serve CPUs without it)"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vector_math.h"

namespace {

using namespace radix;

template <int kDtype>
void rms_norm_rows(const uint16_t* x, int64_t x_stride, const uint16_t* weight, uint16_t* out, int rows,
                   int size, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 16)
  for (int r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * x_stride;
    __m512 squares = _mm512_setzero_ps();
    for (int i = 0; i < size; i += 16) {
      const __m512 v = load_halves<kDtype>(row + i, lanes_from(size - i));
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float inverse = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(size) + eps);
    const __m512 scale = _mm512_set1_ps(inverse);
    uint16_t* dst = out + static_cast<int64_t>(r) * size;
    for (int i = 0; i < size; i += 16) {
      const __mmask16 lanes = lanes_from(size - i);
      const __m512 normed = round_to<kDtype>(_mm512_mul_ps(load_halves<kDtype>(row + i, lanes), scale));
      const __m512 scaled = _mm512_mul_ps(normed, load_halves<kDtype>(weight + i, lanes));
      store_halves<kDtype>(dst + i, lanes, scaled);
    }
  }
}

}  // namespace

extern "C" {

// out[r] = weight * round(x[r] / rms(x[r])), rows `x_stride` elements apart; out is contiguous.
int radix_rms_norm(int32_t dtype, const void* x, int64_t x_stride, const void* weight, void* out, int32_t rows,
                   int32_t size, float eps, int32_t num_threads) {
  auto* in = static_cast<const uint16_t*>(x);
  auto* w = static_cast<const uint16_t*>(weight);
  auto* o = static_cast<uint16_t*>(out);
  if (dtype == kBFloat16) rms_norm_rows<kBFloat16>(in, x_stride, w, o, rows, size, eps, num_threads);
  else if (dtype == kFloat16) rms_norm_rows<kFloat16>(in, x_stride, w, o, rows, size, eps, num_threads);
  else return 3;
  return 0;
}

}  // extern "C"
