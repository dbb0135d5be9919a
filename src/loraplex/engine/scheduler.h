#pragma once
// The engine's scheduler: which sequences run in the next step and how many of their tokens.
// Pure logic over sequence states, the BlockManager and an AdapterSlots interface (the adapter
// manager in the engine, a fake in tests); it never touches the model.
//
// Per step:
//  1. Running sequences that decode (one token each), oldest admitted first, then running
//     sequences still in their prompt (chunked prefill), while the token budget
//     (max_num_batched_tokens) lasts. A sequence that needs a KV block when none is free
//     preempts the newest running sequence not yet scheduled in this step (possibly itself): its
//     blocks are freed and it goes back to the waiting queue, to be recomputed later as prompt +
//     generated tokens (the prefix cache usually still holds most of it).
//  2. Waiting sequences in arrival order (preempted ones keep their place, so they come first),
//     unless this step preempted: while fewer than max_num_seqs run and budget remains, each takes
//     its prefix-cache hits and a chunk of up to the remaining budget. A waiting sequence needs
//     its adapter in a slot: an adapter that already has one is used as is; otherwise a free slot
//     is taken when the adapter is in host memory (AdapterSlots::ready); an adapter that is not is
//     loaded in the background (AdapterSlots::load; at most max_loading_adapters of the oldest
//     waiting adapters at a time) and its requests wait while the others go ahead. The first such
//     request in arrival order belongs to the adapter whose oldest request has waited longest, so
//     free slots go to adapters in that order.
//  3. Fairness: slots only free when an adapter's last running sequence ends, so under skewed
//     traffic busy adapters could hold every slot for ever. When an adapter that is in host
//     memory has waited for a slot longer than lora_drain_after_s (its longest waiting
//     request's wait; negative = never), a slot is freed for it: by eviction (4) when eviction
//     is on, else by draining the resident adapter with the fewest running sequences: its
//     waiting requests are held back until its running ones finish, and its slot is then
//     reserved for the waiting adapter. One drain per waiting adapter, oldest first. Requests
//     of resident adapters that are not draining are never held back by adapters that wait.
//     With eviction on there is no drain: the requests a drain holds back made the
//     time-to-first-token tail (docs/engine.md has the measurements).
//  4. Slot eviction (lora_evict_after_s; negative = off). When an adapter in host memory
//     without a slot has a request that awaits its first token (never run, never preempted,
//     never the cause of an eviction) and has waited lora_evict_after_s, or a request that has
//     waited lora_drain_after_s (once per wait: an evicted sequence that waits again may evict
//     again), and no reservation or eviction already serves the adapter, a resident adapter is
//     evicted for it: one that is not already evicting and whose running sequences have all
//     produced a token (a request's first token is never put off by another's), the one with
//     the fewest running sequences, then the one least recently given a new sequence, then by
//     name. The eviction is only marked in this step (its sequences are already planned); at
//     the start of the next step its running sequences are preempted as under KV shortage
//     (blocks freed to the prefix cache, recomputed later) and its slot is reserved for the
//     waiting adapter, which is admitted in that same step: eviction preemptions do not stop
//     admission. Evictions never outnumber waits (a request's arrival and each preemption
//     start one).
//  A preempted sequence's wait counts from its preemption (Sequence::waiting_since), so a
//  sequence just evicted does not at once take back the slot it gave up.
//
// Asynchronous steps: advance() records a launched step before its ids are known (each
// sampling sequence gets a pending token, kPendingToken, which its next decode runs as a token
// fed on the device), and resolve() puts in the ids when they come back; complete() is both at
// once. A pending token is never hashed for the prefix cache, and a sequence whose pending
// token is its last by length (Sequence::max_num_tokens) is not planned again.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "loraplex/engine/block_manager.h"

namespace loraplex::engine {

/// The adapter side of scheduling. Called only from the scheduling thread.
class AdapterSlots {
 public:
  enum class LoadState { kReady, kLoading, kFailed };
  virtual ~AdapterSlots() = default;
  /// Whether pin(name) would return at once (the adapter is in a slot or in host memory).
  virtual bool ready(const std::string& name) = 0;
  /// Makes the adapter ready in the background (a no-op while it is loading); kFailed, with
  /// `error` set, when that failed.
  virtual LoadState load(const std::string& name, std::string& error) = 0;
  /// Puts a ready adapter in a free slot and pins it; the slot, or -1 when it is no longer
  /// ready (the caller retries after load()). Called only when a slot is free.
  virtual int pin(const std::string& name) = 0;
  /// Unpins; the slot may be reused from the next pin on.
  virtual void unpin(const std::string& name) = 0;
};

struct SchedulerConfig {
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 8192;
  int max_loras = 4;
  /// Seconds an adapter in host memory waits for a slot before a resident one is evicted for it
  /// (eviction on) or drained (eviction off); negative = never.
  double lora_drain_after_s = 1.0;
  /// Seconds a request awaiting its first token waits for a slot before a resident adapter is
  /// evicted for it (policy 4 above); negative = never.
  double lora_evict_after_s = 0.02;
  /// Adapters without a slot that may be brought into host memory at a time (the oldest
  /// waiting first): more would evict each other from a host cache that has room for this many
  /// beyond the slots' adapters, and none would ever get in.
  int max_loading_adapters = 1;
};

/// The value of a token sampled by a launched step whose id has not come back yet.
inline constexpr int32_t kPendingToken = -1;

/// One request as the scheduler sees it. Created by the caller, owned by the scheduler.
struct Sequence {
  uint64_t id = 0;
  uint64_t order = 0;           // arrival order (smaller = earlier); kept across preemption
  double arrival_time = 0.0;    // seconds, on the clock passed to schedule()
  std::string adapter;          // "" = the base model
  uint64_t adapter_key = 0;     // names the adapter's weights in the prefix cache (0 = base)
  std::vector<int32_t> tokens;  // prompt, then generated tokens (the last num_pending pending)
  int64_t num_prompt_tokens = 0;
  /// The sequence ends by length once it holds this many tokens (0 = no such limit): it is
  /// not planned past it, even while its last token is pending.
  int64_t max_num_tokens = 0;

  // Scheduler state.
  enum class Status { kWaiting, kRunning };
  Status status = Status::kWaiting;
  int64_t num_computed = 0;            // positions whose K/V are in the cache
  std::vector<int32_t> blocks;         // KV blocks in position order
  std::vector<uint64_t> block_hashes;  // of every full block of `tokens`
  int64_t num_registered_blocks = 0;   // blocks offered to the prefix cache
  int slot = -1;                       // while running with an adapter
  int64_t num_preemptions = 0;
  double waiting_since = 0.0;         // arrival, or the last preemption
  bool caused_eviction = false;       // an eviction was made for it (at most one per request)
  double escalated_wait = -1.0;       // the waiting_since of the wait a long-wait eviction served
  int64_t prompt_cached_tokens = -1;  // prefix-cache hits of the first admission; -1 = not yet
  uint64_t planned_step = 0;          // the last step that scheduled it
  int64_t num_pending = 0;            // tokens sampled by launched steps, ids not yet known

  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  /// Tokens whose ids the host knows: all but the pending ones at the end.
  int64_t num_known_tokens() const { return num_tokens() - num_pending; }
  bool prefilling() const { return num_computed + 1 < num_tokens(); }
};

/// A sequence's part in a step: tokens[start, start + num_tokens).
struct ScheduledSeq {
  Sequence* seq = nullptr;
  int64_t start = 0;
  int64_t num_tokens = 0;
  bool sample = false;  // the chunk ends at the last token: sample the next one
};

struct StepPlan {
  std::vector<ScheduledSeq> seqs;  // decodes first, then prefill chunks
  int64_t num_tokens = 0;
  int num_adapters = 0;             // distinct adapters among seqs
  std::vector<uint64_t> preempted;  // ids preempted while planning this step
  std::vector<uint64_t> evicted;    // of `preempted`, those an eviction preempted (they come first)
  std::vector<std::unique_ptr<Sequence>> failed;  // removed: their adapter failed to load
  std::vector<std::string> failed_errors;         // same order as failed
  bool stopped_for_blocks = false;     // admission stopped: the next waiting one found no KV blocks
  std::vector<std::string> held_back;  // adapters whose waiting requests a drain held back
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  /// `blocks` and `slots` must outlive the scheduler.
  Scheduler(SchedulerConfig config, BlockManager& blocks, AdapterSlots& slots);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  const SchedulerConfig& config() const { return config_; }

  /// Queues a new sequence (tokens = its prompt, at least one). Its id must be new.
  void add(std::unique_ptr<Sequence> seq);
  /// Plans the next step at time `now` (seconds).
  StepPlan schedule(double now);
  /// Records that `plan` ran: each sequence's chunk is now in the KV cache and every sampling
  /// sequence gets its token (`sampled`, in the order of the sampling entries of plan.seqs);
  /// full blocks are offered to the prefix cache. advance() then resolve().
  void complete(const StepPlan& plan, const std::vector<int32_t>& sampled);
  /// Records that `plan` was launched, before its ids are known: each chunk counts as computed
  /// and every sampling sequence gets a pending token. Call before the next schedule().
  void advance(const StepPlan& plan);
  /// The ids of a launched step: `sampled[i]` replaces the oldest pending token of sequence
  /// `ids[i]`; ids removed since (finished, aborted) are skipped. Full blocks whose tokens are
  /// now all known are offered to the prefix cache.
  void resolve(std::span<const uint64_t> ids, std::span<const int32_t> sampled);
  /// Removes a sequence (finished or aborted), freeing its blocks and its adapter pin; null when
  /// the id is unknown.
  std::unique_ptr<Sequence> remove(uint64_t id);

  Sequence* find(uint64_t id);
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  /// Adapters with running sequences, and with waiting ones (sorted, no base model).
  std::vector<std::string> running_adapters() const;
  std::vector<std::string> waiting_adapters() const;
  /// Adapters pinned in slots (each has running sequences); never more than max_loras.
  int num_pinned_adapters() const { return num_pinned_; }
  /// Adapters currently drained for a waiting one, and slots reserved after a drain.
  std::vector<std::string> draining_adapters() const;
  /// Adapters marked for eviction by the last schedule(), evicted by the next one.
  std::vector<std::string> evicting_adapters() const;

  /// Sequences preempted, by KV shortage or by eviction.
  int64_t preemptions_total() const { return preemptions_; }
  /// Adapters evicted from their slot for a request awaiting its first token.
  int64_t evictions_total() const { return evictions_; }
  /// Of those, the evictions made for a wait of lora_drain_after_s (the others are for first
  /// tokens, at most one per request).
  int64_t long_wait_evictions_total() const { return long_wait_evictions_; }
  int64_t prefix_queries_total() const { return prefix_queries_; }  // tokens looked up
  int64_t prefix_hits_total() const { return prefix_hits_; }        // tokens found

 private:
  struct AdapterUse {
    int64_t running = 0;
    int64_t waiting = 0;
    bool pinned = false;
    int slot = -1;
    bool draining = false;
    bool evicting = false;         // marked for eviction; evicted at the start of the next step
    std::string drained_for;       // the waiting adapter a drain or eviction frees the slot for
    uint64_t last_admitted = 0;    // the step that last admitted one of its sequences
    uint64_t evicted_for_seq = 0;  // while evicting: the request the eviction is made for
    bool long_wait = false;        // while evicting: made for a wait of lora_drain_after_s
  };
  // An adapter in host memory that found no free slot during admission.
  struct Starving {
    std::string adapter;
    double since = 0.0;               // its longest waiting request's waiting_since
    Sequence* first_token = nullptr;  // its oldest request that may cause an eviction
    Sequence* longest = nullptr;      // its longest waiting request
  };

  bool ensure_blocks(Sequence& seq, int64_t end, StepPlan& plan);
  void plan_seq(Sequence& seq, int64_t num_tokens, StepPlan& plan, int64_t& budget);
  void preempt(Sequence& seq, StepPlan& plan);
  void free_blocks(Sequence& seq);
  void unpin_if_idle(const std::string& adapter);
  void update_hashes(Sequence& seq);
  // Offers the sequence's full blocks that are computed and whose tokens are known.
  void register_blocks(Sequence& seq);
  // One admission pass over the waiting queue, in arrival order, under the step's budget.
  void admit_waiting(StepPlan& plan, int64_t& budget, double now);
  // What one admission pass learns about adapters, for the rest of the pass.
  struct AdmissionPass {
    std::set<std::string> skip;     // adapters whose requests wait this step
    std::set<std::string> engaged;  // adapters without a slot that may load, oldest first
    std::map<std::string, std::string> failed;     // adapter -> error
    std::vector<Starving> starving;                // in host memory, no slot; age order
    std::map<std::string, size_t> starving_index;  // adapter -> its entry in `starving`
    // Counts `seq` among the requests of the starving adapter `st`.
    static void note_starving(Starving& st, Sequence& seq);
  };
  // What admission decided for a waiting sequence's adapter.
  struct AdapterAdmission {
    bool admit = false;             // false: the sequence (and its adapter's others) waits
    bool newly_pinned = false;      // this pass pinned the adapter's slot
    bool used_reservation = false;  // ... taking the slot a drain reserved for it
  };
  // The adapter step of admission: no adapter, a pinned slot, or a slot pinned now once the
  // adapter is in host memory and a slot is free.
  AdapterAdmission admit_adapter(Sequence& seq, StepPlan& plan, AdmissionPass& pass);
  // Whether an adapter without a slot is in host memory (starting its load while it may).
  bool adapter_loaded(const Sequence& seq, AdmissionPass& pass);
  // Pins a free slot for the sequence's adapter (false: none free, and it starves; or no pin).
  bool pin_free_slot(Sequence& seq, AdmissionPass& pass, AdapterAdmission& out);
  // Blocks of a new sequence found in the prefix cache (whole blocks, never the last token):
  // taken as computed; returns their tokens.
  int64_t take_prefix_hits(Sequence& seq);
  // Moves an admitted sequence (already out of waiting_) to the running set.
  void start_running(Sequence& seq);
  // Ends the waiting requests of adapters that failed to load.
  void fail_waiting_of(const std::map<std::string, std::string>& failed, StepPlan& plan);
  // Drains (eviction off) or evictions (on) for the adapters that found no free slot.
  void plan_slot_claims(const std::vector<Starving>& starving, double now);
  void plan_evictions(const std::vector<Starving>& starving, double now,
                      std::set<std::string>& beneficiaries);
  void run_evictions(StepPlan& plan);
  void cancel_drains_for(const std::string& beneficiary);
  void cancel_stale_drains();
  // Cancels drains and reservations for adapters that no longer wait for a slot in host memory.
  void drop_stale_claims();
  // Waits for a slot (no pin, requests waiting) while in host memory.
  bool still_waits_ready(const std::string& adapter);
  AdapterUse& use(const std::string& adapter) { return adapters_[adapter]; }
  void forget_if_unused(const std::string& adapter);

  SchedulerConfig config_;
  BlockManager& blocks_;
  AdapterSlots& slots_;
  std::unordered_map<uint64_t, std::unique_ptr<Sequence>> seqs_;
  std::vector<Sequence*> running_;              // admission order
  std::map<uint64_t, Sequence*> waiting_;       // by arrival order
  std::map<std::string, AdapterUse> adapters_;  // adapters with requests ("" excluded)
  std::vector<std::string> reserved_;           // slots freed by drains, for these adapters
  int num_pinned_ = 0;
  uint64_t step_ = 0;
  double now_ = 0.0;  // the time passed to the schedule() in progress
  int64_t preemptions_ = 0;
  int64_t evictions_ = 0;
  int64_t long_wait_evictions_ = 0;
  int64_t prefix_queries_ = 0;
  int64_t prefix_hits_ = 0;
};

}  // namespace loraplex::engine
