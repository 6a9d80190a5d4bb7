// Quantized linear layers on the CPU: y[T, N] = x[T, K] . W[N, K]^T with W held as 4-bit or 8-bit codes
// in blocks of 32 inputs, and each row of x quantized to 8 bits per block of 32 on the way in (as
// llama.cpp does), so the inner products are exact integer dot products.
//
// Batch invariance: every output y[t, n] is computed by the same sequence of operations whatever T is
// and whichever thread computes it: the integer block dots are exact, and the float accumulation runs
// over the blocks of one (t, n) pair in a fixed order. Threads split the output features N, never K.
//
// Speed: a tile of weight rows is decoded once per block and reused for every row of x, so a step of
// many tokens costs little more weight traffic than one token.
//
// Layouts (made by quant/cpu_matmul.py):
//   int4 codes  [N, K/2] uint8: byte j of block b holds input 32b+j in its low nibble and input
//               32b+16+j in its high nibble (llama.cpp's Q4_0 order). w = (q - 8) * scale + zero.
//   int8 codes  [N, K] int8. w = q * scale.
//   scales, zeros [N, K/G] float16, one per group of G inputs (G a multiple of 32; a per-channel int8
//               scale is one group of K). Two bytes each, as the weight plan counts them.

// Only ATen's light headers: the extension's build is mostly spent compiling headers (csrc/ops.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;      // inputs per block
constexpr int64_t TILE_N = 4;   // weight rows decoded together and reused across the rows of x

// One row of x as int8 blocks: codes, the block's scale (absmax / 127) and the sum of its codes.
struct QuantRows {
  std::vector<int8_t> q;      // [T, K]
  std::vector<float> scale;   // [T, K/32]
  std::vector<int32_t> sum;   // [T, K/32]
};

void quantize_rows(const float* x, int64_t T, int64_t K, QuantRows& out) {
  const int64_t nb = K / QK;
  out.q.resize(T * K);
  out.scale.resize(T * nb);
  out.sum.resize(T * nb);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + t * K + b * QK;
        float amax = 0.f;
        for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        int8_t* qb = out.q.data() + t * K + b * QK;
        int32_t s = 0;
        for (int64_t i = 0; i < QK; ++i) {
          const int v = static_cast<int>(std::nearbyint(xb[i] * id));
          qb[i] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
          s += qb[i];
        }
        out.scale[t * nb + b] = d;
        out.sum[t * nb + b] = s;
      }
    }
  });
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// 32 unsigned 4-bit codes (16 packed bytes) as 32 bytes, in input order.
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// Eight int32 partial sums of sum_i u[i] * s[i] (u unsigned < 128 or a magnitude, s signed).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

inline int32_t dot_int4_scalar(const uint8_t* w, const int8_t* x) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) {
    s += static_cast<int32_t>(w[i] & 0x0F) * x[i];
    s += static_cast<int32_t>(w[i] >> 4) * x[i + 16];
  }
  return s;
}

inline int32_t dot_int8_scalar(const int8_t* w, const int8_t* x) {
  int32_t s = 0;
  for (int i = 0; i < QK; ++i) s += static_cast<int32_t>(w[i]) * x[i];
  return s;
}

// Per-thread accumulators for one tile, allocated once per thread's share of the tiles.
struct Scratch {
#if defined(__AVX2__)
  std::vector<__m256> acc;  // [T, rows]: eight partial sums of the block dots, scaled
#endif
  std::vector<float> extra;  // [T, rows]: the zero points' part (int4), or the scalar path's sums
  explicit Scratch(int64_t n) : extra(n) {
#if defined(__AVX2__)
    acc.resize(n);
#endif
  }
};

// y[t, n] for a tile of weight rows [n0, n1) and every t. `int4`: codes are packed nibbles.
void tile(bool int4, const uint8_t* codes, const at::Half* scales, const at::Half* zeros, int64_t group,
          const QuantRows& xr, int64_t T, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y, Scratch& scratch) {
  const int64_t nb = K / QK;
  const int64_t ng = K / group, per_group = group / QK;
  const int64_t row_bytes = int4 ? K / 2 : K;
  const int64_t rows = n1 - n0;
#if defined(__AVX2__)
  __m256* acc = scratch.acc.data();
  std::fill(acc, acc + T * rows, _mm256_setzero_ps());
#endif
  float* extra = scratch.extra.data();
  std::fill(extra, extra + T * rows, 0.f);
  for (int64_t b = 0; b < nb; ++b) {
#if defined(__AVX2__)
    __m256i w[TILE_N];
    __m256i wabs[TILE_N];
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* p = codes + (n0 + r) * row_bytes + b * (int4 ? QK / 2 : QK);
      if (int4) {
        w[r] = unpack_nibbles(p);
      } else {
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        wabs[r] = _mm256_sign_epi8(w[r], w[r]);
      }
    }
    float ws[TILE_N], offset[TILE_N];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t g = (n0 + r) * ng + b / per_group;
      ws[r] = static_cast<float>(scales[g]);
      offset[r] = int4 ? static_cast<float>(zeros[g]) - 8.f * ws[r] : 0.f;
    }
    for (int64_t t = 0; t < T; ++t) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + t * K + b * QK));
      const float xs = xr.scale[t * nb + b];
      const float xsum = xs * static_cast<float>(xr.sum[t * nb + b]);
      for (int64_t r = 0; r < rows; ++r) {
        const __m256i d = int4 ? dot_u8s8(w[r], xq) : dot_u8s8(wabs[r], _mm256_sign_epi8(xq, w[r]));
        acc[t * rows + r] = _mm256_fmadd_ps(_mm256_set1_ps(xs * ws[r]), _mm256_cvtepi32_ps(d), acc[t * rows + r]);
        if (int4) extra[t * rows + r] += offset[r] * xsum;
      }
    }
#else
    for (int64_t t = 0; t < T; ++t) {
      const int8_t* xq = xr.q.data() + t * K + b * QK;
      const float xs = xr.scale[t * nb + b];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        const uint8_t* p = codes + n * row_bytes + b * (int4 ? QK / 2 : QK);
        const int64_t g = n * ng + b / per_group;
        const float ws = static_cast<float>(scales[g]);
        const int32_t d = int4 ? dot_int4_scalar(p, xq) : dot_int8_scalar(reinterpret_cast<const int8_t*>(p), xq);
        extra[t * rows + r] += xs * ws * static_cast<float>(d);
        if (int4) extra[t * rows + r] += (static_cast<float>(zeros[g]) - 8.f * ws) * (xs * static_cast<float>(xr.sum[t * nb + b]));
      }
    }
#endif
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
#if defined(__AVX2__)
      y[t * N + n0 + r] = hsum(acc[t * rows + r]) + extra[t * rows + r];
#else
      y[t * N + n0 + r] = extra[t * rows + r];
#endif
    }
  }
}

}  // namespace

namespace ruvllm {

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, int64_t group, bool int4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, K]");
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  TORCH_CHECK(group > 0 && group % QK == 0 && K % group == 0, "group: a multiple of 32 that divides K");
  TORCH_CHECK(codes.is_contiguous() && codes.size(1) == (int4 ? K / 2 : K), "codes: [N, K/2] (int4) or [N, K] (int8)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == K / group, "scales: contiguous float16 [N, K/group]");
  const at::Half* zp = nullptr;
  if (int4) {
    TORCH_CHECK(zeros.has_value() && zeros->scalar_type() == at::kHalf && zeros->is_contiguous() &&
                zeros->sizes() == scales.sizes(), "zeros: contiguous float16 [N, K/group]");
    zp = zeros->data_ptr<at::Half>();
  }
  auto y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  QuantRows xr;
  quantize_rows(x.data_ptr<float>(), T, K, xr);
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const at::Half* sp = scales.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + TILE_N - 1) / TILE_N;
  at::parallel_for(0, tiles, 1, [&](int64_t i0, int64_t i1) {
    Scratch scratch(T * TILE_N);
    for (int64_t i = i0; i < i1; ++i) {
      tile(int4, cp, sp, zp, group, xr, T, K, N, i * TILE_N, std::min(N, (i + 1) * TILE_N), yp, scratch);
    }
  });
  return y;
}

}  // namespace ruvllm
