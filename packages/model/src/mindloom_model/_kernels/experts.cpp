// Grouped matrix products for the MoE experts (see kernels.h for the signature and the pool).
//
// The dropless dispatch sorts the routed (token, expert) slots by expert: rows
// [off_e, off_e + count_e) of x [P, K] belong to expert e, in expert order, and rows past
// the last expert's are empty (zeros out). Each expert's rows are then one ordinary
// product with that expert's weight, and the three entry points are the three a linear
// layer needs:
//   gmm_nt  y [P, N] = x_e [c_e, K] @ w_e^T    (w [E, N, K]: the forward)
//   gmm_nn  dx [P, K] = dy_e [c_e, N] @ w_e    (the input's gradient)
//   gmm_tn  dw [E, N, K]: dw_e = dy_e^T @ x_e  (the weight's gradient; 0 for an idle expert)
// counts [E] int32 say where each expert's rows start; no buffer is padded per expert and
// no expert's weights are copied per block of rows (the portable dispatch does both).
// Counts [R, E] say, under expert parallelism, how many of expert e's rows came from each
// of the R ranks (in rank order): gmm_tn then sums each rank's rows on their own and adds
// the R sums in order, as a one-process run adds its micro-batches' gradients, so an ep
// run's expert gradients round as the one-process run's do.
//
// One packed GEMM serves all three (Goto/BLIS's scheme, one level): C [M, N] = A [M, K] B
// [K, N] with A and B read through strides, so a transposed operand is just other strides.
// A task is a block of up to MT rows x NC columns of one expert's C; per KC-deep slice it
// copies its B block into NR-wide column panels once, and its rows in MC-row A blocks into
// MR-tall row panels (zero padded: the register tile needs no edge cases), then runs the
// MR x NR register tile over every pair of panels. Tasks are taken from an atomic counter
// by the pool's threads.

#include "kernels.h"

namespace {

using namespace mindloom_kernels;

constexpr int64_t MT = 384;  // rows of a task
constexpr int64_t MC = 96;   // rows of a packed A block (a multiple of every MR below)
constexpr int64_t NC = 256;  // columns of a task (a multiple of every NR below)
constexpr int64_t KC = 256;  // depth of one packed slice

// C [m, n] (=|+=) A [m, k] B [k, n], A(i, p) = a[i * ars + p * aks], B(p, j) = b[p * bks +
// j * bns], C row-major with leading dimension ldc. k == 0 writes zeros.
struct Gemm {
  const float *a;
  int64_t ars, aks;
  const float *b;
  int64_t bks, bns;
  float *c;
  int64_t ldc, m, n, k;
  // depths where a new slice must start besides every KC (increasing, in (0, k)); each
  // slice's sum is added to C in order, so a reduction split at these points rounds as
  // separate reductions added one after another would (see mindloom_gmm_tn)
  const int64_t *breaks = nullptr;
  int64_t nbreaks = 0;
};

struct Task {
  int32_t g;  // which Gemm
  int64_t m0, n0;
};

struct GmmJob {
  const std::vector<Gemm> *gemms;
  const std::vector<Task> *tasks;
  std::atomic<int64_t> *next;
};

// *p in every lane: for AVX-512 a broadcast load (GCC otherwise loads the float and then
// broadcasts it from a register, one more instruction per row of the tile)
typedef float v16 __attribute__((vector_size(64)));

template <class V>
__attribute__((always_inline)) inline V broadcast(const float *p) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if constexpr (sizeof(V) == 64) {  // only instantiated in the AVX-512 body
    V v;
    asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
    return v;
  }
#endif
  return V{} + *p;
}

// The MR x NR register tile: MR rows of NV vectors V (NR = NV * lanes), accumulated over
// kc steps from packed panels ap [kc][MR] and bp [kc][NR]; stored (or added) into the
// mr x nr corner of C that exists.
template <class V, int MR, int NV>
__attribute__((always_inline)) inline void tile(int64_t kc, const float *ap, const float *bp,
                                                float *c, int64_t ldc, int64_t mr, int64_t nr,
                                                bool accumulate) {
  constexpr int L = sizeof(V) / sizeof(float);
  constexpr int NR = NV * L;
  typedef float Vu __attribute__((vector_size(sizeof(V)), aligned(4)));
  V t[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) t[i][j] = V{};
  for (int64_t p = 0; p < kc; ++p, ap += MR, bp += NR) {
    V bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = *reinterpret_cast<const V *>(bp + j * L);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const V av = broadcast<V>(ap + i);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) t[i][j] += av * bv[j];
    }
  }
  if (mr == MR && nr == NR) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        Vu *dst = reinterpret_cast<Vu *>(c + i * ldc + j * L);
        *dst = accumulate ? *dst + t[i][j] : t[i][j];
      }
    return;
  }
  // an edge tile: through a buffer (indexing t by a run-time lane would keep it in memory)
  alignas(64) float buf[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) *reinterpret_cast<V *>(&buf[i][j * L]) = t[i][j];
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] = accumulate ? c[i * ldc + j] + buf[i][j] : buf[i][j];
}

// rows [m0, m0 + mc) x depth [p0, p0 + kc) of A into MR-tall panels, ap [mc/MR][kc][MR],
// zero rows past mc. The loop order follows A's layout: rows contiguous in depth (x, dy
// as they are) are transposed row by row; depth-major A (dy read transposed) is copied
// MR values at a time.
template <int MR>
inline void pack_a(const Gemm &g, int64_t m0, int64_t mc, int64_t p0, int64_t kc, float *ap) {
  for (int64_t i0 = 0; i0 < mc; i0 += MR, ap += kc * MR) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, mc - i0));
    const float *src = g.a + (m0 + i0) * g.ars + p0 * g.aks;
    if (g.aks == 1) {
      for (int i = 0; i < MR; ++i) {
        const float *r = src + i * g.ars;
        for (int64_t p = 0; p < kc; ++p) ap[p * MR + i] = i < rows ? r[p] : 0.f;
      }
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        const float *r = src + p * g.aks;
        for (int i = 0; i < MR; ++i) ap[p * MR + i] = i < rows ? r[i * g.ars] : 0.f;
      }
    }
  }
}

// depth [p0, p0 + kc) x columns [n0, n0 + nc) of B into NR-wide panels, bp [nc/NR][kc][NR],
// zero columns past nc; as above, a transpose when B's columns are contiguous in depth (a
// weight read as w^T), row copies when its rows are (w, x)
template <int NR>
inline void pack_b(const Gemm &g, int64_t n0, int64_t nc, int64_t p0, int64_t kc, float *bp) {
  for (int64_t j0 = 0; j0 < nc; j0 += NR, bp += kc * NR) {
    const int cols = static_cast<int>(std::min<int64_t>(NR, nc - j0));
    const float *src = g.b + p0 * g.bks + (n0 + j0) * g.bns;
    if (g.bks == 1) {
      for (int j = 0; j < NR; ++j) {
        const float *col = src + j * g.bns;
        for (int64_t p = 0; p < kc; ++p) bp[p * NR + j] = j < cols ? col[p] : 0.f;
      }
    } else if (g.bns == 1 && cols == NR) {
      for (int64_t p = 0; p < kc; ++p) std::memcpy(bp + p * NR, src + p * g.bks, sizeof(float) * NR);
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        const float *row = src + p * g.bks;
        for (int j = 0; j < NR; ++j) bp[p * NR + j] = j < cols ? row[j * g.bns] : 0.f;
      }
    }
  }
}

// one thread's share of a job: tasks from the counter until none is left. A task is MT
// rows x NC columns of one product: per KC-deep slice its B block is packed once and
// its rows go through in MC-row A blocks (an expert's ~N k / E rows are usually one task,
// so each weight is packed once per call).
template <class V, int MR, int NV>
__attribute__((always_inline)) inline void gmm_body(const GmmJob &job) {
  constexpr int NR = NV * static_cast<int>(sizeof(V) / sizeof(float));
  static_assert(MC % MR == 0 && NC % NR == 0, "blocks hold whole panels");
  // 64-byte aligned panels: the register tile loads B's rows as whole vectors
  std::vector<float> abuf(MC * KC + 16), bbuf(NC * KC + 16);
  float *ap = reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(abuf.data()) + 63) & ~uintptr_t(63));
  float *bp = reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(bbuf.data()) + 63) & ~uintptr_t(63));
  const auto &tasks = *job.tasks;
  for (;;) {
    const int64_t t = job.next->fetch_add(1, std::memory_order_relaxed);
    if (t >= static_cast<int64_t>(tasks.size())) return;
    const Task &task = tasks[t];
    const Gemm &g = (*job.gemms)[task.g];
    const int64_t mt = std::min(MT, g.m - task.m0), nc = std::min(NC, g.n - task.n0);
    float *ct = g.c + task.m0 * g.ldc + task.n0;
    if (g.k == 0) {
      for (int64_t i = 0; i < mt; ++i) std::fill(ct + i * g.ldc, ct + i * g.ldc + nc, 0.f);
      continue;
    }
    int64_t nb = 0;  // the next break
    for (int64_t p0 = 0, kc = 0; p0 < g.k; p0 += kc) {
      while (nb < g.nbreaks && g.breaks[nb] <= p0) ++nb;
      kc = std::min(KC, (nb < g.nbreaks ? g.breaks[nb] : g.k) - p0);
      pack_b<NR>(g, task.n0, nc, p0, kc, bp);
      for (int64_t m0 = 0; m0 < mt; m0 += MC) {
        const int64_t mc = std::min(MC, mt - m0);
        pack_a<MR>(g, task.m0 + m0, mc, p0, kc, ap);
        float *c = ct + m0 * g.ldc;
        for (int64_t j0 = 0; j0 < nc; j0 += NR)
          for (int64_t i0 = 0; i0 < mc; i0 += MR)
            tile<V, MR, NV>(kc, ap + i0 * kc, bp + j0 * kc, c + i0 * g.ldc + j0, g.ldc,
                            std::min<int64_t>(MR, mc - i0), std::min<int64_t>(NR, nc - j0),
                            p0 > 0);
      }
    }
  }
}

// Compiled three times, as attention.cpp's bodies are (the same reasons, the same
// $MINDLOOM_KERNEL_ISA override): AVX-512 holds a 12 x 32 tile in 24 of its 32 registers,
// AVX2 a 6 x 16 tile in 12 of its 16, the baseline the AVX2 shape in SSE halves.
using GmmFn = void (*)(const GmmJob &);
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MINDLOOM_NO_CLONES)
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void gmm_avx512(const GmmJob &j) {
  gmm_body<v16, 12, 2>(j);
}
__attribute__((target("avx2,fma"))) void gmm_avx2(const GmmJob &j) { gmm_body<v8, 6, 2>(j); }
void gmm_base(const GmmJob &j) { gmm_body<v8, 6, 2>(j); }
GmmFn pick_gmm() {
  const Isa isa = best_isa();
  return isa == Isa::avx512 ? gmm_avx512 : isa == Isa::avx2 ? gmm_avx2 : gmm_base;
}
#else
void gmm_base(const GmmJob &j) { gmm_body<v8, 6, 2>(j); }
GmmFn pick_gmm() { return gmm_base; }
#endif

void run_gemms(const std::vector<Gemm> &gemms) {
  std::vector<Task> tasks;
  for (int32_t g = 0; g < static_cast<int32_t>(gemms.size()); ++g)
    for (int64_t m0 = 0; m0 < gemms[g].m; m0 += MT)
      for (int64_t n0 = 0; n0 < gemms[g].n; n0 += NC) tasks.push_back({g, m0, n0});
  static const GmmFn body = pick_gmm();
  std::atomic<int64_t> next{0};
  const GmmJob job{&gemms, &tasks, &next};
  Pool::get().run([&](int, int) { body(job); });
}

// Each expert's first row from counts [E] or [R, E] (the rows of expert e that came from
// each of R sources, in source order within the expert: expert parallel's ranks), all
// non-negative and summing to at most `rows`; false otherwise, which makes the op raise.
bool expert_offsets(const int32_t *counts, int nd, const int64_t *shape, int64_t rows,
                    std::vector<int64_t> *off) {
  if (nd != 1 && nd != 2) return false;
  const int64_t r = nd == 2 ? shape[0] : 1, e = shape[nd - 1];
  off->assign(e + 1, 0);
  for (int64_t i = 0; i < e; ++i) {
    int64_t n = 0;
    for (int64_t j = 0; j < r; ++j) {
      if (counts[j * e + i] < 0) return false;
      n += counts[j * e + i];
    }
    (*off)[i + 1] = (*off)[i] + n;
  }
  return (*off)[e] <= rows;
}

}  // namespace

namespace {

// y [P, out] = each expert's rows of x [P, in] times its weight w [E, N, K], read as w_e^T
// (transpose: in = K, out = N) or as w_e (in = N, out = K); rows past the experts' are
// zero. params: x, w, counts, y.
int rows_by_weight(int nparam, void **params, int *ndims, int64_t **shapes, bool transpose) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 3) return 1;
  const int64_t e = shapes[1][0], wn = shapes[1][1], wk = shapes[1][2];
  const int64_t p = shapes[0][0], in = shapes[0][1], out = transpose ? wn : wk;
  if (in != (transpose ? wk : wn) || shapes[2][ndims[2] - 1] != e) return 1;
  const auto *x = static_cast<const float *>(params[0]);
  const auto *w = static_cast<const float *>(params[1]);
  auto *y = static_cast<float *>(params[3]);
  std::vector<int64_t> off;
  if (!expert_offsets(static_cast<const int32_t *>(params[2]), ndims[2], shapes[2], p, &off))
    return 2;
  // B(p, j) = w_e[j][p] (transpose) or w_e[p][j]
  const int64_t bks = transpose ? 1 : wk, bns = transpose ? wk : 1;
  std::vector<Gemm> gemms;
  for (int64_t i = 0; i < e; ++i)
    if (off[i + 1] > off[i])
      gemms.push_back({x + off[i] * in, in, 1, w + i * wn * wk, bks, bns, y + off[i] * out, out,
                       off[i + 1] - off[i], out, in});
  run_gemms(gemms);
  std::fill(y + off[e] * out, y + p * out, 0.f);
  return 0;
}

}  // namespace

// x [P, K], w [E, N, K], counts [E] or [R, E] int32 -> y [P, N]: y rows of expert e =
// x rows @ w_e^T; rows past the experts' are zero
EXPORT int mindloom_gmm_nt(int nparam, void **params, int *ndims, int64_t **shapes,
                           const char **, void *, void *) {
  return rows_by_weight(nparam, params, ndims, shapes, true);
}

// dy [P, N], w [E, N, K], counts [E] or [R, E] -> dx [P, K]: dx rows of expert e =
// dy rows @ w_e
EXPORT int mindloom_gmm_nn(int nparam, void **params, int *ndims, int64_t **shapes,
                           const char **, void *, void *) {
  return rows_by_weight(nparam, params, ndims, shapes, false);
}

// dy [P, N], x [P, K], counts [E] or [R, E] -> dw [E, N, K]: dw_e = dy rows^T @ x rows
// of expert e (zeros for an expert with no rows)
EXPORT int mindloom_gmm_tn(int nparam, void **params, int *ndims, int64_t **shapes,
                           const char **, void *, void *) {
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] < 1) return 1;
  const int64_t p = shapes[0][0], n = shapes[0][1], k = shapes[1][1];
  const int64_t e = shapes[2][ndims[2] - 1], r = ndims[2] == 2 ? shapes[2][0] : 1;
  if (shapes[1][0] != p) return 1;
  const auto *dy = static_cast<const float *>(params[0]);
  const auto *x = static_cast<const float *>(params[1]);
  auto *dw = static_cast<float *>(params[3]);
  std::vector<int64_t> off;
  if (!expert_offsets(static_cast<const int32_t *>(params[2]), ndims[2], shapes[2], p, &off))
    return 2;
  // with [R, E] counts each source's rows are a reduction of their own, added in source
  // order: the sum a one-process run forms when those rows were its R micro-batches
  const auto *cnt = static_cast<const int32_t *>(params[2]);
  std::vector<int64_t> breaks;
  breaks.reserve(e * r);
  std::vector<Gemm> gemms;
  for (int64_t i = 0; i < e; ++i) {
    Gemm g{dy + off[i] * n, 1, n, x + off[i] * k, k, 1, dw + i * n * k, k, n, k, off[i + 1] - off[i]};
    g.breaks = breaks.data() + breaks.size();
    for (int64_t j = 0, at = 0; j + 1 < r; ++j) {
      at += cnt[j * e + i];
      if (at > 0 && at < g.k && (g.nbreaks == 0 || g.breaks[g.nbreaks - 1] < at)) {
        breaks.push_back(at);
        ++g.nbreaks;
      }
    }
    gemms.push_back(g);
  }
  run_gemms(gemms);
  return 0;
}

// ------------------------------------------------------------------------ routing

namespace {

// One row of DeepSeek-V3's group-limited top-k on choice = scores + bias [E]: groups of
// E / G experts scored by the sum of their two best, the best tg groups kept, the k best
// experts of those chosen; out [k] in descending order of choice, ties to the lower
// index (a stable sort's order, as the portable path's TopK and the NumPy reference).
void route_row(const float *choice, int64_t e, int64_t g, int64_t tg, int64_t k,
               int32_t *out, std::vector<float> *gscore, std::vector<char> *keep) {
  const int64_t per = e / g;
  keep->assign(e, 1);
  if (g > 1) {
    gscore->resize(g);
    for (int64_t i = 0; i < g; ++i) {
      float a = -INFINITY, b = -INFINITY;  // the group's best two
      for (int64_t j = i * per; j < (i + 1) * per; ++j) {
        const float v = choice[j];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      (*gscore)[i] = per > 1 ? a + b : a;
    }
    std::vector<char> chosen(g, 0);
    for (int64_t t = 0; t < tg; ++t) {
      int64_t best = -1;
      for (int64_t i = 0; i < g; ++i)
        if (!chosen[i] && (best < 0 || (*gscore)[i] > (*gscore)[best])) best = i;
      chosen[best] = 1;
    }
    for (int64_t j = 0; j < e; ++j) (*keep)[j] = chosen[j / per];
  }
  for (int64_t t = 0; t < k; ++t) {
    int64_t best = -1;
    for (int64_t j = 0; j < e; ++j)
      if ((*keep)[j] && (best < 0 || choice[j] > choice[best])) best = j;
    out[t] = static_cast<int32_t>(best);
    (*keep)[best] = 0;
  }
}

}  // namespace

// choice [N, E] fp32, groups [2] int32 (n_group, topk_group) -> ids [N, k] int32: each
// row's experts by DeepSeek-V3's group-limited top-k (route_row)
EXPORT int mindloom_moe_route(int nparam, void **params, int *ndims, int64_t **shapes,
                              const char **, void *, void *) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1 || shapes[1][0] != 2 || ndims[2] != 2)
    return 1;
  const int64_t n = shapes[0][0], e = shapes[0][1], k = shapes[2][1];
  const auto *spec = static_cast<const int32_t *>(params[1]);
  const int64_t g = spec[0], tg = spec[1];
  if (shapes[2][0] != n || g < 1 || e % g || tg < 1 || tg > g || k < 1 || k > tg * (e / g))
    return 1;
  const auto *choice = static_cast<const float *>(params[0]);
  auto *ids = static_cast<int32_t *>(params[2]);
  parallel_rows(n, [&](int64_t lo, int64_t hi) {
    std::vector<float> gscore;
    std::vector<char> keep;
    for (int64_t r = lo; r < hi; ++r) route_row(choice + r * e, e, g, tg, k, ids + r * k, &gscore, &keep);
  });
  return 0;
}
