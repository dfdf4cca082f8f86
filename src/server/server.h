#pragma once
// The OpenAI-compatible HTTP server (cpp-httplib). Handler threads parse and validate requests,
// submit them to the Scheduler and turn its per-request events into responses: one JSON body, or
// server-sent events when stream is true. A client that goes away (a failed write, or a dead
// socket found while waiting) has its request cancelled, which frees its cache row.
//
// Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize and
// /detokenize (vLLM's), GET /health (503 while loading), GET /metrics (Prometheus text).
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "runtime/scheduler.h"
#include "server/openai_api.h"

namespace vireo::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                   // 0: any free port (the chosen one is returned by bind())
  std::string api_key;               // empty: no authentication
  size_t max_body_bytes = 8u << 20;  // larger bodies get 413
  int http_threads = 64;             // handler threads (each open stream holds one)
};

class HttpServer {
 public:
  explicit HttpServer(const ServerOptions& opt);
  ~HttpServer();
  // Binds the listening socket; returns the port. Throws vireo::Error naming host and port.
  int bind();
  // Serves on a background thread; until ready() every generation request and /health get 503.
  void start();
  // The model is loaded: serve it through `scheduler` (which must outlive stop()).
  void ready(ServedModel model, Scheduler& scheduler);
  // Stops accepting and ends open streams (their requests are cancelled), then waits up to
  // `grace` for httplib's threads; false if some are still parked on idle keep-alive connections
  // (then the server must not be destroyed: the caller exits the process instead).
  bool stop(std::chrono::milliseconds grace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vireo::server
