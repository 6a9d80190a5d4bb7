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
//   scales, zeros [N/4, K/G, 4] float16 values held as their int16 bits (so that a module's dtype
//               cast leaves them alone), one per group of G inputs (G a multiple of 32; a per-channel
//               int8 scale is one group of K), the four rows of a tile together for each group. Two
//               bytes each, as the weight plan counts them.

// Only ATen's light headers: the extension's build is mostly spent compiling headers (csrc/ops.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

// The vector path needs AVX2 with FMA and F16C (every AVX2 CPU has both).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RUVLLM_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;      // inputs per block
constexpr int64_t TILE_N = 4;   // weight rows decoded together and reused across the rows of x
// Software prefetch: while a tile is computed, the tile PF_TILES ahead is fetched, a block's share at
// a time. Each call streams a small matrix (0.2-1 MB a layer) that the hardware prefetcher only picks
// up late; this took one decode step's matmuls from ~10 to ~5.4 ms here (2-core Zen 3), and 2 tiles
// (~2 KB) ahead measured as well as 6 and better than 16.
constexpr int64_t PF_TILES = 2;
constexpr int TC8 = 2;  // rows of x a DecodedTile8 pass takes together (3 measured slower: registers spill)
constexpr int64_t kSerialValues = 1 << 16;  // x's values up to which quantize_rows runs on the caller's thread

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
  auto rows = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + t * K + b * QK;
        int8_t* qb = out.q.data() + t * K + b * QK;
#if defined(RUVLLM_AVX2)
        // the same arithmetic as the scalar loop below: |x| max, d = amax / 127, x * (1 / d) rounded
        // to nearest even (the default rounding mode, as nearbyint), clamped to +-127
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
          q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
          q[i] = _mm256_max_epi32(_mm256_set1_epi32(-127), _mm256_min_epi32(_mm256_set1_epi32(127), q[i]));
        }
        // pack 32 int32 to 32 int8 in order (the packs interleave 128-bit lanes; the permute undoes it)
        const __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
        const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), q8);
        __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        const int32_t s = _mm_cvtsi128_si32(s4);
#else
        float amax = 0.f;
        for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        int32_t s = 0;
        for (int64_t i = 0; i < QK; ++i) {
          const int v = static_cast<int>(std::nearbyint(xb[i] * id));
          qb[i] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
          s += qb[i];
        }
#endif
        out.scale[t * nb + b] = d;
        out.sum[t * nb + b] = s;
      }
    }
  };
  // No parallel region for a few rows: at AVX2's ~0.2 ns a value, the learner's 12 rows of up to 3,072
  // inputs take ~5 us, about what entering and leaving a region of 2 threads costs, and the learner's
  // step makes 31 such calls (docs/learning.md "Session 20"). Each row is quantized alone either way.
  if (T * K <= kSerialValues) rows(0, T);
  else at::parallel_for(0, T, 1, rows);
}

#if defined(RUVLLM_AVX2)
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
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Eight int32 partial sums of sum_i u[i] * s[i] (u unsigned < 128 or a magnitude, s signed).
// With AVX-512 VNNI one instruction does it; its sums are exact, and so are maddubs' here (a pair
// of products stays within int16: 2 x 127 x 127 < 32768), so both give the same bits.
// AVX-VNNI (the VEX form, on CPUs with avx_vnni but no AVX-512: Alder Lake and later) is the same
// instruction at 256 bits. Chosen by the compiler's target (-march=native), never at run time.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
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

#if defined(RUVLLM_AVX2)
// One block of a tile of TILE_N weight rows: each row's 32 codes as bytes in input order, and the
// four rows' scales and zero-point offsets (zero - 8 scale; 0 for int8) as floats.
struct Block {
  __m256i w[TILE_N];
  __m128 scale, offset;
};

// Decodes a tile's blocks from the packed weights as they are read (for few rows of x: nothing is
// stored between the decode and its use).
struct PackedTile {
  bool int4;
  const uint8_t* codes;
  const uint16_t *scales, *zeros;
  int64_t K, ng, per_group, n0;

  // Decodes block b into `out` and returns it.
  inline const Block& block(int64_t b, Block& out) const {
    {
      // the weights of the tile PF_TILES ahead, one block's share of it per block (prefetching past
      // the end of the codes is harmless: a prefetch never faults)
      const int64_t rb = int4 ? K / 2 : K, share = rb * TILE_N / (K / QK);
      const char* ahead = reinterpret_cast<const char*>(codes) + (n0 + PF_TILES * TILE_N) * rb + b * share;
      for (int64_t o = 0; o < share; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    }
    for (int r = 0; r < TILE_N; ++r) {
      const int64_t n = n0 + r;
      out.w[r] = int4 ? unpack_nibbles(codes + n * (K / 2) + b * QK / 2)
                      : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + n * K + b * QK));
    }
    // the tile's four scales (and zero points) of a group sit together: one load each
    const int64_t g = (n0 / TILE_N * ng + b / per_group) * TILE_N;
    out.scale = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + g)));
    out.offset = int4 ? _mm_sub_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + g))),
                                   _mm_mul_ps(_mm_set1_ps(8.f), out.scale))
                      : _mm_setzero_ps();
    return out;
  }
};

// A tile decoded once into per-thread scratch and read back for every chunk of x's rows (for many
// rows of x, so a step of many tokens decodes each weight once).
struct DecodedTile {
  std::vector<Block> blocks;  // [K/32]

  void decode(const PackedTile& src) {
    blocks.resize(src.K / QK);
    for (int64_t b = 0; b < src.K / QK; ++b) src.block(b, blocks[b]);
  }
  // The stored block itself, not a copy: the kernel reads each part where it is used, which saves
  // registers (a copy made the compiler spill them).
  inline const Block& block(int64_t b, Block&) const { return blocks[b]; }
};

// 8-bit weights decoded for more than 2 rows of x: each weight row's |codes| (maddubs' unsigned
// side) made once, with the codes themselves (x takes their signs), so a row of x costs one sign
// operation a block where dot_u8s8(sign(c, c), sign(x, c)) costs two: 1.00-1.07x at 4-128 rows on
// this AVX2 EPYC, 1.02x in the learner's backward (docs/learning.md "Session 18"; widening both
// sides to int16 for two madd_epi16 instead measured 0.83x). The products are the same integers, so
// every float operation after them, and every bit of y, is tile_rows' (test_cpu_matmul_order.py).
struct Block8 {
  __m256i mag[TILE_N], sgn[TILE_N];
  __m128 scale;
};

struct DecodedTile8 {
  std::vector<Block8> blocks;  // [K/32]

  // (read through PackedTile::block, whose prefetch of the tiles ahead counts where the weights come
  // from memory, as in the learner's step: without it this path ran 10% slower there than before)
  void decode(const PackedTile& src) {
    blocks.resize(src.K / QK);
    Block raw;
    for (int64_t b = 0; b < src.K / QK; ++b) {
      const Block& c = src.block(b, raw);
      Block8& out = blocks[b];
      for (int r = 0; r < TILE_N; ++r) {
        out.sgn[r] = c.w[r];
        out.mag[r] = _mm256_sign_epi8(c.w[r], c.w[r]);
      }
      out.scale = c.scale;
    }
  }
};

// y[t, n0..n0+4) for TC rows of x from t0 (TC = 2 keeps every accumulator in the 16 vector
// registers). Per (t, n) the arithmetic is fixed: eight lanes accumulate (x scale * w scale) *
// block dot with an FMA over the blocks in order, the zero points' part accumulates (zero - 8
// scale) * (x scale * x code sum) with an FMA in the same order, and the result is hsum(lanes) +
// that part. Neither which rows share a chunk nor where the decoded weights come from changes
// it, so outputs are batch invariant.
//
// Speed (many rows): the limit here is vector loads as much as the multiplies. Each row's block
// of x is loaded once and held; each weight row's codes are read where used (an operand load);
// the four products x scale * w scale are one multiply of the x scale by the four w scales in
// both halves of a register, and each unit's scale is an in-lane permute of it (a register
// operation): a store and four broadcast loads instead ran ~15% slower, even with the products
// computed ahead. 67 -> 85-97 int8 GOP/s a core on AVX2 (docs/performance.md). The products are
// the same float multiplies as before, so the bits are too (tests/unit/test_cpu_matmul_order.py).
template <int TC, bool INT4, typename Tile>
inline void tile_rows(const Tile& w, const QuantRows& xr, const float* xsum, int64_t t0, int64_t K, int64_t N,
                      int64_t n0, float* y) {
  const int64_t nb = K / QK;
  const int8_t* xq = xr.q.data() + t0 * K;
  const float* xs = xr.scale.data() + t0 * nb;
  const float* xe = xsum + t0 * nb;
  __m256 acc[TC][TILE_N];
  __m128 ext[TC];
  for (int t = 0; t < TC; ++t) {
    ext[t] = _mm_setzero_ps();
    for (int r = 0; r < TILE_N; ++r) acc[t][r] = _mm256_setzero_ps();
  }
  Block scratch;
  for (int64_t b = 0; b < nb; ++b) {
    const Block& blk = w.block(b, scratch);
    const __m256 wscale = _mm256_set_m128(blk.scale, blk.scale);
    for (int t = 0; t < TC; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + b * QK));
      const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(xs[t * nb + b]), wscale);
      // one unit per weight row, written out: the permute's lane must be a compile-time constant at
      // any optimization level (a loop over r is only unrolled into constants at -O3)
      auto unit = [&](auto rc) {
        constexpr int r = decltype(rc)::value;
        const __m256i c = blk.w[r];
        const __m256i d = INT4 ? dot_u8s8(c, x) : dot_u8s8(_mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
        acc[t][r] = _mm256_fmadd_ps(_mm256_permute_ps(sc, r * 0x55), _mm256_cvtepi32_ps(d), acc[t][r]);
      };
      static_assert(TILE_N == 4, "one unit per weight row of a tile");
      unit(std::integral_constant<int, 0>{});
      unit(std::integral_constant<int, 1>{});
      unit(std::integral_constant<int, 2>{});
      unit(std::integral_constant<int, 3>{});
      if (INT4) ext[t] = _mm_fmadd_ps(blk.offset, _mm_set1_ps(xe[t * nb + b]), ext[t]);
    }
  }
  for (int t = 0; t < TC; ++t) {
    alignas(16) float e[TILE_N];
    _mm_store_ps(e, ext[t]);
    for (int r = 0; r < TILE_N; ++r) y[(t0 + t) * N + n0 + r] = hsum(acc[t][r]) + e[r];
  }
}

// tile_rows for 8-bit weights over a DecodedTile8 (TC rows of x from t0): the same float operations.
template <int TC>
inline void tile_rows8(const DecodedTile8& w, const QuantRows& xr, int64_t t0, int64_t K, int64_t N, int64_t n0,
                       float* y) {
  const int64_t nb = K / QK;
  const int8_t* xq = xr.q.data() + t0 * K;
  const float* xs = xr.scale.data() + t0 * nb;
  __m256 acc[TC][TILE_N];
  for (int t = 0; t < TC; ++t)
    for (int r = 0; r < TILE_N; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const Block8& blk = w.blocks[b];
    const __m256 wscale = _mm256_set_m128(blk.scale, blk.scale);
    for (int t = 0; t < TC; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + b * QK));
      const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(xs[t * nb + b]), wscale);
      auto unit = [&](auto rc) {
        constexpr int r = decltype(rc)::value;
        const __m256i d = dot_u8s8(blk.mag[r], _mm256_sign_epi8(x, blk.sgn[r]));
        acc[t][r] = _mm256_fmadd_ps(_mm256_permute_ps(sc, r * 0x55), _mm256_cvtepi32_ps(d), acc[t][r]);
      };
      unit(std::integral_constant<int, 0>{});
      unit(std::integral_constant<int, 1>{});
      unit(std::integral_constant<int, 2>{});
      unit(std::integral_constant<int, 3>{});
    }
  }
  for (int t = 0; t < TC; ++t) {
    alignas(16) float e[TILE_N];  // tile_rows' zero-point part: zero for 8-bit weights
    _mm_store_ps(e, _mm_setzero_ps());
    for (int r = 0; r < TILE_N; ++r) y[(t0 + t) * N + n0 + r] = hsum(acc[t][r]) + e[r];
  }
}

// Every row of x against one tile: pairs of rows, then the odd one.
template <bool INT4, typename Tile>
inline void all_rows(const Tile& w, const QuantRows& xr, const float* xsum, int64_t T, int64_t K, int64_t N,
                     int64_t n0, float* y) {
  int64_t t = 0;
  for (; t + 2 <= T; t += 2) tile_rows<2, INT4>(w, xr, xsum, t, K, N, n0, y);
  if (t < T) tile_rows<1, INT4>(w, xr, xsum, t, K, N, n0, y);
}
#else
// Without AVX2: the same sums one (t, n) pair at a time (the dot lanes collapse to one float).
inline float half_bits(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

void tile_rows_scalar(bool int4, const uint8_t* codes, const uint16_t* scales, const uint16_t* zeros, int64_t ng,
                      int64_t per_group, const QuantRows& xr, const float* xsum, int64_t T, int64_t K, int64_t N,
                      int64_t n0, float* y) {
  const int64_t nb = K / QK, row_bytes = int4 ? K / 2 : K;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t r = 0; r < TILE_N; ++r) {
      const int64_t n = n0 + r;
      float acc = 0.f, ext = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xq = xr.q.data() + t * K + b * QK;
        const uint8_t* p = codes + n * row_bytes + b * (int4 ? QK / 2 : QK);
        const int64_t g = (n / TILE_N * ng + b / per_group) * TILE_N + n % TILE_N;
        const float ws = half_bits(scales[g]);
        const int32_t d = int4 ? dot_int4_scalar(p, xq) : dot_int8_scalar(reinterpret_cast<const int8_t*>(p), xq);
        acc += xr.scale[t * nb + b] * ws * static_cast<float>(d);
        if (int4) ext += (half_bits(zeros[g]) - 8.f * ws) * xsum[t * nb + b];
      }
      y[t * N + n] = acc + ext;
    }
  }
}
#endif

}  // namespace

namespace ruvllm {

// The packed layout's checks, for every kernel that reads it (this one and quant_matmul_grad.cpp's):
// codes [N, K/2] uint8 (int4) or [N, K] int8 with K the caller's input width; scales (and int4's
// zeros) float16 bits as int16 [N/4, K/group, 4]. Returns the zeros' bits (nullptr for int8).
const uint16_t* checked_packed(const at::Tensor& codes, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, int64_t group, bool int4, int64_t K) {
  const int64_t N = codes.size(0);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  TORCH_CHECK(group > 0 && group % QK == 0 && K % group == 0, "group: a multiple of 32 that divides K");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == (int4 ? K / 2 : K),
              "codes: [N, K/2] (int4) or [N, K] (int8)");
  TORCH_CHECK(N % TILE_N == 0, "N must be a multiple of 4");
  TORCH_CHECK(scales.scalar_type() == at::kShort && scales.is_contiguous() && scales.dim() == 3 &&
              scales.size(0) * TILE_N == N && scales.size(1) == K / group && scales.size(2) == TILE_N,
              "scales: float16 bits as contiguous int16 [N/4, K/group, 4]");
  if (!int4) return nullptr;
  TORCH_CHECK(zeros.has_value() && zeros->scalar_type() == at::kShort && zeros->is_contiguous() &&
              zeros->sizes() == scales.sizes(), "zeros: float16 bits as contiguous int16 [N/4, K/group, 4]");
  return reinterpret_cast<const uint16_t*>(zeros->data_ptr());
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, int64_t group, bool int4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [T, K]");
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0);
  const uint16_t* zp = checked_packed(codes, scales, zeros, group, int4, K);
  auto y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  // reused across calls (no allocation per call); worker threads must reach the caller's copy, so it
  // is passed on by reference, not named (a thread_local names each thread's own)
  thread_local QuantRows scratch_rows;
  thread_local std::vector<float> scratch_sum;
  QuantRows& xr = scratch_rows;
  quantize_rows(x.data_ptr<float>(), T, K, xr);
  const int64_t nb = K / QK;
  std::vector<float>& xsum = scratch_sum;
  xsum.resize(T * nb);  // each block's x scale times its code sum: the zero points' factor
  for (int64_t i = 0; i < T * nb; ++i) xsum[i] = xr.scale[i] * static_cast<float>(xr.sum[i]);
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t ng = K / group, per_group = group / QK;
  at::parallel_for(0, N / TILE_N, 1, [&](int64_t i0, int64_t i1) {
#if defined(RUVLLM_AVX2)
    DecodedTile decoded;
    DecodedTile8 decoded8;
    PackedTile packed{int4, cp, sp, zp, K, ng, per_group, 0};
#endif
    for (int64_t i = i0; i < i1; ++i) {
#if defined(RUVLLM_AVX2)
      packed.n0 = i * TILE_N;
      if (T <= 2) {  // decoding as it reads: one pass over the weights either way
        if (int4) all_rows<true>(packed, xr, xsum.data(), T, K, N, packed.n0, yp);
        else all_rows<false>(packed, xr, xsum.data(), T, K, N, packed.n0, yp);
        continue;
      }
      if (!int4) {
        decoded8.decode(packed);
        int64_t t = 0;
        for (; t + TC8 <= T; t += TC8) tile_rows8<TC8>(decoded8, xr, t, K, N, packed.n0, yp);
        for (; t < T; ++t) tile_rows8<1>(decoded8, xr, t, K, N, packed.n0, yp);
        continue;
      }
      decoded.decode(packed);
      all_rows<true>(decoded, xr, xsum.data(), T, K, N, packed.n0, yp);
#else
      tile_rows_scalar(int4, cp, sp, zp, ng, per_group, xr, xsum.data(), T, K, N, i * TILE_N, yp);
#endif
    }
  });
  return y;
}

}  // namespace ruvllm

