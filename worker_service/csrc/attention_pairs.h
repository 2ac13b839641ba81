// The attention kernel's bfloat16 pair products (`vdpbf16ps`, AVX512-BF16): the pieces a unit of
// many queries uses (attention_many.h) and a unit of few queries (a decode row's own keys) on the
// pool's rows as they lie. Without AVX512-BF16 only the flags below exist, false.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "page_walk.h"
#include "vector_math.h"

namespace radix {

#ifdef __AVX512BF16__
// bfloat16 pools on CPUs with AVX512-BF16 multiply in bfloat16 pairs (`vdpbf16ps`: two products
// per lane per instruction, summed in float32), twice the float32 FMA rate. The products are exact
// either way (bfloat16 x bfloat16 fits float32), q is taken as stored (the scale goes on the float32
// scores), and the softmax weights are rounded to bfloat16 before they multiply V on every path, so
// only float32 summation order differs.
constexpr bool kBf16Pairs = true;

// (dot_pairs and broadcast_pair: vector_math.h)

// The word order that interleaves a vector's two halves: lane 2i takes value i of the first 16,
// lane 2i + 1 value i of the second 16 (for _mm512_permutexvar_epi16).
inline __m512i halves_interleaved() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

// The chunk's values as key pairs: out[(j / 2) * kD * 2 ...] holds, for each dimension d, the
// values of keys j and j + 1 side by side (an odd last key is paired with zeros), so that one
// `vdpbf16ps` adds two keys' weighted values to 16 dimensions.
template <int kD>
void interleave_values(const uint16_t* v_head, int page_size, const Chunk& chunk, uint16_t* out) {
  const __m512i order = halves_interleaved();  // lane 2d: dimension d of the first key, 2d + 1: of the second
  auto row = [&](int key) {
    return v_head + (static_cast<int64_t>(chunk.pages[key / page_size]) * page_size + key % page_size) * kD;
  };
  for (int j = 0; j < chunk.num_keys; j += 2) {
    const uint16_t* first = row(j);
    const uint16_t* second = j + 1 < chunk.num_keys ? row(j + 1) : nullptr;
    uint16_t* dst = out + static_cast<int64_t>(j / 2) * kD * 2;
    for (int t = 0; t < kD / 16; ++t) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 16 * t));
      const __m256i b = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + 16 * t))
                               : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(dst + 32 * t, _mm512_permutexvar_epi16(order, both));
    }
  }
}

// ---- few queries (a decode row's own keys): pair products on the pool's rows as they lie -------

// Head sizes whose key rows are whole 512-bit words (32 bfloat16 values each).
template <int kD>
constexpr bool kRowPairs = kD % 32 == 0;

// r[j] = the sum of v[j]'s 16 lanes, for all 16 vectors at once: 45 shuffles and adds in all,
// where one horizontal sum per vector costs about 8 (and waits on each step).
inline __m512 sum_each(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i] = a, v[2i+1] = b
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per block: the block's sums of v[4i], ..., v[4i + 3]
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  auto fold = [](__m512 a, __m512 b) {  // blocks: [a0+a1, a2+a3, b0+b1, b2+b3]
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(u[0], u[1]), fold(u[2], u[3]));
}

// scores[b * stride + key] = scale * q_b . k_key for `nb` queries (bfloat16 as stored, kD apart)
// and every key of the chunk. A key's row is kD / 32 words; each word times the query's is one
// `vdpbf16ps` into the key's vector of partial sums, and each 16 keys' vectors are summed at once
// (sum_each). With `values_ahead`, each page's values are fetched to L2 as its keys are read.
template <int kD>
void scores_rows_pairs(const uint16_t* queries, int nb, float scale, const uint16_t* k_head,
                       const uint16_t* v_head, bool values_ahead, int page_size, const Chunk& chunk, float* scores,
                       int stride) {
  constexpr int kW = kD / 32;
  const __m512 vscale = _mm512_set1_ps(scale);
  int page = 0;
  for_each_page(k_head, page_size, kD, chunk, [&](const uint16_t* k_page, int key, int in_page) {
    if (values_ahead)
      prefetch_run(v_head + static_cast<int64_t>(chunk.pages[page]) * page_size * kD, page_size, kD, 1);
    ++page;
    for (int j0 = 0; j0 < in_page; j0 += 16) {
      const int n = std::min(16, in_page - j0);
      const uint16_t* rows = k_page + static_cast<int64_t>(j0) * kD;
      for (int b = 0; b < nb; ++b) {
        __m512i qv[kW];
        for (int w = 0; w < kW; ++w) qv[w] = _mm512_loadu_si512(queries + b * kD + 32 * w);
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) {
          acc[j] = _mm512_setzero_ps();
          if (j < n)
            for (int w = 0; w < kW; ++w) acc[j] = dot_pairs(acc[j], qv[w], _mm512_loadu_si512(rows + j * kD + 32 * w));
        }
        _mm512_mask_storeu_ps(scores + b * stride + key + j0, lanes_from(n), _mm512_mul_ps(sum_each(acc), vscale));
      }
    }
  });
}

// acc[b] += sum over the chunk's keys of weight_b(key) * v_key, two keys per `vdpbf16ps`: the
// value rows of keys j and j + 1 of a page are interleaved within 128-bit blocks (unpacklo/hi), so
// acc[b][2w] and acc[b][2w + 1] hold word w's dimensions in the order `rows_pairs_in_order` undoes.
// `weights` (bfloat16, `stride` apart per query) must read as finite from key 0 to num_keys
// inclusive: a page's odd last key is paired with a row of zeros and the weight after it.
template <int kD, int kBlock>
void values_rows_pairs(const uint16_t* weights, int nb, int stride, const uint16_t* v_head, int page_size,
                       const Chunk& chunk, __m512 (&acc)[kBlock][kD / 16]) {
  constexpr int kW = kD / 32;
  for_each_page(v_head, page_size, kD, chunk, [&](const uint16_t* v_page, int key, int in_page) {
    for (int j = 0; j < in_page; j += 2) {
      __m512i lo[kW], hi[kW];
      for (int w = 0; w < kW; ++w) {
        const __m512i a = _mm512_loadu_si512(v_page + static_cast<int64_t>(j) * kD + 32 * w);
        const __m512i b = j + 1 < in_page ? _mm512_loadu_si512(v_page + static_cast<int64_t>(j + 1) * kD + 32 * w)
                                          : _mm512_setzero_si512();
        lo[w] = _mm512_unpacklo_epi16(a, b);
        hi[w] = _mm512_unpackhi_epi16(a, b);
      }
      for (int b = 0; b < kBlock; ++b) {
        if (b >= nb) break;
        const __m512i wv = broadcast_pair(weights + b * stride + key + j);
        for (int w = 0; w < kW; ++w) {
          acc[b][2 * w] = dot_pairs(acc[b][2 * w], lo[w], wv);
          acc[b][2 * w + 1] = dot_pairs(acc[b][2 * w + 1], hi[w], wv);
        }
      }
    }
  });
}

// values_rows_pairs' sums back in dimension order: word w's lo holds, per 128-bit block i,
// dimensions 32w + 8i + 0..3 and its hi 32w + 8i + 4..7.
template <int kD>
inline void rows_pairs_in_order(__m512 (&acc)[kD / 16]) {
  for (int w = 0; w < kD / 32; ++w) {
    const __m512 lo = acc[2 * w], hi = acc[2 * w + 1];
    const __m512 first = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));  // lo0 lo1 hi0 hi1
    const __m512 second = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));  // lo2 lo3 hi2 hi3
    acc[2 * w] = _mm512_shuffle_f32x4(first, first, _MM_SHUFFLE(3, 1, 2, 0));
    acc[2 * w + 1] = _mm512_shuffle_f32x4(second, second, _MM_SHUFFLE(3, 1, 2, 0));
  }
}
#else
constexpr bool kBf16Pairs = false;
template <int kD>
constexpr bool kRowPairs = false;
#endif

}  // namespace radix
