// mindloom's fused CPU kernels, called by MindSpore as AOT custom operators: RMSNorm,
// SwiGLU and cross-entropy here, attention in attention.cpp, the pool in kernels.h.
//
// Vector paths: the hot loops are plain loops the compiler vectorises; `MINDLOOM_SIMD`
// builds an AVX-512, an AVX2 and a baseline copy of each and the loader picks one at run
// time from the CPU (GCC function multiversioning), so one library runs on any x86-64.
// The pool (`Pool`, kernels.h) spreads rows over its threads.

#include "kernels.h"

namespace {

using namespace mindloom_kernels;

// ------------------------------------------------------------------------ RMSNorm

MINDLOOM_SIMD void rmsnorm_fwd_rows(const float *x, const float *w, float *y, float *rstd,
                                    int64_t n, int64_t d, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * d;
    float *yr = y + r * d;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; ++j) ss += xr[j] * xr[j];
    const float rs = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    rstd[r] = rs;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) yr[j] = xr[j] * rs * w[j];
  }
}

// rows [0, n); the weight gradient of these rows is added into pw
MINDLOOM_SIMD void rmsnorm_bwd_rows(const float *x, const float *w, const float *rstd,
                                    const float *dy, float *dx, float *pw, int64_t n,
                                    int64_t d) {
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * d, *gr = dy + r * d;
    float *dxr = dx + r * d;
    const float rs = rstd[r];
    float dot = 0.f;  // sum_j (w dy)_j xhat_j
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < d; ++j) dot += w[j] * gr[j] * xr[j];
    const float c = dot * rs * rs / static_cast<float>(d);
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      dxr[j] = rs * (w[j] * gr[j] - xr[j] * c);
      pw[j] += gr[j] * xr[j] * rs;
    }
  }
}

// ------------------------------------------------------------------------ SwiGLU

MINDLOOM_SIMD void swiglu_fwd_flat(const float *a, const float *b, float *y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 x = load8(a + i);
    store8(y + i, x / (1.f + vexp8(-x)) * load8(b + i));
  }
  for (; i < n; ++i) y[i] = a[i] / (1.f + vexp(-a[i])) * b[i];
}

MINDLOOM_SIMD void swiglu_bwd_flat(const float *a, const float *b, const float *dy, float *da,
                                   float *db, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8 x = load8(a + i), g = load8(dy + i);
    const v8 s = 1.f / (1.f + vexp8(-x));
    store8(db + i, g * x * s);
    store8(da + i, g * load8(b + i) * s * (1.f + x * (1.f - s)));
  }
  for (; i < n; ++i) {
    const float s = 1.f / (1.f + vexp(-a[i]));
    db[i] = dy[i] * a[i] * s;
    da[i] = dy[i] * b[i] * s * (1.f + a[i] * (1.f - s));
  }
}

// ------------------------------------------------------------------------ cross-entropy

MINDLOOM_SIMD void ce_fwd_rows(const float *x, const int32_t *labels, float *nll, float *lse,
                               int64_t n, int64_t v) {
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * v;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < v; ++j) m = std::max(m, xr[j]);
    v8 acc{};
    int64_t j = 0;
    for (; j + 8 <= v; j += 8) acc += vexp8(load8(xr + j) - m);
    float s = hsum8(acc);
    for (; j < v; ++j) s += vexp(xr[j] - m);
    const float l = m + std::log(s);
    lse[r] = l;
    const int64_t y = std::min<int64_t>(std::max<int32_t>(labels[r], 0), v - 1);
    nll[r] = l - xr[y];
  }
}

MINDLOOM_SIMD void ce_bwd_rows(const float *x, const int32_t *labels, const float *lse,
                               const float *g, float *dx, int64_t n, int64_t v) {
  for (int64_t r = 0; r < n; ++r) {
    const float *xr = x + r * v;
    float *dr = dx + r * v;
    const float gr = g[r], l = lse[r];
    if (gr == 0.f) {
      std::memset(dr, 0, sizeof(float) * v);
      continue;
    }
    int64_t j = 0;
    for (; j + 8 <= v; j += 8) store8(dr + j, gr * vexp8(load8(xr + j) - l));
    for (; j < v; ++j) dr[j] = gr * vexp(xr[j] - l);
    const int64_t y = std::min<int64_t>(std::max<int32_t>(labels[r], 0), v - 1);
    dr[y] -= gr;
  }
}

// sum of x[i]^2 over n values: 8 float lanes over runs of 256 values (32 additions per
// lane), each run's sum added in double, so the rounding stays near fp32's unit
MINDLOOM_SIMD double sumsq_flat(const float *x, int64_t n) {
  double s = 0.0;
  int64_t i = 0;
  while (i + 8 <= n) {
    v8 acc{};
    const int64_t end = std::min(n, i + 256);
    for (; i + 8 <= end; i += 8) {
      const v8 a = load8(x + i);
      acc += a * a;
    }
    s += hsum8(acc);
  }
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

constexpr int64_t kSumsqBlock = 1 << 15;

// One parameter's AdamW update in place, equal to the bit to MindSpore's `AdamWeightDecay`
// on the gradient times `f` (the portable step's Mul): the moments in float, each one
// FMA, the weight's step in double and rounded once (measured against MindSpore 2.10's CPU
// kernel: the float forms of the weight step differ in ~0.5% of the values by an ulp).
// The explicit fma calls fix the moments' rounding whatever -ffp-contract does.
MINDLOOM_SIMD void adamw_span(float *w, float *m, float *v, const float *g, const float *h,
                              int64_t lo, int64_t hi) {
  const float lr = h[0], c1 = 1.f - h[1], c2 = 1.f - h[2], eps = h[3], wd = h[4], f = h[5];
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = g[i] * f;
    const float mi = std::fma(gi - m[i], c1, m[i]);
    const float vi = std::fma(std::fma(gi, gi, -v[i]), c2, v[i]);
    m[i] = mi;
    v[i] = vi;
    const float decay = wd * w[i];
    const double step = static_cast<double>(mi) / (std::sqrt(static_cast<double>(vi)) + eps) +
                        static_cast<double>(decay);
    w[i] = static_cast<float>(static_cast<double>(w[i]) - static_cast<double>(lr) * step);
  }
}

// rows of this many values per pool task: elementwise, so any split gives the same bits
constexpr int64_t kAdamwSpan = 1 << 14;

}  // namespace

using namespace mindloom_kernels;

// x [N, D], w [D], eps [1] -> y [N, D], rstd [N]
EXPORT int mindloom_rmsnorm_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                const char **, void *, void *) {
  if (nparam != 5) return 1;
  const int64_t d = shapes[0][ndims[0] - 1], n = numel(ndims[0], shapes[0]) / d;
  const float *x = static_cast<float *>(params[0]), *w = static_cast<float *>(params[1]);
  float *y = static_cast<float *>(params[3]), *rstd = static_cast<float *>(params[4]);
  const float eps = static_cast<float *>(params[2])[0];
  parallel_rows(n, [&](int64_t lo, int64_t hi) {
    rmsnorm_fwd_rows(x + lo * d, w, y + lo * d, rstd + lo, hi - lo, d, eps);
  });
  return 0;
}

// x [N, D], w [D], rstd [N], dy [N, D] -> dx [N, D], dw [D]
EXPORT int mindloom_rmsnorm_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                const char **, void *, void *) {
  if (nparam != 6) return 1;
  const int64_t d = shapes[0][ndims[0] - 1], n = numel(ndims[0], shapes[0]) / d;
  const float *x = static_cast<float *>(params[0]), *w = static_cast<float *>(params[1]);
  const float *rstd = static_cast<float *>(params[2]), *dy = static_cast<float *>(params[3]);
  float *dx = static_cast<float *>(params[4]), *dw = static_cast<float *>(params[5]);
  const int nt = Pool::get().size();
  std::vector<float> partial(static_cast<size_t>(nt) * d, 0.f);  // per thread: no atomics
  Pool::get().run([&](int t, int nth) {
    int64_t lo, hi;
    chunk(n, t, nth, &lo, &hi);
    if (lo < hi)
      rmsnorm_bwd_rows(x + lo * d, w, rstd + lo, dy + lo * d, dx + lo * d,
                       partial.data() + static_cast<int64_t>(t) * d, hi - lo, d);
  });
  std::fill(dw, dw + d, 0.f);
  for (int t = 0; t < nt; ++t) {
    const float *pw = partial.data() + static_cast<int64_t>(t) * d;
    for (int64_t j = 0; j < d; ++j) dw[j] += pw[j];
  }
  return 0;
}

// a, b -> silu(a) * b
EXPORT int mindloom_swiglu_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **, void *, void *) {
  if (nparam != 3) return 1;
  const float *a = static_cast<float *>(params[0]), *b = static_cast<float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  parallel_rows(numel(ndims[0], shapes[0]), [&](int64_t lo, int64_t hi) {
    swiglu_fwd_flat(a + lo, b + lo, y + lo, hi - lo);
  });
  return 0;
}

// a, b, dy -> da, db
EXPORT int mindloom_swiglu_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **, void *, void *) {
  if (nparam != 5) return 1;
  const float *a = static_cast<float *>(params[0]), *b = static_cast<float *>(params[1]);
  const float *dy = static_cast<float *>(params[2]);
  float *da = static_cast<float *>(params[3]), *db = static_cast<float *>(params[4]);
  parallel_rows(numel(ndims[0], shapes[0]), [&](int64_t lo, int64_t hi) {
    swiglu_bwd_flat(a + lo, b + lo, dy + lo, da + lo, db + lo, hi - lo);
  });
  return 0;
}

// logits [N, V], labels [N] int32 -> nll [N], lse [N]
EXPORT int mindloom_ce_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                           const char **, void *, void *) {
  if (nparam != 4 || ndims[0] != 2) return 1;
  const float *x = static_cast<float *>(params[0]);
  const int32_t *labels = static_cast<int32_t *>(params[1]);
  float *nll = static_cast<float *>(params[2]), *lse = static_cast<float *>(params[3]);
  const int64_t v = shapes[0][1];
  parallel_rows(shapes[0][0], [&](int64_t lo, int64_t hi) {
    ce_fwd_rows(x + lo * v, labels + lo, nll + lo, lse + lo, hi - lo, v);
  });
  return 0;
}

// logits [N, V], labels [N], lse [N], g [N] -> dlogits [N, V]
EXPORT int mindloom_ce_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                           const char **, void *, void *) {
  if (nparam != 5 || ndims[0] != 2) return 1;
  const float *x = static_cast<float *>(params[0]);
  const int32_t *labels = static_cast<int32_t *>(params[1]);
  const float *lse = static_cast<float *>(params[2]), *g = static_cast<float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  const int64_t v = shapes[0][1];
  parallel_rows(shapes[0][0], [&](int64_t lo, int64_t hi) {
    ce_bwd_rows(x + lo * v, labels + lo, lse + lo, g + lo, dx + lo * v, hi - lo, v);
  });
  return 0;
}

// t_0 .. t_{n-1} (fp32, any shapes) -> out [n + 1]: each tensor's sum of squares, then their
// total. One call for the global gradient norm instead of one reduction per tensor; the
// values are cut into blocks of kSumsqBlock whatever the threads, each block summed on
// its own and the blocks added in order in double, so the result is the same on any pool.
EXPORT int mindloom_sumsq_many(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **, void *, void *) {
  const int n = nparam - 1;
  if (n < 1 || ndims[n] != 1 || shapes[n][0] != n + 1) return 1;
  struct Block {
    const float *x;
    int64_t len;
    int tensor;
  };
  std::vector<Block> blocks;
  for (int t = 0; t < n; ++t) {
    const float *x = static_cast<float *>(params[t]);
    const int64_t len = numel(ndims[t], shapes[t]);
    for (int64_t lo = 0; lo < len; lo += kSumsqBlock)
      blocks.push_back({x + lo, std::min(kSumsqBlock, len - lo), t});
  }
  std::vector<double> part(blocks.size(), 0.0);
  parallel_rows(static_cast<int64_t>(blocks.size()), [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) part[b] = sumsq_flat(blocks[b].x, blocks[b].len);
  });
  std::vector<double> per(n, 0.0);
  for (size_t b = 0; b < blocks.size(); ++b) per[blocks[b].tensor] += part[b];
  float *out = static_cast<float *>(params[n]);
  double total = 0.0;
  for (int t = 0; t < n; ++t) {
    out[t] = static_cast<float>(per[t]);
    total += per[t];
  }
  out[n] = static_cast<float>(total);
  return 0;
}

// w, m, v [any shape, the same] fp32, written in place; g (that shape) fp32; h [6] =
// (lr, beta1, beta2, eps, weight decay, gradient factor) -> out [1] (0: the op needs an
// output; the graph orders the writes by the operator's RW_WRITE signature)
EXPORT int mindloom_adamw(int nparam, void **params, int *ndims, int64_t **shapes,
                          const char **, void *, void *) {
  if (nparam != 6 || ndims[4] != 1 || shapes[4][0] != 6) return 1;
  const int64_t n = numel(ndims[0], shapes[0]);
  for (int t = 1; t < 4; ++t)
    if (numel(ndims[t], shapes[t]) != n) return 1;
  float *w = static_cast<float *>(params[0]), *m = static_cast<float *>(params[1]);
  float *v = static_cast<float *>(params[2]);
  const float *g = static_cast<const float *>(params[3]);
  const float *h = static_cast<const float *>(params[4]);
  const int64_t spans = (n + kAdamwSpan - 1) / kAdamwSpan;
  if (spans <= 1) {
    adamw_span(w, m, v, g, h, 0, n);
  } else {
    parallel_rows(spans, [&](int64_t lo, int64_t hi) {
      adamw_span(w, m, v, g, h, lo * kAdamwSpan, std::min(n, hi * kAdamwSpan));
    });
  }
  static_cast<float *>(params[5])[0] = 0.f;
  return 0;
}
