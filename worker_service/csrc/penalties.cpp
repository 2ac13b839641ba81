// Penalties for rank 0's sampler (see sampler.py): repetition over prompt and output tokens,
// presence and frequency over output tokens, applied to a copy of float32 logits in place. One pass
// over each row's token history (the request state's int32 copy, read where it lies) through a
// per-thread count of each token, where the torch path built a Python key per token and sorted
// them every step (4 ms a step for 32 rows of 1,000 tokens). The torch path's float32 operations
// in its order, so both give the same bits.

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kParallelTokens = 1 << 13;  // fewer tokens in all: one thread, a team costs more

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

}  // extern "C"
