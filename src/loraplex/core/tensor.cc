#include "loraplex/core/tensor.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "loraplex/core/cuda_runtime.h"

namespace loraplex {
namespace {

bool is_integer(DType dtype) {
  return dtype == DType::kI32 || dtype == DType::kI64 || dtype == DType::kU8;
}

float load_as_float(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return *static_cast<const float*>(p);
    case DType::kF16:
      return f16_bits_to_float(*static_cast<const uint16_t*>(p));
    case DType::kBF16:
      return bf16_bits_to_float(*static_cast<const uint16_t*>(p));
    case DType::kF8E4M3:
      return e4m3_bits_to_float(*static_cast<const uint8_t*>(p));
    case DType::kF8E5M2:
      return e5m2_bits_to_float(*static_cast<const uint8_t*>(p));
    case DType::kI32:
      return static_cast<float>(*static_cast<const int32_t*>(p));
    case DType::kI64:
      return static_cast<float>(*static_cast<const int64_t*>(p));
    case DType::kU8:
      return static_cast<float>(*static_cast<const uint8_t*>(p));
  }
  return 0.0f;
}

int64_t load_as_int(const void* p, DType dtype) {
  switch (dtype) {
    case DType::kI32:
      return *static_cast<const int32_t*>(p);
    case DType::kI64:
      return *static_cast<const int64_t*>(p);
    case DType::kU8:
      return *static_cast<const uint8_t*>(p);
    default:
      return static_cast<int64_t>(load_as_float(p, dtype));
  }
}

void store_from_float(void* p, DType dtype, float v) {
  switch (dtype) {
    case DType::kF32:
      *static_cast<float*>(p) = v;
      break;
    case DType::kF16:
      *static_cast<uint16_t*>(p) = float_to_f16_bits(v);
      break;
    case DType::kBF16:
      *static_cast<uint16_t*>(p) = float_to_bf16_bits(v);
      break;
    case DType::kF8E4M3:
      *static_cast<uint8_t*>(p) = float_to_e4m3_bits(v);
      break;
    case DType::kF8E5M2:
      *static_cast<uint8_t*>(p) = float_to_e5m2_bits(v);
      break;
    default:
      break;
  }
}

void store_from_int(void* p, DType dtype, int64_t v) {
  switch (dtype) {
    case DType::kI32:
      *static_cast<int32_t*>(p) = static_cast<int32_t>(v);
      break;
    case DType::kI64:
      *static_cast<int64_t*>(p) = v;
      break;
    case DType::kU8:
      *static_cast<uint8_t*>(p) = static_cast<uint8_t>(v);
      break;
    default:
      store_from_float(p, dtype, static_cast<float>(v));
      break;
  }
}

// Visits every element of `shape` in row-major order, passing the element offsets (in
// elements) of the two strided operands.
template <typename Fn>
void for_each_offset(const Shape& shape, const Shape& a_strides, const Shape& b_strides, Fn&& fn) {
  const int64_t n = shape_numel(shape);
  if (n == 0) return;
  const size_t nd = shape.size();
  std::vector<int64_t> idx(nd, 0);
  int64_t a = 0;
  int64_t b = 0;
  for (int64_t i = 0; i < n; ++i) {
    fn(a, b);
    for (size_t d = nd; d-- > 0;) {
      if (++idx[d] < shape[d]) {
        a += a_strides[d];
        b += b_strides[d];
        break;
      }
      a -= a_strides[d] * (shape[d] - 1);
      b -= b_strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

void copy_cpu_strided(const Tensor& dst, const Tensor& src) {
  const size_t de = dst.element_size();
  const size_t se = src.element_size();
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    std::memcpy(d, s, dst.nbytes());
    return;
  }
  const DType dd = dst.dtype();
  const DType sd = src.dtype();
  // Contiguous float conversions in typed loops (adapter packing converts every weight).
  if (dst.is_contiguous() && src.is_contiguous()) {
    const int64_t n = dst.numel();
    bool done = false;
    dispatch_activation_dtype(dd, [&](auto dtag) {
      using D = typename decltype(dtag)::type;
      done = dispatch_activation_dtype(sd, [&](auto stag) {
        using S = typename decltype(stag)::type;
        D* out = reinterpret_cast<D*>(d);
        const S* in = reinterpret_cast<const S*>(s);
        for (int64_t i = 0; i < n; ++i) out[i] = store_float<D>(load_float(in[i]));
      });
    });
    if (done) return;
  }
  for_each_offset(dst.shape(), dst.strides(), src.strides(), [&](int64_t di, int64_t si) {
    void* dp = d + di * static_cast<int64_t>(de);
    const void* sp = s + si * static_cast<int64_t>(se);
    if (dd == sd) {
      std::memcpy(dp, sp, de);
    } else if (is_integer(dd)) {
      store_from_int(dp, dd, load_as_int(sp, sd));
    } else {
      store_from_float(dp, dd, load_as_float(sp, sd));
    }
  });
}

// Describes a tensor as `rows` rows of `row_bytes` contiguous bytes `pitch` bytes apart, when
// its layout allows (contiguous, or 2-D with a contiguous last dimension).
struct RowLayout {
  bool ok = false;
  size_t rows = 0;
  size_t row_bytes = 0;
  size_t pitch = 0;
};

RowLayout row_layout(const Tensor& t) {
  if (t.is_contiguous()) return {true, 1, t.nbytes(), t.nbytes()};
  if (t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= t.size(1)) {
    const size_t es = t.element_size();
    return {true, static_cast<size_t>(t.size(0)), static_cast<size_t>(t.size(1)) * es,
            static_cast<size_t>(t.stride(0)) * es};
  }
  return {};
}

cuda_rt::CopyKind copy_kind(Device dst, Device src) {
  if (dst.is_cuda() && src.is_cuda()) return cuda_rt::CopyKind::kDeviceToDevice;
  if (dst.is_cuda()) return cuda_rt::CopyKind::kHostToDevice;
  if (src.is_cuda()) return cuda_rt::CopyKind::kDeviceToHost;
  return cuda_rt::CopyKind::kHostToHost;
}

}  // namespace

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

int64_t shape_numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

Tensor Tensor::empty_with(const Shape& shape, DType dtype, Device device, Allocator& allocator) {
  for (int64_t s : shape)
    LORAPLEX_CHECK(s >= 0, "tensor sizes must be >= 0, got ", shape_str(shape));
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  void* data = allocator.allocate(bytes);
  Allocator* alloc = &allocator;
  Tensor t;
  t.storage_ = std::make_shared<Storage>(
      data, bytes, device, [alloc, bytes](void* p) { alloc->deallocate(p, bytes); },
      allocator.page_locked());
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return empty_with(shape, dtype, device, allocator_for(device));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, const Stream& stream) {
  Tensor t = empty(shape, dtype, device);
  t.zero_(stream);
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, Device device,
                         std::shared_ptr<void> keep_alive, bool page_locked) {
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  Tensor t;
  t.storage_ = std::make_shared<Storage>(
      data, bytes, device, [keep_alive](void*) mutable { keep_alive.reset(); }, page_locked);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

void* Tensor::data_ptr() const {
  LORAPLEX_CHECK(defined(), "data_ptr() of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(element_size());
}

void Tensor::check_dtype(DType expected, const char* what) const {
  LORAPLEX_CHECK(dtype_ == expected, what, ": tensor has dtype ", dtype_, ", expected ", expected);
}

int64_t Tensor::normalize_dim(int64_t d) const {
  const int64_t nd = dim();
  LORAPLEX_CHECK(d >= -nd && d < nd, "dimension ", d, " out of range for a ", nd, "-D tensor ",
                 shape_str(shape_));
  return d < 0 ? d + nd : d;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t d = shape_.size(); d-- > 0;) {
    if (shape_[d] == 1) continue;
    if (strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  const int64_t nd = normalize_dim(d);
  LORAPLEX_CHECK(start >= 0 && length >= 0 && start + length <= shape_[nd], "narrow(dim ", d,
                 ", start ", start, ", length ", length, ") out of range for size ", shape_[nd]);
  Tensor t = *this;
  t.offset_ += start * strides_[nd];
  t.shape_[nd] = length;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  const int64_t nd = normalize_dim(d);
  LORAPLEX_CHECK(index >= 0 && index < shape_[nd], "select(dim ", d, ", index ", index,
                 ") out of range for size ", shape_[nd]);
  Tensor t = *this;
  t.offset_ += index * strides_[nd];
  t.shape_.erase(t.shape_.begin() + nd);
  t.strides_.erase(t.strides_.begin() + nd);
  return t;
}

Tensor Tensor::view(const Shape& shape) const {
  LORAPLEX_CHECK(is_contiguous(), "view", shape_str(shape), " of a non-contiguous tensor ",
                 describe(), "; use reshape()");
  Shape resolved = shape;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == -1) {
      LORAPLEX_CHECK(infer < 0, "view", shape_str(shape), ": at most one -1 is allowed");
      infer = static_cast<int>(i);
    } else {
      LORAPLEX_CHECK(resolved[i] >= 0, "view", shape_str(shape), ": negative size");
      known *= resolved[i];
    }
  }
  if (infer >= 0) {
    LORAPLEX_CHECK(known != 0 && numel() % known == 0, "view", shape_str(shape),
                   ": cannot infer -1 for ", numel(), " elements");
    resolved[infer] = numel() / known;
  }
  LORAPLEX_CHECK(shape_numel(resolved) == numel(), "view", shape_str(shape), " has ",
                 shape_numel(resolved), " elements, the tensor has ", numel(), " (", describe(),
                 ")");
  Tensor t = *this;
  t.shape_ = resolved;
  t.strides_ = contiguous_strides(resolved);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  return is_contiguous() ? view(shape) : contiguous().view(shape);
}

Tensor Tensor::permute(const std::vector<int64_t>& order) const {
  LORAPLEX_CHECK(static_cast<int64_t>(order.size()) == dim(), "permute needs ", dim(),
                 " dimensions, got ", order.size());
  std::vector<bool> seen(order.size(), false);
  Tensor t = *this;
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t src = normalize_dim(order[i]);
    LORAPLEX_CHECK(!seen[src], "permute: dimension ", order[i], " repeated");
    seen[src] = true;
    t.shape_[i] = shape_[src];
    t.strides_[i] = strides_[src];
  }
  return t;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  std::vector<int64_t> order(shape_.size());
  std::iota(order.begin(), order.end(), 0);
  std::swap(order[normalize_dim(d0)], order[normalize_dim(d1)]);
  return permute(order);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  const int64_t nd = dim();
  LORAPLEX_CHECK(d >= -nd - 1 && d <= nd, "unsqueeze(", d, ") out of range for ", nd, "-D");
  const int64_t pos = d < 0 ? d + nd + 1 : d;
  Tensor t = *this;
  const int64_t stride = pos < nd ? strides_[pos] * shape_[pos] : 1;
  t.shape_.insert(t.shape_.begin() + pos, 1);
  t.strides_.insert(t.strides_.begin() + pos, stride);
  return t;
}

Tensor Tensor::contiguous(const Stream& stream) const {
  if (is_contiguous()) return *this;
  return clone(stream);
}

Tensor Tensor::clone(const Stream& stream) const {
  Tensor t = empty(shape_, dtype_, device_);
  t.copy_from(*this, stream);
  return t;
}

Tensor Tensor::to(DType dtype, const Stream& stream) const {
  if (dtype == dtype_) return *this;
  if (device_.is_cpu()) {
    Tensor t = empty(shape_, dtype, device_);
    copy_cpu_strided(t, *this);
    return t;
  }
  // Conversions on the GPU are rare (weight loading converts on the host first), so route
  // them through the host rather than keeping a cast kernel in core.
  Tensor host = to(Device::cpu(), stream);
  stream.synchronize();
  return host.to(dtype).to(device_, stream);
}

Tensor Tensor::to(Device device, const Stream& stream) const {
  if (device == device_) return *this;
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this, stream);
  return t;
}

void Tensor::copy_from(const Tensor& src, const Stream& stream) {
  LORAPLEX_CHECK(defined() && src.defined(), "copy_from with an undefined tensor");
  LORAPLEX_CHECK(shape_ == src.shape_, "copy_from: destination shape ", shape_str(shape_),
                 " differs from source shape ", shape_str(src.shape_));
  if (device_.is_cpu() && src.device_.is_cpu()) {
    copy_cpu_strided(*this, src);
    return;
  }
  LORAPLEX_CHECK(dtype_ == src.dtype_, "copy_from between devices needs equal dtypes, got ",
                 src.dtype_, " -> ", dtype_);
  if (numel() == 0) return;
  Tensor source = src;
  if (!row_layout(source).ok && source.device_.is_cpu()) source = source.contiguous();
  copy_rows_between_devices(source, stream);
  // A host destination must be readable when copy_from returns; a pageable host source
  // must stay valid until the copy has consumed it.
  if (device_.is_cpu() || source.device_.is_cpu()) stream.synchronize();
}

void Tensor::copy_from_async(const Tensor& src, const Stream& stream) {
  LORAPLEX_CHECK(defined() && src.defined(), "copy_from_async with an undefined tensor");
  LORAPLEX_CHECK(shape_ == src.shape_, "copy_from_async: destination shape ", shape_str(shape_),
                 " differs from source shape ", shape_str(src.shape_));
  if (device_.is_cpu() && src.device_.is_cpu()) {
    copy_cpu_strided(*this, src);
    return;
  }
  LORAPLEX_CHECK(dtype_ == src.dtype_, "copy_from_async between devices needs equal dtypes, got ",
                 src.dtype_, " -> ", dtype_);
  for (const Tensor* t : {static_cast<const Tensor*>(this), &src}) {
    LORAPLEX_CHECK(t->device_.is_cuda() || t->is_pinned(),
                   "copy_from_async needs pinned host memory on the host side, got pageable ",
                   t->describe());
  }
  if (numel() == 0) return;
  copy_rows_between_devices(src, stream);
}

void Tensor::copy_rows_between_devices(const Tensor& source, const Stream& stream) {
  const RowLayout s = row_layout(source);
  const RowLayout d = row_layout(*this);
  LORAPLEX_CHECK(s.ok && d.ok, "copy between devices needs contiguous rows, got ",
                 source.describe(), " -> ", describe());
  const cuda_rt::CopyKind kind = copy_kind(device_, source.device_);
  if (s.rows == 1 && d.rows == 1) {
    cuda_rt::memcpy_async(data_ptr(), source.data_ptr(), nbytes(), kind, stream.handle());
  } else {
    const size_t rows = std::max(s.rows, d.rows);
    const size_t row_bytes = nbytes() / rows;
    const size_t sp = s.rows == 1 ? row_bytes : s.pitch;
    const size_t dp = d.rows == 1 ? row_bytes : d.pitch;
    cuda_rt::memcpy_2d_async(data_ptr(), dp, source.data_ptr(), sp, row_bytes, rows, kind,
                             stream.handle());
  }
}

void Tensor::zero_(const Stream& stream) {
  if (numel() == 0) return;
  if (device_.is_cpu()) {
    if (is_contiguous()) {
      std::memset(data_ptr(), 0, nbytes());
    } else {
      fill_(0.0);
    }
    return;
  }
  const RowLayout layout = row_layout(*this);
  LORAPLEX_CHECK(layout.ok && layout.rows == 1, "zero_ on ", device_,
                 " needs a contiguous tensor, got ", describe());
  cuda_rt::memset_async(data_ptr(), 0, nbytes(), stream.handle());
}

void Tensor::fill_(double value) {
  LORAPLEX_CHECK(device_.is_cpu(), "fill_ needs a CPU tensor, got ", describe());
  std::vector<char> element(element_size());
  if (is_integer(dtype_)) {
    store_from_int(element.data(), dtype_, static_cast<int64_t>(value));
  } else {
    store_from_float(element.data(), dtype_, static_cast<float>(value));
  }
  char* base = static_cast<char*>(data_ptr());
  const int64_t es = static_cast<int64_t>(element_size());
  for_each_offset(shape_, strides_, strides_, [&](int64_t off, int64_t) {
    std::memcpy(base + off * es, element.data(), element.size());
  });
}

double Tensor::item(const std::vector<int64_t>& index) const {
  LORAPLEX_CHECK(device_.is_cpu(), "item() needs a CPU tensor, got ", describe());
  LORAPLEX_CHECK(static_cast<int64_t>(index.size()) == dim(), "item(): ", index.size(),
                 " indices for a ", dim(), "-D tensor");
  int64_t off = 0;
  for (size_t d = 0; d < index.size(); ++d) {
    LORAPLEX_CHECK(index[d] >= 0 && index[d] < shape_[d], "item(): index ", index[d],
                   " out of range for dimension ", d, " of size ", shape_[d]);
    off += index[d] * strides_[d];
  }
  const char* p = static_cast<const char*>(storage_->data()) +
                  (offset_ + off) * static_cast<int64_t>(element_size());
  return is_integer(dtype_) ? static_cast<double>(load_as_int(p, dtype_))
                            : static_cast<double>(load_as_float(p, dtype_));
}

std::vector<double> Tensor::to_double_vector() const {
  LORAPLEX_CHECK(device_.is_cpu(), "to_double_vector() needs a CPU tensor, got ", describe());
  std::vector<double> out;
  out.reserve(static_cast<size_t>(numel()));
  const char* base = static_cast<const char*>(data_ptr());
  const int64_t es = static_cast<int64_t>(element_size());
  const bool integer = is_integer(dtype_);
  for_each_offset(shape_, strides_, strides_, [&](int64_t off, int64_t) {
    const char* p = base + off * es;
    out.push_back(integer ? static_cast<double>(load_as_int(p, dtype_))
                          : static_cast<double>(load_as_float(p, dtype_)));
  });
  return out;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  std::ostringstream os;
  os << dtype_ << shape_str(shape_) << " on " << device_;
  return os.str();
}

}  // namespace loraplex
