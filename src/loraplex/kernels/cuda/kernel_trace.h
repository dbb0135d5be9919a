#pragma once
// Per-CTA timelines of the prefill kernels (shrink, both tensor-core expands), for `loraplex bench
// kernels --trace`: where a CTA's time goes (launch, metadata, setup, streaming, reduction) and how
// CTAs land on SMs. Plain C++ (the CLI includes it); the launchers read the buffer pointer, the
// kernels write to it.

#include <cstdint>

namespace loraplex::kernels::cuda {

/// Values per CTA: the SM id, then the global timer (ns) at seven points, 0 where a CTA returned
/// before that point. Prefill shrink: entry, metadata read, setup done (row tables), first
/// stage landed, K loop done, reduction done (split-K through global memory: the CTA's part
/// stored and its arrival counted), exit (there: after the last CTA's sum of the parts).
/// Tensor-core expands: entry, metadata read,
/// first item's token indices, first item's data landed, (unused), last item stored, exit.
/// Decode pair (gather_lora.cu; one row per CTA of the shrink, then of the expand): the shrink
/// writes slots 1-5 (entry, its PDL wait returned, its loads landed, exit; 5: its tokens' slot
/// and rank known), the expand slots 5-7 (entry, its PDL wait returned, exit): a row with slot 1
/// set is the shrink's. Cluster layer (cluster_lora.cu, one row per CTA): entry, its PDL wait
/// returned, its loads landed, its partial sums sent, its owned partial sums received, the
/// rounded sums received, exit.
inline constexpr int kTraceSlots = 8;

/// While set, every prefill shrink and tensor-core expand launch writes CTA b's values at
/// buffer[b * kTraceSlots] (a device buffer of grid x kTraceSlots values); nullptr stops. Not
/// thread-safe against launches.
void set_kernel_trace(uint64_t* device_buffer);
uint64_t* kernel_trace();

}  // namespace loraplex::kernels::cuda
