#pragma once
// The HTTP front of `loraplex serve` (cpp-httplib, a thread per connection from a pool): routes
// the OpenAI and vLLM endpoints to OpenAIService, checks the API key on /v1/* (401), limits the
// body size (413), answers unknown paths and malformed requests in OpenAI's error shape, and
// streams server-sent events, aborting a request whose client disconnects. The only code that
// knows HTTP.

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
  int threads = 64;  // connections served at once (streams hold one each)
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
  /// Stops accepting connections and makes waiting handlers abort their requests. Safe from
  /// any thread, more than once.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loraplex::server
