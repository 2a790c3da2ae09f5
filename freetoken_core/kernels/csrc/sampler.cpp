// The sampler's last step on CPU: one token per row of float32 logits [B, V], drawn by
// inverse CDF in vocabulary order over softmax(logits / temperature) with the row's own
// uniform number in [0, 1) (splitmix64 of its seed and counter); a row with temperature 0
// takes the argmax. What the torch path
// of freetoken_core/engine/sampler.py computes with five passes over the batch (divide,
// max, softmax, cumsum, searchsorted) and as many [B, V] temporaries, here in three passes
// over each row, the rows in parallel, with no temporaries beyond one row per thread.
//
// Row by row, so a row's token depends only on its own logits, temperature and draw, never
// on the other rows (the seeded draws hold at every batch size). Not bit-identical to the
// torch path: the exponentials are a Cephes polynomial (relative error ~2e-7) and the CDF
// is summed in float64 without normalising first; a draw within ~1e-7 of a boundary between
// two tokens can land on the other one.
//
// finite[b] is false when the row's (tempered) logits have no finite maximum (all -inf, or
// a NaN or +inf among them): the row draws nothing (its token is left 0).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kChunk = 64;  // elements per partial sum of the CDF

// The row's largest value (l[i] / t when t != 0) and whether a NaN was seen (torch's amax
// propagates NaN).
struct RowMax {
  float value;
  bool nan;
};

// Also writes the tempered logits into s[0:v] (when t != 0).
RowMax row_max(const float* l, int64_t v, float t, float* s_out) {
  const bool scale = t != 0.f;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef FREETOKEN_AVX2
  const __m256 tv = _mm256_set1_ps(t);
  __m256 bv = _mm256_set1_ps(best), nv = _mm256_setzero_ps();
  for (; i + 8 <= v; i += 8) {
    __m256 s = _mm256_loadu_ps(l + i);
    if (scale) {
      s = _mm256_div_ps(s, tv);
      _mm256_storeu_ps(s_out + i, s);
    }
    nv = _mm256_or_ps(nv, _mm256_cmp_ps(s, s, _CMP_UNORD_Q));
    bv = _mm256_max_ps(bv, s);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, bv);
  for (float x : lanes) best = std::max(best, x);
  nan = _mm256_movemask_ps(nv) != 0;
#endif
  for (; i < v; ++i) {
    float s = scale ? l[i] / t : l[i];
    if (scale) s_out[i] = s;
    if (s != s) nan = true;
    else if (s > best) best = s;
  }
  return {best, nan};
}

// The first index holding max (torch.argmax's choice among ties).
int64_t first_index_of(const float* l, int64_t v, float max) {
  int64_t i = 0;
#ifdef FREETOKEN_AVX2
  const __m256 mv = _mm256_set1_ps(max);
  for (; i + 8 <= v; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + i), mv, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < v; ++i)
    if (l[i] == max) return i;
  return 0;
}

// The row's uniform number in [0, 1): splitmix64 of (seed, counter), exactly as
// counter_uniform in freetoken_core/engine/sampler.py computes it.
double counter_uniform(int64_t seed, int64_t counter) {
  uint64_t x = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(counter);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) / 9007199254740992.0;  // 2^53
}

// e[i] = exp(e[i] - max) in place (e holds the tempered logits); the sums of each kChunk
// elements into chunks (float32 lanes within a chunk, float64 across).
void row_exp(int64_t v, float max, float* e, double* chunks) {
  int64_t i = 0;
  for (int64_t c = 0; i < v; ++c) {
    const int64_t end = std::min(v, i + kChunk);
    double sum = 0.0;
#ifdef FREETOKEN_AVX2
    const __m256 mv = _mm256_set1_ps(max);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
      const __m256 s = _mm256_sub_ps(_mm256_loadu_ps(e + i), mv);
      // exp8 saturates at -87.3 to ~1e-38; -inf logits (masked tokens) must weigh 0.
      __m256 x = freetoken::vec::exp8(s);
      x = _mm256_and_ps(x, _mm256_cmp_ps(s, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
      _mm256_storeu_ps(e + i, x);
      acc = _mm256_add_ps(acc, x);
    }
    sum = freetoken::vec::hsum(acc);
#endif
    for (; i < end; ++i) {
      const float s = e[i] - max;
      e[i] = s > -87.0f ? std::exp(s) : 0.f;
      sum += e[i];
    }
    chunks[c] = sum;
  }
}

// The first index whose cumulative weight exceeds target (target < total of the weights).
int64_t inverse_cdf(const float* e, int64_t v, const double* chunks, double target) {
  const int64_t num_chunks = (v + kChunk - 1) / kChunk;
  double cum = 0.0;
  int64_t c = 0;
  for (; c < num_chunks - 1 && cum + chunks[c] <= target; ++c) cum += chunks[c];
  int64_t last_positive = -1;
  for (int64_t i = c * kChunk; i < v; ++i) {
    if (e[i] > 0.f) {
      last_positive = i;
      cum += e[i];
      if (cum > target) return i;
    }
  }
  // Rounding left the target at the very end: the last token with any weight.
  for (int64_t i = v - 1; last_positive < 0 && i >= 0; --i)
    if (e[i] > 0.f) last_positive = i;
  return last_positive < 0 ? 0 : last_positive;
}

}  // namespace

namespace freetoken {

void sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                 const at::Tensor& seeds, const at::Tensor& counters, at::Tensor tokens,
                 at::Tensor finite) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
              logits.dim() == 2 && logits.is_contiguous(),
              "sample_rows: logits must be a contiguous float32 [B, V] CPU tensor");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0, "sample_rows: empty vocabulary");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows &&
              temperature.is_contiguous(), "sample_rows: temperature must be float32 [B]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.numel() == rows &&
              seeds.is_contiguous() && counters.scalar_type() == at::kLong &&
              counters.numel() == rows && counters.is_contiguous(),
              "sample_rows: seeds and counters must be int64 [B]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.numel() == rows &&
              tokens.is_contiguous(), "sample_rows: tokens must be int64 [B]");
  TORCH_CHECK(finite.scalar_type() == at::kBool && finite.numel() == rows &&
              finite.is_contiguous(), "sample_rows: finite must be bool [B]");
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* cp = counters.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> e;
    std::vector<double> chunks;
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = lp + r * v;
      const float t = tp[r];
      e.resize(v);
      const RowMax m = row_max(l, v, t, e.data());
      ok[r] = !m.nan && std::isfinite(m.value);
      out[r] = 0;
      if (!ok[r]) continue;
      if (t == 0.f) {
        out[r] = first_index_of(l, v, m.value);
        continue;
      }
      chunks.resize((v + kChunk - 1) / kChunk);
      row_exp(v, m.value, e.data(), chunks.data());
      double total = 0.0;
      for (double s : chunks) total += s;
      double target = counter_uniform(sp[r], cp[r]) * total;
      if (target >= total) target = std::nextafter(total, 0.0);
      out[r] = inverse_cdf(e.data(), v, chunks.data(), target);
    }
  });
}

}  // namespace freetoken

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor seeds, Tensor counters, "
        "Tensor(a!) tokens, Tensor(b!) finite) -> ()", &freetoken::sample_rows);
}
