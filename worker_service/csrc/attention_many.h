// A unit of many queries (a shared prefix's group, a prefill tile) in bfloat16 on a CPU with
// AVX512-BF16, laid out with the queries across the lanes: 16 queries per vector, so a key or a
// value enters as a broadcast pair (`vdpbf16ps`: two products per lane, float32 sums) read where it
// lies in the pool, with nothing gathered or transposed per key. The queries are transposed once
// per unit (q^T), the softmax runs down each lane, and the weights of two keys sit side by side in
// each lane, ready for the values (interleaved once per unit by key pairs, attention_pairs.h).
//
// The pieces the float32 unit shares (tiles, blocks of query vectors, the last transposition) are
// in attention_lanes.h. It replaced a layout with keys across the lanes (16 keys gathered into pairs per pass, each
// query's pair broadcast): 32 rows behind a 992-token prefix, one layer, one thread, four
// alternating runs, 410-494 -> 313-323 us.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_lanes.h"
#include "attention_pairs.h"
#include "page_walk.h"
#include "vector_math.h"

namespace radix {

#ifdef __AVX512BF16__

// Scores of kK keys (rows `keys[i]`) against kQ vectors of 16 queries: st[i * st_stride + 16 t]
// = scale * q . k. qt holds the queries' pairs transposed: pair e of the 16 queries of vector t at
// qt + e * qt_stride + 16 t.
template <int kD, int kK, int kQ>
inline void score_tile(const int32_t* qt, int qt_stride, const uint16_t* const* keys, float* st, int st_stride,
                       __m512 vscale) {
  __m512 acc[kK][kQ];
  for (int i = 0; i < kK; ++i)
    for (int t = 0; t < kQ; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int e = 0; e < kD / 2; ++e) {
    __m512i q[kQ];
    for (int t = 0; t < kQ; ++t) q[t] = _mm512_loadu_si512(qt + e * qt_stride + 16 * t);
    for (int i = 0; i < kK; ++i) {
      const __m512i k = broadcast_pair(keys[i] + 2 * e);
      for (int t = 0; t < kQ; ++t) acc[i][t] = dot_pairs(acc[i][t], k, q[t]);
    }
  }
  for (int i = 0; i < kK; ++i)
    for (int t = 0; t < kQ; ++t) _mm512_storeu_ps(st + i * st_stride + 16 * t, _mm512_mul_ps(acc[i][t], vscale));
}

template <int kD, int kQ, int kCount = keys_per_tile(kQ)>
inline void score_tile_keys(int count, const int32_t* qt, int qt_stride, const uint16_t* const* keys, float* st,
                            int st_stride, __m512 vscale) {
  if (count == kCount) {
    score_tile<kD, kCount, kQ>(qt, qt_stride, keys, st, st_stride, vscale);
  } else if constexpr (kCount > 1) {
    score_tile_keys<kD, kQ, kCount - 1>(count, qt, qt_stride, keys, st, st_stride, vscale);
  }
}

// ot[d * ot_stride + 16 t] (+)= sum over pairs [p_begin, p_end) of (v[2p][d], v[2p+1][d]) .
// (w[2p], w[2p+1]) for kQ vectors of 16 queries and dimensions [d0, d0 + dims_per_tile(kQ)),
// starting from zero when `first`: pp holds the weight pairs (pair p of vector t at pp + p *
// pp_stride + 16 t), vp the values interleaved by key pairs (kD pairs per key pair).

template <int kD, int kQ>
inline void value_tile(const int32_t* pp, int pp_stride, const uint16_t* vp, int p_begin, int p_end, int d0,
                       float* ot, int ot_stride, bool first) {
  constexpr int kDims = dims_per_tile(kQ);
  __m512 acc[kDims][kQ];
  for (int dd = 0; dd < kDims; ++dd)
    for (int t = 0; t < kQ; ++t)
      acc[dd][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(ot + (d0 + dd) * ot_stride + 16 * t);
  for (int p = p_begin; p < p_end; ++p) {
    __m512i w[kQ];
    for (int t = 0; t < kQ; ++t) w[t] = _mm512_loadu_si512(pp + static_cast<int64_t>(p) * pp_stride + 16 * t);
    const uint16_t* values = vp + static_cast<int64_t>(p) * kD * 2 + 2 * d0;
    for (int dd = 0; dd < kDims; ++dd) {
      const __m512i v = broadcast_pair(values + 2 * dd);
      for (int t = 0; t < kQ; ++t) acc[dd][t] = dot_pairs(acc[dd][t], v, w[t]);
    }
  }
  for (int dd = 0; dd < kDims; ++dd)
    for (int t = 0; t < kQ; ++t) _mm512_storeu_ps(ot + (d0 + dd) * ot_stride + 16 * t, acc[dd][t]);
}

// Pairs of the values' tile loop taken at a time: their weights and values stay in L1 while every
// tile of dimensions passes over them.
constexpr int kValuePairsPerBlock = 64;

// Scores of kQ vectors of queries (qt, lanes apart per pair) against every key of the chunk into
// st (lanes apart per key). With `values_ahead` (the values' head), each page's values are fetched
// to L2 as its keys are read: the scores are compute bound, and the values' memory latency hides
// under them (one layer, 32 rows behind 992 tokens, one thread: interleaving the values alone, as
// its first touch, measured 60 us of a 450 us call).
template <int kD, int kQ>
void scores_block(const int32_t* qt, int lanes, const uint16_t* k_head, const uint16_t* values_ahead, int page_size,
                  const Chunk& chunk, float* st, __m512 vscale) {
  constexpr int kKeys = keys_per_tile(kQ);
  int page = 0;
  for_each_page(k_head, page_size, kD, chunk, [&](const uint16_t* k_page, int key, int in_page) {
    if (values_ahead != nullptr)
      prefetch_run(values_ahead + static_cast<int64_t>(chunk.pages[page]) * page_size * kD, page_size, kD, 1);
    ++page;
    for (int j = 0; j < in_page; j += kKeys) {
      const int count = std::min(kKeys, in_page - j);
      const uint16_t* keys[kMaxTileKeys];
      for (int i = 0; i < kMaxTileKeys; ++i) keys[i] = k_page + (j + std::min(i, count - 1)) * kD;
      score_tile_keys<kD, kQ>(count, qt, lanes, keys, st + static_cast<int64_t>(key + j) * lanes, lanes, vscale);
    }
  });
}

// ot (lanes apart per dimension) = the weighted sums of kQ vectors of queries' values over all pairs.
template <int kD, int kQ>
void values_block(const int32_t* pp, int lanes, const uint16_t* vp, int num_pairs, float* ot) {
  for (int p0 = 0; p0 < num_pairs; p0 += kValuePairsPerBlock) {
    const int p1 = std::min(num_pairs, p0 + kValuePairsPerBlock);
    for (int d0 = 0; d0 < kD; d0 += dims_per_tile(kQ))
      value_tile<kD, kQ>(pp, lanes, vp, p0, p1, d0, ot, lanes, p0 == 0);
  }
}

// Softmax of one vector of 16 queries down the keys: st holds key k's scores at st[k * lanes],
// pp receives pair p's weights (bfloat16, keys 2p and 2p + 1 side by side in each lane) at
// pp[p * lanes]; vmax and vsum the lanes' max score and sum of weights. kMasked: lane i sees keys
// up to last_key[i] only (a key past it weighs 0; a lane that sees none keeps max -inf, sum 0).
template <bool kMasked>
inline void softmax_lanes(const float* st, int lanes, int num_keys, __m512i last_key, int32_t* pp, __m512& vmax,
                          __m512& vsum) {
  const __m512i pair_order = halves_interleaved();
  auto scores = [&](int key) { return _mm512_loadu_ps(st + static_cast<int64_t>(key) * lanes); };
  auto visible = [&](int key) { return _mm512_cmpge_epi32_mask(last_key, _mm512_set1_epi32(key)); };
  auto weight = [&](int key) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(scores(key), vmax));
    if constexpr (kMasked) return _mm512_maskz_mov_ps(visible(key), e);
    else return e;
  };
  vmax = lanes_max<kMasked>(st, lanes, num_keys, last_key);
  vsum = _mm512_setzero_ps();
  const int num_pairs = (num_keys + 1) / 2;
  for (int p = 0; p < num_pairs; ++p) {
    const __m512 e0 = weight(2 * p);
    const __m512 e1 = 2 * p + 1 < num_keys ? weight(2 * p + 1) : _mm512_setzero_ps();
    vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0's 16, then e1's
    _mm512_storeu_si512(pp + static_cast<int64_t>(p) * lanes, _mm512_permutexvar_epi16(pair_order, both));
  }
}

// The unit: `num_queries` queries (bfloat16 as stored, kD apart; `group` per row) against the
// chunk's keys; each query's partial (m, l, kD sums) to `partials + n * (kD + 2)`. With
// `first_position` >= 0 the rows are consecutive positions from it and each sees only keys up to
// its own position (a query that sees none leaves m = -inf, l = 0). `pair_space` has room for the
// chunk's values interleaved (num_keys + 1 rows of kD).
template <int kD>
void attend_many_pairs(const uint16_t* queries, int num_queries, int group, int first_position, float scale,
                       const uint16_t* k_head, const uint16_t* v_head, int page_size, const Chunk& chunk,
                       uint16_t* pair_space, float* partials) {
  static_assert(kD % 16 == 0, "dimensions are taken in tiles of up to 16 and transposed 16 at a time");
  const int nv = (num_queries + 15) / 16;  // vectors of 16 queries
  const int lanes = nv * 16;
  const int num_keys = chunk.num_keys, num_pairs = (num_keys + 1) / 2;
  static thread_local std::vector<int32_t> qt_space, pp_space;
  static thread_local std::vector<float> st_space, ot_space;
  if (qt_space.size() < static_cast<size_t>(kD / 2) * lanes) qt_space.resize(static_cast<size_t>(kD / 2) * lanes);
  if (st_space.size() < static_cast<size_t>(num_keys) * lanes) st_space.resize(static_cast<size_t>(num_keys) * lanes);
  if (pp_space.size() < static_cast<size_t>(num_pairs) * lanes) pp_space.resize(static_cast<size_t>(num_pairs) * lanes);
  if (ot_space.size() < static_cast<size_t>(kD) * lanes) ot_space.resize(static_cast<size_t>(kD) * lanes);
  int32_t* const qt = qt_space.data();
  float* const st = st_space.data();
  int32_t* const pp = pp_space.data();
  float* const ot = ot_space.data();

  transpose_words(queries, num_queries, kD / 2, qt, lanes);  // q^T: pair e of query n at qt[e * lanes + n]

  // Scores, key by key: st[key * lanes + n]; the vectors of queries in blocks of at most
  // kMaxVectors, as even as can be (5 vectors: 3 + 2, not 4 + 1).
  const __m512 vscale = _mm512_set1_ps(scale);
  const VectorBlocks blocks(nv);
  for (int b = 0; b < blocks.count; ++b) {
    const int v0 = blocks.first(b);
    with_vectors(blocks.size(b), [&](auto count) {
      scores_block<kD, decltype(count)::value>(qt + 16 * v0, lanes, k_head, b == 0 ? v_head : nullptr, page_size,
                                               chunk, st + 16 * v0, vscale);
    });
  }
  // The values, fetched to L2 while the first block's scores were computed, as key pairs.
  interleave_values<kD>(v_head, page_size, chunk, pair_space);

  // Softmax down each lane, a vector of queries at a time. The weights multiply V rounded to
  // bfloat16, as in every other path; the sum l keeps them unrounded.
  for (int v = 0; v < nv; ++v) {
    const __m512i last_key = last_visible_keys(v, num_queries, group, first_position, chunk);
    __m512 vmax, vsum;
    if (sees_every_key(first_position, chunk))
      softmax_lanes<false>(st + 16 * v, lanes, num_keys, last_key, pp + 16 * v, vmax, vsum);
    else
      softmax_lanes<true>(st + 16 * v, lanes, num_keys, last_key, pp + 16 * v, vmax, vsum);
    store_max_and_sum(vmax, vsum, v, num_queries, kD, partials);
  }

  // Weighted sums of the values: ot[d * lanes + n], then into each query's partial.
  for (int b = 0; b < blocks.count; ++b) {
    const int v0 = blocks.first(b);
    with_vectors(blocks.size(b), [&](auto count) {
      values_block<kD, decltype(count)::value>(pp + 16 * v0, lanes, pair_space, num_pairs, ot + 16 * v0);
    });
  }
  sums_to_partials<kD>(ot, lanes, num_queries, partials);
}

#endif  // __AVX512BF16__

}  // namespace radix
