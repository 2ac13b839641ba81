// Logprobs of sampled tokens (see sampler.py): the log-softmax of each row's raw float32 logits at
// its chosen token, and the row's `num_top` most likely tokens with theirs, where the torch path
// made a whole log-softmax copy of the batch and ranked it (1.2 ms for 32 rows of 49,152 logits,
// 2.1 with 5 top logprobs). Here: the row's max, then the sum of exp(x - max) 16 lanes at a time
// (log-sum-exp = max + log(sum)), and the top tokens from one pass that compares 16 logits at a
// time with the smallest of those kept so far and inserts only the few that pass it.
//
// A row holding a NaN or +inf, or nothing but -inf, is left to the caller (reported per row).

#ifndef __AVX512F__
#error "the logprobs kernel needs AVX-512"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "logit_rows.h"
#include "vector_math.h"

namespace {

using namespace radix;

constexpr int64_t kParallelValues = 1 << 16;  // fewer values: one thread, a team costs more
constexpr int kMaxTop = 64;  // KERNEL_MAX_TOP in native_sampling.py

// The row's max into *best and log(sum(exp(x - max))) into *log_sum (the log-softmax is then
// (x - max) - log_sum, torch's order of operations); false where the row holds a NaN or +inf or
// only -inf.
bool log_sum_exp(const float* x, int cols, float* best_out, float* log_sum) {
  float best;
  if (!finite_max(x, cols, &best)) return false;
  const __m512 m = _mm512_set1_ps(best);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, x + i);
    // -inf (masked tokens, the tail) gives exactly 0; the best token exactly 1.
    const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(v, m))));
  }
  *best_out = best;
  *log_sum = std::log(_mm512_reduce_add_ps(sum));
  return true;
}

// The row's `count` largest logits, largest first (the lower index first among equal ones), into
// ids / values.
void top_tokens(const float* x, int cols, int count, int64_t* ids, float* values) {
  int kept = 0;
  float floor = -INFINITY;  // the smallest kept value once `count` are kept
  for (int i = 0; i < cols; i += 16) {
    const __mmask16 lanes = lanes_from(cols - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, x + i);
    // Until `count` are kept every token is a candidate; then only those above the floor.
    __mmask16 pass = kept < count ? lanes : _mm512_mask_cmp_ps_mask(lanes, v, _mm512_set1_ps(floor), _CMP_GT_OQ);
    for (unsigned bits = pass; bits; bits &= bits - 1) {
      const int index = i + __builtin_ctz(bits);
      const float value = x[index];
      if (kept == count && !(value > values[count - 1])) continue;
      int at = kept < count ? kept++ : count - 1;
      while (at > 0 && values[at - 1] < value) {  // after equal values: the lower index stays first
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        --at;
      }
      values[at] = value;
      ids[at] = index;
      if (kept == count) floor = values[count - 1];
    }
  }
}

}  // namespace

extern "C" {

// For rows x[row_ids[r]] (rows `row_stride` floats apart, `cols` each), r in [0, rows): chosen_out[r] = the
// log-softmax at token chosen[r], and, with num_top > 0 (at most 64), the num_top largest
// log-softmax values and their token ids, largest first, into top_values / top_ids [rows, num_top].
// Returns the number of rows left undone (a NaN or +inf, or only -inf): their chosen_out is NaN.
int radix_logprobs(const float* x, int64_t row_stride, const int64_t* row_ids, int32_t rows, int32_t cols,
                   const int64_t* chosen,
                   float* chosen_out, int32_t num_top, int64_t* top_ids, float* top_values, int32_t num_threads) {
  if (num_top < 0 || num_top > kMaxTop || num_top > cols) return rows;
  int left = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) \
    if (int64_t{rows} * cols >= kParallelValues) reduction(+ : left)
  for (int r = 0; r < rows; ++r) {
    const float* row = x + row_ids[r] * row_stride;
    float best, log_sum;
    if (!log_sum_exp(row, cols, &best, &log_sum) || chosen[r] < 0 || chosen[r] >= cols) {
      chosen_out[r] = NAN;
      ++left;
      continue;
    }
    chosen_out[r] = (row[chosen[r]] - best) - log_sum;
    if (num_top > 0) {
      int64_t* ids = top_ids + int64_t{r} * num_top;
      float* values = top_values + int64_t{r} * num_top;
      top_tokens(row, cols, num_top, ids, values);
      for (int j = 0; j < num_top; ++j) values[j] = (values[j] - best) - log_sum;
    }
  }
  return left;
}

}  // extern "C"
