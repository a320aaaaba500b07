// CUDA implementation of kvlayout::copy_rows.
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
// kHostUnroll loads in flight per thread for PCIe latency).
//
// CTA budget (max_ctas): 0 selects the default, one full wave of resident
// 256-thread CTAs (occupancy of the compiled kernel) for the device variant
// and 1 per SM for the host variant (a transfer beside the forward pass
// should leave SMs to it); n > 0 caps the grid at n CTAs.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../host_checks.h"
#include "../program.h"
#include "cuda_common.h"
#include "kvlayout/copy_rows_kernel.h"

namespace kvlayout {
namespace {

// Segment tables per launch, in two sizes: a launch passes its whole
// parameter block, and its host cost grows with it, so a layer call (K and V
// of one layer: 2 segments) carries a table of 8, others one of 128 (about
// 2 KiB, under the classic 4 KiB parameter limit); calls with more segments
// are split into launches of 128.
constexpr int kFewSegments = 8;
constexpr int kMaxSegmentsPerLaunch = 128;
static_assert(sizeof(CopyRowsParams<kMaxSegmentsPerLaunch>) <= 4096,
              "copy_rows parameters exceed 4 KiB");

constexpr int kDefaultCtasPerSmHost = 1;

// Vector loads/stores with streaming (evict-first) cache hints.
template <class T>
struct StreamingMemOf {
  using vec_type = T;
  __device__ static vec_type load(const vec_type* p) { return __ldcs(p); }
  __device__ static void store(vec_type* p, vec_type v) { __stcs(p, v); }
};
template <int VEC>
struct StreamingMem;
template <>
struct StreamingMem<16> : StreamingMemOf<uint4> {};
template <>
struct StreamingMem<8> : StreamingMemOf<uint2> {};
template <>
struct StreamingMem<4> : StreamingMemOf<unsigned int> {};
template <>
struct StreamingMem<2> : StreamingMemOf<unsigned short> {};
template <>
struct StreamingMem<1> : StreamingMemOf<unsigned char> {};

template <int VEC, int UNROLL, class P>
__global__ void __launch_bounds__(kCopyThreadsPerBlock)
    copy_rows_kernel(const __grid_constant__ P p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent launch (consecutive layer calls),
  // the kernel may start while the previous kernel of the stream still runs:
  // wait for it to finish and its writes to be visible before touching
  // memory, then let the next dependent launch start its CTAs. Without that
  // launch attribute both instructions do nothing.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
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
  copy_rows_walk<VEC, UNROLL, StreamingMem<VEC>>(p.a, src_base, dst_base, thread, num_threads,
                                                 cuda::StatusRecorder{p.a.status});
}

// CTAs of one kernel instance resident on one SM at once, from the compiled
// kernel's registers and shared memory (same for every device of one build's
// architecture).
template <int VEC, int UNROLL, class P>
int64_t resident_ctas_per_sm() {
  static const int64_t ctas = [] {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, copy_rows_kernel<VEC, UNROLL, P>, kCopyThreadsPerBlock, 0));
    return std::max(n, 1);
  }();
  return ctas;
}

// Whether the device supports programmatic dependent launch (compute
// capability 9.0 and later).
bool supports_dependent_launch(c10::DeviceIndex dev) {
  return at::cuda::getDeviceProperties(dev)->major >= 9;
}

// Grid size: max_ctas when given; else one CTA per SM for host memory (the
// host variant keeps 64 KiB in flight per CTA), and for device memory every
// CTA that is resident at once (one full wave: the work is split evenly over
// the grid, so CTAs beyond one wave would run a second, partial wave at a
// fraction of the occupancy). Never more threads than items.
template <int VEC, int UNROLL, class P>
void launch(const P& p, int64_t max_ctas, bool host, bool dependent, cudaStream_t stream) {
  const int64_t budget =
      max_ctas > 0 ? max_ctas
                   : int64_t(cuda::num_sms()) *
                         (host ? kDefaultCtasPerSmHost : resident_ctas_per_sm<VEC, UNROLL, P>());
  const int64_t max_blocks = std::min<int64_t>(budget, (int64_t(1) << 31) - 1);
  const int64_t items = p.a.tokens * p.a.num_segments * p.a.vecs_per_row;
  int64_t blocks = (items + kCopyThreadsPerBlock - 1) / kCopyThreadsPerBlock;
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, max_blocks));
  auto* kernel = copy_rows_kernel<VEC, UNROLL, P>;
  if (!dependent) {
    kernel<<<static_cast<unsigned>(blocks), kCopyThreadsPerBlock, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kCopyThreadsPerBlock);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

// The host variant when either side is host memory, else the device variant.
template <int VEC, class P>
void launch_variant(const P& p, int64_t max_ctas, bool host, bool dependent,
                    cudaStream_t stream) {
  if (host)
    launch<VEC, kHostUnroll>(p, max_ctas, host, dependent, stream);
  else
    launch<VEC, kDeviceUnroll>(p, max_ctas, host, dependent, stream);
}

// One launch with a segment table of N entries: `a` and segments
// [first, first + a.num_segments) of the bound bases.
template <int N>
void launch_table(const CopyRowsArgs& a, const std::vector<const char*>& src_bases,
                  const std::vector<char*>& dst_bases, int64_t first, int vec, bool host,
                  int64_t max_ctas, bool dependent, cudaStream_t stream) {
  CopyRowsParams<N> p;
  p.a = a;
  std::copy_n(src_bases.begin() + first, a.num_segments, p.src_base);
  std::copy_n(dst_bases.begin() + first, a.num_segments, p.dst_base);
  switch (vec) {
    case 16: launch_variant<16>(p, max_ctas, host, dependent, stream); break;
    case 8: launch_variant<8>(p, max_ctas, host, dependent, stream); break;
    case 4: launch_variant<4>(p, max_ctas, host, dependent, stream); break;
    case 2: launch_variant<2>(p, max_ctas, host, dependent, stream); break;
    default: launch_variant<1>(p, max_ctas, host, dependent, stream); break;
  }
}

// Which device runs the op: the first CUDA tensor among dst, src, slots, status.
c10::Device launch_device(at::TensorList src, at::TensorList dst,
                          const std::optional<at::Tensor>& src_slots,
                          const std::optional<at::Tensor>& dst_slots, const at::Tensor& status) {
  if (const auto dev = cuda::first_cuda_device(dst, src)) return *dev;
  if (src_slots.has_value() && src_slots->is_cuda()) return src_slots->device();
  if (dst_slots.has_value() && dst_slots->is_cuda()) return dst_slots->device();
  TORCH_CHECK(status.is_cuda(), "kvlayout::copy_rows: no CUDA tensor among the arguments");
  return status.device();
}

// A launch bound to tensors: device addresses, vector width and the segment
// bases of each <= kMaxSegmentsPerLaunch chunk are resolved once; a run
// fills in the slots and token counts and launches.
class CudaLaunch final : public BoundLaunch {
 public:
  CudaLaunch(const CopyPlan& plan, at::TensorList src, at::TensorList dst, c10::Device dev,
             const at::Tensor& status)
      : dev_(dev), dependent_ok_(supports_dependent_launch(dev.index())) {
    check_status_tensor(status, dev);
    // Device-visible addresses of every tensor (pinned host memory through UVA).
    SegmentBases bases =
        segment_bases(plan, src, dst, [&](const at::Tensor& t, bool is_src, int64_t i) {
          char* address = cuda::device_address(t, dev, is_src ? "src" : "dst", i);
          if (!t.is_cuda()) (is_src ? host_src_ : host_dst_).emplace_back(i, address);
          return address;
        });
    touches_host_ = !host_src_.empty() || !host_dst_.empty();
    vec_ = bases.vec_bytes;
    src_bases_ = std::move(bases.src);
    dst_bases_ = std::move(bases.dst);
    for (int64_t first = 0; first < plan.num_segments; first += kMaxSegmentsPerLaunch) {
      CopyRowsArgs a{};
      a.src_geom = plan.src_geom;
      a.dst_geom = plan.dst_geom;
      a.num_segments = std::min<int64_t>(kMaxSegmentsPerLaunch, plan.num_segments - first);
      a.status = status.data_ptr<int64_t>();
      a.record_errors = first == 0 ? 1 : 0;
      prepare_copy_rows_args(a, plan.num_pieces, plan.piece_bytes / vec_);
      chunks_.push_back({a, first});
    }
  }

  void run(const CopyPlan& plan, const SlotArray& src_slots, const SlotArray& dst_slots,
           const RunArgs& args) const override {
    const c10::cuda::CUDAGuard guard(dev_);
    if (args.validate) {
      validate_slots_on_host(plan_for_run(plan, src_slots, dst_slots, args), args.src_slots,
                             args.dst_slots);
    }
    SlotArray ss = src_slots, ds = dst_slots;
    ss.data = cuda::index_address(args.src_slots, dev_, "src_slots");
    ds.data = cuda::index_address(args.dst_slots, dev_, "dst_slots");
    const bool dependent = args.dependent_launch && dependent_ok_;
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev_.index()).stream();
    for (const Chunk& chunk : chunks_) {
      CopyRowsArgs a = chunk.args;  // a bound launch may run on several threads at once
      a.src_slots = ss;
      a.dst_slots = ds;
      a.skip_prefix = args.skip_prefix;
      a.tokens = args.num_tokens - args.skip_prefix;
      if (a.num_segments <= kFewSegments)
        launch_table<kFewSegments>(a, src_bases_, dst_bases_, chunk.first, vec_, touches_host_,
                                   args.max_ctas, dependent, stream);
      else
        launch_table<kMaxSegmentsPerLaunch>(a, src_bases_, dst_bases_, chunk.first, vec_,
                                            touches_host_, args.max_ctas, dependent, stream);
    }
  }

  // A host tensor at the same address must still be pinned with the same
  // device alias (it may have been freed and its address reused).
  bool still_valid(at::TensorList src, at::TensorList dst) const override {
    auto same_alias = [&](const at::Tensor& t, const char* alias) {
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, t.data_ptr()) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      return attr.type == cudaMemoryTypeHost && attr.devicePointer == alias;
    };
    for (const auto& [i, alias] : host_src_)
      if (!same_alias(src[i], alias)) return false;
    for (const auto& [j, alias] : host_dst_)
      if (!same_alias(dst[j], alias)) return false;
    return true;
  }

 private:
  c10::Device dev_;
  // Launches of at most kMaxSegmentsPerLaunch segments each: their slot-free
  // arguments and the index of their first segment in src_bases_/dst_bases_.
  struct Chunk {
    CopyRowsArgs args;
    int64_t first;
  };
  std::vector<Chunk> chunks_;
  std::vector<const char*> src_bases_;
  std::vector<char*> dst_bases_;
  std::vector<std::pair<int64_t, const char*>> host_src_, host_dst_;
  bool touches_host_ = false;
  bool dependent_ok_ = false;  // the device supports programmatic dependent launch
  int vec_ = 16;
};

std::unique_ptr<BoundLaunch> make_cuda_launch(const CopyPlan& plan, at::TensorList src,
                                              at::TensorList dst, c10::Device device,
                                              const at::Tensor& status) {
  const c10::cuda::CUDAGuard guard(device);
  return std::make_unique<CudaLaunch>(plan, src, dst, device, status);
}

const bool registered =
    (register_bound_launch_factory(c10::DeviceType::CUDA, &make_cuda_launch), true);

void copy_rows_cuda(at::TensorList src, at::TensorList dst,
                    const std::optional<at::Tensor>& src_slots,
                    const std::optional<at::Tensor>& dst_slots, int64_t num_tokens,
                    int64_t skip_prefix, c10::IntArrayRef src_segments,
                    c10::IntArrayRef dst_segments, c10::IntArrayRef src_geometry,
                    c10::IntArrayRef dst_geometry, int64_t num_pieces, int64_t piece_bytes,
                    int64_t max_ctas, const at::Tensor& status, bool validate) {
  const CopyPlan plan =
      plan_copy_rows(src, dst, src_slots, dst_slots, num_tokens, skip_prefix, src_segments,
                     dst_segments, src_geometry, dst_geometry, num_pieces, piece_bytes, max_ctas);
  const c10::Device dev = launch_device(src, dst, src_slots, dst_slots, status);
  const c10::cuda::CUDAGuard guard(dev);
  check_status_tensor(status, dev);
  if (plan.empty()) return;
  const RunArgs args{src_slots, dst_slots, plan.num_tokens, plan.skip_prefix, max_ctas, validate};
  CudaLaunch(plan, src, dst, dev, status).run(plan, plan.src_slots, plan.dst_slots, args);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) { m.impl("copy_rows", &copy_rows_cuda); }

}  // namespace kvlayout
