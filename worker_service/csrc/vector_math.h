// Vector pieces of the compiled kernels (paged_attention.cpp, elementwise.cpp, gemv.cpp): 16 values
// of a dtype to and from 16 float32 lanes, rounding to the dtype, bfloat16 pair products, and exp for
// softmax weights.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace radix {

enum Dtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// ---- conversions: 16 values of the pool's dtype <-> 16 float32 lanes -------------------------
// Half types are rounded to nearest even, as torch's .to() does (no NaNs reach these kernels).

template <int kDtype> struct Elem { using type = uint16_t; };
template <> struct Elem<kFloat32> { using type = float; };

// 16 raw halves (bfloat16 or float16) -> float32.
template <int kDtype>
inline __m512 widen(__m256i halves) {
  if constexpr (kDtype == kFloat16) return _mm512_cvtph_ps(halves);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// float32 -> 16 raw halves.
template <int kDtype>
inline __m256i narrow(__m512 x) {
  if constexpr (kDtype == kFloat16) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  } else {
    __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
  }
}

template <int kDtype>
inline __m512 load_vec(const typename Elem<kDtype>::type* p) {
  if constexpr (kDtype == kFloat32) return _mm512_loadu_ps(p);
  else return widen<kDtype>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int kDtype>
inline void store_vec(typename Elem<kDtype>::type* p, __m512 x) {
  if constexpr (kDtype == kFloat32) _mm512_storeu_ps(p, x);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow<kDtype>(x));
}

// One value of the dtype as float32.
template <int kDtype>
inline float to_float(typename Elem<kDtype>::type x) {
  if constexpr (kDtype == kFloat32) return x;
  else if constexpr (kDtype == kFloat16) return _cvtsh_ss(x);
  else return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(x) << 16)));
}

// The first min(remaining, 16) of 16 lanes.
inline __mmask16 lanes_from(int remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// The first `lanes` of 16 half values (the rest read as zero, never touched in memory).
template <int kDtype>
inline __m512 load_halves(const uint16_t* p, __mmask16 lanes) {
  return widen<kDtype>(_mm256_maskz_loadu_epi16(lanes, p));
}

template <int kDtype>
inline void store_halves(uint16_t* p, __mmask16 lanes, __m512 x) {
  _mm256_mask_storeu_epi16(p, lanes, narrow<kDtype>(x));
}

// x rounded to the dtype's precision and back to float32 (float32: x itself).
template <int kDtype>
inline __m512 round_to(__m512 x) {
  if constexpr (kDtype == kFloat32) return x;
  else return widen<kDtype>(narrow<kDtype>(x));
}

// The first `lanes` of 16 values of any of the dtypes as float32 (the rest zero, never read).
template <int kDtype>
inline __m512 load_masked(const typename Elem<kDtype>::type* p, __mmask16 lanes) {
  if constexpr (kDtype == kFloat32) return _mm512_maskz_loadu_ps(lanes, p);
  else return load_halves<kDtype>(p, lanes);
}

// The first `lanes` of x stored in the dtype (rounded to nearest even).
template <int kDtype>
inline void store_masked(typename Elem<kDtype>::type* p, __mmask16 lanes, __m512 x) {
  if constexpr (kDtype == kFloat32) _mm512_mask_storeu_ps(p, lanes, x);
  else store_halves<kDtype>(p, lanes, x);
}

#ifdef __AVX512BF16__
// acc + per lane a[2i] * b[2i] + a[2i + 1] * b[2i + 1]: bfloat16 pairs, exact products, float32 sums.
inline __m512 dot_pairs(__m512 acc, __m512i pairs_a, __m512i pairs_b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(pairs_a), reinterpret_cast<__m512bh>(pairs_b));
}
#endif

typedef int32_t __attribute__((may_alias)) PairWord;  // two bfloat16 values read as one

// Two adjacent bfloat16 values in every 32-bit lane.
inline __m512i broadcast_pair(const uint16_t* two_values) {
  return _mm512_set1_epi32(*reinterpret_cast<const PairWord*>(two_values));
}

// exp for x in [-87, 100]: range reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, and
// scalef by 2^n. Relative error about 1e-7.
inline __m512 exp_in_range(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// exp for x <= 0 (scores minus their max); x below -87 gives (nearly) 0.
inline __m512 exp_nonpositive(__m512 x) { return exp_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))); }

// exp for any x: below -87 (nearly) 0; above ~88.7 +inf, as float32's own exp overflows (the
// reduction holds up to the clamp at 100, where 2^n is already past float32's range).
inline __m512 exp_any(__m512 x) {
  return exp_in_range(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(100.0f)));
}

}  // namespace radix
