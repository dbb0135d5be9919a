#include "loraplex/model/load_model.h"

#include <filesystem>
#include <mutex>

#include "loraplex/core/error.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/tensor_parallel.h"
#include "loraplex/model/weight_source.h"

namespace loraplex::model {
namespace {

// Counts the bytes of the tensors the layers ask for, over every rank of a load.
class LoadCounter {
 public:
  LoadCounter(int64_t total, LoadProgress progress)
      : total_(total), progress_(std::move(progress)) {}
  void add(int64_t bytes) {
    // Counted and reported under one lock, so that the reports of the ranks' threads never
    // go backwards.
    std::lock_guard<std::mutex> lock(mu_);
    done_ += bytes;
    // Tensors the model does not read (tied or unused ones) never arrive: the end is reported
    // by finish(), and nothing above total before it.
    if (done_ < total_) progress_(done_, total_);
  }
  void finish() {
    std::lock_guard<std::mutex> lock(mu_);
    progress_(total_, total_);
  }

 private:
  int64_t total_;
  LoadProgress progress_;
  int64_t done_ = 0;
  std::mutex mu_;
};

class CountedWeights : public WeightSource {
 public:
  CountedWeights(const CheckpointWeights& source, LoadCounter& counter)
      : source_(source), counter_(counter) {}
  bool has(const std::string& name) const override { return source_.has(name); }
  Tensor get(const std::string& name, const Shape& shape) const override {
    Tensor t = source_.get(name, shape);
    counter_.add(static_cast<int64_t>(t.nbytes()));
    return t;
  }
  BaseWeight linear(const std::string& module, const Shape& shape) const override {
    BaseWeight w = source_.linear(module, shape);
    for (const Tensor* t : {&w.weight, &w.scale, &w.input_scale}) {
      if (t->defined()) counter_.add(static_cast<int64_t>(t->nbytes()));
    }
    return w;
  }
  const std::string& origin() const override { return source_.origin(); }

 private:
  const CheckpointWeights& source_;
  LoadCounter& counter_;
};

}  // namespace

std::unique_ptr<ModelExecutor> load_model(const std::string& dir, const DecoderOptions& options) {
  if (options.tensor_parallel_size == 1) {
    return Decoder::load(dir, options);
  }
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), dir, ": model directory does not exist");
  const ModelConfig config = ModelConfig::from_file((fs::path(dir) / "config.json").string());
  return TensorParallelDecoder::create(
      config, options, [dir](const DecoderOptions& rank) { return Decoder::load(dir, rank); });
}

std::unique_ptr<ModelExecutor> load_model(const std::string& dir, const DecoderOptions& options,
                                          const LoadProgress& progress) {
  if (!progress) return load_model(dir, options);
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), dir, ": model directory does not exist");
  const ModelConfig config = ModelConfig::from_file((fs::path(dir) / "config.json").string());
  const CheckpointWeights weights(dir, config.quant);
  int64_t bytes = 0;
  for (const std::string& name : weights.checkpoint().names()) {
    bytes += static_cast<int64_t>(weights.checkpoint().tensor(name).nbytes());
  }
  LoadCounter counter(bytes * options.tensor_parallel_size, progress);
  // Every rank reads the same memory-mapped checkpoint through the counter.
  const auto make_rank = [&](const DecoderOptions& rank) -> std::unique_ptr<Decoder> {
    return Decoder::create(config, CountedWeights(weights, counter), rank);
  };
  std::unique_ptr<ModelExecutor> model;
  if (options.tensor_parallel_size == 1) {
    model = make_rank(options);
  } else {
    model = TensorParallelDecoder::create(config, options, make_rank);
  }
  counter.finish();
  return model;
}

std::unique_ptr<ModelExecutor> create_random_model(const ModelConfig& config,
                                                   const DecoderOptions& options, uint64_t seed) {
  if (options.tensor_parallel_size == 1) {
    return Decoder::create_random(config, options, seed);
  }
  return TensorParallelDecoder::create(config, options, [config, seed](const DecoderOptions& rank) {
    return Decoder::create_random(config, rank, seed);
  });
}

}  // namespace loraplex::model
