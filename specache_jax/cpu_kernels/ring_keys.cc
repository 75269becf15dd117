// The ring's key columns for XLA:CPU (`caches/lowbit.py`'s ring_segment): ring slot s of sequence b holds position
// key_qlen - R + s (below key_qlen = ⌊n/R⌋·R: its key is quantized, so the column is the dequantized low-bit key,
// row s of the last flushed window) or key_qlen + s (slot s < n - key_qlen: the 16-bit ring key). The jnp form
// (contiguous slices of the codes and key groups, unpacked, dequantized and selected in one XLA fusion) cost
// ~21 µs per layer at batch 1 and ~55 µs at batch 4 on XLA:CPU (the fused loop recomputes the slices' offsets and
// the bit fields per element); here each slot is one row copy or one row dequantization.
//
// out[b, k, s, :] = ring_k[b, k, s, :] where s < n_b - key_qlen_b, else codes[b, k, start + s, :] dequantized
// (start = max(key_qlen_b - R, 0); group row start/g + s/g of scale and zero; q·scale + zero, as
// quant.dequantize_minmax: where q·scale overflows, (q·(scale/2) + zero/2)·2). float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxHeadDim = 1024;

// Row `row` of b-bit codes (H codes) dequantized into dst: codes unpacked first, then one vectorizable pass;
// not finite (overflow or NaN) -> the halved form, as jnp.where(isfinite(plain), plain, halved). With H a multiple
// of 16, 16 channels at a time (`Codes16`), the scalar pass only for a row with a lane not finite.
template <int BITS>
void DequantRow(const uint8_t* row, const float* sc, const float* zr, int64_t h, float* dst) {
  using specache_cpu::Load;
  using specache_cpu::Splat;
  using specache_cpu::V;
  using specache_cpu::VI;
  if (h % 16 == 0) {
    const V big = Splat(std::numeric_limits<float>::max());
    VI finite = VI{} - 1;
    for (int64_t j = 0; j < h; j += 16) {
      const V plain = specache_cpu::Codes16<BITS>(row + j * BITS / 8) * Load(sc + j) + Load(zr + j);
      finite &= (plain <= big) & (plain >= -big);                       // NaN: false
      specache_cpu::Store(dst + j, plain);
    }
    bool all = true;
    for (int i = 0; i < 16; ++i) all &= finite[i] != 0;
    if (all) return;
  }
  constexpr int kPer = 8 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1;
  float q[kMaxHeadDim];
  for (int64_t c = 0; c < h / kPer; ++c)
    for (int j = 0; j < kPer; ++j) q[c * kPer + j] = static_cast<float>((row[c] >> (j * BITS)) & kMask);
  for (int64_t i = 0; i < h; ++i) {
    const float plain = q[i] * sc[i] + zr[i];
    const float halved = (q[i] * (sc[i] * 0.5f) + zr[i] * 0.5f) * 2.0f;
    dst[i] = std::fabs(plain) <= std::numeric_limits<float>::max() ? plain : halved;
  }
}

ffi::Error RingKeys(int64_t bits, int64_t group_size, ffi::Buffer<ffi::F32> ring_k, ffi::Buffer<ffi::U8> codes,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zero, ffi::Buffer<ffi::S32> lengths,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = ring_k.dimensions(), cd = codes.dimensions(), sd = scale.dimensions(), ld = lengths.dimensions();
  const auto zd = zero.dimensions(), od = out->dimensions();
  auto same = [](auto a, auto b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); };
  if (rd.size() != 4 || cd.size() != 4 || sd.size() != 4 || ld.size() != 1 || !same(zd, sd) || !same(od, rd) ||
      cd[0] != rd[0] || cd[1] != rd[1] || sd[0] != rd[0] || sd[1] != rd[1] || sd[3] != rd[3] || ld[0] != rd[0])
    return ffi::Error::InvalidArgument("ring_keys: ring_k [B, K, R, H], codes [B, K, S, C], scale/zero [B, K, P, H], "
                                       "lengths [B]");
  if (!(bits == 1 || bits == 2 || bits == 4 || bits == 8))
    return ffi::Error::InvalidArgument("ring_keys: bits must be 1, 2, 4 or 8");
  const int64_t b_n = rd[0], kh = rd[1], r = rd[2], h = rd[3], s = cd[2], c = cd[3], p = sd[2], g = group_size;
  if (c * 8 != h * bits || g < 1 || r % g || s < r || p * g < s)
    return ffi::Error::InvalidArgument("ring_keys: need C = H·bits/8, R a multiple of g, S >= R, P·g >= S");
  if (h > kMaxHeadDim) return ffi::Error::InvalidArgument("ring_keys: head_dim above 1024");
  const auto dequant = bits == 1 ? &DequantRow<1> : bits == 2 ? &DequantRow<2> : bits == 4 ? &DequantRow<4>
                                                                                          : &DequantRow<8>;
  const float* ring = ring_k.typed_data();
  const uint8_t* cp = codes.typed_data();
  const float *sp = scale.typed_data(), *zp = zero.typed_data();
  float* op = out->typed_data();
  for (int64_t b = 0; b < b_n; ++b) {
    const int64_t n = std::max<int32_t>(0, lengths.typed_data()[b]);
    const int64_t key_qlen = n / r * r, sixteen = n - key_qlen;
    const int64_t start = std::min(std::max<int64_t>(key_qlen - r, 0), s - r);       // dynamic_slice's clamp
    const int64_t g0 = std::min(start / g, p - r / g);
    for (int64_t k = 0; k < kh; ++k) {
      const int64_t bk = b * kh + k;
      for (int64_t slot = 0; slot < r; ++slot) {
        float* dst = op + (bk * r + slot) * h;
        if (slot < sixteen) {
          std::memcpy(dst, ring + (bk * r + slot) * h, h * sizeof(float));
          continue;
        }
        const uint8_t* row = cp + (bk * s + start + slot) * c;
        const float* sc = sp + (bk * p + g0 + slot / g) * h;
        const float* zr = zp + (bk * p + g0 + slot / g) * h;
        dequant(row, sc, zr, h, dst);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RingKeysHandler, RingKeys,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Arg<ffi::Buffer<ffi::F32>>()    // ring_k [B, K, R, H]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // k_codes [B, K, S, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // k_scale [B, K, P, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // k_zero
                                  .Arg<ffi::Buffer<ffi::S32>>()    // lengths [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [B, K, R, H]
