// Attention over the paged KV cache, on the CPU, one query token at a time.
//
// Each query token (a decoding sequence's new token, or one token of a prefill chunk) reads
// its keys and values where they lie in the cache, block by block, up to its own position,
// instead of gathering them into a contiguous copy first (the torch path copies every key
// and value of every sequence, in every layer, at every step). A query's result depends only
// on its own query, keys and values: not on the other queries of the call, nor on how work
// is split (batch-invariant). Work is split over runs of queries (a prefill chunk's
// consecutive tokens, up to 8, read each chunk of keys and values together; a decoding
// sequence is a run of one), or (run, KV head) pairs when there are few, on ATen's thread
// pool or a team (parallel.h), longest context first, in shrinking pieces; the query heads
// of one KV head (grouped-query attention) share each key load.
//
// Layouts (see freetoken_core/engine/attention.py):
//   q            [D, H, hd]             any stride between tokens, heads contiguous
//   kv_cache     [slots, 2, KVH, hd]    keys and values of a slot side by side
//   block_tables [D, W] int32           cache blocks of each query's sequence, padded
//   context_lens [D] int32              keys each query attends to, its own included
//   window                              > 0: only the last `window` of those (sliding-window
//                                       attention: 0 <= query pos - key pos < window)
//   attention_chunk                     > 0: only those in the query's own chunk of that
//                                       many positions (Llama 4's chunked attention: key
//                                       pos / attention_chunk == query pos / attention_chunk);
//                                       not with a window
//   sinks        [H] float32, optional  each head's attention sink (gpt-oss): a logit that
//                                       joins every query's softmax with no value, so the
//                                       weights of its keys sum to less than one
//   softcap      > 0: each score (scaled) becomes softcap * tanh(score / softcap) before the
//                softmax (Gemma 2's attn_logit_softcapping); 0: none
//   out          [D, H, hd]             contiguous
// q and out float32 or bfloat16, the cache float32, bfloat16 or float16 (--kv-cache-dtype);
// sums are float32 either way.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

namespace {

#ifdef FREETOKEN_AVX2
using freetoken::vec::exp8;
using freetoken::vec::hsum;
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline void from_float(float x, float* p) { *p = x; }
inline void from_float(float x, c10::BFloat16* p) { *p = c10::BFloat16(x); }

#ifdef FREETOKEN_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// Sixteen lanes where the CPU has AVX-512: a head of 64 is four vectors rather than eight, so
// a key takes half the instructions (the scores' and the values' loops are bound by them
// where the cache is in the CPU's caches; from memory too, a core's loads and its sums not
// overlapping). The sums' lanes differ from AVX2's: the floats are the machine's own, the
// same in every batch.
#define FREETOKEN_ATTENTION_16 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Lanes 0-7 plus lanes 8-15.
inline __m256 fold16(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#endif

#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef FREETOKEN_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a0);
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += q[i] * to_float(k[i]);
  return s;
}

// acc[0:n] += p * v[0:n]
template <typename T>
inline void axpy(float p, const T* v, float* acc, int64_t n) {
  int64_t i = 0;
#ifdef FREETOKEN_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * to_float(v[i]);
}

// The largest of s[0:n] (n >= 1), eight lanes at a time: the branchy scalar loop it replaces
// cost a cycle or two per score, a seventh of a long context's attention.
inline float max_of(const float* s, int64_t n) {
  int64_t i = 0;
  float m = s[0];
#ifdef FREETOKEN_AVX2
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// scores[0:n] = exp(scores - max), returns their sum.
inline float exp_and_sum(float* s, int64_t n, float max) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef FREETOKEN_AVX2
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}

// s[0:n] = cap * tanh(s / cap) (cap > 0), tanh(y) as 1 - 2 / (exp(2y) + 1), eight lanes at
// a time; the last n % 8 through the same lanes, padded, so that every score gets the same
// floats wherever it lies in the range (the absolute error, ~1e-7 of cap, is far below the
// scores' own rounding).
inline void softcap_scores(float* s, int64_t n, float cap) {
  const float two_over_cap = 2.f / cap;
#ifdef FREETOKEN_AVX2
  const __m256 k = _mm256_set1_ps(two_over_cap), c = _mm256_set1_ps(cap);
  const __m256 one = _mm256_set1_ps(1.f), two_c = _mm256_set1_ps(2.f * cap);
  const auto cap8 = [&](__m256 x) {
    const __m256 e = exp8(_mm256_mul_ps(x, k));
    return _mm256_sub_ps(c, _mm256_div_ps(two_c, _mm256_add_ps(e, one)));
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, cap8(_mm256_loadu_ps(s + i)));
  if (i < n) {
    float tail[8] = {};
    std::copy(s + i, s + n, tail);
    _mm256_storeu_ps(tail, cap8(_mm256_loadu_ps(tail)));
    std::copy(tail, tail + (n - i), s + i);
  }
#else
  for (int64_t i = 0; i < n; ++i) s[i] = cap - 2.f * cap / (std::exp(s[i] * two_over_cap) + 1.f);
#endif
}

// What a pass over keys requests ahead of the slot it reads: `count` elements of the slots
// before `end` (the item's last key), from where it reads: every head's part of a slot, by
// the first pass over a chunk (the others read it from the caches: count 0).
struct Ahead {
  int64_t count, end;
};

#ifdef FREETOKEN_AVX2
// Slots ahead of the one being read whose bytes are requested early: a sequence's slots lie
// in blocks scattered over the cache, and a head's key or value is a short piece of each
// slot (256 of 1,536 bytes in the default model), a stride the hardware prefetchers do not
// follow across 4 KiB.
constexpr int64_t kAheadSlots = 8;

// The cache lines of p[0:count] requested into L1.
template <typename T>
inline void prefetch(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(bytes + b, _MM_HINT_T0);
}

// The attention loops' vectors: L float32 lanes, AVX2's 8 or AVX-512's 16 (kLanes).
template <int L>
struct Lanes;
template <>
struct Lanes<8> {
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static V load_cache(const T* p) { return load8(p); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256 to8(V v) { return v; }
};
#ifdef FREETOKEN_ATTENTION_16
template <>
struct Lanes<16> {
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static V load_cache(const T* p) { return load16(p); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __m256 to8(V v) { return fold16(v); }  // lanes 0-7 plus lanes 8-15
};
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

// out[(h G + g) * out_stride + t] = q[h G + g] . (slots[t] + offset + h n)[0:n] for the G
// query heads of each of `heads` consecutive KV heads and t in [t0, t1): four keys at a
// time, the KV heads in turn (a slot's keys of consecutive heads lie side by side: the four
// slots' bytes are read in order), each key vector loaded once for its G heads (4 keys x G
// heads of FMA chains per pass), each score's lanes reduced with its four (hadd), then the
// keys left one by one (dot). t0 is a multiple of 4, so a key is in the same four whatever
// range it is computed in, unless it is one of the last t1 % 4 of its query's context (t1
// is then that context's length): the same floats for any G, heads and range.
template <typename T, int G>
void group_scores(const float* q, int64_t heads, const T* const* slots, int64_t offset,
                  int64_t t0, int64_t t1, int64_t n, float* out, int64_t out_stride,
                  Ahead ahead) {
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    for (int64_t a = t + kAheadSlots; a < std::min(t + kAheadSlots + 4, ahead.end); ++a)
      prefetch(slots[a] + offset, ahead.count);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = offset + h * n;
      const float* qh = q + h * G * n;
      float* oh = out + h * G * out_stride;
      const T* k[4] = {slots[t] + at, slots[t + 1] + at, slots[t + 2] + at, slots[t + 3] + at};
      using W = Lanes<kLanes>;
      typename W::V w[G][4];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) w[g][j] = W::zero();
      for (int64_t i = 0; i < n; i += kLanes) {
        typename W::V kv[4];
        for (int j = 0; j < 4; ++j) kv[j] = W::load_cache(k[j] + i);
        for (int g = 0; g < G; ++g) {
          const typename W::V qv = W::load(qh + g * n + i);
          for (int j = 0; j < 4; ++j) w[g][j] = W::fma(qv, kv[j], w[g][j]);
        }
      }
      __m256 a[G][4];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) a[g][j] = W::to8(w[g][j]);
      for (int g = 0; g < G; ++g) {
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]),
                                        _mm256_hadd_ps(a[g][2], a[g][3]));
        _mm_storeu_ps(oh + g * out_stride + t,
                      _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
      }
    }
  }
  for (; t < t1; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int g = 0; g < G; ++g)
        out[(h * G + g) * out_stride + t] =
            dot(q + (h * G + g) * n, slots[t] + offset + h * n, n);
}
#endif

// Scores of the `group` query heads of each of `heads` consecutive KV heads,
// q[(h group + g) * n : +n], against their keys t0 to t1, into
// out[(h group + g) * out_stride + t].
template <typename T>
void head_group_scores(const float* q, int64_t group, int64_t heads, const T* const* slots,
                       int64_t offset, int64_t t0, int64_t t1, int64_t n, float* out,
                       int64_t out_stride, Ahead ahead) {
#ifdef FREETOKEN_AVX2
  if (n % kLanes == 0) {
    switch (group) {
      case 1:
        return group_scores<T, 1>(q, heads, slots, offset, t0, t1, n, out, out_stride, ahead);
      case 2:
        return group_scores<T, 2>(q, heads, slots, offset, t0, t1, n, out, out_stride, ahead);
      case 3:
        return group_scores<T, 3>(q, heads, slots, offset, t0, t1, n, out, out_stride, ahead);
      case 4:
        return group_scores<T, 4>(q, heads, slots, offset, t0, t1, n, out, out_stride, ahead);
      default:
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t g = 0; g < group; ++g)
            group_scores<T, 1>(q + (h * group + g) * n, 1, slots, offset + h * n, t0, t1, n,
                               out + (h * group + g) * out_stride, 1,
                               h == 0 && g == 0 ? ahead : Ahead{0, 0});
        return;
    }
  }
#endif
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < group; ++g)
      for (int64_t t = t0; t < t1; ++t)
        out[(h * group + g) * out_stride + t] =
            dot(q + (h * group + g) * n, slots[t] + offset + h * n, n);
}

#ifdef FREETOKEN_AVX2
// acc[r][0:4L] (+)= sum over t in [t0, t1) of p[r * p_stride + t] * (slots[t] + offset)[0:4L],
// for R rows at once, the 4 x R accumulators of L lanes held in registers: from zero with
// `first`, else from acc (the sum so far, in t's order: the same floats as one pass over
// every t).
template <typename T, int R, int L>
void weighted_values_4(const float* p, int64_t p_stride, int64_t t0, int64_t t1, bool first,
                       const T* const* slots, int64_t offset, float* acc, int64_t acc_stride,
                       Ahead ahead) {
  using W = Lanes<L>;
  typename W::V a[R][4];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) a[r][k] = first ? W::zero() : W::load(acc + r * acc_stride + L * k);
  for (int64_t t = t0; t < t1; ++t) {
    const T* v = slots[t] + offset;
    if (t + kAheadSlots < ahead.end) prefetch(slots[t + kAheadSlots] + offset, ahead.count);
    typename W::V vk[4];
    for (int k = 0; k < 4; ++k) vk[k] = W::load_cache(v + L * k);
    for (int r = 0; r < R; ++r) {
      const typename W::V pr = W::broadcast(p + r * p_stride + t);
      for (int k = 0; k < 4; ++k) a[r][k] = W::fma(pr, vk[k], a[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) W::store(acc + r * acc_stride + L * k, a[r][k]);
}

// weighted_values below over columns 4L at a time, rows three at a time.
template <typename T, int L>
void values_by_columns(const float* p, int64_t rows, int64_t p_stride, int64_t t0, int64_t t1,
                       bool first, const T* const* slots, int64_t offset, int64_t n,
                       float* acc, Ahead ahead) {
  for (int64_t r = 0; r < rows; r += 3) {
    for (int64_t c = 0; c < n; c += 4 * L) {
      const float* pr = p + r * p_stride;
      float* out = acc + r * n + c;
      // The first pass over the keys requests what every pass reads.
      const Ahead a = r == 0 && c == 0 ? ahead : Ahead{0, 0};
      switch (std::min<int64_t>(3, rows - r)) {
        case 3:
          weighted_values_4<T, 3, L>(pr, p_stride, t0, t1, first, slots, offset + c, out, n, a);
          break;
        case 2:
          weighted_values_4<T, 2, L>(pr, p_stride, t0, t1, first, slots, offset + c, out, n, a);
          break;
        default:
          weighted_values_4<T, 1, L>(pr, p_stride, t0, t1, first, slots, offset + c, out, n, a);
      }
    }
  }
}
#endif

// acc[r][0:n] (+)= sum over t in [t0, t1) of p[r * p_stride + t] * (slots[t] + offset)[0:n]
// for `rows` rows that share the values (the query heads of one KV head); `first` starts
// from zero.
template <typename T>
void weighted_values(const float* p, int64_t rows, int64_t p_stride, int64_t t0, int64_t t1,
                     bool first, const T* const* slots, int64_t offset, int64_t n, float* acc,
                     Ahead ahead) {
#ifdef FREETOKEN_ATTENTION_16
  if (n % 64 == 0)
    return values_by_columns<T, 16>(p, rows, p_stride, t0, t1, first, slots, offset, n, acc,
                                    ahead);
#endif
#ifdef FREETOKEN_AVX2
  if (n % 32 == 0)
    return values_by_columns<T, 8>(p, rows, p_stride, t0, t1, first, slots, offset, n, acc,
                                   ahead);
#endif
  if (first) std::fill(acc, acc + rows * n, 0.f);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < rows; ++r)
      axpy(p[r * p_stride + t], slots[t] + offset, acc + r * n, n);
}

// Queries of a run, and the keys of a chunk, the unit of the pass over the keys (a multiple
// of 4: the scores' groups of four keys; chunks start at multiples of it, whatever the
// query's step, so that a query's floats are the same in every batch).
constexpr int64_t kRun = 8, kRunChunk = 64;

// TQ: the queries' and the output's type; T: the cache's.
template <typename TQ, typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      int64_t block_size, double scale, int64_t window, int64_t attention_chunk,
                      const float* sinks, float softcap, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t q_stride = q.stride(0), slot_stride = kv_cache.stride(0);
  const int64_t table_width = block_tables.size(1);
  const TQ* q_ptr = q.data_ptr<TQ>();
  const T* cache = kv_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  TQ* out_ptr = out.data_ptr<TQ>();
  const float scale_f = static_cast<float>(scale);
  // The first key a query of context `len` attends to (never earlier for a longer context:
  // a run's first query reads the fewest keys); its scores are computed from that key
  // rounded down to a multiple of 4 (group_scores' groups of four keys, so a key's score is
  // the same floats whatever the range), the softmax and the values from the key itself.
  const auto first_key = [window, attention_chunk](int64_t len) {
    // (the query is key len - 1)
    if (attention_chunk > 0) return (len - 1) / attention_chunk * attention_chunk;
    return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0};
  };

  // Runs: consecutive queries of one sequence (the tokens of a prefill chunk: the same cache
  // blocks, each context one key longer), up to kRun of them, computed together key chunk
  // by key chunk, so that each chunk's keys and values are read from memory once for the
  // run rather than once per query. Every query's arithmetic is the one it has alone (the
  // same scores, the same softmax, the values summed in the same order): a run changes only
  // which loads hit the cache. Decoding sequences are runs of one.
  std::vector<int64_t> runs = {0};
  for (int64_t i = 1; i <= num_seqs; ++i) {
    const int64_t first = runs.back();
    const bool extends =
        i < num_seqs && i - first < kRun && lens[i] == lens[i - 1] + 1 &&
        std::equal(tables + i * table_width,
                   tables + i * table_width + (lens[i] + block_size - 1) / block_size,
                   tables + first * table_width);
    if (!extends) runs.push_back(i);
  }
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;

  // With enough runs, one work item is a whole run, so that each cache slot (all KV heads'
  // keys, then values, side by side) is streamed once, in order. With few, items are
  // (run, KV head) pairs, to keep every thread busy.
  const int64_t heads_per_item =
      num_runs >= 2 * freetoken::work_threads() ? num_kv_heads : 1;
  const int64_t items_per_run = num_kv_heads / heads_per_item;
  const int64_t rows = heads_per_item * group;  // query heads of one item, per query

  // Items longest context first, handed out to the threads in shrinking pieces
  // (guided_for): the long ones start early and the short ones fill the end, so both threads
  // finish together whatever the mix of lengths (a prefill chunk's tokens have growing
  // contexts; decoding sequences are at different points of their answers).
  const int64_t num_items = num_runs * items_per_run;
  std::vector<int64_t> order(num_items);
  std::iota(order.begin(), order.end(), 0);
  const auto longest = [&](int64_t run) { return lens[runs[run + 1] - 1]; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return longest(a / items_per_run) > longest(b / items_per_run);
  });
  freetoken::guided_for(num_items, 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, maxes, sums, scores;
    std::vector<const T*> slots;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t item = order[j];
      const int64_t run = item / items_per_run;
      const int64_t first = runs[run], count = runs[run + 1] - first;
      const int64_t kv0 = (item % items_per_run) * heads_per_item;
      const int64_t most = lens[first + count - 1];
      // Keys before this one are read by none of the run's queries (the first has the
      // shortest context).
      const int64_t least = first_key(lens[first]) & ~int64_t{3};
      const int64_t chunk = kRunChunk;
      qf.resize(count * rows * head_dim);
      acc.resize(count * rows * head_dim);
      maxes.resize(count * rows);
      sums.resize(count * rows);
      // A chunk's scores, query i, row r: scores[(i * rows + r) * chunk + t - t0].
      scores.resize(count * rows * chunk);
      for (int64_t i = 0; i < count; ++i) {
        const TQ* q_item = q_ptr + (first + i) * q_stride + kv0 * group * head_dim;
        for (int64_t e = 0; e < rows * head_dim; ++e)
          qf[i * rows * head_dim + e] = to_float(q_item[e]) * scale_f;
      }
      // Where each key's slot lies, block by block (the run's queries share the blocks).
      const int32_t* table = tables + (first + count - 1) * table_width;
      slots.resize(most);
      for (int64_t t = least / block_size * block_size; t < most; t += block_size) {
        const T* block =
            cache + static_cast<int64_t>(table[t / block_size]) * block_size * slot_stride;
        for (int64_t i = 0; i < block_size && t + i < most; ++i)
          slots[t + i] = block + i * slot_stride;
      }
      // One pass over the keys, a chunk at a time: the chunk's scores, then its values
      // weighted by their exponentials, each query's softmax kept as a running maximum and
      // sum (the values summed so far rescaled where a chunk raises the maximum). The
      // chunk's values are read while its keys' neighbours are still in the caches; and the
      // scores of a chunk, not of a whole context, stay in L1. (With the scores' heads in
      // turn and the 16-lane loops, 30 layers of the default model, 16 sequences, against
      // two passes of 8 lanes: ~1,100 keys 32.4 -> 24.9 ms, ~150 keys 3.3 -> 2.1-2.3 ms;
      // bench/attention.py, Zen 5.)
      for (int64_t t0 = least / chunk * chunk; t0 < most; t0 += chunk) {
        const T* const* chunk_slots = slots.data() + t0;
        // What the run's first query requests ahead: every head's keys (values) of a slot;
        // the run's other queries read the same slots from the caches.
        const Ahead ahead{heads_per_item * head_dim, most - t0};
        for (int64_t i = 0; i < count; ++i) {
          const int64_t len = lens[first + i], lo = first_key(len);
          const int64_t t1 = std::min(t0 + chunk, len), from = std::max(t0, lo);
          if (from >= t1) continue;  // (then the scores' start, lo rounded down, is past t1 too)
          const Ahead query_ahead = i == 0 ? ahead : Ahead{0, 0};
          float* query_scores = scores.data() + i * rows * chunk;
          head_group_scores(qf.data() + i * rows * head_dim, group, heads_per_item, chunk_slots,
                            kv0 * head_dim, std::max(t0, lo & ~int64_t{3}) - t0, t1 - t0,
                            head_dim, query_scores, chunk, query_ahead);
          for (int64_t r = 0; r < rows; ++r) {
            float* s = query_scores + r * chunk + (from - t0);
            if (softcap > 0.f) softcap_scores(s, t1 - from, softcap);
            const float chunk_max = max_of(s, t1 - from);
            float& m = maxes[i * rows + r];
            float& l = sums[i * rows + r];
            if (from == lo) {  // the query's first chunk
              m = chunk_max;
              l = 0.f;
            } else if (chunk_max > m) {
              const float rescale = std::exp(m - chunk_max);
              float* a = acc.data() + (i * rows + r) * head_dim;
              for (int64_t e = 0; e < head_dim; ++e) a[e] *= rescale;
              l *= rescale;
              m = chunk_max;
            }
            l += exp_and_sum(s, t1 - from, m);
          }
          // The chunk that holds the first key starts the sum (chunks run in key order).
          for (int64_t h = 0; h < heads_per_item; ++h)
            weighted_values(query_scores + h * group * chunk, group, chunk, from - t0, t1 - t0,
                            from == lo, chunk_slots, (num_kv_heads + kv0 + h) * head_dim,
                            head_dim, acc.data() + (i * rows + h * group) * head_dim,
                            h == 0 ? query_ahead : Ahead{0, 0});
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        TQ* o = out_ptr + ((first + i) * num_heads + kv0 * group) * head_dim;
        for (int64_t r = 0; r < rows; ++r) {
          float* a = acc.data() + (i * rows + r) * head_dim;
          float l = sums[i * rows + r];
          if (sinks != nullptr) {
            // The sink's exponential joins the sum, against the larger of the sink and the
            // keys' maximum (the values rescaled where the sink is larger).
            const float sink = sinks[kv0 * group + r], m = maxes[i * rows + r];
            if (sink > m) {
              const float rescale = std::exp(m - sink);
              for (int64_t e = 0; e < head_dim; ++e) a[e] *= rescale;
              l = l * rescale + 1.f;
            } else {
              l += std::exp(sink - m);
            }
          }
          const float inv = 1.f / l;
          for (int64_t e = 0; e < head_dim; ++e) from_float(a[e] * inv, o + r * head_dim + e);
        }
      }
    }
  });
}

}  // namespace

namespace freetoken {

// paged_decode_attention with a sliding window (the op's `window` argument; 0: none),
// attention sinks (`sinks`: none where absent), the scores' softcap (`softcap`; 0: none) and
// chunked attention (`attention_chunk`; 0: none).
void paged_window_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, at::Tensor out, int64_t window,
                            const std::optional<at::Tensor>& sinks, double softcap,
                            int64_t attention_chunk) {
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0");
  TORCH_CHECK(attention_chunk >= 0 && !(attention_chunk > 0 && window > 0),
              "paged_decode_attention: attention_chunk must be >= 0, and 0 with a window");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap),
              "paged_decode_attention: softcap must be finite and >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);
  const float* sink_ptr = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == q.size(1),
                "paged_decode_attention: sinks must be contiguous float32 [heads]");
    sink_ptr = sinks->data_ptr<float>();
  }
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 4 && kv_cache.size(1) == 2, "bad shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q: heads must be contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && out.is_contiguous(), "cache and out: contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block_tables and context_lens: contiguous int32");
  TORCH_CHECK(q.size(1) % kv_cache.size(2) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(kv_cache.size(3) == q.size(2), "head_dim mismatch");
  const auto run = [&](auto q_type) {
    using TQ = decltype(q_type);
    switch (kv_cache.scalar_type()) {
      case at::kFloat:
        return decode_attention<TQ, float>(q, kv_cache, block_tables, context_lens, block_size,
                                           scale, window, attention_chunk, sink_ptr, cap, out);
      case at::kBFloat16:
        return decode_attention<TQ, c10::BFloat16>(q, kv_cache, block_tables, context_lens,
                                                   block_size, scale, window, attention_chunk,
                                                   sink_ptr, cap, out);
      case at::kHalf:
        return decode_attention<TQ, c10::Half>(q, kv_cache, block_tables, context_lens,
                                               block_size, scale, window, attention_chunk,
                                               sink_ptr, cap, out);
      default:
        TORCH_CHECK(false, "paged_decode_attention: a float32, bfloat16 or float16 cache only");
    }
  };
  if (q.scalar_type() == at::kFloat) {
    run(float{});
  } else if (q.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 queries only");
  }
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, at::Tensor out) {
  paged_window_attention(q, kv_cache, block_tables, context_lens, block_size, scale, out, 0,
                         std::nullopt, 0.0, 0);
}

}  // namespace freetoken

TORCH_LIBRARY(freetoken, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, Tensor(a!) out, int window=0, "
        "Tensor? sinks=None, float softcap=0.0, int attention_chunk=0) -> ()",
        &freetoken::paged_window_attention);
}
