#include "program.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

namespace kvlayout {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

// Programs live as long as the process: a handle baked into a compiled graph
// must stay valid. The planner registers one program per distinct choice
// (layouts, geometry, strides, layers, planes), so the registry stays small.
std::vector<std::unique_ptr<const CopyProgram>>& programs() {
  static std::vector<std::unique_ptr<const CopyProgram>> all;
  return all;
}

std::array<BoundLaunchFactory, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>&
factories() {
  static std::array<BoundLaunchFactory,
                    static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      all{};
  return all;
}

// The arguments of copy_rows for one launch spec, so that binding runs the
// very checks copy_rows runs (storage bounds, overlaps, repeated rows).
CopyPlan plan_launch(const LaunchSpec& spec, at::TensorList src, at::TensorList dst) {
  auto geometry = [](const RowGeometry& g) {
    return std::vector<int64_t>{g.num_slots, g.page_size, g.stride_page, g.stride_in_page,
                                g.stride_piece};
  };
  auto segments = [](const std::vector<Segment>& segs) {
    std::vector<int64_t> out;
    out.reserve(2 * segs.size());
    for (const Segment& s : segs) {
      out.push_back(s.tensor);
      out.push_back(s.offset);
    }
    return out;
  };
  // One token with identity slots: the checks that depend on no slot value.
  return plan_copy_rows(src, dst, std::nullopt, std::nullopt, /*num_tokens=*/1,
                        /*skip_prefix=*/0, segments(spec.src_segments),
                        segments(spec.dst_segments), geometry(spec.src_geometry),
                        geometry(spec.dst_geometry), spec.num_pieces, spec.piece_bytes,
                        /*max_ctas=*/0);
}

struct CacheKey {
  std::vector<uintptr_t> words;
  bool operator==(const CacheKey& o) const { return words == o.words; }
};

struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const {
    uint64_t h = 1469598103934665603ull;
    for (uintptr_t w : k.words) h = (h ^ static_cast<uint64_t>(w)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// What a binding's checks depend on: device, dtype, where the data and its
// storage are, the storage's size, and the tensor's sizes and strides.
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

}  // namespace

int64_t register_program(CopyProgram program) {
  TORCH_CHECK(!program.steps.empty(), "kvlayout: a copy program needs at least one step");
  for (const auto& step : program.steps) {
    for (const LaunchSpec& l : step) {
      TORCH_CHECK(l.src_segments.size() == l.dst_segments.size(),
                  "kvlayout: a launch of a copy program has ", l.src_segments.size(),
                  " source and ", l.dst_segments.size(), " destination segments");
    }
  }
  std::lock_guard<std::mutex> lock(registry_mutex());
  programs().push_back(std::make_unique<const CopyProgram>(std::move(program)));
  return static_cast<int64_t>(programs().size()) - 1;
}

const CopyProgram& registered_program(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  TORCH_CHECK_INDEX(handle >= 0 && handle < static_cast<int64_t>(programs().size()),
                    "kvlayout: no copy program has handle ", handle);
  return *programs()[static_cast<size_t>(handle)];
}

void register_bound_launch_factory(c10::DeviceType type, BoundLaunchFactory factory) {
  factories()[static_cast<size_t>(type)] = factory;
}

BoundProgram::Fingerprint BoundProgram::fingerprint(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return {};
  const c10::Storage& storage = t.unsafeGetTensorImpl()->unsafe_storage();  // (no reference count)
  return {t.data_ptr(), storage.unsafeGetStorageImpl(), static_cast<int64_t>(storage.nbytes())};
}

BoundProgram::BoundProgram(int64_t handle, at::TensorList src, at::TensorList dst,
                           c10::Device device, const at::Tensor& status)
    : handle_(handle), device_(device) {
  const CopyProgram& program = registered_program(handle);
  TORCH_CHECK_VALUE(static_cast<int64_t>(src.size()) == program.num_src_tensors,
                    "kvlayout: the copy program reads a source of ", program.num_src_tensors,
                    " tensors, got ", src.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(dst.size()) == program.num_dst_tensors,
                    "kvlayout: the copy program writes a destination of ",
                    program.num_dst_tensors, " tensors, got ", dst.size());
  const BoundLaunchFactory factory = factories()[static_cast<size_t>(device.type())];
  TORCH_CHECK_VALUE(factory != nullptr, "kvlayout: copy programs cannot run on ", device,
              " in this build (backends: see kvlayout.ops.built_backends())");
  for (const at::Tensor& t : src) src_prints_.push_back(fingerprint(t));
  for (const at::Tensor& t : dst) dst_prints_.push_back(fingerprint(t));
  std::vector<char> used(dst.size(), 0);
  steps_.resize(program.steps.size());
  for (size_t k = 0; k < program.steps.size(); ++k) {
    Step& step = steps_[k];
    for (const LaunchSpec& spec : program.steps[k]) {
      CopyPlan plan = plan_launch(spec, src, dst);
      for (int64_t g = 0; g < plan.num_segments; ++g) {
        const int64_t i = plan.src_tensor[g], j = plan.dst_tensor[g];
        if (std::find(step.written.begin(), step.written.end(), j) == step.written.end())
          step.written.push_back(j);
        if (std::find(step.read.begin(), step.read.end(), i) == step.read.end())
          step.read.push_back(i);
        used[j] = 1;
      }
      step.launches.push_back(factory(plan, src, dst, device, status));
      step.plans.push_back(std::move(plan));
    }
  }
  for (size_t j = 0; j < dst.size(); ++j)
    if (used[j]) written_ranges_.add(dst[j], static_cast<int64_t>(j));
  written_ranges_.finish();
}

void BoundProgram::check_still_bound(int64_t step, at::TensorList src, at::TensorList dst,
                                     const char* who) const {
  TORCH_CHECK(src.size() == src_prints_.size() && dst.size() == dst_prints_.size(), who,
              ": the bound caches changed their number of tensors");
  TORCH_CHECK_INDEX(step >= 0 && step < num_steps(), who, ": the copy program has ", num_steps(),
                    " steps (all layers, then one per layer), got step ", step);
  const Step& s = steps_[static_cast<size_t>(step)];
  for (int64_t i : s.read) {
    TORCH_CHECK(fingerprint(src[i]) == src_prints_[i], who, ": source tensor ", i,
                " was resized, re-set or freed since the transfer was prepared (its storage "
                "moved or changed size); prepare the transfer again");
  }
  for (int64_t j : s.written) {
    TORCH_CHECK(fingerprint(dst[j]) == dst_prints_[j], who, ": destination tensor ", j,
                " was resized, re-set or freed since the transfer was prepared (its storage "
                "moved or changed size); prepare the transfer again");
  }
}

bool BoundProgram::still_bound(int64_t step, at::TensorList src, at::TensorList dst) const {
  if (src.size() != src_prints_.size() || dst.size() != dst_prints_.size()) return false;
  const Step& s = steps_[static_cast<size_t>(step)];
  for (int64_t i : s.read)
    if (!(fingerprint(src[i]) == src_prints_[i])) return false;
  for (int64_t j : s.written)
    if (!(fingerprint(dst[j]) == dst_prints_[j])) return false;
  return true;
}

bool BoundProgram::still_valid(at::TensorList src, at::TensorList dst) const {
  // Step 0 (every chosen layer) uses every tensor any other step uses.
  for (const auto& l : steps_.front().launches)
    if (!l->still_valid(src, dst)) return false;
  return true;
}

void BoundProgram::run(int64_t step, const RunArgs& args) const {
  TORCH_CHECK_INDEX(step >= 0 && step < num_steps(), "kvlayout: the copy program has ",
                    num_steps(), " steps (all layers, then one per layer), got step ", step);
  TORCH_CHECK_VALUE(args.num_tokens >= 0, "kvlayout: num_tokens must be >= 0, got ",
                    args.num_tokens);
  TORCH_CHECK_VALUE(args.skip_prefix >= 0 && args.skip_prefix <= args.num_tokens,
                    "kvlayout: skip_prefix must lie in [0, num_tokens = ", args.num_tokens,
                    "], got ", args.skip_prefix);
  TORCH_CHECK_VALUE(args.max_ctas >= 0, "kvlayout: max_ctas must be >= 0 (0 = default), got ",
                    args.max_ctas);
  const SlotArray src_slots =
      parse_index(args.src_slots, args.num_tokens, "src_slots", "num_tokens");
  const SlotArray dst_slots =
      parse_index(args.dst_slots, args.num_tokens, "dst_slots", "num_tokens");
  check_slots_not_written(written_ranges_, args.src_slots, "src_slots", "kvlayout");
  check_slots_not_written(written_ranges_, args.dst_slots, "dst_slots", "kvlayout");
  if (args.skip_prefix >= args.num_tokens) return;
  const Step& s = steps_[static_cast<size_t>(step)];
  for (size_t i = 0; i < s.plans.size(); ++i) {
    if (s.plans[i].num_segments == 0) continue;
    s.launches[i]->run(s.plans[i], src_slots, dst_slots, args);
  }
}

std::shared_ptr<const BoundProgram> bound_program(int64_t handle, at::TensorList src,
                                                  at::TensorList dst, c10::Device device,
                                                  const at::Tensor& status) {
  CacheKey key;
  key.words.reserve(4 + 12 * (src.size() + dst.size()));
  key.words.push_back(static_cast<uintptr_t>(handle));
  key.words.push_back(static_cast<uintptr_t>(device.type()) * 1024u +
                      static_cast<uintptr_t>(device.index() + 1));
  key.words.push_back(reinterpret_cast<uintptr_t>(status.defined() ? status.data_ptr() : nullptr));
  for (const at::Tensor& t : src) push_tensor_words(key.words, t);
  key.words.push_back(~uintptr_t(0));
  for (const at::Tensor& t : dst) push_tensor_words(key.words, t);

  static std::mutex mutex;
  static std::unordered_map<CacheKey, std::shared_ptr<const BoundProgram>, CacheKeyHash> cache;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) {
      // Same tensor objects at the same addresses and sizes; what a backend
      // derived beyond that (a pinned page's device alias) is checked again.
      if (it->second->still_valid(src, dst)) return it->second;
      cache.erase(it);
    }
  }
  auto bound = std::make_shared<const BoundProgram>(handle, src, dst, device, status);
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() >= 256) cache.clear();
  cache.emplace(std::move(key), bound);
  return bound;
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

void check_writable(const at::Tensor& t, const std::string& op, const std::string& name,
                    int64_t index) {
  const bool grad_leaf = c10::GradMode::is_enabled() && t.requires_grad() && t.is_leaf();
  const bool inference = t.is_inference() && !c10::InferenceMode::is_enabled();
  if (!grad_leaf && !inference) return;  // (the name is only spelled out for an error)
  const std::string what = index < 0 ? name : name + "[" + std::to_string(index) + "]";
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
                  const std::optional<at::Tensor>& dst_slots, int64_t step, int64_t num_tokens,
                  int64_t skip_prefix, int64_t max_ctas, const at::Tensor& status,
                  bool validate) {
  const c10::Device device = program_device(src, dst, src_slots, dst_slots);
  const auto bound = bound_program(handle, src, dst, device, status);
  bound->run(step, RunArgs{src_slots, dst_slots, num_tokens, skip_prefix, max_ctas, validate});
}

TORCH_LIBRARY_IMPL(kvlayout, CPU, m) { m.impl("copy_program", &copy_program); }
#ifdef KVLAYOUT_WITH_CUDA
TORCH_LIBRARY_IMPL(kvlayout, CUDA, m) { m.impl("copy_program", &copy_program); }
#endif
#ifdef KVLAYOUT_WITH_SYCL
TORCH_LIBRARY_IMPL(kvlayout, XPU, m) { m.impl("copy_program", &copy_program); }
#endif

}  // namespace kvlayout
