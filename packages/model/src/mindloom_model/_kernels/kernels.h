// What mindloom's kernel sources share: the includes, the build macros, the library's
// thread pool and the vectorisable exp. A named namespace, not an anonymous one: every
// source of the library must see the same single Pool.
//
// Every entry point has MindSpore's AOT signature:
//   extern "C" int f(int nparam, void **params, int *ndims, int64_t **shapes,
//                    const char **dtypes, void *stream, void *extra);
// params holds the inputs, then the outputs; all tensors are contiguous fp32 except the
// int32 labels and segment ids. A non-zero return makes MindSpore raise.
//
// Why a pool of the library's own and not OpenMP's threads: libgomp's workers spin for
// ~300k iterations after each parallel region by default, and a training step calls these
// kernels ~90 times between MindSpore's own ops, so the spinning worker took a core from
// MindSpore's thread pool for the op that came next (kernels 0.67x the portable step under
// default settings, 1.51x with OMP_WAIT_POLICY=PASSIVE, which slows every other OpenMP
// user of the process). The pool's workers spin a few microseconds, then sleep on a
// condition variable. `#pragma omp simd` only marks loops to vectorise (-fopenmp-simd:
// no OpenMP runtime, no OpenMP threads).

#pragma once
#pragma GCC diagnostic ignored "-Wpsabi"  // 8-float vectors stay inside always-inlined code

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
#include <string>
#include <thread>
#include <vector>

// The memory-bound loops (norms, SwiGLU, loss): GCC clones for AVX-512, AVX2 and the
// baseline. (A clone string "avx2,fma" makes two clones, AVX2 and FMA, neither with both;
// the attention's GEMMs need both and dispatch by hand, attention.cpp.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MINDLOOM_NO_CLONES)
#define MINDLOOM_SIMD __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MINDLOOM_SIMD
#endif

#define EXPORT extern "C" __attribute__((visibility("default")))

namespace mindloom_kernels {

inline int64_t numel(int nd, const int64_t *shape) {
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
inline int pool_threads() {
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

// Which build of a hand-dispatched body (attention.cpp, experts.cpp) runs: the best
// instruction set the CPU has, or the one $MINDLOOM_KERNEL_ISA (avx512, avx2, base) names
// when the CPU has it, so the tests can check every build on one machine.
enum class Isa { base, avx2, avx512 };

inline Isa best_isa() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(MINDLOOM_NO_CLONES)
  __builtin_cpu_init();
  const char *want = std::getenv("MINDLOOM_KERNEL_ISA");
  const std::string w = want != nullptr ? want : "";
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && (w.empty() || w == "avx512")) return Isa::avx512;
  if (avx2 && (w.empty() || w == "avx512" || w == "avx2")) return Isa::avx2;
#endif
  return Isa::base;
}

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

// exp(x) / 2^n for x = n ln2 + r, |r| <= ln2/2: Cephes' polynomial in r (ln2 split in two
// for the reduction). One definition for a float and for 8 lanes (vexp, vexp8).
template <class T>
__attribute__((always_inline)) inline T exp_reduced(T x, T n) {
  const T r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}

// exp(x) in fp32 to ~2 ulp, written so loops over it vectorise (the libm call does not
// without -ffast-math): 2^n * p(r), x = n ln2 + r, |r| <= ln2/2 (Cephes' polynomial).
inline float vexp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float p = exp_reduced(x, n);
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof bits);
  return p;
}
// 8-float vectors (GCC's vector extension: one AVX register, two SSE ones), for loops the
// compiler does not vectorise by itself
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads/stores
__attribute__((always_inline)) inline v8 load8(const float *p) {
  return *reinterpret_cast<const v8u *>(p);
}
__attribute__((always_inline)) inline void store8(float *p, v8 x) {
  *reinterpret_cast<v8u *>(p) = x;
}
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v8iu __attribute__((vector_size(32), aligned(4)));

// vexp on 8 lanes, the same range reduction and polynomial (adding 1.5 * 2^23 rounds to the
// nearest integer). GCC does not vectorise loops over the scalar one (its clamps become
// branches): SwiGLU ran it one element at a time, ~3 ms for the recipe's 768 x 344.
__attribute__((always_inline)) inline v8 vexp8(v8 x) {
  x = x < -87.3f ? v8{} - 87.3f : x;
  x = x > 88.7f ? v8{} + 88.7f : x;
  const float big = 12582912.f;
  const v8 n = (x * 1.44269504088896341f + big) - big;
  v8 p = exp_reduced(x, n);
  const v8i bits = reinterpret_cast<v8i &>(p) + (__builtin_convertvector(n, v8i) << 23);
  return reinterpret_cast<const v8 &>(bits);
}

__attribute__((always_inline)) inline float hmax8(const v8 &x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, x[i]);
  return m;
}

__attribute__((always_inline)) inline float hsum8(const v8 &x) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += x[i];
  return s;
}

}  // namespace mindloom_kernels
