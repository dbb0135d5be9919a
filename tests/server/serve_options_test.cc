// `loraplex serve` options: defaults, vLLM's flag names, engine options, and refusals.

#include <gtest/gtest.h>

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
