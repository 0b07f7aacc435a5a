// The transports this build knows, in one list (registry.cpp): adding a transport adds one
// line there. Each factory returns a transport even when it cannot run on this host; it then
// reports itself unavailable with the reason.
#pragma once

#include <vector>

#include "transport/transport.h"

namespace tidekv {

struct TransportEntry {
  const char* name;
  TransportFactory make;
};

const std::vector<TransportEntry>& transport_registry();

}  // namespace tidekv
