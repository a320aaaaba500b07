// graph_launch_probe.cu — the host's cost of one cudaGraphLaunch of graphs
// shaped like the staged host transfer's (torch_ext/cuda/staged.cu), by node
// kind and topology: a replayed staged graph costs 1-1.7 us of host time per
// node, and this tells which nodes and edges that time goes to. Only the CUDA
// runtime and the C++ standard library; not part of the library.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 scripts/graph_launch_probe.cu -o graph_launch_probe
//   ./graph_launch_probe [reps] [sections]
//       (default 30 reps, after 3 warmup launches; sections: their numbers
//       joined by commas, e.g. 3,13; default all; the baseline always runs)
//
// Every graph is captured from streams (a non-blocking `main`, and a
// non-blocking `side` forked and joined through events as staged.cu does),
// instantiated once, uploaded once on the launch stream and launched `warmup`
// times. Then per rep: the launch stream is synchronized (the device idle),
// an event is recorded, the cudaGraphLaunch call alone is timed on the host
// (steady_clock), and a second event is recorded after it. Graphs of C chunks
// of 256 KiB (short device work) for C = 4 .. 64, and the store and load at
// the engine's real chunk of 32 MiB (C = 16).
//
// Sections, in order: the baseline (a bare kernel launch, a one-node graph),
// then 1. kernels on one stream, 2. device -> host copies on one stream,
// 3. the staged store, 4. the store with its keep kernel, 5. the staged load,
// 6. the store with the copy engine's copies replaced by kernels, 7. the
// store's nodes on one stream, 8. the store with 2-D copies, 9. kernels on
// one stream with programmatic (PDL) edges, 10. the store whose kernels take
// a parameter block the size of the library's largest (2,336 bytes: 128
// segment bases), 11. the store with 3-D copies (the engine folds runs of
// blocks into them), 12. the store of 16 chunks again
// as the process holds more of what a serving process holds (pinned buffers
// by the thousand and by the GiB, other instantiated graphs): whether a copy
// node's launch cost grows with them; beside, a replayed call's copy of its
// slots into the graph's buffer, by cudaMemcpyAsync and by a kernel; 13. the
// same store graph and slot copies launched on the legacy default stream
// (torch's current stream unless the caller set one) instead.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

constexpr size_t kKiB = 1024, kMiB = 1024 * kKiB;
constexpr int kThreads = 256;
constexpr size_t kKeepBytes = 4 * kKiB;  // the keep kernel's copy: small, its host cost is the point
constexpr int k2dRows = 64;              // rows of a 2-D copy; the host pitch is twice its width

__global__ void empty_kernel() {}

// The copy's arguments in a parameter block the size of the library's
// 128-segment launch (copy_rows_kernel.h): whether a kernel node's launch
// cost grows with its parameters.
struct BigParams {
  uint4* dst;
  const uint4* src;
  size_t n;
  char table[2336 - 3 * sizeof(void*)];
};

__global__ void copy_words_big(const __grid_constant__ BigParams p) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += size_t(gridDim.x) * blockDim.x)
    p.dst[i] = p.src[i];
}

// Grid-stride copy of n 16-byte words.
__global__ void copy_words(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// The same copy launched as a programmatic dependent: it may start before the
// kernel ahead of it ends, so it waits for that kernel's memory first.
__global__ void copy_words_dependent(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  cudaGridDependencySynchronize();
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// (in section order: a topology's section is its value + 1)
enum class Topo {
  Kernels, Copies, Store, StoreKeep, Load, StoreKernelCopies, StoreOneStream, Store2D, KernelsPdl,
  StoreBigParams, Store3D
};

const char* topo_name(Topo t) {
  switch (t) {
    case Topo::Kernels: return "kernels, one stream";
    case Topo::Copies: return "copies, one stream";
    case Topo::Store: return "store";
    case Topo::StoreKeep: return "store with keep";
    case Topo::Load: return "load";
    case Topo::StoreKernelCopies: return "store, copies as kernels";
    case Topo::StoreOneStream: return "store, one stream";
    case Topo::Store2D: return "store, 2-D copies";
    case Topo::KernelsPdl: return "kernels, programmatic";
    case Topo::StoreBigParams: return "store, 2,336-byte parameters";
    case Topo::Store3D: return "store, 3-D copies";
  }
  return "?";
}

struct Case {
  Topo topo;
  int chunks;
  size_t chunk_bytes;
};

// The pinned host bytes a case reads or writes (a 2-D copy's rows lie at
// twice their width apart).
size_t host_bytes(const Case& c) {
  return c.chunks * c.chunk_bytes * (c.topo == Topo::Store2D || c.topo == Topo::Store3D ? 2 : 1);
}

struct Probe {
  cudaStream_t main = nullptr, side = nullptr, launch = nullptr;
  // the graph's dependencies, reused across chunks as staged.cu reuses them
  cudaEvent_t filled[2] = {}, drained[2] = {}, fork = nullptr, join = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr;  // timing, on the launch stream
  char* cache = nullptr;                       // device: chunks * chunk_bytes
  char* ring[2] = {};                          // device: two slots of chunk_bytes
  char* sink = nullptr;                        // device: where "copies as kernels" write
  char* host = nullptr;                        // pinned
  int grid = 0;

  void copy(cudaStream_t s, void* dst, const void* src, size_t bytes) const {
    copy_words<<<grid, kThreads, 0, s>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16);
    CHECK(cudaGetLastError());
  }
  void copy_big(cudaStream_t s, void* dst, const void* src, size_t bytes) const {
    BigParams params{};
    params.dst = static_cast<uint4*>(dst);
    params.src = static_cast<const uint4*>(src);
    params.n = bytes / 16;
    copy_words_big<<<grid, kThreads, 0, s>>>(params);
    CHECK(cudaGetLastError());
  }
  void copy_dependent(cudaStream_t s, void* dst, const void* src, size_t bytes) const {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = 0;
    config.stream = s;
    config.attrs = &attr;
    config.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&config, copy_words_dependent, static_cast<uint4*>(dst),
                             static_cast<const uint4*>(src), bytes / 16));
  }
};

// `waiter` waits for what `stream` has queued so far, through `event`
// (staged.cu's join).
void join(cudaEvent_t event, cudaStream_t stream, cudaStream_t waiter) {
  CHECK(cudaEventRecord(event, stream));
  CHECK(cudaStreamWaitEvent(waiter, event, 0));
}

// The staged store's issue loop (its variants differ in the copy out and
// where it runs): the kernel fills ring slot r on main, the copy engine
// drains it on side, and slot r is refilled only after it drained.
void issue_store(const Probe& p, const Case& k) {
  const size_t cb = k.chunk_bytes;
  const bool one_stream = k.topo == Topo::StoreOneStream;
  const cudaStream_t out = one_stream ? p.main : p.side;
  if (!one_stream) join(p.fork, p.main, p.side);
  for (int c = 0; c < k.chunks; ++c) {
    const int r = c % 2;
    if (!one_stream && c >= 2) CHECK(cudaStreamWaitEvent(p.main, p.drained[r], 0));
    if (k.topo == Topo::StoreKeep) p.copy(p.main, p.ring[r], p.cache + c * cb, kKeepBytes);
    if (k.topo == Topo::StoreBigParams)
      p.copy_big(p.main, p.ring[r], p.cache + c * cb, cb);
    else
      p.copy(p.main, p.ring[r], p.cache + c * cb, cb);
    if (!one_stream) join(p.filled[r], p.main, p.side);
    if (k.topo == Topo::StoreKernelCopies) {
      p.copy(out, p.sink + c * cb, p.ring[r], cb);
    } else if (k.topo == Topo::Store2D) {
      const size_t width = cb / k2dRows;  // the ring side contiguous, the host side at twice the width
      CHECK(cudaMemcpy2DAsync(p.host + c * 2 * cb, 2 * width, p.ring[r], width, width, k2dRows,
                              cudaMemcpyDeviceToHost, out));
    } else if (k.topo == Topo::Store3D) {
      // two blocks of k2dRows / 2 rows each, the host's rows at twice their width apart
      const size_t width = cb / k2dRows;
      cudaMemcpy3DParms params{};
      params.srcPtr = make_cudaPitchedPtr(p.ring[r], width, width, k2dRows / 2);
      params.dstPtr = make_cudaPitchedPtr(p.host + c * 2 * cb, 2 * width, width, k2dRows / 2);
      params.extent = make_cudaExtent(width, k2dRows / 2, 2);
      params.kind = cudaMemcpyDeviceToHost;
      CHECK(cudaMemcpy3DAsync(&params, out));
    } else {
      CHECK(cudaMemcpyAsync(p.host + c * cb, p.ring[r], cb, cudaMemcpyDeviceToHost, out));
    }
    if (!one_stream) CHECK(cudaEventRecord(p.drained[r], out));
  }
  if (!one_stream) join(p.join, p.side, p.main);  // a capture needs every forked stream joined
}

// The staged load's issue loop: the copy engine fills ring slot r on side,
// the kernel drains it into the cache on main. Side is forked first, as the
// engine's capture does (fork_side), so that its copies are captured.
void issue_load(const Probe& p, const Case& k) {
  const size_t cb = k.chunk_bytes;
  join(p.fork, p.main, p.side);
  for (int c = 0; c < k.chunks; ++c) {
    const int r = c % 2;
    if (c >= 2) CHECK(cudaStreamWaitEvent(p.side, p.drained[r], 0));
    CHECK(cudaMemcpyAsync(p.ring[r], p.host + c * cb, cb, cudaMemcpyHostToDevice, p.side));
    join(p.filled[r], p.side, p.main);
    p.copy(p.main, p.cache + c * cb, p.ring[r], cb);
    CHECK(cudaEventRecord(p.drained[r], p.main));
  }
  join(p.join, p.side, p.main);
}

cudaGraph_t capture(const Probe& p, const Case& k) {
  const size_t cb = k.chunk_bytes;
  CHECK(cudaStreamBeginCapture(p.main, cudaStreamCaptureModeThreadLocal));
  switch (k.topo) {
    case Topo::Kernels:  // 2C nodes, as many as the store's
      for (int i = 0; i < 2 * k.chunks; ++i) p.copy(p.main, p.ring[i % 2], p.cache + (i / 2) * cb, cb);
      break;
    case Topo::KernelsPdl:
      for (int i = 0; i < 2 * k.chunks; ++i) p.copy_dependent(p.main, p.ring[i % 2], p.cache + (i / 2) * cb, cb);
      break;
    case Topo::Copies:
      for (int i = 0; i < 2 * k.chunks; ++i)
        CHECK(cudaMemcpyAsync(p.host + (i / 2) * cb, p.ring[i % 2], cb, cudaMemcpyDeviceToHost, p.main));
      break;
    case Topo::Load:
      issue_load(p, k);
      break;
    default:
      issue_store(p, k);
      break;
  }
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(p.main, &graph));
  return graph;
}

struct Timing {
  double host_med = 0, host_min = 0, device_med = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// `launch` (one call, returning its error) on the launch stream: warmup
// launches, then per rep the device idle, the call alone timed on the host,
// events around it for the device span.
template <class F>
Timing time_launch(const Probe& p, int warmup, int reps, F launch) {
  for (int i = 0; i < warmup; ++i) {
    CHECK(launch());
    CHECK(cudaStreamSynchronize(p.launch));
  }
  std::vector<double> host, device;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaStreamSynchronize(p.launch));
    CHECK(cudaEventRecord(p.begin, p.launch));
    const auto t0 = std::chrono::steady_clock::now();
    const cudaError_t err = launch();
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(err);
    CHECK(cudaEventRecord(p.end, p.launch));
    CHECK(cudaEventSynchronize(p.end));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, p.begin, p.end));
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    device.push_back(1e3 * ms);
  }
  Timing t;
  t.host_med = median(host);
  t.host_min = *std::min_element(host.begin(), host.end());
  t.device_med = median(device);
  return t;
}

void print_header() {
  std::printf("%-32s %6s %9s %6s %9s %9s %10s %11s\n", "graph", "chunks", "chunk KiB", "nodes", "host med",
              "host min", "host/node", "device med");
}

void print_row(const char* name, const char* chunks, const char* chunk_kib, size_t nodes, const Timing& t) {
  std::printf("%-32s %6s %9s %6zu %9.2f %9.2f %10.3f %11.1f\n", name, chunks, chunk_kib, nodes, t.host_med,
              t.host_min, t.host_med / double(nodes), t.device_med);
}

// Instantiates `graph`, uploads it to the launch stream and times its
// launches there; `nodes` gets its node count. Both are destroyed after.
Timing time_graph(const Probe& p, cudaGraph_t graph, int warmup, int reps, size_t& nodes) {
  CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  cudaGraphExec_t exec = nullptr;
  CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0));
  CHECK(cudaGraphUpload(exec, p.launch));
  const Timing t = time_launch(p, warmup, reps, [&] { return cudaGraphLaunch(exec, p.launch); });
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return t;
}

// Captures and times the graph of `k`. `label` names the row (default: the
// topology).
void run_case(const Probe& p, const Case& k, int warmup, int reps, const char* label = nullptr) {
  size_t nodes = 0;
  const Timing t = time_graph(p, capture(p, k), warmup, reps, nodes);
  char chunks[24], kib[24];
  std::snprintf(chunks, sizeof chunks, "%d", k.chunks);
  std::snprintf(kib, sizeof kib, "%zu", k.chunk_bytes / kKiB);
  print_row(label != nullptr ? label : topo_name(k.topo), chunks, kib, nodes, t);
}

// A call's slots (4,096 of 8 bytes) copied into a graph's own buffer on the
// launch stream, the way a replayed call does it, by cudaMemcpyAsync and by a
// copy kernel: the host's cost of each, the device idle before it.
void run_slot_copies(const Probe& p, int warmup, int reps, const char* holding) {
  const size_t bytes = 4096 * 8;
  char* dst = p.ring[0];
  const char* src = p.cache;
  char name[64];
  std::snprintf(name, sizeof name, "slots: cudaMemcpyAsync%s", holding);
  print_row(name, "-", "32", 1, time_launch(p, warmup, reps, [&] {
              return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, p.launch);
            }));
  std::snprintf(name, sizeof name, "slots: copy kernel%s", holding);
  print_row(name, "-", "32", 1, time_launch(p, warmup, reps, [&] {
              copy_words<<<8, kThreads, 0, p.launch>>>(reinterpret_cast<uint4*>(dst),
                                                       reinterpret_cast<const uint4*>(src), bytes / 16);
              return cudaGetLastError();
            }));
}

int main(int argc, char** argv) {
  const int warmup = 3;
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  if (reps <= 0) {
    std::fprintf(stderr, "usage: graph_launch_probe [reps] [sections, e.g. 3,13]\n");
    return 1;
  }
  std::vector<int> sections;  // empty: all
  for (const char* c = argc > 2 ? argv[2] : ""; *c != '\0';) {
    char* end = nullptr;
    sections.push_back(int(std::strtol(c, &end, 10)));
    c = *end == ',' ? end + 1 : end;
    if (end == c && *c != '\0') {
      std::fprintf(stderr, "graph_launch_probe: sections are numbers joined by commas, got %s\n", argv[2]);
      return 1;
    }
  }
  const auto wants = [&](int section) {
    return sections.empty() || std::find(sections.begin(), sections.end(), section) != sections.end();
  };

  const Topo order[] = {Topo::Kernels,           Topo::Copies,         Topo::Store,
                        Topo::StoreKeep,         Topo::Load,           Topo::StoreKernelCopies,
                        Topo::StoreOneStream,    Topo::Store2D,        Topo::KernelsPdl,
                        Topo::StoreBigParams,    Topo::Store3D};
  std::vector<Case> cases;
  for (Topo t : order) {
    if (!wants(int(t) + 1)) continue;
    for (int c : {4, 8, 16, 32, 64}) cases.push_back({t, c, 256 * kKiB});
    if (t == Topo::Store || t == Topo::Load) cases.push_back({t, 16, 32 * kMiB});  // the engine's chunk
  }

  // Every buffer sized from the largest case that uses it (512 MiB of cache
  // and of pinned host at 16 x 32 MiB).
  // (sections 12 and 13 run the store of 16 chunks of 256 KiB)
  size_t cache_bytes = 16 * 256 * kKiB, slot_bytes = 256 * kKiB, host_total = 16 * 256 * kKiB, sink_bytes = 0;
  for (const Case& k : cases) {
    cache_bytes = std::max(cache_bytes, k.chunks * k.chunk_bytes);
    slot_bytes = std::max(slot_bytes, k.chunk_bytes);
    host_total = std::max(host_total, host_bytes(k));
    if (k.topo == Topo::StoreKernelCopies) sink_bytes = std::max(sink_bytes, k.chunks * k.chunk_bytes);
  }

  Probe p;
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  p.grid = 2 * sms;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));

  CHECK(cudaStreamCreateWithFlags(&p.main, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&p.side, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&p.launch, cudaStreamNonBlocking));
  for (int r = 0; r < 2; ++r) {
    CHECK(cudaEventCreateWithFlags(&p.filled[r], cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&p.drained[r], cudaEventDisableTiming));
  }
  CHECK(cudaEventCreateWithFlags(&p.fork, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&p.join, cudaEventDisableTiming));
  CHECK(cudaEventCreate(&p.begin));
  CHECK(cudaEventCreate(&p.end));

  char* ring = nullptr;
  CHECK(cudaMalloc(&p.cache, cache_bytes));
  CHECK(cudaMalloc(&ring, 2 * slot_bytes));
  p.ring[0] = ring;
  p.ring[1] = ring + slot_bytes;
  CHECK(cudaMalloc(&p.sink, sink_bytes));
  CHECK(cudaHostAlloc(&p.host, host_total, cudaHostAllocDefault));
  CHECK(cudaMemset(p.cache, 0, cache_bytes));
  CHECK(cudaDeviceSynchronize());

  std::printf("%s, %d SMs, copy grid %d x %d, %d reps after %d warmup launches\n", prop.name, sms, p.grid,
              kThreads, reps, warmup);
  std::printf("chunks, chunk KiB: the transfer's chunks and their size; nodes: cudaGraphGetNodes\n");
  std::printf("host med / min: host us of the launch call alone, the device idle before it\n");
  std::printf("host/node: host med / nodes\n");
  std::printf("device med: us between events recorded just before and after the launch on\n");
  std::printf("  its stream (the graph's device time, with the launch's latency to start)\n");

  std::printf("\n== baseline\n");
  print_header();
  {
    const Timing t = time_launch(p, warmup, reps, [&] {
      return cudaLaunchKernel(reinterpret_cast<const void*>(empty_kernel), dim3(1), dim3(32), nullptr, 0,
                              p.launch);
    });
    print_row("cudaLaunchKernel, empty kernel", "-", "-", 1, t);

    cudaGraph_t graph = nullptr;
    CHECK(cudaStreamBeginCapture(p.main, cudaStreamCaptureModeThreadLocal));
    empty_kernel<<<1, 32, 0, p.main>>>();
    CHECK(cudaGetLastError());
    CHECK(cudaStreamEndCapture(p.main, &graph));
    size_t nodes = 0;
    const Timing g = time_graph(p, graph, warmup, reps, nodes);
    print_row("cudaGraphLaunch, one-node graph", "-", "-", nodes, g);
  }

  for (size_t i = 0; i < cases.size(); ++i) {
    if (i == 0 || cases[i].topo != cases[i - 1].topo) {
      std::printf("\n== %d. %s\n", int(cases[i].topo) + 1, topo_name(cases[i].topo));
      print_header();
    }
    run_case(p, cases[i], warmup, reps);
  }

  const Case store16{Topo::Store, 16, 256 * kKiB};
  if (wants(12)) {
    // What the process holds besides, added in turn (each row keeps the ones
    // before): the same store graph, timed again.
    std::printf("\n== 12. store, 16 chunks of 256 KiB, the process holding more\n");
    print_header();
    run_case(p, store16, warmup, reps, "store, as above");
    run_slot_copies(p, warmup, reps, "");
    std::vector<void*> pinned;
    for (int i = 0; i < 1024; ++i) {
      void* buf = nullptr;
      CHECK(cudaHostAlloc(&buf, 1 * kMiB, cudaHostAllocDefault));
      pinned.push_back(buf);
    }
    run_case(p, store16, warmup, reps, "+ 1,024 pinned buffers of 1 MiB");
    run_slot_copies(p, warmup, reps, ", + 1,024");
    for (int i = 0; i < 4; ++i) {
      void* buf = nullptr;
      CHECK(cudaHostAlloc(&buf, 4096 * kMiB, cudaHostAllocDefault));
      pinned.push_back(buf);
    }
    run_case(p, store16, warmup, reps, "+ 4 pinned buffers of 4 GiB");
    std::vector<cudaGraphExec_t> others;
    for (int i = 0; i < 256; ++i) {
      cudaGraph_t graph = capture(p, store16);
      cudaGraphExec_t exec = nullptr;
      CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0));
      CHECK(cudaGraphDestroy(graph));
      others.push_back(exec);
    }
    run_case(p, store16, warmup, reps, "+ 256 graphs instantiated");
    for (cudaGraphExec_t exec : others) CHECK(cudaGraphExecDestroy(exec));
    for (void* buf : pinned) CHECK(cudaFreeHost(buf));
  }
  if (wants(13)) {
    // torch's current stream is the legacy default stream unless the caller
    // picked another (a launch into it is ordered after the work of every
    // blocking stream): the same graph and slot copies launched there, beside
    // a non-blocking stream's
    std::printf("\n== 13. store, 16 chunks of 256 KiB, launched on the legacy default stream\n");
    print_header();
    run_case(p, store16, warmup, reps, "store, non-blocking stream");
    run_slot_copies(p, warmup, reps, "");
    Probe legacy = p;
    legacy.launch = cudaStreamLegacy;
    run_case(legacy, store16, warmup, reps, "store, legacy stream");
    run_slot_copies(legacy, warmup, reps, ", legacy");
  }

  CHECK(cudaDeviceSynchronize());
  CHECK(cudaFreeHost(p.host));
  CHECK(cudaFree(p.sink));
  CHECK(cudaFree(ring));
  CHECK(cudaFree(p.cache));
  for (cudaEvent_t e : {p.filled[0], p.filled[1], p.drained[0], p.drained[1], p.fork, p.join, p.begin, p.end})
    CHECK(cudaEventDestroy(e));
  CHECK(cudaStreamDestroy(p.launch));
  CHECK(cudaStreamDestroy(p.side));
  CHECK(cudaStreamDestroy(p.main));
  return 0;
}
