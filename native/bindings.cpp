// tidekv._native: the private native module. One register_* per component.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace tidekv {
void register_errors(py::module_& m);
void register_engine(py::module_& m);
}  // namespace tidekv

PYBIND11_MODULE(_native, m) {
  m.doc() = "tidekv native data path (private; use tidekv.TransferEngine)";
  tidekv::register_errors(m);
  tidekv::register_engine(m);
}
