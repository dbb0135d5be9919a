// The scheduler and block manager driven by a fake model (fake_engine.h): scenarios for each
// rule of scheduler.h, and seeded random traces of thousands of steps (arrivals during running
// batches, aborts, adapters dropped from host memory and reloaded, loads that fail, slot
// evictions) checked after every step.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>

#include "fake_engine.h"
#include "loraplex/engine/block_manager.h"
#include "loraplex/engine/scheduler.h"

namespace loraplex::test {
namespace {

using engine::BlockManager;
using engine::ScheduledSeq;
using engine::Scheduler;
using engine::SchedulerConfig;
using engine::Sequence;
using engine::StepPlan;

constexpr int32_t kVocab = 97;

uint64_t key_of(const std::string& adapter) {
  return adapter.empty() ? 0 : std::hash<std::string>()(adapter) | 1;
}

struct Expect {
  std::vector<int32_t> prompt;
  std::string adapter;
  int64_t max_tokens = 0;
};

// A scheduler, its block manager, fake slots and a fake model; requests finish after
// max_tokens generated tokens. With `async`, steps run as the engine runs them with
// asynchronous scheduling: step n + 1 is planned and run before step n's tokens are handed
// back (its decodes run pending tokens, which the fake model feeds).
class Harness {
 public:
  Harness(SchedulerConfig config, int64_t num_blocks, int64_t block_size, int host_capacity,
          bool caching = true)
      : config_(with_loading(config, host_capacity)),
        blocks(num_blocks, block_size, caching),
        slots(config.max_loras, host_capacity),
        sched(config_, blocks, slots),
        model(num_blocks, block_size, kVocab) {}

  // The engine's rule: room in host memory beyond the slots' adapters.
  static SchedulerConfig with_loading(SchedulerConfig c, int host_capacity) {
    c.max_loading_adapters = std::max(1, host_capacity - c.max_loras);
    return c;
  }

  uint64_t add(std::vector<int32_t> prompt, const std::string& adapter, int64_t max_tokens) {
    auto s = std::make_unique<Sequence>();
    s->id = next_id++;
    s->order = s->id;
    s->arrival_time = now;
    s->adapter = adapter;
    s->adapter_key = key_of(adapter);
    s->tokens = prompt;
    s->num_prompt_tokens = static_cast<int64_t>(prompt.size());
    s->max_num_tokens = s->num_prompt_tokens + max_tokens;
    expect[s->id] = {std::move(prompt), adapter, max_tokens};
    const uint64_t id = s->id;
    live_ids.insert(id);
    sched.add(std::move(s));
    return id;
  }

  // One step: plan, run, complete, finish whoever is done; advances the clock and the loads.
  StepPlan step(double dt = 0.01) {
    std::set<uint64_t> decoding;  // running with one token to compute: decodes of this step
    for (uint64_t id : live_ids) {
      const Sequence* s = sched.find(id);
      if (s->status == Sequence::Status::kRunning && !s->prefilling()) decoding.insert(id);
    }
    StepPlan plan = sched.schedule(now);
    for (size_t i = 0; i < plan.failed.size(); ++i) {
      failed[plan.failed[i]->id] = plan.failed_errors[i];
      live_ids.erase(plan.failed[i]->id);
    }
    check(plan, decoding);
    for (uint64_t id : plan.preempted) {
      if (sched.find(id)->num_pending > 0) ++preempted_pending;
    }
    Ran ran;
    ran.sampled = model.run(plan, blocks);
    sched.advance(plan);
    for (const ScheduledSeq& q : plan.seqs)
      if (q.sample) ran.ids.push_back(q.seq->id);
    if (!async) {
      collect(ran);
    } else {
      // The step just run stays in flight while the next one is planned.
      if (in_flight) collect(*in_flight);
      in_flight.reset();
      if (!plan.empty()) in_flight = std::move(ran);
    }
    slots.tick();
    now += dt;
    ++steps;
    if (!plan.preempted.empty()) saw_preemption = true;
    if (!sched.draining_adapters().empty()) saw_drain = true;
    if (!plan.evicted.empty()) saw_eviction = true;
    return plan;
  }

  // A step's tokens handed back: sequences that reached max_tokens finish.
  struct Ran {
    std::vector<uint64_t> ids;
    std::vector<int32_t> sampled;
  };
  void collect(const Ran& ran) {
    sched.resolve(ran.ids, ran.sampled);
    for (uint64_t id : ran.ids) {
      const Sequence* s = sched.find(id);
      if (s == nullptr || s->num_known_tokens() - s->num_prompt_tokens < expect.at(id).max_tokens)
        continue;
      EXPECT_EQ(s->num_pending, 0) << "sequence " << id << " was planned past its length";
      std::unique_ptr<Sequence> done = sched.remove(id);
      finished[id].assign(done->tokens.begin() + done->num_prompt_tokens, done->tokens.end());
      live_ids.erase(id);
      preempted_total += done->num_preemptions;
    }
  }

  void abort(uint64_t id) {
    std::unique_ptr<Sequence> s = sched.remove(id);
    if (s != nullptr) aborted.insert(id);
    live_ids.erase(id);
  }

  // Every invariant that must hold after any step.
  void check(const StepPlan& plan, const std::set<uint64_t>& decoding) {
    ASSERT_LE(plan.num_tokens, config_.max_num_batched_tokens) << "step " << steps;
    ASSERT_LE(static_cast<int64_t>(plan.seqs.size()), config_.max_num_seqs) << "step " << steps;
    ASSERT_LE(sched.num_running(), config_.max_num_seqs);
    ASSERT_LE(plan.num_adapters, config_.max_loras) << "step " << steps;
    ASSERT_LE(slots.num_pinned(), config_.max_loras);
    ASSERT_TRUE(slots.violations().empty()) << slots.violations().front();
    std::set<uint64_t> ids;
    int64_t tokens = 0;
    bool seen_prefill = false;
    for (const ScheduledSeq& q : plan.seqs) {
      ASSERT_TRUE(ids.insert(q.seq->id).second) << "sequence " << q.seq->id << " twice";
      ASSERT_GE(q.num_tokens, 1);
      tokens += q.num_tokens;
      ASSERT_EQ(q.sample, q.start + q.num_tokens == q.seq->num_tokens());
      // Decodes come before any prompt chunk.
      if (decoding.count(q.seq->id) != 0) {
        ASSERT_FALSE(seen_prefill) << "a decode after a prefill chunk at step " << steps;
      } else {
        seen_prefill = true;
      }
      if (!q.seq->adapter.empty()) {
        ASSERT_TRUE(slots.pinned(q.seq->adapter)) << q.seq->adapter;
        ASSERT_EQ(q.seq->slot, slots.slot_of(q.seq->adapter));
      } else {
        ASSERT_EQ(q.seq->slot, -1);
      }
    }
    ASSERT_EQ(tokens, plan.num_tokens);
    // Evictions come first among the step's preemptions, and their sequences are not planned.
    ASSERT_LE(plan.evicted.size(), plan.preempted.size());
    for (size_t i = 0; i < plan.evicted.size(); ++i) {
      ASSERT_EQ(plan.evicted[i], plan.preempted[i]);
      ASSERT_EQ(ids.count(plan.evicted[i]), 0u)
          << "evicted sequence " << plan.evicted[i] << " (" << sched.find(plan.evicted[i])->adapter
          << ") planned at step " << steps << " preempted " << plan.preempted.size() << " seqs "
          << plan.seqs.size() << " pinned " << slots.num_pinned();
    }
    // Block references are exactly the running sequences' block tables.
    std::map<int32_t, int32_t> refs;
    int64_t waiting_seen = 0;
    for (uint64_t id : live_ids) {
      const Sequence* s = sched.find(id);
      if (s->status == Sequence::Status::kRunning) {
        for (int32_t b : s->blocks) ++refs[b];
      } else {
        ++waiting_seen;
        ASSERT_TRUE(s->blocks.empty()) << "waiting sequence " << id << " holds blocks";
      }
    }
    for (int32_t b = 0; b < blocks.num_blocks(); ++b) {
      const auto it = refs.find(b);
      ASSERT_EQ(blocks.ref_count(b), it == refs.end() ? 0 : it->second) << "block " << b;
    }
    ASSERT_EQ(waiting_seen, sched.num_waiting());
    // A waiting request whose adapter could run (base model, or resident and not drained, or in
    // host memory with a slot free for it) is left waiting only when the step ran out of
    // sequences, tokens or KV blocks, or preempted for blocks (evictions do not count).
    const bool cut_short = plan.preempted.size() > plan.evicted.size() || plan.stopped_for_blocks ||
                           sched.num_running() >= config_.max_num_seqs ||
                           plan.num_tokens >= config_.max_num_batched_tokens;
    if (cut_short) return;
    const std::vector<std::string>& draining = plan.held_back;
    for (uint64_t id : live_ids) {
      const Sequence* s = sched.find(id);
      if (s->status != Sequence::Status::kWaiting) continue;
      if (s->adapter.empty()) {
        ADD_FAILURE() << "base-model request " << id << " waits at step " << steps;
        continue;
      }
      const bool drained =
          std::find(draining.begin(), draining.end(), s->adapter) != draining.end();
      if (slots.pinned(s->adapter) && !drained) {
        ADD_FAILURE() << "request " << id << " of resident adapter " << s->adapter
                      << " waits at step " << steps;
      }
    }
  }

  SchedulerConfig config_;
  bool async = false;
  std::optional<Ran> in_flight;
  BlockManager blocks;
  FakeSlots slots;
  Scheduler sched;
  FakeModel model;
  uint64_t next_id = 0;
  double now = 0.0;
  int64_t steps = 0;
  int64_t preempted_total = 0;
  int64_t preempted_pending = 0;  // preempted while a token of theirs was in flight
  bool saw_preemption = false;
  bool saw_drain = false;
  bool saw_eviction = false;
  std::map<uint64_t, Expect> expect;
  std::set<uint64_t> live_ids;
  std::map<uint64_t, std::vector<int32_t>> finished;
  std::map<uint64_t, std::string> failed;
  std::set<uint64_t> aborted;
};

std::vector<int32_t> prompt_of(int64_t n, int32_t base) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(static_cast<int32_t>((base + 7 * i) % kVocab));
  return p;
}

bool waiting(Harness& h, uint64_t id) {
  return h.sched.find(id)->status == Sequence::Status::kWaiting;
}

// Whether `p` planned the live sequence `id` (a plan's pointers to sequences that finished in
// its step dangle, so they are compared, never followed).
bool planned(Harness& h, const StepPlan& p, uint64_t id) {
  const Sequence* s = h.sched.find(id);
  return s != nullptr && std::any_of(p.seqs.begin(), p.seqs.end(),
                                     [&](const ScheduledSeq& q) { return q.seq == s; });
}

void expect_reference_tokens(Harness& h) {
  for (const auto& [id, e] : h.expect) {
    ASSERT_EQ(h.finished.count(id), 1u) << "request " << id << " did not finish";
    EXPECT_EQ(h.finished.at(id), h.model.reference(e.prompt, key_of(e.adapter), e.max_tokens))
        << "request " << id << " (adapter '" << e.adapter << "')";
  }
}

SchedulerConfig config(int64_t seqs, int64_t budget, int loras) {
  SchedulerConfig c;
  c.max_num_seqs = seqs;
  c.max_num_batched_tokens = budget;
  c.max_loras = loras;
  c.lora_drain_after_s = 1e9;
  return c;
}

TEST(Scheduler, DecodesFirstThenChunkedPrefillUnderTheBudget) {
  Harness h(config(8, 10, 2), 64, 4, 4);
  const uint64_t a = h.add(prompt_of(3, 1), "", 6);
  const uint64_t b = h.add(prompt_of(3, 2), "", 6);
  StepPlan p = h.step();  // both prompts
  ASSERT_EQ(p.seqs.size(), 2u);
  const uint64_t c = h.add(prompt_of(23, 3), "", 2);
  p = h.step();  // two decodes, then 8 tokens of c's prompt
  ASSERT_EQ(p.seqs.size(), 3u);
  EXPECT_EQ(p.seqs[0].seq->id, a);
  EXPECT_EQ(p.seqs[1].seq->id, b);
  EXPECT_EQ(p.seqs[2].seq->id, c);
  EXPECT_EQ(p.seqs[2].num_tokens, 8);
  EXPECT_FALSE(p.seqs[2].sample);
  p = h.step();
  EXPECT_EQ(p.seqs[2].start, 8);
  EXPECT_EQ(p.seqs[2].num_tokens, 8);
  p = h.step();
  EXPECT_EQ(p.seqs[2].num_tokens, 7);
  EXPECT_TRUE(p.seqs[2].sample);
  while (h.sched.has_work()) h.step();
  for (const auto& [id, e] : h.expect) {
    EXPECT_EQ(h.finished.at(id), h.model.reference(e.prompt, key_of(e.adapter), e.max_tokens))
        << "request " << id;
  }
}

TEST(Scheduler, ChunkedPrefillGivesTheTokensOfAWholePrefill) {
  for (int64_t budget : {1, 2, 3, 5, 64}) {
    Harness h(config(4, budget, 1), 64, 4, 4);
    h.add(prompt_of(29, 5), "", 5);
    h.add(prompt_of(13, 6), "", 7);
    while (h.sched.has_work()) h.step();
    for (const auto& [id, e] : h.expect) {
      EXPECT_EQ(h.finished.at(id), h.model.reference(e.prompt, 0, e.max_tokens))
          << "budget " << budget << " request " << id;
    }
  }
}

TEST(Scheduler, ResidentAdaptersGoAheadOfOnesWaitingForASlot) {
  Harness h(config(8, 64, 1), 64, 4, 4);
  h.slots.make_resident("a");
  h.slots.make_resident("b");
  h.add(prompt_of(3, 1), "a", 8);
  h.step();  // "a" takes the only slot
  const uint64_t wants_b = h.add(prompt_of(3, 2), "b", 2);
  const uint64_t more_a = h.add(prompt_of(3, 3), "a", 2);
  const uint64_t base = h.add(prompt_of(3, 4), "", 2);
  const StepPlan p = h.step();
  std::set<uint64_t> ran;
  for (const ScheduledSeq& q : p.seqs) ran.insert(q.seq->id);
  EXPECT_EQ(ran.count(wants_b), 0u);
  EXPECT_EQ(ran.count(more_a), 1u);
  EXPECT_EQ(ran.count(base), 1u);
  while (h.sched.has_work()) h.step();
  EXPECT_EQ(h.finished.size(), 4u);
}

TEST(Scheduler, AdapterLoadingInTheBackgroundBlocksNobody) {
  Harness h(config(8, 64, 2), 64, 4, 4);
  h.slots.set_load_delay(5);
  const uint64_t cold = h.add(prompt_of(4, 1), "cold", 2);
  const uint64_t base = h.add(prompt_of(4, 2), "", 2);
  StepPlan p = h.step();
  ASSERT_EQ(p.seqs.size(), 1u);
  EXPECT_EQ(p.seqs[0].seq->id, base);
  EXPECT_EQ(h.slots.loads_started(), 1);
  int64_t waited = 1;
  for (;;) {
    h.step();  // (its plan may point to sequences that finished in it)
    if (!waiting(h, cold)) break;
    ++waited;
    ASSERT_LT(waited, 20);
  }
  EXPECT_GE(waited, 4);
  while (h.sched.has_work()) h.step();
  EXPECT_EQ(h.finished.at(cold), h.model.reference(h.expect[cold].prompt, key_of("cold"), 2));
}

TEST(Scheduler, AFailedLoadEndsOnlyThatAdaptersRequests) {
  Harness h(config(8, 64, 2), 64, 4, 4);
  h.slots.set_load_delay(2);
  h.slots.fail_loads("broken");
  const uint64_t bad = h.add(prompt_of(4, 1), "broken", 2);
  const uint64_t bad2 = h.add(prompt_of(5, 1), "broken", 2);
  const uint64_t good = h.add(prompt_of(4, 2), "", 3);
  while (h.sched.has_work()) h.step();
  EXPECT_EQ(h.failed.size(), 2u);
  EXPECT_EQ(h.failed.count(bad), 1u);
  EXPECT_EQ(h.failed.count(bad2), 1u);
  EXPECT_NE(h.failed.at(bad).find("broken"), std::string::npos);
  EXPECT_EQ(h.finished.count(good), 1u);
}

TEST(Scheduler, TheAdapterWaitingLongestGetsTheFreedSlot) {
  SchedulerConfig cfg = config(8, 64, 1);
  cfg.lora_evict_after_s = -1;  // the slot frees when "a" ends, not by eviction
  Harness h(cfg, 64, 4, 8);
  for (const char* a : {"a", "b", "c"}) h.slots.make_resident(a);
  h.add(prompt_of(3, 1), "a", 3);
  h.step();
  h.now += 1;
  const uint64_t c = h.add(prompt_of(3, 2), "c", 2);  // arrives first
  h.now += 1;
  const uint64_t b = h.add(prompt_of(3, 3), "b", 2);
  while (!h.finished.count(c) && !h.finished.count(b)) h.step();
  EXPECT_EQ(h.finished.count(c), 1u) << "the younger adapter took the slot first";
}

TEST(Scheduler, ABusyAdapterIsDrainedForOneThatWaitedTooLong) {
  SchedulerConfig c = config(8, 64, 1);
  c.lora_drain_after_s = 0.05;
  c.lora_evict_after_s = -1;  // the drain alone
  Harness h(c, 256, 4, 8);
  h.slots.make_resident("busy");
  h.slots.make_resident("rare");
  h.add(prompt_of(3, 1), "busy", 4);
  h.step();
  const uint64_t rare = h.add(prompt_of(3, 2), "rare", 2);
  // "busy" gets a new request every step; without draining it would keep the slot for ever.
  int steps = 0;
  while (h.finished.count(rare) == 0) {
    h.add(prompt_of(3, 3 + steps), "busy", 4);
    h.step();
    ASSERT_LT(++steps, 60) << "the waiting adapter starved";
  }
  EXPECT_TRUE(h.saw_drain);
  while (h.sched.has_work()) h.step();
  for (const auto& [id, e] : h.expect) {
    EXPECT_EQ(h.finished.at(id), h.model.reference(e.prompt, key_of(e.adapter), e.max_tokens));
  }
}

TEST(Scheduler, ANewRequestEvictsTheAdapterWithTheFewestRunningSequences) {
  SchedulerConfig c = config(8, 64, 2);
  c.lora_evict_after_s = 0.05;
  Harness h(c, 256, 4, 8);
  for (const char* a : {"many", "few", "new"}) h.slots.make_resident(a);
  const uint64_t m1 = h.add(prompt_of(5, 1), "many", 40);
  const uint64_t m2 = h.add(prompt_of(6, 2), "many", 40);
  const uint64_t victim = h.add(prompt_of(7, 3), "few", 40);
  h.step();  // every prompt, and its first token
  h.step();
  const uint64_t fresh = h.add(prompt_of(4, 4), "new", 6);
  const double arrived = h.now;
  double evicted_at = 0.0;
  StepPlan p;
  for (int steps = 0;; ++steps) {
    ASSERT_LT(steps, 20) << "no eviction";
    ASSERT_TRUE(waiting(h, fresh));
    evicted_at = h.now;
    p = h.step(0.01);
    if (!p.evicted.empty()) break;
  }
  // Marked by the first step at which the request had waited lora_evict_after_s, carried out by
  // the next (allowing for the clock's rounding).
  EXPECT_GT(evicted_at - arrived, 0.05);
  EXPECT_LT(evicted_at - arrived, 0.075);
  EXPECT_EQ(p.evicted, std::vector<uint64_t>{victim});
  EXPECT_EQ(p.preempted, std::vector<uint64_t>{victim});
  EXPECT_TRUE(planned(h, p, fresh)) << "the new request waits for the freed slot";
  EXPECT_TRUE(planned(h, p, m1) && planned(h, p, m2)) << "the other adapter's sequences stopped";
  const Sequence& v = *h.sched.find(victim);
  EXPECT_TRUE(waiting(h, victim));
  EXPECT_TRUE(v.blocks.empty());
  EXPECT_EQ(v.num_computed, 0);
  EXPECT_EQ(v.num_preemptions, 1);
  EXPECT_GT(v.num_tokens(), v.num_prompt_tokens + 1);  // it had generated tokens
  EXPECT_FALSE(h.slots.pinned("few"));
  EXPECT_TRUE(h.slots.pinned("new"));
  EXPECT_EQ(h.sched.evictions_total(), 1);
  EXPECT_EQ(h.sched.preemptions_total(), 1);
  while (h.sched.has_work()) h.step();
  expect_reference_tokens(h);
  EXPECT_EQ(h.sched.evictions_total(), 1);
  EXPECT_EQ(h.blocks.num_free_blocks(), h.blocks.num_blocks());
}

TEST(Scheduler, EvictionTiesGoToTheAdapterLeastRecentlyGivenASequence) {
  for (bool older_first : {true, false}) {
    SchedulerConfig c = config(8, 64, 2);
    c.lora_evict_after_s = 0.0;
    Harness h(c, 256, 4, 8);
    for (const char* a : {"x", "y", "new"}) h.slots.make_resident(a);
    const std::string older = older_first ? "x" : "y";
    const std::string newer = older_first ? "y" : "x";
    const uint64_t o = h.add(prompt_of(5, 1), older, 30);
    h.step();
    h.step();
    const uint64_t n = h.add(prompt_of(6, 2), newer, 30);
    h.step();
    h.step();
    h.add(prompt_of(4, 3), "new", 3);
    std::vector<uint64_t> evicted;
    for (int steps = 0; evicted.empty(); ++steps) {
      ASSERT_LT(steps, 5);
      evicted = h.step().evicted;
    }
    EXPECT_EQ(evicted, std::vector<uint64_t>{o}) << "older " << older;
    EXPECT_FALSE(waiting(h, n));
    while (h.sched.has_work()) h.step();
    expect_reference_tokens(h);
  }
}

TEST(Scheduler, AFirstTokenIsNeverPutOffByAnEviction) {
  SchedulerConfig c = config(8, 8, 1);  // 8 tokens a step: a 30-token prompt takes 4 steps
  c.lora_evict_after_s = 0.0;
  Harness h(c, 256, 4, 8);
  h.slots.make_resident("a");
  h.slots.make_resident("b");
  const uint64_t a1 = h.add(prompt_of(3, 1), "a", 60);
  h.step();  // a1's prompt and first token
  ASSERT_FALSE(h.sched.find(a1)->prefilling());
  // b waits for the slot; a2, behind it, joins the resident adapter, and its prompt runs in
  // chunks. "a" may not be evicted until a2 has its first token, though a1 has had many.
  const uint64_t b = h.add(prompt_of(3, 3), "b", 4);
  const uint64_t a2 = h.add(prompt_of(30, 2), "a", 20);
  int prompt_steps = 0;
  while (h.sched.find(a2)->num_tokens() == h.sched.find(a2)->num_prompt_tokens) {
    const StepPlan p = h.step();
    ASSERT_TRUE(p.evicted.empty()) << "step " << prompt_steps;
    EXPECT_TRUE(h.slots.pinned("a"));
    EXPECT_TRUE(waiting(h, b));
    ASSERT_LT(++prompt_steps, 40);
  }
  EXPECT_GE(prompt_steps, 4);
  // Now both have produced tokens: "a" goes and b comes, within two steps.
  StepPlan p = h.step();
  if (p.evicted.empty()) p = h.step();
  std::vector<uint64_t> evicted = p.evicted;
  std::sort(evicted.begin(), evicted.end());
  EXPECT_EQ(evicted, (std::vector<uint64_t>{a1, a2}));
  EXPECT_TRUE(planned(h, p, b));
  while (h.sched.has_work()) h.step();
  expect_reference_tokens(h);
}

TEST(Scheduler, ARequestCausesAtMostOneEviction) {
  SchedulerConfig c = config(8, 4, 1);
  c.lora_evict_after_s = 0.0;
  c.lora_drain_after_s = -1;  // first-token evictions only
  Harness h(c, 256, 4, 8);
  h.slots.make_resident("a");
  h.slots.make_resident("x");
  const uint64_t a1 = h.add(prompt_of(3, 1), "a", 40);
  h.step();
  // x1 finds the slot taken: "a" is marked for eviction; the base-model prompt behind it takes
  // the rest of the step.
  const uint64_t x1 = h.add(prompt_of(3, 2), "x", 5);
  h.add(prompt_of(20, 3), "", 3);
  h.step();
  ASSERT_EQ(h.sched.evicting_adapters(), std::vector<std::string>{"a"});
  // The eviction happens, but the prompt's next chunk leaves no budget to admit x1; then x
  // falls out of host memory, which voids its reserved slot, and a1 takes the slot back.
  StepPlan p = h.step();
  ASSERT_EQ(p.evicted, std::vector<uint64_t>{a1});
  ASSERT_TRUE(waiting(h, x1));
  h.slots.evict("x");
  while (waiting(h, a1)) {
    h.step();
    ASSERT_LT(h.steps, 30);
  }
  // x1 is back in host memory and waits for its first token, but it has had its eviction.
  while (h.sched.has_work()) h.step();
  EXPECT_EQ(h.sched.evictions_total(), 1);
  EXPECT_EQ(h.sched.find(a1), nullptr);
  expect_reference_tokens(h);
}

TEST(Scheduler, WithEvictionOffANewRequestWaitsForTheSlotToFree) {
  SchedulerConfig c = config(8, 64, 2);
  c.lora_evict_after_s = -1;
  Harness h(c, 256, 4, 8);
  for (const char* a : {"many", "few", "new"}) h.slots.make_resident(a);
  h.add(prompt_of(5, 1), "many", 40);
  h.add(prompt_of(6, 2), "many", 40);
  const uint64_t few = h.add(prompt_of(7, 3), "few", 20);
  h.step();
  const uint64_t fresh = h.add(prompt_of(4, 4), "new", 6);
  int64_t few_ended = -1;
  while (waiting(h, fresh)) {
    if (few_ended < 0) {
      ASSERT_TRUE(h.slots.pinned("many") && h.slots.pinned("few"));
    }
    h.step(0.5);  // far beyond any eviction delay
    ASSERT_LT(h.steps, 100);
    if (few_ended < 0 && h.finished.count(few) != 0) few_ended = h.steps;
  }
  // Admitted by the step after the one that ended the slot's last sequence.
  EXPECT_EQ(h.steps, few_ended + 1);
  while (h.sched.has_work()) h.step();
  EXPECT_EQ(h.sched.evictions_total(), 0);
  EXPECT_EQ(h.sched.preemptions_total(), 0);
  EXPECT_FALSE(h.saw_eviction);
  expect_reference_tokens(h);
}

TEST(Scheduler, AnEvictedSequenceWaitsFromItsPreemptionNotItsArrival) {
  SchedulerConfig c = config(8, 64, 1);
  c.lora_evict_after_s = 0.0;
  c.lora_drain_after_s = 0.05;
  Harness h(c, 256, 4, 8);
  h.slots.make_resident("old");
  h.slots.make_resident("new");
  const uint64_t old = h.add(prompt_of(5, 1), "old", 40);
  h.step();
  h.now += 10.0;  // "old" arrived long ago
  h.add(prompt_of(4, 2), "new", 30);
  double evicted_at = -1.0;
  while (evicted_at < 0) {
    const double t = h.now;
    if (!h.step().evicted.empty()) evicted_at = t;
    ASSERT_LT(h.steps, 10);
  }
  ASSERT_TRUE(waiting(h, old));
  // Had its wait counted from its arrival, "new" would be evicted for it at once; it is once
  // "old" has waited lora_drain_after_s since its preemption.
  double again_at = -1.0;
  while (again_at < 0) {
    const double t = h.now;
    const StepPlan p = h.step(0.01);
    if (!p.evicted.empty()) {
      again_at = t;
      EXPECT_TRUE(planned(h, p, old)) << "the long-waiting sequence takes the slot back";
    }
    ASSERT_LT(h.steps, 40);
  }
  EXPECT_GE(again_at - evicted_at, 0.05 - 1e-9);
  EXPECT_EQ(h.sched.long_wait_evictions_total(), 1);
  EXPECT_TRUE(h.sched.draining_adapters().empty()) << "with eviction on nothing drains";
  while (h.sched.has_work()) h.step();
  expect_reference_tokens(h);
}

TEST(Scheduler, KvExhaustionPreemptsTheNewestAndRecomputesTheSameTokens) {
  // 12 blocks of 4: three sequences of up to 4 + 24 tokens cannot all hold their blocks.
  Harness h(config(8, 64, 1), 12, 4, 4);
  const uint64_t first = h.add(prompt_of(4, 1), "", 24);
  h.add(prompt_of(4, 2), "", 24);
  const uint64_t newest = h.add(prompt_of(4, 3), "", 24);
  std::vector<uint64_t> preempted;
  while (h.sched.has_work()) {
    const StepPlan p = h.step();
    preempted.insert(preempted.end(), p.preempted.begin(), p.preempted.end());
  }
  ASSERT_FALSE(preempted.empty());
  EXPECT_EQ(preempted.front(), newest);
  EXPECT_EQ(std::count(preempted.begin(), preempted.end(), first), 0);
  for (const auto& [id, e] : h.expect) {
    EXPECT_EQ(h.finished.at(id), h.model.reference(e.prompt, 0, e.max_tokens)) << id;
  }
  EXPECT_EQ(h.blocks.num_free_blocks(), h.blocks.num_blocks());
}

TEST(Scheduler, PrefixCacheHitsFullBlocksPerAdapterAndRecomputesTheLastToken) {
  Harness h(config(8, 64, 2), 64, 4, 4);
  h.slots.make_resident("x");
  const std::vector<int32_t> prompt = prompt_of(12, 9);  // three full blocks
  h.add(prompt, "", 3);
  while (h.sched.has_work()) h.step();
  const uint64_t again = h.add(prompt, "", 3);
  StepPlan p = h.step();
  ASSERT_EQ(p.seqs.size(), 1u);
  // Two blocks come from the cache; the third is recomputed, since the last token's logits are
  // needed.
  EXPECT_EQ(p.seqs[0].start, 8);
  EXPECT_EQ(h.sched.find(again)->prompt_cached_tokens, 8);
  const uint64_t other = h.add(prompt, "x", 3);  // same tokens, another adapter: no hit
  p = h.step();
  for (const ScheduledSeq& q : p.seqs) {
    if (q.seq->id == other) {
      EXPECT_EQ(q.start, 0);
    }
  }
  while (h.sched.has_work()) h.step();
  for (const auto& [id, e] : h.expect) {
    EXPECT_EQ(h.finished.at(id), h.model.reference(e.prompt, key_of(e.adapter), e.max_tokens));
  }
  EXPECT_EQ(h.sched.prefix_hits_total(), 8);
  EXPECT_EQ(h.sched.prefix_queries_total(), 36);
}

TEST(Scheduler, AbortFreesBlocksAndTheAdapterSlot) {
  Harness h(config(8, 64, 2), 64, 4, 4);
  h.slots.make_resident("a");
  const uint64_t r = h.add(prompt_of(9, 1), "a", 50);
  const uint64_t w = h.add(prompt_of(9, 2), "a", 50);
  h.step();
  h.step();
  EXPECT_TRUE(h.slots.pinned("a"));
  EXPECT_GT(h.blocks.num_used_blocks(), 0);
  h.abort(r);
  EXPECT_TRUE(h.slots.pinned("a"));  // w still runs
  h.abort(w);
  EXPECT_FALSE(h.slots.pinned("a"));
  EXPECT_EQ(h.blocks.num_used_blocks(), 0);
  EXPECT_FALSE(h.sched.has_work());
}

// ------------------------------------------------------------ asynchronous steps

std::vector<uint64_t> ids_of(const StepPlan& p) {
  std::vector<uint64_t> ids;
  for (const ScheduledSeq& q : p.seqs)
    if (q.sample) ids.push_back(q.seq->id);
  return ids;
}

TEST(SchedulerAsync, APendingTokenIsDecodedBeforeItsIdComesBack) {
  Harness h(config(8, 64, 1), 16, 4, 4);
  const uint64_t id = h.add(prompt_of(3, 1), "", 10);
  const StepPlan first = h.sched.schedule(0.0);
  h.sched.advance(first);
  const Sequence& s = *h.sched.find(id);
  EXPECT_EQ(s.num_pending, 1);
  EXPECT_EQ(s.tokens.back(), engine::kPendingToken);
  EXPECT_EQ(s.num_computed, 3);
  // Planned from its pending token: one token at position 3, sampled.
  const StepPlan second = h.sched.schedule(0.01);
  ASSERT_EQ(second.seqs.size(), 1u);
  EXPECT_EQ(second.seqs[0].start, 3);
  EXPECT_EQ(second.seqs[0].num_tokens, 1);
  EXPECT_TRUE(second.seqs[0].sample);
  h.sched.advance(second);
  EXPECT_EQ(s.num_pending, 2);
  EXPECT_EQ(s.num_computed, 4);
  // Block 0 is computed, but its last token is still pending: no hash, not in the cache.
  EXPECT_TRUE(s.block_hashes.empty());
  EXPECT_EQ(s.num_registered_blocks, 0);
  h.sched.resolve(ids_of(first), std::vector<int32_t>{42});
  EXPECT_EQ(s.tokens[3], 42);
  EXPECT_EQ(s.num_pending, 1);
  EXPECT_EQ(s.block_hashes.size(), 1u);
  EXPECT_EQ(s.num_registered_blocks, 1);
  h.sched.resolve(ids_of(second), std::vector<int32_t>{43});
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{s.tokens[0], s.tokens[1], s.tokens[2], 42, 43}));
  EXPECT_EQ(s.num_pending, 0);
}

// A sequence that turns out finished when its token comes back (a stop token, say) has one
// more step in flight: that step's token is never handed to it, and its blocks are all free.
TEST(SchedulerAsync, AFinishedSequencesSpeculativeTokenIsDroppedAndItsBlocksReturn) {
  Harness h(config(8, 64, 1), 8, 4, 4);
  const uint64_t id = h.add(prompt_of(4, 1), "", 10);
  const StepPlan first = h.sched.schedule(0.0);
  h.sched.advance(first);
  const StepPlan speculative = h.sched.schedule(0.01);
  ASSERT_EQ(speculative.seqs.size(), 1u);
  h.sched.advance(speculative);
  EXPECT_EQ(h.blocks.num_used_blocks(), 2);  // position 4 took a second block
  h.sched.resolve(ids_of(first), std::vector<int32_t>{5});
  // The engine sees its stop token and ends it.
  std::unique_ptr<Sequence> done = h.sched.remove(id);
  ASSERT_NE(done, nullptr);
  EXPECT_EQ(done->num_known_tokens(), 5);
  EXPECT_EQ(h.blocks.num_free_blocks(), h.blocks.num_blocks());
  EXPECT_FALSE(h.sched.has_work());
  // The speculative step's token comes back to nobody.
  h.sched.resolve(ids_of(speculative), std::vector<int32_t>{6});
  EXPECT_EQ(h.sched.find(id), nullptr);
  EXPECT_EQ(h.blocks.num_free_blocks(), h.blocks.num_blocks());
  EXPECT_TRUE(h.sched.schedule(0.02).empty());
}

TEST(SchedulerAsync, ASequenceIsNotPlannedPastItsLength) {
  Harness h(config(8, 64, 1), 16, 4, 4);
  const uint64_t id = h.add(prompt_of(3, 1), "", 2);  // ends at 5 tokens
  const StepPlan first = h.sched.schedule(0.0);
  h.sched.advance(first);
  const StepPlan second = h.sched.schedule(0.01);
  ASSERT_EQ(second.seqs.size(), 1u);
  h.sched.advance(second);
  EXPECT_EQ(h.sched.find(id)->num_tokens(), 5);
  // Its last token is in flight: nothing more to plan for it.
  EXPECT_TRUE(h.sched.schedule(0.02).empty());
  h.sched.resolve(ids_of(first), std::vector<int32_t>{7});
  h.sched.resolve(ids_of(second), std::vector<int32_t>{8});
  EXPECT_EQ(h.sched.find(id)->num_pending, 0);
}

// The same scenario as the synchronous test, run pipelined: sequences preempted while a token of
// theirs is in flight get it when it comes back and recompute the same tokens.
TEST(SchedulerAsync, KvExhaustionPreemptsSequencesWithPendingTokens) {
  Harness h(config(8, 64, 1), 12, 4, 4);
  h.async = true;
  for (int32_t base = 1; base <= 3; ++base) h.add(prompt_of(4, base), "", 24);
  while (h.sched.has_work()) h.step();
  EXPECT_GT(h.preempted_pending, 0);
  expect_reference_tokens(h);
  EXPECT_EQ(h.blocks.num_free_blocks(), h.blocks.num_blocks());
}

struct TraceParams {
  uint64_t seed;
  int64_t seqs, budget;
  int loras, host_capacity;
  int64_t blocks, block_size;
  double drain_after;
  int load_delay;
  double evict_after;  // negative = off
  bool async = false;  // steps pipelined as with asynchronous scheduling
};

class SchedulerTrace : public ::testing::TestWithParam<TraceParams> {};

TEST_P(SchedulerTrace, InvariantsHoldAndEveryRequestGetsItsTokens) {
  const TraceParams tp = GetParam();
  SchedulerConfig c = config(tp.seqs, tp.budget, tp.loras);
  c.lora_drain_after_s = tp.drain_after;
  c.lora_evict_after_s = tp.evict_after;
  Harness h(c, tp.blocks, tp.block_size, tp.host_capacity);
  h.async = tp.async;
  h.slots.set_load_delay(tp.load_delay);
  std::mt19937_64 rng(tp.seed);
  const std::vector<std::string> adapters = {"", "", "a", "b", "c", "d", "e", "f", "broken"};
  h.slots.fail_loads("broken");
  // Shared prefixes make prefix-cache hits likely.
  std::vector<std::vector<int32_t>> prefixes;
  for (int i = 0; i < 4; ++i) prefixes.push_back(prompt_of(4 + 5 * i, 11 * i + 1));
  const int64_t capacity = tp.blocks * tp.block_size;
  std::vector<uint64_t> live;
  const int arrival_steps = 1500;
  for (int step = 0; step < arrival_steps || h.sched.has_work(); ++step) {
    ASSERT_LT(step, arrival_steps + 20000) << "the trace does not drain";
    if (step < arrival_steps) {
      const int arrivals = static_cast<int>(rng() % 4 == 0 ? rng() % 4 : 0);
      for (int a = 0; a < arrivals; ++a) {
        // Zipf-like adapter popularity.
        const size_t k =
            std::min(adapters.size() - 1,
                     static_cast<size_t>(std::pow(
                         adapters.size(), std::uniform_real_distribution<double>(0, 1)(rng))) -
                         1);
        std::vector<int32_t> prompt;
        if (rng() % 2 == 0) prompt = prefixes[rng() % prefixes.size()];
        const int64_t extra = 1 + static_cast<int64_t>(rng() % 12);
        for (int64_t i = 0; i < extra; ++i) prompt.push_back(static_cast<int32_t>(rng() % kVocab));
        int64_t max_tokens = 1 + static_cast<int64_t>(rng() % 16);
        max_tokens = std::min<int64_t>(max_tokens, capacity - static_cast<int64_t>(prompt.size()));
        if (max_tokens < 1) continue;
        live.push_back(h.add(prompt, adapters[k], max_tokens));
      }
      if (!live.empty() && rng() % 40 == 0) {
        const size_t i = rng() % live.size();
        h.abort(live[i]);
      }
      if (rng() % 50 == 0) h.slots.evict(adapters[2 + rng() % 6]);
    }
    h.step(0.003);
    if (HasFatalFailure()) return;
  }
  int64_t checked = 0;
  for (const auto& [id, e] : h.expect) {
    const bool ended = h.finished.count(id) + h.failed.count(id) + h.aborted.count(id) == 1;
    ASSERT_TRUE(ended) << "request " << id << " neither finished, failed nor was aborted";
    if (h.failed.count(id) != 0) {
      EXPECT_EQ(e.adapter, "broken");
      continue;
    }
    if (h.finished.count(id) == 0) continue;
    EXPECT_EQ(h.finished.at(id), h.model.reference(e.prompt, key_of(e.adapter), e.max_tokens))
        << "request " << id << " (adapter '" << e.adapter << "')";
    ++checked;
  }
  EXPECT_GT(checked, 300);
  EXPECT_EQ(h.blocks.num_free_blocks(), h.blocks.num_blocks());
  EXPECT_EQ(h.slots.num_pinned(), 0);
  EXPECT_GT(h.sched.prefix_hits_total(), 0);
  RecordProperty("preemptions", static_cast<int>(h.sched.preemptions_total()));
  RecordProperty("preempted_pending", static_cast<int>(h.preempted_pending));
  // What each policy did is checked on the synchronous traces, whose steps they were tuned
  // on; pipelined steps plan one step ahead, and only correctness is checked for them.
  const bool policies = !tp.async;
  if (tp.blocks <= 40 && policies) {
    EXPECT_TRUE(h.saw_preemption);
  }
  if (tp.evict_after >= 0) {
    EXPECT_FALSE(h.saw_drain) << "with eviction on nothing drains";
  } else if (tp.drain_after < 1.0 && tp.loras < 3 && policies) {
    EXPECT_TRUE(h.saw_drain);
  }
  RecordProperty("evictions", static_cast<int>(h.sched.evictions_total()));
  if (tp.evict_after < 0) {
    EXPECT_EQ(h.sched.evictions_total(), 0);
  } else if (tp.loras < 3 && policies) {
    EXPECT_TRUE(h.saw_eviction);
  }
  // No thrashing: each request causes at most one eviction for its first token; the others
  // need a wait of lora_drain_after_s each.
  const int64_t first_token_evictions =
      h.sched.evictions_total() - h.sched.long_wait_evictions_total();
  EXPECT_LE(first_token_evictions, static_cast<int64_t>(h.expect.size()));
  RecordProperty("long_wait_evictions", static_cast<int>(h.sched.long_wait_evictions_total()));
  if (tp.drain_after > 100.0) {
    EXPECT_EQ(h.sched.long_wait_evictions_total(), 0);
  } else if (tp.evict_after >= 0 && tp.drain_after < 0.1 && tp.loras < 3 && policies) {
    EXPECT_GT(h.sched.long_wait_evictions_total(), 0) << "evicted sequences take slots back";
  }
}

const TraceParams kTraces[] = {TraceParams{1, 16, 32, 2, 4, 32, 4, 0.02, 0, 0.0},
                               TraceParams{2, 6, 12, 1, 2, 24, 2, 0.0, 3, -1},
                               TraceParams{3, 32, 64, 3, 8, 256, 8, 1e9, 1, 0.01},
                               TraceParams{4, 4, 7, 2, 3, 30, 3, 0.05, 2, 0.02},
                               TraceParams{5, 64, 128, 4, 6, 12, 16, 0.01, 0, -1},
                               // Eviction alone: one slot, no drain.
                               TraceParams{6, 16, 24, 1, 3, 40, 4, 1e9, 1, 0.0},
                               TraceParams{7, 8, 16, 2, 8, 64, 4, 0.05, 0, 0.0}};

std::vector<TraceParams> async_traces() {
  std::vector<TraceParams> out(std::begin(kTraces), std::end(kTraces));
  for (TraceParams& t : out) t.async = true;
  return out;
}

std::string trace_name(const ::testing::TestParamInfo<TraceParams>& info) {
  return "seed" + std::to_string(info.param.seed) + (info.param.async ? "_async" : "");
}

INSTANTIATE_TEST_SUITE_P(Traces, SchedulerTrace, ::testing::ValuesIn(kTraces), trace_name);
// The same traces with every step planned before the previous one's tokens are known: pending
// tokens fed to decodes, preemptions and aborts of sequences whose tokens are in flight.
INSTANTIATE_TEST_SUITE_P(AsyncTraces, SchedulerTrace, ::testing::ValuesIn(async_traces()),
                         trace_name);

}  // namespace
}  // namespace loraplex::test
