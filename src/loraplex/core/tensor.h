#pragma once
// A strided view over reference-counted storage on the CPU or a CUDA device. Views (narrow,
// select, view, permute) share storage; contiguous(), to() and clone() copy. Every method
// validates its arguments and throws loraplex::Error naming the bad value.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/core/allocator.h"
#include "loraplex/core/device.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/error.h"
#include "loraplex/core/stream.h"

namespace loraplex {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);

/// Owns (or borrows) one block of memory on one device.
class Storage {
 public:
  /// `page_locked`: host memory a GPU can copy from asynchronously (pinned_host_allocator()).
  Storage(void* data, size_t bytes, Device device, std::function<void(void*)> release,
          bool page_locked = false)
      : data_(data),
        bytes_(bytes),
        device_(device),
        release_(std::move(release)),
        page_locked_(page_locked) {}
  ~Storage() {
    if (release_) release_(data_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool page_locked() const { return page_locked_; }

 private:
  void* data_;
  size_t bytes_;
  Device device_;
  std::function<void(void*)> release_;
  bool page_locked_;
};

class Tensor {
 public:
  /// An undefined tensor (defined() is false).
  Tensor() = default;

  /// Uninitialised contiguous memory from the device's allocator.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  /// Uninitialised contiguous memory from a specific allocator (pinned host memory, say).
  static Tensor empty_with(const Shape& shape, DType dtype, Device device, Allocator& allocator);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu(),
                      const Stream& stream = Stream());
  /// Borrows `data` (contiguous); `keep_alive` is held as long as any view exists.
  /// `page_locked`: host memory inside a pinned allocation (is_pinned() answers it).
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                          std::shared_ptr<void> keep_alive = nullptr, bool page_locked = false);
  /// A CPU tensor holding a copy of `values`.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// Size of dimension `d`; negative `d` counts from the end.
  int64_t size(int64_t d) const { return shape_[normalize_dim(d)]; }
  int64_t stride(int64_t d) const { return strides_[normalize_dim(d)]; }
  int64_t numel() const { return shape_numel(shape_); }
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  /// Offset of the first element from the start of the storage, in elements.
  int64_t storage_offset() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  void* data_ptr() const;
  /// Typed pointer to the first element; throws if T does not match dtype().
  template <typename T>
  T* data() const {
    check_dtype(dtype_of<std::remove_const_t<T>>, "data<T>()");
    return static_cast<T*>(data_ptr());
  }

  bool is_contiguous() const;
  /// True when the memory is page-locked host memory (Tensor::empty_with with
  /// pinned_host_allocator(), and views of it): copy_from_async can upload it without waiting.
  bool is_pinned() const { return storage_ != nullptr && storage_->page_locked(); }

  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;
  /// Reinterprets a contiguous tensor with a new shape (one entry may be -1).
  Tensor view(const Shape& shape) const;
  /// view() when contiguous, otherwise a contiguous copy with the new shape.
  Tensor reshape(const Shape& shape) const;
  Tensor permute(const std::vector<int64_t>& order) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor unsqueeze(int64_t dim) const;

  /// This tensor when already contiguous, else a contiguous copy on the same device.
  Tensor contiguous(const Stream& stream = Stream()) const;
  /// A copy converted to `dtype`, correctly rounded (same device).
  Tensor to(DType dtype, const Stream& stream = Stream()) const;
  /// A copy on `device` (this tensor itself when already there).
  Tensor to(Device device, const Stream& stream = Stream()) const;
  Tensor clone(const Stream& stream = Stream()) const;
  /// Copies `src` (same shape) into this tensor, converting dtype on the CPU. Between devices
  /// both sides must have the same dtype, and each side must be contiguous or a 2-D set of
  /// contiguous rows.
  void copy_from(const Tensor& src, const Stream& stream = Stream());
  /// copy_from without waiting for `stream`: the host side of a copy between devices must be
  /// pinned (is_pinned()) and laid out as contiguous rows, dtypes must be equal, and the caller
  /// keeps both sides alive and the source unchanged until `stream` has passed the copy (an
  /// Event). Copies within the CPU run at once, as copy_from.
  void copy_from_async(const Tensor& src, const Stream& stream);
  /// Sets every element to zero.
  void zero_(const Stream& stream = Stream());
  /// Sets every element of a CPU tensor to `value` (rounded to the dtype).
  void fill_(double value);

  /// Element at `index` of a CPU tensor, converted to double (for tests and debugging).
  double item(const std::vector<int64_t>& index = {}) const;
  /// All elements of a CPU tensor, in row-major order, as double.
  std::vector<double> to_double_vector() const;

  /// "bfloat16[3, 4] on cpu".
  std::string describe() const;

  /// Throws unless dtype() == expected, naming `what`.
  void check_dtype(DType expected, const char* what) const;

 private:
  int64_t normalize_dim(int64_t d) const;
  // The copy of copy_from / copy_from_async between devices (or host and device), enqueued
  // on `stream`; `source` has contiguous rows.
  void copy_rows_between_devices(const Tensor& source, const Stream& stream);

  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::kF32;
  Device device_ = Device::cpu();
};

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  LORAPLEX_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape),
                 "from_vector: ", values.size(), " values do not fill shape ", shape_str(shape));
  Tensor t = empty(shape, dtype_of<T>);
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

}  // namespace loraplex
