// The Engine on the tiny fixtures (fp32, CPU) against PEFT's references: the fixtures' tokens
// through the engine whatever the batching (chunked prefill, preemption under a small KV cache,
// fewer slots than adapters, the prefix cache); streaming, stop conditions, logprobs, seeds;
// refusals at submit; aborts and adapter unloads that free everything; many threads at once.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine_test_support.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"

namespace loraplex::test {
namespace {

using engine::Engine;
using engine::EngineMetrics;
using engine::EngineOptions;
using engine::FinishReason;
using engine::Request;
using engine::RequestError;
using engine::RequestHandle;
using engine::RequestOutput;

class EngineTinyLlama : public ::testing::Test {
 protected:
  void SetUp() override { expected_ = read_expected("tiny-llama"); }
  std::vector<ExpectedLine> expected_;
};

TEST_F(EngineTinyLlama, MatchesPeftInOneBatch) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  expect_fixture_tokens(*engine, expected_, "one batch");
  const EngineMetrics m = engine->metrics();
  EXPECT_EQ(m.max_step_adapters, 4);
  EXPECT_EQ(m.preemptions_total, 0);
}

TEST_F(EngineTinyLlama, ChunkedPrefillGivesTheTokensOfAWholePrefill) {
  for (int64_t budget : {1, 3, 7}) {
    EngineOptions o = small_engine_options();
    o.max_num_batched_tokens = budget;
    auto engine = make_fixture_engine("tiny-llama", o);
    expect_fixture_tokens(*engine, expected_, "budget " + std::to_string(budget));
    EXPECT_LE(engine->metrics().max_step_tokens, budget);
  }
}

TEST_F(EngineTinyLlama, PreemptedSequencesRecomputeTheSameTokens) {
  EngineOptions o = small_engine_options();
  o.num_kv_blocks = 14;  // one request needs up to 6 blocks of 4: preemption is certain
  o.enable_prefix_caching = false;
  auto engine = make_fixture_engine("tiny-llama", o);
  expect_fixture_tokens(*engine, expected_, "14 blocks");
  EXPECT_GT(engine->metrics().preemptions_total, 0);
  // With the prefix cache, recomputation starts from the blocks still cached.
  o.enable_prefix_caching = true;
  engine = make_fixture_engine("tiny-llama", o);
  expect_fixture_tokens(*engine, expected_, "14 blocks, prefix cache");
  EXPECT_GT(engine->metrics().preemptions_total, 0);
}

TEST_F(EngineTinyLlama, FewerSlotsThanAdapters) {
  EngineOptions o = small_engine_options();
  o.max_loras = 1;
  o.lora_drain_after_s = 0.0;
  auto engine = make_fixture_engine("tiny-llama", o);
  expect_fixture_tokens(*engine, expected_, "one slot");
  EXPECT_EQ(engine->metrics().max_step_adapters, 1);
}

// One slot, four adapters, every request at once: each adapter's first requests get the slot
// by evicting the one whose sequences have had their first token (lora_drain_after_s is far
// off: no long-wait evictions); the evicted sequences are recomputed and still give PEFT's
// tokens.
TEST_F(EngineTinyLlama, EvictedSequencesRecomputeTheSameTokens) {
  EngineOptions o = small_engine_options();
  o.max_loras = 1;
  o.lora_drain_after_s = 1e9;
  o.lora_evict_after_s = 0.0;
  auto engine = make_fixture_engine("tiny-llama", o);
  expect_fixture_tokens(*engine, expected_, "one slot, eviction");
  const EngineMetrics m = engine->metrics();
  EXPECT_GT(m.lora_evictions_total, 0);
  EXPECT_LE(m.lora_evictions_total, static_cast<int64_t>(expected_.size()));
  EXPECT_GE(m.preemptions_total, m.lora_evictions_total);
  EXPECT_EQ(m.max_step_adapters, 1);

  o.lora_evict_after_s = std::nan("");
  EXPECT_THROW(make_fixture_engine("tiny-llama", o), Error);
  o.lora_evict_after_s = -1.0;  // off
  engine = make_fixture_engine("tiny-llama", o);
  expect_fixture_tokens(*engine, expected_, "one slot, no eviction");
  EXPECT_EQ(engine->metrics().lora_evictions_total, 0);
  EXPECT_EQ(engine->metrics().preemptions_total, 0);
}

TEST_F(EngineTinyLlama, PrefixCacheHitsPerAdapter) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  // A 10-token prompt: two full blocks of 4 can come from the cache.
  const auto it = std::find_if(expected_.begin(), expected_.end(), [](const ExpectedLine& e) {
    return e.prompt_token_ids.size() == 10 && e.adapter == "sql";
  });
  ASSERT_NE(it, expected_.end());
  RequestOutput first = engine->submit(fixture_request(*it)).wait();
  EXPECT_EQ(first.cached_tokens, 0);
  RequestOutput again = engine->submit(fixture_request(*it)).wait();
  EXPECT_EQ(again.cached_tokens, 8);
  EXPECT_EQ(again.token_ids, it->output_token_ids);
  Request other = fixture_request(*it);
  other.adapter = "pirate";  // same tokens under another adapter: its own entry
  RequestOutput under_other = engine->submit(other).wait();
  EXPECT_EQ(under_other.cached_tokens, 0);
  const EngineMetrics m = engine->metrics();
  EXPECT_EQ(m.prefix_cache_hits_total, 8);
  EXPECT_EQ(m.prefix_cache_queries_total, 30);
}

TEST_F(EngineTinyLlama, StreamsTokensAndTextThatConcatenateToTheDecode) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  // Long enough (hundreds of steps) that the reader sees it in pieces even on a loaded
  // machine, where 12 tokens could all be done before the first read.
  constexpr int64_t kTokens = 400;
  RequestHandle h = engine->submit(fixture_request(expected_[2], kTokens));
  std::vector<int32_t> ids;
  std::string text;
  int reads = 0;
  for (;;) {
    const RequestOutput o = h.next(std::chrono::milliseconds(5000));
    ids.insert(ids.end(), o.token_ids.begin(), o.token_ids.end());
    text += o.text;
    ++reads;
    EXPECT_EQ(o.completion_tokens, static_cast<int64_t>(ids.size()));
    EXPECT_EQ(o.prompt_tokens, static_cast<int64_t>(expected_[2].prompt_token_ids.size()));
    if (o.finished) break;
  }
  EXPECT_GT(reads, 1);
  ASSERT_EQ(ids.size(), static_cast<size_t>(kTokens));
  // Greedy: the first tokens are PEFT's.
  const std::vector<int32_t>& peft = expected_[2].output_token_ids;
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<int64_t>(peft.size())),
            peft);
  EXPECT_EQ(text, engine->tokenizer().decode(ids, true));
  // After the end, every read says so at once.
  const RequestOutput after = h.next(std::chrono::milliseconds(0));
  EXPECT_TRUE(after.finished);
  EXPECT_TRUE(after.token_ids.empty());
}

TEST_F(EngineTinyLlama, StopTokenIdsEosAndLength) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  const ExpectedLine& e = expected_[0];  // 606 250 397 440 110 606 ...
  Request r = fixture_request(e);
  r.options.stop_token_ids = {440};
  RequestOutput out = engine->submit(r).wait();
  EXPECT_EQ(out.finish_reason, FinishReason::kStop);
  EXPECT_EQ(out.stop_reason, "440");
  EXPECT_EQ(out.token_ids,
            std::vector<int32_t>(e.output_token_ids.begin(), e.output_token_ids.begin() + 4));
  // The stop token's own text is not in the output.
  EXPECT_EQ(
      out.text,
      engine->tokenizer().decode(
          std::vector<int32_t>(e.output_token_ids.begin(), e.output_token_ids.begin() + 3), true));
  // min_tokens bans it (and EOS) for the first 5 tokens: it cannot come out at index 3.
  r.options.min_tokens = 5;
  out = engine->submit(r).wait();
  ASSERT_GE(out.token_ids.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_NE(out.token_ids[i], 440) << i;
  EXPECT_NE(out.token_ids, std::vector<int32_t>(e.output_token_ids.begin(),
                                                e.output_token_ids.begin() +
                                                    static_cast<long>(out.token_ids.size())));

  // EOS (id 1) ends a request unless ignore_eos: find a fixture line that reaches it.
  int stopped = 0;
  for (const ExpectedLine& x : expected_) {
    const auto eos = std::find(x.output_token_ids.begin(), x.output_token_ids.end(), 1);
    if (eos == x.output_token_ids.end()) continue;
    Request q = fixture_request(x);
    q.options.ignore_eos = false;
    const RequestOutput o = engine->submit(q).wait();
    EXPECT_EQ(o.finish_reason, FinishReason::kStop);
    EXPECT_EQ(o.stop_reason, "");
    EXPECT_EQ(o.token_ids, std::vector<int32_t>(x.output_token_ids.begin(), eos + 1));
    ++stopped;
  }
  EXPECT_GT(stopped, 0);

  r = fixture_request(e, 5);
  out = engine->submit(r).wait();
  EXPECT_EQ(out.finish_reason, FinishReason::kLength);
  EXPECT_EQ(out.token_ids.size(), 5u);
}

TEST_F(EngineTinyLlama, StopStringsCutTheText) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  const ExpectedLine& e = expected_[9];  // " arymlockymfilename bytes contextplace areatedymidth"
  const std::string full = engine->tokenizer().decode(e.output_token_ids, true);
  const size_t at = full.find("bytes");
  ASSERT_NE(at, std::string::npos) << full;
  Request r = fixture_request(e);
  r.options.stop = {"never", "bytes"};
  const RequestOutput out = engine->submit(r).wait();
  EXPECT_EQ(out.finish_reason, FinishReason::kStop);
  EXPECT_EQ(out.stop_reason, "bytes");
  EXPECT_EQ(out.text, full.substr(0, at));
  EXPECT_LT(out.token_ids.size(), e.output_token_ids.size());
  EXPECT_EQ(out.token_ids, std::vector<int32_t>(e.output_token_ids.begin(),
                                                e.output_token_ids.begin() +
                                                    static_cast<long>(out.token_ids.size())));
}

TEST_F(EngineTinyLlama, LogprobOfTheFirstTokenMatchesPeft) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  std::vector<Request> requests;
  for (const ExpectedLine& e : expected_) {
    requests.push_back(fixture_request(e, 3));
    requests.back().options.logprobs = true;
  }
  std::vector<RequestHandle> handles = engine->submit_all(std::move(requests));
  // first_token_top5_logprobs[0] is PEFT's (token, logprob) of the greedy first token.
  std::ifstream in(fixture_dir("tiny-llama") + "/expected.jsonl");
  std::string line;
  for (size_t i = 0; i < handles.size(); ++i) {
    ASSERT_TRUE(static_cast<bool>(std::getline(in, line)));
    const nlohmann::json top = nlohmann::json::parse(line).at("first_token_top5_logprobs");
    const RequestOutput out = handles[i].wait();
    ASSERT_EQ(out.logprobs.size(), 3u);
    EXPECT_EQ(out.token_ids[0], top.at(0).at(0).get<int32_t>());
    EXPECT_NEAR(out.logprobs[0], top.at(0).at(1).get<double>(), 1e-4) << "request " << i;
    for (float lp : out.logprobs) EXPECT_LT(lp, 0.0f);
  }
  // Without asking, none come back.
  EXPECT_TRUE(engine->submit(fixture_request(expected_[0], 2)).wait().logprobs.empty());
}

TEST_F(EngineTinyLlama, SeededSamplingIsBatchIndependent) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  Request r = fixture_request(expected_[4]);
  r.options.temperature = 0.9f;
  r.options.top_k = 40;
  r.options.top_p = 0.95f;
  r.options.seed = 1234;
  const RequestOutput alone = engine->submit(r).wait();
  std::vector<Request> batch;
  for (const ExpectedLine& e : expected_) batch.push_back(fixture_request(e));
  batch.push_back(r);
  std::vector<RequestHandle> hs = engine->submit_all(std::move(batch));
  const RequestOutput in_batch = hs.back().wait();
  EXPECT_EQ(in_batch.token_ids, alone.token_ids);
  EXPECT_NE(alone.token_ids, expected_[4].output_token_ids);
  r.options.seed = 4321;
  EXPECT_NE(engine->submit(r).wait().token_ids, alone.token_ids);
}

TEST_F(EngineTinyLlama, TinyTemperaturesSampleGreedily) {
  // Logits divided by 1e-40 overflow to inf: sampled at random before vLLM's epsilon applied.
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  for (const float t : {1e-40f, 1e-30f, 1e-6f}) {
    for (size_t i = 0; i < 6; ++i) {
      Request r = fixture_request(expected_[i]);
      r.options.temperature = t;
      r.options.seed = 77 + i;
      EXPECT_EQ(engine->submit(r).wait().token_ids, expected_[i].output_token_ids)
          << "temperature " << t << ", request " << i;
    }
  }
}

// vLLM's logits processing through the whole engine (CPU): a large bias forces its id, allowed
// ids bound every output, a bad word's first token is never sampled where greedy picked it, and
// penalties change a greedy output only where it repeats.
TEST_F(EngineTinyLlama, LogitsProcessingChangesTheSampledTokens) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  const ExpectedLine& e = expected_[1];  // an adapter's request
  Request r = fixture_request(e);
  r.options.logit_bias = {{321, 100.0f}};
  EXPECT_EQ(engine->submit(r).wait().token_ids, std::vector<int32_t>(12, 321));
  r = fixture_request(e);
  r.options.allowed_token_ids = {17, 400, 803};
  for (int32_t id : engine->submit(r).wait().token_ids) {
    EXPECT_TRUE(id == 17 || id == 400 || id == 803) << id;
  }
  // Sampled (seeded) too: still only the allowed ids.
  r.options.temperature = 1.0f;
  r.options.seed = 5;
  for (int32_t id : engine->submit(r).wait().token_ids) {
    EXPECT_TRUE(id == 17 || id == 400 || id == 803) << id;
  }
  // The greedy first token's text as a bad word: something else comes first.
  r = fixture_request(e);
  const std::string first = engine->tokenizer().decode({e.output_token_ids[0]}, true);
  const std::vector<int32_t> first_ids = engine->tokenizer().encode(first, false);
  if (first_ids.size() == 1 && first_ids[0] == e.output_token_ids[0]) {
    r.options.bad_words = {first};
    const std::vector<int32_t> got = engine->submit(r).wait().token_ids;
    ASSERT_FALSE(got.empty());
    EXPECT_NE(got[0], e.output_token_ids[0]);
    for (int32_t id : got) EXPECT_NE(id, e.output_token_ids[0]);
  }
  // A presence penalty leaves the first token (nothing generated yet) as greedy had it.
  r = fixture_request(e);
  r.options.presence_penalty = 2.0f;
  r.options.frequency_penalty = 2.0f;
  const std::vector<int32_t> penalized = engine->submit(r).wait().token_ids;
  EXPECT_EQ(penalized[0], e.output_token_ids[0]);
  // Logprobs with adjusted logits are refused, naming the fields.
  r.options.logprobs = true;
  try {
    engine->submit(r);
    ADD_FAILURE() << "logprobs with penalties accepted";
  } catch (const RequestError& err) {
    EXPECT_NE(std::string(err.what()).find("logprobs"), std::string::npos) << err.what();
  }
}

// Top logprobs: per token the k most probable ids, most probable first; greedy's token is the
// first, with the sampled token's own log-probability.
TEST_F(EngineTinyLlama, TopLogprobsRankTheStepsTokens) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  std::vector<Request> batch;
  for (size_t i = 0; i < 4; ++i) {
    Request r = fixture_request(expected_[i]);
    r.options.logprobs = true;
    r.options.top_logprobs = i == 3 ? 0 : static_cast<int>(2 + i);
    batch.push_back(r);
  }
  std::vector<RequestHandle> hs = engine->submit_all(std::move(batch));
  for (size_t i = 0; i < hs.size(); ++i) {
    const RequestOutput out = hs[i].wait();
    EXPECT_EQ(out.token_ids, expected_[i].output_token_ids) << i;
    if (i == 3) {
      EXPECT_TRUE(out.top_logprobs.empty());
      continue;
    }
    ASSERT_EQ(out.top_logprobs.size(), out.token_ids.size()) << i;
    for (size_t t = 0; t < out.token_ids.size(); ++t) {
      const auto& top = out.top_logprobs[t];
      ASSERT_EQ(top.size(), 2 + i);
      EXPECT_EQ(top[0].first, out.token_ids[t]) << i << " " << t;
      EXPECT_EQ(top[0].second, out.logprobs[t]) << i << " " << t;
      for (size_t k = 1; k < top.size(); ++k) EXPECT_LE(top[k].second, top[k - 1].second);
    }
  }
}

TEST_F(EngineTinyLlama, RefusalsNameTheValueAndTheLimit) {
  EngineOptions o = small_engine_options();
  o.num_kv_blocks = 300;  // 1200 tokens: more than max_model_len
  auto engine = make_fixture_engine("tiny-llama", o);
  const auto refused = [&](Request r, RequestError::Kind kind, const std::string& part) {
    try {
      engine->submit(std::move(r));
      ADD_FAILURE() << "not refused: " << part;
    } catch (const RequestError& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("request 0"), std::string::npos) << e.what();
    }
  };
  Request r;
  r.prompt_ids.assign(3000, 17);
  refused(r, RequestError::Kind::kTooLong, "max_model_len 1024");
  r.prompt_ids.assign(1020, 17);
  r.options.max_tokens = 5;
  refused(r, RequestError::Kind::kTooLong, "1025 tokens exceeds max_model_len 1024");
  r.options.max_tokens = std::numeric_limits<int64_t>::max();
  refused(r, RequestError::Kind::kTooLong, "exceeds max_model_len 1024");
  EXPECT_EQ(engine->metrics().request_params_max_tokens.count, 0);
  r = fixture_request(expected_[0]);
  r.adapter = "nosuch";
  refused(r, RequestError::Kind::kUnknownAdapter, "adapter 'nosuch' is not loaded");
  r = fixture_request(expected_[0]);
  r.options.temperature = -1.0f;
  refused(r, RequestError::Kind::kInvalid, "temperature -1");
  r = Request{};
  refused(r, RequestError::Kind::kInvalid, "empty");
  r.prompt_ids = {5, 4096};
  refused(r, RequestError::Kind::kInvalid, "4096");

  // submit_all names the index and submits nothing.
  std::vector<Request> batch = {fixture_request(expected_[0]), fixture_request(expected_[1])};
  batch[1].options.top_p = 2.0f;
  try {
    engine->submit_all(std::move(batch));
    ADD_FAILURE() << "not refused";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.index(), 1);
    EXPECT_NE(std::string(e.what()).find("request 1: top_p 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(engine->metrics().num_waiting + engine->metrics().num_running, 0);

  // A rank over max_lora_rank is refused at load, naming the adapter.
  o.max_lora_rank = 8;
  auto small = make_fixture_engine("tiny-llama", o, false);
  try {
    small->load_adapter("pirate", fixture_dir("tiny-llama") + "/adapters/pirate");
    ADD_FAILURE() << "rank 16 loaded under max_lora_rank 8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("adapter 'pirate'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(small->has_adapter("pirate"));
  // A KV cache smaller than one request.
  o.num_kv_blocks = 3;
  auto tiny_cache = make_fixture_engine("tiny-llama", o, false);
  r = fixture_request(expected_[0]);
  r.adapter = "";
  try {
    tiny_cache->submit(r);
    ADD_FAILURE() << "a request larger than the cache was accepted";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.kind(), RequestError::Kind::kTooLong);
    EXPECT_NE(std::string(e.what()).find("KV cache (12 tokens)"), std::string::npos) << e.what();
  }
}

TEST_F(EngineTinyLlama, AbortFreesBlocksAndLeasesAtOnce) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  std::vector<RequestHandle> hs;
  for (int i = 0; i < 8; ++i) {
    Request r = fixture_request(expected_[static_cast<size_t>(i)], 900);
    hs.push_back(engine->submit(r));
  }
  for (RequestHandle& h : hs) {
    const RequestOutput o = h.next(std::chrono::milliseconds(10000));
    EXPECT_FALSE(o.token_ids.empty());
  }
  EXPECT_GT(engine->metrics().kv_cache_usage, 0.0);
  for (RequestHandle& h : hs) {
    h.abort();
    h.abort();  // twice is fine
    const RequestOutput o = h.next(std::chrono::milliseconds(0));
    EXPECT_TRUE(o.finished);
    EXPECT_EQ(o.finish_reason, FinishReason::kAbort);
  }
  const EngineMetrics m = wait_metrics(*engine, [](const EngineMetrics& m) {
    return m.num_running == 0 && m.num_waiting == 0 && m.finished_total.at("abort") == 8;
  });
  EXPECT_EQ(m.num_running, 0);
  EXPECT_EQ(m.kv_cache_usage, 0.0);
  EXPECT_EQ(m.finished_total.at("abort"), 8);
  for (const AdapterInfo& a : engine->list_adapters()) EXPECT_EQ(a.leases, 0) << a.name;
}

TEST_F(EngineTinyLlama, UnloadWhileRunningLetsRequestsFinishThenForgets) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  std::vector<size_t> sql;
  for (size_t i = 0; i < expected_.size(); ++i)
    if (expected_[i].adapter == "sql") sql.push_back(i);
  std::vector<RequestHandle> hs;
  for (size_t i : sql) hs.push_back(engine->submit(fixture_request(expected_[i])));
  EXPECT_TRUE(engine->unload_adapter("sql"));
  EXPECT_FALSE(engine->unload_adapter("sql"));
  EXPECT_FALSE(engine->has_adapter("sql"));
  try {
    engine->submit(fixture_request(expected_[sql[0]]));
    ADD_FAILURE() << "a request for an unloaded adapter was accepted";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.kind(), RequestError::Kind::kUnknownAdapter);
  }
  for (size_t k = 0; k < hs.size(); ++k) {
    EXPECT_EQ(hs[k].wait().token_ids, expected_[sql[k]].output_token_ids);
  }
  // Once they are done the name is free again: load it anew and it serves the same tokens.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    try {
      engine->load_adapter("sql", fixture_dir("tiny-llama") + "/adapters/sql");
      break;
    } catch (const Error& e) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << e.what();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  for (const AdapterInfo& a : engine->list_adapters()) EXPECT_EQ(a.leases, 0);
  EXPECT_EQ(engine->submit(fixture_request(expected_[sql[0]])).wait().token_ids,
            expected_[sql[0]].output_token_ids);
  EXPECT_THROW(engine->load_adapter("sql", fixture_dir("tiny-llama") + "/adapters/sql"), Error);
}

TEST_F(EngineTinyLlama, WaitUntilUnloadedReturnsWhenTheLastRequestEnds) {
  EngineOptions o = small_engine_options();
  o.max_num_seqs = 1;  // the second request waits behind the first
  auto engine = make_fixture_engine("tiny-llama", o);
  const std::string dir = fixture_dir("tiny-llama") + "/adapters/sql";
  using std::chrono::milliseconds;
  EXPECT_TRUE(engine->wait_until_unloaded("sql", milliseconds(0)));      // loaded: not leaving
  EXPECT_TRUE(engine->wait_until_unloaded("nothing", milliseconds(0)));  // never loaded
  size_t sql = 0;
  while (expected_[sql].adapter != "sql") ++sql;
  Request blocker = fixture_request(expected_[0], 1000);  // base model, 1000 tokens
  RequestHandle first = engine->submit(std::move(blocker));
  RequestHandle queued = engine->submit(fixture_request(expected_[sql]));
  EXPECT_TRUE(engine->unload_adapter("sql"));
  // Its request waits behind the blocker, so the adapter cannot be gone yet.
  EXPECT_FALSE(engine->wait_until_unloaded("sql", milliseconds(10)));
  EXPECT_THROW(engine->load_adapter("sql", dir), Error);
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    EXPECT_TRUE(engine->wait_until_unloaded("sql", std::chrono::hours(48)));
    returned = true;
  });
  first.abort();
  const RequestOutput out = queued.wait();
  EXPECT_EQ(out.token_ids, expected_[sql].output_token_ids);
  waiter.join();
  EXPECT_TRUE(returned);
  EXPECT_TRUE(engine->wait_until_unloaded("sql", milliseconds(0)));
  engine->load_adapter("sql", dir);  // the name is free at once, no retry needed
  EXPECT_EQ(engine->submit(fixture_request(expected_[sql])).wait().token_ids,
            expected_[sql].output_token_ids);
}

TEST_F(EngineTinyLlama, MaxWaitingCountsRequestsTakenButNotYetScheduled) {
  EngineOptions o = small_engine_options();
  o.max_num_seqs = 1;
  o.max_waiting = 1;
  auto engine = make_fixture_engine("tiny-llama", o);
  RequestHandle running = engine->submit(fixture_request(expected_[0], 1000));
  wait_metrics(*engine, [](const EngineMetrics& m) { return m.num_running == 1; });
  // While `running` decodes, the step loop takes each new request from the inbox at a step
  // boundary and publishes it as waiting only after the step: in between it must still count.
  int rounds = 0;
  for (; rounds < 40; ++rounds) {
    if (engine->metrics().num_running != 1) break;  // the blocker ended: nothing to learn
    RequestHandle waiting = engine->submit(fixture_request(expected_[1]));
    // Land the next submit at varied points of a step (one step of one sequence takes about
    // 0.1-1 ms here).
    std::this_thread::sleep_for(std::chrono::microseconds(50 * (rounds % 8)));
    try {
      engine->submit(fixture_request(expected_[2]));
      ADD_FAILURE() << "round " << rounds << ": a second waiting request was accepted";
    } catch (const RequestError& e) {
      EXPECT_EQ(e.kind(), RequestError::Kind::kOverloaded) << e.what();
    }
    waiting.abort();
    // Gone from the engine (not merely not yet taken from the inbox) before the next round.
    const int64_t aborted = rounds + 1;
    wait_metrics(*engine, [aborted](const EngineMetrics& m) {
      const auto it = m.finished_total.find("abort");
      return m.num_waiting == 0 && it != m.finished_total.end() && it->second == aborted;
    });
  }
  EXPECT_GT(rounds, 5);
  running.abort();
}

TEST_F(EngineTinyLlama, ManyThreadsSubmitAbortAndReadMetrics) {
  EngineOptions o = small_engine_options();
  o.max_num_seqs = 8;
  o.max_loras = 2;
  o.num_kv_blocks = 40;
  auto engine = make_fixture_engine("tiny-llama", o);
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done) {
      const EngineMetrics m = engine->metrics();
      EXPECT_LE(m.kv_cache_usage, 1.0);
      std::this_thread::yield();
    }
  });
  // "vocab" is unloaded and loaded again and again meanwhile: its requests are refused while
  // it is away, and otherwise served with its weights.
  std::atomic<int> reloads{0};
  std::thread reloader([&] {
    const std::string dir = fixture_dir("tiny-llama") + "/adapters/vocab";
    while (!done) {
      if (engine->unload_adapter("vocab")) {
        for (;;) {
          try {
            engine->load_adapter("vocab", dir);
            ++reloads;
            break;
          } catch (const Error&) {
            std::this_thread::yield();  // its last requests have not finished yet
          }
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 2; ++round) {
        for (size_t i = static_cast<size_t>(t); i < expected_.size(); i += 4) {
          RequestHandle h;
          try {
            h = engine->submit(fixture_request(expected_[i]));
          } catch (const RequestError& e) {
            EXPECT_EQ(expected_[i].adapter, "vocab") << e.what();
            ++refused;
            continue;
          }
          if (i % 7 == 3) {
            h.abort();
            EXPECT_EQ(h.wait().finish_reason, FinishReason::kAbort);
            continue;
          }
          EXPECT_EQ(h.wait().token_ids, expected_[i].output_token_ids) << "request " << i;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  done = true;
  reader.join();
  reloader.join();
  EXPECT_GT(reloads.load(), 0);
  const EngineMetrics m = wait_metrics(*engine, [](const EngineMetrics& m) {
    return m.num_running == 0 && m.kv_cache_usage == 0.0;
  });
  EXPECT_EQ(m.kv_cache_usage, 0.0);
}

TEST_F(EngineTinyLlama, MetricsCountRequestsTokensAndTimes) {
  auto engine = make_fixture_engine("tiny-llama", small_engine_options());
  expect_fixture_tokens(*engine, expected_, "metrics");
  const EngineMetrics m = wait_metrics(
      *engine, [&](const EngineMetrics& m) { return m.finished_total.at("length") == 30; });
  const int64_t n = static_cast<int64_t>(expected_.size());
  int64_t prompt_tokens = 0;
  for (const ExpectedLine& e : expected_)
    prompt_tokens += static_cast<int64_t>(e.prompt_token_ids.size());
  EXPECT_EQ(m.finished_total.at("length"), n);
  EXPECT_EQ(m.generation_tokens_total, 12 * n);
  EXPECT_EQ(m.prompt_tokens_total, prompt_tokens);
  EXPECT_EQ(m.time_to_first_token_s.count, n);
  EXPECT_EQ(m.e2e_request_latency_s.count, n);
  EXPECT_EQ(m.inter_token_latency_s.count, 11 * n);
  EXPECT_EQ(m.request_generation_tokens.sum, 12.0 * static_cast<double>(n));
  EXPECT_EQ(m.time_to_first_token_s.bounds.front(), 0.001);
  EXPECT_EQ(m.time_to_first_token_s.bounds.back(), 2560.0);
  EXPECT_EQ(m.inter_token_latency_s.bounds.back(), 80.0);
  EXPECT_EQ(m.e2e_request_latency_s.bounds.front(), 0.3);
  EXPECT_EQ(m.e2e_request_latency_s.bounds.back(), 7680.0);
  EXPECT_EQ(m.time_to_first_token_s.counts.back(), n);  // cumulative
  EXPECT_EQ(m.num_kv_blocks, 256);
  EXPECT_EQ(m.max_loras, 4);
  EXPECT_GE(m.steps_total, 12);
}

TEST(EngineFixtures, QwenAndMixtralMatchPeft) {
  for (const char* fixture : {"tiny-qwen2", "tiny-mixtral", "tiny-qwen3", "tiny-qwen3-moe"}) {
    const std::vector<ExpectedLine> expected = read_expected(fixture);
    EngineOptions o = small_engine_options();
    o.max_num_batched_tokens = 5;  // chunked prefill as well
    auto engine = make_fixture_engine(fixture, o);
    expect_fixture_tokens(*engine, expected, fixture);
  }
}

}  // namespace
}  // namespace loraplex::test
