// The entry points of the CUDA LoRA ops: check the arguments, make the plan
// (kernels/planner/lora_plan.h), check that the metadata holds the workspace the plan needs, run
// the plan's launchers.

#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/cuda/lora_launch.h"
#include "loraplex/kernels/lora_ops_checks.h"

namespace loraplex::kernels::cuda {
namespace {

Status check_workspace(const Workspace& need, const LoraMetaView& meta, const char* op,
                       const char* what) {
  const int64_t scratch = meta.scratch != nullptr ? meta.scratch_floats : 0;
  LORAPLEX_ENSURE(need.scratch_floats <= scratch, op, ": the ", what, " plan needs ",
                  need.scratch_floats, " floats of metadata scratch, the metadata holds ", scratch,
                  " (LoraBatchMeta::reserve_scratch)");
  const int64_t counters = meta.counters != nullptr ? meta.num_counters : 0;
  LORAPLEX_ENSURE(need.counters <= counters, op, ": the ", what, " plan needs ", need.counters,
                  " metadata counters, the metadata holds ", counters);
  return Status();
}

Status run_shrink(const ShrinkPlan& plan, const ShrinkArgs& args, const LoraMetaView& meta,
                  StreamHandle stream) {
  switch (plan.kernel) {
    case ShrinkKernel::kPrefill:
      return launch_prefill(plan.prefill, args, meta, stream);
    case ShrinkKernel::kGeneric:
      break;
  }
  return launch_shrink_generic(args, meta.token_lora_mapping, stream);
}

Status run_expand(const ExpandPlan& plan, const ExpandArgs& args, const LoraMetaView& meta,
                  StreamHandle stream) {
  switch (plan.kernel) {
    case ExpandKernel::kPipelined:
      return launch_expand_pipelined(plan, args, meta, stream);
    case ExpandKernel::kTensorCore:
      return launch_expand_tc(plan, args, meta, stream);
    case ExpandKernel::kGeneric:
      break;
  }
  return launch_expand_generic(args, meta.token_lora_mapping, stream);
}

}  // namespace

Status lora_shrink(const ShrinkArgs& args, const LoraMetaView& meta, const LoraDevice& device,
                   StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(args));
  LORAPLEX_RETURN_IF_ERROR(check_meta_view(meta, args.num_tokens, args.max_loras, "lora_shrink"));
  if (args.num_tokens == 0) return Status();
  const ShrinkShape shape = shrink_shape(args);
  const ShrinkPlan plan = plan_lora_shrink(shape, device);
  LORAPLEX_RETURN_IF_ERROR(
      check_workspace(shrink_workspace(plan, shape), meta, "lora_shrink", "shrink"));
  return run_shrink(plan, args, meta, stream);
}

Status lora_expand(const ExpandArgs& args, const LoraMetaView& meta, const LoraDevice& device,
                   StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(args));
  LORAPLEX_RETURN_IF_ERROR(check_meta_view(meta, args.num_tokens, args.max_loras, "lora_expand"));
  if (args.num_tokens == 0) return Status();
  return run_expand(plan_lora_expand(expand_shape(args), device), args, meta, stream);
}

Status lora_linear(const ShrinkArgs& shrink, const ExpandArgs& expand, const LoraMetaView& meta,
                   const LoraDevice& device, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(shrink));
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(expand));
  LORAPLEX_ENSURE(shrink.num_tokens == expand.num_tokens, "lora_linear: shrink has ",
                  shrink.num_tokens, " tokens, expand ", expand.num_tokens);
  LORAPLEX_RETURN_IF_ERROR(
      check_meta_view(meta, shrink.num_tokens, shrink.max_loras, "lora_linear"));
  if (shrink.num_tokens == 0) return Status();
  const LinearPlan plan = plan_lora_linear(linear_shape(shrink, expand, meta), device);
  LORAPLEX_RETURN_IF_ERROR(
      check_workspace(plan.workspace, meta, "lora_linear", path_name(plan.path)));
  switch (plan.path) {
    case LinearPath::kCluster:
      return launch_cluster(plan.cluster, shrink, expand, meta, stream);
    case LinearPath::kGather:
      return launch_gather(plan.gather, shrink, expand, meta, stream);
    case LinearPath::kSplit:
    case LinearPath::kGeneric:
      break;
  }
  LORAPLEX_RETURN_IF_ERROR(run_shrink(plan.shrink, shrink, meta, stream));
  return run_expand(plan.expand, expand, meta, stream);
}

Status bgmv_shrink(const ShrinkArgs& args, const int32_t* token_lora_mapping, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_shrink_args(args));
  if (args.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(token_lora_mapping != nullptr, "bgmv_shrink: token mapping is null");
  return launch_shrink_generic(args, token_lora_mapping, stream);
}

Status bgmv_expand(const ExpandArgs& args, const int32_t* token_lora_mapping, StreamHandle stream) {
  LORAPLEX_RETURN_IF_ERROR(check_expand_args(args));
  if (args.num_tokens == 0) return Status();
  LORAPLEX_ENSURE(token_lora_mapping != nullptr, "bgmv_expand: token mapping is null");
  return launch_expand_generic(args, token_lora_mapping, stream);
}

}  // namespace loraplex::kernels::cuda
