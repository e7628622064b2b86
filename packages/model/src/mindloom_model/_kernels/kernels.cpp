// mindloom's fused CPU kernels, called by MindSpore as AOT custom operators.
//
// Every entry point has MindSpore's AOT signature:
//   extern "C" int f(int nparam, void **params, int *ndims, int64_t **shapes,
//                    const char **dtypes, void *stream, void *extra);
// params holds the inputs, then the outputs; all tensors are contiguous fp32 except the
// int32 labels and segment ids. A non-zero return makes MindSpore raise.
//
// Vector paths: the hot loops are plain loops the compiler vectorises; `MINDLOOM_SIMD`
// builds an AVX-512, an AVX2 and a baseline copy of each and the loader picks one at run
// time from the CPU (GCC function multiversioning), so one library runs on any x86-64.
// A small thread pool of the library's own (`Pool`) spreads rows (norms, loss) or (batch,
// head) pairs (attention) over the threads; `#pragma omp simd` only marks loops to
// vectorise (-fopenmp-simd: no OpenMP runtime, no OpenMP threads).
//
// Why not OpenMP's threads: libgomp's workers spin for ~300k iterations after each
// parallel region by default, and a training step calls these kernels ~90 times between
// MindSpore's own ops, so the spinning worker took a core from MindSpore's thread pool for
// the op that came next (kernels 0.67x the portable step under default settings, 1.51x
// with OMP_WAIT_POLICY=PASSIVE, which slows every other OpenMP user of the process). The
// pool's workers spin a few microseconds, then sleep on a condition variable.

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MINDLOOM_NO_CLONES)
#define MINDLOOM_SIMD __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define MINDLOOM_SIMD
#endif

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace {

int64_t numel(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= shape[i];
  return n;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The threads a kernel runs on: $MINDLOOM_KERNEL_THREADS, else the CPUs this process may
// run on (what libgomp chose for the OpenMP build). Not $OMP_NUM_THREADS: importing
// MindSpore setenv()s it to 1 for its own use (libgomp had read it before then).
int pool_threads() {
  const char *v = std::getenv("MINDLOOM_KERNEL_THREADS");
  if (v != nullptr && std::atoi(v) > 0) return std::min(std::atoi(v), 256);
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// f(t, nt) on nt threads, t = 0 being the caller. Workers spin ~kSpin pauses for the next
// job (kernels often come back to back), then sleep. A call made while another kernel
// holds the pool (MindSpore may run independent ops at once) runs alone in its thread as
// f(0, 1): every kernel below is correct for any nt.
class Pool {
 public:
  using Job = std::function<void(int, int)>;

  // Never destroyed: its threads sleep through exit. A child forked after the pool started
  // has none of its threads: it starts a pool of its own at its first kernel.
  static Pool &get() {
    Pool *p = instance().load(std::memory_order_acquire);
    if (p != nullptr) return *p;
    static std::mutex create_mu;
    std::lock_guard<std::mutex> lk(create_mu);
    p = instance().load(std::memory_order_acquire);
    if (p == nullptr) {
      static bool registered = false;
      if (!registered) {
        pthread_atfork(nullptr, nullptr, [] { instance().store(nullptr); });
        registered = true;
      }
      p = new Pool();
      instance().store(p, std::memory_order_release);
    }
    return *p;
  }

  int size() const { return n_; }

  void run(const Job &f) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || n_ == 1) {
      f(0, 1);
      return;
    }
    job_ = &f;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    f(0, n_);
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < kSpin) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpin = 4000;  // ~10-40 us of pause instructions

  static std::atomic<Pool *> &instance() {
    static std::atomic<Pool *> p{nullptr};
    return p;
  }

  Pool() : n_(pool_threads()) {
    for (int t = 1; t < n_; ++t) std::thread([this, t] { loop(t); }).detach();
  }

  void loop(int t) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = gen_.load(std::memory_order_acquire);
      for (int spins = 0; g == seen && spins < kSpin; ++spins) {
        cpu_relax();
        g = gen_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        g = gen_.load(std::memory_order_acquire);
      }
      seen = g;
      (*job_)(t, n_);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int n_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  const Job *job_ = nullptr;
};

// rows [lo, hi) of n for thread t of nt, contiguous and balanced
inline void chunk(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
  const int64_t q = n / nt, r = n % nt;
  *lo = t * q + std::min<int64_t>(t, r);
  *hi = *lo + q + (t < r ? 1 : 0);
}

// rows of n spread over the pool: body(lo, hi) for each thread's contiguous block
template <class Body>
void parallel_rows(int64_t n, Body body) {
  Pool::get().run([&](int t, int nt) {
    int64_t lo, hi;
    chunk(n, t, nt, &lo, &hi);
    if (lo < hi) body(lo, hi);
  });
}

// exp(x) in fp32 to ~2 ulp, written so loops over it vectorise (the libm call does not
// without -ffast-math): 2^n * p(r), x = n ln2 + r, |r| <= ln2/2 (Cephes' polynomial).
inline float vexp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof bits);
  return p;
}

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
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] / (1.f + vexp(-a[i])) * b[i];
}

MINDLOOM_SIMD void swiglu_bwd_flat(const float *a, const float *b, const float *dy, float *da,
                                   float *db, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
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
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < v; ++j) s += vexp(xr[j] - m);
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
#pragma omp simd
    for (int64_t j = 0; j < v; ++j) dr[j] = gr * vexp(xr[j] - l);
    const int64_t y = std::min<int64_t>(std::max<int32_t>(labels[r], 0), v - 1);
    dr[y] -= gr;
  }
}

// ------------------------------------------------------------------------ attention
//
// q [B, S, H, Dk], k [B, S, KV, Dk], v [B, S, KV, Dv] (Dv may differ from Dk: MLA's
// value heads are narrower than its nope + rope query-key heads), seg [B or 1, S] int32,
// scale [1]: score = scale * q . k. Query i sees key j iff j <= i and seg[i] == seg[j].
// Query head h reads kv head h / (H / KV). Each (batch, head) is one task (the backward:
// each (batch, kv head)); its keys and values are copied transposed ([D, Sp], Sp = S
// rounded up to a tile, zero padded) and the queries go RB = 4 rows at a time: a query
// block's scores are a register tile of RB x JT (one load of a key column feeds RB
// multiply-adds), the probabilities times the values are RB dot products per value
// column, the key/value gradients RB-row updates of the transposed accumulators. Only
// RB rows of S scores exist at a time, in either direction.

constexpr int RB = 4;    // query rows per block
constexpr int JT = 16;   // key columns per register tile

struct AttnDims {
  int64_t b, s, h, kv, dk, dv, seg_b;
  float scale;
};

int64_t padded(int64_t s) { return (s + JT - 1) / JT * JT; }

// out[r][j] = sum_k a[r][k] t[k][j] for j in the tiles covering [j0, j1); a [RB, d], t [d, sp]
MINDLOOM_SIMD void tile_scores(const float *a, const float *t, float *out, int64_t j0,
                               int64_t j1, int64_t sp, int64_t d) {
  for (int64_t jc = j0 / JT * JT; jc < j1; jc += JT) {
    float acc0[JT] = {}, acc1[JT] = {}, acc2[JT] = {}, acc3[JT] = {};
    for (int64_t k = 0; k < d; ++k) {
      const float *tk = t + k * sp + jc;
      const float a0 = a[k], a1 = a[d + k], a2 = a[2 * d + k], a3 = a[3 * d + k];
#pragma omp simd
      for (int jj = 0; jj < JT; ++jj) {
        const float tv = tk[jj];
        acc0[jj] += a0 * tv;
        acc1[jj] += a1 * tv;
        acc2[jj] += a2 * tv;
        acc3[jj] += a3 * tv;
      }
    }
    for (int jj = 0; jj < JT; ++jj) {
      out[jc + jj] = acc0[jj];
      out[sp + jc + jj] = acc1[jj];
      out[2 * sp + jc + jj] = acc2[jj];
      out[3 * sp + jc + jj] = acc3[jj];
    }
  }
}

// out[r][k] = mult * sum_{j in [j0, j1)} w[r][j] t[k][j]; w [RB, sp], t [d, sp], out [RB, d]
MINDLOOM_SIMD void tile_dots(const float *w, const float *t, float *out, int64_t j0, int64_t j1,
                             int64_t sp, int64_t d, float mult) {
  const float *w0 = w, *w1 = w + sp, *w2 = w + 2 * sp, *w3 = w + 3 * sp;
  for (int64_t k = 0; k < d; ++k) {
    const float *tk = t + k * sp;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t j = j0; j < j1; ++j) {
      const float tv = tk[j];
      s0 += w0[j] * tv;
      s1 += w1[j] * tv;
      s2 += w2[j] * tv;
      s3 += w3[j] * tv;
    }
    out[k] = s0 * mult;
    out[d + k] = s1 * mult;
    out[2 * d + k] = s2 * mult;
    out[3 * d + k] = s3 * mult;
  }
}

// t[k][j] += sum_r a[r][k] w[r][j] for j in [j0, j1); a [RB, d], w [RB, sp], t [d, sp]
MINDLOOM_SIMD void tile_update(const float *a, const float *w, float *t, int64_t j0, int64_t j1,
                               int64_t sp, int64_t d) {
  const float *w0 = w, *w1 = w + sp, *w2 = w + 2 * sp, *w3 = w + 3 * sp;
  for (int64_t k = 0; k < d; ++k) {
    float *tk = t + k * sp;
    const float a0 = a[k], a1 = a[d + k], a2 = a[2 * d + k], a3 = a[3 * d + k];
#pragma omp simd
    for (int64_t j = j0; j < j1; ++j) tk[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
  }
}

// the first key query i may see: its document's first token (documents need not be runs)
int64_t first_key(const int32_t *sg, int64_t i) {
  int64_t j = 0;
  while (sg[j] != sg[i]) ++j;
  return j;
}

// copy x's rows [S, stride] at column offset `off` (width d) into xt [d, sp], transposed
void transpose_in(const float *x, int64_t stride, int64_t s, int64_t d, int64_t sp, float *xt) {
  std::fill(xt, xt + d * sp, 0.f);
  for (int64_t j = 0; j < s; ++j)
    for (int64_t k = 0; k < d; ++k) xt[k * sp + j] = x[j * stride + k];
}

// the rows of query block i0 (nr <= RB of them): the key range [j0, j1) any of them sees
void block_range(const int32_t *sg, int64_t i0, int64_t nr, int64_t *j0, int64_t *j1) {
  int64_t lo = i0;
  for (int64_t r = 0; r < nr; ++r) lo = std::min(lo, first_key(sg, i0 + r));
  *j0 = lo;
  *j1 = i0 + nr;
}

// p[r][j] <- allowed(r, j) ? exp(p[r][j] - sub[r]) : 0 over [j0, j1); rows nr..RB-1 zeroed
MINDLOOM_SIMD void masked_exp(float *p, const float *sub, const int32_t *sg, int64_t i0,
                              int64_t nr, int64_t j0, int64_t j1, int64_t sp) {
  for (int64_t r = 0; r < RB; ++r) {
    float *pr = p + r * sp;
    if (r >= nr) {
      std::fill(pr + j0, pr + j1, 0.f);
      continue;
    }
    const int64_t i = i0 + r;
    const int32_t si = sg[i];
    const float m = sub[r];
#pragma omp simd
    for (int64_t j = j0; j < j1; ++j) {
      const bool ok = j <= i && sg[j] == si;
      pr[j] = ok ? vexp(pr[j] - m) : 0.f;
    }
  }
}

// one thread's share: (batch, head) tasks taken from `next` until none is left
MINDLOOM_SIMD void attn_fwd_worker(const float *q, const float *k, const float *v,
                                   const int32_t *seg, float *o, float *lse, AttnDims a,
                                   std::atomic<int64_t> *next) {
  const int64_t rep = a.h / a.kv, S = a.s, Dk = a.dk, Dv = a.dv, Sp = padded(a.s);
  const int64_t qstride = a.h * Dk, ostride = a.h * Dv;
  const int64_t kstride = a.kv * Dk, vstride = a.kv * Dv;
  {
    std::vector<float> kt(static_cast<size_t>(Dk * Sp)), vt(static_cast<size_t>(Dv * Sp));
    std::vector<float> p(static_cast<size_t>(RB * Sp)), qs(static_cast<size_t>(RB * Dk));
    std::vector<float> ob(static_cast<size_t>(RB * Dv));
    for (int64_t task; (task = next->fetch_add(1, std::memory_order_relaxed)) < a.b * a.h;) {
      const int64_t bi = task / a.h, hi = task % a.h, kvi = hi / rep;
      const int32_t *sg = seg + (a.seg_b == 1 ? 0 : bi * S);
      transpose_in(k + bi * S * kstride + kvi * Dk, kstride, S, Dk, Sp, kt.data());
      transpose_in(v + bi * S * vstride + kvi * Dv, vstride, S, Dv, Sp, vt.data());
      for (int64_t i0 = 0; i0 < S; i0 += RB) {
        const int64_t nr = std::min<int64_t>(RB, S - i0);
        // the scale goes on the queries (Dk products per row, not one per key)
        for (int64_t r = 0; r < RB; ++r)
          for (int64_t d = 0; d < Dk; ++d)
            qs[r * Dk + d] = r < nr ? q[(bi * S + i0 + r) * qstride + hi * Dk + d] * a.scale : 0.f;
        int64_t j0, j1;
        block_range(sg, i0, nr, &j0, &j1);
        tile_scores(qs.data(), kt.data(), p.data(), j0, j1, Sp, Dk);
        float m[RB], inv[RB];
        for (int64_t r = 0; r < RB; ++r) {
          m[r] = 0.f;
          if (r >= nr) continue;
          const int64_t i = i0 + r;
          float mx = -INFINITY;
          for (int64_t j = j0; j <= i; ++j)
            if (sg[j] == sg[i]) mx = std::max(mx, p[r * Sp + j]);
          m[r] = mx;
        }
        masked_exp(p.data(), m, sg, i0, nr, j0, j1, Sp);
        for (int64_t r = 0; r < nr; ++r) {
          const float *pr = p.data() + r * Sp;
          float l = 0.f;
#pragma omp simd reduction(+ : l)
          for (int64_t j = j0; j < j1; ++j) l += pr[j];
          inv[r] = 1.f / l;
          lse[(bi * a.h + hi) * S + i0 + r] = m[r] + std::log(l);
        }
        tile_dots(p.data(), vt.data(), ob.data(), j0, j1, Sp, Dv, 1.f);
        for (int64_t r = 0; r < nr; ++r) {
          float *oi = o + (bi * S + i0 + r) * ostride + hi * Dv;
          for (int64_t d = 0; d < Dv; ++d) oi[d] = ob[r * Dv + d] * inv[r];
        }
      }
    }
  }
}

MINDLOOM_SIMD void attn_bwd_worker(const float *q, const float *k, const float *v,
                                   const int32_t *seg, const float *o, const float *lse,
                                   const float *dout, float *dq, float *dk, float *dv,
                                   AttnDims a, std::atomic<int64_t> *next) {
  const int64_t rep = a.h / a.kv, S = a.s, Dk = a.dk, Dv = a.dv, Sp = padded(a.s);
  const int64_t qstride = a.h * Dk, ostride = a.h * Dv;
  const int64_t kstride = a.kv * Dk, vstride = a.kv * Dv;
  {
    std::vector<float> kt(static_cast<size_t>(Dk * Sp)), vt(static_cast<size_t>(Dv * Sp));
    std::vector<float> dkt(static_cast<size_t>(Dk * Sp)), dvt(static_cast<size_t>(Dv * Sp));
    std::vector<float> p(static_cast<size_t>(RB * Sp)), dp(static_cast<size_t>(RB * Sp));
    std::vector<float> qs(static_cast<size_t>(RB * Dk)), gb(static_cast<size_t>(RB * Dv));
    std::vector<float> dqb(static_cast<size_t>(RB * Dk));
    // one task per (batch, kv head): it owns that head's dk and dv rows
    for (int64_t task; (task = next->fetch_add(1, std::memory_order_relaxed)) < a.b * a.kv;) {
      const int64_t bi = task / a.kv, kvi = task % a.kv;
      const int32_t *sg = seg + (a.seg_b == 1 ? 0 : bi * S);
      transpose_in(k + bi * S * kstride + kvi * Dk, kstride, S, Dk, Sp, kt.data());
      transpose_in(v + bi * S * vstride + kvi * Dv, vstride, S, Dv, Sp, vt.data());
      std::fill(dkt.begin(), dkt.end(), 0.f);
      std::fill(dvt.begin(), dvt.end(), 0.f);
      for (int64_t hi = kvi * rep; hi < (kvi + 1) * rep; ++hi) {
        for (int64_t i0 = 0; i0 < S; i0 += RB) {
          const int64_t nr = std::min<int64_t>(RB, S - i0);
          float l[RB], di[RB];
          for (int64_t r = 0; r < RB; ++r) {
            const bool in = r < nr;
            const int64_t qrow = (bi * S + i0 + r) * qstride + hi * Dk;
            const int64_t orow = (bi * S + i0 + r) * ostride + hi * Dv;
            for (int64_t d = 0; d < Dk; ++d) qs[r * Dk + d] = in ? q[qrow + d] * a.scale : 0.f;
            float s = 0.f;
            for (int64_t d = 0; d < Dv; ++d) {
              gb[r * Dv + d] = in ? dout[orow + d] : 0.f;
              s += in ? dout[orow + d] * o[orow + d] : 0.f;
            }
            di[r] = s;  // sum_j p_ij dp_ij = do_i . o_i
            l[r] = in ? lse[(bi * a.h + hi) * S + i0 + r] : 0.f;
          }
          int64_t j0, j1;
          block_range(sg, i0, nr, &j0, &j1);
          tile_scores(qs.data(), kt.data(), p.data(), j0, j1, Sp, Dk);
          masked_exp(p.data(), l, sg, i0, nr, j0, j1, Sp);  // the probabilities again
          tile_scores(gb.data(), vt.data(), dp.data(), j0, j1, Sp, Dv);  // do_i . v_j
          for (int64_t r = 0; r < RB; ++r) {
            const float *pr = p.data() + r * Sp;
            float *dr = dp.data() + r * Sp;
            const float dr0 = di[r];
#pragma omp simd
            for (int64_t j = j0; j < j1; ++j) dr[j] = pr[j] * (dr[j] - dr0);  // d score
          }
          // score = scale q . k: dq = scale * ds k, dk += ds (scale q), dv += p do
          tile_dots(dp.data(), kt.data(), dqb.data(), j0, j1, Sp, Dk, a.scale);
          tile_update(qs.data(), dp.data(), dkt.data(), j0, j1, Sp, Dk);
          tile_update(gb.data(), p.data(), dvt.data(), j0, j1, Sp, Dv);
          for (int64_t r = 0; r < nr; ++r)
            std::memcpy(dq + (bi * S + i0 + r) * qstride + hi * Dk, dqb.data() + r * Dk,
                        sizeof(float) * Dk);
        }
      }
      for (int64_t j = 0; j < S; ++j) {
        float *dkj = dk + bi * S * kstride + j * kstride + kvi * Dk;
        float *dvj = dv + bi * S * vstride + j * vstride + kvi * Dv;
        for (int64_t d = 0; d < Dk; ++d) dkj[d] = dkt[d * Sp + j];
        for (int64_t d = 0; d < Dv; ++d) dvj[d] = dvt[d * Sp + j];
      }
    }
  }
}

// q, k, v, seg, scale: the inputs every attention entry point starts with
bool attn_dims(int nparam, void **params, int *ndims, int64_t **shapes, AttnDims *a) {
  if (nparam < 5 || ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 2)
    return false;
  a->b = shapes[0][0];
  a->s = shapes[0][1];
  a->h = shapes[0][2];
  a->dk = shapes[0][3];
  a->kv = shapes[1][2];
  a->dv = shapes[2][3];
  a->seg_b = shapes[3][0];
  if (numel(ndims[4], shapes[4]) != 1) return false;
  a->scale = static_cast<float *>(params[4])[0];
  if (a->kv <= 0 || a->h % a->kv || shapes[1][0] != a->b || shapes[1][1] != a->s ||
      shapes[1][3] != a->dk)
    return false;
  if (shapes[2][0] != a->b || shapes[2][1] != a->s || shapes[2][2] != a->kv) return false;
  return shapes[3][1] == a->s && (a->seg_b == 1 || a->seg_b == a->b);
}

}  // namespace

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

// q [B, S, H, Dk], k [B, S, KV, Dk], v [B, S, KV, Dv], seg [B|1, S], scale [1]
//   -> o [B, S, H, Dv], lse [B, H, S]
EXPORT int mindloom_attn_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **, void *, void *) {
  AttnDims a;
  if (nparam != 7 || !attn_dims(nparam, params, ndims, shapes, &a)) return 1;
  std::atomic<int64_t> next{0};
  Pool::get().run([&](int, int) {
    attn_fwd_worker(static_cast<float *>(params[0]), static_cast<float *>(params[1]),
                    static_cast<float *>(params[2]), static_cast<int32_t *>(params[3]),
                    static_cast<float *>(params[5]), static_cast<float *>(params[6]), a, &next);
  });
  return 0;
}

// q, k, v, seg, scale, o, lse, do -> dq, dk, dv
EXPORT int mindloom_attn_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **, void *, void *) {
  AttnDims a;
  if (nparam != 11 || !attn_dims(nparam, params, ndims, shapes, &a)) return 1;
  std::atomic<int64_t> next{0};
  Pool::get().run([&](int, int) {
    attn_bwd_worker(static_cast<float *>(params[0]), static_cast<float *>(params[1]),
                    static_cast<float *>(params[2]), static_cast<int32_t *>(params[3]),
                    static_cast<float *>(params[5]), static_cast<float *>(params[6]),
                    static_cast<float *>(params[7]), static_cast<float *>(params[8]),
                    static_cast<float *>(params[9]), static_cast<float *>(params[10]), a, &next);
  });
  return 0;
}
