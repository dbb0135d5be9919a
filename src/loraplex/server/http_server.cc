#include "loraplex/server/http_server.h"

#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>

#include "loraplex/core/error.h"
#include "loraplex/server/elastic_thread_pool.h"
#include "loraplex/server/socket_stream.h"

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

// SO_REUSEADDR alone, on the listening socket and in check_can_listen alike: an address whose
// old connections wait in TIME_WAIT binds at once (a restart), one that a process listens on
// does not. httplib's default, SO_REUSEPORT, is the other way round on Linux: TIME_WAIT blocks
// a restart for a minute, and a second server binds the same port and takes half its clients.
void listen_socket_options(int fd) {
  const int yes = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

// The connection being served on this thread, so that the pre-routing handler (which runs once
// the headers are read, before the body is) can give the body its own deadline.
thread_local SocketStream* current_connection = nullptr;

// httplib's task queue as the elastic pool: a connection never waits for another's thread.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { pool_.enqueue(std::move(fn)); }
  void shutdown() override { pool_.shutdown(); }

 private:
  // A few threads stay for the next connections; the rest end after a minute unused.
  ElasticThreadPool pool_{8, std::chrono::seconds(60)};
};

// httplib's server with the connection handling replaced: a connection cap, deadlines for a
// request's head and body, an idle timeout between requests, and a way to close every open
// connection at once when the server stops.
class ConnectionServer : public httplib::Server {
 public:
  explicit ConnectionServer(const HttpOptions& options) : options_(options) {}

  // httplib listens with a backlog of 5, so a burst of clients connecting at once overflows
  // the accept queue and some get reset. Linux takes a second listen() on a bound socket as a
  // new backlog.
  void widen_backlog() {
    const socket_t fd = svr_sock_;
    if (fd != INVALID_SOCKET) ::listen(fd, SOMAXCONN);
  }

  // Every open connection's reads and writes fail from now on, and no new one is served.
  void close_connections() {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
    for (const int fd : open_) ::shutdown(fd, SHUT_RDWR);
  }

  size_t connections() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return open_.size();
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    bool admitted = false;
    bool closing = false;
    size_t open = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open = open_.size();
      closing = closing_;
      admitted = !closing && open < options_.max_connections;
      if (admitted) open_.insert(sock);
    }
    if (!admitted) {
      if (!closing) refuse(sock, open);
      ::close(sock);
      return false;
    }
    bool ok = false;
    {
      SocketStream connection(sock, options_.write_timeout);
      current_connection = &connection;
      for (size_t left = keep_alive_max_count_; left > 0; --left) {
        if (!connection.wait_for_request(options_.idle_timeout)) break;
        connection.set_read_deadline(SocketStream::Clock::now() + options_.header_timeout);
        bool closed = false;
        ok = process_request(connection, left == 1, closed, nullptr);
        connection.clear_read_deadline();
        if (!ok || closed) break;
      }
      current_connection = nullptr;
    }
    {
      // Under the lock: close_connections() must never shut down a number reused by then.
      std::lock_guard<std::mutex> lock(mutex_);
      open_.erase(sock);
      ::shutdown(sock, SHUT_RDWR);
      ::close(sock);
    }
    return ok;
  }

  // A connection over the cap: a 503 in OpenAI's shape, then close (after reading what the
  // client sent, briefly, so that closing does not reset the connection before it reads the
  // answer).
  void refuse(int sock, size_t open) const {
    const std::string body =
        error_body(ApiError{503,
                            "the server has " + std::to_string(open) +
                                " connections open, its limit (--max-connections); try again later",
                            "", ""});
    const std::string response =
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\nConnection: close\r\nRetry-After: 1\r\n\r\n" + body;
    if (::send(sock, response.data(), response.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) return;
    ::shutdown(sock, SHUT_WR);
    char buf[4096];
    for (int i = 0; i < 10; ++i) {
      pollfd p{sock, POLLIN, 0};
      if (::poll(&p, 1, 10) <= 0 || ::recv(sock, buf, sizeof(buf), MSG_DONTWAIT) <= 0) break;
    }
  }

  const HttpOptions& options_;
  mutable std::mutex mutex_;
  std::set<int> open_;
  bool closing_ = false;
};

// The media type of a Content-Type value, lower case, without parameters ("; charset=...").
std::string media_type(const std::string& content_type) {
  std::string t = content_type.substr(0, content_type.find(';'));
  const size_t first = t.find_first_not_of(" \t");
  const size_t last = t.find_last_not_of(" \t");
  t = first == std::string::npos ? std::string() : t.substr(first, last - first + 1);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return t;
}

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
  ConnectionServer http;

  Impl(OpenAIService& s, HttpOptions o) : service(s), options(std::move(o)), http(options) {}

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
            if (!success) submitted->abort();
          });
    });
  }

  void routes() {
    http.set_payload_max_length(options.max_body_bytes);
    http.set_socket_options(listen_socket_options);
    // Without TCP_NODELAY a response written as headers then body waits for the client's
    // delayed ACK (about 40 ms on Linux); every small response and SSE chunk would.
    http.set_tcp_nodelay(true);
    // httplib closes a keep-alive connection after 5 requests by default; clients that reuse
    // connections (the openai client, load generators) would reconnect every few requests.
    http.set_keep_alive_max_count(1000);
    http.new_task_queue = [] { return new ConnectionThreads(); };
    // Runs once the headers are read and before the body is: a request refused here never
    // has its body read.
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      // The head has arrived; the body gets its own deadline.
      if (current_connection != nullptr) {
        current_connection->set_read_deadline(SocketStream::Clock::now() + options.body_timeout);
      }
      // vLLM checks the key on the OpenAI routes only; health, version and metrics stay open
      // for probes and scrapers.
      if (!options.api_key.empty() && req.path.rfind("/v1", 0) == 0) {
        const std::string auth = req.get_header_value("Authorization");
        const std::string prefix = "Bearer ";
        if (auth.rfind(prefix, 0) != 0 || !same_key(auth.substr(prefix.size()), options.api_key)) {
          set_error(res, ApiError{401, "invalid or missing API key (Authorization: Bearer KEY)",
                                  "AuthenticationError", ""});
          return httplib::Server::HandlerResponse::Handled;
        }
      }
      // Every POST body is JSON. Refusing other types keeps browsers from driving the API
      // cross-site: a form or a text/plain fetch needs no CORS preflight, an application/json
      // one does.
      if (req.method == "POST") {
        const std::string type = req.get_header_value("Content-Type");
        if (media_type(type) != "application/json") {
          set_error(res, ApiError{415,
                                  "Content-Type must be application/json, got " +
                                      (type.empty() ? std::string("none") : "'" + type + "'"),
                                  "", ""});
          return httplib::Server::HandlerResponse::Handled;
        }
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
    // As the server binds: an address in TIME_WAIT is free, one a process listens on is not.
    listen_socket_options(fd);
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
  impl_->http.close_connections();
}

size_t HttpServer::connections() const { return impl_->http.connections(); }

}  // namespace loraplex::server
