// A seeded draw of each row's next token from its logits, in one operator: what the core's choose_tokens computes
// with about thirty torch operations when nothing is filtered out (no top-k, top-p or structure), each a pass over
// [B, V] or a dispatch (accelgen.generation.sampling: logits_to_weights, then draw).
//
// Per row: the weights exp((logit - largest) * inverse temperature), those of an exponent below -87 zero (the
// kernels' exp_of_nonpositive_lanes: within 2 units in the last place of std::exp); then the draw of
// sampling.draw, by blocks of kBlock tokens: the mark is the row's uniform number times its total (the last of the
// blocks' cumulative totals), the block the count of cumulative totals at or below the mark (at most the last block
// of any weight), the token the count of the block's cumulative weights, after the blocks before it, at or below the
// mark (at most its last token of any weight). The same counts and the same sums in float32, so the same token up to
// the rounding of the weights and of each block's total.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "lanes.h"

namespace {
using namespace ACCELGEN_KERNELS_NAMESPACE;

constexpr int64_t kBlock = 64;  // tokens per block (sampling.DRAW_BLOCK)

// The token drawn from one row of ``size`` logits; ``weights`` and ``block_ends`` are the caller's scratch
// (blocks * kBlock and blocks values).
template <typename T>
int64_t draw_row(const T* logits, int64_t size, float inverse_temperature, float uniform, float* weights,
                 float* block_ends) {
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  const Lanes largest = broadcast(largest_value(logits, size)), inverse = broadcast(inverse_temperature);
  const int64_t blocks = (size + kBlock - 1) / kBlock;
  float running = 0.0f;
  int64_t last_weighted_block = 0;  // the last block of any weight
  for (int64_t block = 0; block < blocks; ++block) {
    Lanes total = zeros();
    for (int64_t k = block * kBlock; k < (block + 1) * kBlock; k += kLanes) {
      // the tokens past the row weigh 0 (their logits -inf)
      const Lanes weight = k < size ? exp_of_nonpositive_lanes((load_floats(logits + k, size - k, kLowest) - largest) * inverse)
                                    : zeros();
      store(weight, weights + k);
      total = total + weight;
    }
    const float block_total = sum_of(total);
    if (block_total > 0.0f) last_weighted_block = block;
    running += block_total;
    block_ends[block] = running;
  }
  const float mark = uniform * block_ends[blocks - 1];
  int64_t block = 0;
  while (block < blocks && block_ends[block] <= mark) ++block;
  block = std::min(block, last_weighted_block);
  const float before = block > 0 ? block_ends[block - 1] : 0.0f;
  const float* inner = weights + block * kBlock;
  int64_t within = 0, last_weighted = 0;
  float cumulative = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) {
    cumulative += inner[i];
    within += cumulative + before <= mark;
    if (inner[i] > 0.0f) last_weighted = i;
  }
  return block * kBlock + std::min(within, last_weighted);
}

template <typename T>
void draw_all(const T* logits, int64_t rows, int64_t size, const float* inverse, const float* uniform, int64_t* out) {
  const int64_t blocks = (size + kBlock - 1) / kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(blocks * kBlock), block_ends(blocks);
    for (int64_t b = begin; b < end; ++b)
      out[b] = draw_row(logits + b * size, size, inverse[b], uniform[b], weights.data(), block_ends.data());
  });
}

// logits [B, V] (float32 or bfloat16), inverse_temperatures [B] float32, uniform [B] float32 (in (0, 1]) -> [B] int64.
at::Tensor draw_tokens(const at::Tensor& logits, const at::Tensor& inverse_temperatures, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "draw_tokens: logits [B, V]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "draw_tokens: logits float32 or bfloat16");
  const int64_t rows = logits.size(0), size = logits.size(1);
  for (const at::Tensor* t : {&inverse_temperatures, &uniform})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows,
                "draw_tokens: inverse_temperatures and uniform [B] float32");
  const at::Tensor flat = logits.contiguous(), inverses = inverse_temperatures.contiguous(), draws = uniform.contiguous();
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* inverse = inverses.data_ptr<float>();
  const float* u = draws.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat)
    draw_all(flat.data_ptr<float>(), rows, size, inverse, u, out);
  else
    draw_all(flat.data_ptr<at::BFloat16>(), rows, size, inverse, u, out);
  return tokens;
}

at::Tensor draw_tokens_meta(const at::Tensor& logits, const at::Tensor&, const at::Tensor&) {
  return at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ACCELGEN_KERNELS_NAMESPACE, library) {
  library.def("draw_tokens(Tensor logits, Tensor inverse_temperatures, Tensor uniform) -> Tensor");
}

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, CPU, library) { library.impl("draw_tokens", &draw_tokens); }

TORCH_LIBRARY_IMPL(ACCELGEN_KERNELS_NAMESPACE, Meta, library) { library.impl("draw_tokens", &draw_tokens_meta); }
