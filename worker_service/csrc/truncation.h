// top_k and top_p for the sampling kernel (sample.cpp): the key of the last token they keep, found by
// selection, never by sorting every candidate. Rows with few candidates (a peaked distribution)
// rank the tokens above a level counted while the exponentials were made; rows with many (a flat
// one) take a histogram of the weights' top bits and rank only the bucket that holds the cut.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "vector_math.h"

namespace radix {

// Candidate levels: a token is a candidate at level L when its tempered logit is at most kLevels[L]
// below the best one's (its probability at least exp(kLevels[L]) times the best's). Each level's
// count and mass are summed while the exponentials are made; the highest level holding the top_k
// tokens (or, without top_k, top_p of the mass) bounds the ranking. Below the last: every token.
constexpr int kNumLevels = 4;
constexpr float kLevels[kNumLevels] = {-3.0f, -7.0f, -13.0f, -24.0f};
// Candidates left to rank at which the mass selection sorts them instead of partitioning again.
constexpr size_t kSortBelow = 32;

struct RowParams {
  float temperature;
  int32_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  double uniform;  // in [0, 1)
};

// A candidate's key: its weight's bits above (positive floats order as their bits), its index
// inverted below, so a larger key is a likelier token, or as likely with a lower index. Keys are
// distinct, so "the tokens top_k and top_p keep" is "the keys at or above the last kept one's".
inline uint64_t rank_key(float weight, int index) {
  uint32_t bits;
  std::memcpy(&bits, &weight, sizeof bits);
  return (uint64_t{bits} << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(index));
}
inline float key_weight(uint64_t key) {
  const uint32_t bits = static_cast<uint32_t>(key >> 32);
  float weight;
  std::memcpy(&weight, &bits, sizeof weight);
  return weight;
}
inline int32_t key_index(uint64_t key) { return static_cast<int32_t>(~static_cast<uint32_t>(key)); }

// Among keys[0, n) (in any order), the key of the token that brings the mass of it and the likelier
// ones to `limit` (top_p: keep a token while the likelier ones hold less); false if all n together
// stay below it. A selection by mass, no sort of the whole: partition around a pivot, go on in
// the side that holds the answer, sort the last few.
inline bool mass_cut(uint64_t* keys, size_t n, double limit, uint64_t* cut) {
  size_t lo = 0, hi = n;
  double above = 0.0;  // the mass of keys[0, lo), all likelier than keys[lo, n)
  while (hi - lo > kSortBelow) {
    const uint64_t a = keys[lo], b = keys[lo + (hi - lo) / 2], c = keys[hi - 1];
    const uint64_t pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
    uint64_t* mid = std::partition(keys + lo, keys + hi, [pivot](uint64_t key) { return key > pivot; });
    std::iter_swap(mid, std::find(mid, keys + hi, pivot));  // the pivot right after the likelier ones
    double upper = 0.0;
    for (const uint64_t* key = keys + lo; key < mid; ++key) upper += key_weight(*key);
    const size_t at = mid - keys;
    if (above + upper >= limit) {
      hi = at;  // within the likelier ones (never empty here: above < limit)
      continue;
    }
    above += upper + key_weight(pivot);
    if (above >= limit) {
      *cut = pivot;
      return true;
    }
    lo = at + 1;
  }
  std::sort(keys + lo, keys + hi, std::greater<uint64_t>());
  for (size_t r = lo; r < hi; ++r) {
    above += key_weight(keys[r]);
    if (above >= limit) {
      *cut = keys[r];
      return true;
    }
  }
  if (hi < n && hi > lo) {  // summed in another order than when this part was chosen: its last
    *cut = keys[hi - 1];
    return true;
  }
  return false;
}

// The key of the last token top_k and top_p keep, ranking the candidates from `level` on.
inline uint64_t rank_cut(const float* weights, int cols, const RowParams& params, double total, int level,
                         std::vector<uint64_t>& keys) {
  const bool by_count = params.top_k > 0 && params.top_k < cols;
  for (;; ++level) {
    const float floor = level < kNumLevels ? std::exp(kLevels[level]) : 0.0f;
    const __m512 floor_v = _mm512_set1_ps(floor);
    keys.clear();
    for (int i = 0; i < cols; i += 16) {
      const __mmask16 lanes = lanes_from(cols - i);
      const __m512 w = _mm512_maskz_loadu_ps(lanes, weights + i);
      const __mmask16 in = _mm512_mask_cmp_ps_mask(lanes, w, floor_v, _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
      for (unsigned bits = in; bits; bits &= bits - 1) {
        const int index = i + __builtin_ctz(bits);
        keys.push_back(rank_key(weights[index], index));
      }
    }
    uint64_t* const k = keys.data();
    size_t ranked = keys.size();
    if (by_count && ranked > static_cast<size_t>(params.top_k)) {  // the top_k likeliest first, unsorted
      ranked = params.top_k;
      std::nth_element(k, k + (ranked - 1), k + keys.size(), std::greater<uint64_t>());
    }
    const uint64_t least = *std::min_element(k, k + ranked);
    if (params.top_p >= 1.0f) return least;
    // top_p of the top_k tokens' mass (of every token's without top_k).
    double normaliser = total;
    if (by_count) {
      normaliser = 0.0;
      for (size_t r = 0; r < ranked; ++r) normaliser += key_weight(k[r]);
    }
    uint64_t cut;
    if (mass_cut(k, ranked, double{params.top_p} * normaliser, &cut)) return cut;
    // Rounding can leave a level's candidates just short of the mass counted for it: rank more.
    if (!by_count && level < kNumLevels) continue;
    return least;
  }
}

// ---- many candidates: a histogram of the weights ----------------------------------------------

// Weights are in (0, 1] (the best token's is 1): their top 11 bits (exponent and 3 mantissa bits,
// buckets a factor 2^(1/8) wide) are below 1,017.
constexpr int kBuckets = 1024;

struct Histogram {
  int32_t count[kBuckets];
  double mass[kBuckets];
};

inline int bucket_of(float weight) {
  uint32_t bits;
  std::memcpy(&bits, &weight, sizeof bits);
  return std::min<int>(static_cast<int>(bits >> 20), kBuckets - 1);
}

inline void fill_histogram(const float* weights, int cols, Histogram& h) {
  std::memset(&h, 0, sizeof h);
  for (int i = 0; i < cols; ++i) {
    const float w = weights[i];
    if (w > 0.0f) {
      const int b = bucket_of(w);
      ++h.count[b];
      h.mass[b] += w;
    }
  }
}

// The keys of the positive weights in bucket b.
inline void collect_bucket(const float* weights, int cols, int b, std::vector<uint64_t>& keys) {
  keys.clear();
  const __m512i lo = _mm512_set1_epi32(b << 20);
  const __m512i hi = _mm512_set1_epi32(b == kBuckets - 1 ? INT32_MAX : (b + 1) << 20);
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 w = _mm512_maskz_loadu_ps(lanes, weights + i);
    const __m512i bits = _mm512_castps_si512(w);
    const __mmask16 in = _mm512_mask_cmp_epi32_mask(lanes, bits, lo, _MM_CMPINT_GE) &
                         _mm512_cmp_epi32_mask(bits, hi, _MM_CMPINT_LT) &
                         _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
    for (unsigned set = in; set; set &= set - 1) {
      const int index = i + __builtin_ctz(set);
      keys.push_back(rank_key(weights[index], index));
    }
  }
}

// The key of the last token top_k and top_p keep, for a row with many candidates: one histogram
// pass finds the bucket that holds the cut, and only that bucket's tokens are ranked. 0 keeps
// every positive weight.
inline uint64_t hist_cut(const float* weights, int cols, const RowParams& params, double total, Histogram& h,
                         std::vector<uint64_t>& keys) {
  fill_histogram(weights, cols, h);
  const bool by_count = params.top_k > 0 && params.top_k < cols;
  double limit = double{params.top_p} * total;
  if (by_count) {
    // The bucket that holds the k-th likeliest token, and the likeliest of its tokens up to k.
    int b = kBuckets - 1;
    int64_t count = 0;
    double above = 0.0;
    for (; b > 0 && count + h.count[b] < params.top_k; --b) {
      count += h.count[b];
      above += h.mass[b];
    }
    collect_bucket(weights, cols, b, keys);
    if (keys.empty()) return 0;  // fewer positive weights than top_k: every one
    uint64_t* const k = keys.data();
    const size_t need = std::min<size_t>(params.top_k - count, keys.size());
    std::nth_element(k, k + (need - 1), k + keys.size(), std::greater<uint64_t>());
    const uint64_t kth = *std::min_element(k, k + need);
    if (params.top_p >= 1.0f) return kth;
    double selected = 0.0;
    for (size_t r = 0; r < need; ++r) selected += key_weight(k[r]);
    limit = double{params.top_p} * (above + selected);
    // top_p's cut: in a bucket above b, or among b's selected tokens.
    double mass = 0.0;
    for (int c = kBuckets - 1; c > b; --c) {
      if (h.count[c] && mass + h.mass[c] >= limit) {
        collect_bucket(weights, cols, c, keys);
        uint64_t cut;
        return mass_cut(keys.data(), keys.size(), limit - mass, &cut) ? cut : *std::min_element(keys.begin(), keys.end());
      }
      mass += h.mass[c];
    }
    uint64_t cut;
    return mass_cut(k, need, limit - mass, &cut) ? cut : kth;
  }
  double above = 0.0;
  for (int c = kBuckets - 1; c >= 0; --c) {
    if (h.count[c] == 0) continue;
    if (above + h.mass[c] >= limit) {
      collect_bucket(weights, cols, c, keys);
      uint64_t cut;
      if (mass_cut(keys.data(), keys.size(), limit - above, &cut)) return cut;
      // Summed in another order than the histogram's: just short; the cut is further down.
    }
    above += h.mass[c];
  }
  return 0;
}

}  // namespace radix
