// walk_grid_probe.cu — the walk of copy_rows (torch_ext/include/kvlayout/
// copy_rows_kernel.h, the same code the library's kernel runs) timed alone on
// the bench's geometries, for choosing launch shapes; not part of the library.
// Every variant's output is compared with the first variant's.
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_90 -I torch_ext/include \
//        scripts/walk_grid_probe.cu -o /tmp/walk_grid_probe
//   /tmp/walk_grid_probe [device|budget|host|hints|launch|all[,...]] [reps]
//
// device: gathers on the device at small T (paged cache -> chunk; L32 H1 up
//   to T = 32768) under other grids, CTA sizes and loads in flight, beside a
//   one-row-per-CTA kernel of the kind the peers use and kernels of 2, 4 and
//   8 rows per CTA.
// budget: transfers between the device cache and a pinned host chunk under an
//   SM budget of N = 1, 2, 4 CTAs of 1024 threads (what max_ctas = N
//   launches): the library's budget variant with either cache hint (one walk
//   per kernel, and both walks in one kernel as it was built before), 8-byte
//   lanes with more loads per thread, and a walk that keeps its loads in
//   flight in shared memory (cp.async, a rolling pipeline of S stages) rather
//   than registers; GB/s against the pinned copy_ ceiling measured alike.
//
// host: transfers between the device cache and a pinned host chunk without an
//   SM budget at T = 256 and 4096 (the bench's headline host rows): the
//   library's host variant (16 loads in flight, one 256-thread CTA per SM)
//   beside more CTAs per SM, fewer loads in flight, the device variant's walk,
//   one row per CTA, and the peers' staging (the rows gathered into a device
//   buffer, then one pinned copy_; from the host the copy first); GB/s against
//   the pinned copy_ of the same bytes timed alike.
//
// hints: the device rows at T = 256 (L32 H1, H8, MLA), both ways (gather:
//   paged cache -> chunk; scatter: chunk -> paged cache), in the library's
//   rows per CTA (H1 8, H8 1, MLA 2) and one row per CTA, with streaming
//   cache hints (the library's device launches) and the default ones (the
//   peers'); each timed alone after an L2 flush, and back to back (events
//   around 20 launches, per launch: a stream of calls whose host issue time
//   is hidden), so that a gap between the kernels shows apart from the
//   kernels' own time.
//
// launch: the cost of launching parameter blocks of 8, 32, 64 and 128
//   segments (the library's tables hold 8 or 128) and a peer's 64 bytes, an
//   empty kernel: the host's, back to back and with the device idle before
//   it; the device's, the host's issue time hidden, of 1 CTA and of 8,192.
//
// Per case and variant: the median kernel time over `reps` launches (CUDA
// events around one launch, L2 flushed by a read before each), the grid, and
// the registers of the compiled kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvlayout/copy_rows_kernel.h"
#include "probe_check.h"

using namespace kvlayout;

constexpr int kSegs = 128;
using Params = CopyRowsParams<kSegs>;

template <int VEC>
struct DefaultHints {
  using vec_type = VecOf<VEC, uint4, uint2>;
  __device__ static vec_type load(const vec_type* p) { return *p; }
  __device__ static void store(vec_type* p, vec_type v) { *p = v; }
};
template <int VEC>
struct StreamingHints {
  using vec_type = VecOf<VEC, uint4, uint2>;
  __device__ static vec_type load(const vec_type* p) { return __ldcs(p); }
  __device__ static void store(vec_type* p, vec_type v) { __stcs(p, v); }
};

struct NoRecord {
  __device__ void operator()(int64_t, int64_t, int64_t, int64_t) const {}
};

// The segment table into shared memory, as the library's kernel reads it.
__device__ void load_segment_table(const Params& p, const char** src_base, char** dst_base) {
  for (int64_t j = threadIdx.x; j < p.a.num_segments; j += blockDim.x) {
    src_base[j] = p.src_base[j];
    dst_base[j] = p.dst_base[j];
  }
  __syncthreads();
}

// The library kernel's body (segment table into shared memory, then the walk).
template <int VEC, int UNROLL, int THREADS, int MIN_CTAS, class Mem>
__global__ void __launch_bounds__(THREADS, MIN_CTAS) walk_kernel(const __grid_constant__ Params p) {
  __shared__ const char* src_base[kSegs];
  __shared__ char* dst_base[kSegs];
  load_segment_table(p, src_base, dst_base);
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_threads = int64_t(gridDim.x) * blockDim.x;
  copy_rows_walk<VEC, UNROLL, Mem>(p.a, src_base, dst_base, thread, num_threads, NoRecord{});
}

// Both walks in one kernel, the cache hints chosen per thread from
// p.a.cache_hints (how the library's host variant was built before each
// kernel compiled one walk: more registers spilled at 1024 threads).
template <int VEC, int UNROLL>
__global__ void __launch_bounds__(1024, 1) two_walk_kernel(const __grid_constant__ Params p) {
  __shared__ const char* src_base[kSegs];
  __shared__ char* dst_base[kSegs];
  load_segment_table(p, src_base, dst_base);
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_threads = int64_t(gridDim.x) * blockDim.x;
  if (p.a.cache_hints == kDefaultHints) {
    copy_rows_walk<VEC, UNROLL, DefaultHints<VEC>>(p.a, src_base, dst_base, thread, num_threads, NoRecord{});
    return;
  }
  copy_rows_walk<VEC, UNROLL, StreamingHints<VEC>>(p.a, src_base, dst_base, thread, num_threads, NoRecord{});
}

// One (token, segment) row per CTA, VEC-byte words strided by the CTA's
// threads (the peers' shape: LMCache's kernel takes 8-byte words and
// min(words per row, 128) threads): the library's copy_one_row, as its
// copy_row_per_cta_kernel runs it.
template <int VEC>
__global__ void __launch_bounds__(128) row_per_cta_kernel(const __grid_constant__ Params p) {
  copy_one_row<VEC, StreamingHints<VEC>>(p.a, p.src_base[blockIdx.y], p.dst_base[blockIdx.y], blockIdx.x,
                                         blockIdx.y, threadIdx.x, blockDim.x, NoRecord{});
}

// R (token, segment) rows per CTA of R x min(words per row, 128) threads,
// row by row as row_per_cta_kernel: the same rows in R times fewer CTAs (at
// T = 256 the device rows are about as long as starting their CTAs takes:
// the launch section's empty 8,192 CTAs).
template <int VEC, int R, class Hints = StreamingHints<VEC>>
__global__ void __launch_bounds__(128 * R) rows_per_cta_kernel(const __grid_constant__ Params p) {
  const int64_t t = int64_t(blockIdx.x) * R + threadIdx.y;
  if (t >= p.a.tokens) return;
  copy_one_row<VEC, Hints>(p.a, p.src_base[blockIdx.y], p.dst_base[blockIdx.y], t, blockIdx.y, threadIdx.x,
                           blockDim.x, NoRecord{});
}

__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(global) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Loads kept in flight in shared memory: item i of the flat (token, segment,
// 16-byte vector) space is thread i's, then i + num_threads, ...; S stages
// roll: the oldest stage is stored and refilled while S - 1 stay in flight.
// 16-byte rows of one piece only (the bench's geometries).
template <int S>
__global__ void __launch_bounds__(1024, 1) async_pipeline_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint4 stage[];  // [S][blockDim.x]
  __shared__ const char* src_base[kSegs];
  __shared__ char* dst_base[kSegs];
  load_segment_table(p, src_base, dst_base);
  const int64_t vecs = p.a.vecs_per_row;
  const int64_t per_token = p.a.num_segments * vecs;
  const int64_t total = p.a.tokens * per_token;
  const int64_t num_threads = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // issues item i into stage k; its destination, or nullptr (past the end, or a skipped slot)
  const auto issue = [&](int k, int64_t item) -> char* {
    if (item >= total) return nullptr;
    int64_t t, rest, seg, v;
    divmod_nonneg(item, per_token, t, rest);
    divmod_nonneg(rest, vecs, seg, v);
    const int64_t s = p.a.src_slots.load(t), d = p.a.dst_slots.load(t);
    if (s < 0 || d < 0 || s >= p.a.src_geom.num_slots || d >= p.a.dst_geom.num_slots) return nullptr;
    cp_async16(&stage[k * blockDim.x + threadIdx.x],
               src_base[seg] + row_offset(p.a.src_geom, p.a.src_by_page, s) + v * 16);
    return dst_base[seg] + row_offset(p.a.dst_geom, p.a.dst_by_page, d) + v * 16;
  };
  char* out[S];
#pragma unroll
  for (int k = 0; k < S; ++k) {
    out[k] = issue(k, i);
    i += num_threads;
    cp_async_commit();
  }
  while (i - S * num_threads < total) {  // an item is in flight
#pragma unroll
    for (int k = 0; k < S; ++k) {
      cp_async_wait<S - 1>();  // stage k, the oldest, has landed
      if (out[k] != nullptr) *reinterpret_cast<uint4*>(out[k]) = stage[k * blockDim.x + threadIdx.x];
      out[k] = issue(k, i);
      i += num_threads;
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
}

__global__ void flush_kernel(const int4* buf, int64_t n, int* sink) {
  int acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc ^= buf[i].x;
  if (acc == 0x12345678) *sink = acc;
}

__global__ void fill_kernel(uint32_t* buf, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    buf[i] = x;
  }
}

__global__ void diff_kernel(const uint32_t* a, const uint32_t* b, int64_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    c += a[i] != b[i];
  if (c) atomicAdd(count, c);
}

struct Shape {
  const char* name;
  int layers, planes, row_bytes;
};
const Shape kH1{"L32_H1_D128", 32, 2, 256}, kH8{"L32_H8_D128", 32, 2, 2048}, kMLA{"L32_MLA_D576", 32, 1, 1152},
    kL61MLA{"L61_MLA_D576", 61, 1, 1152};

// What every section shares: the device, the L2 flush, events, the status word.
struct Probe {
  int reps;
  int sms = 0;
  cudaDeviceProp prop{};
  int4* flush_buf = nullptr;
  int64_t flush_n = 0;
  int* sink = nullptr;
  int64_t* status = nullptr;
  unsigned long long* count = nullptr;
  cudaEvent_t e0{}, e1{};
  std::mt19937_64 rng{0};

  explicit Probe(int reps_) : reps(reps_) {
    CHECK(cudaGetDeviceProperties(&prop, 0));
    sms = prop.multiProcessorCount;
    flush_n = int64_t(2) * prop.l2CacheSize / 16 + (64 << 20) / 16;
    CHECK(cudaMalloc(&flush_buf, flush_n * 16));
    CHECK(cudaMemset(flush_buf, 1, flush_n * 16));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMalloc(&status, kStatusNumel * 8));
    CHECK(cudaMemset(status, 0, kStatusNumel * 8));
    CHECK(cudaMalloc(&count, 8));
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
  }

  // median, p10, p90 in microseconds of one launch after an L2 flush
  template <class Launch>
  void time(Launch&& launch, double& median, double& p10, double& p90) {
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
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    median = ms[ms.size() / 2] * 1e3;
    p10 = ms[ms.size() / 10] * 1e3;
    p90 = ms[ms.size() * 9 / 10] * 1e3;
  }

  // times `launch` as time does, then whether `out` holds what the first
  // variant's did (`first`: this is it, and its output is kept in `ref`)
  template <class Launch>
  bool time_checked(Launch&& launch, const void* out, void* ref, int64_t bytes, bool& first, double& median,
                    double& p10, double& p90) {
    time(launch, median, p10, p90);
    CHECK(cudaDeviceSynchronize());
    if (first) CHECK(cudaMemcpy(ref, out, bytes, cudaMemcpyDefault));
    const bool ok = first || differing(ref, out, bytes) == 0;
    first = false;
    return ok;
  }

  // words of a and b (device or pinned) that differ
  unsigned long long differing(const void* a, const void* b, int64_t bytes) {
    CHECK(cudaMemset(count, 0, 8));
    diff_kernel<<<sms * 4, 512>>>(static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b), bytes / 4,
                                  count);
    unsigned long long c = 0;
    CHECK(cudaMemcpy(&c, count, 8, cudaMemcpyDeviceToHost));
    return c;
  }

  void fill(void* buf, int64_t bytes) {
    fill_kernel<<<sms * 4, 512>>>(static_cast<uint32_t*>(buf), bytes / 4, static_cast<uint32_t>(rng()));
    CHECK(cudaDeviceSynchronize());
  }

  // the first T slots of whole pages (of `page` slots) of a cache of `cache_slots`, in random order
  std::vector<int64_t> page_slots(int64_t cache_slots, int page, int T) {
    std::vector<int64_t> order(cache_slots / page);
    for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int64_t> slots(T);
    for (int t = 0; t < T; ++t) slots[t] = order[t / page] * page + t % page;
    return slots;
  }
};

// A paged cache (page size 16, every layer and plane one segment) and a chunk
// [segments, T, row]; `slots` (device) names each token's cache slot.
struct Tensors {
  char* cache = nullptr;  // device
  char* chunk = nullptr;  // device or pinned host
  int64_t cache_slots = 0, seg_bytes = 0, chunk_seg_bytes = 0;
  int segs = 0;
  int64_t* slots = nullptr;
  bool host_chunk;

  Tensors(Probe& probe, const Shape& sh, int T, bool host_chunk_) : host_chunk(host_chunk_) {
    cache_slots = std::max<int64_t>(2 * T, 8192);
    segs = sh.layers * sh.planes;
    seg_bytes = cache_slots * sh.row_bytes;
    chunk_seg_bytes = int64_t(T) * sh.row_bytes;
    CHECK(cudaMalloc(&cache, seg_bytes * segs));
    if (host_chunk)
      CHECK(cudaMallocHost(&chunk, chunk_seg_bytes * segs));
    else
      CHECK(cudaMalloc(&chunk, chunk_seg_bytes * segs));
    probe.fill(cache, seg_bytes * segs);
    probe.fill(chunk, chunk_seg_bytes * segs);
    const std::vector<int64_t> h = probe.page_slots(cache_slots, 16, T);
    CHECK(cudaMalloc(&slots, T * 8));
    CHECK(cudaMemcpy(slots, h.data(), T * 8, cudaMemcpyHostToDevice));
  }
  ~Tensors() {
    cudaFree(cache);
    if (host_chunk)
      cudaFreeHost(chunk);
    else
      cudaFree(chunk);
    cudaFree(slots);
  }

  // Launch parameters of cache -> chunk (gather) or chunk -> cache, VEC-byte vectors.
  Params params(const Probe& probe, const Shape& sh, int T, bool to_chunk, int vec) const {
    Params p{};
    const RowGeometry paged{cache_slots, 16, int64_t(16) * sh.row_bytes, sh.row_bytes, 0};
    const RowGeometry flat{T, 1, sh.row_bytes, sh.row_bytes, 0};
    const SlotArray page_slots{slots, 1, 8, 0};
    p.a.src_geom = to_chunk ? paged : flat;
    p.a.dst_geom = to_chunk ? flat : paged;
    p.a.src_slots = to_chunk ? page_slots : SlotArray::identity_slots();
    p.a.dst_slots = to_chunk ? SlotArray::identity_slots() : page_slots;
    p.a.skip_prefix = 0;
    p.a.tokens = T;
    p.a.num_segments = segs;
    p.a.status = probe.status;
    p.a.src_recorded_from = kRecordEverything;
    p.a.dst_recorded_from = kRecordEverything;
    prepare_copy_rows_args(p.a, 1, sh.row_bytes / vec);
    for (int s = 0; s < segs; ++s) {
      char* c = cache + s * seg_bytes;
      char* k = chunk + s * chunk_seg_bytes;
      p.src_base[s] = to_chunk ? c : k;
      p.dst_base[s] = to_chunk ? k : c;
    }
    return p;
  }
};

void print_row(const char* shape, int T, const std::string& variant, double med, double p10, double p90, int regs,
               long long grid, const std::string& extra, bool ok) {
  std::printf("%-14s %6d  %-34s %9.2f %8.2f-%-8.2f %4d %7lld %s%s\n", shape, T, variant.c_str(), med, p10, p90,
              regs, grid, extra.c_str(), ok ? "" : "  OUTPUT DIFFERS");
}

// ---------------------------------------------------------------------------
// device: on-device gathers at small T

struct DeviceVariant {
  std::string name;
  void (*kernel)(Params);
  int threads;
  int unroll;
  int waves;  // 0: items / (threads * unroll) CTAs (each thread one batch); else waves x resident CTAs
};

template <int U, int TH, int MB>
DeviceVariant device_variant(const char* name, int waves) {
  return DeviceVariant{name, walk_kernel<16, U, TH, MB, StreamingHints<16>>, TH, U, waves};
}

void run_device(Probe& probe) {
  struct Case {
    Shape shape;
    int T;
  };
  const Case cases[] = {{kH1, 256},  {kH8, 256},  {kMLA, 256},  {kL61MLA, 256},
                        {kH1, 1024}, {kMLA, 1024}, {kH8, 4096}, {kH1, 4096}, {kH1, 32768}};
  const std::vector<DeviceVariant> variants = {
      device_variant<4, 256, 3>("u4 t256 min3 1 wave (library)", 1),
      device_variant<4, 256, 3>("u4 t256 min3 2 waves", 2),
      device_variant<4, 256, 3>("u4 t256 min3 4 waves", 4),
      device_variant<4, 256, 3>("u4 t256 min3 one batch/thread", 0),
      device_variant<4, 256, 4>("u4 t256 min4 1 wave", 1),
      device_variant<4, 256, 4>("u4 t256 min4 one batch/thread", 0),
      device_variant<3, 256, 4>("u3 t256 min4 1 wave", 1),
      device_variant<3, 256, 4>("u3 t256 min4 one batch/thread", 0),
      device_variant<2, 256, 4>("u2 t256 min4 1 wave", 1),
      device_variant<2, 256, 4>("u2 t256 min4 one batch/thread", 0),
      device_variant<4, 128, 1>("u4 t128 1 wave", 1),
      device_variant<4, 128, 1>("u4 t128 one batch/thread", 0),
      device_variant<8, 256, 1>("u8 t256 1 wave", 1),
      device_variant<1, 256, 5>("u1 t256 min5 one batch/thread", 0),
  };
  std::printf("\n== device: gather, paged cache -> chunk, on the device\n");
  std::printf("%-14s %6s  %-34s %9s %17s %4s %7s\n", "shape", "T", "variant", "us", "p10-p90", "regs", "grid");
  for (const Case& c : cases) {
    Tensors x(probe, c.shape, c.T, false);
    const Params p = x.params(probe, c.shape, c.T, true, 16);
    const int64_t bytes = x.chunk_seg_bytes * x.segs;
    char* ref;
    CHECK(cudaMalloc(&ref, bytes));
    const int64_t items = int64_t(c.T) * x.segs * (c.shape.row_bytes / 16);
    bool first = true;
    for (const DeviceVariant& v : variants) {
      cudaFuncAttributes attr{};
      CHECK(cudaFuncGetAttributes(&attr, v.kernel));
      int resident = 0;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, v.kernel, v.threads, 0));
      const int64_t full = (items + v.threads - 1) / v.threads;
      int64_t grid = v.waves == 0 ? (items + int64_t(v.threads) * v.unroll - 1) / (int64_t(v.threads) * v.unroll)
                                  : int64_t(probe.sms) * std::max(resident, 1) * v.waves;
      grid = std::max<int64_t>(1, std::min(grid, full));
      CHECK(cudaMemset(x.chunk, 0, bytes));
      double med, p10, p90;
      const bool ok = probe.time_checked([&] { v.kernel<<<unsigned(grid), v.threads>>>(p); }, x.chunk, ref, bytes,
                                         first, med, p10, p90);
      print_row(c.shape.name, c.T, v.name, med, p10, p90, attr.numRegs, grid, "", ok);
    }
    // R rows per CTA (R = 1: row_per_cta_kernel, the library's and the peers' shape)
    const auto rows_per_cta = [&](auto vec_tag, auto rows_tag, const char* name) {
      constexpr int kVec = decltype(vec_tag)::value, kRows = decltype(rows_tag)::value;
      const Params pv = x.params(probe, c.shape, c.T, true, kVec);
      const int threads = int(std::min<int64_t>(pv.a.vecs_per_row, 128));
      const dim3 grid(unsigned((c.T + kRows - 1) / kRows), unsigned(x.segs));
      const auto kernel = kRows == 1 ? row_per_cta_kernel<kVec> : rows_per_cta_kernel<kVec, kRows>;
      CHECK(cudaMemset(x.chunk, 0, bytes));
      double med, p10, p90;
      probe.time([&] { kernel<<<grid, dim3(threads, kRows)>>>(pv); }, med, p10, p90);
      CHECK(cudaDeviceSynchronize());
      cudaFuncAttributes attr{};
      CHECK(cudaFuncGetAttributes(&attr, kernel));
      print_row(c.shape.name, c.T, name, med, p10, p90, attr.numRegs, (long long)(grid.x) * grid.y, "",
                probe.differing(ref, x.chunk, bytes) == 0);
    };
    using Vec16 = std::integral_constant<int, 16>;
    using Vec8 = std::integral_constant<int, 8>;
    rows_per_cta(Vec16{}, std::integral_constant<int, 1>{}, "row per CTA, 16 B, <=128 threads");
    rows_per_cta(Vec8{}, std::integral_constant<int, 1>{}, "row per CTA, 8 B, <=128 threads");
    rows_per_cta(Vec16{}, std::integral_constant<int, 2>{}, "2 rows per CTA, 16 B");
    rows_per_cta(Vec16{}, std::integral_constant<int, 4>{}, "4 rows per CTA, 16 B");
    rows_per_cta(Vec16{}, std::integral_constant<int, 8>{}, "8 rows per CTA, 16 B");
    CHECK(cudaFree(ref));
  }
}

// One direction of the host transfers of a shape: the pinned copy_ of the
// chunk's bytes timed alike (the ceiling, printed first), every variant
// started from the same output (a zeroed chunk, or the cache as filled) and
// compared with the first variant's, each printed with its GB/s.
struct HostDirection {
  Probe& probe;
  const Tensors& x;
  const Shape& sh;
  int T;
  bool to_host;
  int64_t bytes, out_bytes;
  char* out;
  char* ref = nullptr;
  char* pristine = nullptr;
  double ceiling = 0;
  bool first = true;

  HostDirection(Probe& probe_, const Tensors& x_, const Shape& sh_, int T_, bool to_host_)
      : probe(probe_), x(x_), sh(sh_), T(T_), to_host(to_host_), bytes(x_.chunk_seg_bytes * x_.segs),
        out_bytes(to_host_ ? bytes : x_.seg_bytes * x_.segs), out(to_host_ ? x_.chunk : x_.cache) {
    char* dev;
    CHECK(cudaMalloc(&dev, bytes));
    double med, p10, p90;
    probe.time([&] { CHECK(cudaMemcpyAsync(to_host ? x.chunk : dev, to_host ? dev : x.chunk, bytes,
                                           to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice)); },
               med, p10, p90);
    CHECK(cudaFree(dev));
    ceiling = bytes / med / 1e3;
    std::printf("%-14s %6d  %-34s %9.2f %8.2f-%-8.2f      %7s %.1f GB/s\n", sh.name, T,
                to_host ? "pinned copy_ to host" : "pinned copy_ from host", med, p10, p90, "", ceiling);
    if (to_host) {
      CHECK(cudaMallocHost(&ref, out_bytes));
    } else {
      CHECK(cudaMalloc(&ref, out_bytes));
      CHECK(cudaMalloc(&pristine, out_bytes));
      CHECK(cudaMemcpy(pristine, out, out_bytes, cudaMemcpyDeviceToDevice));
    }
  }
  ~HostDirection() {
    if (to_host) {
      cudaFreeHost(ref);
    } else {
      cudaFree(ref);
      cudaFree(pristine);
    }
  }

  void restore() {
    if (to_host)
      std::memset(out, 0, out_bytes);
    else
      CHECK(cudaMemcpy(out, pristine, out_bytes, cudaMemcpyDeviceToDevice));
  }

  // times `launch` from a restored output and prints its row
  template <class Launch>
  void run(const std::string& name, int regs, long long grid, Launch&& launch) {
    restore();
    double med, p10, p90;
    const bool ok = probe.time_checked(launch, out, ref, out_bytes, first, med, p10, p90);
    char extra[64];
    std::snprintf(extra, sizeof extra, "%.1f GB/s (%.1f %%)", bytes / med / 1e3, 100.0 * bytes / med / 1e3 / ceiling);
    print_row(sh.name, T, std::string(to_host ? "to host, " : "from host, ") + name, med, p10, p90, regs, grid,
              extra, ok);
  }
};

// ---------------------------------------------------------------------------
// budget: device cache <-> pinned host chunk on N SMs

struct BudgetVariant {
  std::string name;
  void (*kernel)(Params);
  int vec;
  size_t dynamic_smem;
  int32_t hints = kStreamingHints;  // p.a.cache_hints (read by the two-walk kernel only)
};

template <int VEC, int U, class Mem>
BudgetVariant budget_walk(const char* name) {
  return BudgetVariant{name, walk_kernel<VEC, U, 1024, 1, Mem>, VEC, 0};
}
template <int VEC, int U>
BudgetVariant budget_two_walks(const char* name, int32_t hints) {
  return BudgetVariant{name, two_walk_kernel<VEC, U>, VEC, 0, hints};
}
template <int S>
BudgetVariant budget_async(const char* name) {
  const size_t smem = size_t(S) * 1024 * 16;
  CHECK(cudaFuncSetAttribute(async_pipeline_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  return BudgetVariant{name, async_pipeline_kernel<S>, 16, smem};
}

void run_budget(Probe& probe) {
  static_assert(kBudgetHostUnroll == 3, "the variants' names below say the library's loads in flight");
  const std::vector<BudgetVariant> variants = {
      budget_walk<16, kBudgetHostUnroll, DefaultHints<16>>("walk v16 u3 default (library)"),
      budget_walk<16, kBudgetHostUnroll, StreamingHints<16>>("walk v16 u3 streaming (library)"),
      budget_walk<16, 4, DefaultHints<16>>("walk v16 u4 default"),
      budget_walk<16, 4, StreamingHints<16>>("walk v16 u4 streaming"),
      budget_two_walks<16, 4>("two walks v16 u4 default", kDefaultHints),
      budget_two_walks<16, 4>("two walks v16 u4 streaming", kStreamingHints),
      budget_walk<8, 8, DefaultHints<8>>("walk v8 u8 default"),
      budget_walk<8, 16, DefaultHints<8>>("walk v8 u16 default"),
      budget_async<4>("shared-memory pipeline S=4"),
      budget_async<8>("shared-memory pipeline S=8"),
      budget_async<12>("shared-memory pipeline S=12"),
  };
  const Shape shapes[] = {kH8, kH1, kMLA};
  const int T = 4096;
  std::printf("\n== budget: N CTAs of 1024 threads, device cache <-> pinned host chunk, T = %d\n", T);
  std::printf("%-14s %6s  %-34s %9s %17s %4s %7s %s\n", "shape", "T", "variant", "us", "p10-p90", "regs", "N",
              "GB/s (% of pinned copy_)");
  for (const Shape& sh : shapes) {
    Tensors x(probe, sh, T, true);
    for (const bool to_host : {true, false}) {
      HostDirection d(probe, x, sh, T, to_host);
      for (const BudgetVariant& v : variants) {
        Params p = x.params(probe, sh, T, to_host, v.vec);
        p.a.cache_hints = v.hints;
        cudaFuncAttributes attr{};
        CHECK(cudaFuncGetAttributes(&attr, v.kernel));
        for (const int n : {1, 2, 4})
          d.run(v.name, attr.numRegs, n, [&] { v.kernel<<<unsigned(n), 1024, v.dynamic_smem>>>(p); });
      }
    }
  }
}

// ---------------------------------------------------------------------------
// host: device cache <-> pinned host chunk, default grids, small and middle T

struct HostVariant {
  std::string name;
  void (*kernel)(Params);
  int threads;
  int ctas_per_sm;  // 0: one CTA per (token, segment) row (the kernel is row_per_cta_kernel)
  int vec;
};

template <int U, int MB>
HostVariant host_walk(const char* name, int ctas_per_sm) {
  return HostVariant{name, walk_kernel<16, U, 256, MB, StreamingHints<16>>, 256, ctas_per_sm, 16};
}

int64_t walk_grid(const Probe& probe, const HostVariant& v, int64_t items) {
  const int64_t full = (items + v.threads - 1) / v.threads;
  return std::max<int64_t>(1, std::min<int64_t>(int64_t(probe.sms) * v.ctas_per_sm, full));
}

void run_host(Probe& probe) {
  static_assert(kHostUnroll == 16, "the variants' names below say the library's loads in flight");
  const std::vector<HostVariant> variants = {
      host_walk<kHostUnroll, 1>("walk u16, 1 CTA/SM (library)", 1),
      host_walk<kHostUnroll, 1>("walk u16, 2 CTAs/SM", 2),
      host_walk<kHostUnroll, 1>("walk u16, 4 CTAs/SM", 4),
      host_walk<8, 1>("walk u8, 2 CTAs/SM", 2),
      host_walk<8, 1>("walk u8, 4 CTAs/SM", 4),
      host_walk<kDeviceUnroll, 3>("walk u4, 3 CTAs/SM (device's)", 3),
      HostVariant{"row per CTA, 16 B, <=128 threads", row_per_cta_kernel<16>, 128, 0, 16},
      HostVariant{"row per CTA, 8 B, <=128 threads", row_per_cta_kernel<8>, 128, 0, 8},
  };
  const Shape shapes[] = {kH1, kH8, kMLA};
  std::printf("\n== host: device cache <-> pinned host chunk, default grids\n");
  std::printf("%-14s %6s  %-34s %9s %17s %4s %7s %s\n", "shape", "T", "variant", "us", "p10-p90", "regs", "grid",
              "GB/s (% of pinned copy_)");
  for (const Shape& sh : shapes) {
    for (const int T : {256, 4096}) {
      Tensors x(probe, sh, T, true);
      const int64_t bytes = x.chunk_seg_bytes * x.segs;
      char* staging;  // the peers' device buffer: the chunk's rows, then one copy_ across
      CHECK(cudaMalloc(&staging, bytes));
      for (const bool to_host : {true, false}) {
        HostDirection d(probe, x, sh, T, to_host);
        for (const HostVariant& v : variants) {
          const Params p = x.params(probe, sh, T, to_host, v.vec);
          cudaFuncAttributes attr{};
          CHECK(cudaFuncGetAttributes(&attr, v.kernel));
          const int threads = v.ctas_per_sm ? v.threads : int(std::min<int64_t>(p.a.vecs_per_row, v.threads));
          const dim3 grid = v.ctas_per_sm
                                ? dim3(unsigned(walk_grid(probe, v, int64_t(T) * x.segs * p.a.vecs_per_row)))
                                : dim3(unsigned(T), unsigned(x.segs));
          d.run(v.name, attr.numRegs, (long long)(grid.x) * grid.y, [&] { v.kernel<<<grid, threads>>>(p); });
        }
        // the peers' staging: the rows to or from a device buffer by one row per CTA, and one pinned copy_
        Params staged = x.params(probe, sh, T, to_host, 16);
        for (int s = 0; s < x.segs; ++s) {
          char* rows = staging + s * x.chunk_seg_bytes;
          if (to_host)
            staged.dst_base[s] = rows;
          else
            staged.src_base[s] = rows;
        }
        const int threads = int(std::min<int64_t>(staged.a.vecs_per_row, 128));
        const dim3 grid(unsigned(T), unsigned(x.segs));
        d.run("staging: rows per CTA + one copy_", 0, (long long)(grid.x) * grid.y, [&] {
          if (!to_host) CHECK(cudaMemcpyAsync(staging, x.chunk, d.bytes, cudaMemcpyHostToDevice));
          row_per_cta_kernel<16><<<grid, threads>>>(staged);
          if (to_host) CHECK(cudaMemcpyAsync(x.chunk, staging, d.bytes, cudaMemcpyDeviceToHost));
        });
      }
      CHECK(cudaFree(staging));
    }
  }
}

// A kernel that takes a parameter block and does nothing with it (but read
// its first word, so that the block is passed).
template <typename Params>
__global__ void params_kernel(const __grid_constant__ Params p, int* sink) {
  if (*reinterpret_cast<const int*>(&p) < 0) *sink = 1;
}

// Spins for `cycles` clock cycles: holds the device busy while the host
// issues what is timed after it.
__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

template <class Hints>
struct HintsTag {
  using type = Hints;
};

// The device rows at T = 256 both ways, R rows per CTA under either cache
// hint, alone after an L2 flush and back to back (see the file's comment).
void run_hints(Probe& probe) {
  struct Case {
    Shape shape;
    int library_rows;  // rows per CTA of the library's launch of this row width
  };
  const Case cases[] = {{kH1, 8}, {kH8, 1}, {kMLA, 2}};
  constexpr int kT = 256, kBackToBack = 20;
  std::printf("\n== hints: device rows at T = %d, rows per CTA x cache hints; alone after an L2 flush and back to "
              "back (%d launches), us per launch\n", kT, kBackToBack);
  std::printf("%-14s %-8s %-30s %9s %17s %12s\n", "shape", "way", "variant", "alone us", "p10-p90",
              "back to back");
  for (const Case& c : cases) {
    Tensors x(probe, c.shape, kT, false);
    for (const bool to_chunk : {true, false}) {
      const Params p = x.params(probe, c.shape, kT, to_chunk, 16);
      char* const dst = to_chunk ? x.chunk : x.cache;
      const int64_t bytes = to_chunk ? x.chunk_seg_bytes * x.segs : x.seg_bytes * x.segs;
      char* ref;
      CHECK(cudaMalloc(&ref, bytes));
      bool first = true;
      const auto variant = [&](auto rows_tag, auto hints_tag, const char* name) {
        constexpr int kRows = decltype(rows_tag)::value;
        using Hints = typename decltype(hints_tag)::type;
        const int threads = int(std::min<int64_t>(p.a.vecs_per_row, 128));
        const dim3 grid(unsigned((kT + kRows - 1) / kRows), unsigned(x.segs));
        const auto kernel = rows_per_cta_kernel<16, kRows, Hints>;
        const auto launch = [&] { kernel<<<grid, dim3(threads, kRows)>>>(p); };
        CHECK(cudaMemset(dst, 0, bytes));  // (each variant from the same destination: the check compares)
        double med, p10, p90;
        const bool ok = probe.time_checked(launch, dst, ref, bytes, first, med, p10, p90);
        double stream_med, stream_p10, stream_p90;
        probe.time([&] { for (int i = 0; i < kBackToBack; ++i) launch(); }, stream_med, stream_p10, stream_p90);
        CHECK(cudaDeviceSynchronize());
        std::printf("%-14s %-8s %-30s %9.2f %8.2f-%-8.2f %12.2f%s\n", c.shape.name, to_chunk ? "gather" : "scatter",
                    name, med, p10, p90, stream_med / kBackToBack, ok ? "" : "  OUTPUT DIFFERS");
      };
      using One = std::integral_constant<int, 1>;
      using Stream = HintsTag<StreamingHints<16>>;
      using Default = HintsTag<DefaultHints<16>>;
      const auto library = [&](auto hints_tag, const char* name) {
        if (c.library_rows == 8) variant(std::integral_constant<int, 8>{}, hints_tag, name);
        else if (c.library_rows == 2) variant(std::integral_constant<int, 2>{}, hints_tag, name);
        else variant(One{}, hints_tag, name);
      };
      library(Stream{}, "library's rows/CTA, streaming");
      library(Default{}, "library's rows/CTA, default");
      variant(One{}, Stream{}, "1 row/CTA, streaming");
      variant(One{}, Default{}, "1 row/CTA, default");
      CHECK(cudaFree(ref));
    }
  }
}

// A peer's parameter block: a few pointers and sizes (64 bytes).
struct SmallParams {
  int tokens;
  int pad;
  const void* pointers[5];
  long long sizes[2];
};

// The cost of launching a parameter block (the library's tables hold 8 or
// 128 segments; a peer's kernel takes a few pointers): per launch back to
// back (2,000 launches after a synchronisation, the host's clock); one
// launch with the device idle before it (the host's clock around the launch
// call, and the events' time from before the launch to the kernel's end:
// what an idle call's end-to-end time pays for launching); and, with the
// device held busy while the host issues (a spinning kernel first), the
// events' time around one launch of 1 CTA and of `wide_ctas` CTAs of 128
// threads (the device's own cost of starting the kernel and its CTAs with
// that block, the host's issue time hidden: what the bench's kernel-only
// timing of a small row pays).
template <typename Params>
void launch_row(Probe& probe, const char* name, const Params& p, int wide_ctas) {
  const auto launch = [&](int ctas, int threads) { params_kernel<Params><<<ctas, threads>>>(p, probe.sink); };
  for (int i = 0; i < 100; ++i) launch(1, 32);
  CHECK(cudaDeviceSynchronize());
  constexpr int kBackToBack = 2000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kBackToBack; ++i) launch(1, 32);
  const auto t1 = std::chrono::steady_clock::now();
  CHECK(cudaDeviceSynchronize());
  const double back_to_back = std::chrono::duration<double, std::micro>(t1 - t0).count() / kBackToBack;
  const auto median = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  // events around one launch; busy: after a 50 us spin, so that the host's issue time is hidden
  const auto timed = [&](bool busy, int ctas, int threads, std::vector<double>* host_us) {
    std::vector<double> device_us;
    for (int r = 0; r < probe.reps + 3; ++r) {
      CHECK(cudaDeviceSynchronize());
      if (busy) spin_kernel<<<1, 1>>>(static_cast<long long>(clock_khz) * 50 / 1000);
      CHECK(cudaEventRecord(probe.e0));
      const auto a = std::chrono::steady_clock::now();
      launch(ctas, threads);
      const auto b = std::chrono::steady_clock::now();
      CHECK(cudaEventRecord(probe.e1));
      CHECK(cudaEventSynchronize(probe.e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, probe.e0, probe.e1));
      if (r < 3) continue;
      if (host_us != nullptr) host_us->push_back(std::chrono::duration<double, std::micro>(b - a).count());
      device_us.push_back(ms * 1e3);
    }
    CHECK(cudaGetLastError());
    return median(device_us);
  };
  std::vector<double> host_us;
  const double idle = timed(false, 1, 32, &host_us);
  const double busy_one = timed(true, 1, 32, nullptr);
  const double busy_wide = timed(true, wide_ctas, 128, nullptr);
  std::printf("%-14s %6zu B   %8.2f   %8.2f   %8.2f   %8.2f   %8.2f\n", name, sizeof(p), back_to_back,
              median(host_us), idle, busy_one, busy_wide);
}

template <int N>
void launch_table_row(Probe& probe, int wide_ctas) {
  CopyRowsParams<N> p{};
  p.a.tokens = 1;
  const std::string name = std::to_string(N) + " segments";
  launch_row(probe, name.c_str(), p, wide_ctas);
}

void run_launch(Probe& probe) {
  constexpr int kWideCtas = 8192;  // the MLA row at T = 256 (32 layers x 256 tokens, one row per CTA)
  std::printf("\n== launch: parameter blocks, an empty kernel, medians (busy: events around one launch after a "
              "50 us spin; wide: %d CTAs of 128 threads)\n", kWideCtas);
  std::printf("block          bytes    host us/launch   host us idle   idle launch to end us   busy 1 CTA us"
              "   busy wide us\n");
  SmallParams small{};
  small.tokens = 1;
  launch_row(probe, "a peer's", small, kWideCtas);
  launch_table_row<8>(probe, kWideCtas);
  launch_table_row<32>(probe, kWideCtas);
  launch_table_row<64>(probe, kWideCtas);
  launch_table_row<128>(probe, kWideCtas);
  launch_row(probe, "a peer's", small, kWideCtas);  // (again: the first row also warmed the process up)
  launch_table_row<8>(probe, kWideCtas);
}

int main(int argc, char** argv) {
  // sections: one of device, budget, host, launch, all, or several joined by commas
  const std::string arg = argc > 1 ? argv[1] : "all";
  std::vector<std::string> what;
  for (size_t at = 0; at <= arg.size();) {
    const size_t comma = std::min(arg.find(',', at), arg.size());
    what.push_back(arg.substr(at, comma - at));
    at = comma + 1;
  }
  const auto wants = [&](const char* section) {
    return std::find(what.begin(), what.end(), section) != what.end() ||
           std::find(what.begin(), what.end(), "all") != what.end();
  };
  for (const std::string& w : what) {
    if (w != "device" && w != "budget" && w != "host" && w != "hints" && w != "launch" && w != "all") {
      std::fprintf(stderr, "usage: walk_grid_probe [device|budget|host|hints|launch|all[,...]] [reps]\n");
      return 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each row out as it is timed (a run cut short keeps them)
  Probe probe(argc > 2 ? std::atoi(argv[2]) : 50);
  std::printf("%s, %d SMs, L2 %d MiB, %d reps\n", probe.prop.name, probe.sms, probe.prop.l2CacheSize >> 20,
              probe.reps);
  if (wants("device")) run_device(probe);
  if (wants("budget")) run_budget(probe);
  if (wants("host")) run_host(probe);
  if (wants("hints")) run_hints(probe);
  if (wants("launch")) run_launch(probe);
  return 0;
}
