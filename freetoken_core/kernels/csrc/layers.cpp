// Fused element-wise layers of the Llama block, on the CPU: each is one pass over its rows
// where the torch path runs three to six separate operators (and as many dispatches).
//
// They round exactly where the Hugging Face formulas do (this file is compiled with
// -ffp-contract=off, so no multiply-add is fused behind our back); only the order of the
// RMSNorm sum of squares differs. float32 and bfloat16; arithmetic in float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace {

inline float f32(float x) { return x; }
inline float f32(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T cast(float x) { return static_cast<T>(x); }

// Rows per parallel task: small batches (decoding) stay on the calling thread (in a team,
// parallel_rows gives each member an equal share instead).
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / row_elems); }

// Hugging Face's LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps)).to(dtype).
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef FREETOKEN_AVX2
  if constexpr (std::is_same_v<T, float>) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    ss = freetoken::vec::hsum(acc);
  }
#endif
  for (; i < n; ++i) {
    const float v = f32(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = cast<T>(f32(w[i]) * f32(cast<T>(f32(x[i]) * r)));
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  freetoken::parallel_rows(rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
}

// residual = x + residual; x = rms_norm(residual) * w   (vLLM's fused_add_rms_norm)
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T *xp = x.data_ptr<T>(), *rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  freetoken::parallel_rows(rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T *xr = xp + r * n, *rr = rp + r * n;
      for (int64_t i = 0; i < n; ++i) rr[i] = cast<T>(f32(xr[i]) + f32(rr[i]));
      norm_row(rr, wp, xr, n, static_cast<float>(eps));
    }
  });
}

// out = silu(x[:, :d]) * x[:, d:]
template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  freetoken::parallel_rows(rows, grain(d), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T *gate = xp + r * 2 * d, *up = gate + d;
      T* o = op + r * d;
      int64_t i = 0;
#ifdef FREETOKEN_AVX2
      if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
        // 16 lanes where the CPU has them (the same floats: exp16 is exp8 lane by lane).
        const __m512 one16 = _mm512_set1_ps(1.f);
        for (; i + 16 <= d; i += 16) {
          const __m512 g = _mm512_loadu_ps(gate + i);
          const __m512 e = freetoken::vec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
          const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one16, e));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
#endif
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= d; i += 8) {
          const __m256 g = _mm256_loadu_ps(gate + i);
          const __m256 e = freetoken::vec::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
          const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
      }
#endif
      for (; i < d; ++i) {
        const float g = f32(gate[i]);
        o[i] = cast<T>(f32(cast<T>(g / (1.f + std::exp(-g)))) * f32(up[i]));
      }
    }
  });
}

// x = x * cos + rotate_half(x) * sin, in place, for every head of every token.
// x: [T, heads, hd] (any token stride); cos, sin: [T, hd] contiguous.
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), hd = x.size(2), half = hd / 2;
  const int64_t stride = x.stride(0);
  T* xp = x.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  freetoken::parallel_rows(tokens, grain(heads * hd), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T *c = cp + t * hd, *s = sp + t * hd;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * stride + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(v[i]), x2 = f32(v[i + half]);
          const float a1 = f32(cast<T>(x1 * f32(c[i]))), b1 = f32(cast<T>(-x2 * f32(s[i])));
          const float a2 = f32(cast<T>(x2 * f32(c[i + half]))), b2 = f32(cast<T>(x1 * f32(s[i + half])));
          v[i] = cast<T>(a1 + b1);
          v[i + half] = cast<T>(a2 + b2);
        }
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), name,
              ": contiguous 2-d CPU tensor expected");
}

#define FREETOKEN_DISPATCH(dtype, ...)                                              \
  if ((dtype) == at::kFloat) {                                                      \
    using scalar_t = float;                                                         \
    __VA_ARGS__;                                                                    \
  } else if ((dtype) == at::kBFloat16) {                                            \
    using scalar_t = c10::BFloat16;                                                 \
    __VA_ARGS__;                                                                    \
  } else {                                                                          \
    TORCH_CHECK(false, "float32 or bfloat16 only");                                 \
  }

}  // namespace

namespace freetoken {

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && out.sizes() == x.sizes() &&
              w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: shapes or dtypes differ");
  FREETOKEN_DISPATCH(x.scalar_type(), rms_norm_impl<scalar_t>(out, x, w, eps));
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && residual.sizes() == x.sizes() &&
              w.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: shapes or dtypes differ");
  FREETOKEN_DISPATCH(x.scalar_type(), add_rms_norm_impl<scalar_t>(x, residual, w, eps));
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
              out.scalar_type() == x.scalar_type(), "silu_and_mul: shapes or dtypes differ");
  FREETOKEN_DISPATCH(x.scalar_type(), silu_and_mul_impl<scalar_t>(out, x));
}

void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 &&
              x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary_embedding: x must be [T, heads, head_dim] with contiguous heads");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos/sin must be [T, head_dim] of x's dtype");
  FREETOKEN_DISPATCH(x.scalar_type(), rotary_impl<scalar_t>(x, cos, sin));
}

}  // namespace freetoken

TORCH_LIBRARY_FRAGMENT(freetoken, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()", &freetoken::rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        &freetoken::fused_add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()", &freetoken::silu_and_mul);
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin) -> ()",
        &freetoken::rotary_embedding);
}
