#pragma once
// Per-CTA timelines of the prefill shrink, for `loraplex bench kernels --trace`: where a CTA's
// time goes (launch, metadata, setup, streaming, reduction) and how CTAs land on SMs. Plain C++
// (the CLI includes it); the launcher reads the buffer pointer, the kernel writes to it.

#include <cstdint>

namespace loraplex::kernels::cuda {

/// Values per CTA: the SM id, then the global timer (ns) at kernel entry, after the metadata
/// read, after the setup (row tables), when the first stage landed, after the K loop, after the
/// cluster reduction, at exit; 0 where a CTA returned before that point.
inline constexpr int kTraceSlots = 8;

/// While set, every prefill shrink launch writes CTA b's values at buffer[b * kTraceSlots] (a
/// device buffer of grid x kTraceSlots values); nullptr stops. Not thread-safe against launches.
void set_prefill_shrink_trace(uint64_t* device_buffer);

}  // namespace loraplex::kernels::cuda
