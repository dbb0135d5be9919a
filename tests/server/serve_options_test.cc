// `loraplex serve` options: defaults, vLLM's flag names, engine options, and refusals.

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "loraplex/core/error.h"
#include "loraplex/server/serve_options.h"

namespace loraplex::server {
namespace {

TEST(ServeOptions, ParsesServerAndEngineOptions) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  const auto o = parse_serve_options({"--model",
                                      dir,
                                      "--lora",
                                      "sql=/a/sql",
                                      "--lora",
                                      "pirate=/b/p",
                                      "--lora-dir",
                                      dir,
                                      "--host",
                                      "0.0.0.0",
                                      "--port",
                                      "9001",
                                      "--api-key",
                                      "k",
                                      "--served-model-name",
                                      "m",
                                      "--max-loras",
                                      "8",
                                      "--max-lora-rank",
                                      "64",
                                      "--max-num-seqs",
                                      "32",
                                      "--max-num-batched-tokens",
                                      "4096",
                                      "--gpu-memory-utilization",
                                      "0.8",
                                      "--block-size",
                                      "32",
                                      "--max-model-len",
                                      "2048",
                                      "--no-enable-prefix-caching",
                                      "--no-async-scheduling",
                                      "--max-waiting",
                                      "100",
                                      "--seed",
                                      "5",
                                      "--num-kv-blocks",
                                      "64"},
                                     nullptr);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->model_dir, dir);
  ASSERT_EQ(o->loras.size(), 2u);
  EXPECT_EQ(o->loras[1].first, "pirate");
  EXPECT_EQ(o->loras[1].second, "/b/p");
  EXPECT_EQ(o->lora_dir, dir);
  EXPECT_EQ(o->http.host, "0.0.0.0");
  EXPECT_EQ(o->http.port, 9001);
  EXPECT_EQ(o->http.api_key, "k");
  EXPECT_EQ(o->served_model_name, "m");
  EXPECT_EQ(o->engine.max_loras, 8);
  EXPECT_EQ(o->engine.max_lora_rank, 64);
  EXPECT_EQ(o->engine.max_num_seqs, 32);
  EXPECT_EQ(o->engine.max_num_batched_tokens, 4096);
  EXPECT_DOUBLE_EQ(o->engine.gpu_memory_utilization, 0.8);
  EXPECT_EQ(o->engine.kv_block_size, 32);
  EXPECT_EQ(o->engine.max_model_len, 2048);
  EXPECT_FALSE(o->engine.enable_prefix_caching);
  EXPECT_FALSE(o->engine.async_scheduling);
  EXPECT_EQ(o->engine.max_waiting, 100);
  EXPECT_EQ(o->engine.seed, 5u);
  EXPECT_EQ(o->engine.num_kv_blocks, 64);
}

TEST(ServeOptions, DefaultsAndHelp) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  const auto o = parse_serve_options({"--model", dir}, nullptr);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->http.host, "127.0.0.1");
  EXPECT_EQ(o->http.port, 8000);
  EXPECT_EQ(o->served_model_name, dir);  // vLLM names the base model after --model
  EXPECT_TRUE(o->engine.enable_prefix_caching);
  EXPECT_TRUE(o->engine.async_scheduling);
  // Port 0: any free port (the server prints the one it got).
  EXPECT_EQ(parse_serve_options({"--model", dir, "--port", "0"}, nullptr)->http.port, 0);
  std::string help;
  EXPECT_FALSE(parse_serve_options({"--help"}, &help).has_value());
  EXPECT_NE(help.find("--lora-dir"), std::string::npos);
  EXPECT_NE(help.find("--max-loras"), std::string::npos);
}

TEST(ServeOptions, RefusalsNameTheFlag) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  const std::vector<std::vector<std::string>> bad = {
      {},
      {"--model", "/no/such/model/dir"},
      {"--model", dir, "--port", "70000"},
      {"--model", dir, "--port", "-1"},
      {"--model", dir, "--port", "eighty"},
      {"--model", dir, "--lora", "noequals"},
      {"--model", dir, "--lora", "a=/x", "--lora", "a=/y"},
      {"--model", dir, "--max-loras", "0"},
      {"--model", dir, "--gpu-memory-utilization", "1.5"},
      {"--model", dir, "--unknown-flag", "1"},
      {"--model", dir, "--max-loras", "4", "--max-cpu-loras", "2"},
  };
  for (const auto& args : bad) {
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    EXPECT_THROW(parse_serve_options(args, nullptr), Error) << joined;
  }
}

// --shape: random weights of a named shape instead of a checkpoint, named after the shape.
TEST(ServeOptions, ShapeInsteadOfModel) {
  const auto o = parse_serve_options({"--shape", "tiny", "--layers", "1"}, nullptr);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->shape, "tiny");
  EXPECT_EQ(o->shape_layers, 1);
  EXPECT_TRUE(o->model_dir.empty());
  EXPECT_EQ(o->served_model_name, "tiny");
  const std::string dir = std::filesystem::temp_directory_path().string();
  auto refusal = [](const std::vector<std::string>& args) {
    try {
      (void)parse_serve_options(args, nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal({}).find("--model DIR or --shape NAME"), std::string::npos);
  EXPECT_NE(refusal({"--model", dir, "--shape", "tiny"}).find("--shape"), std::string::npos);
  EXPECT_NE(refusal({"--model", dir, "--layers", "2"}).find("--layers"), std::string::npos);
}

TEST(ServeOptions, RuntimeLoadingIsOptInAndNeedsRoots) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  ::unsetenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING");
  EXPECT_FALSE(parse_serve_options({"--model", dir}, nullptr)->enable_lora_loading);
  const auto on = parse_serve_options(
      {"--model", dir, "--enable-lora-loading", "--allowed-lora-paths", dir, dir}, nullptr);
  EXPECT_TRUE(on->enable_lora_loading);
  EXPECT_EQ(on->allowed_lora_paths, (std::vector<std::string>{dir, dir}));
  EXPECT_TRUE(
      parse_serve_options({"--model", dir, "--enable-lora-loading", "--lora-dir", dir}, nullptr)
          ->enable_lora_loading);
  // With nowhere to load from, enabling it is a mistake said at start-up.
  try {
    parse_serve_options({"--model", dir, "--enable-lora-loading"}, nullptr);
    ADD_FAILURE() << "--enable-lora-loading without a root was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--allowed-lora-paths"), std::string::npos) << e.what();
  }
  // vLLM's environment variable, as vLLM reads it.
  for (const char* value : {"true", "1", "TRUE"}) {
    ::setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value, 1);
    EXPECT_TRUE(
        parse_serve_options({"--model", dir, "--lora-dir", dir}, nullptr)->enable_lora_loading)
        << value;
  }
  for (const char* value : {"0", "false", "yes"}) {
    ::setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value, 1);
    EXPECT_FALSE(
        parse_serve_options({"--model", dir, "--lora-dir", dir}, nullptr)->enable_lora_loading)
        << value;
  }
  ::unsetenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING");
}

TEST(ServeOptions, AdapterNamesStayInTheirCharacterSet) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  for (const std::string& name :
       std::vector<std::string>{"a,b", "a b", "caf\xc3\xa9", "..", "x\"y"}) {
    try {
      parse_serve_options({"--model", dir, "--lora", name + "=/x"}, nullptr);
      ADD_FAILURE() << name << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--lora"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(parse_serve_options({"--model", dir, "--lora", "org/sql-v1.2_b:3=/x"}, nullptr)
                ->loras.at(0)
                .first,
            "org/sql-v1.2_b:3");
}

model::ModelConfig positions(int64_t n) {
  model::ModelConfig c;
  c.max_position_embeddings = n;
  return c;
}

TEST(ServeOptions, MaxModelLenBeyondThePositionsNeedsTheOverride) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  ::unsetenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN");
  auto o = parse_serve_options({"--model", dir, "--max-model-len", "4096"}, nullptr);
  try {
    settle_serve_options(*o, positions(1024), {});
    ADD_FAILURE() << "--max-model-len 4096 accepted on a model of 1024 positions";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("4096"), std::string::npos) << m;
    EXPECT_NE(m.find("max_position_embeddings 1024"), std::string::npos) << m;
    EXPECT_NE(m.find("--allow-long-max-model-len"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(settle_serve_options(*o, positions(4096), {}));
  o = parse_serve_options({"--model", dir, "--max-model-len", "4096", "--allow-long-max-model-len"},
                          nullptr);
  EXPECT_NO_THROW(settle_serve_options(*o, positions(1024), {}));
  ::setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1", 1);
  o = parse_serve_options({"--model", dir, "--max-model-len", "4096"}, nullptr);
  ::unsetenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN");
  EXPECT_NO_THROW(settle_serve_options(*o, positions(1024), {}));
  o = parse_serve_options({"--model", dir}, nullptr);  // 0: the model's own
  EXPECT_NO_THROW(settle_serve_options(*o, positions(1024), {}));
}

// "<prefix><i>=/x", an adapter argument. Built with += : GCC 12 warns falsely (-Wrestrict) on
// a one-letter literal + std::to_string in the thread-sanitizer build.
std::string lora_arg(const char* prefix, int i) {
  std::string arg = prefix;
  arg += std::to_string(i);
  arg += "=/x";
  return arg;
}

TEST(ServeOptions, StartupAdaptersDecideTheDefaultRankAndSlots) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  std::vector<std::string> args = {"--model", dir};
  std::vector<int> ranks;
  for (int i = 0; i < 8; ++i) {
    args.push_back("--lora");
    args.push_back(lora_arg("a", i));
    ranks.push_back(i == 5 ? 32 : 8);
  }
  auto o = parse_serve_options(args, nullptr);
  const std::vector<std::string> said = settle_serve_options(*o, positions(1024), ranks);
  EXPECT_EQ(o->engine.max_lora_rank, 32);
  EXPECT_EQ(o->engine.max_loras, 8);
  ASSERT_EQ(said.size(), 2u);
  EXPECT_NE(said[0].find("max_lora_rank 32"), std::string::npos) << said[0];
  EXPECT_NE(said[1].find("max_loras 8"), std::string::npos) << said[1];
  // Given on the command line, they stay; a rank above an explicit limit is refused.
  std::vector<std::string> explicit_args = args;
  explicit_args.insert(explicit_args.end(), {"--max-loras", "2", "--max-lora-rank", "16"});
  o = parse_serve_options(explicit_args, nullptr);
  try {
    settle_serve_options(*o, positions(1024), ranks);
    ADD_FAILURE() << "rank 32 accepted under --max-lora-rank 16";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("adapter 'a5' has rank 32, above --max-lora-rank 16"),
              std::string::npos)
        << e.what();
  }
  ranks[5] = 8;
  EXPECT_TRUE(settle_serve_options(*o, positions(1024), ranks).empty());
  EXPECT_EQ(o->engine.max_loras, 2);
  EXPECT_EQ(o->engine.max_lora_rank, 16);
  // Few or small adapters leave the defaults (4 slots, rank 16).
  o = parse_serve_options({"--model", dir, "--lora", "a=/x"}, nullptr);
  EXPECT_TRUE(settle_serve_options(*o, positions(1024), {4}).empty());
  EXPECT_EQ(o->engine.max_loras, 4);
  EXPECT_EQ(o->engine.max_lora_rank, 16);
  // Many adapters share at most kMaxDefaultLoras slots, and no more than --max-cpu-loras.
  args = {"--model", dir};
  for (int i = 0; i < kMaxDefaultLoras + 5; ++i) {
    args.push_back("--lora");
    args.push_back(lora_arg("b", i));
  }
  o = parse_serve_options(args, nullptr);
  settle_serve_options(*o, positions(1024), std::vector<int>(kMaxDefaultLoras + 5, 8));
  EXPECT_EQ(o->engine.max_loras, kMaxDefaultLoras);
  args.insert(args.end(), {"--max-cpu-loras", "6"});
  o = parse_serve_options(args, nullptr);
  settle_serve_options(*o, positions(1024), std::vector<int>(kMaxDefaultLoras + 5, 8));
  EXPECT_EQ(o->engine.max_loras, 6);
}

TEST(ServeOptions, LoraDtypeAutoOrFp8) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  EXPECT_FALSE(parse_serve_options({"--model", dir}, nullptr)->engine.lora_dtype.has_value());
  EXPECT_FALSE(parse_serve_options({"--model", dir, "--lora-dtype", "auto"}, nullptr)
                   ->engine.lora_dtype.has_value());
  EXPECT_EQ(
      parse_serve_options({"--model", dir, "--lora-dtype", "fp8"}, nullptr)->engine.lora_dtype,
      DType::kF8E4M3);
  try {
    parse_serve_options({"--model", dir, "--lora-dtype", "int4"}, nullptr);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--lora-dtype 'int4' is not supported"), std::string::npos)
        << e.what();
  }
}

TEST(ServeOptions, TensorParallelSizeAsVllmSpellsIt) {
  const std::string dir = std::filesystem::temp_directory_path().string();
  EXPECT_EQ(parse_serve_options({"--model", dir}, nullptr)->engine.tensor_parallel_size, 1);
  const auto short_form = parse_serve_options({"--model", dir, "-tp", "4"}, nullptr);
  EXPECT_EQ(short_form->engine.tensor_parallel_size, 4);
  EXPECT_FALSE(short_form->engine.fully_sharded_loras);
  const auto long_form = parse_serve_options(
      {"--model", dir, "--tensor-parallel-size=2", "--fully-sharded-loras"}, nullptr);
  EXPECT_EQ(long_form->engine.tensor_parallel_size, 2);
  EXPECT_TRUE(long_form->engine.fully_sharded_loras);
  EXPECT_EQ(parse_serve_options({"--model", dir, "-tp=3"}, nullptr)->engine.tensor_parallel_size,
            3);
  EXPECT_THROW(parse_serve_options({"--model", dir, "-tp", "0"}, nullptr), Error);
}

}  // namespace
}  // namespace loraplex::server
