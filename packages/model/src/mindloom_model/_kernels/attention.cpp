// mindloom's causal document attention, forward and backward, as MindSpore AOT custom
// operators (see kernels.h for the signature and the pool).

#include "kernels.h"

namespace {

using namespace mindloom_kernels;

// ------------------------------------------------------------------------ attention
//
// q [B, S, H, Dk], k [B, S, KV, Dk], v [B, S, KV, Dv] (Dv may differ from Dk: MLA's
// value heads are narrower than its nope + rope query-key heads), seg [B or 1, S] int32,
// scale [1]: score = scale * q . k. Query i sees key j iff j <= i and seg[i] == seg[j].
// Query head h reads kv head h / (H / KV).
//
// FlashAttention-2's tiling: a block of BQ queries against tiles of BK keys. The forward
// keeps the block's output, running row maxima and row sums in L1 and rescales the output
// when a tile raises a row's maximum (the online softmax); the backward recomputes each
// tile's probabilities from the saved row log-sum-exp. Every product -- scores = Q K^T,
// O += P V, dP = dO V^T, dQ += dS K, dK += dS^T Q, dV += P^T dO -- is one small GEMM
// (`gemm`): an MR x NV register tile of accumulators, one load of a row of B feeding MR
// multiply-adds, written with GCC's vector types so that the AVX-512 clone holds a row of
// the tile in one register, the AVX2 clone in two and the baseline in four. Operands are
// copied once per task into zero-padded buffers (K^T and V, widths rounded up to NV), so
// the tiles need no edge cases; only a tile's scores (BQ x BK) exist at a time, never
// S x S, in either direction. Tasks: (batch, head) pairs forward, (batch, kv head) pairs
// backward (a task owns its kv head's dk and dv rows and its query heads' dq rows).

constexpr int64_t BQ = 16;  // query rows per block
constexpr int64_t BK = 16;  // keys per tile (two 8-float vectors: RowMask, the row loops)
constexpr int64_t MR = 4;   // rows of a register tile
constexpr int64_t NV = 16;  // columns of a register tile

// which of keys [j0, j0 + 16) query i sees: j <= i and the same document
struct RowMask {
  v8i lo, hi;
  RowMask(const int32_t *sgp, int64_t i, int64_t j0) {
    const v8i idx = {0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t last = static_cast<int32_t>(i - j0), si = sgp[i];
    lo = (idx <= last) & (*reinterpret_cast<const v8iu *>(sgp + j0) == si);
    hi = (idx + 8 <= last) & (*reinterpret_cast<const v8iu *>(sgp + j0 + 8) == si);
  }
};

struct AttnDims {
  int64_t b, s, h, kv, dk, dv, seg_b;
  float scale;
};

// the tensors of one call: forward q, k, v, seg -> o, lse; backward q, k, v, seg, o, lse,
// dout -> dq, dk, dv (o and lse are inputs there)
struct AttnArgs {
  const float *q, *k, *v;
  const int32_t *seg;
  float *o, *lse;
  const float *dout;
  float *dq, *dk, *dv;
  const float *cos, *sin;  // RoPE tables [B or 1, S, Dk], or null: q and k used as given
  int64_t rope_b;
  AttnDims a;
  std::atomic<int64_t> *next;
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// RoPE in Hugging Face's layout (rotate_half pairs element i with i + d/2):
// y = (x * cos + [-x2, x1] * sin) * mult, one row of d (even) elements
inline void rope_row(const float *x, const float *c, const float *s, int64_t d, float mult,
                     float *y) {
  const int64_t h = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    y[i] = (x[i] * c[i] - x[i + h] * s[i]) * mult;
    y[i + h] = (x[i + h] * c[i + h] + x[i] * s[i + h]) * mult;
  }
}

// its transpose (the backward of a rotation): dx = (g * cos + [g2 * sin2, -g1 * sin1]) * mult
inline void rope_row_t(const float *g, const float *c, const float *s, int64_t d, float mult,
                       float *dx) {
  const int64_t h = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    dx[i] = (g[i] * c[i] + g[i + h] * s[i + h]) * mult;
    dx[i + h] = (g[i + h] * c[i + h] - g[i] * s[i]) * mult;
  }
}

// one batch row's RoPE tables (row j of position j), or none
struct Rope {
  const float *c = nullptr, *s = nullptr;
  Rope() = default;
  Rope(const AttnArgs &a, int64_t bi) {
    if (a.cos == nullptr) return;
    const int64_t off = (a.rope_b == 1 ? 0 : bi) * a.a.s * a.a.dk;
    c = a.cos + off;
    s = a.sin + off;
  }
  // row j of x (width d) rotated into tmp, or x's own row without RoPE
  const float *row(const float *x, int64_t j, int64_t d, float *tmp) const {
    if (c == nullptr) return x;
    rope_row(x, c + j * d, s + j * d, d, 1.f, tmp);
    return tmp;
  }
};

// C[m][n] (+)= sum_k A(m, k) B[k][n] for m < M (a multiple of MR), n < N (a multiple of
// NV), k < K; A(m, k) = a[m * ars + k * aks] (so A may be read transposed), B and C
// row-major with leading dimensions ldb, ldc. The register tile is MR rows x two 8-float
// vectors: 8 accumulators, 2 loads of B and MR broadcasts of A per k.
__attribute__((always_inline)) inline void gemm(const float *a, int64_t ars, int64_t aks,
                                                const float *b, int64_t ldb, float *c,
                                                int64_t ldc, int64_t M, int64_t N, int64_t K,
                                                bool accumulate) {
  for (int64_t m0 = 0; m0 < M; m0 += MR) {
    const float *a0 = a + m0 * ars;
    for (int64_t n0 = 0; n0 < N; n0 += NV) {
      float *c0 = c + m0 * ldc + n0;
      v8 t00{}, t01{}, t10{}, t11{}, t20{}, t21{}, t30{}, t31{};
      if (accumulate) {
        t00 = load8(c0), t01 = load8(c0 + 8);
        t10 = load8(c0 + ldc), t11 = load8(c0 + ldc + 8);
        t20 = load8(c0 + 2 * ldc), t21 = load8(c0 + 2 * ldc + 8);
        t30 = load8(c0 + 3 * ldc), t31 = load8(c0 + 3 * ldc + 8);
      }
      const float *bk = b + n0, *ak = a0;
      for (int64_t k = 0; k < K; ++k, bk += ldb, ak += aks) {
        const v8 b0 = load8(bk), b1 = load8(bk + 8);
        const float x0 = ak[0], x1 = ak[ars], x2 = ak[2 * ars], x3 = ak[3 * ars];
        t00 += x0 * b0, t01 += x0 * b1;
        t10 += x1 * b0, t11 += x1 * b1;
        t20 += x2 * b0, t21 += x2 * b1;
        t30 += x3 * b0, t31 += x3 * b1;
      }
      store8(c0, t00), store8(c0 + 8, t01);
      store8(c0 + ldc, t10), store8(c0 + ldc + 8, t11);
      store8(c0 + 2 * ldc, t20), store8(c0 + 2 * ldc + 8, t21);
      store8(c0 + 3 * ldc, t30), store8(c0 + 3 * ldc + 8, t31);
    }
  }
}

// one query row for the tiles: RoPE'd (position i) when there are tables, times the
// softmax scale; zeros for the padding rows of a block (valid false)
inline void q_row(const float *x, const Rope &rope, int64_t i, bool valid, int64_t d,
                  float scale, float *y) {
  if (!valid) {
    std::fill(y, y + d, 0.f);
  } else if (rope.c != nullptr) {
    rope_row(x, rope.c + i * d, rope.s + i * d, d, scale, y);
  } else {
    for (int64_t k = 0; k < d; ++k) y[k] = x[k] * scale;
  }
}

// rows [0, s) of x (row stride `stride`, width d; RoPE applied when `rope` has tables)
// into xt [d, sp] transposed, zero padded
void transpose_in(const float *x, int64_t stride, int64_t s, int64_t d, int64_t sp, float *xt,
                  const Rope &rope = Rope(), float *tmp = nullptr) {
  std::fill(xt, xt + d * sp, 0.f);
  for (int64_t j = 0; j < s; ++j) {
    const float *xr = rope.row(x + j * stride, j, d, tmp);
    for (int64_t k = 0; k < d; ++k) xt[k * sp + j] = xr[k];
  }
}

// rows [0, s) of x (row stride `stride`, width d; RoPE as above) into xp [sp, dp], zero padded
void pad_in(const float *x, int64_t stride, int64_t s, int64_t d, int64_t sp, int64_t dp,
            float *xp, const Rope &rope = Rope(), float *tmp = nullptr) {
  std::fill(xp, xp + sp * dp, 0.f);
  for (int64_t j = 0; j < s; ++j)
    std::memcpy(xp + j * dp, rope.row(x + j * stride, j, d, tmp), sizeof(float) * d);
}

// One row's segment ids, padded to sp, and each query's first visible key (its
// document's first token; documents need not be runs of positions).
void doc_starts(const int32_t *sg, int64_t s, int64_t sp, int32_t *sgp, int64_t *start) {
  for (int64_t i = 0; i < sp; ++i) sgp[i] = i < s ? sg[i] : -1;  // padding: j > i masks it
  for (int64_t i = 0; i < s; ++i) {
    if (i > 0 && sg[i] == sg[i - 1]) {
      start[i] = start[i - 1];
    } else {
      int64_t j = 0;
      while (sg[j] != sg[i]) ++j;
      start[i] = j;
    }
  }
}

// the first key tile a query block [i0, i0 + nr) needs
inline int64_t first_tile(const int64_t *start, int64_t i0, int64_t nr) {
  int64_t lo = i0;
  for (int64_t r = 0; r < nr; ++r) lo = std::min(lo, start[i0 + r]);
  return lo / BK * BK;
}

// one thread's share: (batch, head) tasks taken from `next` until none is left
__attribute__((always_inline)) inline void attn_fwd_body(const AttnArgs &c) {
  const float *q = c.q, *k = c.k, *v = c.v;
  const int32_t *seg = c.seg;
  float *o = c.o, *lse = c.lse;
  const AttnDims a = c.a;
  std::atomic<int64_t> *next = c.next;
  const int64_t rep = a.h / a.kv, S = a.s, Dk = a.dk, Dv = a.dv;
  const int64_t Sp = round_up(S, BQ), Dvp = round_up(Dv, NV);
  const int64_t qstride = a.h * Dk, ostride = a.h * Dv;
  const int64_t kstride = a.kv * Dk, vstride = a.kv * Dv;
  std::vector<float> kt(static_cast<size_t>(Dk * Sp)), vp(static_cast<size_t>(Sp * Dvp));
  std::vector<float> qs(static_cast<size_t>(BQ * Dk)), sc(static_cast<size_t>(BQ * BK));
  std::vector<float> ob(static_cast<size_t>(BQ * Dvp));
  std::vector<int32_t> sgp(static_cast<size_t>(Sp));
  std::vector<int64_t> start(static_cast<size_t>(S));
  std::vector<float> tmp(static_cast<size_t>(Dk));
  int64_t have_b = -1, have_kv = -1;
  for (int64_t task; (task = next->fetch_add(1, std::memory_order_relaxed)) < a.b * a.h;) {
    const int64_t bi = task / a.h, hi = task % a.h, kvi = hi / rep;
    const Rope rope(c, bi);
    if (bi != have_b || kvi != have_kv) {  // consecutive heads of a group share K and V
      transpose_in(k + bi * S * kstride + kvi * Dk, kstride, S, Dk, Sp, kt.data(), rope,
                   tmp.data());
      pad_in(v + bi * S * vstride + kvi * Dv, vstride, S, Dv, Sp, Dvp, vp.data());
      doc_starts(seg + (a.seg_b == 1 ? 0 : bi * S), S, Sp, sgp.data(), start.data());
      have_b = bi;
      have_kv = kvi;
    }
    for (int64_t i0 = 0; i0 < S; i0 += BQ) {
      const int64_t nr = std::min(BQ, S - i0);
      // the scale goes on the queries (Dk products per row, not one per key)
      for (int64_t r = 0; r < BQ; ++r)
        q_row(r < nr ? q + (bi * S + i0 + r) * qstride + hi * Dk : q, rope, i0 + r, r < nr, Dk,
              a.scale, qs.data() + r * Dk);
      float m[BQ], l[BQ];
      std::fill(m, m + BQ, -INFINITY);
      std::fill(l, l + BQ, 0.f);
      std::fill(ob.begin(), ob.end(), 0.f);
      for (int64_t j0 = first_tile(start.data(), i0, nr); j0 < i0 + nr; j0 += BK) {
        gemm(qs.data(), Dk, 1, kt.data() + j0, Sp, sc.data(), BK, BQ, BK, Dk, false);
        for (int64_t r = 0; r < BQ; ++r) {
          float *sr = sc.data() + r * BK;
          if (r >= nr) {
            std::fill(sr, sr + BK, 0.f);
            continue;
          }
          const RowMask ok(sgp.data(), i0 + r, j0);
          const v8 ninf = v8{} - INFINITY;
          const v8 s0 = ok.lo ? load8(sr) : ninf, s1 = ok.hi ? load8(sr + 8) : ninf;
          const float mnew = std::max(m[r], hmax8(s0 > s1 ? s0 : s1));
          if (mnew == -INFINITY) {  // nothing visible to this row yet
            std::fill(sr, sr + BK, 0.f);
            continue;
          }
          const v8 p0 = ok.lo ? vexp8(s0 - mnew) : v8{}, p1 = ok.hi ? vexp8(s1 - mnew) : v8{};
          store8(sr, p0);
          store8(sr + 8, p1);
          // the online softmax: what was summed under the old maximum shrinks by alpha
          const float alpha = m[r] == -INFINITY ? 0.f : vexp(m[r] - mnew);
          l[r] = l[r] * alpha + hsum8(p0 + p1);
          m[r] = mnew;
          if (alpha != 1.f) {
            float *orow = ob.data() + r * Dvp;
            for (int64_t d = 0; d < Dvp; d += 8) store8(orow + d, load8(orow + d) * alpha);
          }
        }
        gemm(sc.data(), BK, 1, vp.data() + j0 * Dvp, Dvp, ob.data(), Dvp, BQ, Dvp, BK, true);
      }
      for (int64_t r = 0; r < nr; ++r) {
        float *oi = o + (bi * S + i0 + r) * ostride + hi * Dv;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < Dv; ++d) oi[d] = ob[r * Dvp + d] * inv;
        lse[(bi * a.h + hi) * S + i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

__attribute__((always_inline)) inline void attn_bwd_body(const AttnArgs &c) {
  const float *q = c.q, *k = c.k, *v = c.v, *o = c.o, *lse = c.lse, *dout = c.dout;
  const int32_t *seg = c.seg;
  float *dq = c.dq, *dk = c.dk, *dv = c.dv;
  const AttnDims a = c.a;
  std::atomic<int64_t> *next = c.next;
  const int64_t rep = a.h / a.kv, S = a.s, Dk = a.dk, Dv = a.dv;
  const int64_t Sp = round_up(S, BQ), Dkp = round_up(Dk, NV), Dvp = round_up(Dv, NV);
  const int64_t qstride = a.h * Dk, ostride = a.h * Dv;
  const int64_t kstride = a.kv * Dk, vstride = a.kv * Dv;
  std::vector<float> kt(static_cast<size_t>(Dk * Sp)), kp(static_cast<size_t>(Sp * Dkp));
  std::vector<float> vt(static_cast<size_t>(Dv * Sp));
  std::vector<float> dkp(static_cast<size_t>(Sp * Dkp)), dvp(static_cast<size_t>(Sp * Dvp));
  std::vector<float> qs(static_cast<size_t>(BQ * Dkp)), gb(static_cast<size_t>(BQ * Dvp));
  std::vector<float> dqb(static_cast<size_t>(BQ * Dkp));
  std::vector<float> p(static_cast<size_t>(BQ * BK)), ds(static_cast<size_t>(BQ * BK));
  std::vector<int32_t> sgp(static_cast<size_t>(Sp));
  std::vector<int64_t> start(static_cast<size_t>(S));
  std::vector<float> tmp(static_cast<size_t>(Dk));
  for (int64_t task; (task = next->fetch_add(1, std::memory_order_relaxed)) < a.b * a.kv;) {
    const int64_t bi = task / a.kv, kvi = task % a.kv;
    const Rope rope(c, bi);
    const float *kb = k + bi * S * kstride + kvi * Dk, *vb = v + bi * S * vstride + kvi * Dv;
    transpose_in(kb, kstride, S, Dk, Sp, kt.data(), rope, tmp.data());
    pad_in(kb, kstride, S, Dk, Sp, Dkp, kp.data(), rope, tmp.data());
    transpose_in(vb, vstride, S, Dv, Sp, vt.data());
    doc_starts(seg + (a.seg_b == 1 ? 0 : bi * S), S, Sp, sgp.data(), start.data());
    std::fill(dkp.begin(), dkp.end(), 0.f);
    std::fill(dvp.begin(), dvp.end(), 0.f);
    for (int64_t hi = kvi * rep; hi < (kvi + 1) * rep; ++hi) {
      for (int64_t i0 = 0; i0 < S; i0 += BQ) {
        const int64_t nr = std::min(BQ, S - i0);
        float l[BQ], di[BQ];
        std::fill(qs.begin(), qs.end(), 0.f);
        std::fill(gb.begin(), gb.end(), 0.f);
        std::fill(dqb.begin(), dqb.end(), 0.f);
        for (int64_t r = 0; r < BQ; ++r) {
          l[r] = di[r] = 0.f;
          if (r >= nr) continue;
          const float *qr = q + (bi * S + i0 + r) * qstride + hi * Dk;
          const float *gr = dout + (bi * S + i0 + r) * ostride + hi * Dv;
          const float *orow = o + (bi * S + i0 + r) * ostride + hi * Dv;
          q_row(qr, rope, i0 + r, true, Dk, a.scale, qs.data() + r * Dkp);
          float s = 0.f;
          for (int64_t d = 0; d < Dv; ++d) {
            gb[r * Dvp + d] = gr[d];
            s += gr[d] * orow[d];
          }
          di[r] = s;  // sum_j p_ij dp_ij = do_i . o_i
          l[r] = lse[(bi * a.h + hi) * S + i0 + r];
        }
        for (int64_t j0 = first_tile(start.data(), i0, nr); j0 < i0 + nr; j0 += BK) {
          gemm(qs.data(), Dkp, 1, kt.data() + j0, Sp, p.data(), BK, BQ, BK, Dk, false);
          gemm(gb.data(), Dvp, 1, vt.data() + j0, Sp, ds.data(), BK, BQ, BK, Dv, false);
          for (int64_t r = 0; r < BQ; ++r) {
            float *pr = p.data() + r * BK, *dr = ds.data() + r * BK;
            if (r >= nr) {
              std::fill(pr, pr + BK, 0.f);
              std::fill(dr, dr + BK, 0.f);
              continue;
            }
            const RowMask ok(sgp.data(), i0 + r, j0);
            const float lr = l[r], dr0 = di[r];
            // P again from the saved log-sum-exp, and dS = P (dP - D)
            const v8 p0 = ok.lo ? vexp8(load8(pr) - lr) : v8{};
            const v8 p1 = ok.hi ? vexp8(load8(pr + 8) - lr) : v8{};
            store8(pr, p0);
            store8(pr + 8, p1);
            store8(dr, p0 * (load8(dr) - dr0));
            store8(dr + 8, p1 * (load8(dr + 8) - dr0));
          }
          // score = scale q . k: dq = scale dS K, dk += dS^T (scale q), dv += P^T dO
          gemm(ds.data(), BK, 1, kp.data() + j0 * Dkp, Dkp, dqb.data(), Dkp, BQ, Dkp, BK, true);
          gemm(ds.data(), 1, BK, qs.data(), Dkp, dkp.data() + j0 * Dkp, Dkp, BK, Dkp, BQ, true);
          gemm(p.data(), 1, BK, gb.data(), Dvp, dvp.data() + j0 * Dvp, Dvp, BK, Dvp, BQ, true);
        }
        for (int64_t r = 0; r < nr; ++r) {
          float *dqr = dq + (bi * S + i0 + r) * qstride + hi * Dk;
          const float *g = dqb.data() + r * Dkp;
          if (rope.c != nullptr) {  // back through the rotation: its transpose
            const int64_t i = i0 + r;
            rope_row_t(g, rope.c + i * Dk, rope.s + i * Dk, Dk, a.scale, dqr);
          } else {
            for (int64_t d = 0; d < Dk; ++d) dqr[d] = g[d] * a.scale;
          }
        }
      }
    }
    for (int64_t j = 0; j < S; ++j) {
      float *dkr = dk + (bi * S + j) * kstride + kvi * Dk;
      if (rope.c != nullptr) {
        rope_row_t(dkp.data() + j * Dkp, rope.c + j * Dk, rope.s + j * Dk, Dk, 1.f, dkr);
      } else {
        std::memcpy(dkr, dkp.data() + j * Dkp, sizeof(float) * Dk);
      }
      std::memcpy(dv + (bi * S + j) * vstride + kvi * Dv, dvp.data() + j * Dvp, sizeof(float) * Dv);
    }
  }
}


// Each body compiled three times -- AVX-512, AVX2 + FMA, baseline x86-64 (SSE2) -- and
// picked once from the CPU. Not target_clones: its "avx2,fma" makes an AVX2 clone and an
// FMA clone, neither with both, and "arch=x86-64-v3" resolved to the baseline on the
// development machine's AMD EPYC. $MINDLOOM_KERNEL_ISA (avx512, avx2, base) forces one,
// so the tests can check the fallback on a machine that has the others.
using AttnFn = void (*)(const AttnArgs &);
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MINDLOOM_NO_CLONES)
#define MINDLOOM_VARIANTS(name)                                                              \
  __attribute__((target("avx512f,avx512vl,avx2,fma"))) void name##_avx512(const AttnArgs &c) { \
    name##_body(c);                                                                          \
  }                                                                                          \
  __attribute__((target("avx2,fma"))) void name##_avx2(const AttnArgs &c) { name##_body(c); } \
  void name##_base(const AttnArgs &c) { name##_body(c); }                                    \
  AttnFn pick_##name() {                                                                     \
    const Isa isa = best_isa();                                                              \
    return isa == Isa::avx512 ? name##_avx512 : isa == Isa::avx2 ? name##_avx2 : name##_base; \
  }
#else
#define MINDLOOM_VARIANTS(name)                          \
  void name##_base(const AttnArgs &c) { name##_body(c); } \
  AttnFn pick_##name() { return name##_base; }
#endif
MINDLOOM_VARIANTS(attn_fwd)
MINDLOOM_VARIANTS(attn_bwd)

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

// the RoPE tables cos, sin at params[5], params[6]: [B or 1, S, Dk] each, Dk even
bool rope_dims(int nparam, int *ndims, int64_t **shapes, const AttnDims &a, int64_t *rope_b) {
  if (nparam < 7 || a.dk % 2) return false;
  for (int i = 5; i < 7; ++i) {
    if (ndims[i] != 3 || shapes[i][1] != a.s || shapes[i][2] != a.dk) return false;
    if (shapes[i][0] != 1 && shapes[i][0] != a.b) return false;
  }
  *rope_b = shapes[5][0];
  return shapes[6][0] == *rope_b;
}

// the pointers every entry point shares: q, k, v, seg, (scale,) [cos, sin,] o, lse; `rope`
// says whether the tables are there (they shift o and lse by two)
AttnArgs attn_args(void **params, const AttnDims &a, std::atomic<int64_t> *next, bool rope) {
  AttnArgs c{};
  c.q = static_cast<float *>(params[0]);
  c.k = static_cast<float *>(params[1]);
  c.v = static_cast<float *>(params[2]);
  c.seg = static_cast<int32_t *>(params[3]);
  const int o = rope ? 7 : 5;
  if (rope) {
    c.cos = static_cast<float *>(params[5]);
    c.sin = static_cast<float *>(params[6]);
  }
  c.o = static_cast<float *>(params[o]);
  c.lse = static_cast<float *>(params[o + 1]);
  c.a = a;
  c.next = next;
  return c;
}

int attn_fwd_call(int nparam, void **params, int *ndims, int64_t **shapes, bool rope) {
  AttnDims a;
  int64_t rope_b = 1;
  if (nparam != (rope ? 9 : 7) || !attn_dims(nparam, params, ndims, shapes, &a)) return 1;
  if (rope && !rope_dims(nparam, ndims, shapes, a, &rope_b)) return 1;
  static const AttnFn fwd = pick_attn_fwd();
  std::atomic<int64_t> next{0};
  AttnArgs c = attn_args(params, a, &next, rope);
  c.rope_b = rope_b;
  Pool::get().run([&](int, int) { fwd(c); });
  return 0;
}

int attn_bwd_call(int nparam, void **params, int *ndims, int64_t **shapes, bool rope) {
  AttnDims a;
  int64_t rope_b = 1;
  if (nparam != (rope ? 13 : 11) || !attn_dims(nparam, params, ndims, shapes, &a)) return 1;
  if (rope && !rope_dims(nparam, ndims, shapes, a, &rope_b)) return 1;
  static const AttnFn bwd = pick_attn_bwd();
  std::atomic<int64_t> next{0};
  AttnArgs c = attn_args(params, a, &next, rope);
  c.rope_b = rope_b;
  const int g = rope ? 9 : 7;  // dout, then the outputs dq, dk, dv
  c.dout = static_cast<float *>(params[g]);
  c.dq = static_cast<float *>(params[g + 1]);
  c.dk = static_cast<float *>(params[g + 2]);
  c.dv = static_cast<float *>(params[g + 3]);
  Pool::get().run([&](int, int) { bwd(c); });
  return 0;
}

}  // namespace

//   -> o [B, S, H, Dv], lse [B, H, S]
EXPORT int mindloom_attn_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **, void *, void *) {
  return attn_fwd_call(nparam, params, ndims, shapes, false);
}

// q, k, v, seg, scale, o, lse, do -> dq, dk, dv
EXPORT int mindloom_attn_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **, void *, void *) {
  return attn_bwd_call(nparam, params, ndims, shapes, false);
}

// RoPE inside: q, k, v, seg, scale, cos, sin -> o, lse, with q and k rotated (Hugging
// Face's rotate_half; cos/sin [B or 1, S, Dk]) as they are copied into the tiles, so the
// model runs no RoPE ops of its own (forward: 7 ops per tensor; backward: more)
EXPORT int mindloom_attn_rope_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                  const char **, void *, void *) {
  return attn_fwd_call(nparam, params, ndims, shapes, true);
}

// q, k, v, seg, scale, cos, sin, o, lse, do -> dq, dk, dv (the gradients of the inputs
// before the rotation: each row's dq, dk goes back through the rotation's transpose)
EXPORT int mindloom_attn_rope_bwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                  const char **, void *, void *) {
  return attn_bwd_call(nparam, params, ndims, shapes, true);
}
