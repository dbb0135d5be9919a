// IncrementalDetokenizer against whole-sequence decoding with the fixtures' tokenizers: the
// streamed pieces concatenate to the full decode, no piece splits a UTF-8 character (byte-level
// BPE and byte-fallback tokens split characters across tokens), and stop strings spanning
// tokens cut the text, with nothing of them ever released.

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "loraplex/engine/detokenizer.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::test {
namespace {

using engine::IncrementalDetokenizer;

Tokenizer load(const std::string& path) {
  return Tokenizer::from_file(std::string(LORAPLEX_TEST_DATA_DIR) + "/" + path);
}

// Whether `s` is well-formed UTF-8 (and so ends on a character boundary).
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

struct Streamed {
  std::vector<std::string> pieces;
  std::string text;
  std::optional<std::string> stop;
  size_t stopped_at = 0;  // tokens added when the stop matched
};

Streamed stream(const Tokenizer& tok, const std::vector<int32_t>& prompt,
                const std::vector<int32_t>& gen, std::vector<std::string> stops = {},
                size_t min_tokens = 0) {
  IncrementalDetokenizer d(tok, prompt, std::move(stops));
  Streamed out;
  for (size_t i = 0; i < gen.size(); ++i) {
    out.stop = d.add(gen[i], i + 1 >= min_tokens);
    const bool last = out.stop.has_value() || i + 1 == gen.size();
    out.pieces.push_back(d.take(last));
    out.text += out.pieces.back();
    if (out.stop) {
      out.stopped_at = i + 1;
      break;
    }
  }
  return out;
}

TEST(IncrementalDetokenizer, ByteLevelPiecesConcatenateToTheFullDecode) {
  const Tokenizer tok = load("tiny-llama/model/tokenizer.json");
  const std::vector<int32_t> prompt = tok.encode("The function returns", true);
  std::mt19937_64 rng(11);
  int with_replacement = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> gen(1 + rng() % 40);
    for (auto& id : gen) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(tok.vocab_size()));
    const Streamed s = stream(tok, prompt, gen);
    const std::string full = tok.decode(gen, true);
    ASSERT_EQ(s.text, full) << "trial " << trial;
    for (const std::string& p : s.pieces) ASSERT_TRUE(valid_utf8(p));
    with_replacement += full.find("\xEF\xBF\xBD") != std::string::npos;
  }
  EXPECT_GT(with_replacement, 10) << "random ids should often hold partial characters";
}

TEST(IncrementalDetokenizer, MultiByteCharactersSplitOverTokensAreNeverSplitInPieces) {
  for (const char* path : {"tiny-llama/model/tokenizer.json", "tokenizer/sentencepiece_style.json",
                           "tokenizer/metaspace_style.json"}) {
    const Tokenizer tok = load(path);
    const std::string text = "héllo 日本語 wörld 🎉 and ñ done";
    const std::vector<int32_t> gen = tok.encode(text, false);
    ASSERT_GT(gen.size(), 10u) << path;
    const std::vector<int32_t> prompt = tok.encode("Say it again:", true);
    const Streamed s = stream(tok, prompt, gen);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), gen.begin(), gen.end());
    const std::string full = tok.decode(all, true);
    const std::string head = tok.decode(prompt, true);
    ASSERT_EQ(full.compare(0, head.size(), head), 0) << path;
    EXPECT_EQ(s.text, full.substr(head.size())) << path;
    int held = 0;
    for (size_t i = 0; i < s.pieces.size(); ++i) {
      EXPECT_TRUE(valid_utf8(s.pieces[i])) << path << " piece " << i;
      EXPECT_EQ(s.pieces[i].find("\xEF\xBF\xBD"), std::string::npos) << path << " piece " << i;
      held += s.pieces[i].empty();
    }
    EXPECT_GT(held, 0) << path << ": some token must end inside a character";
  }
}

TEST(IncrementalDetokenizer, StopStringSpanningTokensCutsTheText) {
  const Tokenizer tok = load("tiny-llama/model/tokenizer.json");
  const std::string text = "The answer is 42. STOP here, and more text follows";
  const std::vector<int32_t> gen = tok.encode(text, false);
  const std::vector<int32_t> stop_ids = tok.encode("STOP here", false);
  ASSERT_GT(stop_ids.size(), 1u) << "the stop string must span tokens";
  const Streamed s = stream(tok, tok.encode("Q:", true), gen, {"more", "STOP here"});
  ASSERT_TRUE(s.stop.has_value());
  EXPECT_EQ(*s.stop, "STOP here");
  EXPECT_EQ(s.text, "The answer is 42. ");
  // Stopped at the token that completed the stop string, not later.
  EXPECT_EQ(tok.decode(std::vector<int32_t>(gen.begin(), gen.begin() + s.stopped_at - 1), true)
                .find("STOP here"),
            std::string::npos);
  EXPECT_NE(tok.decode(std::vector<int32_t>(gen.begin(), gen.begin() + s.stopped_at), true)
                .find("STOP here"),
            std::string::npos);
  for (const std::string& p : s.pieces) EXPECT_EQ(p.find("STOP"), std::string::npos) << p;
}

TEST(IncrementalDetokenizer, StopStringsWaitForMinTokens) {
  const Tokenizer tok = load("tiny-llama/model/tokenizer.json");
  const std::vector<int32_t> gen = tok.encode("ab stop cd stop ef", false);
  // Stop strings count only once min_tokens tokens are out, and only where they end after that.
  const Streamed early = stream(tok, tok.encode("x", true), gen, {"stop"}, 0);
  EXPECT_EQ(early.text, "ab ");
  const Streamed late = stream(tok, tok.encode("x", true), gen, {"stop"}, gen.size());
  EXPECT_FALSE(late.stop.has_value());
  EXPECT_EQ(late.text, "ab stop cd stop ef");
}

TEST(IncrementalDetokenizer, HoldsBackWhatMayStartAStopStringUntilTheEnd) {
  const Tokenizer tok = load("tiny-llama/model/tokenizer.json");
  const std::string text = "one two three four five six";
  const std::vector<int32_t> gen = tok.encode(text, false);
  IncrementalDetokenizer d(tok, tok.encode("go", true), {"never appears"});
  std::string streamed;
  for (int32_t id : gen) {
    ASSERT_FALSE(d.add(id, true).has_value());
    streamed += d.take(false);
    // Everything but the last 12 bytes (longest stop string - 1) may be out.
    EXPECT_LE(streamed.size() + 12, std::max<size_t>(d.text().size(), 12));
  }
  EXPECT_EQ(d.text(), text);
  streamed += d.take(true);
  EXPECT_EQ(streamed, text);
}

TEST(IncrementalDetokenizer, IncludeStopKeepsTheStopStringAndHoldsNothingBack) {
  const Tokenizer tok = load("tiny-llama/model/tokenizer.json");
  const std::vector<int32_t> gen = tok.encode("The answer is 42. STOP here, and more", false);
  IncrementalDetokenizer d(tok, tok.encode("Q:", true), {"STOP here"},
                           engine::DetokenizeOptions{true, true});
  std::string streamed;
  std::optional<std::string> stop;
  for (int32_t id : gen) {
    stop = d.add(id, true);
    const std::string piece = d.take(stop.has_value());
    // Nothing held back: every token's text is out at once (what it completed so far).
    if (!stop) {
      EXPECT_EQ(streamed.size() + piece.size(), d.text().size());
    }
    streamed += piece;
    if (stop) break;
  }
  ASSERT_TRUE(stop.has_value());
  EXPECT_EQ(streamed, "The answer is 42. STOP here");
}

TEST(IncrementalDetokenizer, SpecialTokensHaveTextOnlyWhenNotSkipped) {
  const Tokenizer tok = load("tiny-llama/model/tokenizer.json");
  int32_t special = -1;
  for (int32_t id = 0; id < tok.vocab_size() && special < 0; ++id) {
    if (tok.is_special(id)) special = id;
  }
  ASSERT_GE(special, 0) << "the fixture's tokenizer has a special token";
  std::vector<int32_t> gen = tok.encode("hello", false);
  gen.push_back(special);
  const std::vector<int32_t> more = tok.encode(" world", false);
  gen.insert(gen.end(), more.begin(), more.end());
  for (const bool skip : {true, false}) {
    IncrementalDetokenizer d(tok, tok.encode("x", true), {},
                             engine::DetokenizeOptions{false, skip});
    std::string text;
    for (int32_t id : gen) {
      d.add(id, true);
      text += d.take(false);
    }
    text += d.take(true);
    EXPECT_EQ(text, tok.decode(gen, skip)) << "skip_special_tokens " << skip;
  }
  EXPECT_NE(tok.decode(gen, false), tok.decode(gen, true));
}

}  // namespace
}  // namespace loraplex::test
