// Settings of a C API engine, read from the environment in this one place: every variable of
// tidekv.config.TransferConfig (settings.gen.h, generated from its declarations: the same names,
// ranges and units as Python), TIDEKV_SECRET or TIDEKV_SECRET_FILE, TIDEKV_LOG_LEVEL, and
// Mooncake's MC_FORCE_TCP=1 (TensorRT-LLM's tests set it), which forces tcp. An invalid value is
// an error naming the variable, never a silent default.
#pragma once

#include <string>

#include "common/context.h"
#include "common/log_sink.h"

namespace tidekv::capi {

// Engine options for an engine bound to `host` (throws ApiError naming a bad variable).
EngineOptions engine_options_from_env(const std::string& host);
// The address an engine listens on and advertises: `given` (the caller's host), else
// $TIDEKV_HOST, else the default route's interface, else 127.0.0.1 with a warning, as
// tidekv.hostaddr.advertised_host picks it for a component with no master (throws ApiError for a
// wildcard, which a peer would dial as itself).
std::string listen_host(const std::string& given);
// The lowest level logged on stderr (TIDEKV_LOG_LEVEL, default WARNING; read once).
LogLevel log_threshold();

}  // namespace tidekv::capi
