// Decode attention (one query token per sequence) that reads keys and values straight out of the
// paged KV cache through each sequence's block table: nothing is gathered or copied per step.
//
// One task per (sequence, KV head): the query heads that share that KV head are scored against
// every cached key in one pass, softmaxed in float32, and used to weight the values. Each task's
// arithmetic is the same whatever else is in the batch, so a sequence's output does not depend on
// its neighbours (batch invariance).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                           int64_t block_size, double scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t hkv = k_cache.size(1), group = hq / hkv;
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t slot_stride = hkv * dim;  // cache rows are [slot, kv_head, dim]
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const int64_t ctx = lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.assign(group * ctx, 0.f);
      for (int64_t g = 0; g < group; ++g) load_row(qp + (b * hq + h * group + g) * dim, qf.data() + g * dim, dim);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        load_row(kp + slot * slot_stride + h * dim, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qg[d] * row[d];
          scores[g * ctx + t] = dot * fscale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * ctx;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        load_row(vp + slot * slot_stride + h * dim, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * hq + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d]);
      }
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,Hq,D], caches [slots,Hkv,D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block tables and context lengths must be int64");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, tables, lens, block_size, scale, out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache (one query per sequence)");
}
