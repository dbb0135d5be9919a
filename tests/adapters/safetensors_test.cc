#include "loraplex/adapters/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "support/random_data.h"

namespace loraplex {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = std::string(LORAPLEX_TEST_DATA_DIR) + "/tiny-llama/adapters";

// A file from a raw header text and data bytes; `declared_len` overrides the length field.
std::vector<uint8_t> make_bytes(const std::string& header, const std::vector<uint8_t>& data,
                                uint64_t declared_len = UINT64_MAX) {
  const uint64_t len = declared_len == UINT64_MAX ? header.size() : declared_len;
  std::vector<uint8_t> out(8 + header.size() + data.size());
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(len >> (8 * i));
  std::memcpy(out.data() + 8, header.data(), header.size());
  if (!data.empty()) std::memcpy(out.data() + 8 + header.size(), data.data(), data.size());
  return out;
}

std::vector<uint8_t> bytes_of_floats(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Expects from_bytes to throw an Error whose message holds every one of `parts`.
void expect_refused(const std::vector<uint8_t>& bytes, const std::vector<std::string>& parts) {
  try {
    SafetensorsFile::from_bytes(bytes, "hostile.safetensors");
    ADD_FAILURE() << "accepted a file that should be refused (expected: " << parts[0] << ")";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("hostile.safetensors"), std::string::npos) << msg;
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
  }
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "loraplex_st_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Safetensors, ReadsPeftFixtureF32) {
  auto f = SafetensorsFile::open(kFixtures + "/sql/adapter_model.safetensors");
  EXPECT_EQ(f.size(), 24u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const std::string name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";
  ASSERT_TRUE(f.has(name));
  EXPECT_FALSE(f.has("__metadata__"));
  const auto& info = f.info(name);
  EXPECT_EQ(info.dtype, DType::kF32);
  EXPECT_EQ(info.shape, (Shape{64, 8}));
  EXPECT_EQ(info.data_begin, 55296u);
  EXPECT_EQ(info.data_end, 57344u);
  Tensor t = f.tensor(name);
  // Values read independently with Python's struct module from the same file.
  std::vector<double> v = t.to_double_vector();
  ASSERT_EQ(v.size(), 512u);
  EXPECT_DOUBLE_EQ(v.front(), 0.02294342964887619);
  EXPECT_DOUBLE_EQ(v.back(), -0.16046486794948578);
  EXPECT_NEAR(std::accumulate(v.begin(), v.end(), 0.0), 1.0175921108893817, 1e-9);
}

TEST(Safetensors, ReadsPeftFixtureBf16) {
  auto f = SafetensorsFile::open(kFixtures + "/pirate/adapter_model.safetensors");
  EXPECT_EQ(f.size(), 42u);
  Tensor t = f.tensor("base_model.model.model.layers.2.mlp.down_proj.lora_A.weight");
  EXPECT_EQ(t.dtype(), DType::kBF16);
  EXPECT_EQ(t.shape(), (Shape{16, 320}));
  std::vector<double> v = t.to_double_vector();
  EXPECT_DOUBLE_EQ(v.front(), -0.00933837890625);
  EXPECT_DOUBLE_EQ(v.back(), 0.057861328125);
  EXPECT_NEAR(std::accumulate(v.begin(), v.end(), 0.0), 1.8487060070037842, 1e-9);
}

TEST(Safetensors, ViewOutlivesFileAndWritesStayPrivate) {
  TempDir dir;
  std::mt19937_64 rng(7);
  Tensor src = test::random_tensor({5, 3}, DType::kF32, rng);
  write_safetensors(dir.file("a.safetensors"), {{"w", src}});
  Tensor view;
  {
    auto f = SafetensorsFile::open(dir.file("a.safetensors"));
    view = f.tensor("w");
  }
  EXPECT_EQ(view.to_double_vector(), src.to_double_vector());
  view.fill_(2.5);  // copy-on-write: must neither fault nor change the file
  auto again = SafetensorsFile::open(dir.file("a.safetensors"));
  EXPECT_EQ(again.tensor("w").to_double_vector(), src.to_double_vector());
}

TEST(Safetensors, RoundTripsEveryDtypeAndEmptyShapes) {
  TempDir dir;
  std::mt19937_64 rng(11);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2})
    tensors.emplace_back(std::string(dtype_name(d)), test::random_tensor({3, 7}, d, rng));
  tensors.emplace_back("i32", Tensor::from_vector(std::vector<int32_t>{-5, 9, 1 << 30}, {3}));
  tensors.emplace_back("i64", Tensor::from_vector(std::vector<int64_t>{int64_t{1} << 40, -2}, {2}));
  tensors.emplace_back("u8", Tensor::from_vector(std::vector<uint8_t>{0, 255, 17}, {1, 3}));
  tensors.emplace_back("scalar", Tensor::from_vector(std::vector<float>{3.25f}, {}));
  tensors.emplace_back("empty", Tensor::empty({0, 3}, DType::kBF16));
  write_safetensors(dir.file("all.safetensors"), tensors, {{"format", "pt"}, {"k", "v"}});

  auto f = SafetensorsFile::open(dir.file("all.safetensors"));
  EXPECT_EQ(f.size(), tensors.size());
  EXPECT_EQ(f.metadata().at("k"), "v");
  for (const auto& [name, src] : tensors) {
    SCOPED_TRACE(name);
    Tensor t = f.tensor(name);
    EXPECT_EQ(t.dtype(), src.dtype());
    EXPECT_EQ(t.shape(), src.shape());
    EXPECT_EQ(t.to_double_vector(), src.to_double_vector());
  }
  EXPECT_EQ(f.tensor("scalar").numel(), 1);
  EXPECT_EQ(f.tensor("empty").numel(), 0);
}

TEST(Safetensors, BoolIsReadAsU8) {
  auto bytes =
      make_bytes(R"({"m":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}})", {1, 0, 0, 1});
  auto f = SafetensorsFile::from_bytes(bytes);
  EXPECT_EQ(f.info("m").dtype, DType::kU8);
  EXPECT_EQ(f.info("m").file_dtype, "BOOL");
  EXPECT_EQ(f.tensor("m").to_double_vector(), (std::vector<double>{1, 0, 0, 1}));
}

TEST(Safetensors, MisalignedDataIsCopied) {
  // A 5-byte header puts the data section at offset 13 and the F32 tensor at offset 14.
  std::vector<uint8_t> data = {0xAA};
  auto floats = bytes_of_floats({1.5f, -2.0f, 7.25f});
  data.insert(data.end(), floats.begin(), floats.end());
  const std::string header = R"({"pad":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                             R"("f":{"dtype":"F32","shape":[3],"data_offsets":[1,13]}})";
  auto f = SafetensorsFile::from_bytes(make_bytes(header, data));
  Tensor t = f.tensor("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4, 0u);
  EXPECT_EQ(t.to_double_vector(), (std::vector<double>{1.5, -2.0, 7.25}));
}

TEST(Safetensors, AcceptsHolesTrailingSpacesAndSharedEmptyOffsets) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                             R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}    )";
  auto f = SafetensorsFile::from_bytes(make_bytes(header, bytes_of_floats({9.0f, 3.0f})));
  EXPECT_EQ(f.tensor("a").item({0}), 3.0);
  EXPECT_EQ(f.tensor("z").numel(), 0);
}

TEST(Safetensors, RefusesBadLengthField) {
  expect_refused({1, 2, 3}, {"fewer than the 8-byte header length"});
  expect_refused(make_bytes("{}", {}, 3), {"header length 3 exceeds the 2 bytes"});
  // A length near 2^64 must be refused before anything is allocated for it.
  expect_refused(make_bytes("{}", {}, UINT64_MAX - 1), {"exceeds the 2 bytes"});
  std::vector<uint8_t> big = make_bytes("{}", {});
  big.resize(8 + SafetensorsFile::kMaxHeaderBytes + 1, ' ');
  for (int i = 0; i < 8; ++i) big[i] = static_cast<uint8_t>((big.size() - 8) >> (8 * i));
  expect_refused(big, {"exceeds the limit of 100000000 bytes"});
}

TEST(Safetensors, RefusesBadJson) {
  expect_refused(make_bytes("[1,2]", {}), {"must start with '{'"});
  expect_refused(make_bytes("{\"a\":", {}), {"not valid JSON"});
  expect_refused(make_bytes("{\"a\":\"\xff\"}", {}), {"not valid JSON"});
  expect_refused(make_bytes(R"({"a":{"dtype":"F32","shape":[[[1]]],"data_offsets":[0,4]}})", {}),
                 {"nested deeper"});
  std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  expect_refused(make_bytes(deep, {}), {"nested deeper"});
  expect_refused(make_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                            R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                            bytes_of_floats({1, 2})),
                 {"key 'a' twice"});
  expect_refused(make_bytes(R"({"a":{"dtype":"F32","dtype":"F16","shape":[1],)"
                            R"("data_offsets":[0,4]}})",
                            bytes_of_floats({1})),
                 {"key 'dtype' twice"});
}

TEST(Safetensors, RefusesBadEntries) {
  const auto data = bytes_of_floats({1, 2, 3, 4});
  auto entry = [&](const std::string& body) { return make_bytes("{\"w\":" + body + "}", data); };
  expect_refused(entry("3"), {"tensor 'w'", "must be an object"});
  expect_refused(entry(R"({"dtype":"F64","shape":[2],"data_offsets":[0,16]})"),
                 {"tensor 'w'", "unsupported safetensors dtype 'F64'"});
  expect_refused(entry(R"({"dtype":"I8","shape":[2],"data_offsets":[0,2]})"),
                 {"tensor 'w'", "'I8'"});
  expect_refused(entry(R"({"shape":[2],"data_offsets":[0,8]})"), {"tensor 'w'", "'dtype'"});
  expect_refused(entry(R"({"dtype":"F32","data_offsets":[0,8]})"), {"tensor 'w'", "'shape'"});
  expect_refused(entry(R"({"dtype":"F32","shape":[2]})"), {"tensor 'w'", "'data_offsets'"});
  expect_refused(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})"),
                 {"tensor 'w'", "unknown field 'x'"});
  expect_refused(entry(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "shape entries must be integers >= 0, got -2"});
  expect_refused(entry(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "shape entries"});
  expect_refused(entry(R"({"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "shape entries"});
  expect_refused(entry(R"({"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],)"
                       R"("data_offsets":[0,0]})"),
                 {"tensor 'w'", "too large to index"});
  expect_refused(entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})"),
                 {"tensor 'w'"});
  expect_refused(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[8]})"),
                 {"tensor 'w'", "data_offsets must be two integers"});
  expect_refused(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"),
                 {"tensor 'w'", "end before they begin"});
  expect_refused(entry(R"({"dtype":"F32","shape":[2],"data_offsets":[12,20]})"),
                 {"tensor 'w'", "reach past the data section of 16 bytes"});
  expect_refused(entry(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
                 {"tensor 'w'", "shape [3] of F32 needs 3 x 4 bytes", "hold 8"});
  expect_refused(make_bytes(R"({"__metadata__":{"a":1}})", {}), {"__metadata__ key 'a'"});
  expect_refused(make_bytes(R"({"__metadata__":[]})", {}), {"__metadata__ must be an object"});
}

TEST(Safetensors, RefusesOverlaps) {
  const auto data = bytes_of_floats({1, 2, 3, 4});
  expect_refused(make_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                            data),
                 {"'a' [0, 8)", "'b' [4, 12)", "overlap"});
  expect_refused(make_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                            R"("b":{"dtype":"U8","shape":[1],"data_offsets":[15,16]}})",
                            data),
                 {"overlap"});
}

TEST(Safetensors, RefusesMissingFilesAndNonFiles) {
  TempDir dir;
  try {
    SafetensorsFile::open(dir.file("missing.safetensors"));
    ADD_FAILURE() << "opened a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SafetensorsFile::open(dir.path()), Error);
  ASSERT_EQ(mkfifo(dir.file("fifo").c_str(), 0600), 0);
  EXPECT_THROW(SafetensorsFile::open(dir.file("fifo")), Error);
  { std::ofstream(dir.file("short")) << "abc"; }
  EXPECT_THROW(SafetensorsFile::open(dir.file("short")), Error);

  auto f = SafetensorsFile::from_bytes(make_bytes("{}", {}), "x.safetensors");
  EXPECT_EQ(f.size(), 0u);
  try {
    f.tensor("nope");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no tensor 'nope'"), std::string::npos);
  }
}

}  // namespace
}  // namespace loraplex
