// `loraplex selftest`: runs one mixed-adapter LoRA layer (q/k/v slices of unequal width,
// per-slot ranks, base-only tokens mixed in) on random data through the Punica wrapper and
// checks it against a double-precision computation. A quick end-to-end check of a machine.

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli_parse.h"
#include "command.h"
#include "loraplex/core/error.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::cli {
namespace {

struct Options {
  Device device = Device::cpu();
  DType dtype = DType::kBF16;
  int tokens = 77;
  int loras = 8;
  int rank = 16;
  int hidden = 256;
  uint64_t seed = 1;
};

const char* kHelp =
    "usage: loraplex selftest [--device cpu|cuda] [--dtype float32|float16|bfloat16]\n"
    "                         [--tokens N] [--loras N] [--rank R] [--hidden H] [--seed S]\n"
    "Runs a q/k/v LoRA layer with mixed adapters on random data and compares it with a\n"
    "double-precision reference. Exit status 0 when every output is within tolerance.";

// Returns false when --help was printed.
bool parse(const std::vector<std::string>& args, Options& o) {
  CLI::App app{kHelp, "loraplex selftest"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option_function<std::string>(
         "--device", [&](const std::string& v) { o.device = Device::parse(v); }, "cpu or cuda[:N]")
      ->type_name("DEVICE");
  app.add_option_function<std::string>(
         "--dtype", [&](const std::string& v) { o.dtype = dtype_from_name(v); },
         "float32, float16 or bfloat16 (default bfloat16)")
      ->type_name("DTYPE");
  add_int(app, "--tokens", o.tokens, 1, "tokens (default 77)");
  add_int(app, "--loras", o.loras, 1, "adapter slots (default 8)");
  add_int(app, "--rank", o.rank, 1, "largest rank (default 16)");
  add_int(app, "--hidden", o.hidden, 1, "input width (default 256)");
  add_int(app, "--seed", o.seed, 0, "random data (default 1)");
  return parse_cli(app, args);
}

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.125f, 1.0f);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& x : v) x = neg(rng) ? -u(rng) : u(rng);
  return Tensor::from_vector(v, shape).to(dtype);
}

int run(const std::vector<std::string>& args) {
  Options o;
  if (!parse(args, o)) return 0;
  std::mt19937_64 rng(o.seed);
  const std::vector<int64_t> widths = {o.hidden, o.hidden / 4 + 1, o.hidden / 4 + 1};
  const int slices = static_cast<int>(widths.size());
  const Stream stream = o.device.is_cpu() ? Stream() : Stream::create(o.device);

  SlotRanks ranks(slices, o.loras, o.rank, o.device);
  std::uniform_int_distribution<int> rank_of(1, o.rank);
  for (int s = 0; s < slices; ++s)
    for (int k = 0; k < o.loras; ++k) ranks.set(s, k, rank_of(rng), stream);
  std::vector<Tensor> a_host, b_host, a, b;
  int64_t width = 0;
  for (int64_t n : widths) {
    a_host.push_back(random_tensor({o.loras, o.rank, o.hidden}, o.dtype, rng));
    b_host.push_back(random_tensor({o.loras, n, o.rank}, o.dtype, rng));
    a.push_back(a_host.back().to(o.device, stream));
    b.push_back(b_host.back().to(o.device, stream));
    width += n;
  }
  const Tensor x_host = random_tensor({o.tokens, o.hidden}, o.dtype, rng);
  const Tensor y_host = random_tensor({o.tokens, width}, o.dtype, rng);
  std::vector<int32_t> slots(static_cast<size_t>(o.tokens));
  std::uniform_int_distribution<int32_t> slot_of(-1, o.loras - 1);
  for (auto& s : slots) s = slot_of(rng);

  PunicaWrapper wrapper(o.loras, o.tokens, 1, o.device);
  wrapper.update_metadata(slots, {}, stream);
  Tensor x = x_host.to(o.device, stream);
  // to() returns the same tensor on the same device; the reference needs the original.
  Tensor y = y_host.clone().to(o.device, stream);
  Tensor workspace = Tensor::empty({PunicaWrapper::workspace_elements(slices, o.tokens, o.rank)},
                                   DType::kF32, o.device);
  const float scale = 0.5f;
  // A warm-up call on a copy (first-use costs: scratch buffers, lazy init), then the timed one.
  Tensor warm = y.clone(stream);
  wrapper.add_lora_linear(warm, x, a, b, ranks, scale, workspace, stream);
  stream.synchronize();
  const auto start = std::chrono::steady_clock::now();
  wrapper.add_lora_linear(y, x, a, b, ranks, scale, workspace, stream);
  stream.synchronize();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const std::vector<double> got = y.to(Device::cpu(), stream).to_double_vector();

  // Reference: base + sum over slices of (scale * x A^T) B^T, in double.
  std::vector<double> ref = y_host.to_double_vector();
  const std::vector<double> xs = x_host.to_double_vector();
  int64_t off = 0;
  for (int s = 0; s < slices; ++s) {
    const std::vector<double> av = a_host[s].to_double_vector();
    const std::vector<double> bv = b_host[s].to_double_vector();
    for (int t = 0; t < o.tokens; ++t) {
      const int32_t k = slots[static_cast<size_t>(t)];
      if (k < 0) continue;
      const int r_k = ranks.get(s, k);
      std::vector<double> mid(static_cast<size_t>(r_k), 0.0);
      for (int r = 0; r < r_k; ++r) {
        for (int i = 0; i < o.hidden; ++i) {
          mid[r] += xs[static_cast<size_t>(t) * o.hidden + i] *
                    av[(static_cast<size_t>(k) * o.rank + r) * o.hidden + i];
        }
        mid[r] *= scale;
      }
      for (int64_t j = 0; j < widths[s]; ++j) {
        double acc = 0.0;
        for (int r = 0; r < r_k; ++r) acc += mid[r] * bv[(k * widths[s] + j) * o.rank + r];
        ref[static_cast<size_t>(t * width + off + j)] += acc;
      }
    }
    off += widths[s];
  }
  const double rtol = o.dtype == DType::kF32 ? 1e-4 : (o.dtype == DType::kF16 ? 4e-3 : 2e-2);
  double worst = 0.0;
  double max_abs = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    max_abs = std::max(max_abs, err);
    worst = std::max(worst, err / (rtol * (1.0 + std::fabs(ref[i]))));
  }
  std::printf(
      "selftest on %s: %s, %d tokens, %d adapters, max rank %d, hidden %d, slices %lld/%lld/%lld\n",
      o.device.str().c_str(), std::string(dtype_name(o.dtype)).c_str(), o.tokens, o.loras, o.rank,
      o.hidden, static_cast<long long>(widths[0]), static_cast<long long>(widths[1]),
      static_cast<long long>(widths[2]));
  std::printf("add_lora_linear took %.3f ms\n", ms);
  std::printf("max |error| %.3g, worst error / tolerance %.3f: %s\n", max_abs, worst,
              worst <= 1.0 ? "PASS" : "FAIL");
  return worst <= 1.0 ? 0 : 1;
}

}  // namespace

extern const Command kSelftestCommand = {"selftest",
                                         "check a mixed-adapter LoRA layer on random data", run};

}  // namespace loraplex::cli
