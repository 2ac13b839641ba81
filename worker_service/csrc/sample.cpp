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
// provably holds the top_k tokens or top_p of the mass, counted while the exponentials are made.
//
// Penalties (repetition over prompt and output tokens, presence and frequency over output tokens)
// are applied to a copy of the logits in place, one pass over each row's token history through a
// per-thread count of each token, where the torch path built a key per token in Python and sorted
// them (4 ms a step for 32 rows of 1,000 tokens).
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
#include "vector_math.h"

namespace {

using namespace radix;

constexpr int64_t kParallelValues = 1 << 16;  // fewer values: one thread, a team costs more
constexpr int64_t kParallelTokens = 1 << 13;  // the same for the penalties' token histories

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

// Candidate levels: a token is a candidate at level L when its tempered logit is at most kLevels[L]
// below the best one's (its probability at least exp(kLevels[L]) times the best's). Each level's
// count and mass are summed while the exponentials are made; the highest level holding the top_k
// tokens (or, without top_k, top_p of the mass) bounds the ranking. Below the last: every token.
constexpr int kNumLevels = 4;
constexpr float kLevels[kNumLevels] = {-3.0f, -7.0f, -13.0f, -24.0f};
// Tempered logits further than this below the best get probability 0 (exp would be < 1.7e-38).
constexpr float kLowest = -87.0f;

struct RowParams {
  float temperature;
  int32_t top_k;  // 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  double uniform;  // in [0, 1)
};

// Per thread: the row's exponentials and its ranked candidates.
struct Scratch {
  std::vector<float> weights;
  std::vector<uint64_t> keys;
  std::vector<int32_t> kept;
};
thread_local Scratch scratch;

// A candidate's sort key: its weight's bits above (positive floats order as their bits), its index
// inverted below, so a larger key is a likelier token, or as likely with a lower index.
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

// Adds 16 float lanes into 8 double lanes.
inline __m512d add_wide(__m512d acc, __m512 x) {
  acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
  return _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
}

// The first token, in vocabulary order, whose running sum of `weights` (those at or above
// `threshold`, all positive) passes `target`; the last such token where rounding leaves the target
// at the very top.
int32_t walk_to(const float* weights, int cols, float threshold, double target) {
  const __m512 floor = _mm512_set1_ps(threshold);
  double cum = 0.0;
  int32_t last = -1;
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 w = _mm512_maskz_loadu_ps(lanes, weights + i);
    const __mmask16 kept = _mm512_mask_cmp_ps_mask(lanes, w, floor, _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
    if (!kept) continue;
    const double block = _mm512_mask_reduce_add_ps(kept, w);
    if (cum + block <= target) {
      cum += block;
      last = i + 31 - __builtin_clz(kept);
      continue;
    }
    for (unsigned bits = kept; bits; bits &= bits - 1) {
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
  const __m512 min_weight = _mm512_set1_ps(params.min_p);
  __m512d total_acc = _mm512_setzero_pd();
  __m512d min_p_acc = _mm512_setzero_pd();
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
    if (params.min_p > 0.0f)
      min_p_acc = add_wide(min_p_acc, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, min_weight, _CMP_GE_OQ), w));
  }
  const double total = _mm512_reduce_add_pd(total_acc);
  if (!(total > 0.0)) return -1;  // a temperature so small that even the best token's weight is lost

  const bool by_count = params.top_k > 0 && params.top_k < cols;
  if (!by_count && params.top_p >= 1.0f) {  // min_p alone, or nothing: no ranking
    if (params.min_p > 0.0f) return walk_to(weights, cols, params.min_p, params.uniform * _mm512_reduce_add_pd(min_p_acc));
    return walk_to(weights, cols, 0.0f, params.uniform * total);
  }

  // The highest level that holds every token truncation can keep; past the last, every token.
  int level = 0;
  for (; level < kNumLevels; ++level) {
    if (by_count ? level_count[level] >= params.top_k
                 : double{_mm512_reduce_add_ps(level_mass[level])} >= params.top_p * total)
      break;
  }
  std::vector<uint64_t>& keys = s.keys;
  for (;; ++level) {
    // The candidates at this level, ranked likeliest first.
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
    size_t ranked = keys.size();
    if (by_count && ranked > static_cast<size_t>(params.top_k)) {
      ranked = params.top_k;
      std::nth_element(keys.begin(), keys.begin() + (ranked - 1), keys.end(), std::greater<uint64_t>());
    }
    std::sort(keys.begin(), keys.begin() + ranked, std::greater<uint64_t>());
    // top_p over the top_k tokens' mass (every token's without top_k): keep a token while the mass
    // of the likelier ones is below top_p of it; the best token always.
    double normaliser = total;
    if (by_count) {
      normaliser = 0.0;
      for (size_t r = 0; r < ranked; ++r) normaliser += key_weight(keys[r]);
    }
    size_t keep = ranked;
    double mass = 0.0;
    if (params.top_p < 1.0f) {
      const double limit = double{params.top_p} * normaliser;
      keep = 0;
      while (keep < ranked && (keep == 0 || mass < limit)) mass += key_weight(keys[keep++]);
      // Rounding can leave a level's candidates just short of the mass counted for it: rank more.
      if (!by_count && keep == ranked && mass < limit && level < kNumLevels) continue;
    }
    while (keep > 1 && key_weight(keys[keep - 1]) < params.min_p) --keep;  // the best's weight is 1
    // The draw walks the kept tokens in vocabulary order, as the torch path's cumsum does.
    std::vector<int32_t>& kept = s.kept;
    kept.resize(keep);
    double kept_mass = 0.0;
    for (size_t r = 0; r < keep; ++r) {
      kept[r] = key_index(keys[r]);
      kept_mass += key_weight(keys[r]);
    }
    std::sort(kept.begin(), kept.end());
    const double target = params.uniform * kept_mass;
    double cum = 0.0;
    for (const int32_t index : kept) {
      cum += weights[index];
      if (cum > target) return index;
    }
    return kept.back();  // rounding put the target at the very top
  }
}

// Per thread: how often each token occurs among a row's output tokens (kApplied once its logit is
// penalised); zero again between rows.
thread_local std::vector<int32_t> token_counts;
constexpr int32_t kApplied = INT32_MIN;

// Penalises one row of logits in place (see radix_apply_penalties); false on a token id outside
// [0, cols) (the row is then untouched).
bool penalise_row(float* logits, int cols, const int32_t* tokens, int num_tokens, int num_prompt, float repetition,
                  float presence, float frequency) {
  for (int i = 0; i < num_tokens; ++i)
    if (tokens[i] < 0 || tokens[i] >= cols) return false;
  std::vector<int32_t>& counts = token_counts;
  if (static_cast<int>(counts.size()) < cols) counts.assign(cols, 0);
  num_prompt = std::clamp(num_prompt, 0, num_tokens);
  for (int i = num_prompt; i < num_tokens; ++i) ++counts[tokens[i]];
  // Repetition sees every token, presence and frequency only output tokens (their count is 0 for
  // tokens seen only in the prompt). Each distinct token is penalised once, in the torch path's
  // order and float32 operations: the repetition factor, then presence + frequency * count.
  const bool additive = presence != 0.0f || frequency != 0.0f;
  for (int i = repetition != 1.0f ? 0 : num_prompt; i < num_tokens; ++i) {
    const int32_t token = tokens[i];
    const int32_t count = counts[token];
    if (count == kApplied) continue;
    float x = logits[token];
    if (repetition != 1.0f) x = x > 0.0f ? x / repetition : x * repetition;
    if (additive && count > 0) {
      volatile float scaled = frequency * static_cast<float>(count);  // rounded alone, as torch does (no FMA)
      x -= presence + scaled;
    }
    logits[token] = x;
    counts[token] = kApplied;
  }
  for (int i = 0; i < num_tokens; ++i) counts[tokens[i]] = 0;
  return true;
}

}  // namespace

extern "C" {

// Penalises rows of float32 logits in place: row r's tokens are tokens[r][0, num_tokens[r]), the
// first num_prompt[r] of them prompt. A seen token's logit is divided by repetition[r] when positive,
// multiplied when not (1: off); an output token's loses presence[r] + frequency[r] * its count.
// Returns the number of rows with a token id outside [0, cols), which are left untouched.
int radix_apply_penalties(float* x, int64_t row_stride, int32_t rows, int32_t cols, const int32_t* const* tokens,
                          const int32_t* num_tokens, const int32_t* num_prompt, const float* repetition,
                          const float* presence, const float* frequency, int32_t num_threads) {
  int64_t total = 0;
  for (int r = 0; r < rows; ++r) total += num_tokens[r];
  int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (total >= kParallelTokens) \
    reduction(+ : bad)
  for (int r = 0; r < rows; ++r) {
    if (num_tokens[r] == 0 || (repetition[r] == 1.0f && presence[r] == 0.0f && frequency[r] == 0.0f)) continue;
    if (!penalise_row(x + r * row_stride, cols, tokens[r], num_tokens[r], num_prompt[r], repetition[r], presence[r],
                      frequency[r]))
      ++bad;
  }
  return bad;
}

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
