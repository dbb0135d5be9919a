#include "loraplex/dist/communicator.h"

namespace loraplex {
namespace dist_detail {

int check_all_gather(const Tensor& in, const Tensor& out, int dim, int size, const char* who) {
  LORAPLEX_CHECK(in.defined() && out.defined(), who, ": all_gather with an undefined tensor");
  LORAPLEX_CHECK(in.is_contiguous() && out.is_contiguous(), who,
                 ": all_gather needs contiguous tensors, got in ", in.describe(), ", out ",
                 out.describe());
  LORAPLEX_CHECK(in.dtype() == out.dtype() && in.device() == out.device(), who,
                 ": all_gather in is ", in.describe(), " but out is ", out.describe());
  const int nd = static_cast<int>(in.dim());
  LORAPLEX_CHECK(nd >= 1 && dim >= -nd && dim < nd, who, ": all_gather dim ", dim,
                 " out of range for a ", nd, "-D tensor");
  const int d = dim < 0 ? dim + nd : dim;
  Shape expected = in.shape();
  expected[d] *= size;
  LORAPLEX_CHECK(out.shape() == expected, who, ": all_gather of ", in.describe(), " along dim ", d,
                 " over ", size, " ranks needs out ", shape_str(expected), ", got ",
                 shape_str(out.shape()));
  return d;
}

void check_all_reduce(const Tensor& tensor, const char* who) {
  LORAPLEX_CHECK(tensor.defined(), who, ": all_reduce_sum of an undefined tensor");
  LORAPLEX_CHECK(tensor.is_contiguous(), who, ": all_reduce_sum needs a contiguous tensor, got ",
                 tensor.describe());
}

}  // namespace dist_detail

void SingleDeviceCommunicator::all_reduce_sum(Tensor& tensor, const Stream&) {
  dist_detail::check_all_reduce(tensor, "single-device communicator");
}

void SingleDeviceCommunicator::all_gather(const Tensor& in, Tensor& out, int dim,
                                          const Stream& stream) {
  dist_detail::check_all_gather(in, out, dim, 1, "single-device communicator");
  if (in.numel() == 0 || in.data_ptr() == out.data_ptr()) return;
  out.copy_from(in, stream);
}

}  // namespace loraplex
