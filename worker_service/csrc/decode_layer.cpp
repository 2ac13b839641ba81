// One decoder layer for a decode step (bfloat16 or float32, one TP rank alone), in one call:
// the same kernels the layer's Python code calls one by one (RMSNorm, the small-batch linear
// layers, RoPE with the K/V write, paged attention, SwiGLU), in the same order on the same
// buffers, so the results are the same bits. What it saves is Python: at one row a layer's
// kernels take ~200 us and the interpreter, module calls and ctypes between them ~50 us more.
// See worker_service/layers/fused_layer.py, which builds the structs below.

#include <cstdint>
#include <cstring>

#include "vector_math.h"

extern "C" {
int radix_rms_norm(int32_t dtype, const void* x, int64_t x_stride, const void* weight, void* out, int32_t rows,
                   int32_t size, float eps, int32_t num_threads);
int radix_add_rms_norm(int32_t dtype, void* residual, const void* delta, const void* weight, void* out,
                       int32_t rows, int32_t size, float eps, int32_t num_threads);
int radix_silu_mul(int32_t dtype, const void* gate_up, void* out, int32_t rows, int32_t features,
                   int32_t num_threads);
int radix_gemv(int32_t dtype, const void* x, int64_t x_stride, int32_t rows, int64_t k, const void* packed, int64_t n,
               const void* bias, void* out, int64_t out_stride, int32_t num_threads);
int radix_rope_store(int32_t dtype, void* qkv, int64_t row_stride, int32_t tokens, int32_t num_q_heads,
                     int32_t num_kv_heads, int32_t head_dim, const int64_t* positions, const void* cos,
                     const void* sin, void* k, void* v, int64_t kv_head_stride, const int64_t* slots,
                     int32_t num_threads);
int radix_paged_attention(const void* plan, const void* schedule, const void* q, const void* k, const void* v,
                          void* out, const float* sinks);
}

extern "C" {

// What does not change between steps: one layer's shapes, weights (packed for radix_gemv) and pool.
struct LayerWeights {
  int32_t dtype;  // of weights, pool and activations (native_plan.DTYPE_CODES)
  int32_t hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
  float input_eps, post_eps;
  const void* input_norm;
  const void* post_norm;
  const void* qkv;
  const void* qkv_bias;  // null: none
  const void* o_proj;
  const void* gate_up;
  const void* down;
  void* k_pool;  // head 0 of the layer's pool; heads kv_head_stride apart
  void* v_pool;
  int64_t kv_head_stride;
};

// What one step shares across layers: its rows, where they write and read, and scratch space.
struct StepArgs {
  int32_t rows, num_threads;
  const int64_t* positions;
  const int64_t* write_slots;
  const void* cos;  // RoPE tables [positions, head_dim]
  const void* sin;
  const void* plan;  // the attention kernel's plan and schedule, bound to this layout
  const void* schedule;
  void* normed;    // [rows, hidden]
  void* qkv;       // [rows, (Hq + 2 Hk) * head_dim]
  void* attended;  // [rows, Hq * head_dim]
  void* delta;     // [rows, hidden]
  void* gate_up;   // [rows, 2 * intermediate]
  void* act;       // [rows, intermediate]
};

// hidden [rows, H]: the previous layer's MLP output, replaced by this layer's; residual [rows, H]:
// the residual stream, updated. With `first`, `hidden` holds the embeddings and `residual` is
// set to them. 0: done; otherwise the failing kernel's status.
int radix_decode_layer(const LayerWeights* w, const StepArgs* s, void* hidden, void* residual, int32_t first) {
  const int32_t rows = s->rows, threads = s->num_threads, h = w->hidden, d = w->head_dim, dtype = w->dtype;
  const int32_t q_width = w->num_q_heads * d, qkv_width = (w->num_q_heads + 2 * w->num_kv_heads) * d;
  int status = 0;
  if (first) {
    const size_t value_bytes = dtype == radix::kFloat32 ? 4 : 2;
    std::memcpy(residual, hidden, static_cast<size_t>(rows) * h * value_bytes);
    status = radix_rms_norm(dtype, residual, h, w->input_norm, s->normed, rows, h, w->input_eps, threads);
  } else {
    status = radix_add_rms_norm(dtype, residual, hidden, w->input_norm, s->normed, rows, h, w->input_eps,
                                threads);
  }
  if (status) return status;
  if ((status = radix_gemv(dtype, s->normed, h, rows, h, w->qkv, qkv_width, w->qkv_bias, s->qkv, qkv_width, threads)))
    return status;
  if ((status = radix_rope_store(dtype, s->qkv, qkv_width, rows, w->num_q_heads, w->num_kv_heads, d, s->positions,
                                 s->cos, s->sin, w->k_pool, w->v_pool, w->kv_head_stride, s->write_slots, threads)))
    return status;
  if ((status = radix_paged_attention(s->plan, s->schedule, s->qkv, w->k_pool, w->v_pool, s->attended, nullptr)))
    return status;
  if ((status = radix_gemv(dtype, s->attended, q_width, rows, q_width, w->o_proj, h, nullptr, s->delta, h, threads)))
    return status;
  if ((status = radix_add_rms_norm(dtype, residual, s->delta, w->post_norm, s->normed, rows, h, w->post_eps,
                                   threads)))
    return status;
  const int32_t f = w->intermediate;
  if ((status = radix_gemv(dtype, s->normed, h, rows, h, w->gate_up, 2 * f, nullptr, s->gate_up, 2 * f, threads)))
    return status;
  if ((status = radix_silu_mul(dtype, s->gate_up, s->act, rows, f, threads))) return status;
  return radix_gemv(dtype, s->act, f, rows, f, w->down, h, nullptr, hidden, h, threads);
}

}  // extern "C"
