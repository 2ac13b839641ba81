// Paged attention for x86 CPUs with AVX-512: every query reads its keys and values where they lie
// in the head-major pool, through its page table. Nothing is gathered or padded.
//
// Built at run time by `worker_service/native.py` (g++ -O3 -march=native -fopenmp) and
// called through ctypes; it shares torch's OpenMP runtime (same libgomp soname, already loaded).
//
// One call attends one layer for the whole step. The step's plan (`StepPlan` below) is built once:
// - each decode row owns a suffix: its pages from `row_prefix_pages[r]` on, up to `seq_lens[r]`
//   keys in all;
// - each group of decode rows shares its leading `group_num_pages[g]` pages (same physical pages in
//   every member's table): all members' query heads meet that prefix in ONE pass over its K/V;
// - each prefill span's rows (consecutive positions of one request) are cut into tiles; a tile
//   attends its context's keys, each row only up to its own position (causal).
// These segments are cut into chunks of pages; a work unit is (chunk, kv head). Each unit leaves,
// for each of its queries, the unnormalised partial (max score m, sum of exp(s - m), sum of
// exp(s - m) * v); a last pass merges every row's partials exactly, in float32.
//
// Scores, softmax and sums are float32 whatever the K/V dtype (float32, bfloat16, float16).

#ifndef __AVX512F__
#error "the paged attention kernel needs AVX-512 (the torch path serves CPUs without it)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Dtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct StepPlan {
  int32_t num_rows, num_q_heads, num_kv_heads, head_dim, page_size, dtype;
  int64_t q_row_stride;      // elements between two rows of q (heads of one row are contiguous)
  int64_t kv_head_stride;    // elements between two kv heads of one layer's pool
  float scale;
  int32_t num_threads;
  const int32_t* row_page_start;    // [num_rows + 1] into row_pages
  const int32_t* row_pages;         // every row's page table, concatenated
  const int32_t* seq_lens;          // [num_rows] keys each row attends (its newest token included)
  const int32_t* row_prefix_pages;  // [num_rows] leading pages attended with its group (0: none)
  int32_t num_groups;
  const int32_t* group_row_start;   // [num_groups + 1] into group_rows
  const int32_t* group_rows;
  const int32_t* group_num_pages;   // [num_groups]
  // Prefill spans: rows span_first_row[i] ... + span_num_rows[i] - 1 are one request's tokens at
  // positions span_start[i] ...; each attends its context's keys up to its own position.
  int32_t num_spans;
  const int32_t* span_first_row;
  const int32_t* span_num_rows;
  const int32_t* span_start;
  const int32_t* span_page_start;   // [num_spans + 1] into span_pages
  const int32_t* span_pages;        // each span's pages, up to its last position
};

// ---- conversions: 16 values of the pool's dtype <-> 16 float32 lanes -------------------------

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p, std::integral_constant<int, kBFloat16>) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const uint16_t* p, std::integral_constant<int, kFloat16>) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int kDtype> struct Elem { using type = uint16_t; };
template <> struct Elem<kFloat32> { using type = float; };

template <int kDtype>
inline __m512 load_vec(const typename Elem<kDtype>::type* p) {
  if constexpr (kDtype == kFloat32) return load16(p);
  else return load16(p, std::integral_constant<int, kDtype>{});
}

template <int kDtype>
inline void store_vec(typename Elem<kDtype>::type* p, __m512 x) {
  if constexpr (kDtype == kFloat32) {
    _mm512_storeu_ps(p, x);
  } else if constexpr (kDtype == kFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else {  // bfloat16, round to nearest even (what torch's .to(bfloat16) does; no NaNs here)
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
}

// x rounded to the dtype's precision (nearest even) and back to float32.
template <int kDtype>
inline __m512 round_to(__m512 x) {
  if constexpr (kDtype == kFloat16) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  } else {
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

// exp for x <= 0 (scores minus their max): range reduction to r in [-ln2/2, ln2/2], a degree-6
// polynomial, and scalef by 2^n. Relative error about 1e-7; x below -87 gives (nearly) 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// ---- one work unit ------------------------------------------------------------------------------

// Pages lie anywhere in the pool (the router hands out whichever are free), so the hardware
// prefetchers cannot follow a sequence's keys: each page's run (page_size * head_dim values of one
// head) is fetched ahead in software. Measured: 32 sequences of 380 tokens on pages scattered over
// a 1 GiB pool decoded at 470 tokens/s against 800 on contiguous pages before this.
template <typename T>
inline void prefetch_run(const T* run, int page_size, int head_dim, int hint) {
  const char* bytes = reinterpret_cast<const char*>(run);
  const int size = page_size * head_dim * static_cast<int>(sizeof(T));
  for (int offset = 0; offset < size; offset += 64)
    _mm_prefetch(bytes + offset, hint == 0 ? _MM_HINT_T0 : _MM_HINT_T1);
}

// Keys (and values) this many pages ahead are asked for while a page is read.
constexpr int kPrefetchPages = 3;

// A run of keys of one segment: pages [page_begin, page_end) of `pages`, of which the first
// `num_keys` keys count (the last page may be partly filled).
struct Chunk {
  const int32_t* pages;
  int32_t num_pages;
  int32_t num_keys;
  int32_t first_key;  // position of the chunk's first key in its sequence
};

// Partial result of one query over one chunk: m, l, then head_dim sums.
inline int partial_floats(int head_dim) { return head_dim + 2; }

// A unit with at least this many queries (a shared prefix's group) scores 16 keys at a time
// against transposed keys; fewer queries take one dot product per key and query.
constexpr int kManyQueries = 8;
// Shortest cut of a segment: shorter ones cost more in per-unit setup and merging than they spread.
constexpr int64_t kMinChunkPages = 8;
// Longest cut: a unit's scores (its queries x these keys) should stay in cache.
constexpr int64_t kMaxChunkKeys = 2048;

// scores[i * stride + key] = q_i . k_key for every query and key of the chunk, 16 keys at a time:
// each run of 16 keys is converted and transposed once (kt[d] holds dimension d of the 16 keys),
// then every query's 16 scores are kD broadcast FMAs, with no horizontal sums.
template <int kDtype, int kD>
void scores_transposed(const float* queries, int num_queries, const typename Elem<kDtype>::type* k_head,
                       int page_size, const Chunk& chunk, float* scores, int stride) {
  constexpr int kV = kD / 16;
  alignas(64) float rows[16 * kD];
  alignas(64) float kt[kD * 16];
  const __m512i row_starts = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kD));
  int key = 0;
  for (int p = 0; p < chunk.num_pages && key < chunk.num_keys; ++p) {
    const auto* k_page = k_head + static_cast<int64_t>(chunk.pages[p]) * page_size * kD;
    if (p + kPrefetchPages < chunk.num_pages)
      prefetch_run(k_head + static_cast<int64_t>(chunk.pages[p + kPrefetchPages]) * page_size * kD, page_size, kD, 0);
    const int in_page = std::min(page_size, chunk.num_keys - key);
    for (int j0 = 0; j0 < in_page; j0 += 16) {
      const int n = std::min(16, in_page - j0);
      for (int j = 0; j < 16; ++j)
        for (int t = 0; t < kV; ++t)
          _mm512_store_ps(rows + j * kD + 16 * t,
                          j < n ? load_vec<kDtype>(k_page + (j0 + j) * kD + 16 * t) : _mm512_setzero_ps());
      for (int d = 0; d < kD; ++d) _mm512_store_ps(kt + 16 * d, _mm512_i32gather_ps(row_starts, rows + d, 4));
      const __mmask16 lanes = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      // Eight queries at a time: each transposed key vector is loaded once for all eight, and
      // each query value is a broadcast operand of its FMA.
      int i = 0;
      for (; i + 8 <= num_queries; i += 8) {
        __m512 acc[8];
        for (int b = 0; b < 8; ++b) acc[b] = _mm512_setzero_ps();
        for (int d = 0; d < kD; ++d) {
          const __m512 column = _mm512_load_ps(kt + 16 * d);
          for (int b = 0; b < 8; ++b)
            acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(queries[(i + b) * kD + d]), column, acc[b]);
        }
        for (int b = 0; b < 8; ++b) _mm512_mask_storeu_ps(scores + (i + b) * stride + key + j0, lanes, acc[b]);
      }
      for (; i < num_queries; ++i) {
        const float* qi = queries + i * kD;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int d = 0; d < kD; d += 4)
          for (int u = 0; u < 4; ++u)
            acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(qi[d + u]), _mm512_load_ps(kt + 16 * (d + u)), acc[u]);
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_mask_storeu_ps(scores + i * stride + key + j0, lanes, sum);
      }
    }
    key += in_page;
  }
}

// Queries `queries` ([num_queries][kD] float32, already scaled; `group` per row) against one kv
// head's keys of `chunk`; writes each query's partial to `partials + i * (kD + 2)`. With
// `first_position` >= 0 the rows are consecutive positions from it (a prefill span) and each sees
// only keys up to its own position; a query that sees none of the chunk leaves m = -inf, l = 0.
// `scores` has room for max(kBlock, num_queries) * padded num_keys floats.
template <int kDtype, int kD, int kBlock>
void attend_chunk(const float* queries, int num_queries, int group, int first_position,
                  const typename Elem<kDtype>::type* k_head, const typename Elem<kDtype>::type* v_head,
                  int page_size, const Chunk& chunk, float* all_scores, float* partials) {
  constexpr int kV = kD / 16;
  const int stride = (chunk.num_keys + 15) & ~15;
  const bool many = num_queries >= kManyQueries;
  for (int p = 0; p < std::min(kPrefetchPages, chunk.num_pages); ++p)  // the loops fetch the rest ahead
    prefetch_run(k_head + static_cast<int64_t>(chunk.pages[p]) * page_size * kD, page_size, kD, 0);
  if (many) scores_transposed<kDtype, kD>(queries, num_queries, k_head, page_size, chunk, all_scores, stride);
  for (int q0 = 0; q0 < num_queries; q0 += kBlock) {
    const int nb = std::min(kBlock, num_queries - q0);
    float* scores = many ? all_scores + q0 * stride : all_scores;  // this block's rows
    int key = 0;
    if (!many) {  // scores = q . k for every key of the chunk, one dot product each
      __m512 qv[kBlock][kV];
      for (int b = 0; b < kBlock; ++b)
        for (int t = 0; t < kV; ++t)
          qv[b][t] = b < nb ? _mm512_loadu_ps(queries + (q0 + b) * kD + 16 * t) : _mm512_setzero_ps();
      for (int p = 0; p < chunk.num_pages && key < chunk.num_keys; ++p) {
        const auto* k_page = k_head + static_cast<int64_t>(chunk.pages[p]) * page_size * kD;
        if (p + kPrefetchPages < chunk.num_pages)
          prefetch_run(k_head + static_cast<int64_t>(chunk.pages[p + kPrefetchPages]) * page_size * kD, page_size, kD, 0);
        if (q0 == 0)  // values are read right after, by every block: bring them to L2 now
          prefetch_run(v_head + static_cast<int64_t>(chunk.pages[p]) * page_size * kD, page_size, kD, 1);
        const int in_page = std::min(page_size, chunk.num_keys - key);
        for (int j = 0; j < in_page; ++j, ++key) {
          __m512 kv[kV];
          for (int t = 0; t < kV; ++t) kv[t] = load_vec<kDtype>(k_page + j * kD + 16 * t);
          for (int b = 0; b < kBlock; ++b) {
            if (b >= nb) break;
            __m512 acc = _mm512_mul_ps(qv[b][0], kv[0]);
            for (int t = 1; t < kV; ++t) acc = _mm512_fmadd_ps(qv[b][t], kv[t], acc);
            scores[b * stride + key] = _mm512_reduce_add_ps(acc);
          }
        }
      }
    }

    // softmax pieces per query: m = max, p = exp(s - m) in place, l = sum p; keys a query may
    // not see get p = 0
    float m[kBlock], l[kBlock];
    for (int b = 0; b < nb; ++b) {
      float* s = scores + b * stride;
      int num_keys = chunk.num_keys;
      if (first_position >= 0) {
        const int position = first_position + (q0 + b) / group;
        num_keys = std::clamp(position - chunk.first_key + 1, 0, chunk.num_keys);
        std::fill(s + num_keys, s + chunk.num_keys, 0.0f);
        if (num_keys == 0) {
          m[b] = -INFINITY;
          l[b] = 0.0f;
          continue;
        }
      }
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      int i = 0;
      for (; i + 16 <= num_keys; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
      const __mmask16 tail = static_cast<__mmask16>((1u << (num_keys - i)) - 1);
      if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + i));
      m[b] = _mm512_reduce_max_ps(vmax);
      const __m512 vm = _mm512_set1_ps(m[b]);
      __m512 vsum = _mm512_setzero_ps();
      for (i = 0; i + 16 <= num_keys; i += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
        _mm512_storeu_ps(s + i, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      if (tail) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), vm));
        e = _mm512_maskz_mov_ps(tail, e);
        _mm512_mask_storeu_ps(s + i, tail, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      l[b] = _mm512_reduce_add_ps(vsum);
      // The weights multiply V in the pool's precision, as PyTorch's flash kernel (the torch path,
      // and transformers' reference) does; the sum l keeps them unrounded, as it does.
      if constexpr (kDtype != kFloat32)
        for (i = 0; i < num_keys; i += 16) {
          const __mmask16 lanes = num_keys - i >= 16 ? 0xFFFF : (1u << (num_keys - i)) - 1;
          _mm512_mask_storeu_ps(s + i, lanes, round_to<kDtype>(_mm512_maskz_loadu_ps(lanes, s + i)));
        }
    }

    // acc = sum p * v
    __m512 acc[kBlock][kV];
    for (int b = 0; b < kBlock; ++b)
      for (int t = 0; t < kV; ++t) acc[b][t] = _mm512_setzero_ps();
    key = 0;
    for (int p = 0; p < chunk.num_pages && key < chunk.num_keys; ++p) {
      const auto* v_page = v_head + static_cast<int64_t>(chunk.pages[p]) * page_size * kD;
      if (p + kPrefetchPages < chunk.num_pages)
        prefetch_run(v_head + static_cast<int64_t>(chunk.pages[p + kPrefetchPages]) * page_size * kD, page_size, kD, 0);
      const int in_page = std::min(page_size, chunk.num_keys - key);
      for (int j = 0; j < in_page; ++j, ++key) {
        __m512 vv[kV];
        for (int t = 0; t < kV; ++t) vv[t] = load_vec<kDtype>(v_page + j * kD + 16 * t);
        for (int b = 0; b < kBlock; ++b) {
          if (b >= nb) break;
          const __m512 w = _mm512_set1_ps(scores[b * stride + key]);
          for (int t = 0; t < kV; ++t) acc[b][t] = _mm512_fmadd_ps(w, vv[t], acc[b][t]);
        }
      }
    }
    for (int b = 0; b < nb; ++b) {
      float* out = partials + (q0 + b) * (kD + 2);
      out[0] = m[b];
      out[1] = l[b];
      for (int t = 0; t < kV; ++t) _mm512_storeu_ps(out + 2 + 16 * t, acc[b][t]);
    }
  }
}

// A segment: keys [0, num_keys) of `pages`, attended by `rows` (all of them, all their heads).
struct Segment {
  const int32_t* rows;
  int32_t num_rows;
  const int32_t* pages;
  int32_t num_keys;
  int32_t first_key;       // position of key 0 of `pages`
  int32_t first_position;  // prefill: position of rows[0] (rows are consecutive); -1: decode
};

// Prefill rows are attended in tiles of this many positions: a tile's queries share its keys
// like a shared prefix's group (the transposed-key path), and its scores fit in cache.
constexpr int kTileRows = 32;

template <int kDtype, int kD>
int run(const StepPlan& plan, const void* q_ptr, const void* k_ptr, const void* v_ptr, void* out_ptr) {
  using T = typename Elem<kDtype>::type;
  constexpr int kBlock = kD <= 64 ? 4 : 2;  // queries whose q (and accumulators) stay in registers
  const T* q = static_cast<const T*>(q_ptr);
  const T* k = static_cast<const T*>(k_ptr);
  const T* v = static_cast<const T*>(v_ptr);
  T* out = static_cast<T*>(out_ptr);
  const int num_decode_rows = plan.num_rows, hq = plan.num_q_heads, hk = plan.num_kv_heads;
  const int group = hq / hk, page_size = plan.page_size;
  const int pf = partial_floats(kD);
  int num_rows = num_decode_rows;  // decode rows, then every span's rows
  for (int i = 0; i < plan.num_spans; ++i) num_rows = std::max(num_rows, plan.span_first_row[i] + plan.span_num_rows[i]);

  // Segments: every decode row's suffix, every group's shared prefix, every prefill tile.
  std::vector<int32_t> row_ids(num_rows);
  for (int r = 0; r < num_rows; ++r) row_ids[r] = r;
  std::vector<Segment> segments;
  segments.reserve(num_decode_rows + plan.num_groups + num_rows / kTileRows + plan.num_spans);
  for (int r = 0; r < num_decode_rows; ++r) {
    const int skip = plan.row_prefix_pages[r];
    segments.push_back({&row_ids[r], 1, plan.row_pages + plan.row_page_start[r] + skip,
                        plan.seq_lens[r] - skip * page_size, skip * page_size, -1});
  }
  for (int g = 0; g < plan.num_groups; ++g) {
    const int first = plan.group_rows[plan.group_row_start[g]];
    segments.push_back({plan.group_rows + plan.group_row_start[g],
                        plan.group_row_start[g + 1] - plan.group_row_start[g],
                        plan.row_pages + plan.row_page_start[first], plan.group_num_pages[g] * page_size, 0, -1});
  }
  for (int i = 0; i < plan.num_spans; ++i) {
    for (int t0 = 0; t0 < plan.span_num_rows[i]; t0 += kTileRows) {
      const int n = std::min(kTileRows, plan.span_num_rows[i] - t0);
      const int first_position = plan.span_start[i] + t0;
      segments.push_back({&row_ids[plan.span_first_row[i] + t0], n, plan.span_pages + plan.span_page_start[i],
                          first_position + n, 0, first_position});
    }
  }

  // Chunks: segments are cut so that every thread has several units of similar cost to take.
  // A page costs about its queries' work (a shared prefix's group is compute bound) but never
  // less than a few queries' (a lone row's suffix is bound by reading the page).
  auto page_cost = [&](const Segment& s) { return static_cast<int64_t>(std::max(s.num_rows * group, 4)); };
  int64_t total_cost = 0;
  for (const Segment& s : segments) total_cost += page_cost(s) * ((s.num_keys + page_size - 1) / page_size);
  const int64_t want_units = 8 * static_cast<int64_t>(std::max(1, plan.num_threads));
  const int64_t unit_cost = std::max<int64_t>(1, total_cost * hk / want_units);
  struct ChunkRef { int segment; Chunk chunk; int64_t partial_offset; };
  std::vector<ChunkRef> chunks;
  // Which partials each row has: (chunk, row index in its segment), rows' lists back to back.
  std::vector<int32_t> row_list_start(num_rows + 1, 0);
  std::vector<std::pair<int32_t, int32_t>> row_lists;
  int64_t partial_count = 0;
  for (int si = 0; si < static_cast<int>(segments.size()); ++si) {
    const Segment& s = segments[si];
    const int num_pages = (s.num_keys + page_size - 1) / page_size;
    const int64_t chunk_pages = std::clamp<int64_t>(unit_cost / page_cost(s), kMinChunkPages,
                                                    std::max<int64_t>(kMinChunkPages, kMaxChunkKeys / page_size));
    for (int p0 = 0; p0 < num_pages; p0 += static_cast<int>(chunk_pages)) {
      const int np = std::min<int>(static_cast<int>(chunk_pages), num_pages - p0);
      const int nk = std::min(np * page_size, s.num_keys - p0 * page_size);
      const int ci = static_cast<int>(chunks.size());
      chunks.push_back({si, {s.pages + p0, np, nk, s.first_key + p0 * page_size}, partial_count});
      for (int i = 0; i < s.num_rows; ++i) ++row_list_start[s.rows[i] + 1];
      partial_count += static_cast<int64_t>(s.num_rows) * group * hk;
    }
  }
  for (int r = 0; r < num_rows; ++r) row_list_start[r + 1] += row_list_start[r];
  row_lists.resize(row_list_start[num_rows]);
  {
    std::vector<int32_t> next(row_list_start.begin(), row_list_start.end() - 1);
    for (int ci = 0; ci < static_cast<int>(chunks.size()); ++ci) {
      const Segment& s = segments[chunks[ci].segment];
      for (int i = 0; i < s.num_rows; ++i) row_lists[next[s.rows[i]]++] = {ci, i};
    }
  }
  // Reused across calls (grown, never shrunk or cleared): a fresh buffer per layer would be
  // megabytes for a prefill step that the kernel must fault in and zero each time.
  // (A pointer, not the thread_local itself, goes into the parallel region: there the name would
  // mean each OpenMP thread's own buffer.)
  static thread_local std::vector<float> partial_space;
  if (partial_space.size() < static_cast<size_t>(partial_count * pf)) partial_space.resize(partial_count * pf);
  float* const partials = partial_space.data();
  const int64_t num_units = static_cast<int64_t>(chunks.size()) * hk;

#pragma omp parallel num_threads(plan.num_threads)
  {
    static thread_local std::vector<float> queries, scores;  // per OpenMP thread, reused
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < num_units; ++u) {
      const ChunkRef& c = chunks[u / hk];
      const int h = static_cast<int>(u % hk);
      const Segment& s = segments[c.segment];
      const int nq = s.num_rows * group;
      if (queries.size() < static_cast<size_t>(nq) * kD) queries.resize(static_cast<size_t>(nq) * kD);
      for (int i = 0; i < s.num_rows; ++i) {
        const T* row_q = q + s.rows[i] * plan.q_row_stride + static_cast<int64_t>(h) * group * kD;
        for (int g = 0; g < group; ++g)
          for (int t = 0; t < kD / 16; ++t)
            _mm512_storeu_ps(&queries[(i * group + g) * kD + 16 * t],
                             _mm512_mul_ps(load_vec<kDtype>(row_q + g * kD + 16 * t), _mm512_set1_ps(plan.scale)));
      }
      const size_t scores_size = static_cast<size_t>(std::max(kBlock, nq)) * ((c.chunk.num_keys + 15) & ~15);
      if (scores.size() < scores_size) scores.resize(scores_size);
      // Partials of this unit: [rows of the segment][group] for kv head h.
      float* dest = partials + (c.partial_offset + static_cast<int64_t>(h) * s.num_rows * group) * pf;
      attend_chunk<kDtype, kD, kBlock>(queries.data(), nq, group, s.first_position, k + h * plan.kv_head_stride,
                                       v + h * plan.kv_head_stride, page_size, c.chunk, scores.data(), dest);
    }

    // Merge: out[r, head] = sum_i acc_i e^(m_i - M) / sum_i l_i e^(m_i - M).
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < static_cast<int64_t>(num_rows) * hq; ++rh) {
      const int r = static_cast<int>(rh / hq), head = static_cast<int>(rh % hq);
      const int h = head / group, g = head % group;
      const auto* list_begin = row_lists.data() + row_list_start[r];
      const auto* list_end = row_lists.data() + row_list_start[r + 1];
      auto partial_of = [&](const std::pair<int, int>& entry) {
        const ChunkRef& c = chunks[entry.first];
        const int rows_in_segment = segments[c.segment].num_rows;
        return partials +
               (c.partial_offset + (static_cast<int64_t>(h) * rows_in_segment + entry.second) * group + g) * pf;
      };
      float top = -INFINITY;
      for (const auto* e = list_begin; e != list_end; ++e) top = std::max(top, partial_of(*e)[0]);
      float denominator = 0.0f;
      __m512 acc[kD / 16];
      for (int t = 0; t < kD / 16; ++t) acc[t] = _mm512_setzero_ps();
      for (const auto* e = list_begin; e != list_end; ++e) {
        const float* part = partial_of(*e);
        const float w = std::exp(part[0] - top);
        denominator += part[1] * w;
        for (int t = 0; t < kD / 16; ++t)
          acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(part + 2 + 16 * t), acc[t]);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / denominator);
      T* dst = out + (static_cast<int64_t>(r) * hq + head) * kD;
      for (int t = 0; t < kD / 16; ++t) store_vec<kDtype>(dst + 16 * t, _mm512_mul_ps(acc[t], inv));
    }
  }
  return 0;
}

template <int kDtype>
int dispatch_dim(const StepPlan& plan, const void* q, const void* k, const void* v, void* out) {
  switch (plan.head_dim) {
    case 16: return run<kDtype, 16>(plan, q, k, v, out);
    case 32: return run<kDtype, 32>(plan, q, k, v, out);
    case 64: return run<kDtype, 64>(plan, q, k, v, out);
    case 96: return run<kDtype, 96>(plan, q, k, v, out);
    case 128: return run<kDtype, 128>(plan, q, k, v, out);
    default: return 2;
  }
}

}  // namespace

extern "C" {

// Which head dims and dtypes `radix_paged_attention` takes (the Python side asks before using it).
int radix_supports(int32_t head_dim, int32_t dtype) {
  const bool dim_ok = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128;
  return dim_ok && dtype >= kFloat32 && dtype <= kFloat16;
}

int32_t radix_plan_size() { return static_cast<int32_t>(sizeof(StepPlan)); }

// Attention of one layer's queries `q` (decode rows, then prefill spans' rows) into `out`
// ([rows, num_q_heads, head_dim], contiguous). `k` / `v`: the layer's pool of kv head 0 (heads `kv_head_stride` apart). 0: done.
int radix_paged_attention(const StepPlan* plan, const void* q, const void* k, const void* v, void* out) {
  if (plan->num_q_heads % plan->num_kv_heads != 0) return 1;
  switch (plan->dtype) {
    case kFloat32: return dispatch_dim<kFloat32>(*plan, q, k, v, out);
    case kBFloat16: return dispatch_dim<kBFloat16>(*plan, q, k, v, out);
    case kFloat16: return dispatch_dim<kFloat16>(*plan, q, k, v, out);
    default: return 3;
  }
}

}  // extern "C"
