// Structured outputs' token mask (ruvllm/structured/bitmask.py): the rows of `logits` listed in
// `rows` get -inf wherever their grammar's bitmask (xgrammar's: bit j of word w allows token
// 32 w + j) forbids the token. A word whose bits all allow is skipped, so a mask that allows most
// tokens (inside a JSON string) costs a read per 32 tokens; one that allows few writes -inf for the
// rest. Rows run in parallel; each row's result does not depend on the others.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

namespace ruvllm {

void apply_token_bitmask(at::Tensor logits, const at::Tensor& words, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous(),
              "words must be a contiguous int32 [R, W] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == words.size(0),
              "rows must be int64 [R]");
  const int64_t V = logits.size(1), W = words.size(1), R = rows.size(0), B = logits.size(0);
  TORCH_CHECK(W * 32 >= V, "the bitmask is narrower than the vocabulary");
  float* out = logits.data_ptr<float>();
  const int32_t* bits = words.data_ptr<int32_t>();
  const int64_t* index = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(index[r] >= 0 && index[r] < B, "row index out of range");
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = out + index[r] * V;
      const int32_t* mask = bits + r * W;
      for (int64_t w = 0; w < W; ++w) {
        const uint32_t m = static_cast<uint32_t>(mask[w]);
        if (m == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32;
        const int64_t n = V - base < 32 ? V - base : 32;
        for (int64_t j = 0; j < n; ++j)
          if (!((m >> j) & 1u)) row[base + j] = ninf;
      }
    }
  });
}

}  // namespace ruvllm
