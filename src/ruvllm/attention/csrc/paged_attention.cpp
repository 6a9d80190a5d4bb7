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
// Work is split into tasks of up to kTile consecutive rows of one sequence; within a task each cache slot is loaded once per pass and used by every row of
// the tile and every query head, which keeps prompt chunks fast and reads memory in order.
//
// A quantized KV cache (paged_attention_tiered) adds a cold tier: block ids >= num_hot_blocks hold
// int8/int4 codes with fp16 scales per (token, KV head) row (attention/kv_quant.py has the format).
// A row at position p reads block b as cold when (b + 1) * block_size <= p + 1 - hot_tokens: from the
// cold tier if the block has moved there, else fake-quantized from the hot tier with the very same
// quantizer that moves blocks (quantize_kv_blocks). So what a row reads depends on its position only,
// never on when its blocks moved, how its prompt was chunked, or what else shared the step.
// Only ATen's light headers: the extension's build is mostly spent compiling headers (csrc/ops.cpp).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../csrc/vec.h"

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

// One fixed order for every dot product and update (explicit vector code where the head size is a
// multiple of 8), so every caller computes the very same sums; inlined, so the many short dots of a
// step overlap instead of each paying a call.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RUVLLM_ATTN_AVX2 1

inline float dot(const float* a, const float* b, int64_t n) {
  if (n % 8 == 0) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t i = 8; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return ruvllm::hsum8(acc);
  }
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Keys fetched ahead of the ones dot_keys scores. Scoring a KV head's query heads together reads each
// key once, not once a head, and a decode's keys come from memory: without the prefetch a decode of
// 16 sequences at 1,024 tokens ran 1.2-1.3x slower than one head at a time, which kept four streams
// of keys in flight (benchmarks/paged_attention.py).
constexpr int64_t kPrefetchKeys = 8;

// One 8-wide step of dot_keys' G x NK chains at input i: the first (First) is dot()'s multiply, the
// rest its FMAs. The smaller side stays in registers and the other is loaded a vector at a time.
template <int G, int NK, bool First>
__attribute__((always_inline)) inline void dot_keys_step(const float* q, int64_t q_stride, const float* const* k,
                                                         int64_t i, __m256 (&a)[G][NK]) {
  if constexpr (G <= NK) {  // the heads held, the keys loaded in turn
    __m256 qv[G];
    for (int g = 0; g < G; ++g) {
      qv[g] = _mm256_loadu_ps(q + g * q_stride + i);
      ruvllm::in_register(qv[g]);
    }
    for (int j = 0; j < NK; ++j) {
      __m256 kv = _mm256_loadu_ps(k[j] + i);
      ruvllm::in_register(kv);
      for (int g = 0; g < G; ++g) a[g][j] = First ? _mm256_mul_ps(qv[g], kv) : _mm256_fmadd_ps(qv[g], kv, a[g][j]);
    }
  } else {  // the keys held, the heads loaded in turn
    __m256 kv[NK];
    for (int j = 0; j < NK; ++j) {
      kv[j] = _mm256_loadu_ps(k[j] + i);
      ruvllm::in_register(kv[j]);
    }
    for (int g = 0; g < G; ++g) {
      __m256 qv = _mm256_loadu_ps(q + g * q_stride + i);
      ruvllm::in_register(qv);
      for (int j = 0; j < NK; ++j) a[g][j] = First ? _mm256_mul_ps(qv, kv[j]) : _mm256_fmadd_ps(qv, kv[j], a[g][j]);
    }
  }
}

// out[g * out_stride + t] = dot(q + g * q_stride, keys[t] + off, n) * scale for G query heads that
// share these keys (one KV head's group) and t < count, NK keys at a time: each (head, key) by dot()'s
// own arithmetic (the same multiply, FMA chain and reduction), G x NK chains in flight at once. A
// key's vector is loaded once for the G heads and a query's once for the NK keys: G + NK loads per
// G x NK FMAs, where a head at a time loaded 1 + NK per NK. n: a multiple of 8.
template <int G, int NK>
inline void dot_keys(const float* q, int64_t q_stride, const float* const* keys, int64_t off, int64_t count,
                     int64_t n, float scale, float* out, int64_t out_stride) {
  // 13 of the 16 registers: at 16 (4 x 3, 3 x 4) the 3-head groups measured slower, the 4-head ones the same
  static_assert(G * NK + std::min(G, NK) + 1 <= 13, "accumulators and held vectors, registers to spare");
  int64_t t = 0;
  for (; t + NK <= count; t += NK) {
    const float* k[NK];
    for (int j = 0; j < NK; ++j) k[j] = keys[t + j] + off;
    // the keys kPrefetchKeys ahead, while these are scored
    for (int j = 0; j < NK && t + kPrefetchKeys + j < count; ++j)
      for (int64_t b = 0; b < n * 4; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(keys[t + kPrefetchKeys + j] + off) + b, _MM_HINT_T0);
    __m256 a[G][NK];
    dot_keys_step<G, NK, true>(q, q_stride, k, 0, a);
    for (int64_t i = 8; i < n; i += 8) dot_keys_step<G, NK, false>(q, q_stride, k, i, a);
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NK; ++j) out[g * out_stride + t + j] = ruvllm::hsum8(a[g][j]) * scale;
  }
  for (; t < count; ++t)
    for (int g = 0; g < G; ++g) out[g * out_stride + t] = dot(q + g * q_stride, keys[t] + off, n) * scale;
}

// out[g] = sum over t < count, in order, of p[g * p_stride + t] * (values[t] + off) for G query
// heads sharing these values: what axpy() accumulates key by key (FMA into a zeroed row), held in
// registers 32 values at a time instead of loaded and stored for every key. n: a multiple of 32.
template <int G>
inline void weigh_values(const float* p, int64_t p_stride, const float* const* values, int64_t off, int64_t count,
                         int64_t n, float* out, int64_t out_stride) {
  for (int64_t d = 0; d < n; d += 32) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; ++t) {
      const float* v = values[t] + off + d;
      const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                   v3 = _mm256_loadu_ps(v + 24);
      for (int g = 0; g < G; ++g) {
        const __m256 pb = _mm256_set1_ps(p[g * p_stride + t]);
        acc[g][0] = _mm256_fmadd_ps(pb, v0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(pb, v1, acc[g][1]);
        acc[g][2] = _mm256_fmadd_ps(pb, v2, acc[g][2]);
        acc[g][3] = _mm256_fmadd_ps(pb, v3, acc[g][3]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + g * out_stride + d + 8 * j, acc[g][j]);
  }
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
  if (n % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    return;
  }
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}
#else
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
#endif

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

// --- the cold tier's rows: kv_quant.py's format -------------------------------------------------
// int8: q = round(x / s) in [-127, 127], s = fp16(max|x| / 127).  int4: q = round((x - m) / s) in
// [0, 15], m = fp16(min x), s = fp16((max x - m) / 15), two codes a byte (even index low nibble).
// Not inlined, so moving a block and fake-quantizing it in attention run the same instructions.

inline c10::Half to_half(float x) { return c10::Half(std::min(std::max(x, -65504.f), 65504.f)); }

__attribute__((noinline)) void quantize_row(const float* x, int64_t d, int bits, uint8_t* codes, c10::Half* meta) {
  if (bits == 8) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
    const c10::Half scale = to_half(amax / 127.f);
    const float s = static_cast<float>(scale);
    const float inv = s > 0.f ? 1.f / s : 0.f;
    int8_t* q = reinterpret_cast<int8_t*>(codes);
    for (int64_t i = 0; i < d; ++i)
      q[i] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[i] * inv), -127.f), 127.f));
    meta[0] = scale;
    return;
  }
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < d; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const c10::Half minimum = to_half(lo);
  const float m = static_cast<float>(minimum);
  const c10::Half scale = to_half(std::max(hi - m, 0.f) / 15.f);
  const float s = static_cast<float>(scale);
  const float inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t i = 0; i < d; i += 2) {
    const float a = std::min(std::max(std::nearbyint((x[i] - m) * inv), 0.f), 15.f);
    const float b = std::min(std::max(std::nearbyint((x[i + 1] - m) * inv), 0.f), 15.f);
    codes[i / 2] = static_cast<uint8_t>(static_cast<int>(a) | (static_cast<int>(b) << 4));
  }
  meta[0] = scale;
  meta[1] = minimum;
}

__attribute__((noinline)) void dequantize_row(const uint8_t* codes, const c10::Half* meta, int64_t d, int bits,
                                              float* out) {
  const float s = static_cast<float>(meta[0]);
  if (bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(codes);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(q[i]) * s;
    return;
  }
  const float m = static_cast<float>(meta[1]);
#pragma omp simd
  for (int64_t i = 0; i < d / 2; ++i) {
    out[2 * i] = static_cast<float>(codes[i] & 15) * s + m;
    out[2 * i + 1] = static_cast<float>(codes[i] >> 4) * s + m;
  }
}

// One layer's cold tier, or none (num_hot < 0).
struct Cold {
  const uint8_t* codes[2] = {nullptr, nullptr};  // keys, values: [cold_slots, hkv, code_width]
  const c10::Half* meta[2] = {nullptr, nullptr};  // [cold_slots, hkv, meta_width]
  int64_t num_hot = -1, hot_tokens = 0, code_width = 0, meta_width = 0;
  int bits = 0;
};

struct Tile {
  int64_t row_begin, row_end, seq;
};

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const std::vector<Tile>& tiles, const int64_t* row_ctx,
                    int64_t block_size, double scale, int64_t window, const Cold& cold, at::Tensor& out) {
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
  // pass as one contiguous run. (Splitting a lone sequence's heads across threads measured 2x
  // slower in a decode step: reading one head's part of each slot is a strided walk, and the
  // parallel region costs more than the work.)
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, slot_row(slot_stride), slot_old(slot_stride), scores;
    std::vector<uint8_t> codes_tmp(dim);
    std::vector<c10::Half> meta_tmp(2);
    const float* hot_row = slot_row.data();
    std::vector<const T*> kslots, vslots;  // the fast path's key and value row of each context slot
    for (int64_t task = begin; task < end; ++task) {
      const Tile& tile = tiles[task];
      const int64_t h0 = 0, nh = hkv;  // the KV heads of the task: all
      const int64_t rows = tile.row_end - tile.row_begin;
      const int64_t* table = tables + tile.seq * max_blocks;
      // A sliding-window layer: row r sees keys [first(r), ctx); blocks before a row's window may be
      // placeholders in the table, never read.
      auto first = [&](int64_t ctx) { return window > 0 ? std::max<int64_t>(0, ctx - window) : 0; };
      int64_t ctx_max = 0, lo_min = std::numeric_limits<int64_t>::max();
      for (int64_t r = tile.row_begin; r < tile.row_end; ++r) {
        ctx_max = std::max(ctx_max, row_ctx[r]);
        lo_min = std::min(lo_min, first(row_ctx[r]));
      }
      const int64_t width = nh * group;  // query heads of the task per row
      const int64_t heads = rows * width;  // (row, query head) pairs of the task
      qf.resize(heads * dim);
      acc.assign(heads * dim, 0.f);
      scores.resize(heads * ctx_max);
      for (int64_t r = 0; r < rows; ++r)
        load_row(qp + ((tile.row_begin + r) * hq + h0 * group) * dim, qf.data() + r * width * dim, width * dim);
      auto store = [&] {
        for (int64_t r = 0; r < rows; ++r) {
          T* dst = op + ((tile.row_begin + r) * hq + h0 * group) * dim;
          const float* src = acc.data() + r * width * dim;
          for (int64_t d = 0; d < width * dim; ++d) dst[d] = static_cast<T>(src[d]);
        }
      };

#if defined(RUVLLM_ATTN_AVX2)
      // fp32 caches without a cold tier: the same sums, computed row by row over a tile of keys (a KV
      // head's query heads scored against a few keys at a time, values weighed in registers), which
      // is what makes long prompts fast; a (row, head)'s arithmetic is the generic walk's below.
      if constexpr (std::is_same_v<T, float>) {
        if (cold.num_hot < 0 && dim % 32 == 0) {
          kslots.resize(ctx_max);
          vslots.resize(ctx_max);
          for (int64_t t = lo_min; t < ctx_max; ++t) {
            const int64_t slot = table[t / block_size] * block_size + t % block_size;
            kslots[t] = kp + slot * slot_stride;
            vslots[t] = vp + slot * slot_stride;
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t ctx = row_ctx[tile.row_begin + r], lo = first(ctx);
            // each KV head's query heads a few at a time (4, 3, 2 or 1: SmolLM2's 3, Llama's and Gemma's 4)
            for (int64_t h = 0; h < nh; ++h) {
              for (int64_t g0 = 0; g0 < group;) {
                const int64_t i = r * width + h * group + g0, left = group - g0;
                const float* qi = qf.data() + i * dim;
                const float* const* ks = kslots.data() + lo;
                float* si = scores.data() + i * ctx_max + lo;
                if (left >= 4) dot_keys<4, 2>(qi, dim, ks, h * dim, ctx - lo, dim, fscale, si, ctx_max);
                else if (left == 3) dot_keys<3, 3>(qi, dim, ks, h * dim, ctx - lo, dim, fscale, si, ctx_max);
                else if (left == 2) dot_keys<2, 4>(qi, dim, ks, h * dim, ctx - lo, dim, fscale, si, ctx_max);
                else dot_keys<1, 4>(qi, dim, ks, h * dim, ctx - lo, dim, fscale, si, ctx_max);
                const int64_t done = std::min<int64_t>(left, 4);
                // here, not after all the row's heads: that order took Llama's 256 rows at 2,048 keys
                // 1.7-2.0x the previous kernel's time, this one 1.15x (both before the prefetch)
                for (int64_t g = 0; g < done; ++g) softmax_inplace(si + g * ctx_max, ctx - lo);
                g0 += done;
              }
            }
            for (int64_t h = 0; h < nh; ++h) {
              for (int64_t g0 = 0; g0 < group; g0 += 3) {
                const int64_t i = r * width + h * group + g0;
                const float* pr = scores.data() + i * ctx_max + lo;
                float* out = acc.data() + i * dim;
                const int64_t left = group - g0;
                const T* const* vs = vslots.data() + lo;
                if (left >= 3) weigh_values<3>(pr, ctx_max, vs, h * dim, ctx - lo, dim, out, dim);
                else if (left == 2) weigh_values<2>(pr, ctx_max, vs, h * dim, ctx - lo, dim, out, dim);
                else weigh_values<1>(pr, ctx_max, vs, h * dim, ctx - lo, dim, out, dim);
              }
            }
          }
          store();
          continue;
        }
      }
#endif
      // Walk the context slot by slot through the block table, loading the task's KV heads of each
      // slot once from the cache (`kv` 0: keys, 1: values), and hand every (row, query head) that
      // sees it to `use`. With a cold tier, a row for which the block is old gets `slot_old`: the
      // rows dequantized from the cold tier, or fake-quantized from the hot tier.
      auto for_each_visible = [&](int kv, auto&& use) {
        const T* cache = kv ? vp : kp;
        for (int64_t b = lo_min / block_size, t = b * block_size; t < ctx_max; ++b) {
          const int64_t id = table[b];
          const bool is_cold = cold.num_hot >= 0 && id >= cold.num_hot;
          // Rows with a context of at least this many keys read block b as old.
          const int64_t old_from = (b + 1) * block_size + cold.hot_tokens;
          const bool fake = cold.num_hot >= 0 && !is_cold && ctx_max >= old_from;
          const T* block = cache + (is_cold ? 0 : id) * block_size * slot_stride;
          for (int64_t j = 0; j < block_size && t < ctx_max; ++j, ++t) {
            if (is_cold) {
              const int64_t first = ((id - cold.num_hot) * block_size + j) * hkv + h0;
              for (int64_t h = 0; h < nh; ++h)
                dequantize_row(cold.codes[kv] + (first + h) * cold.code_width,
                               cold.meta[kv] + (first + h) * cold.meta_width, dim, cold.bits,
                               slot_old.data() + h * dim);
            } else {
              const T* src = block + j * slot_stride + h0 * dim;
              if constexpr (std::is_same_v<T, float>) {
                hot_row = src;  // read in place: a copy would be the same floats
              } else {
                load_row(src, slot_row.data(), nh * dim);
              }
              if (fake) {
                for (int64_t h = 0; h < nh; ++h) {
                  quantize_row(hot_row + h * dim, dim, cold.bits, codes_tmp.data(), meta_tmp.data());
                  dequantize_row(codes_tmp.data(), meta_tmp.data(), dim, cold.bits, slot_old.data() + h * dim);
                }
              }
            }
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t ctx = row_ctx[tile.row_begin + r];
              if (t >= ctx || t < first(ctx)) continue;
              const float* src = is_cold || (fake && ctx >= old_from) ? slot_old.data() : hot_row;
              for (int64_t i = 0; i < width; ++i) use(r * width + i, t, src + (i / group) * dim);
            }
          }
        }
      };
      for_each_visible(0, [&](int64_t i, int64_t t, const float* key) {
        scores[i * ctx_max + t] = dot(qf.data() + i * dim, key, dim) * fscale;
      });
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t ctx = row_ctx[tile.row_begin + r], lo = first(ctx);
        for (int64_t i = 0; i < width; ++i) softmax_inplace(scores.data() + (r * width + i) * ctx_max + lo, ctx - lo);
      }
      for_each_visible(1, [&](int64_t i, int64_t t, const float* value) {
        axpy(scores[i * ctx_max + t], value, acc.data() + i * dim, dim);
      });
      store();
    }
  });
}

std::vector<Tile> make_tiles(const at::Tensor& tables, const int64_t* seq_p, const int64_t* ctx_p, int64_t rows,
                             int64_t block_size) {
  const int64_t capacity = tables.size(1) * block_size;
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < rows; ++r) {
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
  return tiles;
}

at::Tensor attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor row_seq, at::Tensor row_ctx, int64_t block_size, double scale,
                        int64_t window, const Cold& cold) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [T,Hq,D], caches [slots,Hkv,D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && row_seq.scalar_type() == at::kLong &&
                  row_ctx.scalar_type() == at::kLong,
              "block tables, row sequences and row contexts must be int64");
  TORCH_CHECK(row_seq.numel() == q.size(0) && row_ctx.numel() == q.size(0), "one sequence and context per row");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: the whole context)");
  auto tables = block_tables.contiguous();
  auto seqs = row_seq.contiguous();
  auto ctx = row_ctx.contiguous();
  const int64_t* ctx_p = ctx.data_ptr<int64_t>();
  std::vector<Tile> tiles = make_tiles(tables, seqs.data_ptr<int64_t>(), ctx_p, q.size(0), block_size);
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attention_impl<scalar_t>(q, k_cache, v_cache, tables, tiles, ctx_p, block_size, scale, window, cold, out);
  });
  return out;
}

}  // namespace

namespace ruvllm {

// q [T, Hq, D]; caches [slots, Hkv, D]; block_tables [S, max_blocks]; row_seq [T]: each row's
// sequence (its block-table row); row_ctx [T]: keys each row attends to (its position + 1);
// window > 0: each row sees only the last `window` of those keys (a sliding-window layer).
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor row_seq, at::Tensor row_ctx,
                              int64_t block_size, double scale, int64_t window) {
  return attention(q, k_cache, v_cache, block_tables, row_seq, row_ctx, block_size, scale, window, Cold{});
}

static void check_cold(const at::Tensor& codes, const at::Tensor& meta, const at::Tensor& hot, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "KV codes are 8 or 4 bits, got ", bits);
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "int8 codes are int8, int4 codes are uint8 (two a byte)");
  TORCH_CHECK(meta.scalar_type() == at::kHalf, "cold-tier scales are float16");
  TORCH_CHECK(codes.is_contiguous() && meta.is_contiguous(), "cold-tier tensors must be contiguous");
  const int64_t d = hot.size(-1);
  TORCH_CHECK(codes.dim() == hot.dim() && codes.size(-2) == hot.size(-2) &&
                  codes.size(-1) == (bits == 8 ? d : d / 2) && meta.size(-1) == (bits == 8 ? 1 : 2) &&
                  meta.size(-2) == hot.size(-2) && meta.size(-3) == codes.size(-3),
              "cold-tier codes/scales do not match the hot cache's heads and head size");
  TORCH_CHECK(bits == 8 || d % 2 == 0, "int4 codes need an even head size");
}

// A two-tier cache: blocks >= num_hot_blocks are cold (codes [cold_slots, Hkv, D or D/2], meta
// [cold_slots, Hkv, 1 or 2] fp16); a row reads block b as cold when (b + 1) * block_size <= its
// context - hot_tokens.
at::Tensor paged_attention_tiered(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor k_codes, at::Tensor v_codes, at::Tensor k_meta,
                                     at::Tensor v_meta, at::Tensor block_tables, at::Tensor row_seq,
                                     at::Tensor row_ctx, int64_t block_size, double scale,
                                     int64_t num_hot_blocks, int64_t hot_tokens, int64_t bits) {
  check_cold(k_codes, k_meta, k_cache, bits);
  check_cold(v_codes, v_meta, v_cache, bits);
  TORCH_CHECK(num_hot_blocks >= 0 && hot_tokens >= 0, "num_hot_blocks and hot_tokens must be >= 0");
  Cold cold;
  cold.codes[0] = reinterpret_cast<const uint8_t*>(k_codes.data_ptr());
  cold.codes[1] = reinterpret_cast<const uint8_t*>(v_codes.data_ptr());
  cold.meta[0] = k_meta.data_ptr<c10::Half>();
  cold.meta[1] = v_meta.data_ptr<c10::Half>();
  cold.num_hot = num_hot_blocks;
  cold.hot_tokens = hot_tokens;
  cold.bits = static_cast<int>(bits);
  cold.code_width = k_codes.size(-1);
  cold.meta_width = k_meta.size(-1);
  const int64_t cold_blocks = k_codes.size(0) / block_size;
  auto tables = block_tables.contiguous();
  const int64_t* ids = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_hot_blocks + cold_blocks, "block id ", ids[i], " is outside the pool (",
                num_hot_blocks, " hot + ", cold_blocks, " cold blocks)");
  return attention(q, k_cache, v_cache, tables, row_seq, row_ctx, block_size, scale, 0, cold);
}

template <typename T>
static void quantize_impl(const at::Tensor& kv, const int64_t* src, at::Tensor& codes, at::Tensor& meta,
                   const int64_t* dst, int64_t n, int bits) {
  const int64_t layers = kv.size(0), hkv = kv.size(3), d = kv.size(4);
  const int64_t hot_slots = kv.size(2), cold_slots = codes.size(2);
  const int64_t cw = codes.size(4), mw = meta.size(4);
  const T* kp = kv.data_ptr<T>();
  uint8_t* cp = reinterpret_cast<uint8_t*>(codes.data_ptr());
  c10::Half* mp = meta.data_ptr<c10::Half>();
  at::parallel_for(0, layers * 2 * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t lk = task / n, i = task % n;  // lk: layer * 2 + (0 keys, 1 values)
      for (int64_t h = 0; h < hkv; ++h) {
        load_row(kp + ((lk * hot_slots + src[i]) * hkv + h) * d, row.data(), d);
        const int64_t o = (lk * cold_slots + dst[i]) * hkv + h;
        quantize_row(row.data(), d, bits, cp + o * cw, mp + o * mw);
      }
    }
  });
}

// kv_cache [L, 2, hot_slots, Hkv, D] -> codes [L, 2, cold_slots, Hkv, D or D/2], meta [L, 2, cold_slots,
// Hkv, 1 or 2]: hot slot src_slots[i] of every layer's keys and values to cold slot dst_slots[i].
void quantize_kv_blocks(at::Tensor kv_cache, at::Tensor src_slots, at::Tensor codes, at::Tensor meta,
                        at::Tensor dst_slots, int64_t bits) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [layers, 2, slots, heads, dim] tensor");
  check_cold(codes, meta, kv_cache, bits);
  TORCH_CHECK(codes.size(0) == kv_cache.size(0) && codes.size(1) == 2, "codes must be [layers, 2, slots, heads, *]");
  TORCH_CHECK(src_slots.scalar_type() == at::kLong && dst_slots.scalar_type() == at::kLong &&
                  src_slots.numel() == dst_slots.numel(),
              "slots must be int64, as many sources as destinations");
  auto src = src_slots.contiguous();
  auto dst = dst_slots.contiguous();
  const int64_t n = src.numel();
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < kv_cache.size(2), "source slot ", sp[i], " out of range");
    TORCH_CHECK(dp[i] >= 0 && dp[i] < codes.size(2), "destination slot ", dp[i], " out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_cache.scalar_type(), "quantize_kv_blocks", [&] {
    quantize_impl<scalar_t>(kv_cache, sp, codes, meta, dp, n, static_cast<int>(bits));
  });
}

}  // namespace ruvllm

