#pragma once
// Python's str operations on UTF-8 text where chat templates rely on them: lengths, indices
// and slices count code points, and strip/split know Unicode whitespace.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loraplex::jinja {

/// Byte offsets of each code point of `s`, plus s.size() at the end. Invalid UTF-8 bytes count
/// as one code point each (templates only see valid UTF-8; this keeps indexing total).
std::vector<size_t> code_point_offsets(std::string_view s);
size_t code_point_count(std::string_view s);
/// Python's str.isspace() for one code point.
bool is_python_space(uint32_t cp);
/// str.strip / lstrip / rstrip: Unicode whitespace, or the code points of `chars` when given.
std::string python_strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                         bool right);
/// str.split(sep, maxsplit): runs of whitespace when `sep` is empty (nullopt).
std::vector<std::string> python_split(std::string_view s, const std::optional<std::string>& sep,
                                      int64_t maxsplit);
/// ASCII case mapping (upper/lower/title/capitalize leave other letters as they are).
std::string ascii_upper(std::string_view s);
std::string ascii_lower(std::string_view s);
/// str.title(): each run of letters starts upper-case and continues lower-case.
std::string ascii_title(std::string_view s);

}  // namespace loraplex::jinja
