// kvlayout/status.h — the status word: how device kernels report an
// out-of-range index without synchronizing with the host.
//
// Layout (int64, kStatusNumel elements, one tensor per device):
//   [0] records made since the host last read it (0: no error)
//   [1] token   [2] the index value   [3] its bound   [4] StatusWhich
// Protocol: every out-of-range index adds 1 to [0] atomically; the record
// that found [0] at 0 writes [1]..[4]. The host (kvlayout.ops.check_errors)
// reads the word, raises IndexError naming the argument, and zeroes it.
// Backends differ only in their atomic add (record_status's fetch_add_one).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVL_STATUS_HD __host__ __device__
#else
#define KVL_STATUS_HD
#endif

namespace kvlayout {

// Which argument held the index (status[4]); the Python reader names them
// in this order (kvlayout._C.STATUS_ARGUMENTS).
enum StatusWhich : int64_t {
  kStatusSrcSlots = 0,
  kStatusDstSlots = 1,
  kStatusOldPositions = 2,
  kStatusNewPositions = 3,
};
constexpr const char* kStatusArguments[] = {"src_slots", "dst_slots", "old_positions",
                                            "new_positions"};
constexpr int64_t kStatusNumel = 5;

// One record. fetch_add_one(status) adds 1 to status[0] atomically and
// returns the value before.
template <class FetchAddOne>
KVL_STATUS_HD inline void record_status(int64_t* status, const FetchAddOne& fetch_add_one,
                                        int64_t token, int64_t value, int64_t bound,
                                        int64_t which) {
  if (fetch_add_one(status) == 0) {
    status[1] = token;
    status[2] = value;
    status[3] = bound;
    status[4] = which;
  }
}

}  // namespace kvlayout
