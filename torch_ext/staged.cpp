// The staged transfer's copy list (staged.h): which copy-engine calls move a
// chunk's rows between the host chunk and a ring slot. Host logic only, the
// same for every backend with a copy engine.
#include "staged.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

namespace kvlayout {
namespace {

constexpr int64_t kMaxPitch = (int64_t(1) << 31) - 1;

std::atomic<int64_t> graph_capacity{8};
std::atomic<int64_t> target_chunks{kStagedChunks};
std::atomic<bool> graph_on_device{false};

// Whether `next` is the next run of the 2-D copy `c` (one host tensor, one
// length, the steps `c` already has, or the first step when it has none).
bool continues(const StagedCopy& c, const StagedCopy& next) {
  if (next.host_tensor != c.host_tensor || next.bytes != c.bytes) return false;
  const int64_t host_step = next.host_offset - c.host_offset - (c.count - 1) * c.host_step;
  const int64_t ring_step = next.ring_offset - c.ring_offset - (c.count - 1) * c.ring_step;
  if (c.count > 1) return host_step == c.host_step && ring_step == c.ring_step;
  return host_step >= c.bytes && ring_step >= c.bytes && host_step <= kMaxPitch && ring_step <= kMaxPitch;
}

}  // namespace

void set_staged_graph_capacity(int64_t graphs) {
  TORCH_CHECK_VALUE(graphs >= 0, "kvlayout: the staged graph capacity must be >= 0, got ", graphs);
  graph_capacity.store(graphs, std::memory_order_relaxed);
}

int64_t staged_graph_capacity() { return graph_capacity.load(std::memory_order_relaxed); }

void set_staged_graph_on_device(bool on) { graph_on_device.store(on, std::memory_order_relaxed); }

bool staged_graph_on_device() { return graph_on_device.load(std::memory_order_relaxed); }

void set_staged_chunks(int64_t chunks) {
  TORCH_CHECK_VALUE(chunks >= 1 && chunks <= 1024,
                    "kvlayout: a staged call's chunks must lie in [1, 1024], got ", chunks);
  target_chunks.store(chunks, std::memory_order_relaxed);
}

int64_t staged_chunks() { return target_chunks.load(std::memory_order_relaxed); }

int64_t staged_chunk_tokens(int64_t capacity, int64_t groups, int64_t tokens, int64_t bytes_per_token,
                            int64_t max_ctas) {
  if (tokens <= 0 || capacity <= 0) return std::max<int64_t>(capacity, 1);
  const int64_t total = tokens * std::max<int64_t>(bytes_per_token, 0);
  const int64_t chunks = staged_chunks();
  const bool budget = max_ctas > 0;
  const int64_t least = budget ? kStagedBudgetChunkBytes : kStagedChunkBytes;
  const int64_t wanted = std::clamp<int64_t>(total / least, 1, budget ? 2 * chunks : chunks);
  const int64_t layer_groups = std::max<int64_t>(groups, 1);
  const int64_t per_group = (wanted + layer_groups - 1) / layer_groups;
  const int64_t n = (tokens + per_group - 1) / per_group;
  return std::min(capacity, (n + 15) / 16 * 16);
}

std::vector<StagedCopy> staged_copies(const std::vector<StagedSegment>& group, int64_t t0, int64_t n) {
  std::vector<StagedCopy> runs;
  for (const StagedSegment& seg : group) {
    const int64_t host = seg.host_offset + t0 * seg.row_bytes, bytes = n * seg.row_bytes;
    if (!runs.empty()) {
      StagedCopy& prev = runs.back();
      if (prev.host_tensor == seg.host_tensor && prev.host_offset + prev.bytes == host &&
          prev.ring_offset + prev.bytes == seg.ring_offset) {
        prev.bytes += bytes;
        continue;
      }
    }
    runs.push_back(StagedCopy{seg.host_tensor, host, seg.ring_offset, bytes, 1, 0, 0});
  }
  std::vector<StagedCopy> out;
  for (const StagedCopy& run : runs) {
    if (!out.empty() && continues(out.back(), run)) {
      StagedCopy& c = out.back();
      if (c.count == 1) {
        c.host_step = run.host_offset - c.host_offset;
        c.ring_step = run.ring_offset - c.ring_offset;
      }
      ++c.count;
      continue;
    }
    out.push_back(run);
  }
  return out;
}

}  // namespace kvlayout
