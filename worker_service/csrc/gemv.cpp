// Linear layers for decode steps (a few to a few dozen rows) on CPUs with AVX-512, in bfloat16
// (AVX512-BF16), float32 or float16: y = x W^T (+ b), reading the weight from memory once: rows go in passes
// of up to six over a few output groups at a time, which stay in cache for every pass. For a few
// rows such a product is memory bound; what costs beside the weight's bytes is per call: oneDNN's
// packed kernel spends ~11 us in each call of a 64 x 64 product here, against ~120 calls per
// decode step (figures for more rows: layers/linear.py).
//
// Layout (`radix_pack_gemv_weight`): output features in groups of 64; within a group, one step of
// the inner loop reads consecutive bytes (256, float16 128), the group's 64 features' weights for
// the step's input features, and multiplies them with each row's inputs broadcast:
// - bfloat16: a step is a pair of input features (k, k + 1), packed[group][k / 2][feature][2]: four
//   vectors of 16 features x 2 weights, two products per lane per instruction (`vdpbf16ps`), summed
//   in float32, rounded to bfloat16 once at the end as oneDNN does;
// - float32: a step is one input feature, packed[group][k][feature]: four vectors of 16 features,
//   one fused multiply-add per lane;
// - float16: as float32 (128 bytes a step), each vector widened to float32 as it is read (F16C),
//   for CPUs without a float16 GEMM (see layers/linear.py).
// Only the order of the float32 sums differs from oneDNN's. Rows of the output past N and (in
// bfloat16) the odd input feature past K are zero in the packing.

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

// Input features per step of the inner loop (see the layout above).
template <int kDtype> constexpr int64_t kPerStep = kDtype == kBFloat16 ? 2 : 1;

inline int64_t num_steps(int32_t dtype, int64_t k) { return dtype == kBFloat16 ? (k + 1) / 2 : k; }

// Rows [0, rows) of x (at most kMaxRows) times groups [g_begin, g_end) of the packed weight.
// With `ahead_per_step` > 0, each step also asks for that many lines from `ahead` (up to
// `ahead_end`) into L2: the next block's weights, fetched while this block is computed from cache.
template <int kDtype, int kRows>
void gemv_groups(const typename Elem<kDtype>::type* x, int64_t x_stride, const typename Elem<kDtype>::type* packed,
                 int64_t steps, int64_t g_begin, int64_t g_end, const typename Elem<kDtype>::type* bias,
                 typename Elem<kDtype>::type* out, int64_t out_stride, int64_t n, const char*& ahead,
                 const char* ahead_end, int ahead_per_step) {
  constexpr int64_t kStepValues = kGroup * kPerStep<kDtype>;  // 256 bytes (float16: 128)
  for (int64_t g = g_begin; g < g_end; ++g) {
    __m512 acc[kRows][4];
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    const auto* w = packed + g * steps * kStepValues;
    for (int64_t p = 0; p < steps; ++p, w += kStepValues) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 128, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + 192, _MM_HINT_T0);
      for (int a = 0; a < ahead_per_step && ahead < ahead_end; ++a, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
      if constexpr (kDtype == kBFloat16) {
#ifdef __AVX512BF16__
        __m512i wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(w + 32 * j);
        for (int m = 0; m < kRows; ++m) {
          const __m512i xb = broadcast_pair(x + m * x_stride + 2 * p);
          for (int j = 0; j < 4; ++j) acc[m][j] = dot_pairs(acc[m][j], xb, wv[j]);
        }
#endif
      } else {
        __m512 wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = load_vec<kDtype>(w + 16 * j);
        for (int m = 0; m < kRows; ++m) {
          const __m512 xb = _mm512_set1_ps(to_float<kDtype>(x[m * x_stride + p]));
          for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(wv[j], xb, acc[m][j]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t first = g * kGroup + 16 * j;
      if (first >= n) break;
      const __mmask16 lanes = lanes_from(static_cast<int>(std::min<int64_t>(16, n - first)));
      const __m512 b = bias ? load_masked<kDtype>(bias + first, lanes) : _mm512_setzero_ps();
      for (int m = 0; m < kRows; ++m)
        store_masked<kDtype>(out + m * out_stride + first, lanes, _mm512_add_ps(acc[m][j], b));
    }
  }
}

// The float32 and float16 layout: packed[group][k][feature], features past n zero.
template <typename T>
void pack_by_feature(const T* w, int64_t n, int64_t k, T* packed, int64_t size) {
  std::memset(packed, 0, static_cast<size_t>(size) * sizeof(T));
  for (int64_t row = 0; row < n; ++row) {
    T* group = packed + (row / kGroup) * k * kGroup;
    for (int64_t col = 0; col < k; ++col) group[col * kGroup + row % kGroup] = w[row * k + col];
  }
}

template <int kDtype>
void gemv(const void* x_in, int64_t x_stride, int32_t rows, int64_t k, const void* packed_in, int64_t n,
          const void* bias_in, void* out_in, int64_t out_stride, int32_t num_threads) {
  using T = typename Elem<kDtype>::type;
  const auto* x = static_cast<const T*>(x_in);
  const auto* packed = static_cast<const T*>(packed_in);
  const auto* bias = static_cast<const T*>(bias_in);
  auto* out = static_cast<T*>(out_in);
  const int64_t steps = num_steps(kDtype, k), groups = num_groups(n);
  const int threads = groups >= 4 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int count = omp_get_num_threads();
    const int64_t g_begin = groups * t / count, g_end = groups * (t + 1) / count;
    // Passes of at most kMaxRows rows, as even as can be (8 rows: 4 + 4, not 6 + 2), taken over a
    // block of a few groups at a time: the block's weights (~73 KB a group at K = 576 in
    // bfloat16, twice that in float32) stay in cache for every pass, so the weight is read from
    // memory once whatever the number of rows. The first pass over a block waits on memory, the
    // others compute from L2. From three passes on (13 rows), those fetch the next block's
    // weights meanwhile, so that its first pass finds them in L2 too; a block and the next then
    // fit in L2 (blocks of at most ~256 KB, or one group). With fewer passes the fetches would
    // crowd the few instructions they hide behind (measured slower at 8 rows, 2 passes).
    const int passes = (rows + kMaxRows - 1) / kMaxRows;
    const bool fetch_ahead = passes >= 3;
    const int64_t group_bytes = steps * kGroup * kPerStep<kDtype> * static_cast<int64_t>(sizeof(T));
    const int64_t groups_per_block = fetch_ahead ? std::clamp<int64_t>(kBlockBytes / group_bytes, 1, 4) : 4;
    const char* const weights = static_cast<const char*>(packed_in);
    for (int64_t b = g_begin; b < g_end; b += groups_per_block) {
      const int64_t b_end = std::min(g_end, b + groups_per_block);
      const char* ahead = weights + b_end * group_bytes;
      const char* const ahead_end = weights + std::min(g_end, b_end + groups_per_block) * group_bytes;
      const int64_t steps_after_first = fetch_ahead ? (passes - 1) * (b_end - b) * steps : 0;
      const int ahead_per_step =
          steps_after_first > 0 ? static_cast<int>(((ahead_end - ahead) / 64 + steps_after_first - 1) / steps_after_first) : 0;
      for (int pass = 0; pass < passes; ++pass) {
        const int r = rows * pass / passes, r_end = rows * (pass + 1) / passes;
        const T* xr = x + r * x_stride;
        T* outr = out + r * out_stride;
        const int per_step = pass == 0 ? 0 : ahead_per_step;
        switch (r_end - r) {
          case 1: gemv_groups<kDtype, 1>(xr, x_stride, packed, steps, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_step); break;
          case 2: gemv_groups<kDtype, 2>(xr, x_stride, packed, steps, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_step); break;
          case 3: gemv_groups<kDtype, 3>(xr, x_stride, packed, steps, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_step); break;
          case 4: gemv_groups<kDtype, 4>(xr, x_stride, packed, steps, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_step); break;
          case 5: gemv_groups<kDtype, 5>(xr, x_stride, packed, steps, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_step); break;
          default: gemv_groups<kDtype, 6>(xr, x_stride, packed, steps, b, b_end, bias, outr, out_stride, n, ahead, ahead_end, per_step); break;
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// 1 where `radix_gemv` runs on this build for the dtype (bfloat16 needs AVX512-BF16), else 0.
int radix_gemv_supported(int32_t dtype) {
#ifdef __AVX512BF16__
  if (dtype == kBFloat16) return 1;
#endif
  return dtype == kFloat32 || dtype == kFloat16 ? 1 : 0;
}

// Values (of the dtype) in the packed form of an [n, k] weight.
int64_t radix_gemv_packed_size(int32_t dtype, int64_t n, int64_t k) {
  return num_groups(n) * num_steps(dtype, k) * kGroup * (dtype == kBFloat16 ? 2 : 1);
}

// Packs the row-major weight w [n, k] of the dtype into `packed` (radix_gemv_packed_size values).
void radix_pack_gemv_weight(int32_t dtype, const void* w_in, int64_t n, int64_t k, void* packed_in) {
  const int64_t size = radix_gemv_packed_size(dtype, n, k);
  if (dtype == kFloat32) {
    pack_by_feature(static_cast<const float*>(w_in), n, k, static_cast<float*>(packed_in), size);
    return;
  }
  if (dtype == kFloat16) {
    pack_by_feature(static_cast<const uint16_t*>(w_in), n, k, static_cast<uint16_t*>(packed_in), size);
    return;
  }
  const auto* w = static_cast<const uint16_t*>(w_in);
  auto* packed = static_cast<uint16_t*>(packed_in);
  const int64_t pairs = num_steps(kBFloat16, k);
  std::memset(packed, 0, static_cast<size_t>(size) * sizeof(uint16_t));
  for (int64_t row = 0; row < n; ++row) {
    uint16_t* group = packed + (row / kGroup) * pairs * kGroup * 2;
    const int64_t lane = row % kGroup;
    for (int64_t col = 0; col < k; ++col) group[((col / 2) * kGroup + lane) * 2 + col % 2] = w[row * k + col];
  }
}

// out [rows, n] (rows `out_stride` apart) = x [rows, k] (rows `x_stride` apart) times the packed
// weight's transpose, plus `bias` [n] when not null; all of the dtype. 0: done; 2: unsupported
// (the dtype on this build, or an odd k in bfloat16, whose pairs of x are read as one 32-bit value).
int radix_gemv(int32_t dtype, const void* x, int64_t x_stride, int32_t rows, int64_t k, const void* packed,
               int64_t n, const void* bias, void* out, int64_t out_stride, int32_t num_threads) {
  if (!radix_gemv_supported(dtype)) return 2;
  if (dtype == kFloat32) {
    gemv<kFloat32>(x, x_stride, rows, k, packed, n, bias, out, out_stride, num_threads);
    return 0;
  }
  if (dtype == kFloat16) {
    gemv<kFloat16>(x, x_stride, rows, k, packed, n, bias, out, out_stride, num_threads);
    return 0;
  }
  if (k % 2 != 0) return 2;
  gemv<kBFloat16>(x, x_stride, rows, k, packed, n, bias, out, out_stride, num_threads);
  return 0;
}

}  // extern "C"
