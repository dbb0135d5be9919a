#pragma once
// The launch recorder's stand-in for the CUDA runtime (fake_cudart.cc): what it reports about the
// device and what it records of each launch.

#include <cstddef>
#include <string>
#include <vector>

namespace fake_cudart {

/// The device the runtime reports (an H100 SXM by default).
struct DeviceModel {
  int sm_count = 132;
  int smem_per_block_optin = 227 * 1024;
  int smem_per_sm = 228 * 1024;
  int reserved_smem_per_block = 1024;
};

/// One recorded launch.
struct Launch {
  std::string name;  // mangled device function name
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0;  // threads
  size_t smem = 0;     // dynamic shared memory bytes
  int cluster_x = 0;   // 0: no cluster attribute
  bool pdl = false;    // programmatic stream serialization allowed
  std::vector<unsigned char> params;
};

/// Reads "mangled_name param_bytes registers" lines (scripts/record_lora_launches.sh makes them
/// from the build's cubins).
void load_kernel_info(const std::string& path);
void set_device(const DeviceModel& device);
/// The launches recorded since the last call.
std::vector<Launch> take_launches();

}  // namespace fake_cudart
