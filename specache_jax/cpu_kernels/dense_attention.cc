// Decode attention over a dense float32 KV cache for XLA:CPU: the contract (and the float32 jnp reference) of
// dense_attention.py. For every (b, KV head k) the M = G·T query rows of that head (row m = g·T + t, pre-scaled
// by sm_scale) attend with one softmax over the slots s < limit[b] + t.
//
// Work items (b, k, chunk of kChunk slots) on the calling thread + XLA's intra-op pool (common.h), two phases:
//   1. per item: the logits of every row for the chunk's slots, 16 slots at a time (each slot's products with a
//      row as hd/16 vector FMAs, the 16 slots' sums by one transpose-reduce), the chunk's max and exp-sum per row
//      and Σ p·v over the chunk (each value row read once for every row). Chunks past every row's limit are
//      never read: the bytes read are the attended slots', not the buffer's.
//   2. per (b, k), on the thread that finishes its last chunk: the log-sum-exp merge of the chunks.
// A row with no visible slot gives 0. float32 throughout; the exp is cephes' expf polynomial (~1 ulp).
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using specache_cpu::Exp;
using specache_cpu::kIota;
using specache_cpu::Load;
using specache_cpu::MergeChunks;
using specache_cpu::Splat;
using specache_cpu::Store;
using specache_cpu::V;
using specache_cpu::VI;

constexpr int64_t kChunk = 512;       // slots per phase-1 item
constexpr int64_t kMaxRows = 64;      // M = G·T
constexpr int64_t kMaxHeadDim = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Lane j of the result = the sum of the 16 lanes of p[j]: four rounds of pairwise shuffles and adds. Each round
// halves the lanes a vector spends on one input; fed in bit-reversed order, the sums come out in order.
inline V Pair1(V x, V y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline V Pair2(V x, V y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline V Pair3(V x, V y) {
  return __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline V Pair4(V x, V y) {
  return __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
inline V Reduce16(const V* p) {
  const V a0 = Pair1(p[0], p[8]), a1 = Pair1(p[4], p[12]), a2 = Pair1(p[2], p[10]), a3 = Pair1(p[6], p[14]);
  const V a4 = Pair1(p[1], p[9]), a5 = Pair1(p[5], p[13]), a6 = Pair1(p[3], p[11]), a7 = Pair1(p[7], p[15]);
  const V b0 = Pair2(a0, a1), b1 = Pair2(a2, a3), b2 = Pair2(a4, a5), b3 = Pair2(a6, a7);
  return Pair4(Pair3(b0, b1), Pair3(b2, b3));
}

struct Shapes {
  int64_t b, k, m, t, hd, s, n_chunks;
};

// o[r] = Σ_j p[r, j] · v[j] for RB rows (p rows kChunk apart), their sums held in registers.
template <int RB>
void ValueRows(const float* p, const float* vb, int64_t n, int64_t hd, float* o) {
  const int64_t nv = hd / 16;
  for (int64_t i0 = 0; i0 < nv; i0 += 4) {                // 4 channel blocks (64 channels) at a time
    const int64_t ni = std::min<int64_t>(4, nv - i0);
    V acc[RB][4] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vb + j * hd + 16 * i0;
      for (int64_t i = 0; i < ni; ++i) {
        const V vv = Load(vr + 16 * i);
        for (int rr = 0; rr < RB; ++rr) acc[rr][i] += p[rr * kChunk + j] * vv;
      }
    }
    for (int rr = 0; rr < RB; ++rr)
      for (int64_t i = 0; i < ni; ++i) Store(o + rr * hd + 16 * (i0 + i), acc[rr][i]);
  }
}

// Phase 1 for (bk, chunk ci): c_max / c_sum [M] and c_out [M, hd] of the chunk (c_max -inf: nothing visible).
void ChunkItem(const Shapes& d, int64_t bk, int64_t ci, const float* q, const float* kc, const float* vc,
               const int32_t* limit, float* c_max, float* c_sum, float* c_out) {
  const int64_t m = d.m, hd = d.hd, nv = hd / 16, s0 = ci * kChunk;
  const int64_t lim = limit[bk / d.k];
  float* cm = c_max + (bk * d.n_chunks + ci) * m;
  float* cs = c_sum + (bk * d.n_chunks + ci) * m;
  float* co = c_out + (bk * d.n_chunks + ci) * m * hd;
  int64_t valid[kMaxRows], n_read = 0;                 // visible slots of the chunk per row, and for any row
  for (int64_t r = 0; r < m; ++r) {
    valid[r] = std::min<int64_t>(std::max<int64_t>(lim + r % d.t - s0, 0), std::min(kChunk, d.s - s0));
    n_read = std::max(n_read, valid[r]);
  }
  if (n_read == 0) {
    std::fill(co, co + m * hd, 0.f);
    std::fill(cm, cm + m, kNegInf);
    std::fill(cs, cs + m, 0.f);
    return;
  }
  const int64_t n16 = (n_read + 15) / 16 * 16;
  thread_local std::vector<float> logits_buf;
  if (logits_buf.size() < static_cast<size_t>(m * kChunk)) logits_buf.resize(m * kChunk);
  float* logits = logits_buf.data();
  const float* kb = kc + (bk * d.s + s0) * hd;
  const float* vb = vc + (bk * d.s + s0) * hd;
  const float* qb = q + bk * m * hd;
  for (int64_t r = 0; r < m; ++r) {
    V qv[kMaxHeadDim / 16];
    for (int64_t i = 0; i < nv; ++i) qv[i] = Load(qb + r * hd + 16 * i);
    for (int64_t j0 = 0; j0 < n_read; j0 += 16) {
      V part[16];
      const int64_t nb = std::min<int64_t>(16, n_read - j0);
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= nb) {
          part[j] = V{};
          continue;
        }
        const float* kr = kb + (j0 + j) * hd;
        V acc = qv[0] * Load(kr);
        for (int64_t i = 1; i < nv; ++i) acc += qv[i] * Load(kr + 16 * i);
        part[j] = acc;
      }
      Store(logits + r * kChunk + j0, Reduce16(part));
    }
    // softmax pieces: columns past the row's limit -> exp 0
    float* l = logits + r * kChunk;
    if (valid[r] == 0) {
      cm[r] = kNegInf;
      cs[r] = 0.f;
      std::fill(l, l + n16, 0.f);
      continue;
    }
    V vmax = Splat(kNegInf);
    for (int64_t j = 0; j < n16; j += 16) {
      const VI ok = (kIota + static_cast<int32_t>(j)) < static_cast<int32_t>(valid[r]);
      const V v = ok ? Load(l + j) : Splat(kNegInf);
      Store(l + j, v);
      vmax = vmax > v ? vmax : v;
    }
    const float row_max = specache_cpu::MaxLanes(vmax, kNegInf);
    V vsum = V{};
    for (int64_t j = 0; j < n16; j += 16) {
      const V e = Exp(Load(l + j) - row_max);
      Store(l + j, e);
      vsum += e;
    }
    float total = 0.f;
    for (int lane = 0; lane < 16; ++lane) total += vsum[lane];
    cm[r] = row_max;
    cs[r] = total;
  }
  // Σ p · v: each value row once for up to 4 rows at a time (p = 0 past a row's limit)
  for (int64_t r = 0; r < m; r += 4) {
    switch (std::min<int64_t>(4, m - r)) {
      case 1: ValueRows<1>(logits + r * kChunk, vb, n_read, hd, co + r * hd); break;
      case 2: ValueRows<2>(logits + r * kChunk, vb, n_read, hd, co + r * hd); break;
      case 3: ValueRows<3>(logits + r * kChunk, vb, n_read, hd, co + r * hd); break;
      default: ValueRows<4>(logits + r * kChunk, vb, n_read, hd, co + r * hd); break;
    }
  }
}

// Phase 2 for one (b, k): out rows from the chunks' pieces.
void MergeItem(const Shapes& d, int64_t bk, const float* c_max, const float* c_sum, const float* c_out, float* out) {
  const int64_t m = d.m, hd = d.hd, nv = hd / 16, nc = d.n_chunks;
  for (int64_t r = 0; r < m; ++r) {
    float row_max = kNegInf;
    for (int64_t c = 0; c < nc; ++c) row_max = std::max(row_max, c_max[(bk * nc + c) * m + r]);
    float* orow = out + (bk * m + r) * hd;
    if (row_max == kNegInf || std::isnan(row_max)) {
      std::fill(orow, orow + hd, 0.f);
      continue;
    }
    V acc[kMaxHeadDim / 16];
    for (int64_t i = 0; i < nv; ++i) acc[i] = V{};
    const float z = MergeChunks(c_max + bk * nc * m + r, c_sum + bk * nc * m + r, c_out + (bk * nc * m + r) * hd,
                                nc, m, hd, row_max, acc);
    const float inv = 1.f / z;
    for (int64_t i = 0; i < nv; ++i) Store(orow + 16 * i, acc[i] * inv);
  }
}

#define CHECK_ARG(cond, msg) \
  if (!(cond)) return ffi::Error::InvalidArgument(std::string("dense_decode_attention: ") + msg)

ffi::Error Run(ffi::ThreadPool pool, int64_t t_rows, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> limit, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  CHECK_ARG(qd.size() == 4 && kd.size() == 4 && vd.size() == 4, "ranks");
  Shapes d{qd[0], qd[1], qd[2], t_rows, qd[3], kd[2], 0};
  CHECK_ARG(kd[0] == d.b && kd[1] == d.k && kd[3] == d.hd, "k must be [B, K, S, H] like q's [B, K, M, H]");
  CHECK_ARG(vd[0] == kd[0] && vd[1] == kd[1] && vd[2] == kd[2] && vd[3] == kd[3], "v must have k's shape");
  CHECK_ARG(d.t >= 1 && d.m % d.t == 0 && d.m <= kMaxRows, "rows M must be G·T <= 64");
  CHECK_ARG(d.hd % 16 == 0 && d.hd <= kMaxHeadDim, "head_dim must be a multiple of 16, <= 128");
  CHECK_ARG(limit.dimensions().size() == 1 && limit.dimensions()[0] == d.b, "limit must be [B]");
  d.n_chunks = std::max<int64_t>(1, (d.s + kChunk - 1) / kChunk);
  const int64_t n_bk = d.b * d.k;
  thread_local std::vector<float> scratch;            // reused across calls by the calling thread
  const int64_t n_max = n_bk * d.n_chunks * d.m;
  const size_t need = 2 * n_max + n_max * d.hd;
  if (scratch.size() < need) scratch.resize(need);
  float* c_max = scratch.data();
  float* c_sum = c_max + n_max;
  float* c_out = c_sum + n_max;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t* lim = limit.typed_data();
  float* op = out->typed_data();
  specache_cpu::RunChunksThenMerge(
      pool, n_bk, d.n_chunks,
      [&](int64_t bk, int64_t ci) { ChunkItem(d, bk, ci, qp, kp, vp, lim, c_max, c_sum, c_out); },
      [&](int64_t bk) { MergeItem(d, bk, c_max, c_sum, c_out, op); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DenseDecodeAttention, Run,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("t_rows")
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q rows [B, K, M, H], scaled by sm_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [B, K, S, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [B, K, S, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // limit [B]: row t sees s < limit + t
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [B, K, M, H]
