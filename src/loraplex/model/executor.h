#pragma once
// What runs a model's steps, as the engine and the benchmarks see it: one Decoder on one device
// (decoder.h), or a tensor-parallel group of Decoders, one per GPU (or per CPU thread), driven
// in lockstep (tensor_parallel.h). load_model.h picks one from DecoderOptions.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loraplex/adapters/lora_targets.h"
#include "loraplex/core/device.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/stream.h"
#include "loraplex/model/config.h"
#include "loraplex/model/step_batch.h"

namespace loraplex {
class Communicator;
}  // namespace loraplex

namespace loraplex::model {

/// How decode-sized steps run the LoRA of the projections:
///   kFused: the shrink as extra rows of each base GEMM (LoraLinear::forward_fused) and the expand
///           inside the op that consumes the projection: no LoRA launches of their own;
///   kOverlap: each projection's LoRA kernels on a second stream beside its GEMM (one GPU);
///   kKernels: each projection's LoRA kernels after its GEMM, in stream order;
///   kAuto: kOverlap for steps of up to kAutoOverlapTokens tokens where it exists, else kFused.
/// Which wins at which size is measured in BENCHMARKS.md and explained in docs/model.md
/// ("How a decode step runs its LoRA").
enum class LoraDecode { kAuto, kFused, kOverlap, kKernels };
inline constexpr int64_t kAutoOverlapTokens = 16;

struct DecoderOptions {
  DType dtype = DType::kF32;  // activations, weights on the device, KV cache, LoRA
  /// The device, or the first of a tensor-parallel group's (rank r runs on cuda:(index + r)).
  Device device = Device::cpu();
  int max_loras = 1;
  int max_lora_rank = 8;
  int64_t max_num_tokens = 256;  // tokens of one step
  int64_t max_num_seqs = 16;     // sequences of one step
  int64_t kv_blocks = 64;
  int64_t kv_block_size = 16;
  /// Longest sequence (prompt + generated); 0 = the model's max_position_embeddings.
  int64_t max_model_len = 0;
  /// Capture pure decode steps in CUDA graphs (CUDA only; MoE models always run eagerly, their
  /// expert grouping reads the routing on the host).
  bool cuda_graphs = true;

  /// Ranks the model is sharded over (GPUs; on the CPU, threads). load_model builds the group;
  /// a Decoder itself is one rank and takes its group in `comm`.
  int tensor_parallel_size = 1;
  /// vLLM's --fully-sharded-loras: column layers also shard LoRA-A by rank and row layers
  /// LoRA-B by output rows, embedding and lm_head LoRA keep only their vocab shard.
  bool fully_sharded_loras = false;
  /// How the linear projections' LoRA A and B are stored: in `dtype` (nullopt), or float8_e4m3
  /// with a float32 scale per row (--lora-dtype fp8): half the adapter memory and bytes at
  /// bfloat16. Embedding and lm_head LoRA stay in `dtype`.
  std::optional<DType> lora_dtype;
  /// How a step of up to fused_lora_max_tokens tokens (decode) applies its LoRA; longer steps
  /// always run each projection's LoRA kernels after its GEMM. In the fused path every token
  /// pays the shrink of every slot up to the highest in use, which a decode step's GEMMs (bound
  /// by the weight bytes) absorb and a long prefill's (bound by the arithmetic) do not.
  LoraDecode lora_decode = LoraDecode::kAuto;
  int64_t fused_lora_max_tokens = 512;
  /// Every MoE step groups its routed pairs on the host and runs one cuBLASLt GEMM per expert
  /// (eager steps), instead of the device-routed expert GEMMs decode steps take by default: to
  /// measure the two against each other (bench e2e --moe-host-routing).
  bool moe_host_routing = false;
  /// "key=value,..." over the device's LoRA kernel tuning table (kernels/planner/lora_tuning.h),
  /// for benchmarks that compare kernel paths inside a model; empty: the table as it is.
  std::string lora_tuning;
  /// One Decoder's tensor-parallel group (tensor_parallel_size ranks), or nullptr for one
  /// device. Set by TensorParallelDecoder; must outlive the Decoder.
  Communicator* comm = nullptr;
  /// A tensor-parallel step that has not finished after this many seconds (a GPU that stopped
  /// or failed, a rank stuck in a collective) stops the group with an error instead of
  /// hanging.
  double step_timeout_s = 120.0;
};

/// How the last step ran, for benchmarks and tests.
struct StepStats {
  int64_t num_tokens = 0;  // tokens of the batch, before padding
  int64_t padded_tokens = 0;
  bool graph = false;  // replayed a captured CUDA graph
};

class ModelExecutor {
 public:
  virtual ~ModelExecutor() = default;

  virtual const ModelConfig& config() const = 0;
  /// The options the model was built with (device: the first rank's).
  virtual const DecoderOptions& options() const = 0;

  /// Replaces the KV cache with one of `num_blocks` blocks (options().kv_block_size tokens
  /// each) on every device; every sequence's cached state is lost. The engine sizes the cache
  /// this way once the weights are on the device(s).
  virtual void allocate_kv_cache(int64_t num_blocks) = 0;
  /// Device bytes of one KV block over all layers (K and V), on each device.
  virtual int64_t kv_block_bytes() const = 0;

  /// Starts one step: stages `batch`, enqueues its device work and the copy of its sampled ids
  /// to the host, and returns without waiting for the device (on the CPU the step runs here).
  /// collect() returns the ids. At most kMaxLaunchedSteps steps are launched and not yet
  /// collected: the engine plans and launches step n + 1 while step n runs, and only then
  /// collects step n. A SequenceStep's feed_row refers to the step launched just before this
  /// one. Throws loraplex::Error naming the sequence and value when the batch is inconsistent
  /// (blocks short of its positions, more tokens than max_num_tokens, a slot outside
  /// [-1, max_loras), bad sampling values, a feed_row the previous step did not sample), and
  /// then nothing was launched.
  virtual void launch(const StepBatch& batch) = 0;
  /// Waits for the oldest launched step and returns its sampled ids (and log-probabilities)
  /// in the order of its sampling sequences.
  virtual StepResult collect() = 0;
  /// One step with nothing else in flight: launch, then collect.
  StepResult execute(const StepBatch& batch) {
    launch(batch);
    return collect();
  }
  static constexpr int kMaxLaunchedSteps = 2;
  virtual const StepStats& last_step() const = 0;

  /// Every module an adapter may target, for the adapter manager; a tensor-parallel group's
  /// targets write every rank's layers (each keeps its shard of the full weights).
  virtual const LoraTargetRegistry& targets() const = 0;

  /// The devices the model runs on, one per rank (the KV cache is sized by the fullest).
  virtual std::vector<Device> devices() const = 0;
  /// The stream every step runs on, one per rank: a forward that uses an adapter slot must be
  /// ordered after the slot's upload on each of them (AdapterManager::Lease::wait_ready).
  virtual std::vector<Stream> streams() const = 0;
  int tensor_parallel_size() const { return static_cast<int>(devices().size()); }
};

}  // namespace loraplex::model
