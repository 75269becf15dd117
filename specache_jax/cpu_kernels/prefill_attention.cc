// Causal prefill attention for XLA:CPU: the contract of caches/attention.py's `prefill_attention` without the
// column sums (its float32 reference, `prefill_attention_reference`, is the reference here too).
//
// Row t of prompt b (each of the G query heads of a KV head) attends to keys j <= min(t, lengths[b] - 1) with
// one softmax; rows past a prompt's length attend to the whole prompt; a prompt of length 0 gives zeros.
// Inputs: q [B, T, N, H] (scaled here by sm_scale), keys transposed per block of kBk columns kt [B, K, Tp/kBk, H,
// kBk] (a block's 64 KiB contiguous: no page per channel; Tp >= T a multiple of kBk, the padding never attended)
// and values v [B, T, K, H] as the projection wrote them (rows K·H floats apart; only rows < T are read). Output
// [B, T, N, H].
//
// Work items (b, KV head, block of kBq positions), heaviest (last) blocks first, on XLA's pool. An item walks
// the key blocks of kBk columns up to its diagonal (a block's keys and values stay in L2 while every row tile
// of the item uses them); per tile of kRows rows (position-major, then group head): logits by a register-tiled
// product with the transposed keys, the mask where a block crosses a row's limit, the online softmax (running
// max and normaliser; cephes exp), and the probability-value product into the tile's accumulator. float32
// throughout.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
using specache_cpu::Splat;
using specache_cpu::Store;
using specache_cpu::V;
using specache_cpu::VI;

constexpr int64_t kBq = 64;     // query positions per item
constexpr int64_t kBk = 256;    // key columns per step (the Python side pads Tp to a multiple)
constexpr int kRows = 6;        // rows per register tile (6 x 64 floats = 24 accumulators)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// s[r, 0 .. n64) = Σ_h q[r, h] kt[h, 0 .. n64) for kRows rows; q [kRows, hd], kt row stride ld, s row stride lds.
void Logits(const float* q, int64_t hd, const float* kt, int64_t ld, int64_t n64, float* s, int64_t lds) {
  for (int64_t j = 0; j < n64; j += 64) {
    V acc[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = V{};
    const float* kp = kt + j;
    for (int64_t h = 0; h < hd; ++h) {
      const V k0 = Load(kp + h * ld), k1 = Load(kp + h * ld + 16), k2 = Load(kp + h * ld + 32),
              k3 = Load(kp + h * ld + 48);
      for (int r = 0; r < kRows; ++r) {
        const V qv = Splat(q[r * hd + h]);
        acc[r][0] += qv * k0;
        acc[r][1] += qv * k1;
        acc[r][2] += qv * k2;
        acc[r][3] += qv * k3;
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) Store(s + r * lds + j + 16 * i, acc[r][i]);
  }
}

// o[r, :] = o[r, :] · alpha[r] + Σ_{j<n} p[r, j] v[j, :] for kRows rows (hd a multiple of 64).
void ProbValues(const float* p, int64_t lds, int64_t n, const float* v, int64_t ldv, int64_t hd, const float* alpha,
                float* o) {
  for (int64_t c = 0; c < hd; c += 64) {
    V acc[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = Load(o + r * hd + c + 16 * i) * alpha[r];
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = v + j * ldv + c;
      const V v0 = Load(vr), v1 = Load(vr + 16), v2 = Load(vr + 32), v3 = Load(vr + 48);
      for (int r = 0; r < kRows; ++r) {
        const V pv = Splat(p[r * lds + j]);
        acc[r][0] += pv * v0;
        acc[r][1] += pv * v1;
        acc[r][2] += pv * v2;
        acc[r][3] += pv * v3;
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) Store(o + r * hd + c + 16 * i, acc[r][i]);
  }
}

struct Dims {
  int64_t b, t, n, kh, g, hd, tp;
};

void Item(const Dims& d, int64_t bk, int64_t qb, const float* q, const float* kt, const float* v, int64_t len,
          float sm_scale, float* out) {
  const int64_t b = bk / d.kh, k = bk % d.kh, g = d.g, hd = d.hd;
  const int64_t t0 = qb * kBq, t1 = std::min(d.t, t0 + kBq);
  const int64_t rows = (t1 - t0) * g, tiles = (rows + kRows - 1) / kRows, padded = tiles * kRows;
  auto out_row = [&](int64_t r) { return out + ((b * d.t + t0 + r / g) * d.n + k * g + r % g) * hd; };
  if (len <= 0) {                                          // nothing to attend: zeros
    for (int64_t r = 0; r < rows; ++r) std::fill(out_row(r), out_row(r) + hd, 0.f);
    return;
  }
  thread_local std::vector<float> qs, o, m, l, lim_f, s, alpha;
  qs.assign(padded * hd, 0.f);
  o.assign(padded * hd, 0.f);
  m.assign(padded, kNegInf);
  l.assign(padded, 0.f);
  s.resize(kRows * kBk);
  alpha.resize(kRows);
  std::vector<int64_t> lim(padded);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t rr = std::min(r, rows - 1);
    lim[r] = std::min<int64_t>(t0 + rr / g, len - 1);    // the last key column row r sees
    if (r < rows) {
      const float* src = q + ((b * d.t + t0 + r / g) * d.n + k * g + r % g) * hd;
      for (int64_t h = 0; h < hd; ++h) qs[r * hd + h] = src[h] * sm_scale;
    }
  }
  const int64_t n_cols = lim[rows - 1] + 1;                // the item's last row sees the most columns
  const float* ktb = kt + bk * hd * d.tp;
  const float* vb = v + (b * d.t * d.kh + k) * hd;       // v [B, T, K, H]: rows K·H apart
  for (int64_t c0 = 0; c0 < n_cols; c0 += kBk) {
    const int64_t n = std::min(kBk, n_cols - c0), n16 = (n + 15) / 16 * 16, n64 = (n + 63) / 64 * 64;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t r0 = tile * kRows;
      Logits(qs.data() + r0 * hd, hd, ktb + c0 * hd, kBk, n64, s.data(), kBk);
      for (int r = 0; r < kRows; ++r) {
        float* sr = s.data() + r * kBk;
        const int64_t last = lim[r0 + r] - c0;             // columns past it are masked (incl. past n)
        V vmax = Splat(kNegInf);
        for (int64_t j = 0; j < n16; j += 16) {
          V x = Load(sr + j);
          if (j + 15 > last) {
            const VI off = kIota + static_cast<int32_t>(j);
            x = off > static_cast<int32_t>(last) ? Splat(kNegInf) : x;
            Store(sr + j, x);
          }
          vmax = vmax > x ? vmax : x;
        }
        const float mx = specache_cpu::MaxLanes(vmax, m[r0 + r]);
        if (mx == kNegInf) {                               // no column of this block (and none before)
          alpha[r] = 1.f;
          std::fill(sr, sr + n16, 0.f);
          continue;
        }
        alpha[r] = m[r0 + r] == kNegInf ? 0.f : std::exp(m[r0 + r] - mx);
        V vsum = V{};
        for (int64_t j = 0; j < n16; j += 16) {
          const V e = Exp(Load(sr + j) - mx);
          Store(sr + j, e);
          vsum += e;
        }
        const float total = specache_cpu::Sum(vsum);
        l[r0 + r] = l[r0 + r] * alpha[r] + total;
        m[r0 + r] = mx;
      }
      ProbValues(s.data(), kBk, n, vb + c0 * d.kh * hd, d.kh * hd, hd, alpha.data(), o.data() + r0 * hd);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    float* dst = out_row(r);
    for (int64_t h = 0; h < hd; ++h) dst[h] = o[r * hd + h] * inv;
  }
}

ffi::Error Run(ffi::ThreadPool pool, float sm_scale, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = kt.dimensions(), vd = v.dimensions(), ld = lengths.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 4 || ld.size() != 1)
    return ffi::Error::InvalidArgument(
        "prefill_attention: q [B,T,N,H], kt [B,K,Tp/kBk,H,kBk], v [B,T,K,H], lengths [B]");
  Dims d{qd[0], qd[1], qd[2], kd[1], 0, qd[3], kd[2] * kd[4]};
  if (d.kh < 1 || d.n % d.kh || kd[0] != d.b || kd[3] != d.hd || kd[4] != kBk || vd[0] != d.b || vd[1] != d.t ||
      vd[2] != d.kh || vd[3] != d.hd || ld[0] != d.b)
    return ffi::Error::InvalidArgument("prefill_attention: shapes do not agree");
  if (d.hd % 64 || d.tp % kBk || d.tp < d.t)
    return ffi::Error::InvalidArgument("prefill_attention: H must be a multiple of 64 and Tp of " +
                                       std::to_string(kBk) + ", >= T");
  d.g = d.n / d.kh;
  const int64_t n_qb = (d.t + kBq - 1) / kBq, n_items = d.b * d.kh * n_qb;
  const float *qp = q.typed_data(), *ktp = kt.typed_data(), *vp = v.typed_data();
  const int32_t* lens = lengths.typed_data();
  float* op = out->typed_data();
  auto item = [&](int64_t it) {                            // the last (heaviest) query blocks first
    const int64_t qb = n_qb - 1 - it / (d.b * d.kh), bk = it % (d.b * d.kh);
    const int64_t len = std::min<int64_t>(d.t, lens[bk / d.kh]);
    Item(d, bk, qb, qp, ktp, vp, len, sm_scale, op);
  };
  specache_cpu::RunAll(pool, item, n_items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PrefillAttention, Run,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("sm_scale")
                                  .Arg<ffi::Buffer<ffi::F32>>()    // q [B, T, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // kt [B, K, Tp/kBk, H, kBk]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // v [B, T, K, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // lengths [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [B, T, N, H]
