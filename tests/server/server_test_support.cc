#include "server_test_support.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>

namespace loraplex::server::testing {

using json = nlohmann::ordered_json;

const char* const kChatml =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

Events parse_sse(const std::string& body) {
  Events e;
  size_t pos = 0;
  while (true) {
    const size_t start = body.find("data: ", pos);
    if (start == std::string::npos) break;
    const size_t end = body.find("\n\n", start);
    const std::string data = body.substr(start + 6, end - start - 6);
    if (data == "[DONE]") {
      e.done = true;
    } else {
      e.chunks.push_back(json::parse(data));
    }
    pos = end == std::string::npos ? body.size() : end + 2;
  }
  return e;
}

RawConnection::RawConnection(int port) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
}

bool RawConnection::send_raw(const std::string& data) {
  return ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
}

bool RawConnection::send_post(const std::string& path, const std::string& body) {
  return send_raw("POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
                  "Content-Type: application/json\r\nContent-Length: " +
                  std::to_string(body.size()) + "\r\n\r\n" + body);
}

namespace {

// The next bytes from `fd`, waiting until `deadline`: empty when none came in time, and
// `closed` set when the peer ended the stream (or reset it).
std::string next_bytes(int fd, std::chrono::steady_clock::time_point deadline, bool& closed) {
  closed = false;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  if (left.count() <= 0) return "";
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
  char buf[4096];
  const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  closed = n <= 0;
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

}  // namespace

std::string RawConnection::read_until(const std::string& needle, int times, int timeout_ms) {
  std::string got;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int seen = 0;
    for (size_t p = got.find(needle); p != std::string::npos; p = got.find(needle, p + 1)) ++seen;
    if (seen >= times) return got;
    bool closed = false;
    const std::string more = next_bytes(fd_, deadline, closed);
    if (more.empty()) return got;
    got += more;
  }
}

bool RawConnection::closed_by_peer(int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    bool closed = false;
    if (next_bytes(fd_, deadline, closed).empty()) return closed;
  }
}

void RawConnection::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void ServerTest::SetUp() {
  lora_dir_ = std::filesystem::temp_directory_path() /
              ("loraplex_server_test_" + std::to_string(::getpid()) + "_" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(lora_dir_ / "sql");
  std::ofstream(lora_dir_ / "sql" / "adapter_config.json") << "{}";
  std::filesystem::create_directories(lora_dir_ / "pirate");
  std::ofstream(lora_dir_ / "pirate" / "adapter_config.json") << "{}";
  std::filesystem::create_directories(lora_dir_ / "broken");  // no adapter_config.json
  backend_.max_model_len_ = 400;
  config_.served_model_name = "base-model";
  config_.model_root = "/models/base";
  config_.lora_dir = lora_dir_.string();
  config_.chat_template =
      std::make_shared<jinja::ChatTemplate>(kChatml, json::object(), "test template");
  config_.version = "9.9.9";
  config_.poll_interval = std::chrono::milliseconds(5);
  http_.port = 0;
}

void ServerTest::start(const std::string& api_key, size_t max_body) {
  service_ = std::make_unique<OpenAIService>(backend_, config_);
  HttpOptions http = http_;
  http.api_key = api_key;
  http.max_body_bytes = max_body;
  server_ = std::make_unique<HttpServer>(*service_, http);
  port_ = server_->bind();
  thread_ = std::thread([this] { server_->serve(); });
}

void ServerTest::allow_runtime_loading() {
  config_.runtime_lora_updating = true;
  config_.lora_roots = {lora_dir_.string()};
}

void ServerTest::TearDown() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
  server_.reset();
  service_.reset();
  std::filesystem::remove_all(lora_dir_);
}

httplib::Client ServerTest::client() {
  httplib::Client c("127.0.0.1", port_);
  c.set_read_timeout(30, 0);
  return c;
}

httplib::Result ServerTest::post(const std::string& path, const json& body,
                                 httplib::Headers headers) {
  return client().Post(path.c_str(), headers, body.dump(), "application/json");
}

json ServerTest::error_of(const httplib::Result& r) { return json::parse(r->body).at("error"); }

std::string ServerTest::expected_completion(const std::string& prompt, const std::string& adapter,
                                            int64_t max_tokens) {
  return FakeBackend::expected_text(
      FakeBackend::expected_tokens(backend_.encode(prompt, true), adapter, max_tokens));
}

}  // namespace loraplex::server::testing
