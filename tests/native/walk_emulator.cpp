// Runs the device kernel's work walk (kvlayout/copy_rows_kernel.h) on the
// host, one thread after the other, so that the walk every GPU backend uses is
// checked on machines without a GPU (in its early-loads form, which covers the
// other: that one waits before the walk). Loaded by tests/test_kernel_walk.py
// through ctypes.
#include <cstdint>
#include <cstring>
#include <iterator>
#include <type_traits>

#include "kvlayout/copy_rows_kernel.h"

namespace {

// The walk runs as an early-loads kernel does (copy_rows_cuda.cuh): each thread
// waits once, before its first write and at its end. These count, over the
// last emulated launch, the waits, and the loads and writes made by a thread
// that had not waited yet (writes must be none).
struct WaitCounts {
  int64_t waits = 0, writes_before = 0, loads_before = 0;
  bool waited = false;  // the current thread's
} g_counts;

struct WaitOnce {
  void operator()() const {
    if (!g_counts.waited) {
      g_counts.waited = true;
      ++g_counts.waits;
    }
  }
};

template <int VEC>
struct Bytes {
  unsigned char b[VEC];
};

template <int VEC>
struct HostMem {
  using vec_type = Bytes<VEC>;
  static vec_type load(const vec_type* p) {
    if (!g_counts.waited) ++g_counts.loads_before;
    vec_type v;
    std::memcpy(&v, p, VEC);
    return v;
  }
  static void store(vec_type* p, vec_type v) {
    if (!g_counts.waited) ++g_counts.writes_before;
    std::memcpy(p, &v, VEC);
  }
};

struct HostRecorder {
  int64_t* status;
  void operator()(int64_t token, int64_t value, int64_t bound, int64_t which) const {
    if (!g_counts.waited) ++g_counts.writes_before;
    if (status[0]++ == 0) {
      status[1] = token;
      status[2] = value;
      status[3] = bound;
      status[4] = which;
    }
  }
};

kvlayout::RowGeometry geometry(const int64_t* g) { return {g[0], g[1], g[2], g[3], g[4]}; }

// What the next emulated launch records (kvl_set_recording): its
// src/dst_recorded_from bounds (see kvlayout::kRecordEverything).
struct Recording {
  int64_t src_from = kvlayout::kRecordEverything, dst_from = kvlayout::kRecordEverything;
} g_recording;

template <int VEC, int UNROLL>
void walk_all(const kvlayout::CopyRowsArgs& a, const char* const* src, char* const* dst,
              int64_t num_threads) {
  g_counts = WaitCounts{};
  for (int64_t thread = 0; thread < num_threads; ++thread) {
    g_counts.waited = false;
    WaitOnce before_write;
    kvlayout::copy_rows_walk<VEC, UNROLL, HostMem<VEC>>(a, src, dst, thread, num_threads,
                                                        HostRecorder{a.status}, before_write);
    before_write();
  }
}

// f(std::integral_constant<int, VEC>) for vec, a width a launch moves; 0, or -1 for another vec.
template <class F>
int with_vec(int vec, const F& f) {
  switch (vec) {
    case 16: f(std::integral_constant<int, 16>{}); return 0;
    case 8: f(std::integral_constant<int, 8>{}); return 0;
    case 4: f(std::integral_constant<int, 4>{}); return 0;
    case 2: f(std::integral_constant<int, 2>{}); return 0;
    case 1: f(std::integral_constant<int, 1>{}); return 0;
    default: return -1;
  }
}

template <int UNROLL>
int walk_vec(int vec, const kvlayout::CopyRowsArgs& a, const char* const* src, char* const* dst,
             int64_t num_threads) {
  return with_vec(vec, [&](auto width) { walk_all<width.value, UNROLL>(a, src, dst, num_threads); });
}

// walk_vec with the UNROLL of kWalkUnrolls (from the I-th on) that equals `unroll`; -1 where none does.
template <size_t I = 0>
int walk_unroll(int unroll, int vec, const kvlayout::CopyRowsArgs& a, const char* const* src,
                char* const* dst, int64_t num_threads) {
  if constexpr (I == std::size(kvlayout::kWalkUnrolls)) {
    return -1;
  } else {
    if (unroll == kvlayout::kWalkUnrolls[I])
      return walk_vec<kvlayout::kWalkUnrolls[I]>(vec, a, src, dst, num_threads);
    return walk_unroll<I + 1>(unroll, vec, a, src, dst, num_threads);
  }
}

// A launch as a backend passes it: its arguments and segment table.
struct Launch {
  kvlayout::CopyRowsArgs a{};
  const char* src[1024];
  char* dst[1024];
};

// `launch` from kvl_emulate_*'s arguments; false where they have too many segments.
bool make_launch(Launch& launch, const int64_t* src_geometry, const int64_t* dst_geometry,
                 const void* src_slots, int64_t src_slot_stride, const void* dst_slots,
                 int64_t dst_slot_stride, int32_t slot_bytes, int64_t skip_prefix,
                 int64_t num_tokens, int64_t num_segments, const int64_t* src_offsets,
                 const int64_t* dst_offsets, char* src_buffer, char* dst_buffer,
                 int64_t num_pieces, int64_t piece_bytes, int32_t vec, int64_t* status) {
  kvlayout::CopyRowsArgs& a = launch.a;
  a.src_geom = geometry(src_geometry);
  a.dst_geom = geometry(dst_geometry);
  a.src_slots = {src_slots, src_slot_stride, slot_bytes, src_slots == nullptr ? 1 : 0};
  a.dst_slots = {dst_slots, dst_slot_stride, slot_bytes, dst_slots == nullptr ? 1 : 0};
  a.skip_prefix = skip_prefix;
  a.tokens = num_tokens - skip_prefix;
  a.num_segments = num_segments;
  a.status = status;
  a.src_recorded_from = g_recording.src_from;
  a.dst_recorded_from = g_recording.dst_from;
  kvlayout::prepare_copy_rows_args(a, num_pieces, piece_bytes / vec);
  if (num_segments > 1024) return false;
  for (int64_t j = 0; j < num_segments; ++j) {
    launch.src[j] = src_buffer + src_offsets[j];
    launch.dst[j] = dst_buffer + dst_offsets[j];
  }
  return true;
}

// The word of the next emulated row-per-CTA launches (kvl_set_row_word): 0,
// the launch's vector; else 1, 2, 4, 8 or 16 bytes, at most the vector.
int32_t g_row_word = 0;

// Every (token, segment) row by copy_one_row in WORD-byte words, `lanes`
// lanes each, in the order of a CUDA grid of (tokens, segments) CTAs; the
// kernel has waited.
template <int VEC, int WORD>
void rows_all(const Launch& launch, int64_t lanes) {
  g_counts = WaitCounts{};
  g_counts.waited = true;
  for (int64_t seg = 0; seg < launch.a.num_segments; ++seg)
    for (int64_t t = 0; t < launch.a.tokens; ++t)
      for (int64_t lane = 0; lane < lanes; ++lane)
        kvlayout::copy_one_row<VEC, HostMem<WORD>>(launch.a, launch.src[seg], launch.dst[seg], t,
                                                   seg, lane, lanes, HostRecorder{launch.a.status});
}

// rows_all in the words of g_row_word; -1 for a word wider than the vector.
template <int VEC>
int rows_in_words(const Launch& launch, int64_t lanes) {
  int rc = 0;
  const int word = g_row_word == 0 ? VEC : g_row_word;
  if (with_vec(word, [&](auto w) {
        if constexpr (w.value <= VEC) rows_all<VEC, w.value>(launch, lanes);
        else rc = -1;
      }) != 0)
    return -1;
  return rc;
}

}  // namespace

extern "C" {

// geometry: [num_slots, page_size, stride_page, stride_in_page, stride_piece]
// per side; slots: nullptr for identity (the SlotArray flag); segment offsets index the buffers.
// unroll: one of kWalkUnrolls, num_threads threads walking; or 0, one row per CTA
// (copy_one_row, in the words kvl_set_row_word set) with num_threads lanes each. Returns 0, or -1
// for an unsupported vec/unroll/word.
int kvl_emulate_walk(const int64_t* src_geometry, const int64_t* dst_geometry,
                     const void* src_slots, int64_t src_slot_stride, const void* dst_slots,
                     int64_t dst_slot_stride, int32_t slot_bytes, int64_t skip_prefix,
                     int64_t num_tokens, int64_t num_segments, const int64_t* src_offsets,
                     const int64_t* dst_offsets, char* src_buffer, char* dst_buffer,
                     int64_t num_pieces, int64_t piece_bytes, int32_t vec, int32_t unroll,
                     int64_t num_threads, int64_t* status) {
  Launch launch;
  if (!make_launch(launch, src_geometry, dst_geometry, src_slots, src_slot_stride, dst_slots,
                   dst_slot_stride, slot_bytes, skip_prefix, num_tokens, num_segments, src_offsets,
                   dst_offsets, src_buffer, dst_buffer, num_pieces, piece_bytes, vec, status))
    return -1;
  if (unroll != 0) return walk_unroll(unroll, vec, launch.a, launch.src, launch.dst, num_threads);
  int rc = 0;
  if (with_vec(vec, [&](auto width) { rc = rows_in_words<width.value>(launch, num_threads); }) != 0)
    return -1;
  return rc;
}

// The words of the row-per-CTA launches emulated from now on: 0 (the launch's vector) or 1..16 bytes.
void kvl_set_row_word(int32_t word) { g_row_word = word; }

// kWalkUnrolls: every loads-in-flight count a launch walks with, the ones kvl_emulate_walk takes.
void kvl_walk_unrolls(int32_t* out) {
  for (size_t i = 0; i < std::size(kvlayout::kWalkUnrolls); ++i) out[i] = kvlayout::kWalkUnrolls[i];
}

// The recording of the launches emulated from now on (mode: a RecordErrors value).
void kvl_set_recording(int64_t src_from, int64_t dst_from) {
  g_recording = Recording{src_from, dst_from};
}

// kMaxWalkCount, the longest row (in vectors) and the most segments of a launch.
int64_t kvl_max_walk_count() { return kvlayout::kMaxWalkCount; }

// [waits, writes before a wait, loads before a wait] of the last emulated launch.
void kvl_wait_counts(int64_t* out) {
  out[0] = g_counts.waits;
  out[1] = g_counts.writes_before;
  out[2] = g_counts.loads_before;
}

// q and r of n / d through FastDivmod::make(d, max_dividend).
void kvl_fast_divmod(int64_t d, int64_t max_dividend, int64_t n, int64_t* q, int64_t* r) {
  kvlayout::FastDivmod::make(d, max_dividend).divmod(n, *q, *r);
}

}  // extern "C"
