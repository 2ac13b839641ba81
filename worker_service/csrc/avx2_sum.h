// The sum of a 256-bit vector's 8 float32 lanes, for the AVX2 libraries (quant_gemv.cpp,
// quant_decode_layer.cpp, moe_experts.cpp), which build without AVX-512.
#pragma once

#include <immintrin.h>

namespace radix_avx2 {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace radix_avx2
