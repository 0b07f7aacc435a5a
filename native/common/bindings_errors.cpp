// Maps native ErrorKind onto the classes of tidekv.errors (imported, never redefined here). This
// is the only place that does: raised exceptions and a batch's per-request results use it.
#include "common/bindings_errors.h"

namespace py = pybind11;

namespace tidekv {
namespace {

PyObject* errors_module() {
  // Leaked on purpose: translators may run until the interpreter is gone.
  static PyObject* errors = py::module_::import("tidekv.errors").release().ptr();
  return errors;
}

const char* class_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kConfig: return "ConfigError";
    case ErrorKind::kNotRegistered: return "SegmentNotRegisteredError";
    case ErrorKind::kTransfer: return "TransferError";
    case ErrorKind::kPeerUnavailable: return "PeerUnavailableError";
    case ErrorKind::kHangup: return "PeerUnavailableError";
    case ErrorKind::kRefused: return "PeerUnavailableError";
    case ErrorKind::kProtocolVersion: return "TransferProtocolVersionError";
    case ErrorKind::kAuth: return "TransferAuthenticationError";
    case ErrorKind::kTimeout: return "TransferTimeoutError";
    case ErrorKind::kClosed: return "EngineClosedError";
  }
  return "TidekvError";
}

}  // namespace

py::handle error_class(ErrorKind kind) {
  static PyObject* cache[16] = {};  // leaked like the module
  PyObject*& cls = cache[int(kind) & 15];
  if (!cls) cls = py::object(py::handle(errors_module()).attr(class_name(kind))).release().ptr();
  return cls;
}

py::object transfer_error(ErrorKind kind, const std::string& message, const std::string& peer, const char* op,
                          uint64_t remote_addr, uint64_t length) {
  py::handle cls = error_class(kind);
  py::handle base = error_class(ErrorKind::kTransfer);
  if (!PyObject_IsSubclass(cls.ptr(), base.ptr())) cls = base;  // a request's failure is a TransferError
  return cls(message, py::arg("peer") = peer, py::arg("op") = op, py::arg("remote_addr") = remote_addr,
             py::arg("length") = length);
}

void register_errors(py::module_& m) {
  errors_module();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_class(e.kind()).ptr(), e.what());
    }
  });
}

}  // namespace tidekv
