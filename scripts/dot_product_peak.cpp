// The bf16 dot-product peak of this CPU: a tight vdpbf16ps loop, 12 independent accumulators
// a thread (more than its latency times its rate), and the float32 FMA peak the same way.
// FLOPs: vdpbf16ps on zmm = 16 lanes x 2 products x (mul + add) = 64; vfmadd = 32.
//
//     g++ -O3 -fopenmp -mavx512f -mavx512bf16 scripts/dot_product_peak.cpp -o /tmp/peak && /tmp/peak
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <vector>
constexpr int A = 12;
template <bool BF16>
double run(long iters, int threads) {
  auto t0 = std::chrono::steady_clock::now();
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 acc[A];
    for (int i = 0; i < A; ++i) acc[i] = _mm512_set1_ps(omp_get_thread_num() * 1e-9f + i);
    const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
    const __m512bh ab = (__m512bh)_mm512_set1_epi32(0x3f803f80), bb = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < A; ++i) {
        if constexpr (BF16) acc[i] = _mm512_dpbf16_ps(acc[i], ab, bb);
        else acc[i] = _mm512_fmadd_ps(acc[i], a, b);
      }
    }
    __m512 s = acc[0];
    for (int i = 1; i < A; ++i) s = _mm512_add_ps(s, acc[i]);
    sink += _mm512_reduce_add_ps(s);
  }
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink == 12345.f) std::puts("");
  return double(iters) * A * threads * (BF16 ? 64 : 32) / sec / 1e9;
}
int main() {
  for (int threads : {1, 2}) {
    std::vector<double> bf, fp;
    for (int r = 0; r < 7; ++r) { bf.push_back(run<true>(100000000 / 4, threads)); fp.push_back(run<false>(100000000 / 4, threads)); }
    std::sort(bf.begin(), bf.end()); std::sort(fp.begin(), fp.end());
    std::printf("%d thread(s): vdpbf16ps median %.1f best %.1f GFLOP/s; fp32 FMA median %.1f best %.1f GFLOP/s\n",
                threads, bf[3], bf[6], fp[3], fp[6]);
  }
}
