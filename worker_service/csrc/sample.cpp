// Rank 0's sampling kernels over float32 logits (see sampler.py).
//
// Greedy rows: PyTorch's CPU argmax along the last dimension took 457 us for 32 rows of SmolLM2's
// 49,152 logits here (2 threads), where its max alone (`amax`) took 42; this is that max, then the
// first index holding it, 16 lanes at a time. The first index of the maximum on ties, as
// torch.argmax.
//
// Sampled rows: temperature, then top_k, top_p and min_p, then one inverse-CDF draw, the same
// distribution and the same walk as the sampler's torch path (the kept tokens' probabilities summed
// in vocabulary order, the first whose running sum passes uniform * total), where the torch path
// spent ~5 ms on 32 rows in its softmax, topk, masks and cumsum. A row's tempered exponentials are
// computed once into a scratch row; only the tokens that can survive truncation are ranked: the
// candidates are the tokens above the highest of a few levels (relative to the best token) that
// provably holds the top_k tokens or top_p of the mass, counted while the exponentials are made,
// and they are selected (nth_element for top_k, a partition by mass for top_p), never sorted whole
// (truncation.h; rows with many candidates rank only the histogram bucket that holds the cut).
//
// A row holding a NaN or +inf, or nothing but -inf, is left to the caller (the torch path says what
// such a row does), reported per row as -1.

#ifndef __AVX512F__
#error "the sampling kernels need AVX-512"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "logit_rows.h"
#include "truncation.h"
#include "vector_math.h"

namespace {

using namespace radix;

constexpr int64_t kParallelValues = 1 << 16;  // fewer values: one thread, a team costs more

// The row's argmax into *out; false if the row holds a NaN (then *out is not set).
bool argmax_row(const float* x, int cols, int64_t* out) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int i = 0;
  for (; i + 16 <= cols; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  if (i < cols) {
    const __mmask16 tail = lanes_from(cols - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  if (nan) return false;
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  for (i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, x + i), m, _CMP_EQ_OQ);
    if (hit) {
      *out = i + __builtin_ctz(hit);
      return true;
    }
  }
  *out = 0;  // unreachable: the maximum is one of the values
  return true;
}

// ---- sampled rows ------------------------------------------------------------------------------

// Tempered logits further than this below the best get probability 0 (exp would be < 1.7e-38).
constexpr float kLowest = -87.0f;
// Candidates up to which the draw walks the kept ones alone; with more, it walks the whole row.
constexpr size_t kWalkCandidates = 4096;

// Per thread: the row's exponentials, its candidates and the kept ones among them.
struct Scratch {
  std::vector<float> weights;
  std::vector<uint64_t> keys;
  std::vector<int32_t> kept;
  Histogram histogram;
};
thread_local Scratch scratch;

// Adds 16 float lanes into 8 double lanes.
inline __m512d add_wide(__m512d acc, __m512 x) {
  acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
  return _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
}

// Which tokens a row keeps: weight above 0 and at least `min_weight` (min_p), and at or above the
// last token top_k and top_p keep (`last_weight`, `last_index`: the key order; 0 and -1 keep every
// positive weight).
struct Kept {
  __m512 last_weight, min_weight;
  int32_t last_index;

  Kept(float last_weight_, int32_t last_index_, float min_weight_)
      : last_weight(_mm512_set1_ps(last_weight_)), min_weight(_mm512_set1_ps(min_weight_)), last_index(last_index_) {}

  // The kept lanes of weights w, tokens [i, i + 16) (`lanes` of them real).
  __mmask16 lanes_of(__m512 w, int i, __mmask16 lanes) const {
    __mmask16 ranked = _mm512_mask_cmp_ps_mask(lanes, w, last_weight, _CMP_GT_OQ);
    const __mmask16 tied = _mm512_mask_cmp_ps_mask(lanes, w, last_weight, _CMP_EQ_OQ);
    if (tied && last_index >= i) ranked |= tied & lanes_from(last_index - i + 1);  // tied: the lower indices
    return ranked & _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ) &
           _mm512_cmp_ps_mask(w, min_weight, _CMP_GE_OQ);
  }
};

double kept_mass(const float* weights, int cols, const Kept& kept) {
  __m512d acc = _mm512_setzero_pd();
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 w = _mm512_maskz_loadu_ps(lanes, weights + i);
    acc = add_wide(acc, _mm512_maskz_mov_ps(kept.lanes_of(w, i, lanes), w));
  }
  return _mm512_reduce_add_pd(acc);
}

// The first kept token, in vocabulary order (the torch path's cumsum), whose running sum of
// weights passes `target`; the last kept token where rounding leaves the target at the very top.
int32_t walk_to(const float* weights, int cols, const Kept& kept, double target) {
  double cum = 0.0;
  int32_t last = -1;
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 w = _mm512_maskz_loadu_ps(lanes, weights + i);
    const __mmask16 in = kept.lanes_of(w, i, lanes);
    if (!in) continue;
    const double block = _mm512_mask_reduce_add_ps(in, w);
    if (cum + block <= target) {
      cum += block;
      last = i + 31 - __builtin_clz(in);
      continue;
    }
    for (unsigned bits = in; bits; bits &= bits - 1) {
      const int index = i + __builtin_ctz(bits);
      cum += weights[index];
      last = index;
      if (cum > target) return index;
    }
  }
  return last;
}

// The sampled token of one row (temperature > 0), or -1 if the row holds a NaN or +inf or nothing
// above -inf.
int64_t sample_row(const float* x, int cols, const RowParams& params) {
  float best;
  if (!finite_max(x, cols, &best)) return -1;

  // Tempered exponentials relative to the best token (the best's is exactly 1), their sum, and the
  // candidate levels' counts and masses.
  Scratch& s = scratch;
  s.weights.resize(cols);
  float* weights = s.weights.data();
  const __m512 m = _mm512_set1_ps(best);
  const __m512 inv_t = _mm512_set1_ps(1.0f / params.temperature);
  const __m512 lowest = _mm512_set1_ps(kLowest);
  __m512 level_at[kNumLevels];
  __m512 level_mass[kNumLevels];
  int level_count[kNumLevels] = {};
  for (int l = 0; l < kNumLevels; ++l) {
    level_at[l] = _mm512_set1_ps(std::exp(kLevels[l]));
    level_mass[l] = _mm512_setzero_ps();
  }
  __m512d total_acc = _mm512_setzero_pd();
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + i), m), inv_t);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(lanes, t, lowest, _CMP_GE_OQ);  // -inf and tails: 0
    const __m512 w = _mm512_maskz_mov_ps(live, exp_in_range(_mm512_maskz_mov_ps(live, t)));
    _mm512_mask_storeu_ps(weights + i, lanes, w);
    total_acc = add_wide(total_acc, w);
    for (int l = 0; l < kNumLevels; ++l) {
      const __mmask16 in = _mm512_cmp_ps_mask(w, level_at[l], _CMP_GE_OQ);
      level_count[l] += __builtin_popcount(in);
      level_mass[l] = _mm512_mask_add_ps(level_mass[l], in, level_mass[l], w);
    }
  }
  const double total = _mm512_reduce_add_pd(total_acc);
  if (!(total > 0.0)) return -1;  // a temperature so small that even the best token's weight is lost

  // top_k and top_p keep the tokens at or above one key; min_p those of weight min_p or more (the
  // best's weight is 1).
  const bool by_count = params.top_k > 0 && params.top_k < cols;
  if (!by_count && params.top_p >= 1.0f) {
    const Kept kept(0.0f, -1, params.min_p);
    const double mass = params.min_p > 0.0f ? kept_mass(weights, cols, kept) : total;
    return walk_to(weights, cols, kept, params.uniform * mass);
  }
  // The highest level that holds every token truncation can keep; past the last, every token.
  int level = 0;
  for (; level < kNumLevels; ++level) {
    if (by_count ? level_count[level] >= params.top_k
                 : double{_mm512_reduce_add_ps(level_mass[level])} >= params.top_p * total)
      break;
  }
  std::vector<uint64_t>& keys = s.keys;
  const int64_t candidates = level < kNumLevels ? level_count[level] : cols;
  const uint64_t cut = candidates > static_cast<int64_t>(kWalkCandidates)
                           ? hist_cut(weights, cols, params, total, s.histogram, keys)
                           : rank_cut(weights, cols, params, total, level, keys);
  if (candidates > static_cast<int64_t>(kWalkCandidates) || keys.size() > kWalkCandidates) {
    // Many candidates: the kept ones may be many too; walk the whole row.
    const Kept kept(key_weight(cut), key_index(cut), params.min_p);
    return walk_to(weights, cols, kept, params.uniform * kept_mass(weights, cols, kept));
  }
  // Few candidates: the kept ones among them, in vocabulary order.
  std::vector<int32_t>& kept = s.kept;
  kept.clear();
  double mass = 0.0;
  for (const uint64_t key : keys) {
    if (key >= cut && key_weight(key) >= params.min_p) {
      kept.push_back(key_index(key));
      mass += key_weight(key);
    }
  }
  std::sort(kept.begin(), kept.end());
  const double target = params.uniform * mass;
  double cum = 0.0;
  for (const int32_t index : kept) {
    cum += weights[index];
    if (cum > target) return index;
  }
  return kept.back();  // rounding put the target at the very top
}

}  // namespace

extern "C" {

// out[r] = the argmax of row r of x (rows `row_stride` floats apart, `cols` each). 0: done; 1: some
// row holds a NaN (out is then incomplete: the caller takes torch's argmax instead).
int radix_argmax_rows(const float* x, int64_t row_stride, int32_t rows, int32_t cols, int64_t* out,
                      int32_t num_threads) {
  int status = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (int64_t{rows} * cols >= kParallelValues) \
    reduction(| : status)
  for (int r = 0; r < rows; ++r)
    if (!argmax_row(x + r * row_stride, cols, out + r)) status |= 1;
  return status;
}

// out[r] = the token drawn for row r of x: its argmax where temperature[r] is 0, else a draw at
// that temperature after top_k[r] (0: off), top_p[r] (1: off) and min_p[r] (0: off) with the
// uniform number uniform[r] in [0, 1); -1 where the row holds a NaN or +inf, or only -inf (the
// caller samples those rows another way). Returns the number of rows left at -1.
int radix_sample_rows(const float* x, int64_t row_stride, int32_t rows, int32_t cols, const float* temperature,
                      const int32_t* top_k, const float* top_p, const float* min_p, const double* uniform,
                      int64_t* out, int32_t num_threads) {
  int left = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) \
    if (int64_t{rows} * cols >= kParallelValues) reduction(+ : left)
  for (int r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    if (temperature[r] <= 0.0f) {
      if (!argmax_row(row, cols, out + r)) out[r] = -1;
    } else {
      out[r] = sample_row(row, cols, RowParams{temperature[r], top_k[r], top_p[r], min_p[r], uniform[r]});
    }
    if (out[r] < 0) ++left;
  }
  return left;
}

}  // extern "C"
