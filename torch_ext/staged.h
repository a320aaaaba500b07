// The staged host transfer's run loop (engine="staged"; planned by
// kvlayout/ops/staged.py): a transfer between a device cache and a pinned
// host chunk that moves the rows with the copy kernel inside device memory,
// through a bounded staging ring, and crosses PCIe with the copy engine.
//
// The ring has R slots; each holds a "mini" cache of the host's layout with
// at most `tokens_per_chunk` slots and one layer group's layers. A transfer
// of T tokens is cut into chunks (layer group g, tokens [t0, t0 + n)),
// n <= tokens_per_chunk, chunk c using ring slot c % R, so the kernel of one
// chunk runs while the copy engine moves another:
//
//   device -> host: [keep kernel: host rows of tokens without a device row
//                    -> ring] -> copy kernel: device -> ring (main stream)
//                    -> copy engine: ring -> host (side stream)
//   host -> device: copy engine: host -> ring (side stream)
//                    -> copy kernel: ring -> device (main stream)
//
// A call's chunks hold n_call = staged_chunk_tokens(...) <= tokens_per_chunk
// tokens, but one short chunk at the pipeline's idle end (staged_cut: in the
// layer group there); a token's ring row is its index in its chunk (so one
// per way of cutting); the host row of token t is t. Every row still moves
// through the copy kernel, so slots, skip_prefix and recorded out-of-range
// slots behave as the kernel engine's.
// Streams are ordered with events; no host synchronisation, so a staged
// transfer can be captured in a CUDA graph (the CUDA engine captures repeated
// call shapes itself and replays them: cuda/staged.cu).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "program.h"

namespace kvlayout {

// One (layer, plane, row part) segment of a layer group: slot 0's row in the
// host tensor and in a ring slot (the same offset in every ring slot), rows
// of `row_bytes` back to back on both sides.
struct StagedSegment {
  int64_t host_tensor = 0;
  int64_t host_offset = 0;  // bytes from the host tensor's data pointer
  int64_t ring_offset = 0;  // bytes from the ring slot's start
  int64_t row_bytes = 0;
};

// One copy-engine call of a chunk: `blocks` blocks of `count` runs of
// `bytes` bytes, run i of block b between host tensor `host_tensor` at byte
// host_offset + b * host_block_step + i * host_step and the ring slot at
// byte ring_offset + b * ring_block_step + i * ring_step. One run is a plain
// copy, one block of several runs a 2-D copy (pitches host_step and
// ring_step), several blocks a 3-D copy: each step is then the pitch of its
// side (at least `bytes`, below 2^31), and each block step a whole multiple
// of it, of at least `count` pitches.
struct StagedCopy {
  int64_t host_tensor = 0;
  int64_t host_offset = 0;
  int64_t ring_offset = 0;
  int64_t bytes = 0;
  int64_t count = 1;
  int64_t host_step = 0;
  int64_t ring_step = 0;
  int64_t blocks = 1;
  int64_t host_block_step = 0;
  int64_t ring_block_step = 0;
};

// The copies of one layer group's chunk of tokens [t0, t0 + n): the
// segments' rows (in the group's order), a copy that continues the previous
// one on both sides merged into it, then consecutive copies of one length at
// constant steps within one host tensor folded into one 2-D copy (each step
// at least the length, so the runs do not overlap, and below 2^31, the
// pitch the copy engine takes), then consecutive copies of one shape at
// constant steps folded into one 3-D copy where both sides' steps are whole
// multiples of a pitch (a K/V chunk's two planes: one copy, not one per
// plane). Fewer copies: fewer driver calls issued directly, fewer nodes in a
// captured graph. Without `fold_blocks`, no 3-D copies: a graph launched as a
// conditional node's body (staged_graph_on_device()) ran them slower than one
// 2-D copy per plane (H100 record of f0f7fef: an L32 H8 load of 32768 tokens at
// 73.4 % of the pinned ceiling with them, 90.2 % without).
std::vector<StagedCopy> staged_copies(const std::vector<StagedSegment>& group, int64_t t0, int64_t n,
                                      bool fold_blocks = true);

// Tokens per chunk of one call: `tokens` tokens (past skip_prefix) whose rows
// carry `bytes_per_token` bytes in all layer groups, cut in `groups` layer
// groups, through ring slots of `capacity` tokens, under an SM budget of
// `max_ctas` (0: none). The capacity, or fewer tokens (a multiple of 16) so
// that the call has about staged_chunks() chunks in all (twice as many
// under a budget), each still moving at least about kStagedChunkBytes
// (kStagedBudgetChunkBytes under a budget), and without a budget at least
// kStagedLargeChunkBytes where the call still has kStagedFewestChunks of
// them (a 64 MiB call: 4 chunks of 16 MiB, not 8 of 8 MiB). A
// pipeline of two stages idles one stage for one chunk at its start and its
// end (the first chunk's kernel before the copy engine has work; the last
// chunk's kernel after it is done), which a transfer of a few slot-sized
// chunks feels: in the H200 record, unbudgeted staged transfers of 2-5
// chunks reached 93.7-96.6 % of the pinned ceiling and those of 16 or more
// 97.9-99.5 %, and a 64 MiB load under an SM budget of 4 (a slow kernel
// behind the copy engine) 79 %. More chunks cost host work where a call is
// issued directly (a few driver calls each), hence fewer without a budget,
// where the kernel of a chunk is short, and more nodes in a captured graph,
// whose launch's host time grows with them. Without a budget the kernel of
// a chunk is short beside its copy, so a chunk's fixed cost (a copy and an
// event each way) outweighs the overlap it buys in small calls: in the H100
// record of 4e3d67a (bench/results/staged_settings_4e3d67a_h100), the 4 MiB
// L32 H1 transfers at T = 256 ran at 40.7-44.9 GB/s kernel only in one chunk
// against 35.9-41.3 in two, and the 9 MiB L32 MLA ones as fast in one chunk
// as in four (45.5-48.9 against 45.7-47.3) with 27-62 us of host work per
// call against 51-79, and slot-sized chunks of 32 MiB moved a 64 MiB call
// within a point of eight of 8 MiB (the H200 record); hence chunks of at
// least 8 MiB without a budget. In the H100 record of b1ed027
// (bench/results/staged_settings_b1ed027_h100, both settings in turn, two
// rounds), the 64 MiB L32 H1 calls at T = 4096 in 4 chunks of 16 MiB (and
// the short one) ran at 52.2-52.3 GB/s to the host and 53.4-53.5 from it
// end to end, with 24-25 us of host work per call, against 51.9-52.0,
// 52.8-53.0 and 33-35 us in 8 chunks of 8 MiB; hence chunks of at least
// 16 MiB where a call still has 4. Under a budget the kernel is as slow
// as the copy, and more, smaller chunks overlap them. Reads
// staged_chunks() once: a call computes its chunk once and passes it on.
int64_t staged_chunk_tokens(int64_t capacity, int64_t groups, int64_t tokens, int64_t bytes_per_token,
                            int64_t max_ctas);

// How a layer group's tokens past skip_prefix are cut into chunks: the first
// chunk holds `first` tokens (1..per_chunk), each other one `per_chunk`, the
// last what is left; `short_tokens` is the short chunk's (below), 0 where
// none. The token `i` tokens past skip_prefix lies in ring row `i` of the
// first chunk, or row `(i - first) % per_chunk` of a later one.
struct StagedCut {
  int64_t per_chunk = 1;
  int64_t first = 1;
  int64_t short_tokens = 0;
  // Whole chunks of per_chunk tokens (the last what is left).
  static StagedCut whole(int64_t per_chunk) { return {per_chunk, per_chunk, 0}; }
  // Chunks of `tokens` tokens (none of none).
  int64_t chunks(int64_t tokens) const {
    if (tokens <= 0) return 0;
    return tokens <= first ? 1 : 1 + (tokens - first + per_chunk - 1) / per_chunk;
  }
  // The end of the chunk that starts at token t0 of a call from `skip` on.
  int64_t end(int64_t skip, int64_t t0, int64_t num_tokens) const {
    return std::min(t0 + (t0 == skip ? first : per_chunk), num_tokens);
  }
};

// A staged call of `tokens` tokens (past skip_prefix) in chunks of
// `per_chunk` (staged_chunk_tokens) without an SM budget (max_ctas 0) has,
// where a layer group has more than one chunk, one short chunk
// (kStagedShortChunk of a full one, at least 16 tokens) at the pipeline's
// idle end rather than a full one: to the host the
// call's first chunk (its kernels run before the copy engine has work), from
// the host its last (its kernel runs after the copy engine is done). So the
// layer group at that end (staged_cut_group: the first to the host, the last
// from it) is cut by staged_cut, whose first chunk from the host holds what
// whole chunks leave over; every other group in whole chunks. In the H100
// record of f0f7fef (its h100_staged_timeline.txt) a full first chunk's kernels
// took 17 us before the first copy to the host, and the last chunk's kernel
// 10 us after the last copy from it, of a 1.2 ms transfer; in the H100
// record of b1ed027 the short chunk's took 10 us and 4.5 us, the call's
// span 1.072x / 1.052x a pinned copy of its bytes instead of 1.095x /
// 1.071x. Under a budget, whose kernel is as slow as the copy, a call has
// none: there the A/B of b1ed027 against f0f7fef had the L32 H1 T = 4096
// calls to the host 2 % slower with it under 4 and 8 SMs (the only change
// to their device work between the two trees).
StagedCut staged_cut(int64_t tokens, int64_t per_chunk, bool to_host, int64_t max_ctas);
inline size_t staged_cut_group(size_t groups, bool to_host) { return to_host || groups == 0 ? 0 : groups - 1; }
constexpr int64_t kStagedShortChunk = 4;  // a short chunk: 1/4 of a full one

constexpr int64_t kStagedChunks = 8;
constexpr int64_t kStagedChunkBytes = int64_t(8) << 20;        // without an SM budget
constexpr int64_t kStagedLargeChunkBytes = int64_t(16) << 20;  // without one, where a call has kStagedFewestChunks
constexpr int64_t kStagedFewestChunks = 4;
constexpr int64_t kStagedBudgetChunkBytes = int64_t(2) << 20;  // under one

// The chunks a staged call aims at without an SM budget (twice as many under
// one; 1: chunks of a ring slot's capacity). Process-wide, kStagedChunks
// unless set; a call reads it once (a captured call keeps the chunks it was
// captured with, and a call shape captured under another count is captured
// again).
void set_staged_chunks(int64_t chunks);
int64_t staged_chunks();

// Captured call shapes each staged transfer keeps (least recently used go
// first; 0: every call is issued directly). Each holds an instantiated graph
// and device buffers for its slots and token table (a few bytes per token).
// Process-wide; a lowered bound applies at each transfer's next call.
void set_staged_graph_capacity(int64_t graphs);
int64_t staged_graph_capacity();

// How a kept graph is launched (process-wide, off unless set; a call reads it
// once, and a call shape kept under the other setting is captured again).
// Off: the captured graph itself, each of whose nodes the host's launch
// issues (in the H200 record about 1.75 us of cudaGraphLaunch per node, and
// from about 190 nodes the launch waits for the device's queue). On: the
// captured graph as the body of a conditional node whose condition is always
// true, in a graph of that one node: the device evaluates the condition and
// starts the body itself, so the host's launch carries one node. A backend
// or runtime that cannot build such a graph keeps the captured graph
// (KeptGraph::on_device says which one a call replays).
void set_staged_graph_on_device(bool on);
bool staged_graph_on_device();

// Whether a call whose token count has no graph of its own yet may replay
// the graph kept for a shorter call (process-wide, off unless set; a call
// reads it once). On, a call of T tokens from skip_prefix s that is not a
// repeat of a kept shape replays the graph of the call of
// P = staged_reuse_prefix(T, s) tokens where one is kept (captured on that
// call shape's second sighting, whichever token counts brought it), then
// moves tokens [P, T) with the direct kernel between the caches themselves
// (StagedSetup::direct), as a call from skip_prefix P: one launch, where
// issuing them staged would take one chunk per layer group at least. A call
// of P tokens moves exactly the first P tokens' rows and one from skip_prefix
// P the rest, so the pair moves what the call of T would; an engine whose
// calls vary in length shares a few graphs instead of issuing every new
// length's chunks one by one (about 12-28 us of driver calls a chunk). A
// shape run before still gets its own graph.
void set_staged_graph_prefixes(bool on);
bool staged_graph_prefixes();

// The prefix a call of `num_tokens` tokens from skip_prefix may replay under
// staged_graph_prefixes(): skip_prefix plus its n = num_tokens - skip_prefix
// tokens rounded down to a multiple of the largest power of two g <= n / 8
// (so at most 8 prefixes for all the lengths of n's octave, and at most an
// eighth of the tokens left to the direct kernel); 0 where that is no proper
// prefix (n < kStagedReuseMinTokens, or n a multiple of g).
constexpr int64_t kStagedReuseMinTokens = 16;
int64_t staged_reuse_prefix(int64_t num_tokens, int64_t skip_prefix);

// The graph kept for a call shape: `nodes` of captured work (0: none kept, a
// call of that shape is issued directly), launched as the body of a
// conditional node (`on_device`) or as it is; `tokens`: the token count of
// the call it was captured from (the call's own, or its staged_reuse_prefix's
// under staged_graph_prefixes(), the rest then moved by the direct kernel).
struct KeptGraph {
  int64_t nodes = 0;
  bool on_device = false;
  int64_t tokens = 0;
};

struct StagedSetup {
  bool host_is_dst = false;
  // Per (group, ring slot), index group * ring_slots.size() + slot: the copy
  // kernel between the device cache and the slot's mini cache (step 0), and
  // (device -> host only) the keep kernel from the host chunk into it.
  std::vector<std::shared_ptr<const BoundProgram>> kernels, keeps;
  std::vector<at::Tensor> ring_slots;            // device memory, one per ring slot
  std::vector<at::Tensor> host_tensors;          // the host chunk's tensors (pinned)
  std::vector<std::vector<StagedSegment>> groups;  // per layer group
  int64_t tokens_per_chunk = 1;  // a ring slot's capacity (a call's chunks: staged_chunk_tokens)
  int64_t device_num_slots = 0;  // the device cache's slot count (slots >= it are out of range)
  c10::Device device{c10::kCPU};
  int64_t side_stream = 0;       // the backend's stream handle for the copy engine's work
  int64_t ring_stream = -1;      // the stream the ring belongs to (-1: none, a ring of one capture)
  // The kernel engine's program between the caches themselves (step 0), which
  // moves the tokens past a replayed prefix (staged_graph_prefixes); null:
  // they are issued staged.
  std::shared_ptr<const BoundProgram> direct;
};

struct StagedArgs {
  std::optional<at::Tensor> device_slots;  // None: token t's device slot is t
  int64_t num_tokens = 0;
  int64_t skip_prefix = 0;
  int64_t max_ctas = 0;
  bool validate = false;
};

class StagedEngine {
 public:
  virtual ~StagedEngine() = default;
  // Issues the transfer in stream order on the current stream.
  virtual void run(const StagedArgs& args) = 0;
  // Whether the current stream is the ring's and captures no graph: where a
  // kept plan may run without its caller looking the ring up again.
  virtual bool on_ring_stream() const = 0;
  // Calls replayed from a captured graph so far, and the graphs kept now.
  virtual int64_t replayed_calls() const = 0;
  virtual int64_t kept_graphs() const = 0;
  // The graph kept for the call shape of `args` (slot_bytes: the device
  // slots' element size, 0 for none), which a call of that shape that does
  // not validate replays; nodes 0 when none is kept (such a call is issued
  // directly). A graph launch's host time grows with the nodes it issues.
  virtual KeptGraph kept_graph(const StagedArgs& args, int64_t slot_bytes) const = 0;
};

using StagedFactory = std::unique_ptr<StagedEngine> (*)(StagedSetup setup);
// Backends with a copy engine register their factory at load time.
void register_staged_factory(c10::DeviceType type, StagedFactory factory);
// nullptr where the build has no staged engine for `type`.
StagedFactory staged_factory(c10::DeviceType type);

}  // namespace kvlayout
