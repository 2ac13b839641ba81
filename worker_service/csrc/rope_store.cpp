// RoPE and the K/V write of one layer in one pass over the merged q/k/v projection: each token's
// query and key heads are rotated in place (half-split pairs, as worker_service/layers/rotary.py
// and the Hugging Face Llama code do), and its rotated keys and its values are stored into their
// slots of the layer's head-major pool. PyTorch's ops take a roll, three multiplies and adds, two
// `index_copy_` and their views per layer for the same (see native.py for figures).
//
// Rounding is the reference's in the model's dtype: x * cos and swapped(x) * sin are each rounded
// before their sum, which is rounded again; `sin` carries the sign of the pair's first half, as
// `RotaryEmbedding` tabulates it. Float32 runs the same code with no rounding.

#ifndef __AVX512F__
#error "the RoPE kernel needs AVX-512 (PyTorch's ops serve CPUs without it)"
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "vector_math.h"

namespace {

using namespace radix;

constexpr int64_t kParallelTokens = 64;

template <int kDtype>
inline void rotate_head(typename Elem<kDtype>::type* x, const typename Elem<kDtype>::type* cos,
                        const typename Elem<kDtype>::type* sin, int half) {
  for (int i = 0; i < half; i += 16) {
    const __mmask16 lanes = lanes_from(half - i);
    const __m512 x1 = load_masked<kDtype>(x + i, lanes);
    const __m512 x2 = load_masked<kDtype>(x + half + i, lanes);
    const __m512 first = _mm512_add_ps(round_to<kDtype>(_mm512_mul_ps(x1, load_masked<kDtype>(cos + i, lanes))),
                                       round_to<kDtype>(_mm512_mul_ps(x2, load_masked<kDtype>(sin + i, lanes))));
    const __m512 second =
        _mm512_add_ps(round_to<kDtype>(_mm512_mul_ps(x2, load_masked<kDtype>(cos + half + i, lanes))),
                      round_to<kDtype>(_mm512_mul_ps(x1, load_masked<kDtype>(sin + half + i, lanes))));
    store_masked<kDtype>(x + i, lanes, first);
    store_masked<kDtype>(x + half + i, lanes, second);
  }
}

template <int kDtype>
void rope_store(void* qkv_in, int64_t row_stride, int tokens, int num_q_heads, int num_kv_heads, int head_dim,
                const int64_t* positions, const void* cos_in, const void* sin_in, void* k_in, void* v_in,
                int64_t kv_head_stride, const int64_t* slots, int num_threads) {
  using T = typename Elem<kDtype>::type;
  T* qkv = static_cast<T*>(qkv_in);
  const T* cos_table = static_cast<const T*>(cos_in);
  const T* sin_table = static_cast<const T*>(sin_in);
  T* k_pool = static_cast<T*>(k_in);
  T* v_pool = static_cast<T*>(v_in);
  const int half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= kParallelTokens)
  for (int t = 0; t < tokens; ++t) {
    T* row = qkv + t * row_stride;
    const T* cos = cos_table + positions[t] * head_dim;
    const T* sin = sin_table + positions[t] * head_dim;
    for (int h = 0; h < num_q_heads + num_kv_heads; ++h) rotate_head<kDtype>(row + h * head_dim, cos, sin, half);
    const T* keys = row + num_q_heads * head_dim;
    const T* values = keys + num_kv_heads * head_dim;
    const int64_t slot = slots[t] * head_dim;
    for (int h = 0; h < num_kv_heads; ++h) {
      std::memcpy(k_pool + h * kv_head_stride + slot, keys + h * head_dim, sizeof(T) * head_dim);
      std::memcpy(v_pool + h * kv_head_stride + slot, values + h * head_dim, sizeof(T) * head_dim);
    }
  }
}

}  // namespace

extern "C" {

// Rotates the query and key heads of `qkv` ([tokens, (Hq + 2 Hk) * head_dim], rows `row_stride`
// apart) in place by the `cos` / signed `sin` tables ([positions, head_dim]) at `positions`, then
// stores each token's keys and values at its slot of `k` / `v` (head 0 of the layer's head-major
// pool, heads `kv_head_stride` apart). Head dims must be even. 0: done.
int radix_rope_store(int32_t dtype, void* qkv, int64_t row_stride, int32_t tokens, int32_t num_q_heads,
                     int32_t num_kv_heads, int32_t head_dim, const int64_t* positions, const void* cos,
                     const void* sin, void* k, void* v, int64_t kv_head_stride, const int64_t* slots,
                     int32_t num_threads) {
  if (head_dim % 2 != 0) return 2;
  switch (dtype) {
    case kFloat32:
      rope_store<kFloat32>(qkv, row_stride, tokens, num_q_heads, num_kv_heads, head_dim, positions, cos, sin, k, v,
                           kv_head_stride, slots, num_threads);
      return 0;
    case kBFloat16:
      rope_store<kBFloat16>(qkv, row_stride, tokens, num_q_heads, num_kv_heads, head_dim, positions, cos, sin, k,
                            v, kv_head_stride, slots, num_threads);
      return 0;
    case kFloat16:
      rope_store<kFloat16>(qkv, row_stride, tokens, num_q_heads, num_kv_heads, head_dim, positions, cos, sin, k,
                           v, kv_head_stride, slots, num_threads);
      return 0;
    default:
      return 3;
  }
}

}  // extern "C"
