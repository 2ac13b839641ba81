// One work unit of the paged attention kernel (paged_attention.cpp): the queries of one segment
// (a decode row, a shared prefix's group, a prefill tile) against one KV head's keys of one chunk
// of its pages, leaving each query's partial softmax (max, sum of weights, weighted sum of values).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_many.h"
#include "attention_many_f32.h"
#include "attention_pairs.h"
#include "page_walk.h"
#include "vector_math.h"

namespace radix {

// ---- one work unit ------------------------------------------------------------------------------

// Partial result of one query over one chunk: m, l, then head_dim sums.
inline int partial_floats(int head_dim) { return head_dim + 2; }

// A unit with at least this many queries (a shared prefix's group, a prefill tile) is a small
// matrix product with the queries across the lanes: bfloat16 pairs with AVX512-BF16
// (attention_many.h), float32 arithmetic for float32 and float16 (attention_many_f32.h);
// otherwise (bfloat16 without AVX512-BF16) 16 keys at a time against transposed keys. Fewer queries (a decode row's own keys) read
// the rows as they lie: in bfloat16 with AVX512-BF16, pair products summed 16 keys at once
// (attention_pairs.h), otherwise one dot product per key and query.
constexpr int kManyQueries = 8;

// scores[i * stride + key] = q_i . k_key for every query and key of the chunk, 16 keys at a time:
// each run of 16 keys is converted and transposed once (kt[d] holds dimension d of the 16 keys),
// then every query's 16 scores are kD broadcast FMAs, with no horizontal sums.
template <int kDtype, int kD>
void scores_transposed(const float* queries, int num_queries, const typename Elem<kDtype>::type* k_head,
                       int page_size, const Chunk& chunk, float* scores, int stride) {
  constexpr int kV = kD / 16;
  alignas(64) float rows[16 * kD];
  alignas(64) float kt[kD * 16];
  const __m512i row_starts = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kD));
  for_each_page(k_head, page_size, kD, chunk, [&](const auto* k_page, int key, int in_page) {
    for (int j0 = 0; j0 < in_page; j0 += 16) {
      const int n = std::min(16, in_page - j0);
      for (int j = 0; j < 16; ++j)
        for (int t = 0; t < kV; ++t)
          _mm512_store_ps(rows + j * kD + 16 * t,
                          j < n ? load_vec<kDtype>(k_page + (j0 + j) * kD + 16 * t) : _mm512_setzero_ps());
      for (int d = 0; d < kD; ++d) _mm512_store_ps(kt + 16 * d, _mm512_i32gather_ps(row_starts, rows + d, 4));
      const __mmask16 lanes = lanes_from(n);
      // Eight queries at a time: each transposed key vector is loaded once for all eight, and
      // each query value is a broadcast operand of its FMA.
      int i = 0;
      for (; i + 8 <= num_queries; i += 8) {
        __m512 acc[8];
        for (int b = 0; b < 8; ++b) acc[b] = _mm512_setzero_ps();
        for (int d = 0; d < kD; ++d) {
          const __m512 column = _mm512_load_ps(kt + 16 * d);
          for (int b = 0; b < 8; ++b)
            acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(queries[(i + b) * kD + d]), column, acc[b]);
        }
        for (int b = 0; b < 8; ++b) _mm512_mask_storeu_ps(scores + (i + b) * stride + key + j0, lanes, acc[b]);
      }
      for (; i < num_queries; ++i) {
        const float* qi = queries + i * kD;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int d = 0; d < kD; d += 4)
          for (int u = 0; u < 4; ++u)
            acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(qi[d + u]), _mm512_load_ps(kt + 16 * (d + u)), acc[u]);
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_mask_storeu_ps(scores + i * stride + key + j0, lanes, sum);
      }
    }
  });
}


// Queries `queries` ([num_queries][kD] float32, already scaled; `group` per row) against one kv
// head's keys of `chunk`; writes each query's partial to `partials + i * (kD + 2)`. A bfloat16
// unit of many queries on a CPU with AVX512-BF16 reads `raw_queries` (q as stored, unscaled) and
// `scale` instead, and interleaves the chunk's values into `pair_space` (num_keys + 1 rows of kD); a
// bfloat16 unit of few queries reads `raw_queries` too when the head size is whole words. With
// `first_position` >= 0 the rows are consecutive positions from it (a prefill span) and each sees
// only keys up to its own position; a query that sees none of the chunk leaves m = -inf, l = 0.
// `scores` has room for max(kBlock, num_queries) * padded num_keys floats.
template <int kDtype, int kD, int kBlock>
void attend_chunk(const float* queries, const uint16_t* raw_queries, float scale, int num_queries, int group,
                  int first_position, const typename Elem<kDtype>::type* k_head,
                  const typename Elem<kDtype>::type* v_head, int page_size, const Chunk& chunk, float* all_scores,
                  uint16_t* pair_space, float* partials) {
  constexpr int kV = kD / 16;
  const int stride = (chunk.num_keys + 15) & ~15;
  const bool many = num_queries >= kManyQueries;
  for (int p = 0; p < std::min(kPrefetchPages, chunk.num_pages); ++p)  // the loops fetch the rest ahead
    prefetch_run(k_head + static_cast<int64_t>(chunk.pages[p]) * page_size * kD, page_size, kD, 0);
#ifdef __AVX512BF16__
  if constexpr (kDtype == kBFloat16) {
    if (many) {
      attend_many_pairs<kD>(raw_queries, num_queries, group, first_position, scale, k_head, v_head, page_size, chunk,
                            pair_space, partials);
      return;
    }
  }
#endif
  if constexpr (kDtype == kFloat32 || kDtype == kFloat16) {
    if (many) {
      attend_many_f32<kDtype, kD>(queries, num_queries, group, first_position, k_head, v_head, page_size, chunk,
                                  partials);
      return;
    }
  }
  if (many)  // (bfloat16 without AVX512-BF16: the other units went to their own paths above)
    scores_transposed<kDtype, kD>(queries, num_queries, k_head, page_size, chunk, all_scores, stride);
  for (int q0 = 0; q0 < num_queries; q0 += kBlock) {
    const int nb = std::min(kBlock, num_queries - q0);
    float* scores = many ? all_scores + q0 * stride : all_scores;  // this block's rows
    bool rows_paired = false;  // few bfloat16 queries: pair products on the rows as they lie
#ifdef __AVX512BF16__
    if constexpr (kDtype == kBFloat16 && kRowPairs<kD>) {
      if (!many) {
        scores_rows_pairs<kD>(raw_queries + q0 * kD, nb, scale, k_head, v_head, q0 == 0, page_size, chunk, scores,
                              stride);
        rows_paired = true;
      }
    }
#endif
    if (!many && !rows_paired) {  // scores = q . k for every key of the chunk, one dot product each
      __m512 qv[kBlock][kV];
      for (int b = 0; b < kBlock; ++b)
        for (int t = 0; t < kV; ++t)
          qv[b][t] = b < nb ? _mm512_loadu_ps(queries + (q0 + b) * kD + 16 * t) : _mm512_setzero_ps();
      int p = 0;
      for_each_page(k_head, page_size, kD, chunk, [&](const auto* k_page, int key, int in_page) {
        if (q0 == 0)  // values are read right after, by every block: bring them to L2 now
          prefetch_run(v_head + static_cast<int64_t>(chunk.pages[p]) * page_size * kD, page_size, kD, 1);
        ++p;
        for (int j = 0; j < in_page; ++j) {
          __m512 kv[kV];
          for (int t = 0; t < kV; ++t) kv[t] = load_vec<kDtype>(k_page + j * kD + 16 * t);
          for (int b = 0; b < nb; ++b) {
            __m512 acc = _mm512_mul_ps(qv[b][0], kv[0]);
            for (int t = 1; t < kV; ++t) acc = _mm512_fmadd_ps(qv[b][t], kv[t], acc);
            scores[b * stride + key + j] = _mm512_reduce_add_ps(acc);
          }
        }
      });
    }

    // softmax pieces per query: m = max, p = exp(s - m) in place, l = sum p; keys a query may
    // not see get p = 0
    float m[kBlock], l[kBlock];
    for (int b = 0; b < nb; ++b) {
      float* s = scores + b * stride;
      int num_keys = chunk.num_keys;
      if (first_position >= 0) {
        const int position = first_position + (q0 + b) / group;
        num_keys = std::clamp(position - chunk.first_key + 1, 0, chunk.num_keys);
        std::fill(s + num_keys, s + chunk.num_keys, 0.0f);
        if (num_keys == 0) {
          m[b] = -INFINITY;
          l[b] = 0.0f;
          continue;
        }
      }
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      int i = 0;
      for (; i + 16 <= num_keys; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
      const __mmask16 tail = lanes_from(num_keys - i);  // i + 16 > num_keys here: 0 when none are left
      if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + i));
      m[b] = _mm512_reduce_max_ps(vmax);
      const __m512 vm = _mm512_set1_ps(m[b]);
      // The weights multiply V in the pool's precision, as PyTorch's flash kernel (the torch path,
      // and transformers' reference) does: stored rounded; the sum l keeps them unrounded, as it does.
      __m512 vsum = _mm512_setzero_ps();
      for (i = 0; i + 16 <= num_keys; i += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
        _mm512_storeu_ps(s + i, round_to<kDtype>(e));
        vsum = _mm512_add_ps(vsum, e);
      }
      if (tail) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), vm));
        e = _mm512_maskz_mov_ps(tail, e);
        _mm512_mask_storeu_ps(s + i, tail, round_to<kDtype>(e));
        vsum = _mm512_add_ps(vsum, e);
      }
      l[b] = _mm512_reduce_add_ps(vsum);
    }

    // acc = sum p * v
    __m512 acc[kBlock][kV];
    for (int b = 0; b < kBlock; ++b)
      for (int t = 0; t < kV; ++t) acc[b][t] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    if constexpr (kDtype == kBFloat16) {
      if (rows_paired) {  // the weights as bfloat16, in place of each query's scores
        // Each query's halves go to the front of its own row of scores, over floats already read.
        auto* weights = reinterpret_cast<uint16_t*>(scores);
        const int weight_stride = 2 * stride;
        for (int b = 0; b < nb; ++b) {
          uint16_t* to = weights + b * weight_stride;
          for (int i = 0; i < stride; i += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i), narrow<kBFloat16>(_mm512_loadu_ps(scores + b * stride + i)));
          to[stride] = 0;  // keys from num_keys to stride are zero already; see values_rows_pairs
        }
        values_rows_pairs<kD, kBlock>(weights, nb, weight_stride, v_head, page_size, chunk, acc);
        for (int b = 0; b < nb; ++b) rows_pairs_in_order<kD>(acc[b]);
      }
    }
#endif
    if (!rows_paired)
      for_each_page(v_head, page_size, kD, chunk, [&](const auto* v_page, int key, int in_page) {
        for (int j = 0; j < in_page; ++j) {
          __m512 vv[kV];
          for (int t = 0; t < kV; ++t) vv[t] = load_vec<kDtype>(v_page + j * kD + 16 * t);
          for (int b = 0; b < nb; ++b) {
            const __m512 w = _mm512_set1_ps(scores[b * stride + key + j]);
            for (int t = 0; t < kV; ++t) acc[b][t] = _mm512_fmadd_ps(w, vv[t], acc[b][t]);
          }
        }
      });
    for (int b = 0; b < nb; ++b) {
      float* out = partials + (q0 + b) * (kD + 2);
      out[0] = m[b];
      out[1] = l[b];
      for (int t = 0; t < kV; ++t) _mm512_storeu_ps(out + 2 + 16 * t, acc[b][t]);
    }
  }
}

}  // namespace radix
