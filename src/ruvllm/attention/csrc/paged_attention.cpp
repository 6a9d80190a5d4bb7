// Attention that reads keys and values straight out of the paged KV cache through each sequence's
// block table, for every query row of a step: decodes (one row per sequence) and prompt chunks
// (consecutive rows of one sequence, each seeing the keys up to its own position). Nothing is
// gathered or copied.
//
// Why one kernel for both: every query row goes through the same arithmetic in the same order —
// scores key by key, a float32 softmax, then values accumulated key by key — whether it is a
// decode, part of a long prompt, recomputed after preemption, or behind a prefix-cache hit. So a
// request's output does not depend on how its tokens were split into steps or what shared them.
//
// Work is split into tasks of up to kTile consecutive rows of one sequence; within a task each
// cache slot (all KV heads of one token, contiguous) is loaded once per pass and used by every row
// of the tile and every query head, which keeps prompt chunks fast and reads memory in order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTile = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// bf16 -> float is a 16-bit shift; spelled out so the compiler vectorizes it.
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// Not inlined, so every caller runs the very same instructions (same reduction order).
__attribute__((noinline)) float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

__attribute__((noinline)) void axpy(float p, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

// The file is built with -ffast-math so this exp loop vectorizes (glibc's vector expf); no input
// here is inf or NaN (the max starts from s[0], masked keys are never stored).
__attribute__((noinline)) void softmax_inplace(float* s, int64_t n) {
  float mx = s[0];
  for (int64_t t = 1; t < n; ++t) mx = std::max(mx, s[t]);
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += s[t];
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

struct Tile {
  int64_t row_begin, row_end, seq;
};

template <typename T>
void attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& block_tables, const std::vector<Tile>& tiles, const int64_t* row_ctx,
                    int64_t block_size, double scale, torch::Tensor& out) {
  const int64_t hq = q.size(1), dim = q.size(2);
  const int64_t hkv = k_cache.size(1), group = hq / hkv;
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t slot_stride = hkv * dim;  // cache rows are [slot, kv_head, dim]: one slot is contiguous
  const float fscale = static_cast<float>(scale);
  const int64_t num_tasks = static_cast<int64_t>(tiles.size());

  // One task per tile, all heads: each cache slot (every KV head of one token) is read once per
  // pass as one contiguous run.
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, slot_row(slot_stride), scores;
    for (int64_t task = begin; task < end; ++task) {
      const Tile& tile = tiles[task];
      const int64_t rows = tile.row_end - tile.row_begin;
      const int64_t* table = tables + tile.seq * max_blocks;
      int64_t ctx_max = 0;
      for (int64_t r = tile.row_begin; r < tile.row_end; ++r) ctx_max = std::max(ctx_max, row_ctx[r]);
      const int64_t heads = rows * hq;  // (row, query head) pairs of this task
      qf.resize(heads * dim);
      acc.assign(heads * dim, 0.f);
      scores.resize(heads * ctx_max);
      for (int64_t r = 0; r < rows; ++r) load_row(qp + (tile.row_begin + r) * hq * dim, qf.data() + r * hq * dim, hq * dim);

      // Walk the context slot by slot through the block table, loading each slot (all KV heads)
      // once from `cache`, and hand every (row, query head) that sees it to `use`.
      auto for_each_visible = [&](const T* cache, auto&& use) {
        for (int64_t b = 0, t = 0; t < ctx_max; ++b) {
          const T* block = cache + table[b] * block_size * slot_stride;
          for (int64_t j = 0; j < block_size && t < ctx_max; ++j, ++t) {
            load_row(block + j * slot_stride, slot_row.data(), slot_stride);
            for (int64_t r = 0; r < rows; ++r) {
              if (t >= row_ctx[tile.row_begin + r]) continue;
              for (int64_t qh = 0; qh < hq; ++qh) use(r * hq + qh, t, slot_row.data() + (qh / group) * dim);
            }
          }
        }
      };
      for_each_visible(kp, [&](int64_t i, int64_t t, const float* key) {
        scores[i * ctx_max + t] = dot(qf.data() + i * dim, key, dim) * fscale;
      });
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t qh = 0; qh < hq; ++qh)
          softmax_inplace(scores.data() + (r * hq + qh) * ctx_max, row_ctx[tile.row_begin + r]);
      for_each_visible(vp, [&](int64_t i, int64_t t, const float* value) {
        axpy(scores[i * ctx_max + t], value, acc.data() + i * dim, dim);
      });
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = op + (tile.row_begin + r) * hq * dim;
        const float* src = acc.data() + r * hq * dim;
        for (int64_t d = 0; d < hq * dim; ++d) dst[d] = static_cast<T>(src[d]);
      }
    }
  });
}

// q [T, Hq, D]; caches [slots, Hkv, D]; block_tables [S, max_blocks]; row_seq [T]: each row's
// sequence (its block-table row); row_ctx [T]: keys each row attends to (its position + 1).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor row_ctx,
                              int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [T,Hq,D], caches [slots,Hkv,D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && row_seq.scalar_type() == torch::kInt64 &&
                  row_ctx.scalar_type() == torch::kInt64,
              "block tables, row sequences and row contexts must be int64");
  TORCH_CHECK(row_seq.numel() == q.size(0) && row_ctx.numel() == q.size(0), "one sequence and context per row");
  auto tables = block_tables.contiguous();
  auto seqs = row_seq.contiguous();
  auto ctx = row_ctx.contiguous();
  const int64_t* seq_p = seqs.data_ptr<int64_t>();
  const int64_t* ctx_p = ctx.data_ptr<int64_t>();
  const int64_t capacity = tables.size(1) * block_size;
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(ctx_p[r] >= 1 && ctx_p[r] <= capacity, "row ", r, " attends to ", ctx_p[r],
                " keys; its block table holds ", capacity);
    TORCH_CHECK(seq_p[r] >= 0 && seq_p[r] < tables.size(0), "row ", r, " names no block table");
    if (!tiles.empty() && tiles.back().seq == seq_p[r] && tiles.back().row_end == r &&
        r - tiles.back().row_begin < kTile) {
      tiles.back().row_end = r + 1;
    } else {
      tiles.push_back({r, r + 1, seq_p[r]});
    }
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attention_impl<scalar_t>(q, k_cache, v_cache, tables, tiles, ctx_p, block_size, scale, out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released for the call (as torch's own ops do), so the server's asyncio thread and
  // signal handlers run while attention computes.
  m.def("paged_attention", &paged_attention, "Attention over a paged KV cache for every query row of a step",
        py::call_guard<py::gil_scoped_release>());
}
