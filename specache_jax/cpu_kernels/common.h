// Shared by the XLA:CPU kernels of this folder: 16-float vectors (GCC vector extensions) and a work queue whose
// items are claimed from an atomic counter by the calling thread and by helper tasks on XLA's intra-op pool.
#ifndef SPECACHE_JAX_CPU_KERNELS_COMMON_H_
#define SPECACHE_JAX_CPU_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace specache_cpu {

namespace ffi = xla::ffi;

// 16 floats: one AVX-512 register, two AVX2 ones, four SSE ones (GCC vector extensions pick what the CPU has).
typedef float V __attribute__((vector_size(64)));
typedef float VU __attribute__((vector_size(64), aligned(4)));   // the same, at any float-aligned address
typedef int32_t VI __attribute__((vector_size(64)));
typedef uint32_t VW __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// Whether vector adds and FMAs issue to separate pipes (AMD Zen 4/5: two FADD and two FMA pipes), so a sum runs
// twice as fast with half its adds written as FMAs (x·1 + a, exact). GCC 12's -march=native names a Zen 4
// "znver3" (it predates znver4); a znver3 with AVX-512 is a Zen 4. Intel's cores run both on the same ports.
#if defined(__AVX512F__) && (defined(__znver3__) || defined(__znver4__) || defined(__znver5__))
constexpr bool kSplitAddPipes = true;
#else
constexpr bool kSplitAddPipes = false;
#endif

inline V Load(const float* p) { return *reinterpret_cast<const VU*>(p); }
inline void Store(float* p, V v) { *reinterpret_cast<VU*>(p) = v; }
// x in every lane. Not `V{} + x`: GCC cannot drop that addition (it turns -0.0 into +0.0), so every broadcast
// became a scalar add plus a register broadcast (port 5, beside the FMAs) instead of one broadcast load.
inline V Splat(float x) { return V{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline const VI kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// Codes of 16 consecutive channels of one slot (the 2·b bytes at p) as floats.
template <int BITS>
inline V Codes16(const uint8_t* p) {
  if constexpr (BITS == 1) {
    uint16_t x;
    std::memcpy(&x, p, 2);
    return __builtin_convertvector(((VI{} + x) >> kIota) & 1, V);
  } else if constexpr (BITS == 2) {
    uint32_t x;
    std::memcpy(&x, p, 4);
    return __builtin_convertvector(VI(((VW{} + x) >> VW(2 * kIota)) & 3u), V);
  } else if constexpr (BITS == 4) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    const VW w = kIota < 8 ? VW{} + lo : VW{} + hi;
    return __builtin_convertvector(VI((w >> VW(4 * (kIota & 7))) & 15u), V);
  } else {
    typedef uint8_t VB __attribute__((vector_size(16)));
    VB x;
    std::memcpy(&x, p, 16);
    return __builtin_convertvector(__builtin_convertvector(x, VI), V);
  }
}

// exp(x) lane by lane; -inf and anything below the float range give 0. cephes expf: x = n ln2 + r, |r| <= ln2/2
// (n ln2 subtracted in two parts), exp(r) by a degree-7 polynomial, times 2^n. On AVX-512 n is one rounding and 2^n
// one vscalefps (13 vector ops; ~22 with a floor by conversions and 2^n built in the exponent bits, which needs
// both ends clamped and the dead lanes masked).
inline V Exp(V x) {
#ifdef __AVX512F__
  x = x < Splat(-104.f) ? Splat(-104.f) : x;             // below: 2^n underflows to 0 (and -inf gives no NaN)
  x = x > Splat(89.f) ? Splat(89.f) : x;                 // above: +inf
  // The masked intrinsics with every lane set are the same instructions as the plain ones, whose undefined
  // pass-through operand GCC 12 reports as maybe-uninitialized (-Wall).
  const __m512 xl2e = reinterpret_cast<__m512>(x * 1.44269504088896341f);
  const V nf = reinterpret_cast<V>(
      _mm512_mask_roundscale_ps(xl2e, 0xFFFF, xl2e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  const VI dead = x < Splat(-87.33654f);
  x = x < Splat(-87.33654f) ? Splat(-87.33654f) : x;
  x = x > Splat(88.02969f) ? Splat(88.02969f) : x;
  const V t = x * 1.44269504088896341f + 0.5f;
  VI n = __builtin_convertvector(t, VI);                 // toward zero ...
  n += __builtin_convertvector(n, V) > t;                // ... then floor (a true compare is -1)
  const V nf = __builtin_convertvector(n, V);
#endif
  const V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  V p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const V y = p * r * r + r + 1.0f;
#ifdef __AVX512F__
  const __m512 ym = reinterpret_cast<__m512>(y);
  return reinterpret_cast<V>(_mm512_mask_scalef_ps(ym, 0xFFFF, ym, reinterpret_cast<__m512>(nf)));
#else
  V pow2;
  const VI bits = (n + 127) << 23;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return dead ? Splat(0.f) : y * pow2;
#endif
}

// The lanes' sum by halves (a tree: 4 vector adds and 3 scalar ones instead of 15 dependent adds).
inline float Sum(V v) {
  typedef float V8 __attribute__((vector_size(32)));
  typedef float V4 __attribute__((vector_size(16)));
  const V8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The lanes' maximum by halves, with `init` (the same tree as Sum; 15 dependent scalar maxes take ~60 cycles on the
// path to a softmax's exps). NaN-free inputs (-inf allowed).
inline float MaxLanes(V v, float init) {
  typedef float V8 __attribute__((vector_size(32)));
  typedef float V4 __attribute__((vector_size(16)));
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), b = __builtin_shufflevector(v, v, 8, 9, 10,
                                                                                                    11, 12, 13, 14, 15);
  const V8 h = a > b ? a : b;
  const V4 c = __builtin_shufflevector(h, h, 0, 1, 2, 3), d = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const V4 q = c > d ? c : d;
  return std::max(std::max(std::max(q[0], q[2]), std::max(q[1], q[3])), init);
}

// The items of one call. The caller only waits for items another thread already claimed, so two calls running
// at once can never wait on each other's queued tasks.
struct Work {
  std::function<void(int64_t)> item;
  int64_t n_items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      item(i);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

// Whether the kernels may use XLA's intra-op pool: not when XLA_FLAGS asks XLA:CPU for single-threaded compute
// (--xla_cpu_multi_thread_eigen=false), so a kernel keeps to the one thread XLA's own ops use (the offloaded
// runtime's overlap measurement leaves the other core to the host store's worker). Read once, as XLA does.
inline bool PoolAllowed() {
  static const bool allowed = [] {
    const char* flags = std::getenv("XLA_FLAGS");
    if (flags == nullptr) return true;
    const char* at = std::strstr(flags, "--xla_cpu_multi_thread_eigen=");
    if (at == nullptr) return true;
    at += std::strlen("--xla_cpu_multi_thread_eigen=");
    return !(std::strncmp(at, "false", 5) == 0 || std::strncmp(at, "0", 1) == 0);
  }();
  return allowed;
}

// Runs item(0 .. n_items-1) on the calling thread and num_threads() - 1 of the pool's (XLA sizes the pool to the
// cores; only the calling thread when !PoolAllowed()); returns when every item is done. One helper per pool thread
// plus the caller would be one runnable thread more than there are cores: measured on the 2-core machine, the
// caller then spins on items a preempted helper holds (SmolLM2-135M's MLP weights at 4 rows: 15.5 GB/s with two
// helpers, 23.1 with one; the whole full-cache step at 1k, batch 4: 48 -> 39 ms).
inline void RunAll(ffi::ThreadPool& pool, std::function<void(int64_t)> item, int64_t n_items) {
  if (n_items <= 0) return;
  auto work = std::make_shared<Work>();
  work->item = std::move(item);
  work->n_items = n_items;
  const int64_t helpers = std::min<int64_t>(PoolAllowed() ? pool.num_threads() - 1 : 0, n_items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->n_items) std::this_thread::yield();
}

// Items (group g, chunk c) for g < n_groups, c < n_chunks on the calling thread + the pool (`RunAll`):
// chunk(g, c) for each, then merge(g) once on the thread that finishes group g's last chunk (no second round of
// tasks): the two-phase schedule of the decode-attention kernels (one group per (b, KV head)).
template <typename Chunk, typename Merge>
inline void RunChunksThenMerge(ffi::ThreadPool& pool, int64_t n_groups, int64_t n_chunks, Chunk chunk, Merge merge) {
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[n_groups]);
  for (int64_t i = 0; i < n_groups; ++i) left[i].store(n_chunks, std::memory_order_relaxed);
  RunAll(pool, [&](int64_t item) {
    const int64_t g = item / n_chunks;
    chunk(g, item % n_chunks);
    if (left[g].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(g);
  }, n_groups * n_chunks);
}

// The log-sum-exp merge of one row's chunks (online-softmax pieces at stride `m` rows): acc[0 .. hd/16) +=
// Σ_c exp(max_c - row_max) · out_c; returns Σ_c exp(max_c - row_max) · sum_c. Chunks with max -inf are skipped.
// c_max, c_sum: the row's first chunk ([n_chunks] at stride m); c_out: its first chunk's [hd] (stride m·hd).
inline float MergeChunks(const float* c_max, const float* c_sum, const float* c_out, int64_t n_chunks, int64_t m,
                         int64_t hd, float row_max, V* acc) {
  float z = 0.f;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const float cm = c_max[c * m];
    if (cm == -__builtin_inff()) continue;
    const float f = std::exp(cm - row_max);
    z += f * c_sum[c * m];
    for (int64_t i = 0; i < hd / 16; ++i) acc[i] += f * Load(c_out + c * m * hd + 16 * i);
  }
  return z;
}

}  // namespace specache_cpu

#endif  // SPECACHE_JAX_CPU_KERNELS_COMMON_H_
