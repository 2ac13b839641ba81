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
// These segments are cut into chunks of pages; a work unit is a chunk and one kv head (or all of
// them, for a chunk of few queries). Each chunk and head leaves,
// for each of its queries, the unnormalised partial (max score m, sum of exp(s - m), sum of
// exp(s - m) * v); a last pass merges every row's partials exactly, in float32.
//
// Scores, softmax and sums are float32 whatever the K/V dtype (float32, bfloat16, float16).

#ifndef __AVX512F__
#error "the paged attention kernel needs AVX-512 (the torch path serves CPUs without it)"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_unit.h"
#include "vector_math.h"

namespace radix {

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

// Shortest cut of a segment: shorter ones cost more in per-unit setup and merging than they spread.
constexpr int64_t kMinChunkPages = 8;
// Longest cut: a unit's scores (its queries x these keys) should stay in cache.
constexpr int64_t kMaxChunkKeys = 2048;

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

// What one step's attention does, the same in every layer: the segments, their chunks, and which
// partials each row has. Built once per step (`radix_schedule`), used by every layer's call.
struct ChunkRef {
  int segment;
  Chunk chunk;
  int64_t partial_offset;  // in partials of (kD + 2) floats: [kv head][row of the segment][group]
};

// A unit of work: one chunk against kv heads [head_begin, head_end). A short chunk of few queries
// (a decode row's own keys, up to kMinChunkPages pages) takes all its heads in one unit: alone,
// each head's unit is a few pages, and what the threads pay to hand units out and to start one is
// a large part of it. Longer chunks keep a unit per head, so that the threads have units enough to
// share the work evenly.
struct Unit {
  int32_t chunk, head_begin, head_end;
};

struct Schedule {
  int num_rows = 0;  // decode rows, then every span's rows
  std::vector<int32_t> row_ids;
  std::vector<Segment> segments;
  std::vector<ChunkRef> chunks;
  std::vector<Unit> units;
  // Which partials each row has: (chunk, row index in its segment), rows' lists back to back.
  std::vector<int32_t> row_list_start;
  std::vector<std::pair<int32_t, int32_t>> row_lists;
  int64_t partial_count = 0;
};

Schedule* build_schedule(const StepPlan& plan) {
  auto* schedule = new Schedule();
  const int num_decode_rows = plan.num_rows, hk = plan.num_kv_heads;
  const int group = plan.num_q_heads / hk, page_size = plan.page_size;
  int num_rows = num_decode_rows;
  for (int i = 0; i < plan.num_spans; ++i) num_rows = std::max(num_rows, plan.span_first_row[i] + plan.span_num_rows[i]);
  schedule->num_rows = num_rows;
  std::vector<int32_t>& row_ids = schedule->row_ids;
  std::vector<Segment>& segments = schedule->segments;
  std::vector<ChunkRef>& chunks = schedule->chunks;
  std::vector<int32_t>& row_list_start = schedule->row_list_start;
  std::vector<std::pair<int32_t, int32_t>>& row_lists = schedule->row_lists;
  int64_t& partial_count = schedule->partial_count;

  // Segments: every decode row's suffix, every group's shared prefix, every prefill tile.
  row_ids.resize(num_rows);
  for (int r = 0; r < num_rows; ++r) row_ids[r] = r;
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
  row_list_start.assign(num_rows + 1, 0);
  for (int si = 0; si < static_cast<int>(segments.size()); ++si) {
    const Segment& s = segments[si];
    const int num_pages = (s.num_keys + page_size - 1) / page_size;
    const int64_t chunk_pages = std::clamp<int64_t>(unit_cost / page_cost(s), kMinChunkPages,
                                                    std::max<int64_t>(kMinChunkPages, kMaxChunkKeys / page_size));
    for (int p0 = 0; p0 < num_pages; p0 += static_cast<int>(chunk_pages)) {
      const int np = std::min<int>(static_cast<int>(chunk_pages), num_pages - p0);
      const int nk = std::min(np * page_size, s.num_keys - p0 * page_size);
      chunks.push_back({si, {s.pages + p0, np, nk, s.first_key + p0 * page_size}, partial_count});
      for (int i = 0; i < s.num_rows; ++i) ++row_list_start[s.rows[i] + 1];
      partial_count += static_cast<int64_t>(s.num_rows) * group * hk;
    }
  }
  for (int ci = 0; ci < static_cast<int>(chunks.size()); ++ci) {
    const bool short_few = segments[chunks[ci].segment].num_rows * group < kManyQueries &&
                           chunks[ci].chunk.num_pages <= kMinChunkPages;
    if (short_few) {
      schedule->units.push_back({ci, 0, hk});
    } else {
      for (int h = 0; h < hk; ++h) schedule->units.push_back({ci, h, h + 1});
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
  return schedule;
}

template <int kDtype, int kD>
int run(const StepPlan& plan, const Schedule& schedule, const void* q_ptr, const void* k_ptr, const void* v_ptr,
        void* out_ptr, const float* sinks) {
  using T = typename Elem<kDtype>::type;
  constexpr int kBlock = kD <= 64 ? 4 : 2;  // queries whose q (and accumulators) stay in registers
  const T* q = static_cast<const T*>(q_ptr);
  const T* k = static_cast<const T*>(k_ptr);
  const T* v = static_cast<const T*>(v_ptr);
  T* out = static_cast<T*>(out_ptr);
  const int hq = plan.num_q_heads, hk = plan.num_kv_heads;
  const int group = hq / hk, page_size = plan.page_size;
  const int pf = partial_floats(kD);
  const int num_rows = schedule.num_rows;
  const auto& segments = schedule.segments;
  const auto& chunks = schedule.chunks;
  const auto& row_list_start = schedule.row_list_start;
  const auto& row_lists = schedule.row_lists;
  const int64_t partial_count = schedule.partial_count;

  // Reused across calls (grown, never shrunk or cleared): a fresh buffer per layer would be
  // megabytes for a prefill step that the kernel must fault in and zero each time.
  // (A pointer, not the thread_local itself, goes into the parallel region: there the name would
  // mean each OpenMP thread's own buffer.)
  static thread_local std::vector<float> partial_space;
  if (partial_space.size() < static_cast<size_t>(partial_count * pf)) partial_space.resize(partial_count * pf);
  float* const partials = partial_space.data();
  const auto& units = schedule.units;
  const int64_t num_units = static_cast<int64_t>(units.size());

#pragma omp parallel num_threads(plan.num_threads)
  {
    static thread_local std::vector<float> queries, scores;  // per OpenMP thread, reused
    static thread_local std::vector<uint16_t> raw_queries, pair_space;
    // One head of one chunk: its queries (copied as the path wants them) against the head's keys.
    auto attend_head = [&](const ChunkRef& c, int h) {
      const Segment& s = segments[c.segment];
      const int nq = s.num_rows * group;
      // bfloat16 pair products (attention_many.h, attention_pairs.h) read q as stored; the other
      // paths, scaled float32 copies. The many-query paths keep their own buffers.
      bool raw = false, many_pairs = false;
      if constexpr (kDtype == kBFloat16 && kBf16Pairs) {
        many_pairs = nq >= kManyQueries;
        raw = many_pairs || kRowPairs<kD>;
      }
      const bool own_buffers = many_pairs || ((kDtype == kFloat32 || kDtype == kFloat16) && nq >= kManyQueries);
      if (raw) {
        if (raw_queries.size() < static_cast<size_t>(nq) * kD) raw_queries.resize(static_cast<size_t>(nq) * kD);
        for (int i = 0; i < s.num_rows; ++i)
          std::copy_n(q + s.rows[i] * plan.q_row_stride + static_cast<int64_t>(h) * group * kD, group * kD,
                      raw_queries.data() + static_cast<size_t>(i) * group * kD);
      } else {
        if (queries.size() < static_cast<size_t>(nq) * kD) queries.resize(static_cast<size_t>(nq) * kD);
        for (int i = 0; i < s.num_rows; ++i) {
          const T* row_q = q + s.rows[i] * plan.q_row_stride + static_cast<int64_t>(h) * group * kD;
          for (int g = 0; g < group; ++g)
            for (int t = 0; t < kD / 16; ++t)
              _mm512_storeu_ps(&queries[(i * group + g) * kD + 16 * t],
                               _mm512_mul_ps(load_vec<kDtype>(row_q + g * kD + 16 * t), _mm512_set1_ps(plan.scale)));
        }
      }
      if (many_pairs) {  // room for the interleaved values
        const size_t pairs_size = static_cast<size_t>(c.chunk.num_keys + 1) * kD;
        if (pair_space.size() < pairs_size) pair_space.resize(pairs_size);
      } else if (!own_buffers) {
        const size_t scores_size = static_cast<size_t>(std::max(kBlock, nq)) * ((c.chunk.num_keys + 15) & ~15);
        if (scores.size() < scores_size) scores.resize(scores_size);
      }
      // Partials of this unit: [rows of the segment][group] for kv head h.
      float* dest = partials + (c.partial_offset + static_cast<int64_t>(h) * s.num_rows * group) * pf;
      attend_chunk<kDtype, kD, kBlock>(queries.data(), raw_queries.data(), plan.scale, nq, group, s.first_position,
                                       k + h * plan.kv_head_stride, v + h * plan.kv_head_stride, page_size, c.chunk,
                                       scores.data(), pair_space.data(), dest);
    };
    auto fetch_start = [&](const Unit& unit, int h) {
      const int64_t head_offset = static_cast<int64_t>(h) * plan.kv_head_stride;
      prefetch_chunk_start(k + head_offset, v + head_offset, page_size, kD, chunks[unit.chunk].chunk);
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < num_units; ++u) {
      const Unit& unit = units[u];
      for (int h = unit.head_begin; h < unit.head_end; ++h) {
        // While this head runs, the next one's first pages (this unit's or the next unit's) move
        // toward L2.
        if (h + 1 < unit.head_end) fetch_start(unit, h + 1);
        else if (u + 1 < num_units) fetch_start(units[u + 1], units[u + 1].head_begin);
        attend_head(chunks[unit.chunk], h);
      }
    }

    // Merge: out[r, head] = sum_i acc_i e^(m_i - M) / (sum_i l_i e^(m_i - M) + e^(sink - M)), the
    // sink term only where the layer has sinks (a logit per query head that attends to nothing).
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
      if (sinks != nullptr) denominator += std::exp(sinks[head] - top);
      const __m512 inv = _mm512_set1_ps(1.0f / denominator);
      T* dst = out + (static_cast<int64_t>(r) * hq + head) * kD;
      for (int t = 0; t < kD / 16; ++t) store_vec<kDtype>(dst + 16 * t, _mm512_mul_ps(acc[t], inv));
    }
  }
  return 0;
}

template <int kDtype>
int dispatch_dim(const StepPlan& plan, const Schedule& schedule, const void* q, const void* k, const void* v,
                 void* out, const float* sinks) {
  switch (plan.head_dim) {
    case 16: return run<kDtype, 16>(plan, schedule, q, k, v, out, sinks);
    case 32: return run<kDtype, 32>(plan, schedule, q, k, v, out, sinks);
    case 64: return run<kDtype, 64>(plan, schedule, q, k, v, out, sinks);
    case 96: return run<kDtype, 96>(plan, schedule, q, k, v, out, sinks);
    case 128: return run<kDtype, 128>(plan, schedule, q, k, v, out, sinks);
    case 576: return run<kDtype, 576>(plan, schedule, q, k, v, out, sinks);  // DeepSeek's latent row
    default: return 2;
  }
}

}  // namespace radix

using namespace radix;

extern "C" {

// Which head dims and dtypes `radix_paged_attention` takes (the Python side asks before using it).
int radix_supports(int32_t head_dim, int32_t dtype) {
  const bool dim_ok = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 ||
                      head_dim == 576;
  return dim_ok && dtype >= kFloat32 && dtype <= kFloat16;
}

int32_t radix_plan_size() { return static_cast<int32_t>(sizeof(StepPlan)); }

// The step's schedule for `plan` (its arrays, heads, page size and threads set), or null if the
// heads do not divide; free it with `radix_free_schedule` when the step is done.
void* radix_schedule(const StepPlan* plan) {
  if (plan->num_kv_heads <= 0 || plan->num_q_heads % plan->num_kv_heads != 0) return nullptr;
  return build_schedule(*plan);
}

void radix_free_schedule(void* schedule) { delete static_cast<Schedule*>(schedule); }

// Attention of one layer's queries `q` (decode rows, then prefill spans' rows) into `out`
// ([rows, num_q_heads, head_dim], contiguous) by `schedule` (made from `plan`). `k` / `v`: the
// layer's pool of kv head 0 (heads `kv_head_stride` apart). `sinks`: float32 [num_q_heads], one
// logit per query head joining its softmax's denominator (GPT-OSS's attention sinks), or null.
// 0: done.
int radix_paged_attention(const StepPlan* plan, const void* schedule, const void* q, const void* k, const void* v,
                          void* out, const float* sinks) {
  if (schedule == nullptr) return 1;
  const auto& steps = *static_cast<const Schedule*>(schedule);
  switch (plan->dtype) {
    case kFloat32: return dispatch_dim<kFloat32>(*plan, steps, q, k, v, out, sinks);
    case kBFloat16: return dispatch_dim<kBFloat16>(*plan, steps, q, k, v, out, sinks);
    case kFloat16: return dispatch_dim<kFloat16>(*plan, steps, q, k, v, out, sinks);
    default: return 3;
  }
}

}  // extern "C"
