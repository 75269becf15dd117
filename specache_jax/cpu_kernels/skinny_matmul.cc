// Skinny matrix products for XLA:CPU decoding steps: y[M, N] = x[M, D] · W, with few rows (M <= kMaxRows).
//
// A decoding step multiplies one or two rows per sequence by every weight matrix: bandwidth-bound, so the cost
// should be one pass over W whatever M is. XLA:CPU's dot takes ~1.65x the one-row time for two rows (measured
// on the 2-core AVX-512 machine, [576, 1536] fp32); these kernels stream W once and apply it to all M rows
// from registers. Two layouts:
//   "dn": W[D, N] row-major (projections: einsum "md,dn->mn"): column blocks of W, D in steps of 8 rows.
//   "nd": W[N, D] row-major (a tied LM head: einsum "md,nd->mn"): blocks of rows of W, M·R dot products.
// Work is split into blocks claimed from an atomic counter by the calling thread and by tasks scheduled on
// XLA's intra-op thread pool; the caller only waits for blocks another thread already claimed (so two calls
// running at once can never wait on each other's queued tasks). float32 only; GCC vector extensions, no
// intrinsics (built with -O3 -march=native on the machine that runs it).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;
constexpr int kColBlock = 2048;  // "dn": columns per item (whole rows of the projections here)
constexpr int kRowParts = 4;     // "dn": ranges of rows of W (each with its own partial sums)
constexpr int kRowBlock = 64;    // "nd": rows of W per block

using specache_cpu::kLanes;
using specache_cpu::Load;
using specache_cpu::Store;
using specache_cpu::V;

// y_part[M, n0:n1] = x[M, d0:d1] · W[d0:d1, n0:n1] for W[D, N] row-major: rows of W are read in order, kGroup at a
// time (contiguous streams the prefetchers follow), each applied to all M rows; the accumulators (M x cols floats)
// stay in L1/L2 and are loaded and stored once per group. The M·kGroup row values are re-read from memory in the
// inner loop (embedded broadcasts): hoisted, they would not fit in registers and spill as full vectors.
constexpr int kGroup = 8;
// The next group's rows are prefetched (into L2: locality 1) while this group's are used: one core streaming W
// with the M·kGroup FMAs per vector in between keeps too few misses in flight for the hardware prefetchers
// alone (measured single-threaded from DRAM, the model's MLP weights: 12.2 -> 15.5 GB/s at M = 4, 10.8 -> 14.0
// at M = 8, 14.6 -> 16.1 at M = 1; the core's plain read rate is ~17).
constexpr int kPrefetchLocality = 1;

template <int M>
void DnBlock(const float* __restrict x, int64_t d_total, const float* __restrict w, int64_t n_total,
             int64_t d0, int64_t d1, int64_t n0, int64_t n1, float* __restrict part) {
  const int64_t nb = n1 - n0;
  const int64_t whole = nb / kLanes * kLanes;
  for (int m = 0; m < M; ++m)
    for (int64_t n = 0; n < nb; ++n) part[m * n_total + n0 + n] = 0.f;
  int64_t d = d0;
  for (; d + kGroup <= d1; d += kGroup) {
    const float* w0 = w + d * n_total + n0;
    const bool prefetch = d + 2 * kGroup <= d1;
    float xs[M * kGroup];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kGroup; ++j) xs[m * kGroup + j] = x[m * d_total + d + j];
    for (int64_t n = 0; n < whole; n += kLanes) {
      V a[kGroup];
      for (int j = 0; j < kGroup; ++j) a[j] = Load(w0 + j * n_total + n);
      if (prefetch)
        for (int j = 0; j < kGroup; ++j) __builtin_prefetch(w0 + (kGroup + j) * n_total + n, 0, kPrefetchLocality);
      const float* xp = xs;
      asm("" : "+r"(xp));                                // opaque: not hoisted out of the loop (see above)
      for (int m = 0; m < M; ++m) {
        float* out = part + m * n_total + n0 + n;
        V s0 = Load(out) + xp[m * kGroup] * a[0], s1 = xp[m * kGroup + 1] * a[1];   // two FMA chains
        for (int j = 2; j < kGroup; j += 2) {
          s0 += xp[m * kGroup + j] * a[j];
          s1 += xp[m * kGroup + j + 1] * a[j + 1];
        }
        Store(out, s0 + s1);
      }
    }
    for (int64_t n = whole; n < nb; ++n)
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < kGroup; ++j) part[m * n_total + n0 + n] += xs[m * kGroup + j] * w0[j * n_total + n];
  }
  for (; d < d1; ++d) {
    const float* wr = w + d * n_total + n0;
    for (int m = 0; m < M; ++m) {
      const float s = x[m * d_total + d];
      for (int64_t n = 0; n < nb; ++n) part[m * n_total + n0 + n] += s * wr[n];
    }
  }
}

// Rows of W per pass in "nd": independent accumulator chains (R·M) for few rows, registers for many.
constexpr int NdRows(int m) { return m <= 2 ? 4 : (m <= 4 ? 2 : 1); }

// y[m, n] = Σ_d x[m, d] W[n, d] for W[N, D] row-major, rows n0 .. n1-1: R rows of W at a time, each applied to all
// M rows of x, the rows R ahead prefetched into L2; one tree reduction per output. Measured on the tied LM head
// [49152, 576], two threads from DRAM: 19.8 -> 29.9 GB/s at M = 2 (the one-row-at-a-time form with a serial lane
// sum), 28.5 -> 30.7 at M = 1.
template <int M>
void NdBlock(const float* __restrict x, int64_t d_total, const float* __restrict w, int64_t n_total,
             int64_t n0, int64_t n1, float* __restrict y) {
  constexpr int R = NdRows(M);
  const int64_t whole = d_total / kLanes * kLanes;
  for (int64_t n = n0; n < n1; n += R) {
    const int64_t rows = std::min<int64_t>(R, n1 - n);
    const float* wr = w + n * d_total;
    const bool prefetch = n + 2 * R <= n1;
    V acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = V{};
    for (int64_t d = 0; d < whole; d += kLanes) {
      if (prefetch)
        for (int r = 0; r < R; ++r) __builtin_prefetch(wr + (R + r) * d_total + d, 0, kPrefetchLocality);
      V xv[M];
      for (int m = 0; m < M; ++m) xv[m] = Load(x + m * d_total + d);
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const V wv = Load(wr + r * d_total + d);
        for (int m = 0; m < M; ++m) acc[r][m] += xv[m] * wv;
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < M; ++m) {
        float s = specache_cpu::Sum(acc[r][m]);
        for (int64_t d = whole; d < d_total; ++d) s += x[m * d_total + d] * wr[r * d_total + d];
        y[m * n_total + n + r] = s;
      }
  }
}

using DnFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float*);
using NdFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);

template <int... Ms>
struct Kernels {
  static constexpr DnFn dn[] = {DnBlock<Ms>...};
  static constexpr NdFn nd[] = {NdBlock<Ms>...};
};
using ByRows = Kernels<1, 2, 3, 4, 5, 6, 7, 8>;
static_assert(sizeof(ByRows::dn) / sizeof(DnFn) == kMaxRows);

// One product's share of a call: its weight, output and (for "dn") partial sums.
struct Product {
  const float* w;
  float* y;
  int64_t n;
  int64_t col_blocks = 1, row_parts = 1, rows_per_part = 0, first_item = 0;
  float* parts = nullptr;
};

ffi::Error Run(ffi::ThreadPool pool, bool nd, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
               ffi::RemainingRets ys) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("skinny_matmul: x must be 2-D");
  const int64_t m = xd[0], d = xd[1];
  if (m < 1 || m > kMaxRows) return ffi::Error::InvalidArgument("skinny_matmul: rows must be in [1, 8]");
  if (ws.size() != ys.size() || ws.size() == 0)
    return ffi::Error::InvalidArgument("skinny_matmul: one output per weight");
  const float* xp = x.typed_data();
  std::vector<Product> products;
  int64_t n_items = 0, part_floats = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    const auto wd = w->dimensions();
    if (wd.size() != 2 || (nd ? wd[1] : wd[0]) != d)
      return ffi::Error::InvalidArgument("skinny_matmul: a weight does not contract with x");
    Product p{w->typed_data(), (*y)->typed_data(), nd ? wd[0] : wd[1]};
    p.first_item = n_items;
    if (nd) {
      p.col_blocks = (p.n + kRowBlock - 1) / kRowBlock;       // blocks of rows of W (= output columns)
    } else {
      // items: (a range of rows of W) x (a range of columns); each row range sums into its own partial [M, N]
      p.col_blocks = (p.n + kColBlock - 1) / kColBlock;
      p.row_parts = std::max<int64_t>(1, std::min<int64_t>(kRowParts, d / 64));
      p.rows_per_part = (d / p.row_parts + kGroup - 1) / kGroup * kGroup;
      part_floats += p.row_parts * m * p.n;
    }
    n_items += p.col_blocks * p.row_parts;
    products.push_back(p);
  }
  // The partial sums: a per-thread buffer kept between calls (every element an item reads it wrote first).
  thread_local std::vector<float> parts_buf;
  if (parts_buf.size() < static_cast<size_t>(part_floats)) parts_buf.resize(part_floats);
  std::vector<int64_t> first_group(products.size() + 1, 0);      // "dn": groups (product, column block)
  for (int64_t i = 0, off = 0; i < static_cast<int64_t>(products.size()) && !nd; ++i) {
    products[i].parts = parts_buf.data() + off;
    off += products[i].row_parts * m * products[i].n;
    first_group[i + 1] = first_group[i] + products[i].col_blocks;
  }
  // A group's row parts sum into y on the thread that finishes its last part (no serial pass after the items).
  const int64_t n_groups = first_group.back();
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[std::max<int64_t>(n_groups, 1)]);
  for (int64_t i = 0; i < static_cast<int64_t>(products.size()) && !nd; ++i)
    for (int64_t c = 0; c < products[i].col_blocks; ++c)
      left[first_group[i] + c].store(products[i].row_parts, std::memory_order_relaxed);
  const DnFn dn = ByRows::dn[m - 1];
  const NdFn ndf = ByRows::nd[m - 1];
  const Product* ps = products.data();
  const int64_t* fg = first_group.data();
  std::atomic<int64_t>* lp = left.get();
  const int64_t n_products = products.size();
  auto item_fn = [=](int64_t item) {
    int64_t j = n_products - 1;
    while (ps[j].first_item > item) --j;
    const Product& p = ps[j];
    const int64_t i = item - p.first_item;
    if (nd) {
      ndf(xp, d, p.w, p.n, i * kRowBlock, std::min(p.n, (i + 1) * kRowBlock), p.y);
      return;
    }
    const int64_t r = i / p.col_blocks, c = i % p.col_blocks;
    const int64_t d0 = std::min(d, r * p.rows_per_part);
    const int64_t d1 = r + 1 == p.row_parts ? d : std::min(d, (r + 1) * p.rows_per_part);
    const int64_t n0 = c * kColBlock, n1 = std::min(p.n, (c + 1) * kColBlock);
    dn(xp, d, p.w, p.n, d0, d1, n0, n1, p.parts + r * m * p.n);
    if (lp[fg[j] + c].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    for (int64_t row = 0; row < m; ++row)
      for (int64_t n = n0; n < n1; ++n) {
        float s = p.parts[row * p.n + n];
        for (int64_t q = 1; q < p.row_parts; ++q) s += p.parts[(q * m + row) * p.n + n];
        p.y[row * p.n + n] = s;
      }
  };
  // RunAll returns once every item is done: `products`, `first_group`, `left` and `parts_buf` outlive the items
  specache_cpu::RunAll(pool, item_fn, n_items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SkinnyMatmul, Run,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<bool>("nd")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
