// The sum of a 256-bit vector's 8 float32 lanes, and a float32 dot product, for the AVX2
// libraries (quant_gemv.cpp, quant_gemv_int8.cpp, quant_decode_layer.cpp, moe_experts.cpp), which
// build without AVX-512.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace radix_avx2 {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i a[i] * b[i], eight lanes at a time (FMA), the rest one by one.
inline float dot(const float* a, const float* b, int64_t count) {
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
  float rest = hsum(s);
  // An explicit fused multiply-add: written as `rest += a[i] * b[i]`, the compiler may contract it
  // or not in each place it is inlined, so one product's sums differed by the rows in its call.
  for (; i < count; ++i) rest = std::fma(a[i], b[i], rest);
  return rest;
}

}  // namespace radix_avx2
