// CUDA implementation of kvlayout::copy_rows: the kernel and the policy
// (CudaRows) that the launcher shared with SYCL (copy_rows_launch.h) runs it
// with. copy_rows.cu registers it; the launches' kernel instances are compiled
// in copy_rows_vec*.cu, one file per vector width (see
// KVLAYOUT_CUDA_ROWS_INSTANCES below).
//
// No host synchronisation, no allocation: the segment base pointers travel
// by value in the kernel parameters (__grid_constant__), so the op can be
// captured in a CUDA graph. Out-of-range slots are skipped on the device and
// recorded in `status` (see copy_rows_kernel.h). Source and destination may
// be CUDA tensors of the launch device or pinned host memory (zero-copy).
//
// Two variants of one kernel body (copy_rows_walk in copy_rows_kernel.h): the
// device variant (both sides in device memory; kDeviceUnroll loads in flight
// per thread) and the host variant (either side pinned host memory;
// kHostUnroll loads in flight per thread for PCIe latency). The device
// variant's wide rows and the host variant's rows of launches up to 64 MiB
// move one per CTA instead (copy_one_row, the same address math; see
// kRowPerCtaMinBytes).
//
// CTA budget (max_ctas): 0 selects the default, one full wave of resident
// 256-thread CTAs (occupancy of the compiled kernel) for the device variant
// and 1 per SM for the host variant (a long transfer beside the forward
// pass should leave SMs to it; an early-loads launch a quarter of that, see
// CudaRows::launch), unless its rows move one per CTA (below); n > 0 means
// n SMs: at most n CTAs of 1024 threads, the most one CTA may have, so that
// each SM of the budget is used fully.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <type_traits>

#include "../copy_rows_launch.h"
#include "cuda_common.h"
#include "kvlayout/copy_rows_kernel.h"

namespace kvlayout {
// A named namespace: CudaRows::launch's instances are compiled in other files
// than the one that calls them.
namespace cuda_rows {


constexpr int kDefaultCtasPerSmHost = 1;
// A budgeted launch (max_ctas = n > 0) runs n CTAs of kBudgetThreads: one
// 256-thread CTA cannot keep an SM's store path busy (a 256-thread CTA
// stored about a third of what 1024 threads of one SM store to pinned
// memory). At 1024 threads a thread has 64 registers, and the loads in
// flight per thread drop to what fits them (kBudgetDeviceUnroll,
// kBudgetHostUnroll in copy_rows_kernel.h).
constexpr int kBudgetThreads = 1024;
// The host variant is the one launch_variant instantiates with kHostUnroll.
template <int UNROLL>
constexpr bool kIsHostVariant = UNROLL == kHostUnroll;
template <int UNROLL>
constexpr int budget_unroll() {
  return kIsHostVariant<UNROLL> ? kBudgetHostUnroll : kBudgetDeviceUnroll;
}

// Vector loads/stores with streaming (evict-first) cache hints
// (kStreamingHints), or with the default cache operators (kDefaultHints).
template <int VEC>
struct StreamingMem {
  using vec_type = VecOf<VEC, uint4, uint2>;
  static_assert(sizeof(vec_type) == VEC, "vector type of the wrong width");
  __device__ static vec_type load(const vec_type* p) { return __ldcs(p); }
  __device__ static void store(vec_type* p, vec_type v) { __stcs(p, v); }
};
template <int VEC>
struct DefaultMem {
  using vec_type = VecOf<VEC, uint4, uint2>;
  __device__ static vec_type load(const vec_type* p) { return *p; }
  __device__ static void store(vec_type* p, vec_type v) { *p = v; }
};

// The CUDA backend of copy_rows_launch.h.
struct CudaRows : cuda::Backend {
  // Segment tables per launch, in two sizes: a launch passes its whole
  // parameter block, and its host cost grows with it, so a layer call (K and
  // V of one layer: 2 segments) carries a table of 8, others one of 128
  // (about 2 KiB, under the classic 4 KiB parameter limit); calls with more
  // segments are split into launches of 128.
  static constexpr int kFewSegments = 8;
  static constexpr int kMaxSegmentsPerLaunch = 128;
  static constexpr size_t kMaxParamBytes = 4096;


  // Programmatic dependent launch needs compute capability 9.0 or later.
  static bool supports_dependent_launch(c10::Device dev) {
    return at::cuda::getDeviceProperties(dev.index())->major >= 9;
  }

  template <int VEC, int UNROLL, class P>
  static void launch(const P& p, int64_t max_ctas, bool host, bool dependent, bool early_loads,
                     cudaStream_t stream);
};

// Programmatic dependent launch (consecutive layer calls): a kernel launched
// with that attribute may start while the previous kernel of the stream still
// runs. griddepcontrol.wait waits for that kernel to end and its writes to be
// visible (without the attribute it returns at once);
// griddepcontrol.launch_dependents lets the next kernel, if launched with the
// attribute, start once every CTA of this grid has issued it or ended.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The walk's before_write of an early-loads kernel: the thread's first write
// waits for the previous kernel (once), then lets the next one start if the
// launch says so (kNextAfterWait).
struct WaitOnce {
  bool pending = true;
  bool next_after_wait = false;
  __device__ void operator()() {
    if (pending) {
      wait_for_previous_kernel();
      if (next_after_wait) let_next_kernel_start();
      pending = false;
    }
  }
};

// EARLY_LOADS: the launcher proved that no kernel that may still run when
// this one starts writes anything this launch reads (LaunchOrder in
// cuda_common.h), so the loads of a thread's first batch are issued before
// the wait and their PCIe round trip overlaps the previous kernels; every
// write still waits. Each thread waits before it exits, so this grid never
// ends before the previous one (the launcher's record relies on that).
// p.a.next_start (NextStart) says when the next kernel may start: a launch
// without programmatic dependent launch never lets it start early, so that
// it is an ordinary kernel to the launches after it.
// HINTS (CacheHints): the loads' and stores' cache operators. A kernel
// compiles one walk: the launch picks the kernel of its hints
// (p.a.cache_hints; a device-memory launch always streams). Both walks in
// one kernel, chosen per thread, doubled the code (3,171 PTX instructions
// against 1,548 for the 16-byte device variant) and, at the 64 registers of
// a 1024-thread CTA, spilled 128-144 bytes of the 16-byte budget host walk
// (stores; 208-232 loaded back) where one walk spilled 56-108 (80-136), and
// 16-32 (20-36) since the walk's TokenRows keeps less.
template <int VEC, int UNROLL, class P, bool EARLY_LOADS, int HINTS,
          int THREADS = kCopyThreadsPerBlock>
__global__ void __launch_bounds__(THREADS) copy_rows_kernel(const __grid_constant__ P p) {
  using Mem = std::conditional_t<HINTS == kDefaultHints, DefaultMem<VEC>, StreamingMem<VEC>>;
  if constexpr (EARLY_LOADS) {
    if (p.a.next_start == kNextAtOnce) let_next_kernel_start();
  } else {
    wait_for_previous_kernel();  // before touching memory
    if (p.a.next_start != kNextAfterEnd) let_next_kernel_start();
  }
  // The segment table, read once per CTA from the parameter block: lanes of
  // one warp index it with different segments, which the constant cache
  // would serialize.
  __shared__ const char* src_base[P::kMaxSegments];
  __shared__ char* dst_base[P::kMaxSegments];
  for (int64_t j = threadIdx.x; j < p.a.num_segments; j += blockDim.x) {
    src_base[j] = p.src_base[j];
    dst_base[j] = p.dst_base[j];
  }
  __syncthreads();
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_threads = int64_t(gridDim.x) * blockDim.x;
  if constexpr (EARLY_LOADS) {
    WaitOnce before_write{true, p.a.next_start == kNextAfterWait};
    copy_rows_walk<VEC, UNROLL, Mem>(p.a, src_base, dst_base, thread, num_threads,
                                     cuda::StatusRecorder{p.a.status}, before_write);
    before_write();
  } else {
    copy_rows_walk<VEC, UNROLL, Mem>(p.a, src_base, dst_base, thread, num_threads,
                                     cuda::StatusRecorder{p.a.status});
  }
}

// Rows moved one per CTA (copy_one_row): blockIdx.x the token, blockIdx.y
// the segment, the row's words strided over at most kRowPerCtaThreads
// threads (the device variant's shorter rows several to a CTA, threadIdx.y
// the row: kDeviceRowsPerWarpCta, kDeviceRowsPerSmallCta).
// * The device variant's rows of kRowPerCtaMinBytes and more, in its vectors,
//   and its rows of one warp of 16-byte vectors (kDeviceWarpRowMinBytes).
//   On an H100 (scripts/walk_grid_probe.cu, the gathers of the bench's
//   shapes) this shape took 0.86-0.96x the walk's time on rows of 1,152 and
//   2,048 bytes at T = 256, 1,024 and 4,096, and 1.7-2.9x on 256-byte rows
//   (16 of its threads busy).
// * The host variant's rows of kHostRowPerCtaMinBytes and more, in 8-byte
//   words, in launches of up to kHostRowPerCtaMaxBytes without an SM budget
//   or early loads, unless host_launch_shape() says kHostWalk. On H100s
//   (walk_grid_probe.cu host: L32 H1, H8 and MLA at T = 256 and 4,096, each
//   way) this shape moved as much of the pinned copy's rate as the walk of
//   one CTA per SM or more on every row, the most on small stores (L32 H1 at
//   T = 256 to the host: 99.2-100 % against 96.3-97.2 %); beside it in one
//   process (bench/side_by_side.py, H100 of c8984fe) the library's stores at
//   T = 256 ran 1.02-1.08x the walk's rate, level with LMCache's kernel of
//   this shape, whose warps wait on loads where the walk's waited for their
//   last stores to drain (H200 counters of 29be2ee). Above the bound the
//   walk keeps its one CTA per SM: one CTA per row would hold every SM's CTA
//   slots for a long transfer's whole length beside the forward pass
//   (max_ctas bounds that explicitly), and the two moved long stores at the
//   same rate within 0.7 points at T = 4,096 (long loads too, where the SMs
//   read pinned memory at the copy engine's rate; where they read it slowly,
//   auto stages them).
constexpr int64_t kRowPerCtaMinBytes = 1024;
constexpr int64_t kHostRowPerCtaMinBytes = 256;
// (kHostRowPerCtaMaxBytes: program.h)
constexpr int kHostRowWordBytes = 8;
constexpr int kRowPerCtaThreads = 128;
// The device variant's rows of fewer than kRowPerCtaThreads threads (rows of
// 1,024-1,536 bytes: MLA's 1,152) move this many to a CTA: on an H100
// (walk_grid_probe.cu device, rows_per_cta_kernel, bench/results/
// h100_2f690c0/walk_probe.txt) two MLA rows a CTA took 0.96-0.97x one row's
// time at T = 256 and 1,024 (L32 and L61), four and eight no less than two;
// rows of 2,048 bytes (128 threads) were fastest one to a CTA.
constexpr int kDeviceRowsPerSmallCta = 2;
// The device variant's rows of one warp or less in 16-byte vectors (256-512
// bytes: L32 H1's 256), which the walk moved before, move this many to a CTA,
// a thread per vector: on an H100 (walk_grid_probe.cu device, bench/results/
// h100_4566555/walk_probe.txt) eight 256-byte rows a CTA of 16 threads each
// took 0.86-0.97x the walk's time at T = 256, 1,024, 4,096 and 32,768 (8.19
// against 8.45 µs; 364.6 against 390.8), four 0.89-0.97x, two 1.16-1.63x.
constexpr int kDeviceRowsPerWarpCta = 8;
constexpr int64_t kDeviceWarpRowMinBytes = 256;

// ROWS rows per CTA: threadIdx.y picks the CTA's row, blockIdx.x * ROWS + threadIdx.y the token.
template <int VEC, int WORD, class P, int HINTS, int ROWS>
__global__ void __launch_bounds__(kRowPerCtaThreads * ROWS) copy_row_per_cta_kernel(
    const __grid_constant__ P p) {
  using Mem = std::conditional_t<HINTS == kDefaultHints, DefaultMem<WORD>, StreamingMem<WORD>>;
  wait_for_previous_kernel();  // before touching memory
  if (p.a.next_start != kNextAfterEnd) let_next_kernel_start();
  const int64_t t = int64_t(blockIdx.x) * ROWS + threadIdx.y;
  if (ROWS > 1 && t >= p.a.tokens) return;
  copy_one_row<VEC, Mem>(p.a, p.src_base[blockIdx.y], p.dst_base[blockIdx.y], t,
                         blockIdx.y, threadIdx.x, blockDim.x, cuda::StatusRecorder{p.a.status});
}

// Whether a launch of the host (HOST) or device variant moves its rows one
// per CTA (see kRowPerCtaMinBytes), and in words of how many bytes.
template <int VEC, bool HOST>
constexpr int row_per_cta_word() {
  if constexpr (VEC < 8) return 0;  // (8- and 16-byte words only: the widths measured so)
  else return HOST ? kHostRowWordBytes : VEC;
}
template <int VEC, bool HOST, class P>
bool moves_row_per_cta(const P& p, int64_t max_ctas, bool early_loads) {
  if constexpr (row_per_cta_word<VEC, HOST>() == 0) {
    return false;
  } else {
    const int64_t row_bytes = p.a.vecs_per_row * VEC;
    if (max_ctas != 0 || p.a.tokens <= 0 || p.a.tokens >= (int64_t(1) << 31)) return false;
    if (!HOST)
      return row_bytes >= kRowPerCtaMinBytes ||
             (VEC == 16 && row_bytes >= kDeviceWarpRowMinBytes && p.a.vecs_per_row <= kWalkLanes);
    return !early_loads && host_launch_shape() == kHostRowPerCta &&
           row_bytes >= kHostRowPerCtaMinBytes &&
           p.a.tokens * p.a.num_segments <= kHostRowPerCtaMaxBytes / row_bytes;
  }
}

// The kernel of a launch of the host (HOST) or device variant, with these
// loads in flight, loads' start and CTA size: for the host variant, the one
// of p.a.cache_hints; the device variant is compiled with streaming hints
// only, which a device-memory launch always has.
template <int VEC, int UNROLL, class P, bool EARLY_LOADS, bool HOST,
          int THREADS = kCopyThreadsPerBlock>
auto* kernel_for(const P& p) {
  if constexpr (HOST) {
    if (p.a.cache_hints == kDefaultHints)
      return &copy_rows_kernel<VEC, UNROLL, P, EARLY_LOADS, kDefaultHints, THREADS>;
  }
  return &copy_rows_kernel<VEC, UNROLL, P, EARLY_LOADS, kStreamingHints, THREADS>;
}

// CTAs of one kernel instance resident on one SM at once, from the compiled
// kernel's registers and shared memory (same for every device of one build's
// architecture).
template <int VEC, int UNROLL, class P>
int64_t resident_ctas_per_sm() {
  static const int64_t ctas = [] {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, copy_rows_kernel<VEC, UNROLL, P, false, kStreamingHints>, kCopyThreadsPerBlock, 0));
    return std::max(n, 1);
  }();
  return ctas;
}

// Grid size: max_ctas CTAs of kBudgetThreads when given; else one CTA per SM for host memory (the
// host variant keeps 64 KiB in flight per CTA), and for device memory every
// CTA that is resident at once (one full wave: the work is split evenly over
// the grid, so CTAs beyond one wave would run a second, partial wave at a
// fraction of the occupancy). An early-loads launch (a dependent launch of
// the host variant that LaunchOrder allowed) takes at most a quarter of the
// SMs, so that the launches of a layer pipeline that run at once find SMs for
// their early loads (eight CTAs already carry a PCIe link's bandwidth, while a
// launch that holds every SM keeps the next one from starting until its CTAs
// exit). Never more threads than items. A launch without a budget whose
// rows moves_row_per_cta says (device memory: rows of kRowPerCtaMinBytes
// and more; host memory: of kHostRowPerCtaMinBytes and more, up to
// kHostRowPerCtaMaxBytes a launch, no early loads; either in 8- or 16-byte
// words; device rows of one warp, of kDeviceWarpRowMinBytes and more in
// 16-byte words) runs one CTA per row instead (copy_row_per_cta_kernel;
// device rows of one warp or less kDeviceRowsPerWarpCta to a CTA, others of
// fewer than kRowPerCtaThreads threads two).
template <int VEC, int UNROLL, class P>
void CudaRows::launch(const P& p, int64_t max_ctas, bool host, bool dependent, bool early_loads,
                      cudaStream_t stream) {
  constexpr bool kHost = kIsHostVariant<UNROLL>;
  // launches `kernel` on grid x block, as a dependent launch where asked
  const auto issue = [&](auto* kernel, dim3 grid, dim3 block) {
    if (!dependent) {
      kernel<<<grid, block, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  };
  constexpr int kWord = row_per_cta_word<VEC, kHost>();
  if constexpr (kWord > 0) {
    static_assert(kMaxSegmentsPerLaunch <= 65535, "a launch's segments are its grid's y extent");
    if (moves_row_per_cta<VEC, kHost>(p, max_ctas, early_loads)) {
      const int64_t words = p.a.vecs_per_row * (VEC / kWord);
      const int64_t warps = (words + kWalkLanes - 1) / kWalkLanes;
      const int threads = static_cast<int>(std::min<int64_t>(warps * kWalkLanes, kRowPerCtaThreads));
      const auto grid = [&](int64_t rows) {
        return dim3(static_cast<unsigned>((p.a.tokens + rows - 1) / rows),
                    static_cast<unsigned>(p.a.num_segments));
      };
      if constexpr (kHost) {  // (a host launch takes its hints)
        auto* kernel = &copy_row_per_cta_kernel<VEC, kWord, P, kStreamingHints, 1>;
        if (p.a.cache_hints == kDefaultHints)
          kernel = &copy_row_per_cta_kernel<VEC, kWord, P, kDefaultHints, 1>;
        issue(kernel, grid(1), threads);
      } else if (words <= kWalkLanes) {  // (a device-memory launch always streams)
        issue(&copy_row_per_cta_kernel<VEC, kWord, P, kStreamingHints, kDeviceRowsPerWarpCta>,
              grid(kDeviceRowsPerWarpCta), dim3(static_cast<unsigned>(words), kDeviceRowsPerWarpCta));
      } else if (threads < kRowPerCtaThreads) {
        issue(&copy_row_per_cta_kernel<VEC, kWord, P, kStreamingHints, kDeviceRowsPerSmallCta>,
              grid(kDeviceRowsPerSmallCta), dim3(threads, kDeviceRowsPerSmallCta));
      } else {
        issue(&copy_row_per_cta_kernel<VEC, kWord, P, kStreamingHints, 1>, grid(1), threads);
      }
      return;
    }
  }
  const int64_t items = p.a.tokens * p.a.num_segments * p.a.vecs_per_row;
  int threads = kCopyThreadsPerBlock;
  int64_t budget;
  auto* kernel = kernel_for<VEC, UNROLL, P, false, kHost>(p);
  if (max_ctas > 0) {
    threads = kBudgetThreads;
    budget = max_ctas;
    constexpr int kUnroll = budget_unroll<UNROLL>();
    kernel = kernel_for<VEC, kUnroll, P, false, kHost, kBudgetThreads>(p);
    if constexpr (kHost) {
      if (early_loads) kernel = kernel_for<VEC, kUnroll, P, true, kHost, kBudgetThreads>(p);
    }
  } else {
    const int64_t sms = cuda::num_sms();
    budget = early_loads ? std::max<int64_t>(1, sms / 4)
             : host      ? sms * kDefaultCtasPerSmHost
                         : sms * resident_ctas_per_sm<VEC, UNROLL, P>();
    if constexpr (kHost) {
      if (early_loads) kernel = kernel_for<VEC, UNROLL, P, true, kHost>(p);
    }
  }
  const int64_t max_blocks = std::min<int64_t>(budget, (int64_t(1) << 31) - 1);
  int64_t blocks = (items + threads - 1) / threads;
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks));
  issue(kernel, dim3(static_cast<unsigned>(blocks)), threads);
}

// The instances of CudaRows::launch of one vector width: both variants, both
// segment-table sizes. KVLAYOUT_CUDA_ROWS_INSTANCES(extern, VEC) declares them
// (copy_rows.cu, which launches them); KVLAYOUT_CUDA_ROWS_INSTANCES(, VEC)
// compiles them (copy_rows_vecVEC.cu). Each width's kernels in a file of their
// own let the build compile them in parallel: in one file they were the
// build's longest step by far.
#define KVLAYOUT_CUDA_ROWS_LAUNCH(EXTERN, VEC, UNROLL, N)                                      \
  EXTERN template void CudaRows::launch<VEC, UNROLL, CopyRowsParams<N>>(                      \
      const CopyRowsParams<N>&, int64_t, bool, bool, bool, cudaStream_t)
#define KVLAYOUT_CUDA_ROWS_INSTANCES(EXTERN, VEC)                                              \
  KVLAYOUT_CUDA_ROWS_LAUNCH(EXTERN, VEC, kHostUnroll, CudaRows::kFewSegments);                 \
  KVLAYOUT_CUDA_ROWS_LAUNCH(EXTERN, VEC, kHostUnroll, CudaRows::kMaxSegmentsPerLaunch);        \
  KVLAYOUT_CUDA_ROWS_LAUNCH(EXTERN, VEC, kDeviceUnroll, CudaRows::kFewSegments);               \
  KVLAYOUT_CUDA_ROWS_LAUNCH(EXTERN, VEC, kDeviceUnroll, CudaRows::kMaxSegmentsPerLaunch)

}  // namespace cuda_rows
}  // namespace kvlayout
