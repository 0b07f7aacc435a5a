// Maps native ErrorKind onto the classes of tidekv.errors (imported, never redefined here).
#include <pybind11/pybind11.h>

#include "common/errors.h"

namespace py = pybind11;

namespace tidekv {

void register_errors(py::module_& m) {
  // Leaked on purpose: translators may run until the interpreter is gone.
  static PyObject* errors = py::module_::import("tidekv.errors").release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      const char* cls = "TidekvError";
      switch (e.kind()) {
        case ErrorKind::kConfig: cls = "ConfigError"; break;
        case ErrorKind::kNotRegistered: cls = "SegmentNotRegisteredError"; break;
        case ErrorKind::kTransfer: cls = "TransferError"; break;
        case ErrorKind::kPeerUnavailable: cls = "PeerUnavailableError"; break;
        case ErrorKind::kProtocolVersion: cls = "ProtocolVersionError"; break;
        case ErrorKind::kAuth: cls = "AuthenticationError"; break;
        case ErrorKind::kTimeout: cls = "TransferTimeoutError"; break;
        case ErrorKind::kUnknownPeer: PyErr_SetString(PyExc_KeyError, e.what()); return;
        case ErrorKind::kClosed: cls = "EngineClosedError"; break;
      }
      py::object type = py::handle(errors).attr(cls);
      PyErr_SetString(type.ptr(), e.what());
    }
  });
  m.attr("ERROR_KINDS") = py::dict(
      py::arg("config") = int(ErrorKind::kConfig), py::arg("not_registered") = int(ErrorKind::kNotRegistered),
      py::arg("transfer") = int(ErrorKind::kTransfer), py::arg("peer_unavailable") = int(ErrorKind::kPeerUnavailable),
      py::arg("protocol_version") = int(ErrorKind::kProtocolVersion), py::arg("auth") = int(ErrorKind::kAuth),
      py::arg("timeout") = int(ErrorKind::kTimeout), py::arg("closed") = int(ErrorKind::kClosed));
}

}  // namespace tidekv
