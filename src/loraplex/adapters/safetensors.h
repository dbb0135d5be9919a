#pragma once
// A reader for the safetensors format (8-byte little-endian header length, a JSON header, then
// the raw tensor bytes). The file is memory-mapped and tensors are zero-copy CPU views of the
// mapping. Every field of the header is validated before anything is exposed: files come from
// users (adapters) and the network, so a hostile file must give loraplex::Error, never a crash,
// an out-of-range read or an allocation sized by the file.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "loraplex/core/tensor.h"

namespace loraplex {

/// One tensor entry of a safetensors header, after validation.
struct SafetensorsTensorInfo {
  DType dtype = DType::kF32;
  /// The dtype string of the file ("F32", "BF16", "BOOL", ...); BOOL is read as kU8.
  std::string file_dtype;
  Shape shape;
  /// Byte range [data_begin, data_end) relative to the start of the data section, as stored.
  uint64_t data_begin = 0;
  uint64_t data_end = 0;
  /// Byte range of the tensor in the file (data_begin + the data section's offset).
  uint64_t file_begin = 0;
  uint64_t file_end = 0;
};

class SafetensorsFile {
 public:
  /// Largest accepted JSON header, as in the reference implementation: a larger one is
  /// refused before anything is allocated for it.
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;

  /// Maps `path` read-only (copy-on-write) and validates its header; throws loraplex::Error
  /// naming the file and the problem.
  static SafetensorsFile open(const std::string& path);
  /// Validates an in-memory file (tests, fuzzing); `bytes` is copied. `label` stands for the
  /// path in error messages.
  static SafetensorsFile from_bytes(std::span<const uint8_t> bytes,
                                    const std::string& label = "<memory>");

  const std::string& path() const { return path_; }
  /// Tensor names in sorted order (`__metadata__` is not a tensor).
  std::vector<std::string> names() const;
  bool has(const std::string& name) const { return infos_.count(name) != 0; }
  size_t size() const { return infos_.size(); }
  /// Throws loraplex::Error naming the file and the tensor when `name` is absent.
  const SafetensorsTensorInfo& info(const std::string& name) const;
  /// The `__metadata__` string map (empty when the header has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Bytes after the header.
  uint64_t data_size() const { return data_size_; }

  /// A contiguous CPU tensor over the file's bytes, valid for as long as any copy of it lives
  /// (it keeps the mapping alive, even after this SafetensorsFile is gone). When the stored
  /// bytes are not aligned to the element size the tensor is an aligned copy instead. Writes
  /// to a view stay private to this process (the mapping is copy-on-write).
  Tensor tensor(const std::string& name) const;

 private:
  struct Mapping;
  SafetensorsFile() = default;
  void parse(const std::string& path);

  std::string path_;
  std::shared_ptr<Mapping> mapping_;
  std::map<std::string, SafetensorsTensorInfo> infos_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_offset_ = 0;
  uint64_t data_size_ = 0;
};

/// Parses a safetensors dtype string ("F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I32", "I64",
/// "U8", "BOOL" -> kU8); throws loraplex::Error naming the string and the accepted ones.
DType safetensors_dtype(const std::string& text);

/// Writes `tensors` as a safetensors file (for tests and generated test data). Each tensor is
/// written in its own dtype with data offsets in the order given.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace loraplex
