// The experts of a mixture-of-experts MLP for a step of the native CPU path, in one call:
// what SparseMoE.loop (models/moe.py) runs from Python expert by expert (gather the rows
// of the tokens that chose the expert, its gate/up linear, SiLU-and-mul, its down linear,
// each row times its routing weight, added into the token's output in the experts' order),
// on the same kernels in the same order, so the results are bit-identical; without the ~6
// operator dispatches per expert (a 16-layer model of 8 experts a token runs ~800 a token).
//
// The (token, slot) pairs are grouped by expert, keeping the tokens' order, into one
// gathered input; each expert's linears compute its contiguous run of rows (every row on its
// own: the linears are batch-invariant), and each token then sums its experts' rows from the
// lowest expert id up, each row rounded times its weight first (this file is compiled with
// -ffp-contract=off), as index_add_ of h * w adds them.
//
// gpt-oss's experts: biases added to each linear's output (as Linear adds them, add_), and
// its clamped SwiGLU in place of SiLU-and-mul (moe.py swiglu_oai's torch operators, in its
// order), where `swiglu_limit` > 0. Gemma 4's (`gelu_tanh`): GELU-tanh-and-mul in place of
// SiLU-and-mul (layers.py gelu_tanh_and_mul's torch operators).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/TensorOperators.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "ops.h"
#include "parallel.h"

namespace {

// A linear's output features (ops.h).
int64_t features(const at::Tensor& blocks, int64_t qtype) {
  return freetoken::linear_out_features(blocks, qtype, "moe_experts");
}

// From this many rows an expert's linears share their features among the threads.
constexpr int64_t kSharedRows = 16;

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                       at::TensorList gate_up, at::IntArrayRef gate_up_types,
                       at::TensorList down, at::IntArrayRef down_types,
                       at::TensorList gate_up_bias, at::TensorList down_bias,
                       double swiglu_alpha, double swiglu_limit, bool gelu_tanh) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "moe_experts: x must be a contiguous float32 [T, hidden] tensor");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(chosen.scalar_type() == at::kLong && chosen.dim() == 2 &&
                  chosen.size(0) == tokens && chosen.is_contiguous(),
              "moe_experts: chosen must be a contiguous int64 [T, k] tensor");
  const int64_t k = chosen.size(1);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == chosen.sizes() &&
                  weights.is_contiguous(),
              "moe_experts: weights must be a contiguous float32 tensor shaped like chosen");
  const int64_t experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(experts > 0 && static_cast<int64_t>(gate_up_types.size()) == experts &&
                  static_cast<int64_t>(down.size()) == experts &&
                  static_cast<int64_t>(down_types.size()) == experts,
              "moe_experts: one gate/up and one down linear per expert");
  const int64_t gate_up_features = features(gate_up[0], gate_up_types[0]);
  TORCH_CHECK(gate_up_features % 2 == 0, "moe_experts: gate/up outputs must be even");
  for (int64_t e = 0; e < experts; ++e)
    TORCH_CHECK(features(gate_up[e], gate_up_types[e]) == gate_up_features &&
                    features(down[e], down_types[e]) == hidden,
                "moe_experts: expert ", e, "'s linears do not have the first one's shapes");
  const bool biases = !gate_up_bias.empty();
  TORCH_CHECK(gate_up_bias.size() == down_bias.size() &&
                  (!biases || static_cast<int64_t>(gate_up_bias.size()) == experts),
              "moe_experts: a gate/up and a down bias per expert, or none");
  for (int64_t e = 0; biases && e < experts; ++e)
    TORCH_CHECK(gate_up_bias[e].scalar_type() == at::kFloat &&
                    gate_up_bias[e].numel() == gate_up_features &&
                    down_bias[e].scalar_type() == at::kFloat && down_bias[e].numel() == hidden,
                "moe_experts: expert ", e, "'s biases must be float32 of its outputs' sizes");

  // The pairs grouped by expert (a counting sort: stable, so each expert's rows keep the
  // tokens' order), and where each pair's row lands.
  const int64_t pairs = tokens * k;
  const int64_t* ids = chosen.data_ptr<int64_t>();
  std::vector<int64_t> start(experts + 1, 0), row_of(pairs), token_of(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(0 <= ids[p] && ids[p] < experts, "moe_experts: expert id ", ids[p],
                " outside the ", experts, " experts");
    ++start[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t row = next[ids[p]]++;
      row_of[p] = row;
      token_of[row] = p / k;
    }
  }
  const auto options = x.options();
  at::Tensor xs = at::empty({pairs, hidden}, options);
  at::Tensor gu = at::empty({pairs, gate_up_features}, options);
  at::Tensor act = at::empty({pairs, gate_up_features / 2}, options);
  at::Tensor hs = at::empty({pairs, hidden}, options);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  const float* hp = hs.data_ptr<float>();
  float* op = out.data_ptr<float>();
  freetoken::parallel_rows(pairs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      std::memcpy(xsp + r * hidden, xp + token_of[r] * hidden, hidden * sizeof(float));
  });
  auto expert = [&](int64_t e) {
    // (The ATen operators below run on the pool's threads too, where the caller's inference
    // mode is not set, and its tensors are inference tensors.)
    c10::InferenceMode inference;
    const int64_t first = start[e], count = start[e + 1] - start[e];
    at::Tensor g = gu.narrow(0, first, count), a = act.narrow(0, first, count);
    freetoken::linear(xs.narrow(0, first, count), gate_up[e], gate_up_types[e], g);
    if (biases) g.add_(gate_up_bias[e]);
    if (gelu_tanh) {
      const int64_t half = gate_up_features / 2;
      at::mul_out(a, at::gelu(g.narrow(1, 0, half), "tanh"), g.narrow(1, half, half));
    } else if (swiglu_limit > 0) {
      const int64_t half = gate_up_features / 2;
      const at::Tensor gate = g.narrow(1, 0, half).clamp_max(swiglu_limit);
      const at::Tensor up = g.narrow(1, half, half).clamp(-swiglu_limit, swiglu_limit);
      at::mul_out(a, up + 1, gate * at::sigmoid(gate * swiglu_alpha));
    } else {
      freetoken::silu_and_mul(a, g);
    }
    at::Tensor h = hs.narrow(0, first, count);
    freetoken::linear(a, down[e], down_types[e], h);
    if (biases) h.add_(down_bias[e]);
  };
  // An expert of many rows shares its linears' features among the threads; the others (a
  // decode step's: a row or a few each) run side by side, one thread an expert, each
  // streaming its own experts' blocks, with no barrier between two linears. Which thread
  // computes a feature changes nothing in it (parallel.h).
  std::vector<int64_t> small;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count >= kSharedRows) {
      expert(e);
    } else if (count > 0) {
      small.push_back(e);
    }
  }
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) {
    return start[a + 1] - start[a] > start[b + 1] - start[b];  // the longest first
  });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(),
                                            static_cast<int64_t>(small.size()));
  if (threads > 1) {
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(small.size());)
        expert(small[i]);
    });
  } else {
    for (int64_t e : small) expert(e);
  }
  freetoken::parallel_rows(tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t s = 0; s < k; ++s) slots[s] = t * k + s;
      std::sort(slots.begin(), slots.end(),
                [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      float* o = op + t * hidden;
      std::fill(o, o + hidden, 0.f);
      for (int64_t p : slots) {
        const float* h = hp + row_of[p] * hidden;
        const float w = wp[p];
        for (int64_t j = 0; j < hidden; ++j) o[j] = o[j] + h[j] * w;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("moe_experts(Tensor x, Tensor chosen, Tensor weights, Tensor[] gate_up, "
        "int[] gate_up_types, Tensor[] down, int[] down_types, Tensor[] gate_up_bias, "
        "Tensor[] down_bias, float swiglu_alpha, float swiglu_limit, bool gelu_tanh=False) "
        "-> Tensor",
        &moe_experts);
}
