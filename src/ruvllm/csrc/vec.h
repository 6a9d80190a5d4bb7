// Small vector pieces the kernels share, so that each is written once and every kernel that uses it
// sums in the same order.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace ruvllm {
// The 8 lanes of a float vector summed in one fixed order: the two 128-bit halves lane by lane, then
// lanes 2-3 onto 0-1, then lane 1 onto lane 0. -ffast-math would let the compiler regroup these adds
// differently where it inlines them; GCC 12 does not (tests/unit/test_dense_linear.py checks every
// micro-kernel's rows against each other bit for bit, and would catch a compiler that did).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Keeps v in a register, so that a vector loaded once is read there by every FMA that needs it. Left
// alone, GCC 12 folds such loads into the FMAs as memory operands: one load per FMA, and in a kernel
// whose FMAs each read a vector that others read too, the loads, not the FMAs, set the pace
// (layers/csrc/dense_matmul.cpp, attention/csrc/paged_attention.cpp: docs/benchmarks.md, session 25).
// Only where a value is loaded changes, never an operation, so no result's bits do.
inline void in_register(__m256& v) {
#if defined(__GNUC__)
  asm("" : "+x"(v));
#endif
}
}  // namespace ruvllm
#endif
