// Binding the listening socket: a restart on the same port comes up at once after the old
// server closed connections itself (its side of them then sits in TIME_WAIT for a minute), and
// a port that another server listens on is refused by both the start-up check and the bind.

#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fake_backend.h"
#include "loraplex/core/error.h"
#include "loraplex/server/http_server.h"
#include "loraplex/server/openai_service.h"

namespace loraplex::server {
namespace {

using testing::FakeBackend;

// Whether /proc/net/tcp has a TIME_WAIT socket (state 06) on local port `port`.
bool has_time_wait(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // the header
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    const size_t colon = local.find(':');
    if (colon == std::string::npos) continue;
    if (std::stoi(local.substr(colon + 1), nullptr, 16) == port && state == "06") return true;
  }
  return false;
}

class RunningServer {
 public:
  RunningServer(FakeBackend& backend, int port) {
    ServiceConfig config;
    config.served_model_name = "base-model";
    config.poll_interval = std::chrono::milliseconds(5);
    service_ = std::make_unique<OpenAIService>(backend, config);
    HttpOptions http;
    http.port = port;
    server_ = std::make_unique<HttpServer>(*service_, http);
  }
  ~RunningServer() { stop(); }
  int bind() { return port_ = server_->bind(); }
  void serve() {
    thread_ = std::thread([this] { server_->serve(); });
  }
  void stop() {
    server_->stop();
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }

 private:
  std::unique_ptr<OpenAIService> service_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  int port_ = 0;
};

TEST(HttpListen, RestartOnTheSamePortAfterTraffic) {
  FakeBackend backend;
  int port = 0;
  {
    RunningServer first(backend, 0);
    port = first.bind();
    first.serve();
    // Keep-alive connections that are still open when the server stops: the server closes
    // them, so its side of each waits in TIME_WAIT.
    std::vector<std::unique_ptr<httplib::Client>> clients;
    for (int i = 0; i < 4; ++i) {
      clients.push_back(std::make_unique<httplib::Client>("127.0.0.1", port));
      clients.back()->set_keep_alive(true);
      auto r = clients.back()->Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 3})",
                                    "application/json");
      ASSERT_TRUE(r);
      ASSERT_EQ(r->status, 200) << r->body;
    }
    first.stop();
  }
  ASSERT_TRUE(has_time_wait(port)) << "the old server's connections left no TIME_WAIT socket";
  EXPECT_NO_THROW(check_can_listen("127.0.0.1", port));
  RunningServer second(backend, port);
  ASSERT_NO_THROW(second.bind());
  second.serve();
  httplib::Client c("127.0.0.1", port);
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST(HttpListen, APortAnotherServerListensOnIsRefused) {
  FakeBackend backend;
  RunningServer first(backend, 0);
  const int port = first.bind();
  first.serve();
  try {
    check_can_listen("127.0.0.1", port);
    ADD_FAILURE() << "check_can_listen accepted a port another server listens on";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(port)), std::string::npos) << e.what();
  }
  RunningServer second(backend, port);
  EXPECT_THROW(second.bind(), Error);
  // The first one still answers.
  httplib::Client c("127.0.0.1", port);
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

}  // namespace
}  // namespace loraplex::server
