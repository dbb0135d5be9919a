#include "loraplex/engine/scheduler.h"

#include <algorithm>
#include <set>

#include "loraplex/core/error.h"

namespace loraplex::engine {

Scheduler::Scheduler(SchedulerConfig config, BlockManager& blocks, AdapterSlots& slots)
    : config_(config), blocks_(blocks), slots_(slots) {
  LORAPLEX_CHECK(config_.max_num_seqs >= 1, "max_num_seqs ", config_.max_num_seqs,
                 ", expected >= 1");
  LORAPLEX_CHECK(config_.max_num_batched_tokens >= 1, "max_num_batched_tokens ",
                 config_.max_num_batched_tokens, ", expected >= 1");
  LORAPLEX_CHECK(config_.max_loras >= 1, "max_loras ", config_.max_loras, ", expected >= 1");
  LORAPLEX_CHECK(config_.max_loading_adapters >= 1, "max_loading_adapters ",
                 config_.max_loading_adapters, ", expected >= 1");
}

Scheduler::~Scheduler() = default;

void Scheduler::update_hashes(Sequence& s) {
  if (!blocks_.caching()) return;
  const size_t bs = static_cast<size_t>(blocks_.block_size());
  const size_t full = static_cast<size_t>(s.num_known_tokens()) / bs;
  while (s.block_hashes.size() < full) {
    const size_t i = s.block_hashes.size();
    const uint64_t parent = i == 0 ? 0 : s.block_hashes[i - 1];
    s.block_hashes.push_back(
        block_hash(parent, std::span<const int32_t>(s.tokens).subspan(i * bs, bs), s.adapter_key));
  }
}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  LORAPLEX_CHECK(seq != nullptr && !seq->tokens.empty(), "scheduler: a sequence needs tokens");
  LORAPLEX_CHECK(seqs_.count(seq->id) == 0, "scheduler: sequence id ", seq->id, " is in use");
  LORAPLEX_CHECK(waiting_.count(seq->order) == 0, "scheduler: arrival order ", seq->order,
                 " is in use");
  seq->status = Sequence::Status::kWaiting;
  seq->num_computed = 0;
  seq->blocks.clear();
  seq->block_hashes.clear();
  seq->num_registered_blocks = 0;
  seq->slot = -1;
  seq->waiting_since = seq->arrival_time;
  update_hashes(*seq);
  waiting_.emplace(seq->order, seq.get());
  if (!seq->adapter.empty()) ++use(seq->adapter).waiting;
  seqs_.emplace(seq->id, std::move(seq));
}

Sequence* Scheduler::find(uint64_t id) {
  const auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

void Scheduler::free_blocks(Sequence& s) {
  blocks_.free(s.blocks);
  s.blocks.clear();
  s.num_computed = 0;
  s.num_registered_blocks = 0;
}

void Scheduler::unpin_if_idle(const std::string& adapter) {
  if (adapter.empty()) return;
  AdapterUse& u = use(adapter);
  if (!u.pinned || u.running > 0) return;
  slots_.unpin(adapter);
  u.pinned = false;
  u.slot = -1;
  --num_pinned_;
  if (u.draining || u.evicting) {
    u.draining = false;
    u.evicting = false;
    // The slot is reserved only while its beneficiary still waits without one.
    const auto it = adapters_.find(u.drained_for);
    if (it != adapters_.end() && it->second.waiting > 0 && !it->second.pinned) {
      reserved_.push_back(u.drained_for);
    }
    u.drained_for.clear();
  }
}

void Scheduler::forget_if_unused(const std::string& adapter) {
  if (adapter.empty()) return;
  const auto it = adapters_.find(adapter);
  if (it == adapters_.end()) return;
  const AdapterUse& u = it->second;
  if (u.running > 0 || u.waiting > 0 || u.pinned) return;
  adapters_.erase(it);
  reserved_.erase(std::remove(reserved_.begin(), reserved_.end(), adapter), reserved_.end());
}

void Scheduler::preempt(Sequence& s, StepPlan& plan) {
  free_blocks(s);
  running_.erase(std::find(running_.begin(), running_.end(), &s));
  s.status = Sequence::Status::kWaiting;
  s.slot = -1;
  s.waiting_since = now_;
  waiting_.emplace(s.order, &s);
  if (!s.adapter.empty()) {
    AdapterUse& u = use(s.adapter);
    --u.running;
    ++u.waiting;
    unpin_if_idle(s.adapter);
  }
  ++s.num_preemptions;
  ++preemptions_;
  plan.preempted.push_back(s.id);
}

bool Scheduler::ensure_blocks(Sequence& s, int64_t end, StepPlan& plan) {
  const int64_t need = blocks_.blocks_for(end) - static_cast<int64_t>(s.blocks.size());
  if (need <= 0) return true;
  while (!blocks_.allocate(need, s.blocks)) {
    // The newest running sequence not yet scheduled in this step; `s` itself is one, so the
    // search always ends.
    Sequence* victim = nullptr;
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      if ((*it)->planned_step != step_) {
        victim = *it;
        break;
      }
    }
    LORAPLEX_CHECK(victim != nullptr, "scheduler: no sequence to preempt (internal error)");
    preempt(*victim, plan);
    if (victim == &s) return false;
  }
  return true;
}

void Scheduler::plan_seq(Sequence& s, int64_t n, StepPlan& plan, int64_t& budget) {
  ScheduledSeq q;
  q.seq = &s;
  q.start = s.num_computed;
  q.num_tokens = n;
  q.sample = s.num_computed + n == s.num_tokens();
  plan.seqs.push_back(q);
  plan.num_tokens += n;
  budget -= n;
  s.planned_step = step_;
}

StepPlan Scheduler::schedule(double now) {
  ++step_;
  now_ = now;
  StepPlan plan;
  int64_t budget = config_.max_num_batched_tokens;
  // 0. Evictions marked by the last step: their slots are reserved before anything is planned.
  drop_stale_claims();
  run_evictions(plan);

  // 1. Decodes, oldest first. Preemption removes sequences behind `i` only, or `i` itself.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& s = *running_[i];
    // A sequence at its length ends when its pending last token comes back.
    if (s.prefilling() || (s.max_num_tokens > 0 && s.num_tokens() >= s.max_num_tokens)) {
      ++i;
      continue;
    }
    if (!ensure_blocks(s, s.num_tokens(), plan)) continue;  // `s` was preempted
    plan_seq(s, s.num_tokens() - s.num_computed, plan, budget);
    ++i;
  }
  // 2. Prompts already running, in chunks.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& s = *running_[i];
    if (s.planned_step == step_ || !s.prefilling()) {
      ++i;
      continue;
    }
    const int64_t n = std::min(s.num_tokens() - s.num_computed, budget);
    if (!ensure_blocks(s, s.num_computed + n, plan)) continue;
    plan_seq(s, n, plan, budget);
    ++i;
  }
  // 3. New (and preempted) sequences, unless this step ran out of KV blocks (evictions do not
  // count: they free a slot for a waiting request to take now).
  if (plan.preempted.size() == plan.evicted.size()) admit_waiting(plan, budget, now);

  std::set<std::string> adapters;
  for (const ScheduledSeq& q : plan.seqs)
    if (!q.seq->adapter.empty()) adapters.insert(q.seq->adapter);
  plan.num_adapters = static_cast<int>(adapters.size());
  return plan;
}

void Scheduler::drop_stale_claims() {
  cancel_stale_drains();
  // Reservations whose beneficiary got a slot, stopped waiting or left host memory (it must
  // load again, behind older adapters) are void.
  reserved_.erase(std::remove_if(reserved_.begin(), reserved_.end(),
                                 [&](const std::string& a) { return !still_waits_ready(a); }),
                  reserved_.end());
}

void Scheduler::AdmissionPass::note_starving(Starving& st, Sequence& seq) {
  if (st.longest == nullptr || seq.waiting_since < st.longest->waiting_since) st.longest = &seq;
  st.since = std::min(st.since, seq.waiting_since);
  if (st.first_token == nullptr && seq.num_preemptions == 0 && !seq.caused_eviction) {
    st.first_token = &seq;
  }
}

void Scheduler::admit_waiting(StepPlan& plan, int64_t& budget, double now) {
  AdmissionPass pass;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (static_cast<int64_t>(running_.size()) >= config_.max_num_seqs || budget <= 0) break;
    Sequence& s = *it->second;
    const AdapterAdmission adapter = admit_adapter(s, plan, pass);
    if (!adapter.admit) {
      ++it;
      continue;
    }
    const int64_t hit_tokens = take_prefix_hits(s);
    const int64_t n = std::min(s.num_tokens() - s.num_computed, budget);
    const int64_t need =
        blocks_.blocks_for(s.num_computed + n) - static_cast<int64_t>(s.blocks.size());
    if (!blocks_.allocate(std::max<int64_t>(need, 0), s.blocks)) {
      free_blocks(s);
      if (adapter.newly_pinned) unpin_if_idle(s.adapter);
      if (adapter.used_reservation) reserved_.push_back(s.adapter);
      plan.stopped_for_blocks = true;
      break;  // first come, first served: nothing younger takes the blocks it waits for
    }
    if (blocks_.caching()) {
      prefix_queries_ += s.num_tokens();
      prefix_hits_ += hit_tokens;
    }
    if (s.prompt_cached_tokens < 0)
      s.prompt_cached_tokens = std::min(hit_tokens, s.num_prompt_tokens);
    it = waiting_.erase(it);
    start_running(s);
    plan_seq(s, n, plan, budget);
  }
  fail_waiting_of(pass.failed, plan);
  plan_slot_claims(pass.starving, now);
}

Scheduler::AdapterAdmission Scheduler::admit_adapter(Sequence& s, StepPlan& plan,
                                                     AdmissionPass& pass) {
  AdapterAdmission out;
  if (s.adapter.empty()) {
    out.admit = true;
    return out;
  }
  // Every reason below holds for the adapter's later requests too, for the rest of this pass:
  // they are skipped at once.
  if (pass.skip.count(s.adapter) != 0) {
    const auto st = pass.starving_index.find(s.adapter);
    if (st != pass.starving_index.end()) AdmissionPass::note_starving(pass.starving[st->second], s);
    return out;
  }
  const auto skip_adapter = [&] {
    pass.skip.insert(s.adapter);
    return AdapterAdmission{};
  };
  const AdapterUse& u = use(s.adapter);
  if (u.pinned) {
    if (u.draining) {
      plan.held_back.push_back(s.adapter);
      return skip_adapter();
    }
    out.admit = true;
    return out;
  }
  if (!adapter_loaded(s, pass) || !pin_free_slot(s, pass, out)) return skip_adapter();
  out.admit = true;
  return out;
}

bool Scheduler::adapter_loaded(const Sequence& s, AdmissionPass& pass) {
  if (pass.engaged.count(s.adapter) == 0 &&
      static_cast<int>(pass.engaged.size()) < config_.max_loading_adapters) {
    pass.engaged.insert(s.adapter);
  }
  if (slots_.ready(s.adapter)) return true;
  if (pass.engaged.count(s.adapter) == 0) return false;
  std::string error;
  const AdapterSlots::LoadState st = slots_.load(s.adapter, error);
  if (st == AdapterSlots::LoadState::kFailed) pass.failed.emplace(s.adapter, error);
  return st == AdapterSlots::LoadState::kReady && slots_.ready(s.adapter);
}

bool Scheduler::pin_free_slot(Sequence& s, AdmissionPass& pass, AdapterAdmission& out) {
  const auto mine = std::find(reserved_.begin(), reserved_.end(), s.adapter);
  const int64_t free_slots = config_.max_loras - num_pinned_ -
                             static_cast<int64_t>(reserved_.size()) +
                             (mine != reserved_.end() ? 1 : 0);
  if (free_slots <= 0) {
    pass.starving_index.emplace(s.adapter, pass.starving.size());
    pass.starving.push_back({s.adapter, s.waiting_since, nullptr});
    AdmissionPass::note_starving(pass.starving.back(), s);
    return false;
  }
  const int slot = slots_.pin(s.adapter);
  if (slot < 0) return false;
  if (mine != reserved_.end()) {
    reserved_.erase(mine);
    out.used_reservation = true;
  }
  AdapterUse& u = use(s.adapter);
  u.pinned = true;
  u.slot = slot;
  ++num_pinned_;
  out.newly_pinned = true;
  cancel_drains_for(s.adapter);
  return true;
}

int64_t Scheduler::take_prefix_hits(Sequence& s) {
  if (s.num_computed != 0 || !blocks_.caching()) return 0;
  const int64_t bs = blocks_.block_size();
  const size_t max_hit = static_cast<size_t>((s.num_tokens() - 1) / bs);
  const std::span<const uint64_t> hashes =
      std::span<const uint64_t>(s.block_hashes).first(std::min(max_hit, s.block_hashes.size()));
  s.blocks = blocks_.lookup(hashes, s.tokens, s.adapter_key);
  const int64_t hit_tokens = static_cast<int64_t>(s.blocks.size()) * bs;
  s.num_computed = hit_tokens;
  s.num_registered_blocks = static_cast<int64_t>(s.blocks.size());
  return hit_tokens;
}

void Scheduler::start_running(Sequence& s) {
  running_.push_back(&s);
  s.status = Sequence::Status::kRunning;
  if (s.adapter.empty()) return;
  AdapterUse& u = use(s.adapter);
  --u.waiting;
  ++u.running;
  u.last_admitted = step_;
  s.slot = u.slot;
}

void Scheduler::fail_waiting_of(const std::map<std::string, std::string>& failed, StepPlan& plan) {
  for (const auto& [adapter, error] : failed) {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (it->second->adapter != adapter) {
        ++it;
        continue;
      }
      const uint64_t id = it->second->id;
      ++it;
      plan.failed.push_back(remove(id));
      plan.failed_errors.push_back(error);
    }
  }
}

void Scheduler::cancel_drains_for(const std::string& beneficiary) {
  for (auto& [name, u] : adapters_) {
    if ((u.draining || u.evicting) && u.drained_for == beneficiary) {
      u.draining = false;
      u.evicting = false;
      u.drained_for.clear();
    }
  }
}

bool Scheduler::still_waits_ready(const std::string& adapter) {
  const auto it = adapters_.find(adapter);
  return it != adapters_.end() && !it->second.pinned && it->second.waiting > 0 &&
         slots_.ready(adapter);
}

void Scheduler::cancel_stale_drains() {
  for (auto& [name, u] : adapters_) {
    if (u.draining && !still_waits_ready(u.drained_for)) {
      u.draining = false;
      u.drained_for.clear();
    }
  }
}

void Scheduler::plan_slot_claims(const std::vector<Starving>& starving, double now) {
  std::set<std::string> beneficiaries(reserved_.begin(), reserved_.end());
  for (const auto& [name, u] : adapters_)
    if (u.draining || u.evicting) beneficiaries.insert(u.drained_for);
  if (config_.lora_evict_after_s >= 0.0) {
    // With eviction, an adapter that has waited lora_drain_after_s gets its slot by eviction
    // too: a drain would hold back the victim's new requests, and those made the
    // time-to-first-token tail.
    plan_evictions(starving, now, beneficiaries);
    return;
  }
  for (const Starving& st : starving) {
    if (config_.lora_drain_after_s < 0.0 || now - st.since < config_.lora_drain_after_s) continue;
    if (beneficiaries.count(st.adapter) != 0) continue;
    AdapterUse* victim = nullptr;
    for (auto& [name, u] : adapters_) {
      if (!u.pinned || u.draining || u.evicting || u.running == 0) continue;
      if (victim == nullptr || u.running < victim->running) victim = &u;
    }
    if (victim == nullptr) return;  // every resident adapter already drains
    victim->draining = true;
    victim->drained_for = st.adapter;
    beneficiaries.insert(st.adapter);
  }
}

void Scheduler::plan_evictions(const std::vector<Starving>& starving, double now,
                               std::set<std::string>& beneficiaries) {
  // Adapters with a running sequence that has not produced a token yet: never evicted.
  std::set<std::string> protected_adapters;
  bool scanned = false;
  for (const Starving& st : starving) {
    if (beneficiaries.count(st.adapter) != 0) continue;
    // A request awaiting its first token that has waited lora_evict_after_s (once per
    // request), else the adapter's longest waiting request once it has waited
    // lora_drain_after_s (once per wait: an evicted sequence that waits again may evict again).
    Sequence* s = st.first_token;
    bool long_wait = false;
    if (s == nullptr || now - s->waiting_since < config_.lora_evict_after_s) {
      s = st.longest;
      long_wait = true;
      if (s == nullptr || config_.lora_drain_after_s < 0.0 ||
          now - s->waiting_since < config_.lora_drain_after_s ||
          s->escalated_wait == s->waiting_since) {
        continue;
      }
    }
    if (!scanned) {
      for (const Sequence* r : running_)
        if (!r->adapter.empty() && r->num_tokens() == r->num_prompt_tokens)
          protected_adapters.insert(r->adapter);
      scanned = true;
    }
    AdapterUse* victim = nullptr;
    for (auto& [name, u] : adapters_) {
      if (!u.pinned || u.draining || u.evicting || u.running == 0) continue;
      if (protected_adapters.count(name) != 0) continue;
      // Fewest running sequences (least work to recompute), then least recently given one;
      // the map's name order settles the rest.
      if (victim == nullptr || u.running < victim->running ||
          (u.running == victim->running && u.last_admitted < victim->last_admitted)) {
        victim = &u;
      }
    }
    if (victim == nullptr) return;  // no resident adapter may be evicted now
    victim->evicting = true;
    victim->long_wait = long_wait;
    victim->drained_for = st.adapter;
    victim->evicted_for_seq = s->id;
    if (long_wait) {
      s->escalated_wait = s->waiting_since;
    } else {
      s->caused_eviction = true;
    }
    beneficiaries.insert(st.adapter);
  }
}

void Scheduler::run_evictions(StepPlan& plan) {
  // Slots freed since the evictions were marked serve first: evicting anyway could only hand
  // a free slot back to the evicted adapter's own sequences.
  int64_t free_slots = config_.max_loras - num_pinned_ - static_cast<int64_t>(reserved_.size());
  for (auto& [name, u] : adapters_) {
    if (!u.evicting) continue;
    // Or the waiting adapter got a slot, left or fell out of host memory: nothing to evict for.
    bool cancel = !u.pinned || !still_waits_ready(u.drained_for);
    if (!cancel && free_slots > 0) {
      --free_slots;
      cancel = true;
    }
    if (cancel) {
      u.evicting = false;
      u.drained_for.clear();
      // Its request may cause an eviction again.
      if (Sequence* s = find(u.evicted_for_seq); s != nullptr) {
        s->caused_eviction = false;
        s->escalated_wait = -1.0;
      }
      continue;
    }
    std::vector<Sequence*> victims;
    for (Sequence* s : running_)
      if (s->adapter == name) victims.push_back(s);
    // preempt() unpins the adapter with its last sequence and reserves the slot.
    for (Sequence* s : victims) {
      preempt(*s, plan);
      plan.evicted.push_back(s->id);
    }
    ++evictions_;
    if (u.long_wait) ++long_wait_evictions_;
  }
}

void Scheduler::complete(const StepPlan& plan, const std::vector<int32_t>& sampled) {
  std::vector<uint64_t> ids;
  for (const ScheduledSeq& q : plan.seqs)
    if (q.sample) ids.push_back(q.seq->id);
  LORAPLEX_CHECK(ids.size() == sampled.size(), "scheduler: ", sampled.size(),
                 " sampled tokens for ", ids.size(), " sampling sequences");
  advance(plan);
  resolve(ids, sampled);
}

void Scheduler::advance(const StepPlan& plan) {
  for (const ScheduledSeq& q : plan.seqs) {
    Sequence& s = *q.seq;
    LORAPLEX_CHECK(s.num_computed == q.start, "scheduler: sequence ", s.id, " completed at ",
                   q.start, " but has ", s.num_computed, " computed tokens (internal error)");
    s.num_computed += q.num_tokens;
    if (q.sample) {
      s.tokens.push_back(kPendingToken);
      ++s.num_pending;
    }
    register_blocks(s);
  }
}

void Scheduler::resolve(std::span<const uint64_t> ids, std::span<const int32_t> sampled) {
  LORAPLEX_CHECK(ids.size() == sampled.size(), "scheduler: ", sampled.size(),
                 " sampled tokens for ", ids.size(), " sequences");
  for (size_t i = 0; i < ids.size(); ++i) {
    Sequence* s = find(ids[i]);
    if (s == nullptr) continue;
    LORAPLEX_CHECK(s->num_pending > 0, "scheduler: sequence ", s->id,
                   " has no pending token for its sampled id (internal error)");
    s->tokens[static_cast<size_t>(s->num_known_tokens())] = sampled[i];
    --s->num_pending;
    update_hashes(*s);
    register_blocks(*s);
  }
}

void Scheduler::register_blocks(Sequence& s) {
  if (!blocks_.caching()) return;
  const int64_t bs = blocks_.block_size();
  const int64_t ready = std::min(s.num_computed, s.num_known_tokens());
  while (s.num_registered_blocks < static_cast<int64_t>(s.blocks.size()) &&
         (s.num_registered_blocks + 1) * bs <= ready) {
    const size_t i = static_cast<size_t>(s.num_registered_blocks);
    blocks_.cache_block(s.blocks[i], s.block_hashes[i], i == 0 ? 0 : s.block_hashes[i - 1],
                        std::span<const int32_t>(s.tokens).subspan(i * static_cast<size_t>(bs),
                                                                   static_cast<size_t>(bs)),
                        s.adapter_key);
    ++s.num_registered_blocks;
  }
}

std::unique_ptr<Sequence> Scheduler::remove(uint64_t id) {
  const auto found = seqs_.find(id);
  if (found == seqs_.end()) return nullptr;
  std::unique_ptr<Sequence> s = std::move(found->second);
  seqs_.erase(found);
  if (s->status == Sequence::Status::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), s.get()));
    free_blocks(*s);
    if (!s->adapter.empty()) {
      --use(s->adapter).running;
      unpin_if_idle(s->adapter);
    }
  } else {
    waiting_.erase(s->order);
    if (!s->adapter.empty()) --use(s->adapter).waiting;
  }
  forget_if_unused(s->adapter);
  return s;
}

std::vector<std::string> Scheduler::running_adapters() const {
  std::vector<std::string> out;
  for (const auto& [name, u] : adapters_)
    if (u.running > 0) out.push_back(name);
  return out;
}

std::vector<std::string> Scheduler::waiting_adapters() const {
  std::vector<std::string> out;
  for (const auto& [name, u] : adapters_)
    if (u.waiting > 0) out.push_back(name);
  return out;
}

std::vector<std::string> Scheduler::draining_adapters() const {
  std::vector<std::string> out;
  for (const auto& [name, u] : adapters_)
    if (u.draining) out.push_back(name);
  return out;
}

std::vector<std::string> Scheduler::evicting_adapters() const {
  std::vector<std::string> out;
  for (const auto& [name, u] : adapters_)
    if (u.evicting) out.push_back(name);
  return out;
}

}  // namespace loraplex::engine
