// Products with quantized weights over activations quantized to 8 bits, for AVX2 (no VNNI).
//
// radix_quant_gemv_int8_activations: radix_quant_gemv's product (quant_gemv.cpp, same arguments)
// with each activation row first quantized once per call, per block of 32 columns: d = max|x| /
// 127, q = round-half-even(x * (1 / d)) (0 where the block is all zeros), so x stands for q * d;
// the weight is then multiplied in integers: for int4, the unsigned nibbles (0..15) times the
// signed q by `_mm256_maddubs_epi16` (pairs into int16, at most 2 * 15 * 127) and
// `_mm256_madd_epi16` with ones (into int32, four columns a lane); for int8 the same with |w|
// and q carrying w's sign (`_mm256_sign_epi8`; |q| <= 127, so no pair reaches int16's limit).
// Each lane's int32 sum is scaled by its weight group's scale times its block's d; int4's offsets
// are added once per output as their dot product with each group's sum of q * d. The result is the
// float32 product over the dequantized weight of x rounded as above (the reference in
// tests/worker/test_quant_int8_activations.py), summed in another order.
// It takes int4 in any multiple of 32 columns a group and any K, and int8 in groups of 16 or a
// multiple of 32 columns with K a multiple of 32 and no offsets; other products are radix_quant_gemv's.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "avx2_sum.h"
#include "quant_plan.h"

namespace {

constexpr int kInt8 = 0;
constexpr int kInt4 = 1;
using radix_quant::kChunk;
constexpr int kTile = 4;        // activation rows sharing one pass over the weight
constexpr int kBlock = 32;      // columns per activation block (and per packed int4 block)
constexpr int kSpan = 2 * kBlock;  // int4 columns one 256-bit load of packed values holds

using radix_avx2::dot;
using radix_avx2::hsum;

// Rows of activations quantized per block (see the file's comment).
struct Activations {
  std::vector<int8_t> q;  // int4: per span 64 bytes, the low nibbles' columns (0..15 of both
                          // blocks) then the high nibbles' (16..31); int8: columns in order
  std::vector<float> d;   // int4: per span 8 lanes, each its block's d; int8: per block
  std::vector<float> sums;  // int4: [rows, num_groups], each group's sum of q * d (for the offsets)
  int64_t row_q = 0, row_d = 0, num_groups = 0;
};

// One block of up to 32 values (`count`) quantized into q[0, 32) (zeros past count); returns d.
float quantize_block(const float* x, int64_t count, int8_t* q) {
  alignas(32) float v[kBlock] = {};
  std::copy(x, x + count, v);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < kBlock; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_load_ps(v + i), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  const float amax = *std::max_element(lanes, lanes + 8);
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  alignas(32) int32_t ints[kBlock];
  for (int i = 0; i < kBlock; i += 8) {
    const __m256 scaled = _mm256_mul_ps(_mm256_load_ps(v + i), _mm256_set1_ps(id));
    const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints + i), _mm256_cvtps_epi32(rounded));
  }
  for (int i = 0; i < kBlock; ++i) q[i] = int8_t(std::clamp(ints[i], -127, 127));
  return d;
}

// x [rows, k] (row stride x_stride) quantized for `format`'s kernel.
void quantize_rows(int format, const float* x, int64_t rows, int64_t x_stride, int64_t k, int64_t group_size,
                   Activations& a) {
  const int64_t blocks = (k + kBlock - 1) / kBlock, spans = (blocks + 1) / 2;
  a.row_q = format == kInt4 ? spans * kSpan : blocks * kBlock;
  a.row_d = format == kInt4 ? spans * 8 : blocks;
  a.q.assign(rows * a.row_q, 0);
  a.d.assign(rows * a.row_d, 0.f);
  a.num_groups = (k + group_size - 1) / group_size;
  a.sums.assign(format == kInt4 ? rows * a.num_groups : 0, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* q = a.q.data() + r * a.row_q;
    float* d = a.d.data() + r * a.row_d;
    for (int64_t b = 0; b < blocks; ++b) {
      int8_t block[kBlock];
      const float scale = quantize_block(x + r * x_stride + b * kBlock, std::min<int64_t>(kBlock, k - b * kBlock), block);
      if (format == kInt4) {
        int8_t* span = q + (b / 2) * kSpan + (b % 2) * (kBlock / 2);
        std::copy(block, block + kBlock / 2, span);
        std::copy(block + kBlock / 2, block + kBlock, span + kBlock);
        const int64_t lanes = (b / 2) * 8 + (b % 2) * 4;
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) sum += block[i];
        std::fill(d + lanes, d + lanes + 4, scale);
        a.sums[r * a.num_groups + b * kBlock / group_size] += float(sum) * scale;  // int4 groups hold whole blocks
      } else {
        std::copy(block, block + kBlock, q + b * kBlock);
        d[b] = scale;
      }
    }
  }
}

struct Problem {
  const void* values;
  const float* scales;
  const float* offsets;
  int64_t k, group_size, num_groups, blocks, spans, full_spans, row_bytes;
  const int32_t* block_groups;  // [2 * spans]: each block's weight group
  const float* bias;
  float* out;
  int64_t out_stride;
  const Activations* a;
};

// The int32 sums of four columns a lane, of 32 (unsigned) weights times 32 signed activations.
inline __m256i lane_sums(__m256i unsigned_w, __m256i signed_x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_w, signed_x), _mm256_set1_epi16(1));
}

// Row r, output n: the lanes' sums, plus the offsets' dot product with the groups' sums of x.
inline void finish(const Problem& p, int64_t r, int64_t n, __m256 acc) {
  const float shift =
      p.offsets == nullptr ? 0.f : dot(p.offsets + n * p.num_groups, p.a->sums.data() + r * p.num_groups, p.num_groups);
  p.out[r * p.out_stride + n] = hsum(acc) + shift + (p.bias == nullptr ? 0.f : p.bias[n]);
}

// The span's two blocks' values of a per-group table (scales or offsets) in lanes 0-3 and 4-7.
template <bool kPair>
inline __m256 span_pair(const Problem& p, const float* table, int64_t s) {
  if constexpr (kPair) {  // groups of 32: the span's two blocks are groups 2s and 2s + 1
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(table + 2 * s)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  } else {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(table + p.block_groups[2 * s])),
                                _mm_broadcast_ss(table + p.block_groups[2 * s + 1]), 1);
  }
}

// int4: a span (two packed blocks) per 256-bit load; its low nibbles are columns 0..15 of both
// blocks, its high nibbles columns 16..31, matching the activations' span layout. Lanes 0-3 sum
// the first block, lanes 4-7 the second. kHalf: the last span of an odd number of blocks (one
// block, its other half zeros; its scale from the table, as a pair would read past it). R rows
// times F output features (`v`, `scales`: each feature's row of values and scales): a row's
// activations are loaded once for all F features, and each (row, feature) sum is accumulated
// exactly as alone, so the result does not depend on R or F. Several features a pass read as many
// rows of values at once, which the hardware prefetcher follows less well than one: each
// feature's row four passes ahead is prefetched (a hint, so one past the tensor's end is harmless).
template <int R, int F, bool kPair, bool kHalf>
[[gnu::always_inline]] inline void int4_span(const Problem& p, const uint8_t* const (&v)[F],
                                             const float* const (&scales)[F], int64_t r0, int64_t s,
                                             __m256 (&acc)[R][F]) {
  const Activations& a = *p.a;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i xlo[R], xhi[R];
  __m256 d[R];
  for (int r = 0; r < R; ++r) {
    const int8_t* q = a.q.data() + (r0 + r) * a.row_q + s * kSpan;
    xlo[r] = _mm256_loadu_si256((const __m256i*)q);
    xhi[r] = _mm256_loadu_si256((const __m256i*)(q + kBlock));
    d[r] = _mm256_loadu_ps(a.d.data() + (r0 + r) * a.row_d + s * 8);
  }
  for (int f = 0; f < F; ++f) {
    if constexpr (F > 1) _mm_prefetch((const char*)(v[f] + 4 * F * p.row_bytes + s * kBlock), _MM_HINT_T0);
    const __m256i bits = kHalf ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(v[f] + s * kBlock)))
                               : _mm256_loadu_si256((const __m256i*)(v[f] + s * kBlock));
    const __m256i lo = _mm256_and_si256(bits, low), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
    const __m256 scale = span_pair<(kPair && !kHalf)>(p, scales[f], s);
    for (int r = 0; r < R; ++r) {
      const __m256i sums = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo[r]), _mm256_maddubs_epi16(hi, xhi[r])), _mm256_set1_epi16(1));
      acc[r][f] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, d[r]), acc[r][f]);
    }
  }
}

template <int R, int F, bool kPair>
void int4_product(const Problem& p, int64_t r0, int64_t n) {
  const uint8_t* v[F];
  const float* scales[F];
  for (int f = 0; f < F; ++f) {
    v[f] = static_cast<const uint8_t*>(p.values) + (n + f) * p.row_bytes;
    scales[f] = p.scales + (n + f) * p.num_groups;
  }
  __m256 acc[R][F], other[R][F];  // two chains of sums, spans taken in pairs (one row alone waits on each FMA)
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) acc[r][f] = other[r][f] = _mm256_setzero_ps();
  int64_t s = 0;
  for (; s + 2 <= p.full_spans; s += 2) {
    int4_span<R, F, kPair, false>(p, v, scales, r0, s, acc);
    int4_span<R, F, kPair, false>(p, v, scales, r0, s + 1, other);
  }
  if (s < p.full_spans) int4_span<R, F, kPair, false>(p, v, scales, r0, s++, acc);
  if (s < p.spans) int4_span<R, F, kPair, true>(p, v, scales, r0, s, other);
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) finish(p, r0 + r, n + f, _mm256_add_ps(acc[r][f], other[r][f]));
}

// int8 (K a multiple of 32): a block per 256-bit load; groups of 16 give lanes 0-3 and 4-7
// their own scales.
template <int R, bool kSixteen>
inline void int8_block(const Problem& p, const int8_t* v, const float* scales, int64_t r0, int64_t b,
                       __m256 (&acc)[R]) {
  const Activations& a = *p.a;
  const __m256i w = _mm256_loadu_si256((const __m256i*)(v + b * kBlock));
  const __m256i magnitude = _mm256_abs_epi8(w);
  __m256 scale;
  if constexpr (kSixteen) {
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales + 2 * b)));
    scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  } else {
    scale = _mm256_set1_ps(scales[p.block_groups[b]]);
  }
  for (int r = 0; r < R; ++r) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)(a.q.data() + (r0 + r) * a.row_q + b * kBlock));
    const __m256i sums = lane_sums(magnitude, _mm256_sign_epi8(x, w));
    const __m256 d = _mm256_set1_ps(a.d[(r0 + r) * a.row_d + b]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, d), acc[r]);
  }
}

template <int R, bool kSixteen>
void int8_product(const Problem& p, int64_t r0, int64_t n) {
  const int8_t* v = static_cast<const int8_t*>(p.values) + n * p.k;
  const float* scales = p.scales + n * p.num_groups;
  __m256 acc[R], other[R];  // two chains of sums, blocks taken in pairs
  for (int r = 0; r < R; ++r) acc[r] = other[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= p.blocks; b += 2) {
    int8_block<R, kSixteen>(p, v, scales, r0, b, acc);
    int8_block<R, kSixteen>(p, v, scales, r0, b + 1, other);
  }
  if (b < p.blocks) int8_block<R, kSixteen>(p, v, scales, r0, b, acc);
  for (int r = 0; r < R; ++r) finish(p, r0 + r, n, _mm256_add_ps(acc[r], other[r]));
}

// Features [n0, n1) of rows [r0, r0 + R), R <= kTile. int4 takes kTile (row, feature) pairs a
// pass (four features of one row, two of two rows), the rest one feature at a time; int8 one
// feature at a time (its weights stream at the memory's rate already: several features a pass
// measured no faster, and slower without a prefetch).
template <int R>
void tile_features(int format, const Problem& p, int64_t r0, int64_t n0, int64_t n1) {
  constexpr int F = kTile / R;
  const bool pair = p.group_size == kBlock;
  int64_t n = n0;
  if (format == kInt4) {
    if constexpr (F > 1)
      for (; n + F <= n1; n += F) pair ? int4_product<R, F, true>(p, r0, n) : int4_product<R, F, false>(p, r0, n);
    for (; n < n1; ++n) pair ? int4_product<R, 1, true>(p, r0, n) : int4_product<R, 1, false>(p, r0, n);
  } else {
    const bool sixteen = p.group_size == kBlock / 2;
    for (; n < n1; ++n) sixteen ? int8_product<R, true>(p, r0, n) : int8_product<R, false>(p, r0, n);
  }
}

void rows_product(int format, const Problem& p, int64_t r0, int64_t count, int64_t n0, int64_t n1) {
  switch (count) {
    case 1: tile_features<1>(format, p, r0, n0, n1); break;
    case 2: tile_features<2>(format, p, r0, n0, n1); break;
    case 3: tile_features<3>(format, p, r0, n0, n1); break;
    default: tile_features<4>(format, p, r0, n0, n1); break;
  }
}

// Whether this kernel takes the product (the file's comment); else it is radix_quant_gemv's.
bool takes(int format, const float* offsets, int64_t k, int64_t group_size) {
  if (format == kInt4) return offsets != nullptr && group_size % kBlock == 0;
  return format == kInt8 && offsets == nullptr && k % kBlock == 0 &&
         (group_size == kBlock / 2 || group_size % kBlock == 0);
}

// The activations of one call quantized (radix_quant::plan_int8_activations).
class Int8Plan final : public radix_quant::Plan {
 public:
  explicit Int8Plan(const radix_quant::ProductArgs& a) : Plan(a.n), format_(a.format), rows_(a.rows) {
    quantize_rows(a.format, a.x, a.rows, a.x_stride, a.k, a.group_size, activations_);
    const int64_t k = a.k, blocks = (k + kBlock - 1) / kBlock, spans = (blocks + 1) / 2;
    const int64_t num_groups = (k + a.group_size - 1) / a.group_size;
    block_groups_ = radix_quant::block_groups(k, a.group_size);
    p_ = Problem{a.values, a.scales, a.offsets, k, a.group_size, num_groups, blocks, spans, blocks / 2,
                 blocks * (kBlock / 2), block_groups_.data(), a.bias, a.out, a.out_stride, &activations_};
  }

  void run(int64_t chunk) const override {
    const int64_t n1 = std::min(n_, (chunk + 1) * kChunk);
    for (int64_t r0 = 0; r0 < rows_; r0 += kTile)
      rows_product(format_, p_, r0, std::min<int64_t>(kTile, rows_ - r0), chunk * kChunk, n1);
  }

 private:
  int format_;
  int64_t rows_;
  Activations activations_;
  std::vector<int32_t> block_groups_;
  Problem p_{};
};

}  // namespace

std::unique_ptr<radix_quant::Plan> radix_quant::plan_int8_activations(const ProductArgs& a, int* status) {
  if (a.rows < 0 || a.n < 0 || a.k <= 0 || a.group_size <= 0 || !takes(a.format, a.offsets, a.k, a.group_size))
    return plan_float(a, status);
  *status = 0;
  return std::make_unique<Int8Plan>(a);
}

extern "C" {

int radix_quant_gemv_int8_activations(int format, const float* x, int64_t rows, int64_t x_stride,
                                      const void* values, const float* scales, const float* offsets, int64_t n,
                                      int64_t k, int64_t group_size, const float* bias, float* out,
                                      int64_t out_stride, int threads) {
  int status = 0;
  const auto plan = radix_quant::plan_int8_activations(
      {format, x, rows, x_stride, values, scales, offsets, n, k, group_size, bias, out, out_stride}, &status);
  if (status) return status;
  const int64_t chunks = plan->chunks();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) plan->run(chunk);
  return 0;
}

}  // extern "C"
