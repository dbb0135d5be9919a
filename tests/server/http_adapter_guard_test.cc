// What keeps the adapter endpoints and the request body from being abused: runtime loading is
// off unless enabled, loads read only under the allowed roots (and a refusal says the same
// whether the path exists or not), POST bodies must be declared JSON, and adapter names stay in
// their character set.

#include <unistd.h>

#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server_test_support.h"

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;
using testing::ServerTest;

namespace fs = std::filesystem;

class AdapterGuardTest : public ServerTest {
 protected:
  void SetUp() override {
    ServerTest::SetUp();
    outside_ = fs::temp_directory_path() /
               ("loraplex_outside_" + std::to_string(::getpid()) + "_" +
                ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(outside_ / "secret");
    std::ofstream(outside_ / "secret" / "adapter_config.json") << "{}";
  }
  void TearDown() override {
    ServerTest::TearDown();
    fs::remove_all(outside_);
  }
  httplib::Result load(const std::string& name, const std::string& path) {
    return post("/v1/load_lora_adapter", {{"lora_name", name}, {"lora_path", path}});
  }
  fs::path outside_;
};

TEST_F(AdapterGuardTest, RuntimeLoadingIsOffUnlessEnabled) {
  start();
  auto load_r = load("sql", (lora_dir_ / "sql").string());
  ASSERT_TRUE(load_r);
  EXPECT_EQ(load_r->status, 404);
  EXPECT_NE(error_of(load_r).at("message").get<std::string>().find("--enable-lora-loading"),
            std::string::npos)
      << load_r->body;
  backend_.load_adapter("pirate", (lora_dir_ / "pirate").string());
  auto unload = post("/v1/unload_lora_adapter", {{"lora_name", "pirate"}});
  ASSERT_TRUE(unload);
  EXPECT_EQ(unload->status, 404);
  EXPECT_EQ(backend_.loads, 1);  // only the test's own load
  EXPECT_TRUE(backend_.has_adapter("pirate"));
  // --lora-dir still resolves names on first use: the operator chose that directory.
  auto r = post("/v1/completions", {{"model", "sql"}, {"prompt", "x"}, {"max_tokens", 2}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
}

TEST_F(AdapterGuardTest, LoadsOnlyFromUnderTheAllowedRoots) {
  allow_runtime_loading();
  start();
  // An adapter that exists outside the roots and a path that does not exist: the same answer.
  auto exists = load("a", (outside_ / "secret").string());
  auto absent = load("a", (outside_ / "nothing").string());
  ASSERT_TRUE(exists);
  ASSERT_TRUE(absent);
  EXPECT_EQ(exists->status, 400);
  EXPECT_EQ(absent->status, exists->status);
  EXPECT_EQ(error_of(exists).at("param"), "lora_path");
  const std::string m1 = error_of(exists).at("message");
  const std::string m2 = error_of(absent).at("message");
  const std::string path1 = (outside_ / "secret").string();
  const std::string path2 = (outside_ / "nothing").string();
  ASSERT_NE(m1.find(path1), std::string::npos) << m1;
  ASSERT_NE(m2.find(path2), std::string::npos) << m2;
  EXPECT_EQ(m1.substr(0, m1.find(path1)), m2.substr(0, m2.find(path2)));
  EXPECT_EQ(m1.substr(m1.find(path1) + path1.size()), m2.substr(m2.find(path2) + path2.size()));
  // Escapes: .. out of a root, and a symlink inside a root that points outside.
  auto dotdot = load("b", (lora_dir_ / ".." / outside_.filename() / "secret").string());
  ASSERT_TRUE(dotdot);
  EXPECT_EQ(dotdot->status, 400) << dotdot->body;
  fs::create_directory_symlink(outside_ / "secret", lora_dir_ / "link");
  auto link = load("c", (lora_dir_ / "link").string());
  ASSERT_TRUE(link);
  EXPECT_EQ(link->status, 400) << link->body;
  auto relative = load("d", "secret");
  ASSERT_TRUE(relative);
  EXPECT_EQ(relative->status, 400) << relative->body;
  EXPECT_EQ(backend_.loads, 0);
  // Under a root: a missing directory is a 404, an adapter loads.
  auto missing = load("e", (lora_dir_ / "nothing").string());
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  auto ok = load("f", (lora_dir_ / "sql" / ".").string());
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(backend_.loads, 1);
}

TEST_F(AdapterGuardTest, PostBodiesMustBeDeclaredJson) {
  allow_runtime_loading();
  start();
  auto c = client();
  const std::string body = R"({"prompt": "x", "max_tokens": 2})";
  for (const char* type : {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                           "application/jsonx"}) {
    auto r = c.Post("/v1/completions", body, type);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 415) << type;
    EXPECT_EQ(error_of(r).at("type"), "UnsupportedMediaTypeError");
    EXPECT_NE(error_of(r).at("message").get<std::string>().find(type), std::string::npos);
  }
  auto load_r = c.Post("/v1/load_lora_adapter",
                       json{{"lora_name", "s"}, {"lora_path", (lora_dir_ / "sql").string()}}.dump(),
                       "text/plain");
  ASSERT_TRUE(load_r);
  EXPECT_EQ(load_r->status, 415);
  // No Content-Type at all (a fetch() of a Blob sends none, without a preflight).
  {
    testing::RawConnection raw(port_);
    ASSERT_TRUE(raw.send_raw("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                             std::to_string(body.size()) + "\r\n\r\n" + body));
    EXPECT_NE(raw.read_until("\r\n", 1).find(" 415 "), std::string::npos);
  }
  EXPECT_EQ(backend_.submitted, 0);
  EXPECT_EQ(backend_.loads, 0);
  auto ok = c.Post("/v1/completions", body, "Application/JSON; charset=utf-8");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

TEST_F(AdapterGuardTest, AdapterNamesStayInTheirCharacterSet) {
  allow_runtime_loading();
  fs::create_directories(lora_dir_ / "a,b");
  std::ofstream(lora_dir_ / "a,b" / "adapter_config.json") << "{}";
  start();
  for (const std::string& name :
       std::vector<std::string>{"a,b", "a b", "x=1", "\xc3\xa9", ".", std::string(129, 'a')}) {
    auto r = load(name, (lora_dir_ / "sql").string());
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << name;
    EXPECT_EQ(error_of(r).at("param"), "lora_name") << name;
  }
  // Not resolved from --lora-dir either, though the directory is there.
  auto r = post("/v1/completions", {{"model", "a,b"}, {"prompt", "x"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(backend_.loads, 0);
  auto ok = load("org/sql-v1.2_b:3", (lora_dir_ / "sql").string());
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

}  // namespace
}  // namespace loraplex::server
