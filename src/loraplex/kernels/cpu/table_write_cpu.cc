#include "loraplex/kernels/table_write.h"

namespace loraplex::kernels::cpu {

Status write_column(const WriteColumnArgs& a) {
  LORAPLEX_ENSURE(a.count >= 0 && a.count <= kMaxColumnValues, "write_column: count ", a.count,
                  " outside [0, ", kMaxColumnValues, "]");
  for (int32_t i = 0; i < a.count; ++i) {
    a.table[(a.first_row + i) * a.row_stride + a.col] = a.values[i];
  }
  return Status();
}

}  // namespace loraplex::kernels::cpu
