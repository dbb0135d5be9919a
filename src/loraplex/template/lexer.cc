#include "loraplex/template/lexer.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "loraplex/template/errors.h"

namespace loraplex::jinja {
namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  Lexer(std::string source, std::string_view origin, const LexOptions& options)
      : src_(std::move(source)), origin_(origin), options_(options) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      const size_t start = find_tag(pos);
      std::string text = src_.substr(pos, start - pos);
      if (start == src_.size()) {
        emit_text(std::move(text), pos);
        break;
      }
      const char kind = src_[start + 1];  // '{', '%' or '#'
      const char modifier = start + 2 < src_.size() ? src_[start + 2] : '\0';
      if (modifier == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (kind != '{' && options_.lstrip_blocks && modifier != '+') {
        const size_t line_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((line_pos > 0 || line_starting) &&
            std::all_of(text.begin() + static_cast<std::ptrdiff_t>(line_pos), text.end(),
                        [](char c) { return c == ' ' || c == '\t'; })) {
          text.resize(line_pos);
        }
      }
      emit_text(std::move(text), pos);
      size_t body = start + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
      size_t end;  // just past the closing delimiter
      bool strip_after = false;
      bool keep_newline = false;
      if (kind == '#') {
        const size_t close = src_.find("#}", body);
        if (close == std::string::npos) fail(start, "unterminated comment ({# without #})");
        strip_after = close > body && src_[close - 1] == '-';
        keep_newline = close > body && src_[close - 1] == '+';
        end = close + 2;
      } else {
        end = lex_tag(kind, start, body, &strip_after, &keep_newline);
      }
      size_t next = end;
      if (strip_after) {
        while (next < src_.size() && is_space(src_[next])) ++next;
      } else if (kind != '{' && options_.trim_blocks && !keep_newline && next < src_.size() &&
                 src_[next] == '\n') {
        ++next;
      }
      line_starting = next > end ? src_[next - 1] == '\n' : false;
      pos = next;
    }
    Token eof;
    eof.type = Token::Type::kEof;
    locate(src_.size(), eof);
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  size_t find_tag(size_t pos) const {
    while (true) {
      const size_t p = src_.find('{', pos);
      if (p == std::string::npos || p + 1 >= src_.size()) return src_.size();
      const char c = src_[p + 1];
      if (c == '{' || c == '%' || c == '#') return p;
      pos = p + 1;
    }
  }

  void locate(size_t offset, Token& token) const {
    // line_starts_[k] is the offset where line k+1 starts.
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line = static_cast<size_t>(it - line_starts_.begin());
    token.line = static_cast<int>(line);
    token.column = static_cast<int>(offset - line_starts_[line - 1]) + 1;
  }

  [[noreturn]] void fail(size_t offset, const std::string& what) const {
    Token t;
    locate(offset, t);
    throw TemplateSyntaxError(std::string(origin_) + ":" + std::to_string(t.line) + ":" +
                              std::to_string(t.column) + ": " + what);
  }

  void emit_text(std::string text, size_t offset) {
    if (text.empty()) return;
    Token t;
    t.type = Token::Type::kText;
    t.value = std::move(text);
    locate(offset, t);
    tokens_.push_back(std::move(t));
  }

  void push(Token::Type type, size_t offset, std::string value = {}) {
    Token t;
    t.type = type;
    t.value = std::move(value);
    locate(offset, t);
    tokens_.push_back(std::move(t));
  }

  // Lexes the tokens of a {{ }} or {% %} tag starting at `start`; returns the offset just past
  // its closing delimiter.
  size_t lex_tag(char kind, size_t start, size_t pos, bool* strip_after, bool* keep_newline) {
    push(kind == '{' ? Token::Type::kVarBegin : Token::Type::kBlockBegin, start);
    const char close = kind == '{' ? '}' : '%';
    int depth = 0;
    while (true) {
      while (pos < src_.size() && is_space(src_[pos])) ++pos;
      if (pos >= src_.size()) {
        fail(start,
             kind == '{' ? "unterminated {{ (no closing }})" : "unterminated {% (no closing %})");
      }
      // The closing delimiter, optionally with - or + before it, ends the tag when every
      // bracket opened inside it is closed.
      if (depth == 0) {
        for (char mod : {'\0', '-', '+'}) {
          const size_t at = mod ? pos + 1 : pos;
          if (mod && src_[pos] != mod) continue;
          if (mod == '+' && kind == '{') continue;
          if (at + 1 < src_.size() && src_[at] == close && src_[at + 1] == '}') {
            push(kind == '{' ? Token::Type::kVarEnd : Token::Type::kBlockEnd, pos);
            *strip_after = mod == '-';
            *keep_newline = mod == '+';
            return at + 2;
          }
        }
      }
      const char c = src_[pos];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos;
        while (e < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) {
          ++e;
        }
        push(Token::Type::kName, pos, src_.substr(pos, e - pos));
        pos = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        pos = lex_number(pos);
      } else if (c == '\'' || c == '"') {
        pos = lex_string(pos);
      } else {
        static const char* const kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                           "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                           "]",  "{",  "}",  ",",  ".",  ":",  "|"};
        const char* match = nullptr;
        for (const char* op : kOps) {
          const size_t n = std::char_traits<char>::length(op);
          if (src_.compare(pos, n, op) == 0) {
            match = op;
            break;
          }
        }
        if (match == nullptr) fail(pos, std::string("unexpected character '") + c + "'");
        const std::string op(match);
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") {
          if (depth == 0) fail(pos, "unbalanced '" + op + "'");
          --depth;
        }
        push(Token::Type::kOperator, pos, op);
        pos += op.size();
      }
    }
  }

  size_t lex_number(size_t pos) {
    size_t e = pos;
    auto digits = [&] {
      while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) ||
                                 (src_[e] == '_' && e + 1 < src_.size() &&
                                  std::isdigit(static_cast<unsigned char>(src_[e + 1]))))) {
        ++e;
      }
    };
    digits();
    bool is_float = false;
    if (e + 1 < src_.size() && src_[e] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      is_float = true;
      ++e;
      digits();
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t f = e + 1;
      if (f < src_.size() && (src_[f] == '+' || src_[f] == '-')) ++f;
      if (f < src_.size() && std::isdigit(static_cast<unsigned char>(src_[f]))) {
        is_float = true;
        e = f;
        digits();
      }
    }
    std::string text;
    for (size_t i = pos; i < e; ++i)
      if (src_[i] != '_') text += src_[i];
    Token t;
    locate(pos, t);
    t.value = text;
    if (is_float) {
      t.type = Token::Type::kFloat;
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      t.type = Token::Type::kInt;
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) fail(pos, "integer literal out of range: " + text);
    }
    tokens_.push_back(std::move(t));
    return e;
  }

  // Python string-literal escapes, as jinja2 decodes them.
  size_t lex_string(size_t pos) {
    const char quote = src_[pos];
    std::string out;
    size_t i = pos + 1;
    auto hex = [&](size_t at, int n) -> uint32_t {
      if (at + static_cast<size_t>(n) > src_.size()) fail(at, "truncated escape in string");
      uint32_t v = 0;
      for (int k = 0; k < n; ++k) {
        const char h = src_[at + static_cast<size_t>(k)];
        if (!std::isxdigit(static_cast<unsigned char>(h))) fail(at, "bad hex escape in string");
        v = v * 16 +
            static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                      ? h - '0'
                                      : std::tolower(static_cast<unsigned char>(h)) - 'a' + 10);
      }
      return v;
    };
    while (true) {
      if (i >= src_.size()) fail(pos, "unterminated string literal");
      const char c = src_[i];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++i;
        continue;
      }
      if (i + 1 >= src_.size()) fail(pos, "unterminated string literal");
      const char e = src_[i + 1];
      i += 2;
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case '\n':
          break;  // a line continuation
        case 'x':
          append_utf8(out, hex(i, 2));
          i += 2;
          break;
        case 'u':
          append_utf8(out, hex(i, 4));
          i += 4;
          break;
        case 'U':
          append_utf8(out, hex(i, 8));
          i += 8;
          break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < src_.size() && src_[i] >= '0' && src_[i] <= '7'; ++k)
              v = v * 8 + static_cast<uint32_t>(src_[i++] - '0');
            append_utf8(out, v);
          } else {
            // Python keeps unknown escapes as written.
            out += '\\';
            out += e;
          }
      }
    }
    push(Token::Type::kString, pos, std::move(out));
    return i + 1;
  }

  std::string src_;
  std::string_view origin_;
  LexOptions options_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source, std::string_view origin,
                            const LexOptions& options) {
  // jinja2 normalizes \r\n and \r to \n, then drops one trailing newline.
  std::string src;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src += source[i];
    }
  }
  if (!options.keep_trailing_newline && !src.empty() && src.back() == '\n') src.pop_back();
  return Lexer(std::move(src), origin, options).run();
}

}  // namespace loraplex::jinja
