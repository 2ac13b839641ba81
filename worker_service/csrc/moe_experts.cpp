// A mixture-of-experts layer's experts in one call, for AVX2 + FMA (see native/moe_kernels.py).
//
// radix_moe_experts: for rows x [T, H] routed to experts_ids [T, top_k] with route weights
// [T, top_k], out[t] = sum_j weight[t, j] * down_e (silu(gate_e x[t]) * up_e x[t]), e = ids[t, j],
// over the experts' stacked weights gate_up [E, 2I, H] (the gate's I features, then the up's) and
// down [E, H, I], float32 or bfloat16, in float32 arithmetic. Optionally (GPT-OSS's experts)
// float32 biases gate_up_bias [E, 2I] and down_bias [E, H] (each may be null), and the clamped
// SwiGLU (clamp > 0): gate clamped above at `clamp`, up to [-clamp, clamp], then
// (up + 1) * gate * sigmoid(alpha * gate) in place of silu(gate) * up. The (row, choice) pairs are grouped
// by expert (a counting sort, stable: the order PyTorch's grouped path takes) and each expert
// multiplies its rows a tile of up to kTile at a time, so a weight byte is read once per tile.
// Two phases over the threads: the SwiGLU middle [pairs, I] split by (expert, feature chunk),
// then the down products split by output features, each thread adding every routed expert's
// weighted products into its own features of out (no two threads write one float).
// Like quant_gemv.cpp this is a library of its own: it needs AVX2 and FMA only. Built (for the
// machine's own CPU) where AVX-512 BF16 is, bfloat16 weights multiply bfloat16 activations by its
// pair products (dots_bf16): the rows and the SwiGLU middle rounded to bfloat16 once (a bfloat16
// model's rows are bfloat16 already; the middle is rounded as PyTorch's products round it), the
// sums in float32, sixteen lanes of pairs where the AVX2 path has eight lanes of single products.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx2_sum.h"

namespace {

constexpr int kFloat32 = 0;
constexpr int kBFloat16 = 1;
constexpr int kTile = 4;        // rows sharing one pass over an expert's weight (AVX2: 16 registers)
constexpr int kPairTile = 8;    // the same with AVX-512 BF16's pair products (32 registers)
constexpr int kMaxTile = 8;
constexpr int64_t kChunk = 16;  // features a thread takes at a time
// Weight bytes read per thread at least: a thread more than that costs more in its start and
// barriers than it saves (and, on a loaded machine, a descheduled thread stalls the others).
constexpr int64_t kBytesPerThread = int64_t(1) << 20;

using radix_avx2::hsum;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// dot[f][r] = w[f] . x[r] over k, for NF weight rows (stride w_stride) and R activation rows.
template <typename W, int NF, int R>
void dots(const W* w, int64_t w_stride, const float* const* x, int64_t k, float (*dot)[kMaxTile]) {
  __m256 acc[NF][R];
  for (int f = 0; f < NF; ++f)
    for (int r = 0; r < R; ++r) acc[f][r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x[r] + c);
    for (int f = 0; f < NF; ++f) {
      // The next NF rows' line at this column: the rows of a few-row product come from memory,
      // and the hardware prefetcher alone leaves the reads well under the bandwidth.
      _mm_prefetch(reinterpret_cast<const char*>(w + (f + NF) * w_stride + c), _MM_HINT_T0);
      const __m256 wv = load8(w + f * w_stride + c);
      for (int r = 0; r < R; ++r) acc[f][r] = _mm256_fmadd_ps(wv, xv[r], acc[f][r]);
    }
  }
  for (int f = 0; f < NF; ++f)
    for (int r = 0; r < R; ++r) {
      float sum = hsum(acc[f][r]);
      for (int64_t i = c; i < k; ++i) sum += to_float(w[f * w_stride + i]) * x[r][i];
      dot[f][r] = sum;
    }
}

// dot[n - n0][r] for the weight rows n0 .. n1 - 1, `count` (1..kTile) activation rows.
template <typename W, int R>
void tile_dots(const W* w, int64_t k, int64_t n0, int64_t n1, const float* const* x, float (*dot)[kMaxTile]) {
  constexpr int NF = R <= 2 ? 4 : 2;  // accumulators that fit the 16 registers with the loads
  int64_t n = n0;
  for (; n + NF <= n1; n += NF) dots<W, NF, R>(w + n * k, k, x, k, dot + (n - n0));
  for (; n < n1; ++n) dots<W, 1, R>(w + n * k, k, x, k, dot + (n - n0));
}

template <typename W>
void rows_dots(const W* w, int64_t k, int64_t n0, int64_t n1, const float* const* x, int count,
               float (*dot)[kMaxTile]) {
  switch (count) {
    case 1: tile_dots<W, 1>(w, k, n0, n1, x, dot); break;
    case 2: tile_dots<W, 2>(w, k, n0, n1, x, dot); break;
    case 3: tile_dots<W, 3>(w, k, n0, n1, x, dot); break;
    default: tile_dots<W, 4>(w, k, n0, n1, x, dot); break;
  }
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

inline uint16_t to_bf16(float v) {  // round to nearest even (no NaN among the products)
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// dot[f][r] = w[f] . x[r] over k bfloat16 values, NF weight rows by R activation rows, 32 values a step.
template <int NF, int R>
void dots_bf16(const uint16_t* w, int64_t w_stride, const uint16_t* const* x, int64_t k, float (*dot)[kMaxTile]) {
  __m512 acc[NF][R];
  for (int f = 0; f < NF; ++f)
    for (int r = 0; r < R; ++r) acc[f][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    const __mmask32 mask = k - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - c)) - 1;
    __m512bh xv[R];
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + c);
    for (int f = 0; f < NF; ++f) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (f + NF) * w_stride + c), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + f * w_stride + c);
      for (int r = 0; r < R; ++r) acc[f][r] = _mm512_dpbf16_ps(acc[f][r], wv, xv[r]);
    }
  }
  for (int f = 0; f < NF; ++f)
    for (int r = 0; r < R; ++r) dot[f][r] = _mm512_reduce_add_ps(acc[f][r]);
}

template <int R>
void tile_dots_bf16(const uint16_t* w, int64_t k, int64_t n0, int64_t n1, const uint16_t* const* x,
                    float (*dot)[kMaxTile]) {
  constexpr int NF = R <= 4 ? 4 : 2;  // at most 16 accumulators with the rows and a weight: 32 registers
  int64_t n = n0;
  for (; n + NF <= n1; n += NF) dots_bf16<NF, R>(w + n * k, k, x, k, dot + (n - n0));
  for (; n < n1; ++n) dots_bf16<1, R>(w + n * k, k, x, k, dot + (n - n0));
}

void rows_dots(const uint16_t* w, int64_t k, int64_t n0, int64_t n1, const uint16_t* const* x, int count,
               float (*dot)[kMaxTile]) {
  switch (count) {
    case 1: tile_dots_bf16<1>(w, k, n0, n1, x, dot); break;
    case 2: tile_dots_bf16<2>(w, k, n0, n1, x, dot); break;
    case 3: tile_dots_bf16<3>(w, k, n0, n1, x, dot); break;
    case 4: tile_dots_bf16<4>(w, k, n0, n1, x, dot); break;
    case 5: tile_dots_bf16<5>(w, k, n0, n1, x, dot); break;
    case 6: tile_dots_bf16<6>(w, k, n0, n1, x, dot); break;
    case 7: tile_dots_bf16<7>(w, k, n0, n1, x, dot); break;
    default: tile_dots_bf16<8>(w, k, n0, n1, x, dot); break;
  }
}
#else
constexpr bool kBf16Dot = false;
inline uint16_t to_bf16(float) { return 0; }
#endif

struct Routed {
  std::vector<int64_t> experts;  // the experts with rows, ascending
  std::vector<int64_t> starts;   // experts[i]'s pairs: order[starts[i] .. starts[i + 1])
  std::vector<int64_t> order;    // (row * top_k + choice) pairs grouped by expert
};

// What an expert does beyond down(silu(gate) * up): its biases (null: none) and clamped SwiGLU.
struct Extras {
  const float* gate_up_bias;  // [E, 2I] or null
  const float* down_bias;     // [E, H] or null
  float clamp;                // > 0: GPT-OSS's clamped SwiGLU with `alpha`; else silu(gate) * up
  float alpha;
};

inline float activate(float g, float u, const Extras& extras) {
  if (extras.clamp > 0.f) {
    g = std::min(g, extras.clamp);
    u = std::min(std::max(u, -extras.clamp), extras.clamp);
    return (u + 1.f) * (g / (1.f + std::exp(-extras.alpha * g)));
  }
  return g / (1.f + std::exp(-g)) * u;
}

template <typename W>
void run(const float* x_in, int64_t rows, int64_t hidden, const float* route_weights,
         int64_t top_k, const W* gate_up, const W* down, int64_t inter, const Routed& routed, float* out,
         int threads, const Extras& extras) {
  // The activations as the products take them: bfloat16 where bfloat16 weights have the pair
  // products (the module doc), else float32.
  constexpr bool kPairs = std::is_same_v<W, uint16_t> && kBf16Dot;
  constexpr int kRows = kPairs ? kPairTile : kTile;  // rows a pass over the weights takes
  using A = std::conditional_t<kPairs, uint16_t, float>;
  const int64_t num_routed = int64_t(routed.experts.size());
  const int64_t inter_chunks = (inter + kChunk - 1) / kChunk;
  const int64_t hidden_chunks = (hidden + kChunk - 1) / kChunk;
  std::vector<A> rounded(kPairs ? rows * hidden : 0);
  if constexpr (kPairs)
    for (int64_t i = 0; i < rows * hidden; ++i) rounded[i] = to_bf16(x_in[i]);
  const A* x = nullptr;
  if constexpr (kPairs) x = rounded.data(); else x = x_in;
  std::vector<A> middle(rows * top_k * inter);  // by pair index (row * top_k + choice)
  std::fill(out, out + rows * hidden, 0.f);
  const int64_t bytes = num_routed * 3 * inter * hidden * int64_t(sizeof(W));
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, bytes / kBytesPerThread)));
#pragma omp parallel num_threads(threads)
  {
    float gate[kChunk][kMaxTile], up[kChunk][kMaxTile], dot[kChunk][kMaxTile];
    const A* xs[kMaxTile];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_routed * inter_chunks; ++item) {
      const int64_t i = item / inter_chunks, f0 = item % inter_chunks * kChunk;
      const int64_t f1 = std::min(inter, f0 + kChunk);
      const W* w = gate_up + routed.experts[i] * 2 * inter * hidden;
      for (int64_t p = routed.starts[i]; p < routed.starts[i + 1]; p += kRows) {
        const int count = int(std::min<int64_t>(kRows, routed.starts[i + 1] - p));
        for (int r = 0; r < count; ++r) xs[r] = x + routed.order[p + r] / top_k * hidden;
        rows_dots(w, hidden, f0, f1, xs, count, gate);
        rows_dots(w, hidden, inter + f0, inter + f1, xs, count, up);
        const float* bias = extras.gate_up_bias ? extras.gate_up_bias + routed.experts[i] * 2 * inter : nullptr;
        for (int r = 0; r < count; ++r) {
          A* m = middle.data() + routed.order[p + r] * inter;
          for (int64_t f = f0; f < f1; ++f) {
            const float g = gate[f - f0][r] + (bias ? bias[f] : 0.f);
            const float u = up[f - f0][r] + (bias ? bias[inter + f] : 0.f);
            if constexpr (kPairs) m[f] = to_bf16(activate(g, u, extras)); else m[f] = activate(g, u, extras);
          }
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < hidden_chunks; ++chunk) {
      const int64_t n0 = chunk * kChunk, n1 = std::min(hidden, n0 + kChunk);
      for (int64_t i = 0; i < num_routed; ++i) {
        const W* w = down + routed.experts[i] * hidden * inter;
        const float* bias = extras.down_bias ? extras.down_bias + routed.experts[i] * hidden : nullptr;
        for (int64_t p = routed.starts[i]; p < routed.starts[i + 1]; p += kRows) {
          const int count = int(std::min<int64_t>(kRows, routed.starts[i + 1] - p));
          for (int r = 0; r < count; ++r) xs[r] = middle.data() + routed.order[p + r] * inter;
          rows_dots(w, inter, n0, n1, xs, count, dot);
          for (int r = 0; r < count; ++r) {
            const int64_t pair = routed.order[p + r];
            float* o = out + pair / top_k * hidden;
            const float weight = route_weights[pair];
            for (int64_t n = n0; n < n1; ++n) o[n] += weight * (dot[n - n0][r] + (bias ? bias[n] : 0.f));
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int radix_moe_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

// Rows of one expert that share a pass over its weights, for weights of `dtype`.
int radix_moe_rows_per_pass(int dtype) { return dtype == kBFloat16 && kBf16Dot ? kPairTile : kTile; }

// Status: 0 done; 1 a bad shape or dtype; 2 an expert id outside 0 .. num_experts - 1.
// `gate_up_bias`, `down_bias`: float32, or null; `clamp` > 0 with `alpha`: the clamped SwiGLU.
int radix_moe_experts(int dtype, const float* x, int64_t rows, int64_t hidden, const int64_t* expert_ids,
                      const float* route_weights, int64_t top_k, int64_t num_experts, const void* gate_up,
                      const void* down, int64_t inter, float* out, int threads, const float* gate_up_bias,
                      const float* down_bias, float clamp, float alpha) {
  if ((dtype != kFloat32 && dtype != kBFloat16) || rows < 0 || hidden <= 0 || top_k <= 0 || num_experts <= 0 ||
      inter <= 0)
    return 1;
  const int64_t pairs = rows * top_k;
  std::vector<int64_t> counts(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (expert_ids[p] < 0 || expert_ids[p] >= num_experts) return 2;
    ++counts[expert_ids[p] + 1];
  }
  Routed routed;
  routed.order.resize(pairs);
  routed.starts.push_back(0);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (counts[e + 1] > 0) {
      routed.experts.push_back(e);
      routed.starts.push_back(routed.starts.back() + counts[e + 1]);
    }
    counts[e + 1] += counts[e];  // counts[e]: where expert e's pairs start
  }
  for (int64_t p = 0; p < pairs; ++p) routed.order[counts[expert_ids[p]]++] = p;
  const Extras extras{gate_up_bias, down_bias, clamp, alpha};
  if (dtype == kFloat32)
    run(x, rows, hidden, route_weights, top_k, static_cast<const float*>(gate_up),
        static_cast<const float*>(down), inter, routed, out, threads, extras);
  else
    run(x, rows, hidden, route_weights, top_k, static_cast<const uint16_t*>(gate_up),
        static_cast<const uint16_t*>(down), inter, routed, out, threads, extras);
  return 0;
}

}  // extern "C"
