// pybind11 surface of the engine: EngineOptions, Engine and Batch. Owned by
// tidekv.transfer.engine.TransferEngine; see core/_native.pyi for the typed view.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "engine/engine.h"

namespace py = pybind11;

namespace tidekv {
namespace {

py::bytes descriptor_bytes(const wire::Descriptor& d) {
  return py::bytes(reinterpret_cast<const char*>(&d), sizeof(d));
}

wire::Descriptor descriptor_from(const py::bytes& b) {
  std::string s = b;
  if (s.size() != sizeof(wire::Descriptor))
    TIDEKV_THROW(kConfig, "peer descriptor has " + std::to_string(s.size()) + " bytes, expected " +
                              std::to_string(sizeof(wire::Descriptor)));
  wire::Descriptor d;
  std::memcpy(&d, s.data(), sizeof(d));
  return d;
}

std::vector<Request> requests_from(Engine& engine, const py::sequence& items) {
  std::vector<Request> out;
  size_t n = py::len(items);
  out.reserve(n);
  std::string last_name;
  uint32_t last_id = 0;
  bool have_last = false;
  for (size_t i = 0; i < n; ++i) {
    py::tuple t = py::reinterpret_borrow<py::object>(items[i]).cast<py::tuple>();
    if (t.size() != 5)
      TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " must be (op, local_addr, length, peer, remote_addr)");
    int op = t[0].cast<int>();
    if (op != int(wire::Op::kRead) && op != int(wire::Op::kWrite))
      TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " has op " + std::to_string(op) + "; use TransferOp.READ or WRITE");
    std::string name = t[3].cast<std::string>();
    if (!have_last || name != last_name) {
      last_id = engine.peer_id(name);
      last_name = name;
      have_last = true;
    }
    out.push_back(Request{wire::Op(op), t[1].cast<uint64_t>(), t[2].cast<uint64_t>(), last_id, t[4].cast<uint64_t>()});
  }
  return out;
}

}  // namespace

void register_engine(py::module_& m) {
  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("host", &EngineOptions::host)
      .def_readwrite("port", &EngineOptions::port)
      .def_property(
          "transport", [](const EngineOptions& o) { return int(o.transport); },
          [](EngineOptions& o, int v) { o.transport = TransportChoice(v); })
      .def_readwrite("connections_per_peer", &EngineOptions::connections_per_peer)
      .def_readwrite("worker_threads", &EngineOptions::worker_threads)
      .def_readwrite("slice_bytes", &EngineOptions::slice_bytes)
      .def_readwrite("io_timeout_ms", &EngineOptions::io_timeout_ms)
      .def_readwrite("socket_buffer_bytes", &EngineOptions::socket_buffer_bytes)
      .def_readwrite("secret", &EngineOptions::secret)
      .def_readwrite("max_regions", &EngineOptions::max_regions)
      .def_readwrite("unregister_timeout_ms", &EngineOptions::unregister_timeout_ms)
      .def_readwrite("inline_bytes", &EngineOptions::inline_bytes)
      .def_readwrite("defer_bytes", &EngineOptions::defer_bytes)
      .def_readwrite("defer_grace_us", &EngineOptions::defer_grace_us)
      .def_readwrite("reply_spin_us", &EngineOptions::reply_spin_us)
      .def_readwrite("shm_parallelism", &EngineOptions::shm_parallelism)
      .def_readwrite("enable_cross_memory_attach", &EngineOptions::enable_cross_memory_attach);

  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch")
      .def("wait", &Batch::wait, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("done", &Batch::is_done)
      .def("bytes_done", &Batch::bytes_done)
      .def("results", [](Batch& b) {
        py::list out;
        for (const auto& r : b.results()) out.append(py::make_tuple(int(r.state), int(r.kind), r.message));
        return out;
      });

  py::class_<Engine>(m, "Engine")
      .def(py::init<EngineOptions>(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("name", &Engine::name)
      .def_property_readonly("protocol_version", [](const Engine&) { return wire::kProtocolVersion; })
      .def("descriptor", [](const Engine& e) { return descriptor_bytes(e.descriptor()); })
      .def("register", &Engine::register_region, py::arg("addr"), py::arg("length"), py::arg("location"),
           py::call_guard<py::gil_scoped_release>())
      .def("allocate", &Engine::allocate, py::arg("length"), py::arg("huge") = false, py::call_guard<py::gil_scoped_release>())
      .def("unregister", &Engine::unregister_region, py::arg("addr"), py::call_guard<py::gil_scoped_release>())
      .def("fetch_descriptor",
           [](Engine& e, const std::string& host, int port) {
             wire::Descriptor d;
             {
               py::gil_scoped_release release;
               d = e.fetch_descriptor(host, port);
             }
             return descriptor_bytes(d);
           })
      .def("add_peer",
           [](Engine& e, const std::string& name, const py::bytes& d) {
             wire::Descriptor desc = descriptor_from(d);
             py::gil_scoped_release release;
             return e.add_peer(name, desc);
           })
      .def("peer_transport", &Engine::peer_transport)
      .def("submit",
           [](Engine& e, const py::sequence& items) {
             std::vector<Request> reqs = requests_from(e, items);
             py::gil_scoped_release release;
             return e.submit(std::move(reqs));
           })
      .def("stats",
           [](Engine& e) {
             const Counters& c = e.context().counters;
             py::dict d;
             d["batches"] = c.batches.load();
             d["bytes_read"] = c.bytes_read.load();
             d["bytes_written"] = c.bytes_written.load();
             d["shm_bytes"] = c.shm_bytes.load();
             d["served_bytes"] = c.served_bytes.load();
             d["frames_refused"] = c.frames_refused.load();
             d["connections_accepted"] = c.connections_accepted.load();
             d["connections_refused"] = c.connections_refused.load();
             d["connections_opened"] = c.connections_opened.load();
             return d;
           })
      .def("drain_log",
           [](Engine& e, int timeout_ms) {
             std::vector<std::pair<LogLevel, std::string>> records;
             {
               py::gil_scoped_release release;
               records = e.context().log.drain(timeout_ms);
             }
             py::list out;
             for (auto& [level, msg] : records) out.append(py::make_tuple(int(level), msg));
             return out;
           })
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace tidekv
