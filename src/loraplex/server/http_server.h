#pragma once
// The HTTP front of `loraplex serve` (cpp-httplib): routes the OpenAI and vLLM endpoints to
// OpenAIService, checks the API key on /v1/* (401), the body's Content-Type (415) and size
// (413), answers unknown paths and malformed requests in OpenAI's error shape, and streams
// server-sent events, aborting a request whose client disconnects. The only code that knows
// HTTP.
//
// Connections: each open connection holds a thread (a stream blocks on its request's output),
// from a pool that grows with the connections (elastic_thread_pool.h) up to max_connections;
// one beyond it gets a 503 and is closed. Slow or idle clients cannot hold threads for long:
// a request's head and body must arrive within their timeouts, and a connection with no
// request for idle_timeout is closed (socket_stream.h).

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "loraplex/server/openai_service.h"

namespace loraplex::server {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;      // 0: any free port (tests)
  std::string api_key;  // empty: no key needed
  size_t max_body_bytes = 16u << 20;
  /// Connections open at once (streams, requests, idle keep-alive ones), each with a thread.
  size_t max_connections = 4096;
  /// A connection with no request for this long (a new one, or kept alive) is closed.
  std::chrono::milliseconds idle_timeout{5000};
  /// From a request's first byte, the time its request line and headers may take.
  std::chrono::milliseconds header_timeout{10000};
  /// After its headers, the time its body may take.
  std::chrono::milliseconds body_timeout{60000};
  /// How long a write may wait for a client that stops reading (its request is then aborted).
  std::chrono::milliseconds write_timeout{60000};
};

/// Throws loraplex::Error naming the address and the reason when `host`:`port` cannot be
/// bound now (in use, not an address of this machine). A quick check before a slow start-up;
/// HttpServer::bind binds for real later. Port 0 always passes.
void check_can_listen(const std::string& host, int port);

class HttpServer {
 public:
  HttpServer(OpenAIService& service, HttpOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  /// Binds the listening socket and returns its port; throws loraplex::Error naming the host
  /// and port when it cannot.
  int bind();
  /// Serves until stop() (blocks the calling thread); false when the accept loop failed.
  bool serve();
  /// Stops accepting connections, makes waiting handlers abort their requests and closes the
  /// open connections. Safe from any thread, more than once.
  void stop();
  /// Connections open now.
  size_t connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loraplex::server
