// Products with quantized weights (worker_service/quant/format.py's layouts), for AVX2 + FMA.
//
// radix_quant_gemv: out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]) for a few rows of float32
// activations, the weight dequantized in registers, so a weight byte is read once per tile of up
// to kTile rows; threads split the output features. int8: 8 values widened to float and
// multiplied with FMA, small groups' values scaled first, large groups' sums scaled once (see
// int8_product). int4: 64 values
// (two packed blocks) from one 256-bit load, each nibble position masked in place and converted
// (see span_column) against activations laid out once per call to match, so no value is moved
// between lanes; a span's sum scaled per group, the offsets added once per output as their dot
// product with the groups' sums of x. Every product is value * x in float32 as the plain order
// would compute it; the sums run in another order.
// radix_quant_dequantize: the plain float32 weight, for products too large for the above
// (prefill), which the caller hands to a GEMM.
// This file is its own library (see quant/kernels.py): it needs AVX2 and FMA only, so it
// builds where the AVX-512 kernels of the other sources do not.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "avx2_sum.h"
#include "quant_plan.h"

namespace {

using radix_quant::kChunk;
constexpr int kInt8 = 0;
constexpr int kInt4 = 1;
constexpr int kTile = 4;        // activation rows sharing one pass over the weight
constexpr int kBlock = 32;      // int4 columns per packed block
constexpr int kSpan = 2 * kBlock;  // int4 columns one 256-bit load of packed values holds

using radix_avx2::dot;
using radix_avx2::hsum;

inline int int4_at(const uint8_t* row, int64_t col) {
  const int64_t block = col / kBlock, in = col % kBlock;
  const uint8_t byte = row[block * (kBlock / 2) + (in % (kBlock / 2))];
  return in < kBlock / 2 ? (byte & 0x0F) : (byte >> 4);
}

// The int4 product reads a span of two packed blocks (64 columns, 32 bytes) as eight 32-bit
// lanes of eight nibbles each, and takes nibble t of every lane at once: `bits & (15 << 4t)`
// is value * 16^t, which converts to float exactly (4 significant bits; t = 7 is shifted down
// instead, as its mask would set the sign). Lane j, nibble t holds column
// span_column(j, t) of the span, so the activations are laid out once per call in that order,
// each scaled by 16^-t (exact: a power of two), and every product is value * x exactly as the
// plain order would compute it; only the order of the sums differs.
inline int span_column(int lane, int t) {
  return (lane / 4) * kBlock + 4 * (lane % 4) + t / 2 + (t % 2) * (kBlock / 2);
}

inline float nibble_weight(int t) { return t == 7 ? 1.f : 1.f / float(1 << (4 * t)); }

// x[0, k) in span order (see span_column), each value scaled by its nibble_weight, into `to`
// [spans * kSpan] (zeros past k, which the caller has written).
void lay_out_spans(const float* x, int64_t k, int64_t spans, float* to) {
  for (int64_t s = 0; s < spans; ++s, x += kSpan, to += kSpan) {
    if ((s + 1) * kSpan > k) {  // the last span, cut short
      for (int t = 0; t < 8; ++t)
        for (int lane = 0; lane < 8; ++lane)
          if (s * kSpan + span_column(lane, t) < k) to[8 * t + lane] = x[span_column(lane, t)] * nibble_weight(t);
      continue;
    }
    // Lanes 4 h .. 4 h + 3 of nibble t = 2 j + n hold columns 32 h + 16 n + 4 i + j, i = 0..3:
    // a 4 x 4 transpose of those 16 columns.
    for (int h = 0; h < 2; ++h)
      for (int n = 0; n < 2; ++n) {
        const float* from = x + h * kBlock + n * (kBlock / 2);
        __m128 c0 = _mm_loadu_ps(from), c1 = _mm_loadu_ps(from + 4), c2 = _mm_loadu_ps(from + 8),
               c3 = _mm_loadu_ps(from + 12);
        _MM_TRANSPOSE4_PS(c0, c1, c2, c3);
        const __m128 columns[4] = {c0, c1, c2, c3};
        for (int j = 0; j < 4; ++j) {
          const int t = 2 * j + n;
          _mm_storeu_ps(to + 8 * t + 4 * h, _mm_mul_ps(columns[j], _mm_set1_ps(nibble_weight(t))));
        }
      }
  }
}

inline float sum_of(const float* x, int64_t count) {
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) s = _mm256_add_ps(_mm256_loadu_ps(x + i), s);
  float rest = hsum(s);
  for (; i < count; ++i) rest += x[i];
  return rest;
}

struct Problem {
  int format;
  const float* x;
  int64_t x_stride;
  const void* values;
  const float* scales;
  const float* offsets;
  int64_t k, group_size, num_groups;
  const float* bias;
  float* out;
  int64_t out_stride;
  const float* x_sums;     // [rows, num_groups]: each group's sum of x (int4's offsets)
  const float* x_spans;    // int4: [rows, spans * kSpan], x in span order (see span_column)
  const int32_t* span_groups;  // int4: [spans * 2], the group of each packed block
  int64_t spans, full_spans, row_bytes;
};

inline __m256 widen8(const int8_t* v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
}

// Small groups (GGUF's Q8_0 and Q6_K: 32 and 16 columns) scale the widened values first, each
// value * scale the exact weight the dequantized matrix holds, and add every product straight into
// the row's sums: a group's own sum and scaling would cost about as much as its four FMAs. Large
// groups (a whole row, per output channel) sum value * x per group and scale the sum once. One row
// keeps two chains of sums.
constexpr int64_t kScaledGroupMax = 64;

template <int R>
void int8_product(const Problem& p, int64_t r0, int64_t n) {
  constexpr int C = R == 1 ? 2 : 1;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x + (r0 + r) * p.x_stride;
  __m256 acc[R][C];
  float rest[R];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    rest[r] = 0.f;
  }
  const float* scales = p.scales + n * p.num_groups;
  const int8_t* v = static_cast<const int8_t*>(p.values) + n * p.k;
  const bool scale_values = p.group_size <= kScaledGroupMax;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t c0 = g * p.group_size, c1 = std::min(c0 + p.group_size, p.k);
    const float scale = scales[g];
    const __m256 scale8 = _mm256_set1_ps(scale);
    int64_t c = c0;
    if (scale_values) {
      for (; c + 16 <= c1; c += 16) {
        const __m256 w0 = _mm256_mul_ps(widen8(v + c), scale8), w1 = _mm256_mul_ps(widen8(v + c + 8), scale8);
        for (int r = 0; r < R; ++r) {
          acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + c), acc[r][0]);
          acc[r][C - 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + c + 8), acc[r][C - 1]);
        }
      }
      for (; c + 8 <= c1; c += 8) {
        const __m256 w = _mm256_mul_ps(widen8(v + c), scale8);
        for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[r] + c), acc[r][0]);
      }
      for (; c < c1; ++c)
        for (int r = 0; r < R; ++r) rest[r] += float(v[c]) * scale * x[r][c];
      continue;
    }
    __m256 part[R];
    float tail[R];
    for (int r = 0; r < R; ++r) { part[r] = _mm256_setzero_ps(); tail[r] = 0.f; }
    for (; c + 8 <= c1; c += 8) {
      const __m256 w = widen8(v + c);
      for (int r = 0; r < R; ++r) part[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[r] + c), part[r]);
    }
    for (; c < c1; ++c)
      for (int r = 0; r < R; ++r) tail[r] += float(v[c]) * x[r][c];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_fmadd_ps(part[r], scale8, acc[r][0]);
      rest[r] += scale * tail[r];
    }
  }
  const float bias = p.bias == nullptr ? 0.f : p.bias[n];
  for (int r = 0; r < R; ++r) {
    const float* x_sums = p.x_sums + (r0 + r) * p.num_groups;
    const float offset = p.offsets == nullptr ? 0.f : dot(p.offsets + n * p.num_groups, x_sums, p.num_groups);
    const __m256 sum = C == 2 ? _mm256_add_ps(acc[r][0], acc[r][C - 1]) : acc[r][0];
    p.out[(r0 + r) * p.out_stride + n] = hsum(sum) + rest[r] + offset + bias;
  }
}

// One span of R rows added to sum[r] (R = 1 keeps two chains of sums).
template <int R>
inline void int4_span(__m256i bits, const float* const* xs, __m256 (&sum)[R][2]) {
  constexpr int kChains = R == 1 ? 2 : 1;
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    const __m256i q = t == 7 ? _mm256_srli_epi32(bits, 28)
                             : _mm256_and_si256(bits, _mm256_set1_epi32(0xF << (4 * t)));
    const __m256 w = _mm256_cvtepi32_ps(q);
    for (int r = 0; r < R; ++r)
      sum[r][t % kChains] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[r] + 8 * t), sum[r][t % kChains]);
  }
}

// How a span's lanes find their scales: groups of 32 (a span's two blocks, two scales), groups
// of a multiple of 64 (spans share one scale: summed first, scaled once), any other multiple of
// 32 (each block's group looked up).
enum class Groups { kPair, kWhole, kTable };

template <Groups kGroups>
inline __m256 span_scale(const Problem& p, const float* scales, int64_t s) {
  if constexpr (kGroups == Groups::kPair) {
    // The last span of an odd number of blocks has one block and one scale: a pair would read the
    // float past the row's scales (past the tensor, for the last row), and its zero lanes times a
    // NaN or an infinity found there are NaN. Lanes 4-7 get a zero scale instead.
    if (s >= p.full_spans) return _mm256_zextps128_ps256(_mm_broadcast_ss(scales + 2 * s));
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales + 2 * s)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  } else if constexpr (kGroups == Groups::kWhole) {
    return _mm256_set1_ps(scales[s * kSpan / p.group_size]);
  } else {
    const __m128 first = _mm_broadcast_ss(scales + p.span_groups[2 * s]);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(first), _mm_broadcast_ss(scales + p.span_groups[2 * s + 1]), 1);
  }
}

template <int R, Groups kGroups>
void int4_product(const Problem& p, int64_t r0, int64_t n) {
  constexpr int kChains = R == 1 ? 2 : 1;
  const int64_t spans = p.spans, full_spans = p.full_spans;
  const int64_t step = kGroups == Groups::kWhole ? p.group_size / kSpan : 1;  // spans sharing a scale
  const float* xs[R];
  for (int r = 0; r < R; ++r) xs[r] = p.x_spans + (r0 + r) * spans * kSpan;
  const uint8_t* v = static_cast<const uint8_t*>(p.values) + n * p.row_bytes;
  const float* scales = p.scales + n * p.num_groups;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s0 = 0; s0 < spans; s0 += step) {
    __m256 sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
    const int64_t s1 = kGroups == Groups::kWhole ? std::min(s0 + step, spans) : s0 + 1;
    for (int64_t s = s0; s < s1; ++s) {
      // The last span of an odd number of blocks has one block: its other half reads as zeros.
      const __m256i bits = s < full_spans
                               ? _mm256_loadu_si256((const __m256i*)(v + s * kBlock))
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(v + s * kBlock)));
      int4_span<R>(bits, xs, sum);
      for (int r = 0; r < R; ++r) xs[r] += kSpan;
    }
    const __m256 scale = span_scale<kGroups>(p, scales, s0);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(kChains == 2 ? _mm256_add_ps(sum[r][0], sum[r][1]) : sum[r][0], scale, acc[r]);
  }
  const float bias = p.bias == nullptr ? 0.f : p.bias[n];
  const float* offsets = p.offsets + n * p.num_groups;
  for (int r = 0; r < R; ++r)
    p.out[(r0 + r) * p.out_stride + n] =
        hsum(acc[r]) + dot(offsets, p.x_sums + (r0 + r) * p.num_groups, p.num_groups) + bias;
}

template <int R>
void row_product(const Problem& p, int64_t r0, int64_t n) {
  if (p.format == kInt8)
    int8_product<R>(p, r0, n);
  else if (p.group_size == kBlock)
    int4_product<R, Groups::kPair>(p, r0, n);
  else if (p.group_size % kSpan == 0)
    int4_product<R, Groups::kWhole>(p, r0, n);
  else
    int4_product<R, Groups::kTable>(p, r0, n);
}

void rows_product(const Problem& p, int64_t r0, int64_t count, int64_t n) {
  switch (count) {
    case 1: row_product<1>(p, r0, n); break;
    case 2: row_product<2>(p, r0, n); break;
    case 3: row_product<3>(p, r0, n); break;
    default: row_product<4>(p, r0, n); break;
  }
}

// The activations of one call laid out and summed (radix_quant::plan_float).
class FloatPlan final : public radix_quant::Plan {
 public:
  explicit FloatPlan(const radix_quant::ProductArgs& a) : Plan(a.n) {
    const int64_t k = a.k, group_size = a.group_size, num_groups = (k + group_size - 1) / group_size;
    const int64_t blocks = (k + kBlock - 1) / kBlock, spans = (blocks + 1) / 2;
    if (a.offsets != nullptr) {
      x_sums_.resize(a.rows * num_groups);
      for (int64_t r = 0; r < a.rows; ++r)
        for (int64_t g = 0; g < num_groups; ++g)
          x_sums_[r * num_groups + g] =
              sum_of(a.x + r * a.x_stride + g * group_size, std::min(group_size, k - g * group_size));
    }
    if (a.format == kInt4) {
      x_spans_.assign(a.rows * spans * kSpan, 0.f);
      for (int64_t r = 0; r < a.rows; ++r)
        lay_out_spans(a.x + r * a.x_stride, k, spans, x_spans_.data() + r * spans * kSpan);
      span_groups_ = radix_quant::block_groups(k, group_size);
    }
    p_ = Problem{a.format, a.x, a.x_stride, a.values, a.scales, a.offsets, k, group_size, num_groups,
                 a.bias, a.out, a.out_stride, x_sums_.data(), x_spans_.data(), span_groups_.data(),
                 spans, blocks / 2, blocks * (kBlock / 2)};
    rows_ = a.rows;
  }

  void run(int64_t chunk) const override {
    const int64_t n1 = std::min(n_, (chunk + 1) * kChunk);
    for (int64_t r0 = 0; r0 < rows_; r0 += kTile)
      for (int64_t j = chunk * kChunk; j < n1; ++j) rows_product(p_, r0, std::min<int64_t>(kTile, rows_ - r0), j);
  }

 private:
  std::vector<float> x_sums_, x_spans_;
  std::vector<int32_t> span_groups_;
  Problem p_{};
  int64_t rows_ = 0;
};

}  // namespace

std::unique_ptr<radix_quant::Plan> radix_quant::plan_float(const ProductArgs& a, int* status) {
  *status = 0;
  if ((a.format != kInt8 && a.format != kInt4) || a.rows < 0 || a.n < 0 || a.k <= 0 || a.group_size <= 0)
    *status = 1;
  else if (a.format == kInt4 && (a.offsets == nullptr || a.group_size % kBlock != 0))
    *status = 2;
  if (*status) return nullptr;
  return std::make_unique<FloatPlan>(a);
}

extern "C" {

int radix_quant_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

int radix_quant_gemv(int format, const float* x, int64_t rows, int64_t x_stride, const void* values,
                     const float* scales, const float* offsets, int64_t n, int64_t k, int64_t group_size,
                     const float* bias, float* out, int64_t out_stride, int threads) {
  int status = 0;
  const auto plan = radix_quant::plan_float(
      {format, x, rows, x_stride, values, scales, offsets, n, k, group_size, bias, out, out_stride}, &status);
  if (status) return status;
  const int64_t chunks = plan->chunks();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) plan->run(chunk);
  return 0;
}

int radix_quant_dequantize(int format, const void* values, const float* scales, const float* offsets, int64_t n,
                           int64_t k, int64_t group_size, float* out, int threads) {
  if ((format != kInt8 && format != kInt4) || n < 0 || k <= 0 || group_size <= 0) return 1;
  if (format == kInt4 && (offsets == nullptr || group_size % kBlock != 0)) return 2;
  const int64_t num_groups = (k + group_size - 1) / group_size;
  const int64_t row_bytes = (k + kBlock - 1) / kBlock * (kBlock / 2);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    float* row = out + j * k;
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t c0 = g * group_size, c1 = std::min(c0 + group_size, k);
      const float scale = scales[j * num_groups + g];
      const float offset = offsets == nullptr ? 0.f : offsets[j * num_groups + g];
      if (format == kInt8) {
        const int8_t* v = static_cast<const int8_t*>(values) + j * k;
        for (int64_t c = c0; c < c1; ++c) row[c] = float(v[c]) * scale + offset;
        continue;
      }
      const uint8_t* v = static_cast<const uint8_t*>(values) + j * row_bytes;
      for (int64_t c = c0; c < c1; c += kBlock) {  // c0 is a multiple of kBlock
        const uint8_t* bytes = v + c / 2;
        if (c + kBlock <= k) {
          for (int i = 0; i < kBlock / 2; ++i) {
            row[c + i] = float(bytes[i] & 0x0F) * scale + offset;
            row[c + kBlock / 2 + i] = float(bytes[i] >> 4) * scale + offset;
          }
        } else {
          for (int64_t i = c; i < k; ++i) row[i] = float(int4_at(v, i)) * scale + offset;
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
