// One quantized product split in two: its activations prepared once (laid out for the int4
// kernel, summed per group, or rounded to 8 bits), then its output features computed chunk by
// chunk by any thread. radix_quant_gemv and radix_quant_gemv_int8_activations run the chunks in
// an OpenMP loop of their own; quant_decode_layer.cpp runs them on the threads of one parallel
// region that covers a whole decode step (see team.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace radix_quant {

constexpr int64_t kChunk = 16;  // output features a thread takes at a time

// The weight group of each 32-column block of a row of `k` columns, for the spans of two blocks
// the int4 kernels read at once (an odd last block's missing partner takes the last group).
inline std::vector<int32_t> block_groups(int64_t k, int64_t group_size) {
  constexpr int64_t kBlock = 32;
  const int64_t blocks = (k + kBlock - 1) / kBlock, spans = (blocks + 1) / 2;
  const int64_t num_groups = (k + group_size - 1) / group_size;
  std::vector<int32_t> groups(2 * spans);
  for (int64_t b = 0; b < 2 * spans; ++b) groups[b] = int32_t(std::min(b * kBlock / group_size, num_groups - 1));
  return groups;
}

// out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]) over rows [0, rows) and features [0, n).
struct ProductArgs {
  int format;
  const float* x;
  int64_t rows, x_stride;
  const void* values;
  const float* scales;
  const float* offsets;  // null: none
  int64_t n, k, group_size;
  const float* bias;  // null: none
  float* out;
  int64_t out_stride;
};

class Plan {
 public:
  virtual ~Plan() = default;
  int64_t chunks() const { return (n_ + kChunk - 1) / kChunk; }
  // Features [chunk * kChunk, (chunk + 1) * kChunk) of every row; chunks are independent, and
  // each feature's value is the same whichever thread computes it.
  virtual void run(int64_t chunk) const = 0;

 protected:
  explicit Plan(int64_t n) : n_(n) {}
  int64_t n_;
};

// The float32-activation product (quant_gemv.cpp); null with `status` set where the arguments
// are refused (1: a bad shape or format, 2: int4 without offsets or with groups not a multiple of 32).
std::unique_ptr<Plan> plan_float(const ProductArgs& a, int* status);

// The 8-bit-activation product (quant_gemv_int8.cpp) where that kernel takes the arguments,
// else plan_float's.
std::unique_ptr<Plan> plan_int8_activations(const ProductArgs& a, int* status);

}  // namespace radix_quant
