// llama.cpp's matrix-vector products, timed on request: the other half of benchmarks/ggml_gemv.py.
//
// Usage: ggml_gemv TYPE THREADS NxK[,NxK...]   (TYPE: bf16 or f32; each NxK one weight matrix, N outputs, K inputs)
// Builds one ggml graph of mul_mat(weight, x) per matrix (x one f32 row, as llama.cpp's decode step of one token
// feeds them), weights on their own 2 MiB-aligned mapping with MADV_HUGEPAGE (as our packed weights), every page
// written before timing: weight i (row-major, N rows of K) holds bf16 bits 0x3f80 + (i % 128) (1.0 to 1.99), fp32
// 1 + (i % 128) / 128; x is 0.5. Then, for each line on stdin: "run" computes the graph once on THREADS threads and
// prints the milliseconds it took; "sum" prints the sum of every output (what the last run computed); "quit" (or
// end of input) exits. The outputs are zeroed before every run (and after the warm-up run), so "sum" shows what
// that run computed.
#include "ggml-cpu.h"
#include "ggml.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr size_t HUGE_PAGE = size_t{2} << 20;

void* huge_page_buffer(size_t bytes) {
  const size_t size = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
  void* raw = mmap(nullptr, size + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(raw) + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
  madvise(aligned, size, MADV_HUGEPAGE);
  return aligned;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 || (std::strcmp(argv[1], "bf16") != 0 && std::strcmp(argv[1], "f32") != 0)) {
    std::fprintf(stderr, "usage: %s bf16|f32 THREADS NxK[,NxK...]\n", argv[0]);
    return 2;
  }
  const bool bf16 = std::strcmp(argv[1], "bf16") == 0;
  const int threads = std::atoi(argv[2]);
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const char* p = argv[3]; *p;) {
    char* end = nullptr;
    const int64_t n = std::strtoll(p, &end, 10);
    if (*end != 'x') { std::fprintf(stderr, "bad shape list: %s\n", argv[3]); return 2; }
    const int64_t k = std::strtoll(end + 1, &end, 10);
    shapes.emplace_back(n, k);
    p = *end == ',' ? end + 1 : end;
  }
  ggml_cpu_init();
  ggml_init_params params = {size_t{64} << 20, nullptr, /*no_alloc=*/true};  // tensor headers only
  ggml_context* ctx = ggml_init(params);
  ggml_cgraph* graph = ggml_new_graph_custom(ctx, 2 * shapes.size() + 16, false);
  int64_t max_k = 0;
  for (const auto& [n, k] : shapes) max_k = std::max(max_k, k);
  std::vector<float> x(max_k, 0.5f);
  std::vector<std::vector<float>> outputs;
  outputs.reserve(shapes.size());
  for (const auto& [n, k] : shapes) {
    ggml_tensor* w = ggml_new_tensor_2d(ctx, bf16 ? GGML_TYPE_BF16 : GGML_TYPE_F32, k, n);
    const size_t bytes = ggml_nbytes(w);
    w->data = huge_page_buffer(bytes);
    if (bf16) {  // small values (1.0 to 2.0), every page written
      auto* v = static_cast<uint16_t*>(w->data);
      for (size_t i = 0; i < bytes / 2; ++i) v[i] = static_cast<uint16_t>(0x3f80 + (i & 127));
    } else {
      auto* v = static_cast<float*>(w->data);
      for (size_t i = 0; i < bytes / 4; ++i) v[i] = 1.0f + static_cast<float>(i & 127) / 128.0f;
    }
    ggml_tensor* row = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, 1);
    row->data = x.data();
    ggml_tensor* out = ggml_mul_mat(ctx, w, row);
    outputs.emplace_back(n);
    out->data = outputs.back().data();
    ggml_build_forward_expand(graph, out);
  }
  ggml_cplan plan = ggml_graph_plan(graph, threads, nullptr);
  std::vector<uint8_t> work(plan.work_size + 64);
  plan.work_data = work.data();
  ggml_graph_compute(graph, &plan);  // warm: threads started, every weight page read once
  for (auto& out : outputs) std::fill(out.begin(), out.end(), 0.0f);
  std::printf("ready\n");
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line) && line != "quit";) {
    if (line == "sum") {
      double sum = 0;
      for (const auto& out : outputs)
        for (float v : out) sum += v;
      std::printf("%.6e\n", sum);
      std::fflush(stdout);
      continue;
    }
    if (line != "run") continue;
    for (auto& out : outputs) std::fill(out.begin(), out.end(), 0.0f);
    const auto start = std::chrono::steady_clock::now();
    ggml_graph_compute(graph, &plan);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    std::printf("%.4f\n", ms);
    std::fflush(stdout);
  }
  ggml_free(ctx);
  return 0;
}
