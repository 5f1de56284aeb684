// Pins the calling thread's OpenMP team, one thread per CPU, as vLLM's CPU worker does
// (VLLM_CPU_OMP_THREADS_BIND): a thread that stays on its core keeps its caches and is never migrated onto a
// core that another of the team's threads is using, which is what makes an OpenMP barrier wait.
#include "common.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <thread>
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

// Ends this process (exit status 1) once its parent is no longer `parent_pid`, checking every `interval_ms`,
// from a native thread that never needs Python's GIL: a Python watchdog cannot run while another thread holds
// the GIL blocked for good in a call to a dead parent (a Triton stub whose server was killed).
void exit_when_orphaned(int64_t parent_pid, int64_t interval_ms) {
  std::thread([parent_pid, interval_ms] {
    while (static_cast<int64_t>(getppid()) == parent_pid) {
      std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
    }
    _exit(1);
  }).detach();
}
