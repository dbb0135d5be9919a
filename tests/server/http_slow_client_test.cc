// Slow and idle clients do not block anyone (bounded: 150 of each, short timeouts): /health and
// completions are answered while they hold connections, the server closes them once their
// header or idle timeout passes, and a connection over --max-connections gets a 503 at once.

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "server_test_support.h"

namespace loraplex::server {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::ordered_json;
using testing::RawConnection;
using testing::ServerTest;

constexpr int kSlow = 150;
constexpr int kIdle = 150;

class SlowClientTest : public ServerTest {
 protected:
  void SetUp() override {
    ServerTest::SetUp();
    http_.idle_timeout = 1500ms;
    http_.header_timeout = 1500ms;
  }
};

TEST_F(SlowClientTest, SlowAndIdleConnectionsBlockNobody) {
  start();
  std::vector<std::unique_ptr<RawConnection>> slow;
  std::vector<std::unique_ptr<RawConnection>> idle;
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: ";
  for (int i = 0; i < kSlow; ++i) {
    slow.push_back(std::make_unique<RawConnection>(port_));
    ASSERT_TRUE(slow.back()->connected());
    ASSERT_TRUE(slow.back()->send_raw(head.substr(0, 1)));
  }
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(std::make_unique<RawConnection>(port_));
    ASSERT_TRUE(idle.back()->connected());
  }
  // While the slow ones trickle a byte at a time (each byte well within a per-read timeout),
  // everyone else is served.
  std::atomic<bool> trickling{true};
  std::thread trickle([&] {
    for (size_t k = 1; trickling && k < head.size(); ++k) {
      for (auto& c : slow) c->send_raw(head.substr(k, 1));
      std::this_thread::sleep_for(100ms);
    }
  });
  httplib::Client c("127.0.0.1", port_);
  c.set_read_timeout(10, 0);
  c.set_connection_timeout(10, 0);
  for (int i = 0; i < 10; ++i) {
    auto health = c.Get("/health");
    ASSERT_TRUE(health) << "request " << i << ": " << httplib::to_string(health.error());
    EXPECT_EQ(health->status, 200);
  }
  auto r = c.Post("/v1/completions",
                  json{{"prompt", "busy"}, {"max_tokens", 8}, {"stream", true}}.dump(),
                  "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_TRUE(testing::parse_sse(r->body).done);
  EXPECT_GE(server_->connections(), static_cast<size_t>(kSlow + kIdle));
  // Their time runs out: the header timeout for the slow ones, the idle timeout for the rest.
  for (auto& s : slow) EXPECT_TRUE(s->closed_by_peer(20000));
  for (auto& s : idle) EXPECT_TRUE(s->closed_by_peer(20000));
  trickling = false;
  trickle.join();
  EXPECT_TRUE(c.Get("/health"));
}

TEST_F(SlowClientTest, ASlowBodyIsCutAfterTheBodyTimeout) {
  http_.body_timeout = 1000ms;
  start();
  RawConnection conn(port_);
  ASSERT_TRUE(
      conn.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 100\r\n\r\n{\"prompt\":"));
  EXPECT_TRUE(conn.closed_by_peer(20000));
  EXPECT_EQ(backend_.submitted, 0);
}

TEST_F(SlowClientTest, ConnectionsOverTheCapGet503) {
  http_.max_connections = 8;
  start();
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 8; ++i) held.push_back(std::make_unique<RawConnection>(port_));
  // The server counts a connection once a thread has taken it: wait for all eight.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (server_->connections() < 8 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(server_->connections(), 8u);
  RawConnection over(port_);
  ASSERT_TRUE(over.connected());
  over.send_raw("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string got = over.read_until("}", 1, 20000);
  EXPECT_NE(got.find("HTTP/1.1 503"), std::string::npos) << got;
  EXPECT_NE(got.find("--max-connections"), std::string::npos) << got;
  held.clear();  // the held ones leave: the server takes new connections again
  httplib::Client c("127.0.0.1", port_);
  c.set_read_timeout(10, 0);
  bool served = false;
  for (int i = 0; i < 200 && !served; ++i) {
    auto health = c.Get("/health");
    served = health && health->status == 200;
    if (!served) std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(served);
}

}  // namespace
}  // namespace loraplex::server
