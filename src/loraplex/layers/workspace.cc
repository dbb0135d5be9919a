#include "loraplex/layers/workspace.h"

#include <algorithm>

#include "loraplex/core/error.h"

namespace loraplex {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

void LayerWorkspace::reserve(size_t bytes) { reserved_ = std::max(reserved_, align_up(bytes)); }

void LayerWorkspace::allocate() {
  if (buffer_.defined() && static_cast<size_t>(buffer_.numel()) >= reserved_) return;
  buffer_ = Tensor();  // release the old buffer first: the caching allocator can reuse it
  buffer_ = Tensor::empty({static_cast<int64_t>(std::max<size_t>(reserved_, kAlign))}, DType::kU8,
                          device_);
}

LayerWorkspace::Carver LayerWorkspace::carver() {
  allocate();
  return Carver(this);
}

Tensor LayerWorkspace::Carver::take(const Shape& shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  const size_t offset = used_;
  used_ += align_up(bytes);
  if (ws_ == nullptr) return Tensor();
  LORAPLEX_CHECK(used_ <= static_cast<size_t>(ws_->buffer_.numel()), "layer workspace of ",
                 ws_->buffer_.numel(), " bytes is too small: this forward needs at least ", used_,
                 " (was the layer built with a larger reservation than max_num_tokens allows?)");
  char* base = static_cast<char*>(ws_->buffer_.data_ptr());
  return Tensor::from_blob(base + offset, shape, dtype, ws_->device_, ws_->buffer_.storage());
}

}  // namespace loraplex
