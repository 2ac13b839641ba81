// Linear layers for decode steps (a few to a few dozen rows) in bfloat16 on CPUs with AVX512-BF16:
// y = x W^T (+ b), reading the weight from memory once: rows go in passes of up to six over a few
// output groups at a time, which stay in cache for every pass. For a few rows such a product is
// memory bound; what costs beside the weight's bytes is per call: oneDNN's packed kernel spends
// ~11 us in each call of a 64 x 64 product here, against ~120 calls per decode step (figures for
// more rows: layers/linear.py).
//
// Layout (`radix_pack_gemv_weight`): output features in groups of 64, and within a group, for each
// pair of input features (k, k + 1), the 64 features' two weights side by side:
// packed[group][k / 2][feature][2]. A step of the inner loop reads 256 consecutive bytes (four
// vectors of 16 features x 2 weights) and multiplies them with each row's pair (x[k], x[k + 1])
// broadcast, two products per lane per instruction (`vdpbf16ps`), summed in float32, rounded to
// bfloat16 once at the end as oneDNN does; only the order of the float32 sums differs. Rows of
// the output past N and the odd input feature past K are zero in the packing.

#ifndef __AVX512F__
#error "the small-batch linear kernel needs AVX-512"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "vector_math.h"

namespace {

using namespace radix;

constexpr int kGroup = 64;    // output features per group: four vectors of 16
constexpr int kMaxRows = 6;   // rows per pass over the weight (accumulators: 6 x 4 vectors)
constexpr int64_t kBlockBytes = 256 << 10;  // weights of the groups a pass takes before the next pass

inline int64_t num_groups(int64_t n) { return (n + kGroup - 1) / kGroup; }
inline int64_t num_pairs(int64_t k) { return (k + 1) / 2; }

#ifdef __AVX512BF16__
// Rows [0, rows) of x (at most kMaxRows) times groups [g_begin, g_end) of the packed weight.
// With `ahead_per_pair` > 0, each pair step also asks for that many lines from `ahead` (up to
// `ahead_end`) into L2: the next block's weights, fetched while this block is computed from cache.
template <int kRows>
void gemv_groups(const uint16_t* x, int64_t x_stride, const uint16_t* packed, int64_t pairs, int64_t g_begin,
                 int64_t g_end, const uint16_t* bias, uint16_t* out, int64_t out_stride, int64_t n,
                 const char*& ahead, const char* ahead_end, int ahead_per_pair) {
  for (int64_t g = g_begin; g < g_end; ++g) {
    __m512 acc[kRows][4];
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    const uint16_t* w = packed + g * pairs * kGroup * 2;
    for (int64_t p = 0; p < pairs; ++p, w += kGroup * 2) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 128, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 192, _MM_HINT_T0);
      for (int a = 0; a < ahead_per_pair && ahead < ahead_end; ++a, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
      __m512i wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(w + 32 * j);
      for (int m = 0; m < kRows; ++m) {
        const __m512i xb = broadcast_pair(x + m * x_stride + 2 * p);
        for (int j = 0; j < 4; ++j) acc[m][j] = dot_pairs(acc[m][j], xb, wv[j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t first = g * kGroup + 16 * j;
      if (first >= n) break;
      const __mmask16 lanes = lanes_from(static_cast<int>(std::min<int64_t>(16, n - first)));
      const __m512 b = bias ? load_masked<kBFloat16>(bias + first, lanes) : _mm512_setzero_ps();
      for (int m = 0; m < kRows; ++m)
        store_masked<kBFloat16>(out + m * out_stride + first, lanes, _mm512_add_ps(acc[m][j], b));
    }
  }
}
#endif

}  // namespace

extern "C" {

// 1 where `radix_gemv` runs on this build (bfloat16 with AVX512-BF16), else 0.
int radix_gemv_supported() {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

// Bytes (in bfloat16 values) of the packed form of an [n, k] weight.
int64_t radix_gemv_packed_size(int64_t n, int64_t k) { return num_groups(n) * num_pairs(k) * kGroup * 2; }

// Packs the row-major bfloat16 weight w [n, k] into `packed` (radix_gemv_packed_size values).
void radix_pack_gemv_weight(const void* w_in, int64_t n, int64_t k, void* packed_in) {
  const auto* w = static_cast<const uint16_t*>(w_in);
  auto* packed = static_cast<uint16_t*>(packed_in);
  const int64_t pairs = num_pairs(k);
  std::memset(packed, 0, static_cast<size_t>(radix_gemv_packed_size(n, k)) * sizeof(uint16_t));
  for (int64_t row = 0; row < n; ++row) {
    uint16_t* group = packed + (row / kGroup) * pairs * kGroup * 2;
    const int64_t lane = row % kGroup;
    for (int64_t col = 0; col < k; ++col) group[((col / 2) * kGroup + lane) * 2 + col % 2] = w[row * k + col];
  }
}

// out [rows, n] (rows `out_stride` apart) = x [rows, k] (rows `x_stride` apart) times the packed
// weight's transpose, plus `bias` [n] when not null; bfloat16 throughout. 0: done; 2: unsupported.
int radix_gemv(const void* x_in, int64_t x_stride, int32_t rows, int64_t k, const void* packed_in, int64_t n,
               const void* bias_in, void* out_in, int64_t out_stride, int32_t num_threads) {
#ifdef __AVX512BF16__
  const auto* x = static_cast<const uint16_t*>(x_in);
  const auto* packed = static_cast<const uint16_t*>(packed_in);
  const auto* bias = static_cast<const uint16_t*>(bias_in);
  auto* out = static_cast<uint16_t*>(out_in);
  if (k % 2 != 0) return 2;  // pairs of x are read as one 32-bit value
  const int64_t pairs = k / 2, groups = num_groups(n);
  const int threads = groups >= 4 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int count = omp_get_num_threads();
    const int64_t g_begin = groups * t / count, g_end = groups * (t + 1) / count;
    // Passes of at most kMaxRows rows, as even as can be (8 rows: 4 + 4, not 6 + 2), taken over a
    // block of a few groups at a time: the block's weights (~73 KB a group at K = 576) stay in
    // cache for every pass, so the weight is read from memory once whatever the number of rows.
    // The first pass over a block waits on memory, the others compute from L2. From three passes
    // on (13 rows), those fetch the next block's weights meanwhile, so that its first pass finds
    // them in L2 too; a block and the next then fit in L2 (blocks of at most ~256 KB). With fewer
    // passes the fetches would crowd the few instructions they hide behind (measured slower at 8
    // rows, 2 passes).
    const int passes = (rows + kMaxRows - 1) / kMaxRows;
    const bool fetch_ahead = passes >= 3;
    const int64_t group_bytes = pairs * kGroup * 2 * static_cast<int64_t>(sizeof(uint16_t));
    const int64_t groups_per_block = fetch_ahead ? std::clamp<int64_t>(kBlockBytes / group_bytes, 1, 4) : 4;
    const char* const weights = static_cast<const char*>(packed_in);
    for (int64_t b = g_begin; b < g_end; b += groups_per_block) {
      const int64_t b_end = std::min(g_end, b + groups_per_block);
      const char* ahead = weights + b_end * group_bytes;
      const char* const ahead_end = weights + std::min(g_end, b_end + groups_per_block) * group_bytes;
      const int64_t steps_after_first = fetch_ahead ? (passes - 1) * (b_end - b) * pairs : 0;
      const int ahead_per_pair =
          steps_after_first > 0 ? static_cast<int>(((ahead_end - ahead) / 64 + steps_after_first - 1) / steps_after_first) : 0;
      for (int pass = 0; pass < passes; ++pass) {
        const int r = rows * pass / passes, r_end = rows * (pass + 1) / passes;
        const uint16_t* xr = x + r * x_stride;
        uint16_t* outr = out + r * out_stride;
        const int per_pair = pass == 0 ? 0 : ahead_per_pair;
        switch (r_end - r) {
          case 1: gemv_groups<1>(xr, x_stride, packed, pairs, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_pair); break;
          case 2: gemv_groups<2>(xr, x_stride, packed, pairs, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_pair); break;
          case 3: gemv_groups<3>(xr, x_stride, packed, pairs, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_pair); break;
          case 4: gemv_groups<4>(xr, x_stride, packed, pairs, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_pair); break;
          case 5: gemv_groups<5>(xr, x_stride, packed, pairs, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_pair); break;
          default: gemv_groups<6>(xr, x_stride, packed, pairs, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_pair); break;
        }
      }
    }
  }
  return 0;
#else
  (void)x_in, (void)x_stride, (void)rows, (void)k, (void)packed_in, (void)n, (void)bias_in, (void)out_in,
      (void)out_stride, (void)num_threads;
  return 2;
#endif
}

}  // extern "C"
