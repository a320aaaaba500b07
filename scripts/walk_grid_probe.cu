// walk_grid_probe.cu — the device walk of copy_rows (torch_ext/include/kvlayout/
// copy_rows_kernel.h, the same code the library's kernel runs) timed alone on
// the bench's gather geometries at small T, under different grids, CTA sizes
// and loads in flight, beside a one-row-per-CTA kernel of the kind the peers
// use. For choosing the device variant's launch shape; not part of the
// library. Every variant's output is compared with the library-shaped one.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I torch_ext/include scripts/walk_grid_probe.cu -o /tmp/walk_grid_probe
//   /tmp/walk_grid_probe [reps]
//
// Per case and variant: the median kernel time over `reps` launches (CUDA
// events around one launch, L2 flushed by a read before each), the grid, and
// the registers of the compiled kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvlayout/copy_rows_kernel.h"

using namespace kvlayout;

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

constexpr int kSegs = 128;
using Params = CopyRowsParams<kSegs>;

struct Streaming16 {
  using vec_type = uint4;
  __device__ static vec_type load(const vec_type* p) { return __ldcs(p); }
  __device__ static void store(vec_type* p, vec_type v) { __stcs(p, v); }
};

struct NoRecord {
  __device__ void operator()(int64_t, int64_t, int64_t, int64_t) const {}
};

// The library kernel's body (segment table into shared memory, then the walk).
template <int UNROLL, int THREADS, int MIN_CTAS>
__global__ void __launch_bounds__(THREADS, MIN_CTAS) walk_kernel(const __grid_constant__ Params p) {
  __shared__ const char* src_base[kSegs];
  __shared__ char* dst_base[kSegs];
  for (int64_t j = threadIdx.x; j < p.a.num_segments; j += blockDim.x) {
    src_base[j] = p.src_base[j];
    dst_base[j] = p.dst_base[j];
  }
  __syncthreads();
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_threads = int64_t(gridDim.x) * blockDim.x;
  copy_rows_walk<16, UNROLL, Streaming16>(p.a, src_base, dst_base, thread, num_threads, NoRecord{});
}

// One (token, segment) row per CTA, 16-byte vectors strided by the CTA's threads.
__global__ void __launch_bounds__(128) row_per_cta_kernel(const __grid_constant__ Params p) {
  const int64_t t = blockIdx.x, seg = blockIdx.y;
  const int64_t s = p.a.src_slots.load(t), d = p.a.dst_slots.load(t);
  if (s < 0 || d < 0) return;
  const char* src = p.src_base[seg] + row_offset(p.a.src_geom, p.a.src_by_page, s);
  char* dst = p.dst_base[seg] + row_offset(p.a.dst_geom, p.a.dst_by_page, d);
  for (int64_t v = threadIdx.x; v < p.a.vecs_per_row; v += blockDim.x)
    Streaming16::store(reinterpret_cast<uint4*>(dst) + v, Streaming16::load(reinterpret_cast<const uint4*>(src) + v));
}

__global__ void flush_kernel(const int4* buf, int64_t n, int* sink) {
  int acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc ^= buf[i].x;
  if (acc == 0x12345678) *sink = acc;
}

struct Case {
  const char* name;
  int layers, planes, row_bytes, T;
};

struct Variant {
  std::string name;
  void (*kernel)(Params);
  int threads;
  int unroll;
  int waves;  // 0: items / (threads * unroll) CTAs (each thread one batch); else waves x resident CTAs
};

template <int U, int TH, int MB>
Variant variant(const char* name, int waves) {
  return Variant{name, walk_kernel<U, TH, MB>, TH, U, waves};
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs, L2 %d MiB\n", prop.name, sms, prop.l2CacheSize >> 20);

  // bench shapes, vLLM paged cache (page size 16) -> LMCache chunk, all layers
  const Case cases[] = {
      {"L32_H1_D128", 32, 2, 256, 256},   {"L32_H8_D128", 32, 2, 2048, 256},
      {"L32_MLA_D576", 32, 1, 1152, 256}, {"L61_MLA_D576", 61, 1, 1152, 256},
      {"L32_H1_D128", 32, 2, 256, 1024},  {"L32_MLA_D576", 32, 1, 1152, 1024},
      {"L32_H8_D128", 32, 2, 2048, 4096},
  };
  const std::vector<Variant> variants = {
      variant<4, 256, 3>("u4 t256 min3 1 wave (library)", 1),
      variant<4, 256, 3>("u4 t256 min3 2 waves", 2),
      variant<4, 256, 3>("u4 t256 min3 4 waves", 4),
      variant<4, 256, 3>("u4 t256 min3 one batch/thread", 0),
      variant<2, 256, 4>("u2 t256 min4 1 wave", 1),
      variant<2, 256, 4>("u2 t256 min4 one batch/thread", 0),
      variant<4, 128, 1>("u4 t128 1 wave", 1),
      variant<4, 128, 1>("u4 t128 one batch/thread", 0),
      variant<8, 256, 1>("u8 t256 1 wave", 1),
      variant<1, 256, 5>("u1 t256 min5 one batch/thread", 0),
  };

  const int64_t flush_n = int64_t(2) * prop.l2CacheSize / 16 + (64 << 20) / 16;
  int4* flush_buf;
  int* sink;
  CHECK(cudaMalloc(&flush_buf, flush_n * 16));
  CHECK(cudaMemset(flush_buf, 1, flush_n * 16));
  CHECK(cudaMalloc(&sink, 4));
  int64_t* status;
  CHECK(cudaMalloc(&status, kStatusNumel * 8));
  CHECK(cudaMemset(status, 0, kStatusNumel * 8));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::mt19937_64 rng(0);

  std::printf("%-14s %6s  %-32s %8s %8s %5s %7s\n", "shape", "T", "variant", "us", "p10-p90", "regs", "grid");
  for (const Case& c : cases) {
    const int page = 16;
    const int64_t cache_slots = std::max<int64_t>(2 * c.T, 8192);
    const int64_t pages = cache_slots / page;
    const int segs = c.layers * c.planes;
    const int64_t seg_bytes = cache_slots * c.row_bytes;
    const int64_t chunk_seg_bytes = int64_t(c.T) * c.row_bytes;
    char *cache, *chunk, *ref;
    CHECK(cudaMalloc(&cache, seg_bytes * segs));
    CHECK(cudaMalloc(&chunk, chunk_seg_bytes * segs));
    CHECK(cudaMalloc(&ref, chunk_seg_bytes * segs));
    {
      std::vector<uint32_t> h(seg_bytes * segs / 4);
      for (auto& x : h) x = static_cast<uint32_t>(rng());
      CHECK(cudaMemcpy(cache, h.data(), seg_bytes * segs, cudaMemcpyHostToDevice));
    }
    // the first T slots of whole pages in random order
    std::vector<int64_t> order(pages);
    for (int64_t i = 0; i < pages; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int64_t> slots(c.T);
    for (int t = 0; t < c.T; ++t) slots[t] = order[t / page] * page + t % page;
    int64_t* d_slots;
    CHECK(cudaMalloc(&d_slots, c.T * 8));
    CHECK(cudaMemcpy(d_slots, slots.data(), c.T * 8, cudaMemcpyHostToDevice));

    Params p{};
    p.a.src_geom = RowGeometry{cache_slots, page, int64_t(page) * c.row_bytes, c.row_bytes, 0};
    p.a.dst_geom = RowGeometry{c.T, 1, c.row_bytes, c.row_bytes, 0};
    p.a.src_slots = SlotArray{d_slots, 1, 8, 0};
    p.a.dst_slots = SlotArray::identity_slots();
    p.a.skip_prefix = 0;
    p.a.tokens = c.T;
    p.a.num_segments = segs;
    p.a.status = status;
    p.a.src_recorded_from = kRecordEverything;
    p.a.dst_recorded_from = kRecordEverything;
    prepare_copy_rows_args(p.a, 1, c.row_bytes / 16);
    for (int s = 0; s < segs; ++s) {
      p.src_base[s] = cache + s * seg_bytes;
      p.dst_base[s] = chunk + s * chunk_seg_bytes;
    }
    const int64_t items = int64_t(c.T) * segs * (c.row_bytes / 16);

    auto time_launch = [&](auto&& launch, double& median, double& p10, double& p90) {
      std::vector<float> ms;
      for (int r = 0; r < reps + 3; ++r) {
        flush_kernel<<<sms * 4, 512>>>(flush_buf, flush_n, sink);
        CHECK(cudaEventRecord(e0));
        launch();
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float t;
        CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (r >= 3) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      median = ms[ms.size() / 2] * 1e3;
      p10 = ms[ms.size() / 10] * 1e3;
      p90 = ms[ms.size() * 9 / 10] * 1e3;
    };
    auto same_as_ref = [&]() {
      std::vector<char> a(chunk_seg_bytes * segs), b(chunk_seg_bytes * segs);
      CHECK(cudaMemcpy(a.data(), chunk, a.size(), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(b.data(), ref, b.size(), cudaMemcpyDeviceToHost));
      return std::memcmp(a.data(), b.data(), a.size()) == 0;
    };

    bool first = true;
    for (const Variant& v : variants) {
      cudaFuncAttributes attr{};
      CHECK(cudaFuncGetAttributes(&attr, v.kernel));
      int resident = 0;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, v.kernel, v.threads, 0));
      const int64_t full = (items + v.threads - 1) / v.threads;
      int64_t grid = v.waves == 0 ? (items + int64_t(v.threads) * v.unroll - 1) / (int64_t(v.threads) * v.unroll)
                                  : int64_t(sms) * std::max(resident, 1) * v.waves;
      grid = std::max<int64_t>(1, std::min(grid, full));
      CHECK(cudaMemset(chunk, 0, chunk_seg_bytes * segs));
      auto launch = [&] { v.kernel<<<unsigned(grid), v.threads>>>(p); };
      double med, p10, p90;
      time_launch(launch, med, p10, p90);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      if (first) CHECK(cudaMemcpy(ref, chunk, chunk_seg_bytes * segs, cudaMemcpyDeviceToDevice));
      const bool ok = first || same_as_ref();
      first = false;
      std::printf("%-14s %6d  %-32s %8.2f %4.2f-%-4.2f %4d %7lld%s\n", c.name, c.T, v.name.c_str(), med, p10, p90,
                  attr.numRegs, (long long)grid, ok ? "" : "  OUTPUT DIFFERS");
    }
    {
      CHECK(cudaMemset(chunk, 0, chunk_seg_bytes * segs));
      const dim3 grid(c.T, segs);
      auto launch = [&] { row_per_cta_kernel<<<grid, 128>>>(p); };
      double med, p10, p90;
      time_launch(launch, med, p10, p90);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      cudaFuncAttributes attr{};
      CHECK(cudaFuncGetAttributes(&attr, row_per_cta_kernel));
      std::printf("%-14s %6d  %-32s %8.2f %4.2f-%-4.2f %4d %7lld%s\n", c.name, c.T, "row per CTA, 128 threads", med,
                  p10, p90, attr.numRegs, (long long)(grid.x * grid.y), same_as_ref() ? "" : "  OUTPUT DIFFERS");
    }
    CHECK(cudaFree(cache));
    CHECK(cudaFree(chunk));
    CHECK(cudaFree(ref));
    CHECK(cudaFree(d_slots));
  }
  return 0;
}
