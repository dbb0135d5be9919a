// loraplex._C: the extension module behind the `loraplex` Python package.

#include <nanobind/nanobind.h>

#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"

namespace loraplex::python {

namespace nb = nanobind;

void bind_engine(nb::module_& m);
void bind_ops(nb::module_& m);

}  // namespace loraplex::python

NB_MODULE(_C, m) {
  namespace nb = nanobind;
  m.attr("__version__") = LORAPLEX_VERSION;
  // Every library error reaches Python with the C++ message. A refused request is also a
  // ValueError, as vLLM raises for invalid requests; translators registered later are tried
  // first.
  nb::exception<loraplex::Error> error(m, "LoraplexError", PyExc_RuntimeError);
  nb::object bases = nb::make_tuple(error, nb::handle(PyExc_ValueError));
  nb::exception<loraplex::engine::RequestError>(m, "RequestError", bases);
  loraplex::python::bind_engine(m);
  loraplex::python::bind_ops(m);
}
