// Mixed-precision decode attention for XLA:CPU: the contract of pallas_kernels/mixed_decode_attention.py (its
// jnp reference is the reference here too), in one custom call instead of ~100 XLA ops per layer.
//
// For every (b, KV head k) the M = G·T query rows of that head (row m = g·T + t, pre-scaled by sm_scale) attend
// with one softmax over
//   - low-bit slots s < lowbit_len[b] not listed in exclude[b, k, :] (keys: b-bit codes with per-channel groups
//     of g slots, q·k̂ = Σ_h q_h z_{p,h} + Σ_h (q_h s_{p,h}) code_{s,h}; values: per-token groups of g channels),
//   - E extra 16-bit columns where extra_mask[b, k, t, e], their keys and values given in three segments
//     [B, K, E_i, H] (E = E_0 + E_1 + E_2, in that order; SpeCache's ring, κ rows and new rows, read where they
//     are instead of concatenated by XLA first; a segment may be empty).
// Returns every row's output, and for each of the last P rows (t = T-P .. T-1; P = prob_rows) its probabilities
// averaged over the G heads, split into the low-bit part [P, S] (0 where not attended) and the extra part [P, E].
// With lowbit_values false the low-bit slots only score: the probabilities are the same, the output is the softmax
// over the extra columns alone (SpeCache's lowbit_in_output=False), and the low-bit values are never read.
//
// Work items (b, k, chunk of kChunk slots) on the calling thread + XLA's intra-op pool (common.h), two phases:
//   1. per item: logits of all M rows for the chunk's slots (16 slots at a time: a block's codes are unpacked
//      once and scored for every row; 1-, 2-bit by nibble tables), the chunk's max per row, then one pass for the
//      exps, their sum and (one value group per slot) the value weights p·scale and Σ p·zero; Σ p·v̂'s codes part
//      (each slot's codes read once per 16-channel block for every row; 1-bit: four blocks per pass, by masked
//      adds), and the last P rows' unnormalised probabilities.
//   2. (b, k): log-sum-exp merge of the chunks and the extra columns; outputs and probabilities (run by the
//      thread that finishes the head's last chunk).
// Slots at or past lowbit_len are never read (their scales may be NaN); a row with every column masked gives
// output 0 and probabilities 0. float32 throughout; the exp is cephes' expf polynomial (~1 ulp).
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "mixed_values.h"
#include "xla/ffi/api/ffi.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using specache_cpu::Load;
using specache_cpu::MergeChunks;
using specache_cpu::Splat;
using specache_cpu::Store;
using specache_cpu::Sum;
using specache_cpu::ValueSum;
using specache_cpu::V;
using specache_cpu::VI;
using specache_cpu::VW;
using specache_cpu::Exp;
using specache_cpu::kIota;

constexpr int64_t kChunk = 1024;   // slots per phase-1 item (rounded up to a multiple of the key group size)
constexpr int64_t kMaxHeadDim = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The packed rows of `n` (<= 16) slots as uint32 words, word by word: words[w] lane i = word w of slot i (slot i's
// row at codes + i·c_bytes; code h of a row is bits (h % (32/b))·b of word h / (32/b), DESIGN.md's layout).
// Lanes >= n are 0.
inline void SlotWords(const uint8_t* codes, int64_t c_bytes, int64_t n, VW* words) {
  if (n == 16 && c_bytes == 8) {                       // two words per row: even / odd words of 16 rows
    VW a, b;
    std::memcpy(&a, codes, sizeof(a));
    std::memcpy(&b, codes + 64, sizeof(b));
    words[0] = __builtin_shuffle(a, b, VW(2 * kIota));
    words[1] = __builtin_shuffle(a, b, VW(2 * kIota + 1));
    return;
  }
  for (int64_t w = 0; w < c_bytes / 4; ++w) {
    alignas(64) uint32_t tmp[16] = {0};
    for (int64_t i = 0; i < n; ++i) std::memcpy(&tmp[i], codes + i * c_bytes + 4 * w, 4);
    std::memcpy(&words[w], tmp, sizeof(VW));
  }
}

// Codes of every channel for a block of slots: cv[h] lane i = code_h of slot i, as floats.
template <int BITS>
inline void SlotCodes(const VW* words, int64_t c_bytes, V* cv) {
  constexpr int kPerWord = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1;
  for (int64_t w = 0; w < c_bytes / 4; ++w)
    for (int j = 0; j < kPerWord; ++j)
      cv[w * kPerWord + j] = __builtin_convertvector(VI((words[w] >> (j * BITS)) & kMask), V);
}

// logits of rows m0 .. m0+RB-1 for one block of 16 slots: base[m] + Σ_h w[m, h] · cv[h] -> out + m·stride.
template <int RB>
void KeyRows(const V* cv, int64_t hd, const float* w, const float* base, int64_t m0, float* out, int64_t stride) {
  V a0[RB], a1[RB];
  for (int r = 0; r < RB; ++r) {
    a0[r] = Splat(base[m0 + r]);
    a1[r] = V{};
  }
  for (int64_t h = 0; h < hd; h += 2) {                  // hd is even (a multiple of 16)
    const V c0 = cv[h], c1 = cv[h + 1];
    for (int r = 0; r < RB; ++r) {
      a0[r] += c0 * w[(m0 + r) * hd + h];
      a1[r] += c1 * w[(m0 + r) * hd + h + 1];
    }
  }
  for (int r = 0; r < RB; ++r) Store(out + (m0 + r) * stride, a0[r] + a1[r]);
}

// 1- and 2-bit keys by table lookups: nibble c of a slot's row (its n = 4/b channels nc .. nc+n-1) indexes the
// 16-entry table T_c[i] = Σ_{j<n} code_j(i) · w[nc + j] of the row's query (code_j(i): bits jb .. jb+b-1 of i;
// one register; __builtin_shuffle is one vpermps on AVX-512). idx[c] lane i = nibble c of slot i; tables
// [M, H·b/4]. Per 16 slots and row: H·b/4 permutes and adds instead of H FMAs, and no unpacking of the codes.
template <int RB>
void KeyRowsNibbles(const VI* idx, int64_t n_nib, const V* tables, const float* base, int64_t m0, float* out,
                    int64_t stride) {
  V a0[RB], a1[RB];
  for (int r = 0; r < RB; ++r) {
    a0[r] = Splat(base[m0 + r]);
    a1[r] = V{};
  }
#ifdef __AVX512F__
  __m512 one = _mm512_set1_ps(1.f);
  asm("" : "+v"(one));                                   // opaque: the FMA below is not folded into an add
#endif
  for (int64_t c = 0; c < n_nib; c += 2) {               // n_nib = H/4 is even
    for (int r = 0; r < RB; ++r) {
      a0[r] += __builtin_shuffle(tables[(m0 + r) * n_nib + c], idx[c]);
#ifdef __AVX512F__
      // a1 by an FMA (x·1 + a, exact): the FMA pipes take half the adds (see ValueBlocks1)
      a1[r] = reinterpret_cast<V>(_mm512_fmadd_ps(
          reinterpret_cast<__m512>(__builtin_shuffle(tables[(m0 + r) * n_nib + c + 1], idx[c + 1])), one,
          reinterpret_cast<__m512>(a1[r])));
#else
      a1[r] += __builtin_shuffle(tables[(m0 + r) * n_nib + c + 1], idx[c + 1]);
#endif
    }
  }
  for (int r = 0; r < RB; ++r) Store(out + (m0 + r) * stride, a0[r] + a1[r]);
}

constexpr int kKeyRows = 8;    // rows per pass over a block's codes
using KeyFn = void (*)(const V*, int64_t, const float*, const float*, int64_t, float*, int64_t);
using NibbleFn = void (*)(const VI*, int64_t, const V*, const float*, int64_t, float*, int64_t);
template <int... RBs>
struct KeyFns {
  static constexpr KeyFn dense[] = {KeyRows<RBs + 1>...};
  static constexpr NibbleFn nibbles[] = {KeyRowsNibbles<RBs + 1>...};
};
template <int... RBs>
constexpr KeyFns<RBs...> MakeKeyFns(std::integer_sequence<int, RBs...>) { return {}; }
using KeyTable = decltype(MakeKeyFns(std::make_integer_sequence<int, kKeyRows>()));

struct Shapes {
  int64_t b, k, m, t, hd, s, c_bytes, p_groups, v_groups, x, e, g, chunk, n_chunks, p;   // p: prob rows
  bool values;   // the low-bit values enter the output (else it attends the extra columns only)
};

// Phase 1 for one (b, k, chunk): see the file comment. L: scratch [M, stride].
template <int BITS>
void ChunkItem(const Shapes& d, int64_t bk, int64_t ci, const float* q, const uint8_t* kc, const float* ks,
               const float* kz, const uint8_t* vc, const float* vs, const float* vz, int64_t len,
               const int32_t* excl, float* c_max, float* c_sum, float* c_out, float* last_p) {
  const int64_t s0 = ci * d.chunk, s1 = std::min(d.s, s0 + d.chunk);
  const int64_t n = std::max<int64_t>(0, std::min(s1, len) - s0);
  const int64_t m = d.m, hd = d.hd, n_rep = d.m / d.t;
  float* mx = c_max + (bk * d.n_chunks + ci) * m;
  float* zs = c_sum + (bk * d.n_chunks + ci) * m;
  float* o = c_out + (bk * d.n_chunks + ci) * m * hd;
  std::fill(o, o + m * hd, 0.f);
  float* lp = last_p + bk * d.p * n_rep * d.s;          // [P, G, S] of this (b, k)
  if (n == 0) {
    std::fill(mx, mx + m, kNegInf);
    std::fill(zs, zs + m, 0.f);
    for (int64_t pg = 0; pg < d.p * n_rep; ++pg) std::fill(lp + pg * d.s + s0, lp + pg * d.s + s1, 0.f);
    return;
  }
  const int64_t n16 = (n + 15) / 16 * 16;
  const int64_t stride = n16 + 16;
  // per-thread scratch, not cleared: every element read below is written first
  thread_local std::vector<float> logits_buf, scaled_buf;
  if (logits_buf.size() < static_cast<size_t>(m * stride)) {
    logits_buf.resize(m * stride);
    scaled_buf.resize(m * stride);
  }
  float* const logits = logits_buf.data();
  // logits, one key group at a time (the query folded with the group's scales and zeros); 1-bit keys by nibble
  // tables (KeyRowsNibbles: 4 / BITS channels per nibble), 2-bit too on AMD Zen 4/5, whose permutes issue beside
  // the adds (30 layers at 8k, 3 rows per KV head: 7.8-11.5 -> 7.2-7.3 ms at batch 1, 29.6-30.5 -> 27.2-29.4 at
  // batch 4; 6 rows: even; on an Intel Xeon the permutes share port 5 with the adds: 8.8 -> 9.8 ms), wider codes
  // unpacked to floats
  constexpr bool kNibbles = BITS == 1 || (BITS == 2 && specache_cpu::kSplitAddPipes);
  constexpr int kPerNibble = 4 / BITS;
  const int64_t n_nib = hd * BITS / 4;
  std::vector<float> w(m * hd), base(m);
  std::vector<V> tables(kNibbles ? m * n_nib : 0);
  V cv[kMaxHeadDim];
  VW words[kMaxHeadDim / 4];
  VI idx[kMaxHeadDim / 2];
  V code_of[kPerNibble];                                 // lane i: code j of nibble value i
  for (int j = 0; j < kPerNibble; ++j)
    code_of[j] = __builtin_convertvector((kIota >> (j * BITS)) & ((1 << BITS) - 1), V);
  const float* qb = q + bk * m * hd;
  for (int64_t gs = s0; gs < s0 + n; gs += d.g) {
    const int64_t p = gs / d.g, ge = std::min(gs + d.g, s0 + n);
    const float* sc = ks + (bk * d.p_groups + p) * hd;
    const float* zr = kz + (bk * d.p_groups + p) * hd;
    for (int64_t r = 0; r < m; ++r) {
      V acc = V{};
      for (int64_t h = 0; h < hd; h += 16) {
        const V qv = Load(qb + r * hd + h);
        Store(w.data() + r * hd + h, qv * Load(sc + h));
        acc += qv * Load(zr + h);
      }
      base[r] = Sum(acc);
      if constexpr (kNibbles) {
        const float* wr = w.data() + r * hd;
        for (int64_t c = 0; c < n_nib; ++c) {
          V t = code_of[0] * wr[kPerNibble * c];
          for (int j = 1; j < kPerNibble; ++j) t += code_of[j] * wr[kPerNibble * c + j];
          tables[r * n_nib + c] = t;
        }
      }
    }
    for (int64_t bs = gs; bs < ge; bs += 16) {
      const int64_t nb = std::min<int64_t>(16, ge - bs);
      SlotWords(kc + (bk * d.s + bs) * d.c_bytes, d.c_bytes, nb, words);
      float* out = logits + (bs - s0);
      if constexpr (kNibbles) {
        for (int64_t c = 0; c < n_nib; ++c) idx[c] = VI(words[c / 8] >> (4 * (c % 8)));   // shuffles: index mod 16
      } else {
        SlotCodes<BITS>(words, d.c_bytes, cv);
      }
      for (int64_t r = 0; r < m; r += kKeyRows) {
        const int64_t rb = std::min<int64_t>(kKeyRows, m - r);
        if constexpr (kNibbles) {
          KeyTable::nibbles[rb - 1](idx, n_nib, tables.data(), base.data(), r, out, stride);
        } else {
          KeyTable::dense[rb - 1](cv, hd, w.data(), base.data(), r, out, stride);
        }
      }
    }
  }
  // masked -> -inf: the excluded slots and the lanes past n
  for (int64_t r = 0; r < m; ++r) {
    float* l = logits + r * stride;
    std::fill(l + n, l + n16, kNegInf);
    for (int64_t i = 0; i < d.x; ++i) {
      const int64_t xs = excl[bk * d.x + i];
      if (xs >= s0 && xs < s0 + n) l[xs - s0] = kNegInf;
    }
  }
  // per row: max, then one pass for p = exp(l - max), Σ p and, with one value group per slot, the codes' weights
  // p·scale (ValueSum's w) and the zeros' part Σ p·z
  const float* vsr = vs + (bk * d.s + s0) * d.v_groups;
  const float* vzr = vz + (bk * d.s + s0) * d.v_groups;
  const bool one_group = d.values && d.v_groups == 1;          // then g = H, a multiple of 16
  alignas(64) float tail_s[16] = {0}, tail_z[16] = {0};          // the last vector's scales / zeros, 0 past n
  const int64_t n_whole = n / 16 * 16;
  if (one_group)
    for (int64_t i = n_whole; i < n; ++i) {
      tail_s[i - n_whole] = vsr[i];
      tail_z[i - n_whole] = vzr[i];
    }
  float* const wbuf = scaled_buf.data();
  std::vector<float> zpart(m, 0.f);
  const V ninf = Splat(kNegInf);
  for (int64_t r = 0; r < m; ++r) {
    float* l = logits + r * stride;
    V vmax = ninf, vmax1 = ninf;                        // two chains: a max's latency per vector otherwise
    int64_t c = 0;
    for (; c + 32 <= n16; c += 32) {
      const V v = Load(l + c), v1 = Load(l + c + 16);
      vmax = vmax > v ? vmax : v;
      vmax1 = vmax1 > v1 ? vmax1 : v1;
    }
    if (c < n16) vmax1 = vmax1 > Load(l + c) ? vmax1 : Load(l + c);   // n16 is a multiple of 16: one vector left
    vmax = vmax > vmax1 ? vmax : vmax1;
    const float row_max = specache_cpu::MaxLanes(vmax, kNegInf);
    mx[r] = row_max;
    V vsum = V{}, vz_acc = V{};
    if (row_max == kNegInf) {
      std::fill(l, l + n16, 0.f);
      if (one_group) std::fill(wbuf + r * stride, wbuf + r * stride + n16, 0.f);
    } else {
      for (int64_t i = 0; i < n16; i += 16) {
        const V e = Exp(Load(l + i) - row_max);
        Store(l + i, e);
        vsum += e;
        if (one_group) {
          const bool whole = i < n_whole;
          Store(wbuf + r * stride + i, e * (whole ? Load(vsr + i) : Load(tail_s)));
          vz_acc += e * (whole ? Load(vzr + i) : Load(tail_z));
        }
      }
    }
    zs[r] = Sum(vsum);
    zpart[r] = Sum(vz_acc);
  }
  // Σ p · v̂: the codes' part per channel block, then the zeros' part Σ_i p_i z_{i, group}
  if (d.values)
    ValueSum<BITS>(logits, wbuf, stride, m, n, vc + (bk * d.s + s0) * d.c_bytes, d.c_bytes, vsr, d.v_groups, d.g, o,
                   hd);
  for (int64_t r = 0; r < m && d.values; ++r) {
    if (one_group) {
      for (int64_t h = 0; h < hd; ++h) o[r * hd + h] += zpart[r];
      continue;
    }
    const float* l = logits + r * stride;
    for (int64_t qg = 0; qg < d.v_groups; ++qg) {
      float total = 0.f;
      for (int64_t i = 0; i < n; ++i) total += l[i] * vzr[i * d.v_groups + qg];
      for (int64_t h = qg * d.g; h < (qg + 1) * d.g; ++h) o[r * hd + h] += total;
    }
  }
  // the last P rows' unnormalised probabilities (phase 2 scales them)
  for (int64_t pi = 0; pi < d.p; ++pi) {
    for (int64_t gi = 0; gi < n_rep; ++gi) {
      const float* l = logits + (gi * d.t + d.t - d.p + pi) * stride;
      float* dst = lp + (pi * n_rep + gi) * d.s;
      std::copy(l, l + n, dst + s0);
      std::fill(dst + s0 + n, dst + s1, 0.f);
    }
  }
}

// The extra columns' key and value rows, in up to three segments (`Run`'s extra_k0..2, extra_v0..2).
struct ExtraRows {
  const float* k[3];
  const float* v[3];
  int64_t e[3];
  int64_t hd;
  // Row j (0 <= j < E) of (b, k) = bk: segment i = the first with j < E_0 + .. + E_i.
  const float* Key(int64_t bk, int64_t j) const { return Row(k, bk, j); }
  const float* Value(int64_t bk, int64_t j) const { return Row(v, bk, j); }

 private:
  const float* Row(const float* const* seg, int64_t bk, int64_t j) const {
    int i = 0;
    while (j >= e[i]) j -= e[i++];
    return seg[i] + (bk * e[i] + j) * hd;
  }
};

// Without the low-bit values (Shapes::values false) a row's output is the softmax over its unmasked extra columns
// alone (their own maximum `e_max`; 0 where there are none): out = Σ_j exp(l_j - e_max) v_j / Σ_j exp(l_j - e_max).
void ExtraOutput(const ExtraRows& extra, int64_t bk, const uint8_t* mrow, const float* logits, int64_t e,
                 float e_max, int64_t hd, float* orow) {
  V acc[kMaxHeadDim / 16];
  for (int64_t i = 0; i < hd / 16; ++i) acc[i] = V{};
  float z = 0.f;
  for (int64_t j = 0; j < e && e_max != kNegInf; ++j) {
    if (!mrow[j]) continue;
    const float p = std::exp(logits[j] - e_max);
    const float* vr = extra.Value(bk, j);
    z += p;
    for (int64_t i = 0; i < hd / 16; ++i) acc[i] += p * Load(vr + 16 * i);
  }
  const float inv = z > 0.f ? 1.f / z : 0.f;
  for (int64_t i = 0; i < hd / 16; ++i) Store(orow + 16 * i, acc[i] * inv);
}

// Phase 2 for one (b, k): merge the chunks and the extra columns (16 channels at a time: each extra column's
// score is one vector dot, their exps 16 columns at a time, each value row added as hd/16 vectors).
void MergeItem(const Shapes& d, int64_t bk, const float* q, const ExtraRows& extra, const uint8_t* emask,
               const float* c_max, const float* c_sum, const float* c_out, const float* last_p, float* out,
               float* p_low, float* p_extra) {
  const int64_t m = d.m, hd = d.hd, e = d.e, nc = d.n_chunks, n_rep = d.m / d.t, nv = hd / 16;
  const int64_t e16 = (e + 15) / 16 * 16;
  const float* qb = q + bk * m * hd;
  std::vector<float> le(e16), fac(nc * d.p * n_rep, 0.f), pe(d.p * e, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t = r % d.t;
    const uint8_t* mrow = emask + (bk * d.t + t) * e;
    V qv[kMaxHeadDim / 16];
    for (int64_t i = 0; i < nv; ++i) qv[i] = Load(qb + r * hd + 16 * i);
    float row_max = kNegInf;
    for (int64_t j = 0; j < e; ++j) {
      le[j] = kNegInf;
      if (!mrow[j]) continue;
      const float* kr = extra.Key(bk, j);
      V acc = qv[0] * Load(kr);
      for (int64_t i = 1; i < nv; ++i) acc += qv[i] * Load(kr + 16 * i);
      le[j] = Sum(acc);
      row_max = std::max(row_max, le[j]);
    }
    std::fill(le.begin() + e, le.end(), kNegInf);
    float* orow = out + (bk * m + r) * hd;
    if (!d.values) ExtraOutput(extra, bk, mrow, le.data(), e, row_max, hd, orow);   // row_max: the extra columns'
    for (int64_t c = 0; c < nc; ++c) row_max = std::max(row_max, c_max[(bk * nc + c) * m + r]);
    if (row_max == kNegInf || std::isnan(row_max)) {
      if (d.values) std::fill(orow, orow + hd, 0.f);
      continue;
    }
    V acc[kMaxHeadDim / 16];
    for (int64_t i = 0; i < nv; ++i) acc[i] = V{};
    float z = MergeChunks(c_max + bk * nc * m + r, c_sum + bk * nc * m + r, c_out + (bk * nc * m + r) * hd, nc, m,
                          hd, row_max, acc);
    V zv = V{};                                          // masked columns: exp(-inf) = 0
    for (int64_t j = 0; j < e16; j += 16) {
      const V p = Exp(Load(le.data() + j) - row_max);
      Store(le.data() + j, p);
      zv += p;
    }
    z += Sum(zv);
    const float inv = 1.f / z;
    if (d.values) {
      for (int64_t j = 0; j < e; ++j) {
        if (!mrow[j]) continue;                          // never read a masked row (it may hold anything)
        const float* vr = extra.Value(bk, j);
        for (int64_t i = 0; i < nv; ++i) acc[i] += le[j] * Load(vr + 16 * i);
      }
      for (int64_t i = 0; i < nv; ++i) Store(orow + 16 * i, acc[i] * inv);
    }
    if (t >= d.t - d.p) {                                // prob row pi of head g = r / T
      const int64_t gi = r / d.t, pi = t - (d.t - d.p);
      for (int64_t c = 0; c < nc; ++c) {
        const float cm = c_max[(bk * nc + c) * m + r];
        fac[(c * d.p + pi) * n_rep + gi] = cm == kNegInf ? 0.f : std::exp(cm - row_max) * inv / n_rep;
      }
      for (int64_t j = 0; j < e; ++j) pe[pi * e + j] += le[j] * inv / n_rep;
    }
  }
  std::copy(pe.begin(), pe.end(), p_extra + bk * d.p * e);
  for (int64_t pi = 0; pi < d.p; ++pi) {
    float* dst = p_low + (bk * d.p + pi) * d.s;
    const float* lp = last_p + (bk * d.p + pi) * n_rep * d.s;
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t s0 = c * d.chunk, s1 = std::min(d.s, s0 + d.chunk);
      const float* f = fac.data() + (c * d.p + pi) * n_rep;
      int64_t s = s0;
      for (; s + 16 <= s1; s += 16) {
        V acc = V{};
        for (int64_t gi = 0; gi < n_rep; ++gi) acc += Load(lp + gi * d.s + s) * f[gi];
        Store(dst + s, acc);
      }
      for (; s < s1; ++s) {
        float acc = 0.f;
        for (int64_t gi = 0; gi < n_rep; ++gi) acc += lp[gi * d.s + s] * f[gi];
        dst[s] = acc;
      }
    }
  }
}

#define CHECK_ARG(cond, msg) \
  if (!(cond)) return ffi::Error::InvalidArgument(std::string("mixed_decode_attention: ") + msg)

ffi::Error Run(ffi::ThreadPool pool, int64_t bits, int64_t group_size, int64_t t_rows, int64_t prob_rows,
               bool values,
               ffi::Buffer<ffi::F32> q,
               ffi::Buffer<ffi::U8> k_codes, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> k_zero,
               ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> v_zero,
               ffi::Buffer<ffi::S32> lowbit_len, ffi::Buffer<ffi::S32> exclude, ffi::Buffer<ffi::F32> extra_k0,
               ffi::Buffer<ffi::F32> extra_k1, ffi::Buffer<ffi::F32> extra_k2, ffi::Buffer<ffi::F32> extra_v0,
               ffi::Buffer<ffi::F32> extra_v1, ffi::Buffer<ffi::F32> extra_v2,
               ffi::Buffer<ffi::U8> extra_mask, ffi::ResultBuffer<ffi::F32> out,
               ffi::ResultBuffer<ffi::F32> probs_low, ffi::ResultBuffer<ffi::F32> probs_extra) {
  const auto qd = q.dimensions(), kd = k_codes.dimensions(), sd = k_scale.dimensions();
  const auto vd = v_scale.dimensions(), xd = exclude.dimensions();
  CHECK_ARG(qd.size() == 4 && kd.size() == 4 && sd.size() == 4 && vd.size() == 4 && xd.size() == 3, "ranks");
  const std::array<ffi::Buffer<ffi::F32>*, 3> eks{&extra_k0, &extra_k1, &extra_k2};
  const std::array<ffi::Buffer<ffi::F32>*, 3> evs{&extra_v0, &extra_v1, &extra_v2};
  ExtraRows extra{};
  int64_t e_total = 0;
  for (int i = 0; i < 3; ++i) {
    const auto kd_i = eks[i]->dimensions(), vd_i = evs[i]->dimensions();
    CHECK_ARG(kd_i.size() == 4 && vd_i.size() == 4 && kd_i[0] == qd[0] && kd_i[1] == qd[1] && kd_i[3] == qd[3] &&
                  vd_i[0] == kd_i[0] && vd_i[1] == kd_i[1] && vd_i[2] == kd_i[2] && vd_i[3] == kd_i[3],
              "extra key/value segments must be [B, K, E_i, H], the same for keys and values");
    extra.k[i] = eks[i]->typed_data();
    extra.v[i] = evs[i]->typed_data();
    extra.e[i] = kd_i[2];
    e_total += kd_i[2];
  }
  extra.hd = qd[3];
  CHECK_ARG(bits == 1 || bits == 2 || bits == 4 || bits == 8, "bits must be 1, 2, 4 or 8");
  Shapes d{qd[0], qd[1], qd[2], t_rows, qd[3], kd[2], kd[3], sd[2], vd[3], xd[2], e_total, group_size, 0, 0,
           prob_rows, values};
  CHECK_ARG(d.t >= 1 && d.m % d.t == 0, "rows M must be G·T");
  CHECK_ARG(d.p >= 1 && d.p <= d.t, "prob_rows must be in [1, T]");
  CHECK_ARG(d.hd == 16 || d.hd == 32 || d.hd == 64 || d.hd == 128, "head_dim must be 16, 32, 64 or 128");
  CHECK_ARG(d.c_bytes * 8 == d.hd * bits && d.c_bytes % 4 == 0, "code bytes C must be H·b/8, a multiple of 4");
  CHECK_ARG(d.g >= 1 && d.hd % d.g == 0 && d.v_groups * d.g == d.hd, "value groups must be H/g");
  CHECK_ARG(d.p_groups * d.g >= d.s, "key groups P must cover S");
  d.chunk = (kChunk + d.g - 1) / d.g * d.g;
  d.n_chunks = std::max<int64_t>(1, (d.s + d.chunk - 1) / d.chunk);
  const int64_t n_bk = d.b * d.k, n_rep = d.m / d.t;
  // Scratch, reused across calls by the calling thread (no page faults of fresh large allocations per call).
  thread_local std::vector<float> scratch;
  const int64_t n_max = n_bk * d.n_chunks * d.m;
  const size_t need = 2 * n_max + n_max * d.hd + n_bk * d.p * n_rep * d.s;
  if (scratch.size() < need) scratch.resize(need);
  float* c_max = scratch.data();
  float* c_sum = c_max + n_max;
  float* c_out = c_sum + n_max;
  float* last_p = c_out + n_max * d.hd;
  const float* qp = q.typed_data();
  const uint8_t* kc = k_codes.typed_data();
  const float *ks = k_scale.typed_data(), *kz = k_zero.typed_data();
  const uint8_t* vc = v_codes.typed_data();
  const float *vs = v_scale.typed_data(), *vz = v_zero.typed_data();
  const int32_t *lens = lowbit_len.typed_data(), *excl = exclude.typed_data();
  float *op = out->typed_data(), *pl = probs_low->typed_data(), *pe = probs_extra->typed_data();
  using ChunkFn = decltype(&ChunkItem<1>);
  const ChunkFn chunk = bits == 1 ? &ChunkItem<1> : bits == 2 ? &ChunkItem<2> : bits == 4 ? &ChunkItem<4> : &ChunkItem<8>;
  specache_cpu::RunChunksThenMerge(
      pool, n_bk, d.n_chunks,
      [&](int64_t bk, int64_t ci) {
        const int64_t len = std::min<int64_t>(d.s, std::max<int32_t>(0, lens[bk / d.k]));
        chunk(d, bk, ci, qp, kc, ks, kz, vc, vs, vz, len, excl, c_max, c_sum, c_out, last_p);
      },
      [&](int64_t bk) {
        MergeItem(d, bk, qp, extra, extra_mask.typed_data(), c_max, c_sum, c_out,
                  last_p, op, pl, pe);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MixedDecodeAttention, Run,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("t_rows")
                                  .Attr<int64_t>("prob_rows")
                                  .Attr<bool>("lowbit_values")
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q rows [B, K, M, H], scaled by sm_scale
                                  .Arg<ffi::Buffer<ffi::U8>>()    // k_codes [B, K, S, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scale [B, K, P, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_zero
                                  .Arg<ffi::Buffer<ffi::U8>>()    // v_codes [B, K, S, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scale [B, K, S, H/g]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_zero
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lowbit_len [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // exclude [B, K, X]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // extra_k0 [B, K, E_0, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // extra_k1 [B, K, E_1, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // extra_k2 [B, K, E_2, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // extra_v0 (as extra_k0)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // extra_v1
                                  .Arg<ffi::Buffer<ffi::F32>>()   // extra_v2
                                  .Arg<ffi::Buffer<ffi::U8>>()    // extra_mask [B, K, T, E]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [B, K, M, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // last P rows' low-bit probabilities [B, K, P, S]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // last P rows' extra probabilities [B, K, P, E]
