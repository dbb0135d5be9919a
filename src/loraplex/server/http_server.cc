#include "loraplex/server/http_server.h"

#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "loraplex/core/error.h"

namespace loraplex::server {
namespace {

void set_reply(httplib::Response& res, const HttpReply& reply) {
  res.status = reply.status;
  res.set_content(reply.body, reply.content_type.c_str());
}

void set_error(httplib::Response& res, const ApiError& error) {
  res.status = error.status;
  res.set_content(error_body(error), "application/json");
}

// The connection as the service's ChunkSink.
class HttplibSink : public ChunkSink {
 public:
  explicit HttplibSink(httplib::DataSink& sink) : sink_(sink) {}
  bool write(const std::string& data) override {
    return sink_.is_writable() && sink_.write(data.data(), data.size());
  }
  bool connected() override { return sink_.is_writable(); }

 private:
  httplib::DataSink& sink_;
};

// cpp-httplib listens with a backlog of 5, so a burst of clients connecting at once overflows
// the accept queue and some get reset. Linux takes a second listen() on a bound socket as a
// new backlog, and the listening socket is only reachable from a subclass.
class BackloggedServer : public httplib::Server {
 public:
  void widen_backlog() {
    const socket_t fd = svr_sock_;
    if (fd != INVALID_SOCKET) ::listen(fd, SOMAXCONN);
  }
};

// Compares without leaking the key's length or content through timing.
bool same_key(const std::string& given, const std::string& key) {
  unsigned char diff = given.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ key[i % (key.empty() ? 1 : key.size())]);
  }
  return diff == 0;
}

}  // namespace

struct HttpServer::Impl {
  OpenAIService& service;
  HttpOptions options;
  BackloggedServer http;

  Impl(OpenAIService& s, HttpOptions o) : service(s), options(std::move(o)) {}

  // Runs a handler body, turning ApiExceptions and anything else into OpenAI error JSON.
  template <typename F>
  void guarded(httplib::Response& res, F&& body) {
    try {
      body();
    } catch (const ApiException& e) {
      set_error(res, e.error());
    } catch (const std::exception& e) {
      set_error(res, ApiError{500, std::string("internal error: ") + e.what(), "", ""});
    }
  }

  void generation(GenerationRequest::Kind kind, const httplib::Request& req,
                  httplib::Response& res) {
    guarded(res, [&] {
      auto submitted = std::make_shared<OpenAIService::Submitted>(service.submit(kind, req.body));
      if (!submitted->request.stream) {
        set_reply(res, service.complete(*submitted));
        return;
      }
      res.set_header("Cache-Control", "no-cache");
      res.set_chunked_content_provider(
          "text/event-stream",
          [this, submitted](size_t, httplib::DataSink& sink) {
            HttplibSink out(sink);
            service.stream(*submitted, out);
            sink.done();
            return true;
          },
          [submitted](bool success) {
            // A response that did not complete (the client left mid-write) ends its request.
            if (!success) submitted->stream->abort();
          });
    });
  }

  void routes() {
    http.set_payload_max_length(options.max_body_bytes);
    // Without TCP_NODELAY a response written as headers then body waits for the client's
    // delayed ACK (about 40 ms on Linux); every small response and SSE chunk would.
    http.set_tcp_nodelay(true);
    // httplib closes a keep-alive connection after 5 requests by default; clients that reuse
    // connections (the openai client, load generators) would reconnect every few requests.
    http.set_keep_alive_max_count(1000);
    const int threads = options.threads;
    http.new_task_queue = [threads] {
      return new httplib::ThreadPool(static_cast<size_t>(threads));
    };
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      // vLLM checks the key on the OpenAI routes only; health, version and metrics stay open
      // for probes and scrapers.
      if (options.api_key.empty() || req.path.rfind("/v1", 0) != 0) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      const std::string auth = req.get_header_value("Authorization");
      const std::string prefix = "Bearer ";
      if (auth.rfind(prefix, 0) != 0 || !same_key(auth.substr(prefix.size()), options.api_key)) {
        set_error(res, ApiError{401, "invalid or missing API key (Authorization: Bearer KEY)",
                                "AuthenticationError", ""});
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      res.status = service.stopping() ? 503 : 200;
    });
    http.Get("/version", [this](const httplib::Request&, httplib::Response& res) {
      set_reply(res, service.version());
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      guarded(res, [&] { set_reply(res, service.metrics()); });
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      guarded(res, [&] { set_reply(res, service.list_models()); });
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      generation(GenerationRequest::Kind::kCompletion, req, res);
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      generation(GenerationRequest::Kind::kChat, req, res);
    });
    http.Post("/v1/load_lora_adapter", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { set_reply(res, service.load_adapter(req.body)); });
    });
    http.Post("/v1/unload_lora_adapter",
              [this](const httplib::Request& req, httplib::Response& res) {
                guarded(res, [&] { set_reply(res, service.unload_adapter(req.body)); });
              });
    // Failures httplib answers itself (no route, body too large, a malformed request) get
    // OpenAI's error shape; responses a handler filled in are left alone.
    const httplib::Server::HandlerWithResponse on_error = [this](const httplib::Request& req,
                                                                 httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      std::string message;
      switch (res.status) {
        case 404:
          message = "no route for " + req.method + " " + req.path;
          break;
        case 413:
          message = "the request body is larger than " + std::to_string(options.max_body_bytes) +
                    " bytes";
          break;
        default:
          message = "HTTP error " + std::to_string(res.status);
      }
      set_error(res, ApiError{res.status, message, "", ""});
      return httplib::Server::HandlerResponse::Handled;
    };
    http.set_error_handler(on_error);
    http.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
          std::string what = "unknown exception";
          try {
            if (ep) std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          set_error(res, ApiError{500, "internal error: " + what, "", ""});
        });
  }
};

HttpServer::HttpServer(OpenAIService& service, HttpOptions options)
    : impl_(std::make_unique<Impl>(service, std::move(options))) {
  impl_->routes();
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  const HttpOptions& o = impl_->options;
  int port = o.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(o.host);
    LORAPLEX_CHECK(port > 0, "cannot listen on ", o.host, " (any port)");
  } else {
    LORAPLEX_CHECK(impl_->http.bind_to_port(o.host, port), "cannot listen on ", o.host, ":", port,
                   " (in use, or not an address of this machine)");
  }
  impl_->http.widen_backlog();
  return port;
}

bool HttpServer::serve() { return impl_->http.listen_after_bind(); }

void check_can_listen(const std::string& host, int port) {
  if (port == 0) return;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  LORAPLEX_CHECK(rc == 0, "cannot listen on ", host, ":", port, ": ", ::gai_strerror(rc));
  int error = 0;
  bool bound = false;
  for (addrinfo* a = found; a != nullptr && !bound; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) {
      error = errno;
      continue;
    }
    // As httplib binds: an address in TIME_WAIT is free, one that a process listens on is not.
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    bound = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!bound) error = errno;
    ::close(fd);
  }
  ::freeaddrinfo(found);
  LORAPLEX_CHECK(
      bound, "cannot listen on ", host, ":", port, ": ", std::strerror(error),
      error == EADDRINUSE ? " (another process listens there; pick another --port)" : "");
}

void HttpServer::stop() {
  impl_->service.shutdown();
  impl_->http.stop();
}

}  // namespace loraplex::server
