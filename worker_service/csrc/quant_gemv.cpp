// Products with quantized weights (worker_service/quant/format.py's layouts), for AVX2 + FMA.
//
// radix_quant_gemv: out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]) for a few rows of float32
// activations, the weight dequantized in registers: int8 or unpacked int4 values widened to
// float and multiplied with FMA into per-group partial sums, each group's sum scaled once (and,
// for int4, its offset times the group's sum of x added), so a weight byte is read once per
// tile of up to kTile rows. Threads split the output features.
// radix_quant_dequantize: the plain float32 weight, for products too large for the above
// (prefill), which the caller hands to a GEMM.
// This file is its own library (see quant/kernels.py): it needs AVX2 and FMA only, so it
// builds where the AVX-512 kernels of the other sources do not.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kInt8 = 0;
constexpr int kInt4 = 1;
constexpr int kTile = 4;        // activation rows sharing one pass over the weight
constexpr int64_t kChunk = 16;  // output features a thread takes at a time
constexpr int kBlock = 32;      // int4 columns per packed block

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int int4_at(const uint8_t* row, int64_t col) {
  const int64_t block = col / kBlock, in = col % kBlock;
  const uint8_t byte = row[block * (kBlock / 2) + (in % (kBlock / 2))];
  return in < kBlock / 2 ? (byte & 0x0F) : (byte >> 4);
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
  const float* x_sums;  // [rows, num_groups]: each group's sum of x (int4's offsets)
};

template <int R>
void row_product(const Problem& p, int64_t r0, int64_t n) {
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x + (r0 + r) * p.x_stride;
  __m256 acc[R];
  float rest[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); rest[r] = 0.f; }
  const float* scales = p.scales + n * p.num_groups;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t c0 = g * p.group_size, c1 = std::min(c0 + p.group_size, p.k);
    __m256 part[R];
    float tail[R];
    for (int r = 0; r < R; ++r) { part[r] = _mm256_setzero_ps(); tail[r] = 0.f; }
    int64_t c = c0;
    if (p.format == kInt8) {
      const int8_t* v = static_cast<const int8_t*>(p.values) + n * p.k;
      for (; c + 8 <= c1; c += 8) {
        const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(v + c))));
        for (int r = 0; r < R; ++r) part[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[r] + c), part[r]);
      }
      for (; c < c1; ++c)
        for (int r = 0; r < R; ++r) tail[r] += float(v[c]) * x[r][c];
    } else {
      const int64_t row_bytes = (p.k + kBlock - 1) / kBlock * (kBlock / 2);
      const uint8_t* v = static_cast<const uint8_t*>(p.values) + n * row_bytes;
      const __m128i mask = _mm_set1_epi8(0x0F);
      for (; c + kBlock <= c1; c += kBlock) {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(v + c / 2));
        const __m128i lo = _mm_and_si128(bytes, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        for (int r = 0; r < R; ++r) {
          __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(x[r] + c));
          s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + c + 8), s);
          s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x[r] + c + 16), s);
          s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x[r] + c + 24), s);
          part[r] = _mm256_add_ps(part[r], s);
        }
      }
      for (; c < c1; ++c)
        for (int r = 0; r < R; ++r) tail[r] += float(int4_at(v, c)) * x[r][c];
    }
    const float scale = scales[g];
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(part[r], scale8, acc[r]);
      rest[r] += scale * tail[r];
    }
    if (p.offsets != nullptr) {
      const float offset = p.offsets[n * p.num_groups + g];
      for (int r = 0; r < R; ++r) rest[r] += offset * p.x_sums[(r0 + r) * p.num_groups + g];
    }
  }
  const float bias = p.bias == nullptr ? 0.f : p.bias[n];
  for (int r = 0; r < R; ++r) p.out[(r0 + r) * p.out_stride + n] = hsum(acc[r]) + rest[r] + bias;
}

void rows_product(const Problem& p, int64_t r0, int64_t count, int64_t n) {
  switch (count) {
    case 1: row_product<1>(p, r0, n); break;
    case 2: row_product<2>(p, r0, n); break;
    case 3: row_product<3>(p, r0, n); break;
    default: row_product<4>(p, r0, n); break;
  }
}

}  // namespace

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
  if ((format != kInt8 && format != kInt4) || rows < 0 || n < 0 || k <= 0 || group_size <= 0) return 1;
  if (format == kInt4 && (offsets == nullptr || group_size % kBlock != 0)) return 2;
  const int64_t num_groups = (k + group_size - 1) / group_size;
  std::vector<float> x_sums;
  if (offsets != nullptr) {
    x_sums.assign(rows * num_groups, 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < k; ++c) x_sums[r * num_groups + c / group_size] += x[r * x_stride + c];
  }
  const Problem p{format, x, x_stride, values, scales, offsets, k, group_size, num_groups,
                  bias, out, out_stride, x_sums.data()};
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t n1 = std::min(n, (chunk + 1) * kChunk);
    for (int64_t r0 = 0; r0 < rows; r0 += kTile)
      for (int64_t j = chunk * kChunk; j < n1; ++j) rows_product(p, r0, std::min<int64_t>(kTile, rows - r0), j);
  }
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
