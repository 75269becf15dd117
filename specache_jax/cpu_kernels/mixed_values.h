// Σ p·v̂ over packed value codes for mixed_attention.cc (phase 1 of a chunk): the codes' part of each row's
// output, o[m, :] += Σ_i p[m, i] · code(slot i) · scale(slot i, group), for b-bit codes with per-token value
// groups of g channels (DESIGN.md's layout). Included by that file only.
#ifndef SPECACHE_JAX_CPU_KERNELS_MIXED_VALUES_H_
#define SPECACHE_JAX_CPU_KERNELS_MIXED_VALUES_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "common.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace specache_cpu {

// acc + (w in the lanes whose bit is set in `bits`, 0 elsewhere): one masked add on AVX-512.
inline V MaskedAdd(V acc, uint16_t bits, float w) {
#ifdef __AVX512F__
  return reinterpret_cast<V>(_mm512_mask_add_ps(reinterpret_cast<__m512>(acc), bits, reinterpret_cast<__m512>(acc),
                                                _mm512_set1_ps(w)));
#else
  const VI on = ((VI{} + bits) & ((VI{} + 1) << kIota)) != 0;
  return acc + (on ? Splat(w) : V{});
#endif
}

// o[m, 16j .. 16j+15] += Σ_i w[m, i] · code(slot i, channels 16j ..) for the chunk's first n slots, rows m0 ..
// m0+RB-1 (RB accumulators), w = the probabilities times the slot's scale of that channel block's value group.
// 2- to 8-bit codes (1-bit: ValueBlocks1).
template <int BITS, int RB>
void ValueBlock(const float* w, int64_t stride, int64_t m0, int64_t n, const uint8_t* codes, int64_t c_bytes,
                int64_t j, float* o, int64_t hd) {
  V acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = V{};
  const uint8_t* col = codes + j * 2 * BITS;
  for (int64_t i = 0; i < n; ++i) {
    const V cv = Codes16<BITS>(col + i * c_bytes);
    for (int r = 0; r < RB; ++r) acc[r] += cv * w[(m0 + r) * stride + i];
  }
  for (int r = 0; r < RB; ++r) {
    float* dst = o + (m0 + r) * hd + j * 16;
    Store(dst, Load(dst) + acc[r]);
  }
}

// The same for 1-bit codes and NB channel blocks j0 .. j0+NB-1 of one value group (one w per slot): one pass over
// the slots with RB·NB accumulators (each row's w broadcast once per slot, each block's 16 bits loaded once for
// every row); the bits select which lanes add w. On Zen 4/5, whose add and FMA pipes are separate, odd rows add
// by an FMA with the bits as 0/1 floats (twice the adds per cycle); Intel's cores run both on ports 0 and 5.
template <int RB, int NB>
void ValueBlocks1(const float* w, int64_t stride, int64_t m0, int64_t n, const uint8_t* codes, int64_t c_bytes,
                  int64_t j0, float* o, int64_t hd) {
  constexpr bool kFmaRows = kSplitAddPipes;
  V acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = V{};
  const uint8_t* col = codes + j0 * 2;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t bits16[NB];
    std::memcpy(bits16, col + i * c_bytes, 2 * NB);
    V ones[NB];
    for (int j = 0; j < NB; ++j) ones[j] = kFmaRows ? MaskedAdd(V{}, bits16[j], 1.f) : V{};
    for (int r = 0; r < RB; ++r) {
      const float wr = w[(m0 + r) * stride + i];
      for (int j = 0; j < NB; ++j)
        acc[r][j] = kFmaRows && r % 2 ? acc[r][j] + ones[j] * wr : MaskedAdd(acc[r][j], bits16[j], wr);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NB; ++j) {
      float* dst = o + (m0 + r) * hd + (j0 + j) * 16;
      Store(dst, Load(dst) + acc[r][j]);
    }
}

// The same for value groups narrower than a channel block (g < 16): a scale vector per slot, built lane by lane.
template <int BITS>
void ValueBlockNarrow(const float* p, int64_t stride, int64_t m, int64_t n, const uint8_t* codes, int64_t c_bytes,
                      const float* scale, int64_t n_groups, int64_t g, float* o, int64_t hd) {
  for (int64_t j = 0; j < hd / 16; ++j)
    for (int64_t i = 0; i < n; ++i) {
      V sv;
      for (int l = 0; l < 16; ++l) sv[l] = scale[i * n_groups + (j * 16 + l) / g];
      const V cs = Codes16<BITS>(codes + i * c_bytes + j * 2 * BITS) * sv;
      for (int64_t r = 0; r < m; ++r) {
        float* dst = o + r * hd + j * 16;
        Store(dst, Load(dst) + cs * p[r * stride + i]);
      }
    }
}

constexpr int kValueRows = 8;   // rows per pass over a channel block's codes (1-bit: 6 rows x NB blocks)
using ValueFn = void (*)(const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);
template <int BITS, int... RBs>
constexpr std::array<ValueFn, sizeof...(RBs)> ValueFns(std::integer_sequence<int, RBs...>) {
  return {ValueBlock<BITS, RBs + 1>...};
}
template <int NB, int... RBs>
constexpr std::array<ValueFn, sizeof...(RBs)> Value1Fns(std::integer_sequence<int, RBs...>) {
  return {ValueBlocks1<RBs + 1, NB>...};
}

// o[m, :] += Σ_i p[m, i] · code(slot i) · scale(slot i, group) over the chunk's first n slots (the codes' part of
// Σ p·v̂; the zeros' part is the caller's). w [M, stride]: with one value group per slot (n_groups == 1, g = H) the
// weights p · scale as the caller's softmax pass wrote them; otherwise scratch, written here per group.
template <int BITS>
void ValueSum(const float* p, float* w, int64_t stride, int64_t m, int64_t n, const uint8_t* codes, int64_t c_bytes,
              const float* scale, int64_t n_groups, int64_t g, float* o, int64_t hd) {
  if (g % 16) {
    ValueBlockNarrow<BITS>(p, stride, m, n, codes, c_bytes, scale, n_groups, g, o, hd);
    return;
  }
  for (int64_t qg = 0; qg < n_groups; ++qg) {
    if (n_groups > 1)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < n; ++i) w[r * stride + i] = p[r * stride + i] * scale[i * n_groups + qg];
    const int64_t j1 = (qg + 1) * g / 16;
    if constexpr (BITS == 1) {                           // 4 (else 2, 1) blocks of up to 6 rows per pass
      static constexpr auto kRows = std::make_integer_sequence<int, 6>();
      static constexpr auto k4 = Value1Fns<4>(kRows), k2 = Value1Fns<2>(kRows), k1 = Value1Fns<1>(kRows);
      for (int64_t j = qg * g / 16, nb; j < j1; j += nb) {
        nb = j1 - j >= 4 ? 4 : (j1 - j >= 2 ? 2 : 1);
        const auto& fns = nb == 4 ? k4 : (nb == 2 ? k2 : k1);
        for (int64_t m0 = 0; m0 < m; m0 += 6)
          fns[std::min<int64_t>(6, m - m0) - 1](w, stride, m0, n, codes, c_bytes, j, o, hd);
      }
    } else {
      static constexpr auto kFns = ValueFns<BITS>(std::make_integer_sequence<int, kValueRows>());
      for (int64_t j = qg * g / 16; j < j1; ++j)
        for (int64_t m0 = 0; m0 < m; m0 += kValueRows)
          kFns[std::min<int64_t>(kValueRows, m - m0) - 1](w, stride, m0, n, codes, c_bytes, j, o, hd);
    }
  }
}

}  // namespace specache_cpu

#endif  // SPECACHE_JAX_CPU_KERNELS_MIXED_VALUES_H_
