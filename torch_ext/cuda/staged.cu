// CUDA implementation of the staged host transfer's run loop (staged.h): the
// copy kernel between the device cache and a ring slot on the caller's
// stream, cudaMemcpyAsync between the ring slot and the pinned host chunk on
// a side stream, ordered by events (reused across calls: a wait takes the
// event's latest record at the time it is issued).
//
// Issued directly, a call's host work is one small kernel that writes the
// ring row of every token (and, device -> host, which host rows must be
// kept), then per chunk one or two program runs, the chunk's copies (adjacent
// ones merged, runs at constant steps folded into 2-D and 3-D copies:
// staged_copies)
// and two event records with their waits: about 25 us of driver
// calls per chunk. So a call whose shape (token count, skip_prefix, SM
// budget, slot dtype) came before is captured once into a CUDA graph (on the
// engine's own streams, reading the slots from a buffer of the graph) and
// replayed: per call one kernel copying the slots into that buffer and one graph
// launch, whatever the chunk count. Shapes are captured on their second call
// (a one-off shape costs no capture); under staged_graph_prefixes() a new
// shape replays the graph of its staged_reuse_prefix where one is kept (a
// prefix too is captured when it comes the second time) and moves the rest
// with the direct kernel (move_rest). At most staged_graph_capacity() graphs
// are kept per engine, least recently used evicted. Under
// staged_graph_on_device() the kept graph is the captured one as the body of
// an always-true conditional node (instantiate_as_conditional_body), so that
// the host's launch carries one node whatever the chunk count (its copies
// not folded into 3-D copies: staged_copies). No synchronisation either way.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "../staged.h"
#include "cuda_common.h"

namespace kvlayout {
namespace {

// The token table of a call cut by `cut` (its layer group at the
// pipeline's idle end, staged_cut) and in whole chunks of cut.per_chunk
// (every other group): rows[0][t] is token t's ring row (its index in its
// chunk) in whole chunks, rows[1][t] in the cut (-1 before skip both).
// With keep (device -> host): rows[2][t] = t, and rows[3][t] / rows[4][t]
// its ring row in whole chunks / in the cut, where token t has no device row
// (slot < 0 or >= num_slots), else -1: the keep kernel copies those host rows
// into the ring so that the copy back leaves them as they were.
template <class Slot>
__global__ void staged_rows_kernel(const Slot* slots, int64_t num_tokens, int64_t skip,
                                   int64_t first, int64_t per_chunk, int64_t num_slots, bool keep,
                                   int64_t* rows) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < num_tokens;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = t - skip;  // (StagedCut: row i of the first chunk, else of a later one)
    const int64_t whole_row = i < 0 ? -1 : i % per_chunk;
    const int64_t cut_row = i < 0 ? -1 : i < first ? i : (i - first) % per_chunk;
    rows[t] = whole_row;
    rows[num_tokens + t] = cut_row;
    if (keep) {
      const int64_t s = slots != nullptr ? int64_t(slots[t]) : t;
      const bool kept = i >= 0 && (s < 0 || s >= num_slots);
      rows[2 * num_tokens + t] = kept ? t : -1;
      rows[3 * num_tokens + t] = kept ? whole_row : -1;
      rows[4 * num_tokens + t] = kept ? cut_row : -1;
    }
  }
}

// A replayed call's slots into its graph's buffer: `words` 4-byte words. A
// kernel, not cudaMemcpyAsync: its launch costs the host a little less
// (scripts/graph_launch_probe.cu, its "slots:" rows: 2.95-3.30 against 3.30-3.69 us,
// median, on an H100).
__global__ void copy_slot_words_kernel(const uint32_t* __restrict__ src, uint32_t* __restrict__ dst,
                                       int64_t words) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

class Events {
 public:
  explicit Events(size_t n) : events_(n, nullptr) {
    for (cudaEvent_t& e : events_) C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~Events() {
    for (cudaEvent_t e : events_)
      if (e != nullptr) (void)cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// `waiter` waits for what `stream` has queued so far, through `event`.
void join(cudaEvent_t event, cudaStream_t stream, cudaStream_t waiter) {
  C10_CUDA_CHECK(cudaEventRecord(event, stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, event, 0));
}

// A stream of the engine's own (never another library's pool stream: a
// capture would take in whatever else is queued on it).
class OwnStream {
 public:
  OwnStream() = default;
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  ~OwnStream() {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }
  cudaStream_t get() {
    if (stream_ == nullptr) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return stream_;
  }

 private:
  cudaStream_t stream_ = nullptr;
};

// What a captured call depends on besides the bound tensors.
struct ReplayKey {
  int64_t num_tokens, skip_prefix, max_ctas;
  int64_t slot_bytes;  // 0: no device slots; else 4 or 8
  int64_t per_chunk;   // the call's chunk tokens (staged_chunk_tokens when it was made)
  bool on_device;      // staged_graph_on_device() when it was made
  bool operator==(const ReplayKey& o) const {
    return num_tokens == o.num_tokens && skip_prefix == o.skip_prefix && max_ctas == o.max_ctas &&
           slot_bytes == o.slot_bytes && per_chunk == o.per_chunk && on_device == o.on_device;
  }
};

// One captured call: its graph, the buffer it reads the slots from and the
// token table it writes (allocated for the caller's stream before the capture).
struct Replay {
  ReplayKey key{};
  at::Tensor slots, rows;
  cudaGraphExec_t exec = nullptr;
  KeptGraph shape;  // the captured graph's nodes, whether exec runs it as a conditional node's body, its tokens
  Replay() = default;
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;
  ~Replay() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);  // (freed when done if still running)
  }
};

constexpr size_t kSeenShapes = 16;  // shapes remembered as run once

#if CUDART_VERSION >= 12040
cudaError_t add_node(cudaGraphNode_t* node, cudaGraph_t graph, cudaGraphNodeParams* params) {
#if CUDART_VERSION >= 13000
  return cudaGraphAddNode(node, graph, nullptr, nullptr, 0, params);
#else
  return cudaGraphAddNode(node, graph, nullptr, 0, params);
#endif
}
#endif

// `work` as the body of a conditional node whose condition is always true
// (its default, assigned at every launch), in a graph of that one node,
// instantiated: the device starts the body, the host's launch carries one
// node. nullptr (the error cleared) where the runtime refuses, e.g. a body
// node type or a memory kind a conditional body may not hold. `work` is
// copied (a child graph node) and stays the caller's.
cudaGraphExec_t instantiate_as_conditional_body(cudaGraph_t work) {
#if CUDART_VERSION >= 12040
  cudaGraph_t outer = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaError_t err = cudaGraphCreate(&outer, 0);
  cudaGraphConditionalHandle always{};
  if (err == cudaSuccess)
    err = cudaGraphConditionalHandleCreate(&always, outer, /*defaultLaunchValue=*/1, cudaGraphCondAssignDefault);
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = always;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t conditional = nullptr, body = nullptr;
  if (err == cudaSuccess) err = add_node(&conditional, outer, &params);
  if (err == cudaSuccess)
    err = cudaGraphAddChildGraphNode(&body, params.conditional.phGraph_out[0], nullptr, 0, work);
  if (err == cudaSuccess) err = cudaGraphInstantiateWithFlags(&exec, outer, 0);
  if (outer != nullptr) (void)cudaGraphDestroy(outer);
  if (err == cudaSuccess) return exec;
  (void)cudaGetLastError();
  if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
  TORCH_WARN_ONCE("kvlayout: the CUDA runtime refused a staged graph as a conditional node's body (",
                  cudaGetErrorName(err), ": ", cudaGetErrorString(err), "); its graphs run as captured");
  return nullptr;
#else
  (void)work;
  return nullptr;  // (built against a runtime before 12.4: not attempted)
#endif
}

class CudaStaged final : public StagedEngine {
 public:
  explicit CudaStaged(StagedSetup setup)
      : s_(std::move(setup)), events_(2 + 2 * s_.ring_slots.size()) {
    const c10::cuda::CUDAGuard guard(s_.device);
    for (const at::Tensor& slot : s_.ring_slots) ring_.push_back(static_cast<char*>(slot.data_ptr()));
    for (const std::vector<StagedSegment>& group : s_.groups)
      for (const StagedSegment& seg : group) bytes_per_token_ += seg.row_bytes;
    for (size_t i = 0; i < s_.host_tensors.size(); ++i) {
      (void)cuda::device_address(s_.host_tensors[i], s_.device, "host", int64_t(i));  // pinned?
      host_.push_back(static_cast<char*>(s_.host_tensors[i].data_ptr()));
    }
  }

  bool on_ring_stream() const override {
    const cudaStream_t current = c10::cuda::getCurrentCUDAStream(s_.device.index()).stream();
    if (s_.ring_stream < 0 || current != reinterpret_cast<cudaStream_t>(s_.ring_stream)) return false;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(current, &capture));
    return capture == cudaStreamCaptureStatusNone;
  }

  int64_t replayed_calls() const override {
    const std::lock_guard<std::mutex> lock(mu_);
    return replayed_;
  }
  int64_t kept_graphs() const override {
    const std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(replays_.size());
  }
  KeptGraph kept_graph(const StagedArgs& a, int64_t slot_bytes) const override {
    const int64_t per_chunk = chunk_tokens(a.num_tokens, a.skip_prefix, a.max_ctas);
    const ReplayKey key = replay_key(a.num_tokens, a.skip_prefix, a.max_ctas, slot_bytes, per_chunk);
    const std::lock_guard<std::mutex> lock(mu_);
    if (const Replay* own = kept(key)) return own->shape;
    // (a shape run before is captured at this call, not replayed from its prefix: see run)
    if (seen(key)) return {};
    if (const std::optional<ReplayKey> prefix = prefix_key(key); prefix.has_value())
      if (const Replay* shared = kept(*prefix)) return shared->shape;
    return {};
  }

  void run(const StagedArgs& a) override {
    if (a.skip_prefix >= a.num_tokens) return;
    const c10::cuda::CUDAGuard guard(s_.device);
    const std::lock_guard<std::mutex> lock(mu_);
    const cudaStream_t main = c10::cuda::getCurrentCUDAStream(s_.device.index()).stream();
    const at::Tensor device_slots =
        a.device_slots.has_value() && a.device_slots->defined() ? *a.device_slots : at::Tensor();
    // A validating call checks its slots on the host first (per call), and a call inside the
    // caller's own graph capture becomes part of that graph: both are issued directly.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(main, &capture));
    const auto graphs = static_cast<size_t>(staged_graph_capacity());
    while (replays_.size() > graphs) replays_.pop_back();  // (a bound lowered since the last call)
    // the call's chunk, once (the chunk setting may change meanwhile on another thread)
    const int64_t per_chunk = chunk_tokens(a.num_tokens, a.skip_prefix, a.max_ctas);
    if (graphs > 0 && !a.validate && replays_ok_ && capture == cudaStreamCaptureStatusNone) {
      const ReplayKey key = replay_key(a.num_tokens, a.skip_prefix, a.max_ctas,
                                       device_slots.defined() ? int64_t(device_slots.element_size()) : 0,
                                       per_chunk);
      Replay* replay = find_replay(key);
      if (replay == nullptr) {
        // a shape run before gets its own graph; a new one replays its reuse prefix's where that
        // is kept (or seen before: captured now), the rest moved by move_rest
        if (seen_before(key)) {
          replay = capture_replay(key, graphs);
        } else if (const std::optional<ReplayKey> prefix = prefix_key(key); prefix.has_value()) {
          replay = find_replay(*prefix);
          if (replay == nullptr && seen_before(*prefix)) replay = capture_replay(*prefix, graphs);
        }
      }
      if (replay != nullptr) {
        const int64_t replayed_tokens = replay->key.num_tokens;  // (a prefix's: fewer than the call's)
        if (device_slots.defined()) copy_slots(device_slots, replay->slots, replayed_tokens, main);
        const cudaError_t launched = cudaGraphLaunch(replay->exec, main);
        if (launched == cudaSuccess) {
          ++replayed_;
          if (replayed_tokens < a.num_tokens)  // the tokens past the prefix, after the graph on `main`
            move_rest(device_slots, a, replayed_tokens, main);
          return;
        }
        if (!replay->shape.on_device) C10_CUDA_CHECK(launched);
        // a conditional body the runtime took at instantiation but refuses to launch: no more of them
        // (this shape is captured again as it is at its next call); this call is issued directly
        (void)cudaGetLastError();
        TORCH_WARN_ONCE("kvlayout: the CUDA runtime refused to launch a staged graph as a conditional "
                        "node's body (", cudaGetErrorName(launched), ": ", cudaGetErrorString(launched),
                        "); its graphs run as captured");
        conditional_bodies_ok_ = false;
        replays_.pop_front();  // (find_replay and capture_replay leave the replay they return first)
      }
    }
    issue_directly(device_slots, a, a.skip_prefix, per_chunk, main);
  }

 private:
  bool keeps() const { return s_.host_is_dst && !s_.keeps.empty(); }

  // The key of a call's shape, by the graph settings of now.
  static ReplayKey replay_key(int64_t num_tokens, int64_t skip_prefix, int64_t max_ctas, int64_t slot_bytes,
                              int64_t per_chunk) {
    return ReplayKey{num_tokens, skip_prefix, max_ctas, slot_bytes, per_chunk, staged_graph_on_device()};
  }

  // Under staged_graph_prefixes(): the key of the call of `key`'s staged_reuse_prefix (its own chunk
  // for its token count), whose graph a call of `key` may replay; none where there is no such prefix.
  std::optional<ReplayKey> prefix_key(const ReplayKey& key) const {
    if (!staged_graph_prefixes()) return std::nullopt;
    const int64_t prefix = staged_reuse_prefix(key.num_tokens, key.skip_prefix);
    if (prefix == 0) return std::nullopt;
    ReplayKey k = key;
    k.num_tokens = prefix;
    k.per_chunk = chunk_tokens(prefix, key.skip_prefix, key.max_ctas);
    return k;
  }

  // Tokens [from, a.num_tokens) of the call `a`, past the prefix a graph moved, on `main`: by the
  // direct kernel between the caches (one launch, or one per its launch's segments), else staged.
  void move_rest(const at::Tensor& device_slots, const StagedArgs& a, int64_t from, cudaStream_t main) {
    if (s_.direct == nullptr) {
      issue_directly(device_slots, a, from, chunk_tokens(a.num_tokens, from, a.max_ctas), main);
      return;
    }
    RunArgs rest;
    (s_.host_is_dst ? rest.src_slots : rest.dst_slots) =
        device_slots.defined() ? std::optional<at::Tensor>(device_slots) : std::nullopt;
    rest.num_tokens = a.num_tokens;
    rest.skip_prefix = from;
    rest.max_ctas = a.max_ctas;
    s_.direct->run(0, rest);  // (on the current stream: `main`)
  }

  // Tokens [from, a.num_tokens) of the call `a` (from: its skip_prefix, or the end of the prefix a
  // graph moved) issued directly on `main` and the side stream, in chunks of per_chunk.
  void issue_directly(const at::Tensor& device_slots, const StagedArgs& a, int64_t from, int64_t per_chunk,
                      cudaStream_t main) {
    const cudaStream_t side = reinterpret_cast<cudaStream_t>(s_.side_stream);
    fork_side(main, side);
    const at::Tensor rows = new_token_rows(a.num_tokens);
    const StagedCut cut = this->cut(a.num_tokens, from, a.max_ctas, per_chunk);
    fill_token_rows(device_slots, a.num_tokens, from, cut, rows, main);
    issue(device_slots, a.num_tokens, from, a.max_ctas, cut, a.validate, rows, main, side, /*fold_blocks=*/true);
  }

  // Tokens per chunk of a call of num_tokens tokens from skip_prefix on under
  // a budget of max_ctas, by the chunk setting of now (a call computes it
  // once; a replay's is part of its key).
  int64_t chunk_tokens(int64_t num_tokens, int64_t skip_prefix, int64_t max_ctas) const {
    return staged_chunk_tokens(s_.tokens_per_chunk, static_cast<int64_t>(s_.groups.size()),
                               num_tokens - skip_prefix, bytes_per_token_, max_ctas);
  }

  // The cut of the layer group at the pipeline's idle end (staged_cut) of a
  // call of num_tokens tokens from skip_prefix on in chunks of per_chunk.
  StagedCut cut(int64_t num_tokens, int64_t skip_prefix, int64_t max_ctas, int64_t per_chunk) const {
    return staged_cut(num_tokens - skip_prefix, per_chunk, s_.host_is_dst, max_ctas);
  }

  // The replay kept for `key` (nullptr: none), left where it is in the order of use.
  const Replay* kept(const ReplayKey& key) const {
    for (const auto& replay : replays_)
      if (replay->key == key) return replay.get();
    return nullptr;
  }

  Replay* find_replay(const ReplayKey& key) {
    for (auto it = replays_.begin(); it != replays_.end(); ++it) {
      if ((*it)->key == key) {
        replays_.splice(replays_.begin(), replays_, it);  // most recently used first
        return replays_.front().get();
      }
    }
    return nullptr;
  }

  // Whether `key` is among the shapes run once.
  bool seen(const ReplayKey& key) const { return std::find(seen_.begin(), seen_.end(), key) != seen_.end(); }

  // Whether `key` was run before (remembering it now if not).
  bool seen_before(const ReplayKey& key) {
    if (seen(key)) return true;
    seen_.push_front(key);
    if (seen_.size() > kSeenShapes) seen_.pop_back();
    return false;
  }

  // Captures the call of `key` on the engine's own streams; nullptr where
  // the runtime refuses (and no more captures by this engine) or the call
  // raised (the direct call that follows raises the same). The graph's
  // buffers are allocated for the caller's stream, where the graph runs:
  // freed, they are reused only after the work queued there.
  Replay* capture_replay(const ReplayKey& key, size_t graphs) {
    auto replay = std::make_unique<Replay>();
    replay->key = key;
    if (key.slot_bytes != 0)
      replay->slots = at::empty({key.num_tokens}, at::TensorOptions().device(s_.device).dtype(
                                                      key.slot_bytes == 4 ? at::kInt : at::kLong));
    replay->rows = new_token_rows(key.num_tokens);
    const cudaStream_t cap = capture_stream_.get(), side = capture_side_.get();
    const c10::cuda::CUDAStreamGuard on_cap(c10::cuda::getStreamFromExternal(cap, s_.device.index()));
    if (cudaStreamBeginCapture(cap, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      (void)cudaGetLastError();
      replays_ok_ = false;
      return nullptr;
    }
    cudaGraph_t graph = nullptr;
    try {
      fork_side(cap, side);
      const StagedCut cut = this->cut(key.num_tokens, key.skip_prefix, key.max_ctas, key.per_chunk);
      fill_token_rows(replay->slots, key.num_tokens, key.skip_prefix, cut, replay->rows, cap);
      // (a conditional node's body keeps one copy per plane: staged_copies)
      issue(replay->slots, key.num_tokens, key.skip_prefix, key.max_ctas, cut, false,
            replay->rows, cap, side, /*fold_blocks=*/!(key.on_device && conditional_bodies_ok_));
    } catch (...) {
      (void)cudaStreamEndCapture(cap, &graph);
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      return nullptr;
    }
    cudaError_t err = cudaStreamEndCapture(cap, &graph);
    size_t nodes = 0;
    if (err == cudaSuccess) err = cudaGraphGetNodes(graph, nullptr, &nodes);
    if (err == cudaSuccess && key.on_device && conditional_bodies_ok_) {
      replay->exec = instantiate_as_conditional_body(graph);
      replay->shape.on_device = replay->exec != nullptr;
      conditional_bodies_ok_ = replay->shape.on_device;  // (refused once: not asked again)
    }
    if (err == cudaSuccess && replay->exec == nullptr)
      err = cudaGraphInstantiateWithFlags(&replay->exec, graph, 0);
    replay->shape.nodes = static_cast<int64_t>(nodes);
    replay->shape.tokens = key.num_tokens;
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      replays_ok_ = false;
      return nullptr;
    }
    replays_.push_front(std::move(replay));
    while (replays_.size() > graphs) replays_.pop_back();
    return replays_.front().get();
  }

  // What the caller queued on `main` before the call (the caches, the host
  // chunk, an earlier call's kernels that read the ring) comes first on
  // `side`. Forked before the call's token table is filled: no copy reads
  // the table, so a load's first copy from the host starts at once rather
  // than after the table's kernel (in a captured graph: as a root node).
  void fork_side(cudaStream_t main, cudaStream_t side) { join(events_[0], main, side); }

  // The transfer's work in stream order, after fork_side, the layer group at
  // the pipeline's idle end in the chunks of `cut`, every other in whole
  // chunks of cut.per_chunk: `main` runs the kernels, `side` the copy
  // engine's copies; `rows` is the token table fill_token_rows wrote for the
  // same cut.
  void issue(const at::Tensor& device_slots, int64_t num_tokens, int64_t skip_prefix,
             int64_t max_ctas, const StagedCut& cut, bool validate, const at::Tensor& rows,
             cudaStream_t main, cudaStream_t side, bool fold_blocks) {
    const size_t R = ring_.size();
    const bool keep = keeps();
    // The token table's rows, each read by every chunk as a prefix (RunArgs::slot_prefixes): one view
    // per row per call, none per chunk.
    // (index 0: whole chunks, 1: the cut; see staged_rows_kernel)
    const at::Tensor ring_rows[2] = {rows[0], rows[1]};
    const at::Tensor kept_host_rows = keep ? rows[2] : at::Tensor();
    const at::Tensor kept_ring_rows[2] = {keep ? rows[3] : at::Tensor(), keep ? rows[4] : at::Tensor()};
    const StagedCut whole = StagedCut::whole(cut.per_chunk);
    const size_t cut_group = staged_cut_group(s_.groups.size(), s_.host_is_dst);
    size_t c = 0;
    for (size_t g = 0; g < s_.groups.size(); ++g) {
      const int cuts = g == cut_group ? 1 : 0;
      const StagedCut& chunking = cuts ? cut : whole;
      for (int64_t t0 = skip_prefix, end = 0; t0 < num_tokens; t0 = end, ++c) {
        // tokens [t0, end): the slot arrays' first `end` entries, with skip_prefix t0 (so a
        // recorded out-of-range slot names its index in the caller's slots)
        end = chunking.end(skip_prefix, t0, num_tokens);
        const size_t r = c % R;
        const cudaEvent_t filled = events_[2 + r], drained = events_[2 + R + r];
        const BoundProgram& kernel = *s_.kernels[g * R + r];
        // every layer group reads the same slots: only the first records bad ones (each once)
        const auto run = [&](const BoundProgram& p, const at::Tensor& src_slots,
                             const at::Tensor& dst_slots, bool validate) {
          RunArgs args{slots_or_none(src_slots), slots_or_none(dst_slots), end, t0, max_ctas,
                       validate};
          args.record_errors = g == 0;
          args.slot_prefixes = true;
          p.run(0, args);
        };
        if (s_.host_is_dst) {
          if (c >= R) C10_CUDA_CHECK(cudaStreamWaitEvent(main, drained, 0));  // its copy out is done
          if (keep) run(*s_.keeps[g * R + r], kept_host_rows, kept_ring_rows[cuts], false);
          run(kernel, device_slots, ring_rows[cuts], validate);
          join(filled, main, side);
          copy(g, r, t0, end - t0, /*to_host=*/true, fold_blocks, side);
          C10_CUDA_CHECK(cudaEventRecord(drained, side));
        } else {
          if (c >= R) C10_CUDA_CHECK(cudaStreamWaitEvent(side, drained, 0));  // its kernel is done
          copy(g, r, t0, end - t0, /*to_host=*/false, fold_blocks, side);
          join(filled, side, main);
          run(kernel, ring_rows[cuts], device_slots, validate);
          C10_CUDA_CHECK(cudaEventRecord(drained, main));
        }
      }
    }
    // the side stream's last work joins the caller's stream (a graph capture
    // needs every forked stream joined; a device -> host transfer ends there)
    join(events_[1], side, main);
  }

  // An undefined tensor stands for "no slots" (token t uses slot t).
  static std::optional<at::Tensor> slots_or_none(const at::Tensor& t) {
    if (!t.defined()) return std::nullopt;
    return t;
  }

  // The first num_tokens slots of `src` into `dst` (a replay's buffer, of src's dtype) on `stream`.
  static void copy_slots(const at::Tensor& src, const at::Tensor& dst, int64_t num_tokens,
                         cudaStream_t stream) {
    const int64_t words = num_tokens * int64_t(src.element_size()) / int64_t(sizeof(uint32_t));
    const int threads = 256;
    const int blocks = static_cast<int>(std::clamp<int64_t>((words + threads - 1) / threads, 1, 64));
    copy_slot_words_kernel<<<blocks, threads, 0, stream>>>(static_cast<const uint32_t*>(src.data_ptr()),
                                                            static_cast<uint32_t*>(dst.data_ptr()), words);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // The token table of a call of `num_tokens` tokens (see staged_rows_kernel).
  at::Tensor new_token_rows(int64_t num_tokens) const {
    return at::empty({keeps() ? 5 : 2, num_tokens},
                     at::TensorOptions().dtype(at::kLong).device(s_.device));
  }

  void fill_token_rows(const at::Tensor& device_slots, int64_t num_tokens, int64_t skip_prefix,
                       const StagedCut& cut, const at::Tensor& rows, cudaStream_t stream) const {
    const int threads = 256;
    const int blocks =
        static_cast<int>(std::min<int64_t>((num_tokens + threads - 1) / threads, 1024));
    if (device_slots.defined() && device_slots.scalar_type() == at::kInt) {
      staged_rows_kernel<int32_t><<<blocks, threads, 0, stream>>>(
          device_slots.data_ptr<int32_t>(), num_tokens, skip_prefix, cut.first, cut.per_chunk,
          s_.device_num_slots, keeps(), rows.data_ptr<int64_t>());
    } else {
      staged_rows_kernel<int64_t><<<blocks, threads, 0, stream>>>(
          device_slots.defined() ? device_slots.data_ptr<int64_t>() : nullptr, num_tokens,
          skip_prefix, cut.first, cut.per_chunk, s_.device_num_slots, keeps(), rows.data_ptr<int64_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // The copy engine's part of chunk (group g, tokens [t0, t0 + n)) through
  // ring slot r: host rows t0.. <-> ring rows 0.., as staged_copies lists
  // them (merged and folded into 2-D and 3-D copies).
  void copy(size_t g, size_t r, int64_t t0, int64_t n, bool to_host, bool fold_blocks,
            cudaStream_t side) const {
    for (const StagedCopy& c : staged_copies(s_.groups[g], t0, n, fold_blocks)) {
      char* host = host_[static_cast<size_t>(c.host_tensor)] + c.host_offset;
      char* ring = ring_[r] + c.ring_offset;
      const auto bytes = static_cast<size_t>(c.bytes);
      if (c.blocks > 1) {
        // pitched pointers: a side's block step is a whole number of its pitch (staged_copies)
        const auto pitched = [&](char* p, int64_t pitch, int64_t block_step) {
          return make_cudaPitchedPtr(p, size_t(pitch), bytes, size_t(block_step / pitch));
        };
        cudaMemcpy3DParms params{};
        const cudaPitchedPtr host_ptr = pitched(host, c.host_step, c.host_block_step);
        const cudaPitchedPtr ring_ptr = pitched(ring, c.ring_step, c.ring_block_step);
        params.srcPtr = to_host ? ring_ptr : host_ptr;
        params.dstPtr = to_host ? host_ptr : ring_ptr;
        params.extent = make_cudaExtent(bytes, size_t(c.count), size_t(c.blocks));
        params.kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
        C10_CUDA_CHECK(cudaMemcpy3DAsync(&params, side));
        continue;
      }
      if (c.count == 1) {
        C10_CUDA_CHECK(to_host ? cudaMemcpyAsync(host, ring, bytes, cudaMemcpyDeviceToHost, side)
                               : cudaMemcpyAsync(ring, host, bytes, cudaMemcpyHostToDevice, side));
        continue;
      }
      const auto rows = static_cast<size_t>(c.count);
      const auto host_pitch = static_cast<size_t>(c.host_step), ring_pitch = static_cast<size_t>(c.ring_step);
      C10_CUDA_CHECK(to_host ? cudaMemcpy2DAsync(host, host_pitch, ring, ring_pitch, bytes, rows,
                                                 cudaMemcpyDeviceToHost, side)
                             : cudaMemcpy2DAsync(ring, ring_pitch, host, host_pitch, bytes, rows,
                                                 cudaMemcpyHostToDevice, side));
    }
  }

  StagedSetup s_;
  Events events_;  // 0: side waits for main; 1: main waits for side; then filled[R], free[R]
  std::vector<char*> ring_, host_;
  int64_t bytes_per_token_ = 0;  // every layer group's rows of one token
  mutable std::mutex mu_;  // a call's issue and the replays below
  OwnStream capture_stream_, capture_side_;
  std::list<std::unique_ptr<Replay>> replays_;  // most recently used first
  std::list<ReplayKey> seen_;                    // shapes run once, most recent first
  bool replays_ok_ = true;
  bool conditional_bodies_ok_ = true;  // (false once the runtime refused a conditional body)
  int64_t replayed_ = 0;
};

std::unique_ptr<StagedEngine> make_cuda_staged(StagedSetup setup) {
  return std::make_unique<CudaStaged>(std::move(setup));
}

const bool registered = (register_staged_factory(c10::DeviceType::CUDA, &make_cuda_staged), true);

}  // namespace
}  // namespace kvlayout
