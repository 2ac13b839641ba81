// A decoder layer's elementwise steps on x86 CPUs with AVX-512, each one pass over its rows where
// PyTorch runs a chain of kernels that each read and write the whole activation: RMSNorm (in
// bfloat16 eight kernels: casts, pow, mean, add, rsqrt, two muls), the residual add fused with the
// RMSNorm that follows it, and SwiGLU (silu(gate) * up). Built into the same library as
// paged_attention.cpp (see native.py).
//
// Rounding follows the reference Llama/Qwen2 code as PyTorch runs it in the model's dtype: the
// residual sum rounded to the dtype; RMSNorm normalised in float32, rounded, multiplied by the
// weight and rounded again; silu rounded before the product with up. Only the sum of squares is
// taken in another order (and silu's exp is our own), so a value may differ from PyTorch's by one
// step of the dtype. Float32 runs the same code with no rounding.

#ifndef __AVX512F__
#error "the RMSNorm kernel needs AVX-512 (PyTorch's ops serve CPUs without it)"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vector_math.h"

namespace {

using namespace radix;

// Rows of `size` values: small steps (a decode step's few rows) stay on the calling thread, where
// waking a team would cost more than the work.
constexpr int64_t kParallelValues = 1 << 16;
constexpr int64_t kParallelSilu = 1 << 14;  // an exp per value: worth a team sooner

// One row's RMSNorm into `dst`; `row` is already in the dtype (a fused residual sum is rounded).
template <int kDtype>
inline void norm_row(const typename Elem<kDtype>::type* row, const typename Elem<kDtype>::type* weight,
                     typename Elem<kDtype>::type* dst, int size, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int i = 0; i < size; i += 16) {
    const __m512 v = load_masked<kDtype>(row + i, lanes_from(size - i));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float inverse = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(size) + eps);
  const __m512 scale = _mm512_set1_ps(inverse);
  for (int i = 0; i < size; i += 16) {
    const __mmask16 lanes = lanes_from(size - i);
    const __m512 normed = round_to<kDtype>(_mm512_mul_ps(load_masked<kDtype>(row + i, lanes), scale));
    store_masked<kDtype>(dst + i, lanes, _mm512_mul_ps(normed, load_masked<kDtype>(weight + i, lanes)));
  }
}

template <int kDtype>
void rms_norm_rows(const void* x_in, int64_t x_stride, const void* weight_in, void* out_in, int rows, int size,
                   float eps, int num_threads) {
  using T = typename Elem<kDtype>::type;
  const T* x = static_cast<const T*>(x_in);
  const T* weight = static_cast<const T*>(weight_in);
  T* out = static_cast<T*>(out_in);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (int64_t{rows} * size >= kParallelValues)
  for (int r = 0; r < rows; ++r) norm_row<kDtype>(x + r * x_stride, weight, out + int64_t{r} * size, size, eps);
}

// residual += delta (rounded to the dtype), then out = RMSNorm(residual); all rows contiguous.
template <int kDtype>
void add_rms_norm_rows(void* residual_in, const void* delta_in, const void* weight_in, void* out_in, int rows,
                       int size, float eps, int num_threads) {
  using T = typename Elem<kDtype>::type;
  T* residual = static_cast<T*>(residual_in);
  const T* delta = static_cast<const T*>(delta_in);
  const T* weight = static_cast<const T*>(weight_in);
  T* out = static_cast<T*>(out_in);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (int64_t{rows} * size >= kParallelValues)
  for (int r = 0; r < rows; ++r) {
    T* row = residual + int64_t{r} * size;
    const T* add = delta + int64_t{r} * size;
    for (int i = 0; i < size; i += 16) {
      const __mmask16 lanes = lanes_from(size - i);
      store_masked<kDtype>(row + i, lanes, _mm512_add_ps(load_masked<kDtype>(row + i, lanes),
                                                         load_masked<kDtype>(add + i, lanes)));
    }
    norm_row<kDtype>(row, weight, out + int64_t{r} * size, size, eps);
  }
}

// out[r] = silu(gate[r]) * up[r], where row r of `gate_up` is [gate (features) | up (features)].
template <int kDtype>
void silu_mul_rows(const void* gate_up_in, void* out_in, int rows, int features, int num_threads) {
  using T = typename Elem<kDtype>::type;
  const T* gate_up = static_cast<const T*>(gate_up_in);
  T* out = static_cast<T*>(out_in);
  const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (int64_t{rows} * features >= kParallelSilu)
  for (int r = 0; r < rows; ++r) {
    const T* gate = gate_up + int64_t{r} * 2 * features;
    const T* up = gate + features;
    T* dst = out + int64_t{r} * features;
    for (int i = 0; i < features; i += 16) {
      const __mmask16 lanes = lanes_from(features - i);
      const __m512 g = load_masked<kDtype>(gate + i, lanes);
      const __m512 d = _mm512_add_ps(one, exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g)));
      const __m512 silu = round_to<kDtype>(_mm512_div_ps(g, d));
      store_masked<kDtype>(dst + i, lanes, _mm512_mul_ps(silu, load_masked<kDtype>(up + i, lanes)));
    }
  }
}

template <template <int> class Op, typename... Args>
int by_dtype(int32_t dtype, Args... args) {
  switch (dtype) {
    case kFloat32: Op<kFloat32>::run(args...); return 0;
    case kBFloat16: Op<kBFloat16>::run(args...); return 0;
    case kFloat16: Op<kFloat16>::run(args...); return 0;
    default: return 3;
  }
}

template <int kDtype> struct RmsNorm { template <typename... A> static void run(A... a) { rms_norm_rows<kDtype>(a...); } };
template <int kDtype> struct AddRmsNorm { template <typename... A> static void run(A... a) { add_rms_norm_rows<kDtype>(a...); } };
template <int kDtype> struct SiluMul { template <typename... A> static void run(A... a) { silu_mul_rows<kDtype>(a...); } };

}  // namespace

extern "C" {

// out[r] = weight * round(x[r] / rms(x[r])), rows `x_stride` elements apart; out is contiguous.
int radix_rms_norm(int32_t dtype, const void* x, int64_t x_stride, const void* weight, void* out, int32_t rows,
                   int32_t size, float eps, int32_t num_threads) {
  return by_dtype<RmsNorm>(dtype, x, x_stride, weight, out, int{rows}, int{size}, eps, int{num_threads});
}

// residual[r] = round(residual[r] + delta[r]); out[r] = RMSNorm(residual[r]). Contiguous rows.
int radix_add_rms_norm(int32_t dtype, void* residual, const void* delta, const void* weight, void* out,
                       int32_t rows, int32_t size, float eps, int32_t num_threads) {
  return by_dtype<AddRmsNorm>(dtype, residual, delta, weight, out, int{rows}, int{size}, eps, int{num_threads});
}

// out[r] = round(round(silu(gate_up[r, :F])) * gate_up[r, F:]) for F = `features`. Contiguous rows.
int radix_silu_mul(int32_t dtype, const void* gate_up, void* out, int32_t rows, int32_t features,
                   int32_t num_threads) {
  return by_dtype<SiluMul>(dtype, gate_up, out, int{rows}, int{features}, int{num_threads});
}

}  // extern "C"
