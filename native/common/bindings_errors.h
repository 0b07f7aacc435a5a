// The one mapping of native failures onto tidekv.errors (bindings_errors.cpp): raised
// exceptions and per-request results of a batch go through it alike.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "common/errors.h"

namespace tidekv {

// The tidekv.errors class for a kind.
pybind11::handle error_class(ErrorKind kind);
// A TransferError (or subclass) naming what failed: `peer`, `op` ("READ"/"WRITE") and the range.
pybind11::object transfer_error(ErrorKind kind, const std::string& message, const std::string& peer, const char* op,
                                uint64_t remote_addr, uint64_t length);

}  // namespace tidekv
