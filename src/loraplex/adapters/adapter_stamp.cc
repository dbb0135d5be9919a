#include "loraplex/adapters/adapter_stamp.h"

#include <sys/stat.h>

#include "loraplex/adapters/peft_adapter.h"
#include "loraplex/core/error.h"

namespace loraplex {
namespace {

AdapterStamp::File stamp_file(const std::string& path) {
  AdapterStamp::File f;
  f.path = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return f;
  f.exists = true;
  f.size = static_cast<int64_t>(st.st_size);
  f.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  f.inode = static_cast<uint64_t>(st.st_ino);
  return f;
}

std::string show(const AdapterStamp::File& f) {
  if (!f.exists) return "missing";
  return detail::concat(f.size, " bytes, modified at ", f.mtime_ns / 1000000000, ".",
                        f.mtime_ns % 1000000000, " s, inode ", f.inode);
}

}  // namespace

AdapterStamp AdapterStamp::of(const std::string& dir) {
  AdapterStamp s;
  s.files.push_back(stamp_file(adapter_config_path(dir)));
  s.files.push_back(stamp_file(adapter_weights_path(dir)));
  return s;
}

std::string describe_change(const AdapterStamp& then, const AdapterStamp& now) {
  for (size_t i = 0; i < then.files.size() && i < now.files.size(); ++i) {
    if (!(then.files[i] == now.files[i])) {
      return detail::concat(now.files[i].path, " was ", show(then.files[i]), ", is ",
                            show(now.files[i]));
    }
  }
  return then.files.size() == now.files.size() ? "" : "the adapter's files differ";
}

}  // namespace loraplex
