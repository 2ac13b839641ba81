// A unit of many queries (a shared prefix's group, a prefill tile) in float32 arithmetic, for a
// float32 or float16 pool, in the layout of attention_many.h: 16 queries per vector, so a key's or
// a value's dimension enters as a broadcast operand read where it lies in the pool (a float16 one
// widened first), one fused multiply-add per lane (bfloat16 takes two per lane as pairs), with
// nothing gathered or transposed per key. The queries are transposed once per
// unit, the softmax runs down each lane, and the values are read page by page as they lie.
//
// It replaced, for float32, 16 keys gathered and transposed per pass with each query broadcast
// (`scores_transposed`), then the values in blocks of four queries: one layer, 2 threads
// (bench_attention's shapes in float32), 32 rows behind a 992-token prefix 536 -> 444-452 us, 31
// prompts of 25 tokens behind 944 cached 8,756 -> 5,754-5,798 us. Splitting each key's dot product
// or each dimension's weighted sum into two chains measured slower (fewer keys or dimensions per
// tile: 539-673 and 7,447-11,542 us) and no more accurate.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_lanes.h"
#include "page_walk.h"
#include "vector_math.h"

namespace radix {

// Scores of kK keys (rows `keys[i]`) against kQ vectors of 16 queries (already scaled):
// st[i * st_stride + 16 t] = q . k. Dimension d of the 16 queries of vector t is at qt + d *
// qt_stride + 16 t.
template <int kDtype, int kD, int kK, int kQ>
inline void score_tile_f32(const float* qt, int qt_stride, const typename Elem<kDtype>::type* const* keys, float* st,
                           int st_stride) {
  __m512 acc[kK][kQ];
  for (int i = 0; i < kK; ++i)
    for (int t = 0; t < kQ; ++t) acc[i][t] = _mm512_setzero_ps();
  for (int d = 0; d < kD; ++d) {
    __m512 q[kQ];
    for (int t = 0; t < kQ; ++t) q[t] = _mm512_loadu_ps(qt + d * qt_stride + 16 * t);
    for (int i = 0; i < kK; ++i) {
      const __m512 k = _mm512_set1_ps(to_float<kDtype>(keys[i][d]));
      for (int t = 0; t < kQ; ++t) acc[i][t] = _mm512_fmadd_ps(q[t], k, acc[i][t]);
    }
  }
  for (int i = 0; i < kK; ++i)
    for (int t = 0; t < kQ; ++t) _mm512_storeu_ps(st + i * st_stride + 16 * t, acc[i][t]);
}

template <int kDtype, int kD, int kQ, int kCount = keys_per_tile(kQ)>
inline void score_tile_keys_f32(int count, const float* qt, int qt_stride, const typename Elem<kDtype>::type* const* keys,
                                float* st, int st_stride) {
  if (count == kCount) {
    score_tile_f32<kDtype, kD, kCount, kQ>(qt, qt_stride, keys, st, st_stride);
  } else if constexpr (kCount > 1) {
    score_tile_keys_f32<kDtype, kD, kQ, kCount - 1>(count, qt, qt_stride, keys, st, st_stride);
  }
}

// Scores of kQ vectors of queries (qt, lanes apart per dimension) against every key of the chunk
// into st (lanes apart per key); with `values_ahead`, each page's values are fetched to L2 as its
// keys are read (as in attention_many.h).
template <int kDtype, int kD, int kQ>
void scores_block_f32(const float* qt, int lanes, const typename Elem<kDtype>::type* k_head,
                      const typename Elem<kDtype>::type* values_ahead, int page_size, const Chunk& chunk, float* st) {
  constexpr int kKeys = keys_per_tile(kQ);
  int page = 0;
  for_each_page(k_head, page_size, kD, chunk, [&](const auto* k_page, int key, int in_page) {
    if (values_ahead != nullptr)
      prefetch_run(values_ahead + static_cast<int64_t>(chunk.pages[page]) * page_size * kD, page_size, kD, 1);
    ++page;
    for (int j = 0; j < in_page; j += kKeys) {
      const int count = std::min(kKeys, in_page - j);
      const typename Elem<kDtype>::type* keys[kMaxTileKeys];
      for (int i = 0; i < kMaxTileKeys; ++i) keys[i] = k_page + (j + std::min(i, count - 1)) * kD;
      score_tile_keys_f32<kDtype, kD, kQ>(count, qt, lanes, keys, st + static_cast<int64_t>(key + j) * lanes, lanes);
    }
  });
}

// ot[d * ot_stride + 16 t] (+)= sum over the page's `keys` keys of w[key] * v[key][d], for kQ
// vectors of 16 queries and dimensions [d0, d0 + dims_per_tile(kQ)), from zero when `first`:
// weights of key j for vector t at pw + j * pw_stride + 16 t.
template <int kDtype, int kD, int kQ>
inline void value_tile_f32(const float* pw, int pw_stride, const typename Elem<kDtype>::type* v_page, int keys, int d0,
                           float* ot, int ot_stride, bool first) {
  constexpr int kDims = dims_per_tile(kQ);
  __m512 acc[kDims][kQ];
  for (int dd = 0; dd < kDims; ++dd)
    for (int t = 0; t < kQ; ++t)
      acc[dd][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(ot + (d0 + dd) * ot_stride + 16 * t);
  for (int j = 0; j < keys; ++j) {
    __m512 w[kQ];
    for (int t = 0; t < kQ; ++t) w[t] = _mm512_loadu_ps(pw + static_cast<int64_t>(j) * pw_stride + 16 * t);
    const auto* values = v_page + j * kD + d0;
    for (int dd = 0; dd < kDims; ++dd) {
      const __m512 v = _mm512_set1_ps(to_float<kDtype>(values[dd]));
      for (int t = 0; t < kQ; ++t) acc[dd][t] = _mm512_fmadd_ps(w[t], v, acc[dd][t]);
    }
  }
  for (int dd = 0; dd < kDims; ++dd)
    for (int t = 0; t < kQ; ++t) _mm512_storeu_ps(ot + (d0 + dd) * ot_stride + 16 * t, acc[dd][t]);
}

// ot (lanes apart per dimension) = the weighted sums of kQ vectors of queries' values over the
// chunk, a page at a time: its weights and values stay in L1 while every tile of dimensions passes.
template <int kDtype, int kD, int kQ>
void values_block_f32(const float* pw, int lanes, const typename Elem<kDtype>::type* v_head, int page_size,
                      const Chunk& chunk, float* ot) {
  for_each_page(v_head, page_size, kD, chunk, [&](const auto* v_page, int key, int in_page) {
    for (int d0 = 0; d0 < kD; d0 += dims_per_tile(kQ))
      value_tile_f32<kDtype, kD, kQ>(pw + static_cast<int64_t>(key) * lanes, lanes, v_page, in_page, d0, ot, lanes, key == 0);
  });
}

// Softmax of one vector of 16 queries down the keys, in place: st holds key k's scores at
// st[k * lanes] and receives their weights exp(s - max); vmax and vsum the lanes' max score and
// sum of weights. kMasked: lane i sees keys up to last_key[i] only (a key past it weighs 0; a
// lane that sees none keeps max -inf, sum 0).
template <int kDtype, bool kMasked>
inline void softmax_lanes_f32(float* st, int lanes, int num_keys, __m512i last_key, __m512& vmax, __m512& vsum) {
  auto scores = [&](int key) { return _mm512_loadu_ps(st + static_cast<int64_t>(key) * lanes); };
  auto visible = [&](int key) { return _mm512_cmpge_epi32_mask(last_key, _mm512_set1_epi32(key)); };
  vmax = lanes_max<kMasked>(st, lanes, num_keys, last_key);
  // Four running sums, key by key in turn: a thousand keys in one chain would lose float32 precision.
  __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int key = 0; key < num_keys; ++key) {
    __m512 e = exp_nonpositive(_mm512_sub_ps(scores(key), vmax));
    if constexpr (kMasked) e = _mm512_maskz_mov_ps(visible(key), e);
    sums[key % 4] = _mm512_add_ps(sums[key % 4], e);
    // The weights multiply V in the pool's precision, as in every other path (float32: as they are).
    _mm512_storeu_ps(st + static_cast<int64_t>(key) * lanes, round_to<kDtype>(e));
  }
  vsum = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
}

// The unit: `num_queries` queries (float32, already scaled, kD apart; `group` per row) against
// the chunk's keys; each query's partial (m, l, kD sums) to `partials + n * (kD + 2)`. With
// `first_position` >= 0 the rows are consecutive positions from it and each sees only keys up to
// its own position (a query that sees none leaves m = -inf, l = 0).
template <int kDtype, int kD>
void attend_many_f32(const float* queries, int num_queries, int group, int first_position,
                     const typename Elem<kDtype>::type* k_head, const typename Elem<kDtype>::type* v_head, int page_size,
                     const Chunk& chunk, float* partials) {
  static_assert(kD % 16 == 0, "dimensions are transposed 16 at a time");
  const int nv = (num_queries + 15) / 16;  // vectors of 16 queries
  const int lanes = nv * 16;
  const int num_keys = chunk.num_keys;
  static thread_local std::vector<float> qt_space, st_space, ot_space;
  if (qt_space.size() < static_cast<size_t>(kD) * lanes) qt_space.resize(static_cast<size_t>(kD) * lanes);
  if (st_space.size() < static_cast<size_t>(num_keys) * lanes) st_space.resize(static_cast<size_t>(num_keys) * lanes);
  if (ot_space.size() < static_cast<size_t>(kD) * lanes) ot_space.resize(static_cast<size_t>(kD) * lanes);
  float* const qt = qt_space.data();
  float* const st = st_space.data();
  float* const ot = ot_space.data();

  transpose_words(queries, num_queries, kD, qt, lanes);  // q^T: dimension d of query n at qt[d * lanes + n]

  const VectorBlocks blocks(nv);
  for (int b = 0; b < blocks.count; ++b) {
    const int v0 = blocks.first(b);
    with_vectors(blocks.size(b), [&](auto count) {
      scores_block_f32<kDtype, kD, decltype(count)::value>(qt + 16 * v0, lanes, k_head, b == 0 ? v_head : nullptr, page_size,
                                                   chunk, st + 16 * v0);
    });
  }
  for (int v = 0; v < nv; ++v) {
    const __m512i last_key = last_visible_keys(v, num_queries, group, first_position, chunk);
    __m512 vmax, vsum;
    if (sees_every_key(first_position, chunk))
      softmax_lanes_f32<kDtype, false>(st + 16 * v, lanes, num_keys, last_key, vmax, vsum);
    else
      softmax_lanes_f32<kDtype, true>(st + 16 * v, lanes, num_keys, last_key, vmax, vsum);
    store_max_and_sum(vmax, vsum, v, num_queries, kD, partials);
  }
  for (int b = 0; b < blocks.count; ++b) {
    const int v0 = blocks.first(b);
    with_vectors(blocks.size(b), [&](auto count) {
      values_block_f32<kDtype, kD, decltype(count)::value>(st + 16 * v0, lanes, v_head, page_size, chunk, ot + 16 * v0);
    });
  }
  sums_to_partials<kD>(ot, lanes, num_queries, partials);
}

}  // namespace radix
