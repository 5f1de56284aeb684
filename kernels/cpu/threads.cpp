// Pins the calling thread's OpenMP team, one thread per CPU, as vLLM's CPU worker does
// (VLLM_CPU_OMP_THREADS_BIND): a thread that stays on its core keeps its caches and is never migrated onto a
// core that another of the team's threads is using, which is what makes an OpenMP barrier wait.
#include "common.h"

#include <omp.h>
#include <sched.h>

#include <vector>

// cpus: one CPU id per thread of the team started from the calling thread (the calling thread is thread 0).
// Returns the number of threads that could not be pinned (0 when all were).
int64_t bind_threads(std::vector<int64_t> cpus) {
  TORCH_CHECK(!cpus.empty(), "bind_threads: no CPUs given");
  int64_t failed = 0;
#pragma omp parallel num_threads(static_cast<int>(cpus.size())) reduction(+ : failed)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) failed += 1;  // 0: the calling thread
  }
  return failed;
}
