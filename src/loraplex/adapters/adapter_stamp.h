#pragma once
// What identifies the files an adapter was loaded from: each file's size, modification time and
// inode, as the file system reports them. An adapter evicted from the CPU cache is read from
// disk again when it is needed; if its files were replaced in between, the reload would serve
// other weights under the same name (and its prefix-cache key, which names the load, would
// reuse KV blocks computed with the old ones), so the manager compares stamps and refuses.

#include <cstdint>
#include <string>
#include <vector>

namespace loraplex {

struct AdapterStamp {
  struct File {
    std::string path;
    bool exists = false;
    int64_t size = 0;
    int64_t mtime_ns = 0;
    uint64_t inode = 0;
    bool operator==(const File&) const = default;
  };
  std::vector<File> files;  // the adapter's config, then its weights

  /// The stamp of the PEFT adapter in `dir` now (missing files are recorded as missing).
  static AdapterStamp of(const std::string& dir);
  bool operator==(const AdapterStamp&) const = default;
};

/// Empty when `now` equals `then`; else the first file that differs, named by its path, with
/// what it was and what it is.
std::string describe_change(const AdapterStamp& then, const AdapterStamp& now);

}  // namespace loraplex
