#include "loraplex/adapters/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <system_error>

namespace loraplex {

using json = nlohmann::json;

// The bytes of the whole file: a private mapping of a file, or an owned aligned copy.
struct SafetensorsFile::Mapping {
  uint8_t* data = nullptr;
  uint64_t size = 0;
  bool mapped = false;

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data == nullptr) return;
    if (mapped) {
      munmap(data, size);
    } else {
      std::free(data);
    }
  }
};

namespace {

std::string errno_text(int err) { return std::generic_category().message(err); }

struct FileDtype {
  const char* name;
  DType dtype;
};

constexpr FileDtype kFileDtypes[] = {
    {"F32", DType::kF32},        {"F16", DType::kF16},        {"BF16", DType::kBF16},
    {"F8_E4M3", DType::kF8E4M3}, {"F8_E5M2", DType::kF8E5M2}, {"I32", DType::kI32},
    {"I64", DType::kI64},        {"U8", DType::kU8},          {"BOOL", DType::kU8},
};

const char* file_dtype_name(DType dtype) {
  for (const FileDtype& d : kFileDtypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Reads a JSON number that must be a non-negative integer that fits int64.
bool json_to_u63(const json& j, uint64_t& out) {
  if (j.is_number_unsigned()) {
    out = j.get<uint64_t>();
  } else if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    out = static_cast<uint64_t>(v);
  } else {
    return false;
  }
  return out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
}

// Builds the header's JSON from the parser's events, refusing what the format does not allow
// while parsing: more than three levels (before a deeply nested document can cost memory) and
// duplicate keys (a parser keeps one of them silently). nlohmann's callback parser would check
// the same, but it scans the parent object each time a child object ends, which is quadratic
// in the tensor count (seconds for a 128-expert adapter's 70,000 tensors).
class HeaderBuilder {
 public:
  explicit HeaderBuilder(const std::string& path) : path_(path) {}

  json take() { return std::move(root_); }

  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(json::number_integer_t v) { return put(v); }
  bool number_unsigned(json::number_unsigned_t v) { return put(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(v); }
  bool string(json::string_t& v) { return put(std::move(v)); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    json& object = *open_.back();
    LORAPLEX_CHECK(!object.contains(k), "safetensors file '", path_, "': header JSON has the key '",
                   k, "' twice");
    value_slot_ = &object[k];
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    throw e;
  }

 private:
  // Where the next value goes: the root, the end of the open array, or the key just read.
  // References into an object stay valid as it grows; an array's last element may move, but
  // only after it was closed.
  json* place(json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    *value_slot_ = std::move(v);
    return value_slot_;
  }
  bool put(json v) {
    place(std::move(v));
    return true;
  }
  bool open(json container) {
    LORAPLEX_CHECK(open_.size() < 3, "safetensors file '", path_,
                   "': header JSON is nested deeper than the format allows (3 levels)");
    open_.push_back(place(std::move(container)));
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }

  const std::string& path_;
  json root_;
  std::vector<json*> open_;
  json* value_slot_ = nullptr;
};

// The steps of SafetensorsFile::parse.

// A tensor's header entry, checked against the data section (data_size bytes from
// data_offset): its fields, dtype, shape and byte range.
SafetensorsTensorInfo parse_tensor_entry(const std::string& where, const json& entry,
                                         uint64_t data_offset, uint64_t data_size) {
  LORAPLEX_CHECK(entry.is_object(), where, ": entry must be an object, got ", entry.type_name());
  for (auto f = entry.begin(); f != entry.end(); ++f) {
    LORAPLEX_CHECK(f.key() == "dtype" || f.key() == "shape" || f.key() == "data_offsets", where,
                   ": unknown field '", f.key(), "' (expected dtype, shape, data_offsets)");
  }
  LORAPLEX_CHECK(entry.contains("dtype") && entry["dtype"].is_string(), where,
                 ": missing string field 'dtype'");
  LORAPLEX_CHECK(entry.contains("shape") && entry["shape"].is_array(), where,
                 ": missing array field 'shape'");
  LORAPLEX_CHECK(entry.contains("data_offsets") && entry["data_offsets"].is_array(), where,
                 ": missing array field 'data_offsets'");

  SafetensorsTensorInfo info;
  info.file_dtype = entry["dtype"].get<std::string>();
  try {
    info.dtype = safetensors_dtype(info.file_dtype);
  } catch (const Error& e) {
    LORAPLEX_FAIL(where, ": ", e.what());
  }
  uint64_t numel = 1;
  // Strides multiply the non-zero sizes even when the tensor is empty, so their product must
  // fit int64 too: [2^62, 2^62, 0] holds nothing but cannot be indexed.
  int64_t stride_product = 1;
  for (const json& d : entry["shape"]) {
    uint64_t dim = 0;
    LORAPLEX_CHECK(json_to_u63(d, dim), where, ": shape entries must be integers >= 0, got ",
                   d.dump());
    info.shape.push_back(static_cast<int64_t>(dim));
    numel *= dim;
    LORAPLEX_CHECK(
        !__builtin_mul_overflow(stride_product, std::max<int64_t>(dim, 1), &stride_product), where,
        ": shape ", entry["shape"].dump(), " is too large to index");
  }
  const json& offsets = entry["data_offsets"];
  LORAPLEX_CHECK(offsets.size() == 2 && json_to_u63(offsets[0], info.data_begin) &&
                     json_to_u63(offsets[1], info.data_end),
                 where, ": data_offsets must be two integers >= 0, got ", offsets.dump());
  LORAPLEX_CHECK(info.data_begin <= info.data_end, where, ": data_offsets ", offsets.dump(),
                 " end before they begin");
  LORAPLEX_CHECK(info.data_end <= data_size, where, ": data_offsets ", offsets.dump(),
                 " reach past the data section of ", data_size, " bytes");
  uint64_t nbytes = 0;
  LORAPLEX_CHECK(!__builtin_mul_overflow(numel, dtype_size(info.dtype), &nbytes) &&
                     nbytes == info.data_end - info.data_begin,
                 where, ": shape ", shape_str(info.shape), " of ", info.file_dtype, " needs ",
                 numel, " x ", dtype_size(info.dtype), " bytes but data_offsets ", offsets.dump(),
                 " hold ", info.data_end - info.data_begin);
  info.file_begin = data_offset + info.data_begin;
  info.file_end = data_offset + info.data_end;
  return info;
}

// A tensor's bytes in the data section, for the overlap check.
struct Range {
  uint64_t begin;
  uint64_t end;
  const std::string* name;
};

// No two tensors' bytes overlap (empty tensors have no range).
void check_disjoint(std::vector<Range>& ranges, const std::string& path) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    LORAPLEX_CHECK(ranges[i].begin >= ranges[i - 1].end, "safetensors file '", path, "': tensors '",
                   *ranges[i - 1].name, "' [", ranges[i - 1].begin, ", ", ranges[i - 1].end,
                   ") and '", *ranges[i].name, "' [", ranges[i].begin, ", ", ranges[i].end,
                   ") overlap");
  }
}

}  // namespace

DType safetensors_dtype(const std::string& text) {
  for (const FileDtype& d : kFileDtypes)
    if (text == d.name) return d.dtype;
  LORAPLEX_FAIL("unsupported safetensors dtype '", text,
                "' (supported: F32, F16, BF16, F8_E4M3, F8_E5M2, I32, I64, U8, BOOL)");
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  // O_NONBLOCK keeps open() of a FIFO from hanging; such files are refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  LORAPLEX_CHECK(fd >= 0, "cannot open safetensors file '", path, "': ", errno_text(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  LORAPLEX_CHECK(fstat(fd, &st) == 0, "cannot stat safetensors file '", path,
                 "': ", errno_text(errno));
  LORAPLEX_CHECK(S_ISREG(st.st_mode), "safetensors file '", path, "' is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  LORAPLEX_CHECK(size >= 8, "safetensors file '", path, "' has ", size,
                 " bytes, fewer than the 8-byte header length");

  auto mapping = std::make_shared<Mapping>();
  // Private and writable: views handed out may be written by callers (in-place conversions),
  // which must neither fault nor reach the file.
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  LORAPLEX_CHECK(p != MAP_FAILED, "cannot map safetensors file '", path, "': ", errno_text(errno));
  mapping->data = static_cast<uint8_t*>(p);
  mapping->size = size;
  mapping->mapped = true;

  SafetensorsFile file;
  file.mapping_ = std::move(mapping);
  file.parse(path);
  return file;
}

SafetensorsFile SafetensorsFile::from_bytes(std::span<const uint8_t> bytes,
                                            const std::string& label) {
  auto mapping = std::make_shared<Mapping>();
  // Exactly the given size (malloc aligns to 16, enough for every dtype), so that a sanitizer
  // sees any read past the end.
  mapping->data = static_cast<uint8_t*>(std::malloc(bytes.empty() ? 1 : bytes.size()));
  LORAPLEX_CHECK(mapping->data != nullptr, "out of memory copying ", bytes.size(), " bytes of '",
                 label, "'");
  if (!bytes.empty()) std::memcpy(mapping->data, bytes.data(), bytes.size());
  mapping->size = bytes.size();

  SafetensorsFile file;
  file.mapping_ = std::move(mapping);
  file.parse(label);
  return file;
}

void SafetensorsFile::parse(const std::string& path) {
  path_ = path;
  const uint8_t* base = mapping_->data;
  const uint64_t size = mapping_->size;
  LORAPLEX_CHECK(size >= 8, "safetensors file '", path, "' has ", size,
                 " bytes, fewer than the 8-byte header length");
  const uint64_t header_len = read_le64(base);
  LORAPLEX_CHECK(header_len <= size - 8, "safetensors file '", path, "': header length ",
                 header_len, " exceeds the ", size - 8, " bytes after the length field");
  LORAPLEX_CHECK(header_len <= kMaxHeaderBytes, "safetensors file '", path, "': header length ",
                 header_len, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  LORAPLEX_CHECK(header_len >= 2 && base[8] == '{', "safetensors file '", path,
                 "': header is not a JSON object (it must start with '{')");
  data_offset_ = 8 + header_len;
  data_size_ = size - data_offset_;

  const char* text = reinterpret_cast<const char*>(base + 8);
  json header;
  try {
    HeaderBuilder builder(path);
    json::sax_parse(text, text + header_len, &builder);
    header = builder.take();
  } catch (const json::exception& e) {
    LORAPLEX_FAIL("safetensors file '", path, "': header is not valid JSON: ", e.what());
  }
  LORAPLEX_CHECK(header.is_object(), "safetensors file '", path, "': header is not a JSON object");

  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      LORAPLEX_CHECK(entry.is_object(), "safetensors file '", path,
                     "': __metadata__ must be an object of strings");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        LORAPLEX_CHECK(m.value().is_string(), "safetensors file '", path, "': __metadata__ key '",
                       m.key(), "' must have a string value, got ", m.value().type_name());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = detail::concat("safetensors file '", path, "': tensor '", name, "'");
    SafetensorsTensorInfo info = parse_tensor_entry(where, entry, data_offset_, data_size_);
    auto [pos, inserted] = infos_.emplace(name, std::move(info));
    if (pos->second.data_end > pos->second.data_begin)
      ranges.push_back({pos->second.data_begin, pos->second.data_end, &pos->first});
  }

  check_disjoint(ranges, path);
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(infos_.size());
  for (const auto& [name, info] : infos_) out.push_back(name);
  return out;
}

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = infos_.find(name);
  LORAPLEX_CHECK(it != infos_.end(), "safetensors file '", path_, "' has no tensor '", name, "'");
  return it->second;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsTensorInfo& meta = info(name);
  const uint64_t nbytes = meta.data_end - meta.data_begin;
  uint8_t* ptr = mapping_->data + meta.file_begin;
  if (nbytes == 0) return Tensor::empty(meta.shape, meta.dtype);
  if (reinterpret_cast<uintptr_t>(ptr) % dtype_size(meta.dtype) != 0) {
    // Typed access to a misaligned element is undefined behaviour; copy instead.
    Tensor copy = Tensor::empty(meta.shape, meta.dtype);
    std::memcpy(copy.data_ptr(), ptr, nbytes);
    return copy;
  }
  return Tensor::from_blob(ptr, meta.shape, meta.dtype, Device::cpu(), mapping_);
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<Tensor> contiguous;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    LORAPLEX_CHECK(t.defined() && t.device().is_cpu(), "write_safetensors: tensor '", name,
                   "' must be a defined CPU tensor");
    LORAPLEX_CHECK(!header.contains(name), "write_safetensors: tensor '", name, "' given twice");
    contiguous.push_back(t.contiguous());
    header[name] = {{"dtype", file_dtype_name(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  LORAPLEX_CHECK(out.good(), "write_safetensors: cannot create '", path, "'");
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const Tensor& t : contiguous)
    if (t.nbytes() > 0)
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  out.close();
  LORAPLEX_CHECK(!out.fail(), "write_safetensors: writing '", path, "' failed");
}

}  // namespace loraplex
