// The staged transfer's copy list (staged.h): which copy-engine calls move a
// chunk's rows between the host chunk and a ring slot. Host logic only, the
// same for every backend with a copy engine.
#include "staged.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <optional>

namespace kvlayout {
namespace {

constexpr int64_t kMaxPitch = (int64_t(1) << 31) - 1;

std::atomic<int64_t> graph_capacity{8};
std::atomic<int64_t> target_chunks{kStagedChunks};
std::atomic<bool> graph_on_device{false};
std::atomic<bool> graph_prefixes{false};

// Whether `next` is the next run of the 2-D copy `c` (one host tensor, one
// length, the steps `c` already has, or the first step when it has none).
bool continues(const StagedCopy& c, const StagedCopy& next) {
  if (next.host_tensor != c.host_tensor || next.bytes != c.bytes) return false;
  const int64_t host_step = next.host_offset - c.host_offset - (c.count - 1) * c.host_step;
  const int64_t ring_step = next.ring_offset - c.ring_offset - (c.count - 1) * c.ring_step;
  if (c.count > 1) return host_step == c.host_step && ring_step == c.ring_step;
  return host_step >= c.bytes && ring_step >= c.bytes && host_step <= kMaxPitch && ring_step <= kMaxPitch;
}

// The pitch of one side of a 3-D copy whose blocks lie `block_step` bytes
// apart: the runs' step where a block holds several (if the block step is a
// whole multiple of it, past the block's last run), else the largest whole
// fraction of the block step below 2^31 (a few tried) that still holds a run
// of `bytes`; 0 where there is none.
int64_t block_pitch(int64_t block_step, int64_t count, int64_t step, int64_t bytes) {
  if (block_step < bytes) return 0;
  if (count > 1) return block_step % step == 0 && block_step / step >= count ? step : 0;
  constexpr int64_t kTries = 64;
  const int64_t first = block_step / kMaxPitch + 1;  // (block_step / first < 2^31)
  for (int64_t k = first; k < first + kTries && block_step / k >= bytes; ++k)
    if (block_step % k == 0) return block_step / k;
  return 0;
}

// `c` with `next` as its next block (one host tensor, one shape, the block
// steps `c` already has, or the first ones where both sides have a pitch);
// nullopt where `next` is not.
std::optional<StagedCopy> with_block(const StagedCopy& c, const StagedCopy& next) {
  if (next.host_tensor != c.host_tensor || next.bytes != c.bytes || next.count != c.count || next.blocks != 1)
    return std::nullopt;
  if (c.count > 1 && (next.host_step != c.host_step || next.ring_step != c.ring_step)) return std::nullopt;
  const int64_t host_block = next.host_offset - c.host_offset - (c.blocks - 1) * c.host_block_step;
  const int64_t ring_block = next.ring_offset - c.ring_offset - (c.blocks - 1) * c.ring_block_step;
  StagedCopy merged = c;
  if (c.blocks > 1) {
    if (host_block != c.host_block_step || ring_block != c.ring_block_step) return std::nullopt;
  } else {
    merged.host_step = block_pitch(host_block, c.count, c.host_step, c.bytes);
    merged.ring_step = block_pitch(ring_block, c.count, c.ring_step, c.bytes);
    if (merged.host_step == 0 || merged.ring_step == 0) return std::nullopt;
    merged.host_block_step = host_block;
    merged.ring_block_step = ring_block;
  }
  ++merged.blocks;
  return merged;
}

}  // namespace

void set_staged_graph_capacity(int64_t graphs) {
  TORCH_CHECK_VALUE(graphs >= 0, "kvlayout: the staged graph capacity must be >= 0, got ", graphs);
  graph_capacity.store(graphs, std::memory_order_relaxed);
}

int64_t staged_graph_capacity() { return graph_capacity.load(std::memory_order_relaxed); }

void set_staged_graph_on_device(bool on) { graph_on_device.store(on, std::memory_order_relaxed); }

bool staged_graph_on_device() { return graph_on_device.load(std::memory_order_relaxed); }

void set_staged_graph_prefixes(bool on) { graph_prefixes.store(on, std::memory_order_relaxed); }

bool staged_graph_prefixes() { return graph_prefixes.load(std::memory_order_relaxed); }

int64_t staged_reuse_prefix(int64_t num_tokens, int64_t skip_prefix) {
  const int64_t n = num_tokens - skip_prefix;
  if (skip_prefix < 0 || n < kStagedReuseMinTokens) return 0;
  int64_t granule = 1;
  while (granule * 16 <= n) granule *= 2;  // the largest power of two <= n / 8
  const int64_t whole = n / granule * granule;
  return whole < n ? skip_prefix + whole : 0;
}

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
  // without a budget, chunks of kStagedLargeChunkBytes where the call still has kStagedFewestChunks of
  // them, else as many of kStagedChunkBytes as there are, up to kStagedFewestChunks
  const int64_t wanted =
      budget ? std::clamp<int64_t>(total / kStagedBudgetChunkBytes, 1, 2 * chunks)
             : std::clamp<int64_t>(std::max(std::min(total / kStagedChunkBytes, kStagedFewestChunks),
                                            total / kStagedLargeChunkBytes),
                                   1, chunks);
  const int64_t layer_groups = std::max<int64_t>(groups, 1);
  const int64_t per_group = (wanted + layer_groups - 1) / layer_groups;
  const int64_t n = (tokens + per_group - 1) / per_group;
  return std::min(capacity, (n + 15) / 16 * 16);
}

StagedCut staged_cut(int64_t tokens, int64_t per_chunk, bool to_host, int64_t max_ctas) {
  TORCH_CHECK_VALUE(per_chunk >= 1, "kvlayout: a staged chunk must hold at least one token, got ", per_chunk);
  const int64_t short_chunk = std::min(per_chunk, std::max<int64_t>(16, per_chunk / kStagedShortChunk / 16 * 16));
  if (max_ctas > 0 || tokens <= per_chunk || short_chunk == per_chunk) return StagedCut::whole(per_chunk);
  if (to_host) return {per_chunk, short_chunk, short_chunk};
  const int64_t left_over = (tokens - short_chunk) % per_chunk;  // (the last chunk: short_chunk)
  return {per_chunk, left_over == 0 ? per_chunk : left_over, short_chunk};
}

std::vector<StagedCopy> staged_copies(const std::vector<StagedSegment>& group, int64_t t0, int64_t n,
                                      bool fold_blocks) {
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
  if (!fold_blocks) return out;
  std::vector<StagedCopy> blocks;
  for (const StagedCopy& copy : out) {
    if (!blocks.empty()) {
      if (std::optional<StagedCopy> merged = with_block(blocks.back(), copy)) {
        blocks.back() = *merged;
        continue;
      }
    }
    blocks.push_back(copy);
  }
  return blocks;
}

}  // namespace kvlayout
