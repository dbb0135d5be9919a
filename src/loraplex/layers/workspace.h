#pragma once
// Scratch memory of the layers' forward passes. The layers of one model replica run one after
// another on one stream, so their intermediates (gathered rows, expert activations, LoRA
// intermediates, collective staging) can share one buffer: each layer reserves what it needs
// at construction, the buffer is allocated once at the largest reservation, and every forward
// carves its views from the start again. A layer built without a shared workspace gets its own.
//
// Not thread-safe: layers sharing a workspace must not run forward concurrently (tensor-parallel
// ranks each have their own layers and workspaces).

#include <cstddef>
#include <cstdint>

#include "loraplex/core/tensor.h"

namespace loraplex {

class LayerWorkspace {
 public:
  explicit LayerWorkspace(Device device) : device_(device) {}

  Device device() const { return device_; }
  /// Raises the reservation to at least `bytes` (layers call this at construction).
  void reserve(size_t bytes);
  size_t reserved_bytes() const { return reserved_; }
  /// Allocates the buffer at the reserved size unless it already has that size. Called by the
  /// first forward; call it after building every layer so that no forward allocates.
  void allocate();

  /// Carves views out of the buffer front to back, 256-byte aligned. With a null workspace it
  /// only counts bytes (take() returns undefined tensors): layers use the same carving code to
  /// size their reservation and to run.
  class Carver {
   public:
    /// A view of `shape` and `dtype` (contiguous). Throws when the buffer is too small.
    Tensor take(const Shape& shape, DType dtype);
    /// Bytes carved so far (aligned).
    size_t used() const { return used_; }

   private:
    friend class LayerWorkspace;
    explicit Carver(LayerWorkspace* ws) : ws_(ws) {}
    LayerWorkspace* ws_;
    size_t used_ = 0;
  };

  /// A carver over the (allocated) buffer, starting at its beginning.
  Carver carver();
  /// A carver that only measures.
  static Carver measure() { return Carver(nullptr); }

 private:
  Device device_;
  size_t reserved_ = 0;
  Tensor buffer_;  // u8 [reserved_]
};

}  // namespace loraplex
