#pragma once
// The tensor-core, decode and gather paths, shared between the .cu files of kernels/cuda/
// (lora_shrink in shrink_expand.cu picks one). Internal to the CUDA backend.

#include "loraplex/kernels/cuda/cuda_common.cuh"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"

namespace loraplex::kernels::cuda {

/// The shrink and expand describe one layer that the one-launch decode paths can take: bf16 or
/// f16 throughout, the same slices, slots, ranks and tokens, and the sum added to y.
inline bool one_half_layer(const ShrinkArgs& s, const ExpandArgs& e) {
  return half_dtype(s.dtype) && e.dtype == s.dtype && e.add_inputs &&
         e.num_slices == s.num_slices && e.max_rank == s.max_rank && e.max_loras == s.max_loras &&
         e.num_tokens == s.num_tokens;
}

/// The decode kernel (decode_lora.cu) runs this shrink: small batch, bf16/f16, aligned rows
/// and enough metadata scratch for its split-K partial sums.
bool decode_shrink_applies(const ShrinkArgs& args, const LoraMetaView& meta);
Status decode_shrink(const ShrinkArgs& args, const LoraMetaView& meta, StreamHandle stream);

/// The tensor-core prefill shrink (prefill_shrink.cu) runs this shrink: bf16/f16, aligned
/// rows, num_slices * max_rank <= 256.
bool prefill_shrink_applies(const ShrinkArgs& args);
/// expand_follows: the next launch is this layer's pipelined expand under PDL, which reads
/// nothing of this shrink's before its wait: the shrink (and its sum kernel) let it launch at
/// their own start.
Status prefill_shrink(const ShrinkArgs& args, const LoraMetaView& meta, StreamHandle stream,
                      bool expand_follows = false);

/// The software-pipelined expand (expand_pipelined.cu) runs this expand: bf16/f16, max_rank a
/// multiple of 8 up to 64, aligned rows, slice widths multiples of 8, unless the
/// expand_pipelined knob is 1.
bool expand_pipelined_applies(const ExpandArgs& args);
/// after_prefill_shrink: the kernel before it in the stream is this layer's prefill shrink (or
/// its sum kernel), which lets it launch at its start; the expand is then launched with PDL and
/// loads its first y and B tiles before it waits for the intermediate.
Status expand_pipelined(const ExpandArgs& args, const LoraMetaView& meta, StreamHandle stream,
                        bool after_prefill_shrink = false);

/// The split path of a layer (shrink kernels, then expand kernels), with the expand launched
/// under PDL after the prefill shrink where split_pdl allows.
Status lora_split_linear(const ShrinkArgs& shrink, const ExpandArgs& expand,
                         const LoraMetaView& meta, StreamHandle stream);

/// The per-token layer pair (gather_lora.cu) runs this layer: bf16/f16, add_inputs, max_rank a
/// multiple of 8 up to 256, aligned rows, slice widths multiples of 4, enough scratch.
bool gather_linear_applies(const ShrinkArgs& shrink, const ExpandArgs& expand,
                           const LoraMetaView& meta);
Status gather_linear(const ShrinkArgs& shrink, const ExpandArgs& expand, const LoraMetaView& meta,
                     StreamHandle stream);

/// The one-kernel cluster layer (cluster_lora.cu) runs this layer: bf16/f16, add_inputs,
/// max_rank a multiple of 8 up to 256, aligned rows, slice widths multiples of 8, and its
/// staged weights fit in shared memory.
bool cluster_linear_applies(const ShrinkArgs& shrink, const ExpandArgs& expand,
                            const LoraMetaView& meta);
Status cluster_linear(const ShrinkArgs& shrink, const ExpandArgs& expand, const LoraMetaView& meta,
                      StreamHandle stream);

}  // namespace loraplex::kernels::cuda
