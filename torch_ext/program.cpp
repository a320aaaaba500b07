#include "program.h"
#include "staged.h"

#include "slots.h"

#include <ATen/core/Tensor.h>  // (not ATen/ATen.h: every operator declared costs each file seconds of compile time)
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include <pthread.h>

namespace kvlayout {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

// Handle -> program. Handles count up and are never reused, so a handle that
// was dropped (the Python side evicts unused programs) can never name another
// program.
struct Registry {
  std::unordered_map<int64_t, std::shared_ptr<const CopyProgram>> programs;
  int64_t next_handle = 0;
};

Registry& registry() {
  static Registry r;
  return r;
}

// One entry per device type, filled by the backends as they load.
template <class Factory>
std::array<Factory, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>&
per_device_type() {
  static std::array<Factory, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      all{};
  return all;
}

auto& factories() { return per_device_type<BoundLaunchFactory>(); }

int64_t mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  const bool overflow = __builtin_mul_overflow(a, b, &r);
  TORCH_CHECK(!overflow, "kvlayout: ", what, " overflows 64-bit byte offsets");
  return r;
}

int64_t add(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  const bool overflow = __builtin_add_overflow(a, b, &r);
  TORCH_CHECK(!overflow, "kvlayout: ", what, " overflows 64-bit byte offsets");
  return r;
}

// Size and stride of a canonical axis of `t` (an absent axis: size 1, stride 0).
struct Axis {
  int64_t size = 1, stride = 0;
};

Axis axis(const at::Tensor& t, int64_t dim, const char* side, int64_t index, const char* name) {
  if (dim < 0) return {};
  TORCH_CHECK_VALUE(dim < t.dim(), "kvlayout: ", side, "[", index, "] has ", t.dim(),
                    " dimensions; its layout keeps the ", name, " axis in dimension ", dim);
  return {t.size(dim), t.stride(dim)};
}

// The slot geometry of a tensor (strides in bytes; stride_piece not set).
RowGeometry slot_geometry(const at::Tensor& t, const TensorAxes& a, const char* side,
                          int64_t index) {
  const int64_t isz = static_cast<int64_t>(t.element_size());
  const Axis page = axis(t, a.page, side, index, "page");
  const Axis in_page = axis(t, a.in_page, side, index, "slot");
  RowGeometry g{};
  if (a.page >= 0 && a.in_page >= 0) {
    g.num_slots = mul(page.size, in_page.size, "the slot count");
    g.page_size = std::max<int64_t>(1, in_page.size);
    g.stride_page = mul(page.stride, isz, "the page stride");
    g.stride_in_page = mul(in_page.stride, isz, "the slot stride");
  } else {
    // a flat slot axis (or a page axis alone): slot s sits at s * stride
    const Axis flat = a.in_page >= 0 ? in_page : page;
    g.num_slots = (a.in_page >= 0 || a.page >= 0) ? flat.size : 1;
    g.page_size = 1;
    g.stride_page = mul(flat.stride, isz, "the slot stride");
    g.stride_in_page = g.stride_page;
  }
  return g;
}

// A StrideSum of tensor `t` in bytes.
int64_t stride_sum_bytes(const StrideSum& s, const at::Tensor& t, const TensorAxes& a,
                         const char* side, int64_t index) {
  const char* what = "a segment offset";
  int64_t elems = s.constant;
  elems = add(elems, mul(s.plane, axis(t, a.plane, side, index, "plane").stride, what), what);
  elems = add(elems, mul(s.layer, axis(t, a.layer, side, index, "layer").stride, what), what);
  elems = add(elems, mul(s.head, axis(t, a.head, side, index, "head").stride, what), what);
  return mul(elems, static_cast<int64_t>(t.element_size()), what);
}

// One side of a launch in bytes: every segment's tensor must give the same
// geometry (one launch has one geometry per side).
void resolve_side(const LaunchSide& side, const std::vector<TensorAxes>& axes,
                  at::TensorList tensors, const char* name, int64_t piece_elems,
                  RowGeometry& geom, std::vector<int64_t>& tensor_of,
                  std::vector<int64_t>& offset_of, int64_t& piece_bytes) {
  for (size_t s = 0; s < side.segments.size(); ++s) {
    const Segment& seg = side.segments[s];
    TORCH_CHECK_INDEX(seg.tensor >= 0 && seg.tensor < static_cast<int64_t>(tensors.size()),
                      "kvlayout: a copy program's ", name, " segment names tensor ", seg.tensor,
                      " of ", tensors.size());
    const at::Tensor& t = tensors[seg.tensor];
    TORCH_CHECK_VALUE(t.defined(), "kvlayout: ", name, "[", seg.tensor, "] is undefined");
    const TensorAxes& a = axes[static_cast<size_t>(seg.tensor)];
    RowGeometry g = slot_geometry(t, a, name, seg.tensor);
    g.stride_piece = stride_sum_bytes(side.piece_stride, t, a, name, seg.tensor);
    const int64_t bytes = mul(piece_elems, static_cast<int64_t>(t.element_size()), "a piece");
    if (s == 0) {
      geom = g;
      piece_bytes = bytes;
    } else {
      TORCH_CHECK_VALUE(
          g.num_slots == geom.num_slots && g.page_size == geom.page_size &&
              g.stride_page == geom.stride_page && g.stride_in_page == geom.stride_in_page &&
              g.stride_piece == geom.stride_piece && bytes == piece_bytes,
          "kvlayout: ", name, "[", seg.tensor, "] and ", name, "[", side.segments[0].tensor,
          "] differ in slot count, element size or strides (sizes ", t.sizes(), " strides ",
          t.strides(), "); the tensors of one cache part must share them");
    }
    tensor_of.push_back(seg.tensor);
    offset_of.push_back(stride_sum_bytes(seg.offset, t, a, name, seg.tensor));
  }
}

// A binding's key: (handle, device, status), the source tensors' words, a
// separator, the destination tensors' words. Its hash combines the hashes of
// the three runs of words, so a TensorGroup's run is hashed once, when the
// group is made.
struct CacheKey {
  std::vector<uintptr_t> words;
  uint64_t hash = 0;
  bool operator==(const CacheKey& o) const { return hash == o.hash && words == o.words; }
};

struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const { return static_cast<size_t>(k.hash); }
};

uint64_t hash_words(const uintptr_t* words, size_t n) {
  uint64_t h = 1469598103934665603ull;  // (FNV-1a over words)
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(words[i])) * 1099511628211ull;
  return h;
}

uint64_t combine_hashes(uint64_t a, uint64_t b) {
  return a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
}

constexpr size_t kKeyPrefixWords = 3;

// The key's (handle, device, status) words.
void push_key_prefix(std::vector<uintptr_t>& words, int64_t handle, c10::Device device,
                     const at::Tensor& status) {
  words.push_back(static_cast<uintptr_t>(handle));
  words.push_back(static_cast<uintptr_t>(device.type()) * 1024u +
                  static_cast<uintptr_t>(device.index() + 1));
  words.push_back(reinterpret_cast<uintptr_t>(status.defined() ? status.data_ptr() : nullptr));
}

// The key's hash: its prefix's, combined with the hashes of its source and
// destination words.
void hash_key(CacheKey& key, uint64_t src_hash, uint64_t dst_hash) {
  key.hash = combine_hashes(
      combine_hashes(hash_words(key.words.data(), kKeyPrefixWords), src_hash), dst_hash);
}

// What a binding's checks depend on: device, dtype, where the data and its
// storage are, the storage's size, and the tensor's sizes and strides.
void push_tensor_words(std::vector<uintptr_t>& words, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    words.push_back(~uintptr_t(1));
    return;
  }
  words.push_back((static_cast<uintptr_t>(t.device().type()) << 40) ^
                  (static_cast<uintptr_t>(t.device().index() + 1) << 32) ^
                  (static_cast<uintptr_t>(t.scalar_type()) << 16) ^ static_cast<uintptr_t>(t.dim()));
  words.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()));
  words.push_back(reinterpret_cast<uintptr_t>(t.storage().data()));
  words.push_back(static_cast<uintptr_t>(t.storage().nbytes()));
  for (int64_t d = 0; d < t.dim(); ++d) {
    words.push_back(static_cast<uintptr_t>(t.size(d)));
    words.push_back(static_cast<uintptr_t>(t.stride(d)));
  }
}

// Bindings by (handle, device, status, tensors' addresses, sizes, strides),
// least recently used evicted first. A binding holds no tensor (data
// pointers, fingerprints, checked plans), so its cost is its plans' memory.
struct BindingCache {
  std::mutex mutex;
  std::list<std::pair<CacheKey, std::shared_ptr<const BoundProgram>>> order;  // most recent first
  std::unordered_map<CacheKey, decltype(order)::iterator, CacheKeyHash> index;
  size_t capacity = 256;

  void trim() {
    while (index.size() > capacity) {
      index.erase(order.back().first);
      order.pop_back();
    }
  }
};

BindingCache& binding_cache() {
  static BindingCache cache;
  return cache;
}

// A process may fork while another thread holds one of the two locks above
// (a torch.ops call runs the op with the GIL released, and takes them); the
// child would inherit it held by a thread it does not have, and its first
// call would wait forever. The forking thread takes both around fork(), so
// the child starts with them free and the tables whole. (Never nested
// elsewhere, so the order here is the only order.)
const bool fork_handlers_registered = [] {
  pthread_atfork([] { registry_mutex().lock(); binding_cache().mutex.lock(); },
                 [] { binding_cache().mutex.unlock(); registry_mutex().unlock(); },
                 [] { binding_cache().mutex.unlock(); registry_mutex().unlock(); });
  return true;
}();

}  // namespace

TensorGroup::TensorGroup(std::vector<at::Tensor> tensors, bool kept) : tensors_(std::move(tensors)) {
  if (kept) prints_.reserve(tensors_.size());
  words_.reserve(12 * tensors_.size());
  for (const at::Tensor& t : tensors_) {
    if (kept) prints_.push_back(TensorFingerprint::of(t));
    // (meta and fake tensors have no address to read: a call with them goes
    // through the dispatcher, never to the binding cache)
    if (t.defined() && (t.is_meta() || t.key_set().has(c10::DispatchKey::Python)))
      words_.push_back(~uintptr_t(2));
    else
      push_tensor_words(words_, t);
  }
  words_hash_ = hash_words(words_.data(), words_.size());
}

bool TensorGroup::unchanged() const {
  for (size_t i = 0; i < prints_.size(); ++i)  // (none for a group of one call)
    if (!prints_[i].matches(tensors_[i])) return false;
  return true;
}

int64_t register_program(CopyProgram program) {
  TORCH_CHECK(!program.steps.empty(), "kvlayout: a copy program needs at least one step");
  for (const auto& step : program.steps) {
    for (const LaunchSpec& l : step) {
      TORCH_CHECK(l.src.segments.size() == l.dst.segments.size(),
                  "kvlayout: a launch of a copy program has ", l.src.segments.size(),
                  " source and ", l.dst.segments.size(), " destination segments");
      TORCH_CHECK(l.num_pieces >= 1 && l.piece_elems >= 1,
                  "kvlayout: a launch of a copy program needs num_pieces >= 1 and "
                  "piece_elems >= 1, got ", l.num_pieces, " and ", l.piece_elems);
      for (const auto& [segs, n] : {std::make_pair(&l.src.segments, program.src_axes.size()),
                                    std::make_pair(&l.dst.segments, program.dst_axes.size())})
        for (const Segment& seg : *segs)
          TORCH_CHECK(seg.tensor >= 0 && seg.tensor < static_cast<int64_t>(n),
                      "kvlayout: a copy program's segment names tensor ", seg.tensor, " of ", n);
    }
  }
  auto shared = std::make_shared<const CopyProgram>(std::move(program));
  std::lock_guard<std::mutex> lock(registry_mutex());
  const int64_t handle = registry().next_handle++;
  registry().programs.emplace(handle, std::move(shared));
  return handle;
}

void drop_program(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().programs.erase(handle);
}

std::shared_ptr<const CopyProgram> registered_program(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  const auto it = registry().programs.find(handle);
  TORCH_CHECK_INDEX(it != registry().programs.end(), "kvlayout: no copy program has handle ",
                    handle, " (it was never registered, or was evicted from the program cache)");
  return it->second;
}

int64_t program_count() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return static_cast<int64_t>(registry().programs.size());
}

void check_program_call(int64_t num_steps, size_t program_src, size_t program_dst, int64_t step,
                        size_t num_src, size_t num_dst, const char* who) {
  if (step != kNoStep) {
    TORCH_CHECK_INDEX(step >= 0 && step < num_steps, who, ": the copy program has ", num_steps,
                      " steps (all layers, then one per layer), got step ", step);
  }
  TORCH_CHECK_VALUE(num_src == program_src, who, ": the copy program reads a source of ",
                    program_src, " tensors, got ", num_src);
  TORCH_CHECK_VALUE(num_dst == program_dst, who, ": the copy program writes a destination of ",
                    program_dst, " tensors, got ", num_dst);
}

void check_program_call(const CopyProgram& program, int64_t step, size_t num_src, size_t num_dst,
                        const char* who) {
  check_program_call(static_cast<int64_t>(program.steps.size()), program.src_axes.size(),
                     program.dst_axes.size(), step, num_src, num_dst, who);
}

CopyPlan resolve_launch(const LaunchSpec& launch, const CopyProgram& program, at::TensorList src,
                        at::TensorList dst) {
  CopyPlan p;
  p.num_tokens = 1;  // the checks that depend on no slot value
  p.num_pieces = launch.num_pieces;
  int64_t src_piece = 0, dst_piece = 0;
  resolve_side(launch.src, program.src_axes, src, "src", launch.piece_elems, p.src_geom,
               p.src_tensor, p.src_offset, src_piece);
  resolve_side(launch.dst, program.dst_axes, dst, "dst", launch.piece_elems, p.dst_geom,
               p.dst_tensor, p.dst_offset, dst_piece);
  TORCH_CHECK_TYPE(src_piece == dst_piece, "kvlayout: source and destination elements differ "
                   "in size (", launch.piece_elems, " elements are ", src_piece, " and ",
                   dst_piece, " bytes); a copy is byte-exact");
  p.piece_bytes = src_piece;
  p.num_segments = static_cast<int64_t>(p.src_tensor.size());
  return p;
}

void register_bound_launch_factory(c10::DeviceType type, BoundLaunchFactory factory) {
  factories()[static_cast<size_t>(type)] = factory;
}

void register_staged_factory(c10::DeviceType type, StagedFactory factory) {
  per_device_type<StagedFactory>()[static_cast<size_t>(type)] = factory;
}

StagedFactory staged_factory(c10::DeviceType type) {
  return per_device_type<StagedFactory>()[static_cast<size_t>(type)];
}

namespace {

// Dimensions past TensorFingerprint::kDims, hashed (FNV-1a over the words).
uint64_t hash_beyond(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  uint64_t h = 1469598103934665603ull;
  for (size_t d = TensorFingerprint::kDims; d < sizes.size(); ++d) {
    h = (h ^ static_cast<uint64_t>(sizes[d])) * 1099511628211ull;
    h = (h ^ static_cast<uint64_t>(strides[d])) * 1099511628211ull;
  }
  return h;
}

}  // namespace

bool TensorFingerprint::operator==(const TensorFingerprint& o) const {
  if (storage != o.storage || memory != o.memory || nbytes != o.nbytes || offset != o.offset ||
      dim != o.dim || beyond != o.beyond)
    return false;
  for (int64_t d = 0; d < std::min<int64_t>(dim, kDims); ++d)
    if (sizes[d] != o.sizes[d] || strides[d] != o.strides[d]) return false;
  return true;
}

TensorFingerprint TensorFingerprint::of(const at::Tensor& t) {
  if (!t.defined()) return {};
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();  // (no reference count)
  if (storage == nullptr) return {};
  // The view's sizes and strides too: a tensor re-strided in place
  // (as_strided_, set_ with other strides) over the same storage would
  // otherwise be written in its old geometry.
  TensorFingerprint f;
  f.storage = storage;
  f.memory = storage->data();
  f.nbytes = static_cast<int64_t>(storage->nbytes());
  f.offset = impl->storage_offset();
  f.dim = impl->dim();
  const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  for (int64_t d = 0; d < std::min<int64_t>(f.dim, kDims); ++d) {
    f.sizes[d] = sizes[d];
    f.strides[d] = strides[d];
  }
  if (f.dim > kDims) f.beyond = hash_beyond(sizes, strides);
  return f;
}

bool TensorFingerprint::matches(const at::Tensor& t) const {
  const c10::TensorImpl* impl = t.defined() ? t.unsafeGetTensorImpl() : nullptr;
  const c10::StorageImpl* s = impl ? impl->unsafe_storage().unsafeGetStorageImpl() : nullptr;
  if (s == nullptr) return *this == TensorFingerprint{};  // (as of() gives for such a tensor)
  if (s != storage) return false;
  if (s->data() != memory || static_cast<int64_t>(s->nbytes()) != nbytes ||
      impl->storage_offset() != offset || impl->dim() != dim)
    return false;
  const c10::IntArrayRef sz = impl->sizes(), st = impl->strides();
  for (int64_t d = 0; d < std::min<int64_t>(dim, kDims); ++d)
    if (sz[d] != sizes[d] || st[d] != strides[d]) return false;
  return dim <= kDims || hash_beyond(sz, st) == beyond;
}

BoundProgram::BoundProgram(int64_t handle, at::TensorList src, at::TensorList dst,
                           c10::Device device, const at::Tensor& status)
    : handle_(handle), device_(device) {
  const std::shared_ptr<const CopyProgram> shared = registered_program(handle);
  const CopyProgram& program = *shared;
  check_program_call(program, kNoStep, src.size(), dst.size(), "kvlayout");
  num_src_ = src.size();
  num_dst_ = dst.size();
  const BoundLaunchFactory factory = factories()[static_cast<size_t>(device.type())];
  TORCH_CHECK_VALUE(factory != nullptr, "kvlayout: copy programs cannot run on ", device,
              " in this build (backends: see kvlayout.ops.built_backends())");
  for (const at::Tensor& t : src) src_prints_.push_back(TensorFingerprint::of(t));
  for (const at::Tensor& t : dst) dst_prints_.push_back(TensorFingerprint::of(t));
  std::vector<char> used(dst.size(), 0);
  steps_.resize(program.steps.size());
  for (size_t k = 0; k < program.steps.size(); ++k) {
    Step& step = steps_[k];
    for (const LaunchSpec& spec : program.steps[k]) {
      CopyPlan plan = resolve_launch(spec, program, src, dst);
      if (plan.num_segments == 0) {  // (no layer or plane chosen) nothing to check, nothing to launch
        step.launches.push_back(nullptr);
        step.plans.push_back(std::move(plan));
        continue;
      }
      check_copy_plan(plan, src, dst, std::nullopt, std::nullopt);
      for (int64_t g = 0; g < plan.num_segments; ++g) {
        const int64_t i = plan.src_tensor[g], j = plan.dst_tensor[g];
        if (std::find(step.written.begin(), step.written.end(), j) == step.written.end())
          step.written.push_back(j);
        if (std::find(step.read.begin(), step.read.end(), i) == step.read.end())
          step.read.push_back(i);
        used[j] = 1;
      }
      step.bytes_per_token += plan.num_segments * plan.row_bytes();
      step.launches.push_back(factory(plan, src, dst, device, status));
      step.plans.push_back(std::move(plan));
    }
  }
  for (size_t j = 0; j < dst.size(); ++j)
    if (used[j]) written_ranges_.add(dst[j], static_cast<int64_t>(j));
  written_ranges_.finish();
  // (each launch checked its own destination tensors; launches of different
  // geometry write tensors of other launches' cache parts too)
  check_written_disjoint(written_ranges_, dst, "kvlayout");
}

void BoundProgram::check_step(int64_t step, size_t num_src, size_t num_dst, const char* who) const {
  check_program_call(num_steps(), num_src_, num_dst_, step, num_src, num_dst, who);
}

void BoundProgram::check_still_bound(int64_t step, at::TensorList src, at::TensorList dst,
                                     const char* who) const {
  check_step(step, src.size(), dst.size(), who);
  const Step& s = steps_[static_cast<size_t>(step)];
  for (int64_t i : s.read) {
    TORCH_CHECK(src_prints_[i].matches(src[i]), who, ": source tensor ", i,
                " was resized, re-set or freed since the transfer was prepared (its storage "
                "moved or changed size, or its sizes or strides changed); prepare the transfer "
                "again");
  }
  for (int64_t j : s.written) {
    TORCH_CHECK(dst_prints_[j].matches(dst[j]), who, ": destination tensor ", j,
                " was resized, re-set or freed since the transfer was prepared (its storage "
                "moved or changed size, or its sizes or strides changed); prepare the transfer "
                "again");
  }
}

bool BoundProgram::still_bound(int64_t step, at::TensorList src, at::TensorList dst) const {
  if (src.size() != src_prints_.size() || dst.size() != dst_prints_.size()) return false;
  const Step& s = steps_[static_cast<size_t>(step)];
  for (int64_t i : s.read)
    if (!src_prints_[i].matches(src[i])) return false;
  for (int64_t j : s.written)
    if (!dst_prints_[j].matches(dst[j])) return false;
  return true;
}

bool BoundProgram::still_valid(at::TensorList src, at::TensorList dst) const {
  // Step 0 (every chosen layer) uses every tensor any other step uses.
  for (const auto& l : steps_.front().launches)
    if (l != nullptr && !l->still_valid(src, dst)) return false;
  return true;
}

void BoundProgram::run(int64_t step, const RunArgs& args) const {
  check_step(step, num_src_, num_dst_, "kvlayout");
  TORCH_CHECK_VALUE(args.num_tokens >= 0, "kvlayout: num_tokens must be >= 0, got ",
                    args.num_tokens);
  TORCH_CHECK_VALUE(args.skip_prefix >= 0 && args.skip_prefix <= args.num_tokens,
                    "kvlayout: skip_prefix must lie in [0, num_tokens = ", args.num_tokens,
                    "], got ", args.skip_prefix);
  TORCH_CHECK_VALUE(args.max_ctas >= 0, "kvlayout: max_ctas must be >= 0 (0 = default), got ",
                    args.max_ctas);
  const SlotArray src_slots =
      slot_array(args.src_slots, args.num_tokens, "src_slots", "num_tokens", args.slot_prefixes);
  const SlotArray dst_slots =
      slot_array(args.dst_slots, args.num_tokens, "dst_slots", "num_tokens", args.slot_prefixes);
  check_slots_not_written(written_ranges_, args.src_slots, "src_slots", "kvlayout");
  check_slots_not_written(written_ranges_, args.dst_slots, "dst_slots", "kvlayout");
  if (args.skip_prefix >= args.num_tokens) return;
  const Step& s = steps_[static_cast<size_t>(step)];
  check_run_size(args.num_tokens, s.bytes_per_token);
  RecordedBefore before = args.record_errors ? RecordedBefore{} : RecordedBefore::everything();
  for (size_t i = 0; i < s.plans.size(); ++i) {
    if (s.plans[i].num_segments == 0) continue;
    s.launches[i]->run(s.plans[i], src_slots, dst_slots, args, before);
    before.add(s.plans[i]);
  }
}

namespace {

// The binding cache's entry for `key`, bound and checked on a miss.
std::shared_ptr<const BoundProgram> cached_binding(CacheKey key, int64_t handle,
                                                   at::TensorList src, at::TensorList dst,
                                                   c10::Device device, const at::Tensor& status) {
  BindingCache& cache = binding_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    auto it = cache.index.find(key);
    if (it != cache.index.end()) {
      // Same tensor objects at the same addresses and sizes; what a backend
      // derived beyond that (a pinned page's device alias) is checked again.
      std::shared_ptr<const BoundProgram> hit = it->second->second;
      if (hit->still_valid(src, dst)) {
        cache.order.splice(cache.order.begin(), cache.order, it->second);  // most recent first
        return hit;
      }
      cache.order.erase(it->second);
      cache.index.erase(it);
    }
  }
  auto bound = std::make_shared<const BoundProgram>(handle, src, dst, device, status);
  std::lock_guard<std::mutex> lock(cache.mutex);
  if (cache.index.find(key) == cache.index.end() && cache.capacity > 0) {
    cache.order.emplace_front(key, bound);
    cache.index.emplace(std::move(key), cache.order.begin());
    cache.trim();
  }
  return bound;
}

}  // namespace

std::shared_ptr<const BoundProgram> bound_program(int64_t handle, at::TensorList src,
                                                  at::TensorList dst, c10::Device device,
                                                  const at::Tensor& status) {
  CacheKey key;
  key.words.reserve(kKeyPrefixWords + 1 + 12 * (src.size() + dst.size()));
  push_key_prefix(key.words, handle, device, status);
  for (const at::Tensor& t : src) push_tensor_words(key.words, t);
  const size_t dst_begin = key.words.size() + 1;
  key.words.push_back(~uintptr_t(0));
  for (const at::Tensor& t : dst) push_tensor_words(key.words, t);
  hash_key(key, hash_words(key.words.data() + kKeyPrefixWords, dst_begin - 1 - kKeyPrefixWords),
           hash_words(key.words.data() + dst_begin, key.words.size() - dst_begin));
  return cached_binding(std::move(key), handle, src, dst, device, status);
}

std::shared_ptr<const BoundProgram> bound_program(int64_t handle, const TensorGroup& src,
                                                  const TensorGroup& dst, c10::Device device,
                                                  const at::Tensor& status) {
  if (!src.unchanged() || !dst.unchanged())  // (a tensor resized or re-set since: as it is now)
    return bound_program(handle, src.tensors(), dst.tensors(), device, status);
  CacheKey key;
  key.words.reserve(kKeyPrefixWords + 1 + src.words().size() + dst.words().size());
  push_key_prefix(key.words, handle, device, status);
  key.words.insert(key.words.end(), src.words().begin(), src.words().end());
  key.words.push_back(~uintptr_t(0));
  key.words.insert(key.words.end(), dst.words().begin(), dst.words().end());
  hash_key(key, src.words_hash(), dst.words_hash());
  return cached_binding(std::move(key), handle, src.tensors(), dst.tensors(), device, status);
}

void set_binding_cache_capacity(int64_t capacity) {
  TORCH_CHECK_VALUE(capacity >= 0, "kvlayout: the binding cache capacity must be >= 0, got ",
                    capacity);
  BindingCache& cache = binding_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.capacity = static_cast<size_t>(capacity);
  cache.trim();
}

int64_t binding_cache_capacity() {
  BindingCache& cache = binding_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return static_cast<int64_t>(cache.capacity);
}

namespace {
std::atomic<int32_t> host_hints{kStreamingHints};
}  // namespace

void set_host_cache_hints(int32_t hints) {
  TORCH_CHECK_VALUE(hints == kStreamingHints || hints == kDefaultHints,
                    "kvlayout: host cache hints must be ", int(kStreamingHints), " (streaming) or ",
                    int(kDefaultHints), " (default), got ", hints);
  host_hints.store(hints, std::memory_order_relaxed);
}

int32_t host_cache_hints() { return host_hints.load(std::memory_order_relaxed); }

namespace {
std::atomic<int32_t> host_shape{kHostRowPerCta};
}  // namespace

void set_host_launch_shape(int32_t shape) {
  TORCH_CHECK_VALUE(shape == kHostRowPerCta || shape == kHostWalk,
                    "kvlayout: a host launch shape must be ", int(kHostRowPerCta), " (row per CTA) or ",
                    int(kHostWalk), " (walk), got ", shape);
  host_shape.store(shape, std::memory_order_relaxed);
}

int32_t host_launch_shape() { return host_shape.load(std::memory_order_relaxed); }

int64_t binding_cache_size() {
  BindingCache& cache = binding_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return static_cast<int64_t>(cache.index.size());
}

c10::Device program_device(at::TensorList src, at::TensorList dst,
                           const std::optional<at::Tensor>& src_slots,
                           const std::optional<at::Tensor>& dst_slots) {
  for (const at::Tensor& t : dst)
    if (t.defined() && !t.device().is_cpu()) return t.device();
  for (const at::Tensor& t : src)
    if (t.defined() && !t.device().is_cpu()) return t.device();
  for (const auto* s : {&src_slots, &dst_slots})
    if (s->has_value() && (*s)->defined() && !(*s)->device().is_cpu()) return (*s)->device();
  return c10::Device(c10::kCPU);
}

void refuse_write(const at::Tensor& t, const char* op, const char* name, int64_t index) {
  const bool grad_leaf = c10::GradMode::is_enabled() && t.requires_grad() && t.is_leaf();
  const bool inference = t.is_inference() && !c10::InferenceMode::is_enabled();
  if (!grad_leaf && !inference) return;  // (a non-leaf, or an inference tensor in inference mode)
  const std::string what =
      index < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(index) + "]";
  TORCH_CHECK(!grad_leaf, op, ": ", what,
              " is a leaf tensor that requires grad; a leaf Variable that requires grad is "
              "being used in an in-place operation (write under torch.no_grad() or into a "
              "tensor that does not require grad)");
  TORCH_CHECK(!inference, op, ": ", what,
              " is an inference tensor; inplace update to inference tensor outside "
              "InferenceMode is not allowed (make a clone to get a normal tensor first)");
}

namespace {
std::atomic<int64_t> early_loads{0};
}  // namespace

int64_t early_load_launches() { return early_loads.load(); }
void count_early_load_launch() { early_loads.fetch_add(1, std::memory_order_relaxed); }

void copy_program(int64_t handle, at::TensorList src, at::TensorList dst,
                  const std::optional<at::Tensor>& src_slots,
                  const std::optional<at::Tensor>& dst_slots, int64_t step, c10::SymInt num_tokens,
                  c10::SymInt skip_prefix, int64_t max_ctas, const at::Tensor& status,
                  bool validate) {
  const c10::Device device = program_device(src, dst, src_slots, dst_slots);
  const auto bound = bound_program(handle, src, dst, device, status);
  bound->run(step, RunArgs{src_slots, dst_slots, num_tokens.expect_int(),
                           skip_prefix.expect_int(), max_ctas, validate});
}

TORCH_LIBRARY_IMPL(kvlayout, CPU, m) { m.impl("copy_program", &copy_program); }
#ifdef KVLAYOUT_WITH_CUDA
TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) { m.impl("copy_program", &copy_program); }
#endif
#ifdef KVLAYOUT_WITH_SYCL
TORCH_LIBRARY_IMPL(kvlayout, XPU, m) { m.impl("copy_program", &copy_program); }
#endif

}  // namespace kvlayout
