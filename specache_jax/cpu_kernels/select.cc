// Row selection for XLA:CPU: SpeCache's κ choice (top-k of a probability row) and the κ rows' gather.
//
// TopK: indices of the k largest of each row of x [N, S] float32, exactly XLA's TopK (xla/service/cpu's
// runtime): a total order on the float bits (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN), the larger
// first, ties by the lower index. Per row: order keys (uint32, ascending = that order), a threshold θ from a
// strided sample of 256 keys chosen so that ~3k keys are >= θ, the indices with key >= θ in index order (all of
// them when fewer than k pass), the k-th largest key T among those (nth_element), the indices above T then the
// first ones equal to T, sorted. O(S) with a small constant (XLA's partial_sort of S indices: O(S log k) through
// an indirect comparator); exact whatever θ turns out to be.
//
// ScatterTopK: TopK of scores the kernel builds from SpeCache's attention's two probability parts (the fused
// attention kernels return them so: `caches/specache.py`): row n's scores are low[n, :] with extra[n, e] added at
// position pos[n, e] for e = 0 .. E-1 in order (a position outside [0, S) adds nothing), then -1 at positions >=
// limit[n] (the positions κ may not pick). The dense scatter, the mask and TopK were ~6 XLA ops and a custom call
// per layer.
//
// ArgMax: the index of each row's largest element of x [N, V] float32, as jnp.argmax: the first NaN where the row
// has one, else the first element equal to the maximum (-0.0 == +0.0). Two passes over the row: the maximum and a
// NaN check 16 lanes at a time, then the first index equal to it (XLA:CPU's variadic reduce took ~85 µs for one
// row of SmolLM2's 49152 logits, two per decoding step).
//
// TakeRows: out[n, x, :] = buf[n, clip(idx[n, x], 0, S-1), :] for buf [N, S, R] of any element type (whole rows
// by memcpy; XLA:CPU's gather computes an index per element).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSample = 256;    // keys sampled for θ
constexpr int64_t kRowsPerItem = 4;  // rows per work item (a row costs a few µs: below that, threads cost more)

// XLA's TopK key (int32: the float bits, negatives mapped to INT32_MAX - bits), shifted so that unsigned order
// is its order.
inline uint32_t OrderKey(uint32_t bits) {
  const uint32_t v = static_cast<int32_t>(bits) < 0 ? 0x7fffffffu - bits : bits;
  return v ^ 0x80000000u;
}

// Indices i (in index order) with keys[i] >= theta -> cand; their count. 16 at a time by compress-stores on
// AVX-512.
int64_t Compact(const uint32_t* keys, int64_t s, uint32_t theta, int32_t* cand) {
  int64_t n = 0, i = 0;
#ifdef __AVX512F__
  const __m512i th = _mm512_set1_epi32(static_cast<int>(theta));
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (; i + 16 <= s; i += 16) {
    const __mmask16 ge = _mm512_cmpge_epu32_mask(_mm512_loadu_si512(keys + i), th);
    _mm512_mask_compressstoreu_epi32(cand + n, ge, idx);
    n += __builtin_popcount(ge);
    idx = _mm512_add_epi32(idx, step);
  }
#endif
  for (; i < s; ++i) {                                // branch-free compaction, index order
    cand[n] = static_cast<int32_t>(i);
    n += keys[i] >= theta;
  }
  return n;
}

void TopKRow(const float* x, int64_t s, int64_t k, int32_t* out) {
  thread_local std::vector<uint32_t> keys, tmp;
  thread_local std::vector<int32_t> cand;
  keys.resize(s);
  cand.resize(s);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  for (int64_t i = 0; i < s; ++i) keys[i] = OrderKey(bits[i]);
  uint32_t theta = 0;
  if (s > kSample && 4 * k < s) {                     // sample: j-th largest of m keys, ~3k of S above it
    const int64_t m = kSample, stride = s / m;
    const int64_t j = std::min<int64_t>(m, std::max<int64_t>(1, (3 * k * m + s - 1) / s));
    tmp.resize(m);
    for (int64_t i = 0; i < m; ++i) tmp[i] = keys[i * stride];
    std::nth_element(tmp.begin(), tmp.begin() + (m - j), tmp.end());
    theta = tmp[m - j];
  }
  int64_t n = Compact(keys.data(), s, theta, cand.data());
  if (n < k) {                                        // θ was too high: every index is a candidate
    for (int64_t i = 0; i < s; ++i) cand[i] = static_cast<int32_t>(i);
    n = s;
  }
  tmp.resize(n);
  for (int64_t i = 0; i < n; ++i) tmp[i] = keys[cand[i]];
  std::nth_element(tmp.begin(), tmp.begin() + (n - k), tmp.end());
  const uint32_t t = tmp[n - k];                      // the k-th largest key
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i)
    if (keys[cand[i]] > t) out[c++] = cand[i];
  for (int64_t i = 0; i < n && c < k; ++i)
    if (keys[cand[i]] == t) out[c++] = cand[i];
  thread_local std::vector<uint64_t> order;          // (key, ~index): descending = larger key, then lower index
  order.resize(k);
  for (int64_t i = 0; i < k; ++i) order[i] = (uint64_t{keys[out[i]]} << 32) | (0xffffffffu - uint32_t(out[i]));
  std::sort(order.begin(), order.end(), [](uint64_t a, uint64_t b) { return a > b; });
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int32_t>(0xffffffffu - uint32_t(order[i]));
}

ffi::Error TopK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2 || xd[0] != od[0])
    return ffi::Error::InvalidArgument("top_k: x must be [N, S] and the result [N, k]");
  const int64_t rows = xd[0], s = xd[1], k = od[1];
  if (k > s) return ffi::Error::InvalidArgument("top_k: k = " + std::to_string(k) + " > S = " + std::to_string(s));
  if (k == 0 || rows == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  auto item = [&](int64_t it) {
    for (int64_t r = it * kRowsPerItem; r < std::min(rows, (it + 1) * kRowsPerItem); ++r)
      TopKRow(xp + r * s, s, k, op + r * k);
  };
  if (items == 1) {
    item(0);
  } else {
    specache_cpu::RunAll(pool, item, items);
  }
  return ffi::Error::Success();
}

ffi::Error ScatterTopK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> low, ffi::Buffer<ffi::F32> extra,
                       ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> limit, ffi::ResultBuffer<ffi::S32> out) {
  const auto ld = low.dimensions(), ed = extra.dimensions(), pd = pos.dimensions(), md = limit.dimensions();
  const auto od = out->dimensions();
  if (ld.size() != 2 || ed.size() != 2 || pd.size() != 2 || md.size() != 1 || od.size() != 2 || ed[0] != ld[0] ||
      pd[0] != ld[0] || pd[1] != ed[1] || md[0] != ld[0] || od[0] != ld[0])
    return ffi::Error::InvalidArgument("scatter_top_k: low [N, S], extra [N, E], pos [N, E], limit [N] -> [N, k]");
  const int64_t rows = ld[0], s = ld[1], e = ed[1], k = od[1];
  if (k > s)
    return ffi::Error::InvalidArgument("scatter_top_k: k = " + std::to_string(k) + " > S = " + std::to_string(s));
  if (k == 0 || rows == 0) return ffi::Error::Success();
  const float *lp = low.typed_data(), *ep = extra.typed_data();
  const int32_t *pp = pos.typed_data(), *mp = limit.typed_data();
  int32_t* op = out->typed_data();
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  auto item = [&](int64_t it) {
    thread_local std::vector<float> scores;
    scores.resize(s);
    for (int64_t r = it * kRowsPerItem; r < std::min(rows, (it + 1) * kRowsPerItem); ++r) {
      std::memcpy(scores.data(), lp + r * s, s * sizeof(float));
      for (int64_t j = 0; j < e; ++j) {
        const int32_t at = pp[r * e + j];
        if (at >= 0 && at < s) scores[at] += ep[r * e + j];
      }
      std::fill(scores.begin() + std::min<int64_t>(s, std::max<int32_t>(0, mp[r])), scores.end(), -1.f);
      TopKRow(scores.data(), s, k, op + r * k);
    }
  };
  if (items == 1) {
    item(0);
  } else {
    specache_cpu::RunAll(pool, item, items);
  }
  return ffi::Error::Success();
}

int32_t ArgMaxRow(const float* x, int64_t v) {
  using specache_cpu::Load;
  using specache_cpu::Splat;
  using specache_cpu::V;
  using specache_cpu::VI;
  int64_t i = 0;
  V vmax = Splat(-std::numeric_limits<float>::infinity());
  VI nan{};
  for (; i + 16 <= v; i += 16) {
    const V a = Load(x + i);
    nan |= a != a;
    vmax = a > vmax ? a : vmax;
  }
  bool any_nan = false;
  for (int l = 0; l < 16; ++l) any_nan |= nan[l] != 0;
  float m = specache_cpu::MaxLanes(vmax, -std::numeric_limits<float>::infinity());
  for (int64_t j = i; j < v; ++j) {
    any_nan |= std::isnan(x[j]);
    m = x[j] > m ? x[j] : m;
  }
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 mv = _mm512_set1_ps(m);
  for (; j + 16 <= v; j += 16) {
    const __m512 a = _mm512_loadu_ps(x + j);
    const __mmask16 hit = any_nan ? _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(a, mv, _CMP_EQ_OQ);
    if (hit) return static_cast<int32_t>(j + __builtin_ctz(hit));
  }
#endif
  for (; j < v; ++j)
    if (any_nan ? std::isnan(x[j]) : x[j] == m) return static_cast<int32_t>(j);
  return 0;
}

ffi::Error ArgMax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || od.size() != 1 || xd[0] != od[0])
    return ffi::Error::InvalidArgument("argmax: x must be [N, V] and the result [N]");
  const int64_t rows = xd[0], v = xd[1];
  if (rows == 0) return ffi::Error::Success();
  if (v == 0) return ffi::Error::InvalidArgument("argmax: V = 0 elements per row");
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  auto row = [&](int64_t r) { op[r] = ArgMaxRow(xp + r * v, v); };
  if (rows == 1) {
    row(0);
  } else {
    specache_cpu::RunAll(pool, row, rows);
  }
  return ffi::Error::Success();
}

ffi::Error TakeRows(ffi::AnyBuffer buf, ffi::Buffer<ffi::S32> idx, ffi::Result<ffi::AnyBuffer> out) {
  const auto bd = buf.dimensions(), id = idx.dimensions(), od = out->dimensions();
  if (bd.size() != 3 || id.size() != 2 || od.size() != 3 || id[0] != bd[0] || od[0] != bd[0] ||
      od[1] != id[1] || od[2] != bd[2] || out->element_type() != buf.element_type())
    return ffi::Error::InvalidArgument("take_rows: buf [N, S, R], idx [N, X] -> [N, X, R] of buf's type");
  const int64_t n = bd[0], s = bd[1], x = id[1];
  if (n * x == 0) return ffi::Error::Success();
  if (s == 0) return ffi::Error::InvalidArgument("take_rows: S = 0 rows to take from");
  const size_t row = buf.size_bytes() / static_cast<size_t>(n * s);
  const char* src = static_cast<const char*>(buf.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* ip = idx.typed_data();
  for (int64_t a = 0; a < n; ++a)
    for (int64_t j = 0; j < x; ++j) {
      const int64_t r = std::min<int64_t>(s - 1, std::max<int32_t>(0, ip[a * x + j]));
      std::memcpy(dst + (a * x + j) * row, src + (a * s + r) * row, row);
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SelectTopK, TopK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [N, S]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices [N, k]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SelectTakeRows, TakeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // buf [N, S, R]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // idx [N, X]
                                  .Ret<ffi::AnyBuffer>());         // out [N, X, R]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SelectArgMax, ArgMax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [N, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices [N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(SelectScatterTopK, ScatterTopK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // low [N, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // extra [N, E]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // pos [N, E]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // limit [N]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices [N, k]
