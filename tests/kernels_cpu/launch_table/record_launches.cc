// Records what the CUDA LoRA launchers launch for a grid of layer shapes and tuning tables, on
// the fake runtime of fake_cudart.cc (no GPU needed). One line per (tuning, op, shape):
//
//   tuning  op  dtype  tokens  max_loras  max_rank  hidden  widths  settled  path  launches
//
// tuning: a name defined by a header line "# NAME key=value,..." (lora_tuning.h's keys over the
// defaults), or "-" for the defaults; op: linear
// (lora_linear), shrink or expand (alone); a launch is
// kernel<template args>|grid x,y,z|threads|dynamic smem|cluster x|pdl[|params], params being a
// 64-bit FNV-1a hash of the kernel's parameter bytes (fake device pointers, the same in every
// build). Built by record.sh against a build's libloraplex_kernels.a, once per API generation
// (RECORD_OLD_API: the KernelTuning global that preceded kernels/planner/lora_plan.h).
//
// usage: record_launches KERNEL_INFO {table|full} [--no-params]
//   table: the grid of lora_launches_h100.tsv; full: a wider one, for comparing two builds.

#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fake_cudart.h"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#ifdef RECORD_OLD_API
#include "loraplex/kernels/cuda/kernel_tuning.h"
#else
#include "loraplex/kernels/planner/lora_plan.h"
#endif

namespace {

using loraplex::DType;
using loraplex::Status;
namespace lk = loraplex::kernels;
namespace kc = loraplex::kernels::cuda;
#ifndef RECORD_OLD_API
namespace kp = loraplex::kernels::planner;
#endif

struct Config {
  const char* name;
  const char* old_tuning;  // kernel_tuning.h keys
  const char* new_tuning;  // lora_plan.h keys
  int limit;               // the old set_fused_linear_max_tokens (-1: default)
};

// The path configurations of the CUDA tests and `bench kernels`, and the tuned launch shapes of
// CudaLoraLinear.TunedLaunchShapesMatchCpu, each with the decode token limit at 0 and 1 << 20.
constexpr int kBig = 1 << 20;
const std::vector<Config>& configs() {
  static const std::vector<Config> c = {
      {"default", "", "", -1},
      {"path_split", "decode_cluster=0", "decode_cluster=0,decode_max_tokens=0", 0},
      {"path_fused", "decode_persistent=1,decode_cluster=0",
       "gather_max_token_ranks=0,decode_cluster=0,decode_max_tokens=1048576", kBig},
      {"path_gather", "gather_max_token_ranks=1073741824,decode_cluster=0",
       "gather_max_token_ranks=1073741824,decode_cluster=0,decode_max_tokens=1048576", kBig},
      {"path_cluster", "gather_max_token_ranks=1073741824,decode_cluster=2",
       "gather_max_token_ranks=1073741824,decode_cluster=2,decode_max_tokens=1048576", kBig},
  };
  return c;
}

const std::vector<std::string>& tuned_shapes() {
  static const std::vector<std::string> t = {
      "prefill_k_split=1,prefill_ctas_per_sm=1,prefill_stages=3,"
      "expand_ctas_per_sm=1,gather_group=1,gather_max_token_ranks=1073741824,gather_shrink=2,"
      "gather_rows=8,decode_cluster=0",
      "prefill_k_split=8,prefill_ctas_per_sm=8,prefill_stages=4,"
      "prefill_reduce=1,prefill_mma=1,expand_ctas_per_sm=16,gather_group=2,"
      "gather_max_token_ranks=1073741824,gather_shrink=2,gather_rows=8,decode_cluster=0",
      "gather_group=2,gather_max_token_ranks=1073741824,gather_shrink=1,gather_rows=8,"
      "decode_cluster=0,layer_pdl=2",
      "gather_group=2,gather_max_token_ranks=1073741824,gather_shrink=2,decode_cluster=0,"
      "layer_pdl=0",
      "prefill_k_split=2,prefill_ctas_per_sm=4,prefill_stages=4,"
      "prefill_mma=1,expand_ctas_per_sm=2,gather_max_token_ranks=0,decode_cluster=0",
      "prefill_k_split=8,prefill_ctas_per_sm=8,prefill_reduce=1,prefill_mma=2",
      "prefill_k_split=8,prefill_ctas_per_sm=8,prefill_stages=3,prefill_reduce=2,prefill_mma=2",
      "prefill_mma=1",
      "prefill_k_split=8,prefill_ctas_per_sm=8,prefill_reduce=2,prefill_sum=2",
      "prefill_k_split=4,prefill_ctas_per_sm=8,prefill_reduce=2,prefill_mma=1,prefill_sum=2",
      "decode_cluster=2,cluster_size=1",
      "decode_cluster=2,cluster_size=2",
      "decode_cluster=2,layer_pdl=2,cluster_size=16",
  };
  return t;
}

struct Shape {
  DType dtype;
  int tokens;
  int max_loras;
  int max_rank;
  int64_t hidden;
  std::vector<int64_t> widths;
};

// The bench grid of `loraplex bench kernels`.
std::vector<Shape> bench_shapes() {
  std::vector<Shape> out;
  for (int r : {16, 64})
    for (int a : {1, 8, 32})
      for (int t : {1, 16, 64, 256, 1024, 4096})
        for (int s : {1, 3}) {
          out.push_back(
              {DType::kBF16, t, a, r, 4096,
               s == 1 ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 1024, 1024}});
        }
  return out;
}

// The cases of the CUDA linear tests (tests/kernels_cuda/linear_cuda_test.cc).
std::vector<Shape> test_shapes() {
  return {
      {DType::kBF16, 1, 1, 16, 4096, {4096}},
      {DType::kBF16, 16, 8, 16, 4096, {4096, 1024, 1024}},
      {DType::kBF16, 64, 32, 64, 1024, {512, 128, 128}},
      {DType::kF16, 77, 4, 32, 512, {256, 64}},
      {DType::kBF16, 5, 4, 128, 256, {264}},
      {DType::kBF16, 128, 3, 8, 64, {24, 8, 16, 40}},
      {DType::kBF16, 300, 8, 64, 2048, {1024, 256, 256}},
      {DType::kF16, 1100, 32, 16, 1024, {1024}},
      {DType::kBF16, 200, 2, 128, 512, {384}},
      {DType::kBF16, 333, 3, 16, 4096, {1024, 256, 256}},
      {DType::kBF16, 600, 32, 64, 4096, {1024, 256, 256}},
      {DType::kBF16, 64, 2, 16, 4096, {4096, 1024, 1024}},
      {DType::kF16, 40, 6, 24, 1592, {200, 56}},
      {DType::kBF16, 3, 3, 64, 1592, {1592}},
      {DType::kF32, 33, 4, 8, 96, {40, 24}},
      {DType::kBF16, 17, 3, 12, 100, {36, 20}},
      {DType::kF16, 199, 5, 16, 77, {33}},
      // The traced-kernel and chained-layer tests.
      {DType::kBF16, 300, 8, 16, 2048, {1024}},
      {DType::kBF16, 1100, 4, 64, 1024, {512, 128, 128}},
      {DType::kBF16, 1100, 4, 128, 1024, {512, 128, 128}},
      {DType::kBF16, 16, 8, 16, 1024, {1024}},
      {DType::kBF16, 64, 8, 16, 1024, {1024}},
      {DType::kBF16, 320, 8, 16, 1024, {1024}},
  };
}

// Tokens x slices x ranks x adapters over models' projections: q/k/v, gate/up, down, o, eight
// slices; with `wide` more of each (for comparing two builds; too many lines to commit).
std::vector<Shape> grid_shapes(bool wide) {
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> layers = {
      {4096, {4096}},           {4096, {4096, 1024, 1024}},
      {4096, {14336, 14336}},   {14336, {4096}},
      {2048, {2048, 256, 256}}, {8192, {8192, 1024, 1024}},
      {3584, {3584, 512, 512}}, {1024, {256, 256, 256, 256, 256, 256, 256, 256}},
  };
  const std::vector<int> ranks =
      wide ? std::vector<int>{8, 16, 32, 64, 128, 256} : std::vector<int>{8, 16, 64, 256};
  const std::vector<int> adapters =
      wide ? std::vector<int>{1, 4, 16, 64} : std::vector<int>{1, 16, 64};
  const std::vector<int> tokens =
      wide ? std::vector<int>{1,  2,   3,   8,   15,  16,  17,   32,   33,   48,   64,  65,
                              96, 128, 200, 256, 257, 512, 1000, 2048, 2049, 4096, 8192}
           : std::vector<int>{1, 3, 16, 17, 33, 64, 65, 200, 257, 1000, 2049, 8192};
  std::vector<Shape> out;
  for (DType d : {DType::kBF16, DType::kF16})
    for (const auto& [k, w] : layers)
      for (int r : ranks)
        for (int a : adapters)
          for (int t : tokens) {
            if (d == DType::kF16 && (!wide || a == 4 || r == 32 || r == 128)) continue;
            out.push_back({d, t, a, r, k, w});
          }
  if (!wide) {
    // float32 layers take the generic kernels.
    for (int t : {1, 64, 300}) out.push_back({DType::kF32, t, 4, 16, 4096, {4096, 1024, 1024}});
  }
  return out;
}

std::string demangled(const std::string& mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(
      abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status), std::free);
  std::string s = status == 0 ? d.get() : mangled;
  // "void ns::(anonymous namespace)::kernel<args>(ns::Params)" -> "kernel<args>"
  const size_t open = s.find('<');
  size_t name_end = open == std::string::npos ? s.find('(') : open;
  size_t start = s.rfind("::", name_end);
  start = start == std::string::npos ? 0 : start + 2;
  size_t end = s.size();
  if (open != std::string::npos) {
    int depth = 0;
    for (size_t i = open; i < s.size(); ++i) {
      if (s[i] == '<') ++depth;
      if (s[i] == '>' && --depth == 0) {
        end = i + 1;
        break;
      }
    }
  } else {
    end = name_end;
  }
  std::string out = s.substr(start, end - start);
  auto replace = [&](const std::string& from, const std::string& to) {
    for (size_t p = out.find(from); p != std::string::npos; p = out.find(from, p + to.size())) {
      out.replace(p, from.size(), to);
    }
  };
  replace("__nv_bfloat16", "bf16");
  replace("__half", "f16");
  replace(" ", "");
  replace("_kernel<", "<");
  replace("true", "1");
  replace("false", "0");
  return out;
}

uint64_t fnv1a(const std::vector<unsigned char>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char b : bytes) {
    h ^= b;
    h *= 1099511628211ull;
  }
  return h;
}

bool g_params = true;  // hashes of the parameter bytes in the launches

std::string launches_text(const Status& status) {
  std::string out;
  for (const fake_cudart::Launch& l : fake_cudart::take_launches()) {
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%s|%u,%u,%u|%u|%zu|%d|%d", demangled(l.name).c_str(),
                  l.grid[0], l.grid[1], l.grid[2], l.block, l.smem, l.cluster_x, l.pdl ? 1 : 0);
    std::string one = buf;
    if (g_params) {
      std::snprintf(buf, sizeof(buf), "|%016llx", static_cast<unsigned long long>(fnv1a(l.params)));
      one += buf;
    }
    if (!out.empty()) out += " ";
    out += one;
  }
  if (!status.ok()) {
    std::string msg = status.message();
    std::replace(msg.begin(), msg.end(), '\t', ' ');
    out += (out.empty() ? "" : " ") + std::string("ERROR:") + msg;
  }
  return out.empty() ? "-" : out;
}

void* fake(uint64_t at) { return reinterpret_cast<void*>(at); }

struct Call {
  lk::ShrinkArgs shrink;
  lk::ExpandArgs expand;
  lk::LoraMetaView meta;
};

Call make_call(const Shape& sh, bool settled) {
  Call c;
  const int slices = static_cast<int>(sh.widths.size());
  int64_t width = 0;
  for (int64_t w : sh.widths) width += w;
  lk::ShrinkArgs& s = c.shrink;
  s.dtype = sh.dtype;
  s.num_tokens = sh.tokens;
  s.hidden = sh.hidden;
  s.x = fake(0x10000000000ull);
  s.x_row_stride = sh.hidden;
  s.num_slices = slices;
  for (int i = 0; i < slices; ++i) s.lora_a[i] = fake(0x20000000000ull + i * 0x1000000000ull);
  s.max_loras = sh.max_loras;
  s.max_rank = sh.max_rank;
  s.ranks = static_cast<const int32_t*>(fake(0x30000000000ull));
  s.scale = 1.0f;
  s.out_dtype = DType::kF32;
  s.out = fake(0x40000000000ull);
  lk::ExpandArgs& e = c.expand;
  e.dtype = sh.dtype;
  e.num_tokens = sh.tokens;
  e.in_dtype = DType::kF32;
  e.in = s.out;
  e.num_slices = slices;
  for (int i = 0; i < slices; ++i) {
    e.lora_b[i] = fake(0x50000000000ull + i * 0x1000000000ull);
    e.slice_width[i] = sh.widths[static_cast<size_t>(i)];
  }
  e.max_loras = sh.max_loras;
  e.max_rank = sh.max_rank;
  e.ranks = s.ranks;
  e.y = fake(0x60000000000ull);
  e.y_row_stride = width;
  e.offset_start = 0;
  e.add_inputs = true;
  lk::LoraMetaView& m = c.meta;
  m.num_tokens = sh.tokens;
  m.max_loras = sh.max_loras;
  m.token_lora_mapping = static_cast<const int32_t*>(fake(0x70000000000ull));
  m.sorted_token_indices = static_cast<const int32_t*>(fake(0x70100000000ull));
  m.active_lora_ids = static_cast<const int32_t*>(fake(0x70200000000ull));
  m.num_tokens_per_lora = static_cast<const int32_t*>(fake(0x70300000000ull));
  m.lora_token_start_loc = static_cast<const int32_t*>(fake(0x70400000000ull));
  m.num_active_loras = static_cast<const int32_t*>(fake(0x70500000000ull));
  m.scratch = static_cast<float*>(fake(0x80000000000ull));
  // Scratch enough for any plan (the metadata's before lora_plan.h was smaller: a decode kernel
  // that did not find enough took another path), counters as LoraBatchMeta's for
  // max_num_tokens = tokens.
  const int64_t n = sh.tokens;
  m.scratch_floats = int64_t{1} << 40;
  m.counters = static_cast<int32_t*>(fake(0x90000000000ull));
  m.num_counters = std::max<int64_t>((int64_t{sh.max_loras} + 1) * lk::kMaxSlices,
                                     (n + 63) / 64 + sh.max_loras + 1);
  m.settled = settled;
  return c;
}

#ifdef RECORD_OLD_API
struct Api {
  void set(const Config& c, const std::string& extra, int limit) {
    kc::set_fused_linear_max_tokens(limit);
    kc::KernelTuning t;
    std::string text = c.old_tuning;
    if (!extra.empty()) text += (text.empty() ? "" : ",") + extra;
    // gather_max_token_ranks=0 (never the pair) was decode_persistent=1.
    const std::string never = "gather_max_token_ranks=0";
    const size_t at = text.find(never);
    if (at != std::string::npos &&
        (at + never.size() == text.size() || text[at + never.size()] == ','))
      text.replace(at, never.size(), "decode_persistent=1");
    if (!kc::parse_kernel_tuning(text, t).ok() || !kc::set_kernel_tuning(t).ok()) {
      std::fprintf(stderr, "bad tuning %s\n", text.c_str());
      std::exit(1);
    }
  }
  std::string path(const Call& c) { return kc::lora_linear_path(c.shrink, c.expand, c.meta); }
  Status linear(const Call& c) { return kc::lora_linear(c.shrink, c.expand, c.meta, nullptr); }
  Status shrink(const Call& c) { return kc::lora_shrink(c.shrink, c.meta, nullptr); }
  Status expand(const Call& c) { return kc::lora_expand(c.expand, c.meta, nullptr); }
};
#else
struct Api {
  kp::LoraDevice device = kc::lora_device(0);
  void set(const Config& c, const std::string& extra, int limit) {
    std::string text = c.new_tuning;
    if (!extra.empty()) text += (text.empty() ? "" : ",") + extra;
    if (limit >= 0 && text.find("decode_max_tokens") == std::string::npos) {
      text += (text.empty() ? "" : ",") + std::string("decode_max_tokens=") + std::to_string(limit);
    }
    device.tuning = kp::LoraTuning{};
    if (!kp::parse_lora_tuning(text, device.tuning).ok()) {
      std::fprintf(stderr, "bad tuning %s\n", text.c_str());
      std::exit(1);
    }
  }
  std::string path(const Call& c) {
    return kp::path_name(
        kp::plan_lora_linear(kp::linear_shape(c.shrink, c.expand, c.meta), device).path);
  }
  Status linear(const Call& c) {
    return kc::lora_linear(c.shrink, c.expand, c.meta, device, nullptr);
  }
  Status shrink(const Call& c) { return kc::lora_shrink(c.shrink, c.meta, device, nullptr); }
  Status expand(const Call& c) { return kc::lora_expand(c.expand, c.meta, device, nullptr); }
};
#endif

std::string widths_text(const std::vector<int64_t>& w) {
  std::string s;
  for (int64_t v : w) s += (s.empty() ? "" : "/") + std::to_string(v);
  return s;
}

void record(Api& api, const std::string& tuning, const std::vector<Shape>& shapes) {
  for (const Shape& sh : shapes) {
    for (bool settled : {false, true}) {
      const Call c = make_call(sh, settled);
      char key[256];
      std::snprintf(key, sizeof(key), "%s\t%d\t%d\t%d\t%lld\t%s\t%d",
                    std::string(loraplex::dtype_name(sh.dtype)).c_str(), sh.tokens, sh.max_loras,
                    sh.max_rank, static_cast<long long>(sh.hidden), widths_text(sh.widths).c_str(),
                    settled ? 1 : 0);
      fake_cudart::take_launches();
      const std::string path = api.path(c);
      const Status lin = api.linear(c);
      std::printf("%s\tlinear\t%s\t%s\t%s\n", tuning.c_str(), key, path.c_str(),
                  launches_text(lin).c_str());
      if (settled) continue;  // the shrink and expand alone do not read `settled`
      const Status shr = api.shrink(c);
      std::printf("%s\tshrink\t%s\t-\t%s\n", tuning.c_str(), key, launches_text(shr).c_str());
      const Status exp = api.expand(c);
      std::printf("%s\texpand\t%s\t-\t%s\n", tuning.c_str(), key, launches_text(exp).c_str());
    }
  }
}

std::vector<Shape> concat(std::vector<Shape> a, const std::vector<Shape>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s KERNEL_INFO {table|full} [--no-params]\n", argv[0]);
    return 2;
  }
  fake_cudart::load_kernel_info(argv[1]);
  const bool full = std::strcmp(argv[2], "full") == 0;
  g_params = !(argc >= 4 && std::strcmp(argv[3], "--no-params") == 0);
  Api api;
  const std::vector<Shape> decode_and_tests = concat(bench_shapes(), test_shapes());
  // Tunings are named t0, t1, ... in the rows ("-": the defaults) and defined in header lines.
  std::vector<std::string> names;
  auto declare = [&](const std::string& text) {
    const std::string name = "t" + std::to_string(names.size());
    std::printf("# %s %s\n", name.c_str(), text.c_str());
    names.push_back(name);
    return name;
  };
  for (const Config& c : configs()) {
    api.set(c, "", c.limit);
    const bool defaults = c.name == std::string("default");
    record(api, defaults ? "-" : declare(c.new_tuning),
           defaults ? concat(decode_and_tests, grid_shapes(full)) : decode_and_tests);
  }
  for (const std::string& t : tuned_shapes()) {
    for (int limit : {0, kBig}) {
      api.set(Config{"tuned", "", "", limit}, t, limit);
      record(api, declare(t + ",decode_max_tokens=" + std::to_string(limit)), test_shapes());
    }
  }
  return 0;
}
