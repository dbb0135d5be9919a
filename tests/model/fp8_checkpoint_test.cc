// Reading FP8 projections (read_linear_weight): codes and scales as each format stores them,
// and refusal, naming the checkpoint, the tensor and the shapes, of scales that do not fit.

#include "loraplex/model/fp8_checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "loraplex/adapters/safetensors.h"
#include "loraplex/core/error.h"

namespace loraplex::model {
namespace {

namespace fs = std::filesystem;

class ReadLinearWeight : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loraplex_fp8_ckpt_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A checkpoint holding `tensors` under "m.<name>".
  Checkpoint write(const std::vector<std::pair<std::string, Tensor>>& tensors) {
    std::vector<std::pair<std::string, Tensor>> named;
    for (const auto& [n, t] : tensors) named.emplace_back("m." + n, t);
    write_safetensors((dir_ / "model.safetensors").string(), named);
    return Checkpoint::open(dir_.string());
  }

  static Tensor codes(int64_t out, int64_t in) {
    Tensor t = Tensor::empty({out, in}, DType::kF8E4M3);
    uint8_t* p = static_cast<uint8_t*>(t.data_ptr());
    for (int64_t i = 0; i < out * in; ++i) p[i] = static_cast<uint8_t>((i * 37 + 11) % 0x7e);
    return t;
  }
  static Tensor floats(const Shape& shape, float first, DType dtype = DType::kF32) {
    std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
    for (size_t i = 0; i < v.size(); ++i) v[i] = first + 0.5f * static_cast<float>(i);
    return Tensor::from_vector(v, shape).to(dtype);
  }
  std::string error_of(const Checkpoint& c, const QuantConfig& q, const Shape& shape) {
    try {
      read_linear_weight(c, q, "m", shape);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

QuantConfig config(Fp8WeightScale kind, Fp8Activations act = Fp8Activations::kDynamicPerToken) {
  QuantConfig q;
  q.method = QuantConfig::Method::kCompressedTensors;
  q.weight_scale = kind;
  q.activations = act;
  q.block_n = 4;
  q.block_k = 8;
  q.weight_scale_names = {"weight_scale_inv", "weight_scale"};
  q.input_scale_names = {"input_scale"};
  return q;
}

TEST_F(ReadLinearWeight, EachFormatGivesCodesAndAScaleGrid) {
  const Checkpoint c = write({{"weight", codes(10, 20)},
                              {"weight_scale", floats({10, 1}, 1.0f, DType::kBF16)},
                              {"input_scale", floats({}, 2.0f)}});
  BaseWeight b = read_linear_weight(c, config(Fp8WeightScale::kPerChannel, Fp8Activations::kStatic),
                                    "m", {10, 20});
  ASSERT_TRUE(b.is_fp8());
  EXPECT_EQ(b.scale.shape(), (Shape{10, 1}));
  EXPECT_EQ(b.scale.dtype(), DType::kF32);  // bf16 scales converted exactly
  EXPECT_EQ(b.scale.data<float>()[3], 2.5f);
  EXPECT_EQ(b.group_n, 1);
  EXPECT_EQ(b.group_k, 20);
  ASSERT_TRUE(b.input_scale.defined());
  EXPECT_EQ(b.input_scale.shape(), (Shape{1}));
  EXPECT_EQ(b.input_scale.data<float>()[0], 2.0f);

  const Checkpoint blocks =
      write({{"weight", codes(10, 20)}, {"weight_scale_inv", floats({3, 3}, 0.25f)}});
  b = read_linear_weight(blocks, config(Fp8WeightScale::kBlock), "m", {10, 20});
  EXPECT_EQ(b.scale.shape(), (Shape{3, 3}));
  EXPECT_EQ(b.group_n, 4);
  EXPECT_EQ(b.group_k, 8);
  EXPECT_FALSE(b.input_scale.defined());

  const Checkpoint tensor = write({{"weight", codes(10, 20)}, {"weight_scale", floats({1}, 3.f)}});
  b = read_linear_weight(tensor, config(Fp8WeightScale::kPerTensor), "m", {10, 20});
  EXPECT_EQ(b.scale.shape(), (Shape{1, 1}));
  EXPECT_EQ(b.group_n, 10);
  EXPECT_EQ(b.group_k, 20);

  // A float projection in a quantized checkpoint (an ignore list) comes back as it is.
  const Checkpoint plain = write({{"weight", floats({10, 20}, 0.0f, DType::kBF16)}});
  b = read_linear_weight(plain, config(Fp8WeightScale::kBlock), "m", {10, 20});
  EXPECT_FALSE(b.is_fp8());
  EXPECT_EQ(b.weight.dtype(), DType::kBF16);
}

TEST_F(ReadLinearWeight, RefusesScalesThatDoNotFitNamingTensorAndShapes) {
  const Checkpoint c = write({{"weight", codes(10, 20)}, {"weight_scale", floats({3, 2}, 1.f)}});
  EXPECT_NE(error_of(c, config(Fp8WeightScale::kBlock), {10, 20})
                .find("tensor 'm.weight_scale' has shape [3, 2], expected [3, 3] (4x8 block "
                      "scales of the [10, 20] weight)"),
            std::string::npos)
      << error_of(c, config(Fp8WeightScale::kBlock), {10, 20});
  EXPECT_NE(error_of(c, config(Fp8WeightScale::kPerChannel), {10, 20})
                .find("has shape [3, 2], expected [10, 1]"),
            std::string::npos);
  EXPECT_NE(error_of(c, config(Fp8WeightScale::kPerTensor), {10, 20})
                .find("has shape [3, 2], expected [] or [1]"),
            std::string::npos);
  EXPECT_NE(error_of(c, config(Fp8WeightScale::kBlock), {10, 21}).find("has shape [10, 20]"),
            std::string::npos);
}

TEST_F(ReadLinearWeight, RefusesMissingOrBadScalesAndOtherFp8Kinds) {
  const Checkpoint no_scale = write({{"weight", codes(4, 8)}});
  EXPECT_NE(error_of(no_scale, config(Fp8WeightScale::kPerTensor), {4, 8})
                .find("has no scale: expected 'm.weight_scale_inv' or 'm.weight_scale'"),
            std::string::npos);
  EXPECT_NE(error_of(no_scale, QuantConfig{}, {4, 8})
                .find("is float8_e4m3 but config.json has no quantization_config"),
            std::string::npos);
  const Checkpoint negative =
      write({{"weight", codes(4, 8)}, {"weight_scale", floats({4, 1}, -1.0f)}});
  EXPECT_NE(error_of(negative, config(Fp8WeightScale::kPerChannel), {4, 8})
                .find("holds -1 at element 0, expected a finite non-negative scale"),
            std::string::npos)
      << error_of(negative, config(Fp8WeightScale::kPerChannel), {4, 8});
  const Checkpoint zero_input = write({{"weight", codes(4, 8)},
                                       {"weight_scale", floats({1}, 1.0f)},
                                       {"input_scale", floats({1}, 0.0f)}});
  EXPECT_NE(
      error_of(zero_input, config(Fp8WeightScale::kPerTensor, Fp8Activations::kStatic), {4, 8})
          .find("'m.input_scale' holds 0 at element 0, expected a finite positive scale"),
      std::string::npos);
  Tensor e5m2 = codes(4, 8);
  const Checkpoint other =
      write({{"weight", Tensor::from_blob(e5m2.data_ptr(), {4, 8}, DType::kF8E5M2, Device::cpu())},
             {"weight_scale", floats({1}, 1.0f)}});
  EXPECT_NE(error_of(other, config(Fp8WeightScale::kPerTensor), {4, 8})
                .find("has dtype float8_e5m2, expected float32, float16, bfloat16 or (FP8 "
                      "checkpoints) float8_e4m3"),
            std::string::npos);
}

}  // namespace
}  // namespace loraplex::model
