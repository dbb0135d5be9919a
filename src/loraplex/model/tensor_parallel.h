#pragma once
// A model sharded over a tensor-parallel group: one Decoder per rank, each on a thread of its
// own (on CUDA with its GPU current and its own streams), every rank running the same
// StepBatch in lockstep, tied together by the collectives inside its layers (NCCL between GPUs
// of this process, InProcessCommunicator between CPU threads).
//
// Why a thread per rank and not one driver thread enqueuing for every GPU: each rank's step
// already is a complete single-device program (host planning, PagedAttention's plan, graph
// capture and replay, MoE routing that waits for the device), so the ranks reuse Decoder
// unchanged and their host work runs in parallel instead of N times over on one thread; and a
// rank that blocks on its device (MoE routing, the end of a step) cannot hold up the host work
// of the others, which would deadlock the collectives it waits for.
//
// Sampling: every rank has the full logits after the lm_head's all-gather and samples them
// itself with the same uniforms; the ids agree bit for bit (checked every step) and rank 0's
// are returned. Sampling on rank 0 and broadcasting would add a collective to every step for
// nothing: the ids are needed on the devices only as the next step's fed tokens
// (SequenceStep::feed_row), and every rank has them already.
//
// Asynchronous steps: launch() has every rank stage and enqueue the step and returns once all
// have (on CUDA without waiting for the devices); collect() has every rank wait for its ids.
// The driver's thread is free in between, to plan the next step.
//
// Failure: the batch is checked once on the host before any rank starts. A rank that throws
// during a step (a CUDA error, a failed GPU), an asynchronous NCCL error, or a step still
// running after options.step_timeout_s aborts every communicator (NCCL kernels waiting for a
// peer return), and the group is stopped: that call and every later one throw an error naming
// the rank, its device and what happened.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/model/decoder.h"
#include "loraplex/model/executor.h"

namespace loraplex::model {

class TensorParallelDecoder final : public ModelExecutor {
 public:
  /// Builds one rank: called on that rank's thread (its CUDA device current) with the rank's
  /// options (device, comm), e.g. Decoder::load(dir, rank_options).
  using RankFactory = std::function<std::unique_ptr<Decoder>(const DecoderOptions& rank_options)>;

  /// options.tensor_parallel_size ranks: on CUDA rank r runs on cuda:(options.device.index + r)
  /// with an NCCL communicator; on the CPU each rank is a thread, with an
  /// InProcessCommunicator. Throws naming the value when there are fewer GPUs than ranks or the
  /// model's shapes cannot be split (check_shard_layout).
  static std::unique_ptr<TensorParallelDecoder> create(const ModelConfig& config,
                                                       const DecoderOptions& options,
                                                       const RankFactory& make_rank);
  /// The same over communicators made by the caller (rank order, one per rank, on the ranks'
  /// devices), which must outlive the decoder.
  static std::unique_ptr<TensorParallelDecoder> create(const ModelConfig& config,
                                                       const DecoderOptions& options,
                                                       const RankFactory& make_rank,
                                                       const std::vector<Communicator*>& comms);
  ~TensorParallelDecoder() override;
  TensorParallelDecoder(const TensorParallelDecoder&) = delete;
  TensorParallelDecoder& operator=(const TensorParallelDecoder&) = delete;

  const ModelConfig& config() const override { return config_; }
  const DecoderOptions& options() const override { return options_; }
  void allocate_kv_cache(int64_t num_blocks) override;
  int64_t kv_block_bytes() const override;
  void launch(const StepBatch& batch) override;
  StepResult collect() override;
  const StepStats& last_step() const override { return last_step_; }
  const LoraTargetRegistry& targets() const override { return targets_; }
  std::vector<Device> devices() const override;
  std::vector<Stream> streams() const override;

  /// Rank r's replica (tests; do not run it outside the group's calls).
  Decoder& rank(int r);
  /// Why the group stopped, or "" while it runs.
  std::string failure() const;

 private:
  struct Group;
  TensorParallelDecoder() = default;
  static std::unique_ptr<TensorParallelDecoder> build(
      const ModelConfig& config, const DecoderOptions& options, const RankFactory& make_rank,
      const std::vector<Communicator*>& comms, std::vector<std::unique_ptr<Communicator>> owned);
  // Starts the rank threads and loads every rank.
  void start(const RankFactory& make_rank);
  void build_targets();

  ModelConfig config_;
  DecoderOptions options_;
  std::shared_ptr<Group> group_;
  LoraTargetRegistry targets_;
  StepStats last_step_;
};

}  // namespace loraplex::model
