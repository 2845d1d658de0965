#pragma once
/// The evaluation protocol of models/tinycode/MODEL.md: eval data files, the continuation-loss task and the
/// passkey-retrieval task. Each task splits its bytes into a context (prefilled, then compressed) and what follows.

#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.hpp"

namespace tinycode::eval {

using Tokens = std::vector<Token>;

inline std::string read_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error(file.string() + ": cannot open");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline Tokens to_tokens(const std::string& bytes) {
  Tokens t(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) t[i] = static_cast<unsigned char>(bytes[i]);
  return t;
}

/// eval/docs.bin: 64 documents of 2560 bytes, back to back.
inline std::vector<Tokens> load_docs(const std::filesystem::path& file, std::size_t doc_bytes = 2560) {
  const std::string all = read_bytes(file);
  if (all.empty() || all.size() % doc_bytes != 0)
    throw std::runtime_error(file.string() + ": size " + std::to_string(all.size()) + " is not a multiple of " +
                             std::to_string(doc_bytes));
  std::vector<Tokens> docs;
  for (std::size_t at = 0; at < all.size(); at += doc_bytes) docs.push_back(to_tokens(all.substr(at, doc_bytes)));
  return docs;
}

struct PasskeyRecord {
  std::string kind;  ///< "ident" or "assert"
  Tokens prompt, answer;
};

/// eval/passkeys.bin: records joined by 0x1E, each `kind NUL prompt NUL answer`.
inline std::vector<PasskeyRecord> load_passkeys(const std::filesystem::path& file) {
  const std::string all = read_bytes(file);
  std::vector<PasskeyRecord> records;
  std::size_t start = 0;
  while (start <= all.size()) {
    std::size_t end = all.find('\x1e', start);
    if (end == std::string::npos) end = all.size();
    const std::string rec = all.substr(start, end - start);
    const std::size_t a = rec.find('\0'), b = a == std::string::npos ? a : rec.find('\0', a + 1);
    if (b == std::string::npos)
      throw std::runtime_error(file.string() + ": record " + std::to_string(records.size()) +
                               " is not `kind NUL prompt NUL answer`");
    records.push_back({rec.substr(0, a), to_tokens(rec.substr(a + 1, b - a - 1)), to_tokens(rec.substr(b + 1))});
    start = end + 1;
  }
  return records;
}

/// -log softmax(logits)[target], in double.
template <class Row>
double nll(const Row& logits, Token target) {
  const Eigen::ArrayXd z = logits.template cast<double>().transpose().array();
  const double m = z.maxCoeff();
  return m + std::log((z - m).exp().sum()) - z(target);
}

/// Index of the largest logit (the first one on ties).
template <class Row>
Token argmax(const Row& logits) {
  Eigen::Index best = 0;
  logits.maxCoeff(&best);
  return static_cast<Token>(best);
}

/// Continuation loss: prefill doc[0, context_len), compress, then score doc[context_len, total_len).
struct ContinuationTask {
  static constexpr std::size_t context_len = 1536, total_len = 2048;
  Tokens context;       ///< [1536]
  Tokens continuation;  ///< [512], the bytes whose predictions are scored

  explicit ContinuationTask(const Tokens& doc) {
    if (doc.size() < total_len) throw std::invalid_argument("ContinuationTask: document shorter than 2048 bytes");
    context.assign(doc.begin(), doc.begin() + context_len);
    continuation.assign(doc.begin() + context_len, doc.begin() + total_len);
  }
  /// Tokens to run after the compression: all but the last continuation byte (teacher forcing).
  Tokens continuation_inputs() const { return Tokens(continuation.begin(), continuation.end() - 1); }
  /// Mean NLL of the continuation: byte 0 predicted by the prefill's last position (full attention), bytes
  /// 1.. by `after_logits` [511, vocab] (the compressed cache).
  double loss(const Matrix& context_logits, const Matrix& after_logits) const {
    double sum = nll(context_logits.row(context_logits.rows() - 1), continuation[0]);
    for (std::size_t i = 1; i < continuation.size(); ++i)
      sum += nll(after_logits.row(static_cast<Index>(i) - 1), continuation[i]);
    return sum / static_cast<double>(continuation.size());
  }
};

/// Passkey retrieval: the context is the prompt up to (not including) its last newline; after compression the
/// rest of the prompt (the question) and the answer are run uncompressed; solved when every answer byte is the
/// argmax prediction (teacher forcing).
struct PasskeyTask {
  std::string kind;
  Tokens context;   ///< prompt before its last newline
  Tokens question;  ///< the rest of the prompt, from the last newline
  Tokens answer;

  explicit PasskeyTask(const PasskeyRecord& r) : kind(r.kind), answer(r.answer) {
    std::size_t nl = r.prompt.size();
    while (nl > 0 && r.prompt[nl - 1] != '\n') --nl;
    if (nl == 0 || answer.empty()) throw std::invalid_argument("PasskeyTask: prompt without newline or empty answer");
    context.assign(r.prompt.begin(), r.prompt.begin() + static_cast<std::ptrdiff_t>(nl) - 1);
    question.assign(r.prompt.begin() + static_cast<std::ptrdiff_t>(nl) - 1, r.prompt.end());
  }
  /// Tokens to run after the compression: the question and all but the last answer byte.
  Tokens after_inputs() const {
    Tokens t = question;
    t.insert(t.end(), answer.begin(), answer.end() - 1);
    return t;
  }
  /// Whether `after_logits` (the logits of after_inputs()) predict every answer byte.
  bool solved(const Matrix& after_logits) const {
    for (std::size_t k = 0; k < answer.size(); ++k)
      if (argmax(after_logits.row(static_cast<Index>(question.size() + k) - 1)) != answer[k]) return false;
    return true;
  }
};

}  // namespace tinycode::eval
