// The MoE dropless dispatch around the grouped expert GEMM (experts.cpp), in three ops
// where MindSpore's ops took ~25 per layer each way (one-hot ranks, cumsums, segment
// sums, a zero row concatenated and sliced off again, the weights scaled row by row).
//
// M tokens, k experts each (idx [M, k]), E experts here, S = M k routed slots, D wide
// rows. Slot (m, j) goes to row dest[m, j] of an expert-sorted buffer [S, D]: expert e's
// rows are [off_e, off_e + count_e) (off_e = counts summed before e), and within an
// expert the slots keep slot order (m, then j), the order of the portable path's
// exclusive cumsum.
//   moe_plan      idx -> dest [M, k], row_token [S] (the token each row holds), counts [R, E]
//   moe_gather    xs [S, D] = x[row_token]            backward: dx[m] = sum_j dxs[dest[m, j]]
//   moe_combine   y[m] = sum_j w[m, j] xs[dest[m, j]] + base[m]
//                 backward: dxs[dest[m, j]] = w[m, j] dy[m], dw[m, j] = dy[m] . xs[dest[m, j]]
// One process (R = 1): every id is one of the E experts and every row holds one slot.
// Expert parallel (R > 1 ranks, the group's tokens rank by rank, ids minus this rank's
// first expert): a slot whose id is outside [0, E) is another rank's (dest -1: it adds
// nothing here and its weight's gradient is 0 here), the rows past this rank's slots are
// empty (row_token -1: zero rows), and counts[r, e] are expert e's rows from rank r, as
// KernelGroupedMatMul takes them. dest is a permutation onto the used rows, so the
// scatters are plain writes and no two threads touch one row.
//
// The sums over j run in j order and the product and the sum are rounded apart (no FMA:
// contraction off for this file): with k = 2 they are the portable path's values bit for
// bit (its segment sum adds a token's two rows in row order; two terms commute exactly).

#pragma GCC optimize("fp-contract=off")

#include "kernels.h"

using namespace mindloom_kernels;

namespace {

// dest's and row_token's ranges, -1 (no row, no token) allowed: a corrupt plan must not
// read or write past a buffer
bool rows_in_range(const int32_t *v, int64_t n, int64_t hi) {
  for (int64_t i = 0; i < n; ++i)
    if (v[i] < -1 || v[i] >= hi) return false;
  return true;
}

MINDLOOM_SIMD void combine_rows(const float *xs, const float *w, const int32_t *dest,
                                const float *base, float *y, int64_t lo, int64_t hi, int64_t k,
                                int64_t d) {
  for (int64_t m = lo; m < hi; ++m) {
    float *out = y + m * d;
    bool first = true;
    for (int64_t j = 0; j < k; ++j) {
      if (dest[m * k + j] < 0) continue;  // another rank's slot
      const float *r = xs + static_cast<int64_t>(dest[m * k + j]) * d;
      const float wj = w[m * k + j];
      if (first) {
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) out[c] = wj * r[c];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          const float p = wj * r[c];
          out[c] = out[c] + p;
        }
      }
      first = false;
    }
    const float *b = base + m * d;
    if (first) {
      std::memcpy(out, b, sizeof(float) * d);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) out[c] = out[c] + b[c];
    }
  }
}

MINDLOOM_SIMD void combine_bwd_rows(const float *dy, const float *xs, const float *w,
                                    const int32_t *dest, float *dxs, float *dw, int64_t lo,
                                    int64_t hi, int64_t k, int64_t d) {
  for (int64_t m = lo; m < hi; ++m) {
    const float *g = dy + m * d;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = dest[m * k + j];
      if (row < 0) {
        dw[m * k + j] = 0.f;
        continue;
      }
      const float *r = xs + row * d;
      float *out = dxs + row * d;
      const float wj = w[m * k + j];
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < d; ++c) {
        out[c] = wj * g[c];
        s += g[c] * r[c];
      }
      dw[m * k + j] = s;
    }
  }
}

MINDLOOM_SIMD void gather_bwd_rows(const float *dxs, const int32_t *dest, float *dx, int64_t lo,
                                   int64_t hi, int64_t k, int64_t d) {
  for (int64_t m = lo; m < hi; ++m) {
    float *out = dx + m * d;
    bool first = true;
    for (int64_t j = 0; j < k; ++j) {
      if (dest[m * k + j] < 0) continue;
      const float *r = dxs + static_cast<int64_t>(dest[m * k + j]) * d;
      if (first) {
        std::memcpy(out, r, sizeof(float) * d);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) out[c] = out[c] + r[c];
      }
      first = false;
    }
    if (first) std::fill(out, out + d, 0.f);
  }
}

// the rows dest uses: a permutation onto [0, used), so the rows from `used` on are empty
int64_t used_rows(const int32_t *dest, int64_t s) {
  int64_t used = 0;
  for (int64_t i = 0; i < s; ++i) used += dest[i] >= 0;
  return used;
}

}  // namespace

// idx [M, k] int32 expert ids, experts [R, E] (its shape is all that is read) -> dest
// [M, k] int32, row_token [S] int32, counts [R, E] int32 (see the top). R = 1: an id
// outside [0, E) makes the op raise; M must be a multiple of R.
EXPORT int mindloom_moe_plan(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **, void *, void *) {
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 2) return 1;
  const int64_t m = shapes[0][0], k = shapes[0][1], r = shapes[1][0], e = shapes[1][1];
  const int64_t s = m * k;
  if (r < 1 || m % r) return 1;
  const auto *idx = static_cast<const int32_t *>(params[0]);
  auto *dest = static_cast<int32_t *>(params[2]);
  auto *row_token = static_cast<int32_t *>(params[3]);
  auto *counts = static_cast<int32_t *>(params[4]);
  std::fill(counts, counts + r * e, 0);
  for (int64_t i = 0; i < s; ++i) {
    const int32_t id = idx[i];
    if (id < 0 || id >= e) {
      if (r == 1) return 2;
      continue;
    }
    ++counts[(i / k) / (m / r) * e + id];
  }
  std::vector<int64_t> next(e, 0);  // each expert's next row
  for (int64_t i = 0, off = 0; i < e; ++i) {
    next[i] = off;
    for (int64_t j = 0; j < r; ++j) off += counts[j * e + i];
  }
  std::fill(row_token, row_token + s, -1);
  for (int64_t i = 0; i < s; ++i) {
    const int32_t id = idx[i];
    if (id < 0 || id >= e) {
      dest[i] = -1;
      continue;
    }
    const int64_t row = next[id]++;
    dest[i] = static_cast<int32_t>(row);
    row_token[row] = static_cast<int32_t>(i / k);
  }
  return 0;
}

// x [M, D], row_token [S] int32 in [-1, M) -> xs [S, D] = x[row_token] (-1: a zero row)
EXPORT int mindloom_moe_gather(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **, void *, void *) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1) return 1;
  const int64_t m = shapes[0][0], d = shapes[0][1], s = shapes[1][0];
  const auto *x = static_cast<const float *>(params[0]);
  const auto *tok = static_cast<const int32_t *>(params[1]);
  auto *xs = static_cast<float *>(params[2]);
  if (!rows_in_range(tok, s, m)) return 2;
  parallel_rows(s, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (tok[r] < 0)
        std::fill(xs + r * d, xs + (r + 1) * d, 0.f);
      else
        std::memcpy(xs + r * d, x + static_cast<int64_t>(tok[r]) * d, sizeof(float) * d);
    }
  });
  return 0;
}

// dxs [S, D], dest [M, k] int32 in [-1, S) -> dx [M, D], dx[m] = sum over j of dxs[dest[m, j]]
EXPORT int mindloom_moe_gather_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                   const char **, void *, void *) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2) return 1;
  const int64_t s = shapes[0][0], d = shapes[0][1], m = shapes[1][0], k = shapes[1][1];
  if (m * k != s) return 1;
  const auto *dxs = static_cast<const float *>(params[0]);
  const auto *dest = static_cast<const int32_t *>(params[1]);
  auto *dx = static_cast<float *>(params[2]);
  if (!rows_in_range(dest, s, s)) return 2;
  parallel_rows(m, [&](int64_t lo, int64_t hi) { gather_bwd_rows(dxs, dest, dx, lo, hi, k, d); });
  return 0;
}

// xs [S, D], w [M, k], dest [M, k] int32, base [M, D] -> y [M, D]
EXPORT int mindloom_moe_combine(int nparam, void **params, int *ndims, int64_t **shapes,
                                const char **, void *, void *) {
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 2) return 1;
  const int64_t s = shapes[0][0], d = shapes[0][1], m = shapes[1][0], k = shapes[1][1];
  if (m * k != s || shapes[2][0] != m || shapes[2][1] != k || shapes[3][0] != m ||
      shapes[3][1] != d)
    return 1;
  const auto *xs = static_cast<const float *>(params[0]);
  const auto *w = static_cast<const float *>(params[1]);
  const auto *dest = static_cast<const int32_t *>(params[2]);
  const auto *base = static_cast<const float *>(params[3]);
  auto *y = static_cast<float *>(params[4]);
  if (!rows_in_range(dest, s, s)) return 2;
  parallel_rows(m, [&](int64_t lo, int64_t hi) { combine_rows(xs, w, dest, base, y, lo, hi, k, d); });
  return 0;
}

// dy [M, D], xs [S, D], w [M, k], dest [M, k] int32 -> dxs [S, D] (unused rows zero), dw [M, k]
EXPORT int mindloom_moe_combine_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                    const char **, void *, void *) {
  if (nparam != 6 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2 || ndims[3] != 2) return 1;
  const int64_t m = shapes[0][0], d = shapes[0][1], s = shapes[1][0], k = shapes[2][1];
  if (m * k != s || shapes[1][1] != d || shapes[2][0] != m || shapes[3][0] != m ||
      shapes[3][1] != k)
    return 1;
  const auto *dy = static_cast<const float *>(params[0]);
  const auto *xs = static_cast<const float *>(params[1]);
  const auto *w = static_cast<const float *>(params[2]);
  const auto *dest = static_cast<const int32_t *>(params[3]);
  auto *dxs = static_cast<float *>(params[4]);
  auto *dw = static_cast<float *>(params[5]);
  if (!rows_in_range(dest, s, s)) return 2;
  const int64_t used = used_rows(dest, s);
  std::fill(dxs + used * d, dxs + s * d, 0.f);
  parallel_rows(m, [&](int64_t lo, int64_t hi) {
    combine_bwd_rows(dy, xs, w, dest, dxs, dw, lo, hi, k, d);
  });
  return 0;
}
