// Each of torch's intra-op threads pinned to one core (the CPU worker actor's
// `worker.cpu_bind_threads`). A step is hundreds of parallel regions whose every thread must
// finish before the next starts; a thread the scheduler moved to the core another thread or
// a process holds stalls them all, and it arrives with cold caches.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <sched.h>

#include <vector>

// Thread t of torch's pool (t < cpus.size()) on cpus[t]; returns the threads pinned. One
// region of as many items as threads: with OpenMP each thread runs exactly one.
int64_t bind_threads(std::vector<int64_t> cpus) {
  const int64_t n = std::min<int64_t>(at::get_num_threads(), cpus.size());
  std::vector<int> pinned(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const int t = at::get_thread_num();
    if (t >= n) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    pinned[t] = sched_setaffinity(0, sizeof(set), &set) == 0;
  });
  int64_t total = 0;
  for (int p : pinned) total += p;
  return total;
}

void register_thread_ops(pybind11::module& m) {
  m.def("bind_threads", &bind_threads, "pin torch's intra-op thread t to cpus[t] (CPU)");
}
