#pragma once
// What the HTTP server's tests share: a real server on 127.0.0.1 and a free port over the fake
// backend (ServerTest), server-sent events parsed back into JSON, and a raw connection for the
// tests that need to stop reading, hang up mid-response or write bytes slowly.

#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "fake_backend.h"
#include "loraplex/server/http_server.h"
#include "loraplex/server/openai_service.h"

namespace loraplex::server::testing {

/// A ChatML-like template: enough to check that chat requests are rendered.
extern const char* const kChatml;

/// SSE events of a response body: the JSON after each "data: ", and whether [DONE] closed it.
struct Events {
  std::vector<nlohmann::ordered_json> chunks;
  bool done = false;
};
Events parse_sse(const std::string& body);

/// A raw TCP connection to 127.0.0.1:port.
class RawConnection {
 public:
  explicit RawConnection(int port);
  ~RawConnection() { close(); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;
  bool connected() const { return connected_; }
  /// A whole POST with a JSON body; false when the send failed.
  bool send_post(const std::string& path, const std::string& body);
  /// Sends `data` as it is; false when the send failed (the server closed the connection).
  bool send_raw(const std::string& data);
  /// Reads until `needle` has been seen `times` times, or the peer closes, or `timeout_ms`.
  std::string read_until(const std::string& needle, int times, int timeout_ms = 30000);
  /// Whether the server has closed the connection (waits up to `timeout_ms` for it).
  bool closed_by_peer(int timeout_ms);
  void close();

 private:
  int fd_ = -1;
  bool connected_ = false;
};

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  /// Starts the server with `http_` and `config_` (set them before), a free port, and
  /// api_key / max_body when given.
  void start(const std::string& api_key = "", size_t max_body = 1 << 20);
  /// --enable-lora-loading with --lora-dir = lora_dir_ (call before start()).
  void allow_runtime_loading();
  httplib::Client client();
  httplib::Result post(const std::string& path, const nlohmann::ordered_json& body,
                       httplib::Headers headers = {});
  static nlohmann::ordered_json error_of(const httplib::Result& r);
  /// The completion text the fake produces for a text prompt on `adapter`.
  std::string expected_completion(const std::string& prompt, const std::string& adapter,
                                  int64_t max_tokens);

  FakeBackend backend_;
  ServiceConfig config_;
  HttpOptions http_;
  std::unique_ptr<OpenAIService> service_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  int port_ = 0;
  std::filesystem::path lora_dir_;
};

}  // namespace loraplex::server::testing
