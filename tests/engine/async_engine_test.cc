// Asynchronous scheduling (EngineOptions::async_scheduling) against synchronous stepping, on the
// tiny fixtures in float32: every fixture gives PEFT's tokens both ways; a trace of every
// feature (preemption, chunked prefill, aborts mid-stream, stop strings and tokens, EOS,
// min_tokens, seeded sampling, n > 1, logprobs, penalties, slot swaps) gives the same outputs
// both ways; a stopped sequence's extra step never shows; the same on a GPU, CUDA graphs on.

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "engine_test_support.h"
#include "loraplex/adapters/adapter_manager.h"
#include "support/gpu_check.h"

namespace loraplex::test {
namespace {

using engine::Engine;
using engine::EngineMetrics;
using engine::EngineOptions;
using engine::FinishReason;
using engine::Request;
using engine::RequestHandle;
using engine::RequestOutput;

constexpr int32_t kEos = 1;  // tiny-llama's

const char* const kFixtures[] = {"tiny-llama", "tiny-qwen2", "tiny-mixtral", "tiny-qwen3",
                                 "tiny-qwen3-moe"};

EngineOptions with_async(EngineOptions o, bool on) {
  o.async_scheduling = on;
  return o;
}

// Waits until nothing runs or waits, then checks that every block and lease came back.
EngineMetrics expect_everything_returned(const Engine& engine, const std::string& what) {
  const EngineMetrics m = wait_metrics(
      engine, [](const EngineMetrics& m) { return m.num_running == 0 && m.num_waiting == 0; });
  EXPECT_EQ(m.num_running + m.num_waiting, 0) << what;
  EXPECT_EQ(m.kv_cache_usage, 0.0) << what;
  for (const AdapterInfo& a : engine.list_adapters()) EXPECT_EQ(a.leases, 0) << what << a.name;
  return m;
}

// Every expected line of `fixture` with asynchronous scheduling off and on: PEFT's tokens both
// ways. Returns the CUDA-graph steps of the asynchronous run that took fed tokens.
int64_t expect_fixture_both_ways(const std::string& fixture, const EngineOptions& options,
                                 Device device) {
  const std::vector<ExpectedLine> expected = read_expected(fixture);
  std::vector<std::vector<int32_t>> tokens[2];
  int64_t graph_fed = 0;
  for (const bool on : {false, true}) {
    const std::string what = fixture + (on ? ", async" : ", sync") + ", " +
                             std::to_string(options.max_num_batched_tokens) + " tokens a step";
    auto log = std::make_shared<StepLog>();
    auto engine = make_fixture_engine(fixture, with_async(options, on), true, device, log);
    for (const RequestOutput& out : expect_fixture_tokens(*engine, expected, what))
      tokens[on].push_back(out.token_ids);
    expect_everything_returned(*engine, what);
    engine.reset();  // the step loop has stopped: the log is complete
    EXPECT_EQ(log->launches, log->collects) << what;
    if (on) {
      // The engine really pipelined: steps launched while the one before ran, their decode
      // tokens taken from it on the device.
      EXPECT_GT(log->launched_while_running, 0) << what;
      EXPECT_GT(log->fed_tokens, 0) << what;
      EXPECT_EQ(log->max_in_flight, 2) << what;
      graph_fed = log->graph_fed_launches;
    } else {
      EXPECT_EQ(log->max_in_flight, 1) << what;
      EXPECT_EQ(log->fed_tokens, 0) << what;
    }
  }
  EXPECT_EQ(tokens[0], tokens[1]) << fixture;
  return graph_fed;
}

// One request of the feature trace; `abort_after` > 0: aborted once that many tokens are read.
struct TraceRequest {
  Request request;
  int64_t abort_after = 0;
};

std::vector<TraceRequest> feature_trace(const std::vector<ExpectedLine>& e, const Engine& engine) {
  std::vector<TraceRequest> t;
  const auto add = [&](Request r, int64_t abort_after = 0) { t.push_back({r, abort_after}); };
  // Every fixture line greedily to EOS or 12 tokens, some of them to 30.
  for (size_t i = 0; i < e.size(); ++i) {
    Request r = fixture_request(e[i], i % 4 == 0 ? 30 : 12);
    r.options.ignore_eos = false;
    add(r);
  }
  Request r = fixture_request(e[9]);
  r.options.stop = {"never", "bytes"};
  add(r);
  r.options.include_stop_str_in_output = true;
  add(r);
  r = fixture_request(e[0]);
  r.options.stop_token_ids = {440};
  add(r);
  r.options.min_tokens = 5;  // bans 440 (and EOS) for the first 5 tokens
  add(r);
  // Seeded sampling, and n = 3 as the server makes it: seeds s, s + 1, s + 2.
  r = fixture_request(e[4], 20);
  r.options.temperature = 0.9f;
  r.options.top_k = 40;
  r.options.top_p = 0.95f;
  for (uint64_t k = 0; k < 3; ++k) {
    r.options.seed = 1234 + k;
    add(r);
  }
  r.options.seed.reset();  // from the engine's seed and the request id
  add(r);
  r = fixture_request(e[6]);
  r.options.logprobs = true;
  r.options.top_logprobs = 3;
  add(r);
  // Penalties read the generated tokens: their steps wait for the last one.
  r = fixture_request(e[7], 20);
  r.options.presence_penalty = 0.5f;
  r.options.frequency_penalty = 0.5f;
  add(r);
  r = fixture_request(e[8]);
  r.options.logit_bias = {{321, 4.0f}};
  add(r);
  r = fixture_request(e[1]);
  const std::string first = engine.tokenizer().decode({e[1].output_token_ids[0]}, true);
  r.options.bad_words = {first};
  add(r);
  // Long requests aborted mid-stream.
  for (size_t i : {10, 11, 12}) add(fixture_request(e[i], 90), 3);
  return t;
}

struct TraceRun {
  std::vector<RequestOutput> outputs;
  int64_t preemptions = 0;
  int64_t steps = 0;
};

TraceRun run_trace(Engine& engine, const std::vector<TraceRequest>& trace) {
  std::vector<Request> requests;
  for (const TraceRequest& t : trace) requests.push_back(t.request);
  std::vector<RequestHandle> handles = engine.submit_all(std::move(requests));
  TraceRun run;
  run.outputs.resize(trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    if (trace[i].abort_after == 0) continue;
    RequestOutput& out = run.outputs[i];
    while (!out.finished && static_cast<int64_t>(out.token_ids.size()) < trace[i].abort_after) {
      const RequestOutput o = handles[i].next();
      out.token_ids.insert(out.token_ids.end(), o.token_ids.begin(), o.token_ids.end());
      out.finished = o.finished;
    }
    handles[i].abort();
    const RequestOutput rest = handles[i].wait();
    out.token_ids.insert(out.token_ids.end(), rest.token_ids.begin(), rest.token_ids.end());
    out.finish_reason = rest.finish_reason;
  }
  for (size_t i = 0; i < trace.size(); ++i) {
    if (trace[i].abort_after == 0) run.outputs[i] = handles[i].wait();
  }
  const EngineMetrics m = expect_everything_returned(engine, "after the trace");
  run.preemptions = m.preemptions_total;
  run.steps = m.steps_total;
  return run;
}

void expect_same_output(const RequestOutput& a, const RequestOutput& b, const std::string& what) {
  EXPECT_EQ(a.token_ids, b.token_ids) << what;
  EXPECT_EQ(a.text, b.text) << what;
  EXPECT_EQ(a.finish_reason, b.finish_reason) << what << ": " << a.error << b.error;
  EXPECT_EQ(a.stop_reason, b.stop_reason) << what;
  // The two runs batch their steps differently, and on a GPU another batch shape may take
  // another GEMM algorithm: log-probabilities agree to float32 rounding, not bit for bit.
  constexpr float kTol = 1e-4f;
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << what;
  for (size_t i = 0; i < a.logprobs.size(); ++i) {
    EXPECT_NEAR(a.logprobs[i], b.logprobs[i], kTol) << what << ": token " << i;
  }
  ASSERT_EQ(a.top_logprobs.size(), b.top_logprobs.size()) << what;
  for (size_t i = 0; i < a.top_logprobs.size(); ++i) {
    ASSERT_EQ(a.top_logprobs[i].size(), b.top_logprobs[i].size()) << what << ": token " << i;
    for (size_t j = 0; j < a.top_logprobs[i].size(); ++j) {
      EXPECT_EQ(a.top_logprobs[i][j].first, b.top_logprobs[i][j].first) << what << ": token " << i;
      EXPECT_NEAR(a.top_logprobs[i][j].second, b.top_logprobs[i][j].second, kTol)
          << what << ": token " << i;
    }
  }
  EXPECT_EQ(a.completion_tokens, b.completion_tokens) << what;
  EXPECT_EQ(a.prompt_tokens, b.prompt_tokens) << what;
}

// The feature trace on `device`, with asynchronous scheduling off and on: every output the
// same (an aborted request's tokens agree as far as both got), and greedy lines give PEFT's
// tokens up to EOS.
void expect_trace_both_ways(Device device) {
  const std::vector<ExpectedLine> e = read_expected("tiny-llama");
  EngineOptions o = small_engine_options();
  o.num_kv_blocks = 40;          // 160 tokens: sequences are preempted
  o.max_num_batched_tokens = 7;  // prompts in chunks
  o.max_loras = 2;               // four adapters take turns in two slots
  TraceRun runs[2];
  std::vector<TraceRequest> trace;
  for (const bool on : {false, true}) {
    auto log = std::make_shared<StepLog>();
    auto engine = make_fixture_engine("tiny-llama", with_async(o, on), true, device, log);
    if (trace.empty()) trace = feature_trace(e, *engine);
    runs[on] = run_trace(*engine, trace);
    engine.reset();
    EXPECT_GT(runs[on].preemptions, 0) << (on ? "async" : "sync");
    if (on) {
      EXPECT_GT(log->launched_while_running, 0);
    }
  }
  for (size_t i = 0; i < trace.size(); ++i) {
    const RequestOutput& sync = runs[0].outputs[i];
    const RequestOutput& async = runs[1].outputs[i];
    const std::string what = "request " + std::to_string(i);
    if (trace[i].abort_after == 0) {
      expect_same_output(sync, async, what);
      continue;
    }
    EXPECT_EQ(sync.finish_reason, FinishReason::kAbort) << what;
    EXPECT_EQ(async.finish_reason, FinishReason::kAbort) << what;
    const size_t n = std::min(sync.token_ids.size(), async.token_ids.size());
    EXPECT_GE(n, static_cast<size_t>(trace[i].abort_after)) << what;
    EXPECT_TRUE(
        std::equal(sync.token_ids.begin(), sync.token_ids.begin() + n, async.token_ids.begin()))
        << what;
  }
  for (size_t i = 0; i < e.size(); ++i) {
    std::vector<int32_t> want = e[i].output_token_ids;
    const auto eos = std::find(want.begin(), want.end(), kEos);
    if (eos != want.end()) want.erase(eos + 1, want.end());
    const std::vector<int32_t>& got = runs[1].outputs[i].token_ids;
    EXPECT_TRUE(got.size() >= want.size() && std::equal(want.begin(), want.end(), got.begin()))
        << "request " << i << ": not PEFT's tokens";
  }
}

TEST(AsyncScheduling, EveryFixtureGivesPeftsTokensOnAndOff) {
  for (const char* fixture : kFixtures) {
    expect_fixture_both_ways(fixture, small_engine_options(), Device::cpu());
    EngineOptions chunked = small_engine_options();
    chunked.max_num_batched_tokens = 5;
    expect_fixture_both_ways(fixture, chunked, Device::cpu());
  }
}

TEST(AsyncScheduling, ATraceWithAbortsStopsAndPreemptionIsTheSameOnAndOff) {
  expect_trace_both_ways(Device::cpu());
}

// A request that stops on a token it sampled (EOS, a stop string) has one more step in flight
// when its token comes back: that step runs (one step more than synchronously) but its token
// never reaches the request, and its blocks and lease come back. A request that ends by length
// gets no extra step.
TEST(AsyncScheduling, AStoppedSequencesExtraStepIsNeverSeen) {
  const std::vector<ExpectedLine> e = read_expected("tiny-llama");
  const auto stops_early = std::find_if(e.begin(), e.end(), [](const ExpectedLine& x) {
    const auto eos = std::find(x.output_token_ids.begin(), x.output_token_ids.end(), kEos);
    return eos != x.output_token_ids.end() && eos + 1 != x.output_token_ids.end();
  });
  ASSERT_NE(stops_early, e.end());
  Request at_eos = fixture_request(*stops_early);
  at_eos.options.ignore_eos = false;
  Request at_stop_string = fixture_request(e[9]);
  at_stop_string.options.stop = {"bytes"};
  const Request at_length = fixture_request(e[3], 5);
  struct Case {
    const char* name;
    Request request;
    int64_t extra_steps;
  };
  for (const Case& c : {Case{"eos", at_eos, 1}, Case{"stop string", at_stop_string, 1},
                        Case{"length", at_length, 0}}) {
    RequestOutput out[2];
    EngineMetrics m[2];
    for (const bool on : {false, true}) {
      auto engine = make_fixture_engine("tiny-llama", with_async(small_engine_options(), on));
      out[on] = engine->submit(c.request).wait();
      m[on] = expect_everything_returned(*engine, c.name);
    }
    expect_same_output(out[0], out[1], c.name);
    EXPECT_NE(out[1].finish_reason, FinishReason::kAbort) << c.name;
    EXPECT_EQ(m[1].steps_total, m[0].steps_total + c.extra_steps) << c.name;
    EXPECT_EQ(m[1].generation_tokens_total, m[0].generation_tokens_total) << c.name;
    EXPECT_EQ(m[1].generation_tokens_total, static_cast<int64_t>(out[1].token_ids.size()))
        << c.name;
  }
}

// ------------------------------------------------------------------------------ GPU

TEST(AsyncSchedulingCuda, EveryFixtureGivesPeftsTokensOnAndOff) {
  LORAPLEX_REQUIRE_GPU();
  for (const char* fixture : kFixtures) {
    const int64_t graph_fed =
        expect_fixture_both_ways(fixture, small_engine_options(), Device::cuda(0));
    // Decode steps replay CUDA graphs with their tokens fed on the device (MoE models run
    // their steps eagerly).
    const bool moe = std::string(fixture).find("mixtral") != std::string::npos ||
                     std::string(fixture).find("moe") != std::string::npos;
    if (!moe) {
      EXPECT_GT(graph_fed, 0) << fixture;
    }
    EngineOptions chunked = small_engine_options();
    chunked.max_num_batched_tokens = 5;
    expect_fixture_both_ways(fixture, chunked, Device::cuda(0));
  }
}

TEST(AsyncSchedulingCuda, ATraceWithAbortsStopsAndPreemptionIsTheSameOnAndOff) {
  LORAPLEX_REQUIRE_GPU();
  expect_trace_both_ways(Device::cuda(0));
}

}  // namespace
}  // namespace loraplex::test
