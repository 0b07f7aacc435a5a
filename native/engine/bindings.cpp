// pybind11 surface of the engine: EngineOptions, Engine and Batch. Owned by
// tidekv.transfer.engine.TransferEngine; see core/_native.pyi for the typed view. Every call
// that can block releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "common/bindings_errors.h"
#include "common/copy.h"
#include "common/region_proof.h"
#include "cuda/driver.h"
#include "engine/engine.h"

namespace py = pybind11;

namespace tidekv {
namespace {

uint64_t as_u64(PyObject* o, size_t i, const char* field) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " has an invalid " + field + " (a non-negative int is needed)");
  }
  return v;
}

// Converts (op, local_addr, length, peer, remote_addr) tuples (TransferRequest). Peer names the
// engine does not know yet are collected in *unknown instead of failing.
std::vector<Request> requests_from(Engine& engine, const py::sequence& items, std::vector<std::string>* unknown,
                                   std::vector<std::pair<uint32_t, std::string>>* names) {
  std::vector<Request> out;
  size_t n = py::len(items);
  out.reserve(n);
  PyObject* last_name = nullptr;
  uint32_t last_id = 0;
  bool last_known = false;
  for (size_t i = 0; i < n; ++i) {
    py::object item = items[i];
    PyObject* t = item.ptr();
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 5)
      TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " must be (op, local_addr, length, peer, remote_addr)");
    long op = PyLong_AsLong(PyTuple_GET_ITEM(t, 0));
    if (op != long(wire::Op::kRead) && op != long(wire::Op::kWrite)) {
      PyErr_Clear();
      TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " has op " + std::to_string(op) + "; use TransferOp.READ or WRITE");
    }
    PyObject* name = PyTuple_GET_ITEM(t, 3);
    if (name != last_name) {
      if (!PyUnicode_Check(name)) TIDEKV_THROW(kConfig, "request " + std::to_string(i) + " has a peer that is not a str");
      std::string s = py::reinterpret_borrow<py::str>(name);
      last_name = name;
      try {
        last_id = engine.peer_id(s);
        last_known = true;
        bool seen = false;
        for (const auto& [id, nm] : *names) seen = seen || id == last_id;
        if (!seen) names->emplace_back(last_id, s);
      } catch (const Error&) {
        last_known = false;
        if (std::find(unknown->begin(), unknown->end(), s) == unknown->end()) unknown->push_back(s);
      }
    }
    if (!last_known) continue;
    out.push_back(Request{wire::Op(op), as_u64(PyTuple_GET_ITEM(t, 1), i, "local_addr"),
                          as_u64(PyTuple_GET_ITEM(t, 2), i, "length"), last_id,
                          as_u64(PyTuple_GET_ITEM(t, 4), i, "remote_addr")});
  }
  return out;
}

// Per request: True (done), None (still running) or its TransferError.
py::list batch_results(Batch& b) {
  py::list out;
  const auto& reqs = b.requests();
  auto results = b.results();
  for (size_t i = 0; i < results.size(); ++i) {
    const RequestResult& r = results[i];
    if (r.state == RequestState::kDone) {
      out.append(py::bool_(true));
    } else if (r.state == RequestState::kPending) {
      out.append(py::none());
    } else {
      const Request& q = reqs[i];
      const char* op = q.op == wire::Op::kRead ? "READ" : "WRITE";
      const std::string& peer = b.peer_name(q.peer);
      char addr[24];
      snprintf(addr, sizeof(addr), "%#llx", (unsigned long long)q.remote_addr);
      out.append(transfer_error(r.kind,
                                "request " + std::to_string(i) + " (" + op + " " + std::to_string(q.length) +
                                    " bytes at peer " + peer + " addr " + addr + ") failed: " + r.message,
                                peer, op, q.remote_addr, q.length));
    }
  }
  return out;
}

}  // namespace

void register_engine(py::module_& m) {
  py::class_<TcpOptions>(m, "TcpOptions")
      .def(py::init<>())
      .def_readwrite("connections_per_peer", &TcpOptions::connections_per_peer)
      .def_readwrite("reply_spin_us", &TcpOptions::reply_spin_us)
      .def_readwrite("server_threads", &TcpOptions::server_threads);

  py::class_<ShmOptions>(m, "ShmOptions")
      .def(py::init<>())
      .def_readwrite("parallelism", &ShmOptions::parallelism)
      .def_readwrite("stream_copy_bytes", &ShmOptions::stream_copy_bytes)
      .def_readwrite("enable_cross_memory_attach", &ShmOptions::enable_cross_memory_attach);

  py::class_<FabricOptions>(m, "FabricOptions")
      .def(py::init<>())
      .def_readwrite("provider", &FabricOptions::provider)
      .def_readwrite("nics", &FabricOptions::nics);

  py::class_<EngineOptions>(m, "EngineOptions")
      .def(py::init<>())
      .def_readwrite("host", &EngineOptions::host)
      .def_readwrite("port", &EngineOptions::port)
      .def_readwrite("transport", &EngineOptions::transport)
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
      // Each transport's section: options.tcp.server_threads = ...
      .def_readwrite("tcp", &EngineOptions::tcp)
      .def_readwrite("shm", &EngineOptions::shm)
      .def_readwrite("fabric", &EngineOptions::fabric)
      .def_readwrite("handshake_timeout_ms", &EngineOptions::handshake_timeout_ms)
      .def_readwrite("idle_timeout_ms", &EngineOptions::idle_timeout_ms)
      .def_readwrite("max_connections", &EngineOptions::max_connections)
      .def_readwrite("max_connections_per_peer", &EngineOptions::max_connections_per_peer);

  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch")
      .def(
          "wait",
          [](Batch& b, double timeout_s) {
            // True only when finished and every request succeeded: the common answer in one call.
            if (!b.is_done()) {  // (a small same-host batch is done on submit: it keeps the GIL)
              py::gil_scoped_release release;
              if (!b.wait(timeout_s)) return false;
            }
            return !b.has_failures();
          },
          py::arg("timeout_s"))
      .def("done", &Batch::is_done)
      .def("has_failures", &Batch::has_failures)
      .def("bytes_done", &Batch::bytes_done)
      .def("results", &batch_results);

  m.def(
      "cuda_device_of", [](uint64_t addr) { return cuda::Driver::get().device_of(addr); }, py::arg("addr"),
      "The ordinal of the GPU whose memory holds addr; -1 when it is not GPU memory (or no CUDA driver).");
  m.def("stream_copy_kind", &stream_copy_kind,
        "Which streaming copy large same-host batches use on this CPU: avx2, sse2 or none (memcpy only).");
  m.def(
      "_stream_copy_with",
      [](const std::string& kind, uint64_t dst, uint64_t src, uint64_t n) {
        py::gil_scoped_release release;
        return stream_copy_with(kind.c_str(), reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      py::arg("kind"), py::arg("dst"), py::arg("src"), py::arg("n"),
      "Tests only: copies n bytes with the named routine (avx2, sse2, memcpy); False if this CPU lacks it.");
  m.def(
      "cuda_driver", [] { return py::make_tuple(cuda::Driver::get().available(), cuda::Driver::get().reason()); },
      "(available, reason): whether this process loaded and initialised the CUDA driver, and what it sees.");

  m.def(
      "check_region_proof",
      [](const std::string& engine, const std::string& secret, const py::bytes& context, uint64_t base,
         uint64_t length, const py::bytes& proof, int timeout_ms) {
        std::string ctx = context, mac = proof;
        if (ctx.size() != 32 || mac.size() != 32)
          TIDEKV_THROW(kConfig, "a region proof and its context are 32 bytes each");
        wire::RegionProof request{wire::kMagic, 0, base, length, {}, {}};
        std::memcpy(request.context, ctx.data(), 32);
        std::memcpy(request.mac, mac.data(), 32);
        std::string host;
        int port = 0;
        split_host_port(engine, &host, &port);
        py::gil_scoped_release release;
        check_region_proof(host, port, secret, request, timeout_ms);
      },
      py::arg("engine"), py::arg("secret"), py::arg("context"), py::arg("base"), py::arg("length"), py::arg("proof"),
      py::arg("timeout_ms"),
      "Asks the engine at host:port whether it vouches for a region proof (common/region_proof.h); raises "
      "SegmentNotRegisteredError, AuthenticationError or PeerUnavailableError when it does not.");

  py::class_<Engine>(m, "Engine")
      .def(py::init<EngineOptions>(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("name", &Engine::name)
      .def_property_readonly("protocol_version", [](const Engine&) { return wire::kProtocolVersion; })
      .def("descriptor", [](const Engine& e) { return py::bytes(e.descriptor()); })
      .def("transports",
           [](const Engine& e) {
             py::list out;
             for (const auto& t : e.transports()) out.append(py::make_tuple(t.name, t.available, t.reason));
             return out;
           })
      .def("register", &Engine::register_region, py::arg("addr"), py::arg("length"), py::arg("location"),
           py::call_guard<py::gil_scoped_release>())
      .def("allocate", &Engine::allocate, py::arg("length"), py::arg("huge") = false, py::call_guard<py::gil_scoped_release>())
      .def("unregister", &Engine::unregister_region, py::arg("addr"), py::call_guard<py::gil_scoped_release>())
      .def(
          "region_proof",
          [](const Engine& e, const py::bytes& context, uint64_t addr, uint64_t length) {
            return py::bytes(e.region_proof(context, addr, length));
          },
          py::arg("context"), py::arg("addr"), py::arg("length"))
      .def("fetch_descriptor",
           [](Engine& e, const std::string& host, int port) {
             std::string d;
             {
               py::gil_scoped_release release;
               d = e.fetch_descriptor(host, port);
             }
             return py::bytes(d);
           })
      .def("add_peer",
           [](Engine& e, const std::string& name, const py::bytes& d) {
             std::string desc = d;
             py::gil_scoped_release release;
             return e.add_peer(name, desc);
           })
      .def("peer_transports", &Engine::peer_transports, py::call_guard<py::gil_scoped_release>())
      .def("submit",
           [](Engine& e, const py::sequence& items) -> py::object {
             std::vector<std::string> unknown;
             std::vector<std::pair<uint32_t, std::string>> names;
             std::vector<Request> reqs = requests_from(e, items, &unknown, &names);
             if (!unknown.empty()) return py::cast(unknown);  // nothing submitted: connect these first
             std::shared_ptr<Batch> batch;
             {
               py::gil_scoped_release release;
               batch = e.submit(std::move(reqs));
             }
             // Finished and all succeeded already (a small same-host copy is done on submit):
             // nothing left to ask of it, so no Python object is made for it (a tenth of the cost
             // of a 4 KiB shm request went into making and freeing that object).
             if (batch->is_done() && !batch->has_failures()) return py::none();
             batch->set_peer_names(std::move(names));
             return py::cast(batch);
           })
      .def("stats",
           [](Engine& e) {
             const Counters& c = e.context().counters;
             py::dict d;
             d["batches"] = c.batches.load();
             d["bytes_read"] = c.bytes_read.load();
             d["bytes_written"] = c.bytes_written.load();
             d["shm_bytes"] = c.shm_bytes.load();
             d["shm_streamed_bytes"] = c.shm_streamed_bytes.load();
             d["cuda_bytes"] = c.cuda_bytes.load();
             d["fabric_bytes"] = c.fabric_bytes.load();
             d["served_bytes"] = c.served_bytes.load();
             d["frames_refused"] = c.frames_refused.load();
             d["connections_accepted"] = c.connections_accepted.load();
             d["connections_refused"] = c.connections_refused.load();
             d["connections_opened"] = c.connections_opened.load();
             d["connections_limited"] = c.connections_limited.load();
             d["connections_idle_closed"] = c.connections_idle_closed.load();
             d["connections_open"] = c.connections_open.load();
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
