// The planner of the CUDA LoRA kernels (kernels/planner/lora_plan.h) is plain C++: these tests run
// it in every build. The launch table (launch_table/lora_launches_h100.tsv, made on the fake CUDA
// runtime from the launchers as they were before the planner existed: see launch_table/README.md)
// holds, for a grid of layer shapes and tuning tables on an H100, the path and every launch
// (kernel and template arguments, grid, threads, shared memory, cluster, PDL) of lora_linear, of
// lora_shrink and of lora_expand; the plans must describe exactly those launches.

#include "loraplex/kernels/planner/lora_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "loraplex/core/dtype.h"

namespace loraplex {
namespace {

namespace kp = kernels::planner;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, sep)) out.push_back(item);
  return out;
}

// The device type names the table's kernel names use.
const char* type_name(DType d) {
  switch (d) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    default:
      return "float";
  }
}

// One launch in the table's format: kernel<args>|x,y,z|threads|smem|cluster|pdl.
std::string launch(const std::string& kernel, int64_t gx, int64_t gy, int64_t gz, int threads,
                   int64_t smem, int cluster, bool pdl) {
  std::ostringstream o;
  o << kernel << "|" << gx << "," << gy << "," << gz << "|" << threads << "|" << smem << "|"
    << cluster << "|" << (pdl ? 1 : 0);
  return o.str();
}

std::string shrink_launches(const kp::ShrinkPlan& p, const kp::ShrinkShape& s) {
  const std::string t = type_name(s.dtype);
  switch (p.kernel) {
    case kp::ShrinkKernel::kPrefill: {
      const kp::PrefillPlan& f = p.prefill;
      std::string out = launch("prefill_shrink<" + t + "," + std::to_string(f.cols) + "," +
                                   std::to_string(f.stages) + ",0," + (f.wg ? "1" : "0") + ">",
                               f.tiles * f.k_split, 1, 1, kp::prefill_kernel::kThreads, f.smem,
                               f.global_reduce ? 0 : f.k_split, false);
      if (f.defer_sum) {
        out += " " + launch("prefill_sum<" + t + "," + std::to_string(f.m) + "," +
                                std::to_string(f.k_split) + ">",
                            f.sum_grid, 1, 1, kp::prefill_kernel::kSumThreads, 0, 0, true);
      }
      return out;
    }
    case kp::ShrinkKernel::kGeneric:
      break;
  }
  const std::string out_t = s.out_dtype == DType::kF32 ? "float" : t;
  return launch("shrink_generic<" + t + "," + out_t + ">", p.generic_grid[0], p.generic_grid[1], 1,
                kp::kGenericThreads, 0, 0, false);
}

std::string expand_launches(const kp::ExpandPlan& p, const kp::ExpandShape& e) {
  const std::string t = type_name(e.dtype);
  switch (p.kernel) {
    case kp::ExpandKernel::kPipelined:
      return launch("expand_pipe<" + t + "," + std::to_string(p.steps) + ",0>", p.grid, 1, 1,
                    kp::expand_kernel::kThreads, p.smem, 0, p.pdl);
    case kp::ExpandKernel::kTensorCore:
      return launch("expand_tc<" + t + ",64,0>", p.grid, 1, 1, kp::expand_kernel::kThreads, p.smem,
                    0, false);
    case kp::ExpandKernel::kGeneric:
      break;
  }
  const std::string in_t = e.in_dtype == DType::kF32 ? "float" : t;
  return launch("expand_generic<" + t + "," + in_t + ">", e.tokens, p.generic_col_blocks, 1,
                kp::kGenericThreads, 0, 0, false);
}

std::string linear_launches(const kp::LinearPlan& p, const kp::LinearShape& shape) {
  const std::string t = type_name(shape.shrink.dtype);
  switch (p.path) {
    case kp::LinearPath::kCluster: {
      const kp::ClusterPlan& c = p.cluster;
      return launch("cluster_lora<" + t + ",0>", c.cluster, c.units, 1,
                    kp::cluster_kernel::kThreads, c.smem, c.cluster, c.pdl);
    }
    case kp::LinearPath::kGather: {
      const kp::GatherPlan& g = p.gather;
      const bool regs = g.mode == kp::GatherExpandMode::kRegs;
      return launch("gather_shrink<" + t + "," + std::to_string(g.group) + "," +
                        (g.mma ? "1" : "0") + ",0," + (regs ? "1" : "0") + "," +
                        std::to_string(g.rows) + ">",
                    g.shrink_grid[0], g.shrink_grid[1], g.shrink_grid[2],
                    kp::gather_kernel::kThreads, 0, 0, g.shrink_pdl) +
             " " +
             launch("gather_expand<" + t + ",0," + std::to_string(static_cast<int>(g.mode)) + ">",
                    g.expand_grid[0], g.expand_grid[1], 1, kp::gather_kernel::kThreads,
                    g.expand_smem, 0, true);
    }
    case kp::LinearPath::kSplit:
    case kp::LinearPath::kGeneric:
      break;
  }
  return shrink_launches(p.shrink, shape.shrink) + " " + expand_launches(p.expand, shape.expand);
}

// The call the launch recorder made for a row: every pointer 16-byte aligned, x rows of `hidden`
// elements, y rows of the slices' widths, the intermediate float32.
kp::LinearShape shape_of(DType dtype, int64_t tokens, int max_loras, int max_rank, int64_t hidden,
                         const std::vector<int64_t>& widths, bool settled) {
  kp::LinearShape sh;
  kp::ShrinkShape& s = sh.shrink;
  s.dtype = dtype;
  s.out_dtype = DType::kF32;
  s.tokens = tokens;
  s.hidden = hidden;
  s.x_row_stride = hidden;
  s.num_slices = static_cast<int>(widths.size());
  s.max_loras = max_loras;
  s.max_rank = max_rank;
  kp::ExpandShape& e = sh.expand;
  e.dtype = dtype;
  e.in_dtype = DType::kF32;
  e.tokens = tokens;
  e.num_slices = s.num_slices;
  int64_t width = 0;
  for (size_t i = 0; i < widths.size(); ++i) {
    e.slice_width[i] = widths[i];
    width += widths[i];
  }
  e.max_loras = max_loras;
  e.max_rank = max_rank;
  e.y_row_stride = width;
  sh.settled = settled;
  return sh;
}

// A recorded tuning without the fields of the removed persistent kernel (they changed only its
// launches).
std::string without_removed_keys(const std::string& tuning) {
  std::string out;
  for (const std::string& kv : split(tuning, ',')) {
    if (kv.rfind("decode_k_chunks=", 0) == 0 || kv.rfind("decode_cols=", 0) == 0) continue;
    out += (out.empty() ? "" : ",") + kv;
  }
  return out;
}

TEST(LoraPlan, MatchesTheRecordedLaunchesOfEveryShapeAndTuning) {
  std::ifstream in(LORAPLEX_LAUNCH_TABLE);
  ASSERT_TRUE(in.good()) << "cannot read " << LORAPLEX_LAUNCH_TABLE;
  std::map<std::string, kp::LoraTuning> tunings = {{"-", kp::LoraTuning{}}};
  const kp::DeviceLimits limits;  // the H100 the table was recorded for
  int rows = 0;
  int removed = 0;
  int mismatches = 0;
  std::map<std::string, int> paths;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# ", 0) == 0) {
      const std::vector<std::string> f = split(line.substr(2), ' ');
      ASSERT_EQ(f.size(), 2u) << line;
      kp::LoraTuning t;
      ASSERT_TRUE(kp::parse_lora_tuning(without_removed_keys(f[1]), t).ok()) << line;
      tunings[f[0]] = t;
      continue;
    }
    const std::vector<std::string> f = split(line, '\t');
    ASSERT_EQ(f.size(), 11u) << line;
    ASSERT_TRUE(tunings.count(f[0])) << "undeclared tuning in " << line;
    const kp::LoraDevice device{limits, tunings[f[0]]};
    std::vector<int64_t> widths;
    for (const std::string& w : split(f[7], '/')) widths.push_back(std::stoll(w));
    const kp::LinearShape shape = shape_of(dtype_from_name(f[2]), std::stoll(f[3]), std::stoi(f[4]),
                                           std::stoi(f[5]), std::stoll(f[6]), widths, f[8] == "1");
    std::string path = "-";
    std::string got;
    if (f[1] == "linear") {
      const kp::LinearPlan plan = kp::plan_lora_linear(shape, device);
      path = kp::path_name(plan.path);
      got = linear_launches(plan, shape);
    } else if (f[1] == "shrink") {
      got = shrink_launches(kp::plan_lora_shrink(shape.shrink, device), shape.shrink);
    } else {
      ASSERT_EQ(f[1], "expand") << line;
      got = expand_launches(kp::plan_lora_expand(shape.expand, device), shape.expand);
    }
    // Rows that ran the persistent decode kernel, removed since (bench kernels' path comparison:
    // never the fastest path): a layer recorded there now takes the split kernels.
    if (f[10].find("decode_lora<") != std::string::npos) {
      ++removed;
      EXPECT_EQ(got.find("decode_lora<"), std::string::npos) << line;
      if (f[9] == "fused") {
        EXPECT_TRUE(path == "split" || path == "generic") << path << ": " << line;
      }
      continue;
    }
    ++rows;
    ++paths[path];
    if (path != f[9] || got != f[10]) {
      if (++mismatches <= 10) {
        ADD_FAILURE() << "tuning " << f[0] << " " << f[1] << " " << f[2] << " T" << f[3] << " L"
                      << f[4] << " R" << f[5] << " K" << f[6] << " N" << f[7] << " settled " << f[8]
                      << "\n  recorded " << f[9] << ": " << f[10] << "\n  planned  " << path << ": "
                      << got;
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << rows << " rows";
  // The table covers every path (and the shrink and expand alone).
  EXPECT_GT(rows, 6000);
  EXPECT_GT(removed, 10);
  for (const char* p : {"cluster", "gather", "split", "generic", "-"}) {
    EXPECT_GT(paths[p], 10) << p;
  }
}

// The plans' workspace fits what LoraBatchMeta holds by default (lora_scratch_floats), for the
// default tuning, every token count up to max_num_tokens and the shapes the kernels take.
TEST(LoraPlan, DefaultScratchCoversEveryDefaultPlan) {
  const kp::LoraDevice device;
  for (const int max_tokens : {1, 7, 64, 300}) {
    const int64_t scratch = kp::lora_scratch_floats(max_tokens, device.tuning);
    for (int tokens = 1; tokens <= max_tokens; tokens += tokens < 20 ? 1 : 37) {
      for (const int rank : {8, 16, 64, 256}) {
        for (const int slices : {1, 3, 8}) {
          for (const int64_t hidden : {64, 4096, 16384, 65536}) {
            const std::vector<int64_t> widths(static_cast<size_t>(slices), 1024);
            const kp::LinearShape shape =
                shape_of(DType::kBF16, tokens, 16, rank, hidden, widths, true);
            const kp::LinearPlan plan = kp::plan_lora_linear(shape, device);
            EXPECT_LE(plan.workspace.scratch_floats, scratch)
                << kp::path_name(plan.path) << " T" << tokens << " R" << rank << " S" << slices
                << " K" << hidden << " max_num_tokens " << max_tokens;
            EXPECT_LE(plan.workspace.counters, kp::lora_counters(max_tokens, 16));
            const kp::ShrinkPlan shrink = kp::plan_lora_shrink(shape.shrink, device);
            EXPECT_LE(kp::shrink_workspace(shrink, shape.shrink).scratch_floats, scratch);
          }
        }
      }
    }
  }
}

// Limits come from the device: a smaller opt-in shared memory moves the cluster layer to larger
// clusters, and fewer SMs shrink the grids that fill them.
TEST(LoraPlan, FollowsTheDeviceLimits) {
  kp::LoraDevice h100;
  kp::LoraDevice small = h100;
  small.limits.sm_count = 66;
  const kp::LinearShape decode = shape_of(DType::kBF16, 64, 2, 16, 4096, {4096, 1024, 1024}, true);
  const kp::LinearPlan a = kp::plan_lora_linear(decode, h100);
  ASSERT_EQ(a.path, kp::LinearPath::kCluster);
  kp::LoraDevice tight = h100;
  tight.limits.smem_per_block_optin = a.cluster.smem - 1;
  const kp::LinearPlan b = kp::plan_lora_linear(decode, tight);
  if (b.path == kp::LinearPath::kCluster) {
    EXPECT_GT(b.cluster.cluster, a.cluster.cluster);
    EXPECT_LE(b.cluster.smem, tight.limits.smem_per_block_optin);
  }
  const kp::LinearShape prefill = shape_of(DType::kBF16, 4096, 8, 16, 4096, {4096}, true);
  const kp::ExpandPlan e132 = kp::plan_lora_expand(prefill.expand, h100);
  const kp::ExpandPlan e66 = kp::plan_lora_expand(prefill.expand, small);
  EXPECT_EQ(e132.kernel, kp::ExpandKernel::kPipelined);
  EXPECT_LT(e66.grid, e132.grid);
  EXPECT_LE(e66.grid, 5u * 66);
}

}  // namespace
}  // namespace loraplex
