// libFuzzer target for the safetensors reader: any input must either be refused with
// loraplex::Error or give tensors whose every byte can be read. Any other exception, a crash or
// a sanitizer report is a finding.

#include <cstddef>
#include <cstdint>
#include <span>

#include "loraplex/adapters/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto file = loraplex::SafetensorsFile::from_bytes(std::span<const uint8_t>(data, size), "fuzz");
    volatile uint64_t sink = 0;
    for (const std::string& name : file.names()) {
      const auto& info = file.info(name);
      loraplex::Tensor t = file.tensor(name);
      if (t.nbytes() != info.data_end - info.data_begin) __builtin_trap();
      const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
      for (size_t i = 0; i < t.nbytes(); ++i) sink = sink + bytes[i];
      // Converting touches every element through the typed path as well.
      if (t.numel() <= 4096) sink = sink + t.to_double_vector().size();
    }
  } catch (const loraplex::Error&) {
  }
  return 0;
}
