// The sampled softmax's drawn candidates pooled in one pass (issue 37 item 1, session 19): for each
// of the learner's rows r_t, over the drawn candidates' head rows D [n, H] (one contiguous block
// gathered ahead, learning/candidates.py) with their logits l_tj = r_t . D_j + bias_j (masked ones
// left out),
//   lse_t = log sum_j exp(l_tj)   and   S_t = sum_j softmax_j(l_t) D_j,
// which is d lse_t / d r_t: the backward is dlse_t S_t, with no second read of D.
//
// Why: the step's losses (cross-entropy toward a target, unlikelihood away from it) read the drawn
// candidates only through the softmax's normalizer (the targets are all exact candidates), so the
// drawn columns can be one pooled logit, lse_t, beside the exact ones (learning/sampled_logits.py).
// As torch ops that was rows D^T forward and dlogits D backward: the 4.7 MB block (2,048 rows of 576
// floats) read twice a step from memory (gathered by the background pass, evicted since), at ~3.5
// GB/s on this VM ~1.4 ms each, and BLAS's packing does not pay at a dozen rows. Here each row of D
// is read once, into L1, for every learner row's dot product and its weighted sum: a running max
// keeps exp's arguments at or under 0 (S and the sum rescaled when the max rises, as an online
// softmax does).
//
// Rows are split between the threads; each row's sums run over the candidates in order, in float32,
// whatever the threads or the other rows. Checked against torch's log-sum-exp and autograd by
// tests/unit/test_learning_whole.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>
#include "../../csrc/vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// out[c] = r . w[c] for C rows of w, H inputs (H % 8 == 0).
template <int C>
inline void dots(const float* r, const float* w, int64_t H, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < H; k += 8) {
    const __m256 rv = _mm256_loadu_ps(r + k);
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(rv, _mm256_loadu_ps(w + c * H + k), acc[c]);
  }
  for (int c = 0; c < C; ++c) out[c] = ruvllm::hsum8(acc[c]);
#else
  for (int c = 0; c < C; ++c) {
    float s = 0.f;
    for (int64_t k = 0; k < H; ++k) s += r[k] * w[c * H + k];
    out[c] = s;
  }
#endif
}

// s[k] = s[k] * scale + sum_j p[j] w[j, k] for J rows of w (scale applied first, in the same pass).
template <int J>
inline void accumulate(float* s, float scale, const float* p, const float* w, int64_t H) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 pv[J];
  for (int j = 0; j < J; ++j) pv[j] = _mm256_set1_ps(p[j]);
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t k = 0; k < H; k += 8) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(s + k), sc);
    for (int j = 0; j < J; ++j) acc = _mm256_fmadd_ps(pv[j], _mm256_loadu_ps(w + j * H + k), acc);
    _mm256_storeu_ps(s + k, acc);
  }
#else
  for (int64_t k = 0; k < H; ++k) {
    float acc = s[k] * scale;
    for (int j = 0; j < J; ++j) acc += p[j] * w[j * H + k];
    s[k] = acc;
  }
#endif
}

constexpr int64_t kBlock = 8;  // candidates a pass of the rows (8 rows of D: 18 KB of L1 at H = 576)

// One block of J candidates (J <= kBlock) for rows [t0, t1): their logits, the running max, sum
// and weighted sum of each row.
template <int J>
void block(const float* r, int64_t t0, int64_t t1, const float* w, const float* bias, const bool* masked,
           int64_t H, float* max, float* sum, float* s) {
  for (int64_t t = t0; t < t1; ++t) {
    float l[J], p[J];
    if constexpr (J % 4 == 0) {
      for (int j = 0; j < J; j += 4) dots<4>(r + t * H, w + j * H, H, l + j);
    } else {
      for (int j = 0; j < J; ++j) dots<1>(r + t * H, w + j * H, H, l + j);
    }
    float top = max[t];
    for (int j = 0; j < J; ++j) {
      l[j] += bias[j];
      if (!masked[j]) top = std::max(top, l[j]);
    }
    // (exp's arguments are at most 0, and finite: -ffast-math assumes no infinities)
    const float scale = top > max[t] ? std::exp(std::max(max[t] - top, -80.f)) : 1.f;
    float added = 0.f;
    for (int j = 0; j < J; ++j) {
      p[j] = masked[j] ? 0.f : std::exp(std::max(l[j] - top, -80.f));
      added += p[j];
    }
    sum[t] = sum[t] * scale + added;
    max[t] = top;
    accumulate<J>(s + t * H, scale, p, w, H);
  }
}

}  // namespace

namespace ruvllm {

// (lse [T], S [T, H]): rows [T, H], drawn D [n, H], bias [n], masked [n] (bool: left out). A row
// with every candidate masked gets lse -1e30 (no weight beside the exact ones) and S 0.
std::tuple<at::Tensor, at::Tensor> drawn_pool(const at::Tensor& rows, const at::Tensor& drawn, const at::Tensor& bias,
                                              const at::Tensor& masked) {
  for (const at::Tensor* t : {&rows, &drawn})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous(),
                "rows, drawn: contiguous float32 CPU [rows, H]");
  const int64_t T = rows.size(0), H = rows.size(1), n = drawn.size(0);
  TORCH_CHECK(drawn.size(1) == H && H % 8 == 0, "drawn: rows' width, a multiple of 8");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous(),
              "bias: float32 [n]");
  TORCH_CHECK(masked.scalar_type() == at::kBool && masked.dim() == 1 && masked.size(0) == n && masked.is_contiguous(),
              "masked: bool [n]");
  at::Tensor lse = at::empty({T}, rows.options()), s = at::empty({T, H}, rows.options());
  const float *r = rows.const_data_ptr<float>(), *w = drawn.const_data_ptr<float>(), *b = bias.const_data_ptr<float>();
  const bool* mk = masked.const_data_ptr<bool>();
  float *lp = lse.mutable_data_ptr<float>(), *sp = s.mutable_data_ptr<float>();
  std::vector<float> max(T, -FLT_MAX), sum(T, 0.f);
  std::fill(sp, sp + T * H, 0.f);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    int64_t j = 0;
    for (; j + kBlock <= n; j += kBlock) {
      // the block two ahead asked for now: the rows arrive from memory while these are summed
      // (the block is cold, read once: latency, not bandwidth, bounds a plain pass)
      if (j + 3 * kBlock <= n)
        for (const char *p = reinterpret_cast<const char*>(w + (j + 2 * kBlock) * H),
                        *end = reinterpret_cast<const char*>(w + (j + 3 * kBlock) * H);
             p < end; p += 64)
          __builtin_prefetch(p, 0, 3);
      block<kBlock>(r, t0, t1, w + j * H, b + j, mk + j, H, max.data(), sum.data(), sp);
    }
    for (; j < n; ++j) block<1>(r, t0, t1, w + j * H, b + j, mk + j, H, max.data(), sum.data(), sp);
    for (int64_t t = t0; t < t1; ++t) {
      if (sum[t] > 0.f) {
        lp[t] = max[t] + std::log(sum[t]);
        const float inv = 1.f / sum[t];
        for (int64_t k = 0; k < H; ++k) sp[t * H + k] *= inv;
      } else {
        lp[t] = -1e30f;
      }
    }
  });
  return {lse, s};
}


// The instant step's loss over the sampled softmax and its gradient, without autograd's graph (issue
// 37 item 1, session 20): the logits [rows . exact_c for the m exact candidates, lse_t of the drawn
// ones (drawn_pool's)], the loss toward (score >= 0: cross-entropy, times max(score, 1e-3)) or away
// from (score < 0: unlikelihood, -log(1 - p) with p at most 1 - 1e-6, times -score) each row's label
// `index` among the exact candidates, averaged over the rows, as instant.py's step and feedback_loss
// compute it with torch; and the rows' gradient, the logits' gradient through the exact rows and the
// pooled S_t. Returns (loss [], each row's -log p of its label [T], drows [T, H]).
//
// Why: as torch ops and autograd's nodes (the exact product, the cat, the cross-entropy, the mean and
// their backward nodes, the Python between them) this was ~1-2 ms of the ~10.7 ms step at two threads,
// all on one thread (docs/learning.md "Session 20"); here it is one call.
//
// Threads: the drawn candidates are split in chunks of kChunk, each chunk's running max, sum and S
// for every row made apart and merged in chunk order, so each thread reads its share of the cold
// drawn block once (split by rows, both threads read all of it); the chunks do not depend on the
// thread count, so neither do the bits. The exact candidates and the loss: rows split between the
// threads, each row's sums over the candidates in order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sampled_loss(const at::Tensor& rows, const at::Tensor& exact,
                                                            const at::Tensor& drawn, const at::Tensor& bias,
                                                            const at::Tensor& masked, const at::Tensor& index,
                                                            double score) {
  for (const at::Tensor* t : {&rows, &exact, &drawn})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous(),
                "rows, exact, drawn: contiguous float32 CPU [rows, H]");
  const int64_t T = rows.size(0), H = rows.size(1), m = exact.size(0), n = drawn.size(0);
  TORCH_CHECK(exact.size(1) == H && drawn.size(1) == H && H % 8 == 0 && m > 0,
              "exact, drawn: rows' width, a multiple of 8; at least one exact candidate");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous(),
              "bias: float32 [n]");
  TORCH_CHECK(masked.scalar_type() == at::kBool && masked.dim() == 1 && masked.size(0) == n && masked.is_contiguous(),
              "masked: bool [n]");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1 && index.size(0) == T && index.is_contiguous(),
              "index: int64 [T], each row's label among the exact candidates");
  const int64_t* ip = index.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < m, "index: a place among the exact candidates");
  const float *r = rows.const_data_ptr<float>(), *e = exact.const_data_ptr<float>(), *w = drawn.const_data_ptr<float>();
  const float* b = bias.const_data_ptr<float>();
  const bool* mk = masked.const_data_ptr<bool>();

  // 1. the drawn candidates, chunk by chunk: each chunk's max, sum and unnormalized S per row
  constexpr int64_t kChunk = 1024;
  const int64_t chunks = std::max<int64_t>(1, (n + kChunk - 1) / kChunk);
  std::vector<float> cmax(chunks * T, -FLT_MAX), csum(chunks * T, 0.f), cs(chunks * T * H, 0.f);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * kChunk, hi = std::min(n, lo + kChunk);
      float *mx = cmax.data() + c * T, *sm = csum.data() + c * T, *sp = cs.data() + c * T * H;
      int64_t j = lo;
      for (; j + kBlock <= hi; j += kBlock) {
        if (j + 3 * kBlock <= hi)  // the block two ahead asked for while this one is summed (drawn_pool's)
          for (const char *p = reinterpret_cast<const char*>(w + (j + 2 * kBlock) * H),
                          *end = reinterpret_cast<const char*>(w + (j + 3 * kBlock) * H);
               p < end; p += 64)
            __builtin_prefetch(p, 0, 3);
        block<kBlock>(r, 0, T, w + j * H, b + j, mk + j, H, mx, sm, sp);
      }
      for (; j < hi; ++j) block<1>(r, 0, T, w + j * H, b + j, mk + j, H, mx, sm, sp);
    }
  });

  at::Tensor nll = at::empty({T}, rows.options()), drows = at::empty({T, H}, rows.options());
  float *np = nll.mutable_data_ptr<float>(), *dp = drows.mutable_data_ptr<float>();
  std::vector<float> row_loss(T);
  const float weight = static_cast<float>(score >= 0 ? std::max(score, 1e-3) : -score) / static_cast<float>(T);
  // 2. per row: the chunks merged (lse_t, S_t), the exact logits, the softmax, the loss and drows_t.
  // The exact rows (~0.7 MB at the step's ~310) are read block by block for all of a thread's rows at
  // once, forward and backward, not once a row: each row's sums are the same, in the same order.
  std::vector<float> logits(T * (m + 1)), pooled(T * H);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float top = -FLT_MAX;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, cmax[c * T + t]);
      float sum = 0.f;
      float* st = pooled.data() + t * H;
      std::fill(st, st + H, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float cm = cmax[c * T + t];
        if (csum[c * T + t] <= 0.f) continue;  // every candidate of the chunk masked
        const float f = std::exp(std::max(cm - top, -80.f));
        sum += csum[c * T + t] * f;
        const float* sc = cs.data() + (c * T + t) * H;
        for (int64_t k = 0; k < H; ++k) st[k] += sc[k] * f;
      }
      float lse = -1e30f;
      if (sum > 0.f) {
        lse = top + std::log(sum);
        const float inv = 1.f / sum;
        for (int64_t k = 0; k < H; ++k) st[k] *= inv;
      }
      logits[t * (m + 1) + m] = lse;
    }
    int64_t c = 0;
    for (; c + 4 <= m; c += 4)
      for (int64_t t = t0; t < t1; ++t) dots<4>(r + t * H, e + c * H, H, logits.data() + t * (m + 1) + c);
    for (; c < m; ++c)
      for (int64_t t = t0; t < t1; ++t) dots<1>(r + t * H, e + c * H, H, logits.data() + t * (m + 1) + c);
    for (int64_t t = t0; t < t1; ++t) {
      float* logit = logits.data() + t * (m + 1);
      float mx = -FLT_MAX;
      for (int64_t i = 0; i <= m; ++i) mx = std::max(mx, logit[i]);
      float z = 0.f;
      for (int64_t i = 0; i <= m; ++i) {
        logit[i] = std::exp(std::max(logit[i] - mx, -80.f));  // (now each column's unnormalized probability)
        z += logit[i];
      }
      const float inv_z = 1.f / z;
      for (int64_t i = 0; i <= m; ++i) logit[i] *= inv_z;
      const int64_t label = ip[t];
      const float p = logit[label];
      np[t] = -std::log(std::max(p, 1e-37f));
      // the logits' gradient, in place: CE (p - onehot) weight; unlikelihood weight p / (1 - p) (onehot - p)
      // (zero where p is clamped at 1 - 1e-6, as clamp's gradient is)
      float coef;
      if (score >= 0) {
        row_loss[t] = np[t];
        coef = weight;
      } else {
        const float pc = std::min(p, 1.f - 1e-6f);
        row_loss[t] = -std::log1p(-pc);
        coef = p < 1.f - 1e-6f ? -weight * p / (1.f - p) : 0.f;
      }
      for (int64_t i = 0; i <= m; ++i) logit[i] *= coef;
      logit[label] -= coef;
      std::fill(dp + t * H, dp + (t + 1) * H, 0.f);
    }
    // drows_t = sum_c g_c exact_c + g_m S_t
    c = 0;
    for (; c + 4 <= m; c += 4)
      for (int64_t t = t0; t < t1; ++t) accumulate<4>(dp + t * H, 1.f, logits.data() + t * (m + 1) + c, e + c * H, H);
    for (; c < m; ++c)
      for (int64_t t = t0; t < t1; ++t) accumulate<1>(dp + t * H, 1.f, logits.data() + t * (m + 1) + c, e + c * H, H);
    for (int64_t t = t0; t < t1; ++t) {
      const float gm = logits[t * (m + 1) + m], *st = pooled.data() + t * H;
      float* dt = dp + t * H;
      for (int64_t k = 0; k < H; ++k) dt[k] += gm * st[k];
    }
  });
  float total = 0.f;
  for (int64_t t = 0; t < T; ++t) total += row_loss[t];
  at::Tensor loss = at::empty({}, rows.options());
  loss.mutable_data_ptr<float>()[0] = total * weight;
  return {loss, nll, drows};
}

}  // namespace ruvllm

