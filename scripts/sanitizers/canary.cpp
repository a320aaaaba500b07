// Two planted bugs that a sanitizer run must report before its reports can be
// trusted: scripts/sanitize_cpu.sh builds this file with the run's sanitizers,
// calls the bug of that run through ctypes under the same preloaded runtime,
// and stops if the report does not come (a runtime not loaded, or options
// that silence it, would otherwise pass every test unseen).
#include <thread>
#include <vector>

// AddressSanitizer: one read past the end of a heap array.
extern "C" int heap_overflow(int n) {
  std::vector<int> rows(static_cast<size_t>(n), 1);
  return rows.data()[n];  // one past the end
}

// ThreadSanitizer: two threads increment one counter without synchronisation.
static int unsynchronised_count = 0;
extern "C" int data_race(int n) {
  const auto bump = [n] {
    for (int i = 0; i < n; ++i) ++unsynchronised_count;
  };
  std::thread a(bump), b(bump);
  a.join();
  b.join();
  return unsynchronised_count;
}
