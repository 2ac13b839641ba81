// What the units with the queries across the lanes (attention_many.h in bfloat16,
// attention_many_f32.h in float32) share: 16 queries per vector, tiles of keys or dimensions
// against a few such vectors, the blocks those vectors go in, each lane's softmax totals, and the
// transposition of the weighted sums back to one row per query.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "page_walk.h"
#include "vector_math.h"

namespace radix {

// Most keys a score tile takes.
constexpr int kMaxTileKeys = 8;

// Keys per score tile for kQ vectors of queries: up to 24 sums in registers (with the kQ query
// vectors and a broadcast key value, 31 of the 32), and at least 8 where the queries allow, to cover
// the multiply-adds' latency (`vdpbf16ps`, `vfmadd`) at two per cycle.
constexpr int keys_per_tile(int kQ) { return std::min(kMaxTileKeys, 24 / kQ); }

// Dimensions per value tile for kQ vectors of queries (12-24 sums in registers).
constexpr int dims_per_tile(int kQ) { return kQ == 1 ? 16 : kQ <= 3 ? 8 : 4; }

// Vectors of 16 queries taken together by the tiles (their sums and operands fill the registers;
// blocks of 6 measured slower).
constexpr int kMaxVectors = 4;

// f(std::integral_constant<int, count>{}) for a count of query vectors in [1, kMaxVectors].
template <typename F>
inline void with_vectors(int count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}
static_assert(kMaxVectors == 4, "with_vectors covers 1 to 4");

// The unit's query vectors in blocks of at most kMaxVectors, as even as can be (5 vectors: 3 + 2,
// not 4 + 1).
struct VectorBlocks {
  explicit VectorBlocks(int num_vectors)
      : vectors(num_vectors), count((num_vectors + kMaxVectors - 1) / kMaxVectors) {}
  int first(int b) const { return vectors * b / count; }
  int size(int b) const { return first(b + 1) - first(b); }
  int vectors, count;
};

// Rows of `words` 32-bit words (a unit's queries: float32 values, or bfloat16 pairs) transposed:
// word e of row n at out[e * lanes + n], lanes past the last row zero.
inline void transpose_words(const void* rows, int num_rows, int words, void* out_words, int lanes) {
  auto* out = static_cast<int32_t*>(out_words);
  for (int v = 0; v * 16 < num_rows; ++v) {
    const __m512i firsts = _mm512_mullo_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(16 * v), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        _mm512_set1_epi32(words));
    const __mmask16 present = lanes_from(num_rows - 16 * v);
    for (int e = 0; e < words; ++e)
      _mm512_storeu_si512(out + static_cast<int64_t>(e) * lanes + 16 * v,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present,
                                                      _mm512_add_epi32(firsts, _mm512_set1_epi32(e)), rows, 4));
  }
}

// Whether every query of the unit sees every key of the chunk (decode rows always; prefill rows
// whose first position is at or past the chunk's last key).
inline bool sees_every_key(int first_position, const Chunk& chunk) {
  return first_position < 0 || first_position - chunk.first_key >= chunk.num_keys - 1;
}

// The lanes' max score down the keys (st: key k's scores at st[k * lanes]); kMasked: lane i
// counts keys up to last_key[i] only (a lane that sees none keeps -inf).
template <bool kMasked>
inline __m512 lanes_max(const float* st, int lanes, int num_keys, __m512i last_key) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int key = 0; key < num_keys; ++key) {
    const __m512 scores = _mm512_loadu_ps(st + static_cast<int64_t>(key) * lanes);
    if constexpr (kMasked) vmax = _mm512_mask_max_ps(vmax, _mm512_cmpge_epi32_mask(last_key, _mm512_set1_epi32(key)), vmax, scores);
    else vmax = _mm512_max_ps(vmax, scores);
  }
  return vmax;
}

// The last key each lane of query vector v may see, as a chunk index: every key, or with
// `first_position` >= 0 (prefill rows, `group` queries per position) each query's own position.
inline __m512i last_visible_keys(int v, int num_queries, int group, int first_position, const Chunk& chunk) {
  if (first_position < 0) return _mm512_set1_epi32(chunk.num_keys - 1);
  alignas(64) int32_t last[16];
  for (int i = 0; i < 16; ++i) {
    const int n = std::min(v * 16 + i, num_queries - 1);
    last[i] = std::min(first_position + n / group - chunk.first_key, chunk.num_keys - 1);
  }
  return _mm512_load_si512(last);
}

// Query vector v's lanes' softmax max and sum into their partials (m, l, head_dim sums each).
inline void store_max_and_sum(__m512 vmax, __m512 vsum, int v, int num_queries, int head_dim, float* partials) {
  alignas(64) float m_out[16], l_out[16];
  _mm512_store_ps(m_out, vmax);
  _mm512_store_ps(l_out, vsum);
  for (int i = 0; i < 16 && v * 16 + i < num_queries; ++i) {
    float* out = partials + static_cast<int64_t>(v * 16 + i) * (head_dim + 2);
    out[0] = m_out[i];
    out[1] = l_out[i];
  }
}

// c[i][j] = r[j][i] for 16 x 16 floats: pairs of rows interleaved, then fours, then the 128-bit
// blocks gathered across (64 shuffles).
inline void transpose16(const __m512 (&r)[16], __m512 (&c)[16]) {
  __m512 t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    u[4 * k + 0] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int q = 0; q < 4; ++q) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[q], u[4 + q], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 x1 = _mm512_shuffle_f32x4(u[q], u[4 + q], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(3, 1, 3, 1));
    c[q] = _mm512_shuffle_f32x4(x0, y0, _MM_SHUFFLE(2, 0, 2, 0));
    c[4 + q] = _mm512_shuffle_f32x4(x1, y1, _MM_SHUFFLE(2, 0, 2, 0));
    c[8 + q] = _mm512_shuffle_f32x4(x0, y0, _MM_SHUFFLE(3, 1, 3, 1));
    c[12 + q] = _mm512_shuffle_f32x4(x1, y1, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The weighted sums ot[d * lanes + n] into each query's partial, 16 queries x 16 dimensions at a
// time, transposed in registers.
template <int kD>
void sums_to_partials(const float* ot, int lanes, int num_queries, float* partials) {
  for (int v = 0; v * 16 < num_queries; ++v) {
    const int present = std::min(16, num_queries - 16 * v);
    for (int d0 = 0; d0 < kD; d0 += 16) {
      __m512 dims[16], rows[16];
      for (int j = 0; j < 16; ++j) dims[j] = _mm512_loadu_ps(ot + static_cast<int64_t>(d0 + j) * lanes + 16 * v);
      transpose16(dims, rows);
      for (int i = 0; i < present; ++i)
        _mm512_storeu_ps(partials + static_cast<int64_t>(16 * v + i) * (kD + 2) + 2 + d0, rows[i]);
    }
  }
}

}  // namespace radix
