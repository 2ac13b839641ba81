// One Llama decoder layer for a decode step with quantized linear weights, for AVX2 + FMA, in one
// call: RMSNorm, the merged q/k/v product, RoPE, the new K/V written into the paged pool, paged
// attention of each row over its own pages, o_proj, residual add + RMSNorm, merged gate/up,
// SwiGLU, down. Activations are float32 throughout (the pool may hold bfloat16: K/V are widened
// when read and rounded to nearest-even when written, as a PyTorch cast rounds); the products
// are radix_quant_gemv's (quant_gemv.cpp, linked into the same library), or with the step's
// `int8_activations` radix_quant_gemv_int8_activations' (quant_gemv_int8.cpp).
//
// radix_quant_decode_layers runs a step's layers in one OpenMP parallel region: its threads split
// each product's output features, the attention's (row, head) pairs and SwiGLU's values, one
// thread computes the other per-row parts (norms, RoPE, the K/V writes), and they meet at team.h's
// barriers, which spin briefly before sleeping. A region per product instead (as the products'
// own entry points run) wakes the sleeping threads some 120 times a step.
//
// It is the machines without AVX-512 (where decode_layer.cpp's library does not build) whose
// decode steps it serves: there a step of the PyTorch backend spends most of its time between
// ops, not in them. See worker_service/backends/fused_quant_llama.py, which builds the structs.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <atomic>
#include <memory>

#include "avx2_sum.h"
#include "quant_plan.h"
#include "team.h"

namespace {

constexpr int32_t kPoolFloat32 = 0;
constexpr int32_t kPoolBFloat16 = 1;
constexpr int32_t kMaxHeadDim = 256;

using radix_avx2::hsum;

// 8 pool values at `p` (float32 or bfloat16) as float32.
inline __m256 load8(const void* p, int32_t dtype) {
  if (dtype == kPoolFloat32) return _mm256_loadu_ps(static_cast<const float*>(p));
  const __m128i half = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline uint16_t to_bf16(float value) {  // round to nearest even, as torch's cast (no NaNs here)
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

extern "C" {

// One quantized product's operands (quant/format.py's layout; quant/kernels.py's format codes).
struct QuantLinearArgs {
  int32_t format;
  const void* values;
  const float* scales;
  const float* offsets;  // null: none (int8)
  const float* bias;     // null: none
  int64_t n, k, group_size;
};

// What does not change between steps: one layer's shapes, weights and pool.
struct QuantLayerWeights {
  int32_t hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
  int32_t pool_dtype;  // kPoolFloat32 or kPoolBFloat16
  float input_eps, post_eps;
  const float* input_norm;  // float32 copies
  const float* post_norm;
  QuantLinearArgs qkv, o_proj, gate_up, down;
  void* k_pool;  // head 0 of the layer's pool [Hk, slots, D]; heads kv_head_stride values apart
  void* v_pool;
  int64_t kv_head_stride;
};

// What one step shares across layers: its decode rows, their pages, and float32 scratch space.
struct QuantStepArgs {
  int32_t rows, num_threads, page_size, max_pages;
  const int64_t* positions;     // [rows]: the new token's position (its context is positions + 1)
  const int64_t* write_slots;   // [rows]
  const int64_t* page_tables;   // [rows, max_pages]
  const float* cos;             // RoPE tables [positions, D], signed sin (layers/rotary.py)
  const float* sin;
  float softmax_scale;
  float* normed;    // [rows, hidden]
  float* qkv;       // [rows, (Hq + 2 Hk) D]
  float* attended;  // [rows, Hq D]
  float* gate_up;   // [rows, 2 I]
  float* act;       // [rows, I]
  int32_t int8_activations;  // 1: the products quantize their activations to 8 bits (quant_gemv_int8.cpp)
};

}  // extern "C"

namespace {

void rms_norm(const float* x, const float* weight, float* out, int32_t size, float eps) {
  double sum = 0.0;
  for (int32_t i = 0; i < size; ++i) sum += double(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(float(sum / size) + eps);
  for (int32_t i = 0; i < size; ++i) out[i] = x[i] * inv * weight[i];
}

// x * cos + roll(x, D/2) * signed sin, for one head in place.
void rotate(float* x, const float* cos, const float* sin, int32_t d) {
  float rolled[kMaxHeadDim];
  const int32_t half = d / 2;
  for (int32_t i = 0; i < d; ++i) rolled[i] = x[(i + half) % d];
  for (int32_t i = 0; i < d; ++i) x[i] = x[i] * cos[i] + rolled[i] * sin[i];
}

void store(void* pool, int32_t dtype, int64_t offset, const float* values, int32_t d) {
  if (dtype == kPoolFloat32) {
    std::memcpy(static_cast<float*>(pool) + offset, values, sizeof(float) * d);
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(pool) + offset;
  for (int32_t i = 0; i < d; ++i) out[i] = to_bf16(values[i]);
}

// One q head of one row over its context, with an online softmax: out[D] = softmax(q K^T * scale) V.
void attend_head(const QuantLayerWeights& w, const QuantStepArgs& s, int32_t row, int32_t head, float* out) {
  const int32_t d = w.head_dim, dtype = w.pool_dtype, ps = s.page_size;
  const int32_t kv_head = head / (w.num_q_heads / w.num_kv_heads);
  const int32_t qkv_width = (w.num_q_heads + 2 * w.num_kv_heads) * d;
  const float* q = s.qkv + int64_t(row) * qkv_width + int64_t(head) * d;
  const int64_t length = s.positions[row] + 1;
  const int64_t* table = s.page_tables + int64_t(row) * s.max_pages;
  const size_t value_bytes = dtype == kPoolFloat32 ? 4 : 2;
  const char* k_head = static_cast<const char*>(w.k_pool) + kv_head * w.kv_head_stride * value_bytes;
  const char* v_head = static_cast<const char*>(w.v_pool) + kv_head * w.kv_head_stride * value_bytes;
  const int32_t lanes = d / 8;
  __m256 qv[kMaxHeadDim / 8], acc[kMaxHeadDim / 8];
  const __m256 scale = _mm256_set1_ps(s.softmax_scale);
  for (int32_t j = 0; j < lanes; ++j) {
    qv[j] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * j), scale);
    acc[j] = _mm256_setzero_ps();
  }
  float running_max = -INFINITY, total = 0.f;
  float scores[64];
  for (int64_t start = 0; start < length; start += ps) {
    const int32_t count = int32_t(std::min<int64_t>(ps, length - start));
    const int64_t slot0 = table[start / ps] * ps;
    float block_max = -INFINITY;
    for (int32_t t = 0; t < count; ++t) {
      const char* key = k_head + (slot0 + t) * d * value_bytes;
      __m256 dot = _mm256_setzero_ps();
      for (int32_t j = 0; j < lanes; ++j) dot = _mm256_fmadd_ps(qv[j], load8(key + 8 * j * value_bytes, dtype), dot);
      scores[t] = hsum(dot);
      block_max = std::max(block_max, scores[t]);
    }
    if (block_max > running_max) {
      const __m256 rescale = _mm256_set1_ps(std::exp(running_max - block_max));
      total *= std::exp(running_max - block_max);
      for (int32_t j = 0; j < lanes; ++j) acc[j] = _mm256_mul_ps(acc[j], rescale);
      running_max = block_max;
    }
    for (int32_t t = 0; t < count; ++t) {
      const float p = std::exp(scores[t] - running_max);
      total += p;
      const __m256 pv = _mm256_set1_ps(p);
      const char* value = v_head + (slot0 + t) * d * value_bytes;
      for (int32_t j = 0; j < lanes; ++j)
        acc[j] = _mm256_fmadd_ps(pv, load8(value + 8 * j * value_bytes, dtype), acc[j]);
    }
  }
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (int32_t j = 0; j < lanes; ++j) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc[j], inv));
}

}  // namespace

extern "C" {

int radix_quant_layer_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"

namespace {

// What the team's threads share while they run a step.
struct Shared {
  radix_team::Barrier barrier;
  std::unique_ptr<radix_quant::Plan> plan;  // the product being computed
  std::atomic<int64_t> next_task{0};        // attention's next (row, head) pair
  int status = 0;                           // nonzero: a product refused its arguments; all stop
};

// out = x @ w^T for the step's rows: one thread prepares the activations, all compute features.
// Returns the product's status, the same on every thread.
int product(const radix_team::Team& team, Shared& shared, const QuantLinearArgs& w, const QuantStepArgs& s,
            const float* x, float* out) {
  if (team.index == 0) {
    const radix_quant::ProductArgs args{w.format, x, s.rows, w.k, w.values, w.scales, w.offsets,
                                        w.n, w.k, w.group_size, w.bias, out, w.n};
    shared.plan = s.int8_activations ? radix_quant::plan_int8_activations(args, &shared.status)
                                     : radix_quant::plan_float(args, &shared.status);
  }
  team.sync();
  if (shared.status) return shared.status;
  int64_t begin, end;
  team.share(shared.plan->chunks(), &begin, &end);
  for (int64_t chunk = begin; chunk < end; ++chunk) shared.plan->run(chunk);
  team.sync();
  return 0;
}

// One layer (the entry point's comment) on every thread of the team; the same status on each.
int layer(const radix_team::Team& team, Shared& shared, const QuantLayerWeights& w, const QuantStepArgs& s,
          float* hidden, float* residual, bool first) {
  const int32_t rows = s.rows, h = w.hidden, d = w.head_dim;
  const int32_t hq = w.num_q_heads, hk = w.num_kv_heads, qkv_width = (hq + 2 * hk) * d;
  const bool lead = team.index == 0;
  if (lead) {
    for (int32_t r = 0; r < rows; ++r) {
      float* res = residual + int64_t(r) * h;
      const float* x = hidden + int64_t(r) * h;
      if (first) {
        std::memcpy(res, x, sizeof(float) * h);
      } else {
        for (int32_t i = 0; i < h; ++i) res[i] += x[i];
      }
      rms_norm(res, w.input_norm, s.normed + int64_t(r) * h, h, w.input_eps);
    }
  }
  int status = product(team, shared, w.qkv, s, s.normed, s.qkv);
  if (status) return status;
  if (lead) {
    for (int32_t r = 0; r < rows; ++r) {
      float* row = s.qkv + int64_t(r) * qkv_width;
      const float* cos = s.cos + s.positions[r] * d;
      const float* sin = s.sin + s.positions[r] * d;
      for (int32_t head = 0; head < hq + hk; ++head) rotate(row + int64_t(head) * d, cos, sin, d);
      for (int32_t head = 0; head < hk; ++head) {
        const int64_t offset = head * w.kv_head_stride + s.write_slots[r] * d;
        store(w.k_pool, w.pool_dtype, offset, row + int64_t(hq + head) * d, d);
        store(w.v_pool, w.pool_dtype, offset, row + int64_t(hq + hk + head) * d, d);
      }
    }
    shared.next_task.store(0, std::memory_order_relaxed);
  }
  team.sync();
  // Each thread takes the next (row, head) pair until none is left: contexts differ in length.
  const int64_t tasks = int64_t(rows) * hq;
  for (int64_t task; (task = shared.next_task.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
    const int32_t r = int32_t(task / hq), head = int32_t(task % hq);
    attend_head(w, s, r, head, s.attended + int64_t(r) * hq * d + int64_t(head) * d);
  }
  team.sync();
  if ((status = product(team, shared, w.o_proj, s, s.attended, hidden))) return status;
  if (lead) {
    for (int32_t r = 0; r < rows; ++r) {
      float* res = residual + int64_t(r) * h;
      const float* x = hidden + int64_t(r) * h;
      for (int32_t i = 0; i < h; ++i) res[i] += x[i];
      rms_norm(res, w.post_norm, s.normed + int64_t(r) * h, h, w.post_eps);
    }
  }
  if ((status = product(team, shared, w.gate_up, s, s.normed, s.gate_up))) return status;
  // SwiGLU, element by element: each thread takes its share of the step's rows x I values.
  const int32_t f = w.intermediate;
  int64_t begin, end;
  team.share(int64_t(rows) * f, &begin, &end);
  for (int64_t e = begin; e < end; ++e) {
    const float* gate = s.gate_up + (e / f) * 2 * f + e % f;
    s.act[e] = gate[0] / (1.f + std::exp(-gate[0])) * gate[f];
  }
  team.sync();
  return product(team, shared, w.down, s, s.act, hidden);
}

}  // namespace

extern "C" {

// A decode step's `count` layers (`layers`, from the model's first, in order). hidden [rows, H]
// float32: the embeddings, replaced by the last layer's MLP output; residual [rows, H] float32:
// the residual stream out of the last layer (its contents on entry are not read). 0: done; 3: a
// shape this code does not take; else the failing product's status.
int radix_quant_decode_layers(const QuantLayerWeights* const* layers, int32_t count, const QuantStepArgs* sp,
                              float* hidden, float* residual) {
  const QuantStepArgs& s = *sp;
  for (int32_t i = 0; i < count; ++i) {
    const QuantLayerWeights& w = *layers[i];
    if (w.head_dim % 8 || w.head_dim > kMaxHeadDim || s.page_size > 64 || w.num_q_heads % w.num_kv_heads) return 3;
  }
  Shared shared;
  const int threads = std::max(1, s.num_threads);
  int result = 0;
#pragma omp parallel num_threads(threads)
  {
    const radix_team::Team team{omp_get_thread_num(), omp_get_num_threads(), &shared.barrier};
    int status = 0;
    for (int32_t i = 0; i < count && status == 0; ++i)
      status = layer(team, shared, *layers[i], s, hidden, residual, i == 0);
    if (team.index == 0) result = status;
  }
  return result;
}

}  // extern "C"
