// Numbers and shapes for error messages, formatted without iostreams.
//
// TORCH_CHECK builds its message with an std::ostringstream compiled into our extension. Where the
// compiler links libstdc++ statically into the extension (the lent GPU machines' CXX does: no
// libstdc++ in the .so's NEEDED list), that copy's number formatting crashes with SIGSEGV while text
// streams fine (kernels/NOTES.md; a probe there: `os << int64_t(3)` crashes, std::to_string
// does not). So every number or shape in a message goes through these first:
//
//   TORCH_CHECK(ok, "x has ", flashgpt::num(K), " features but w1 is ", flashgpt::dims(w1.sizes()));
#pragma once

#include <cstdint>
#include <string>

#include <c10/util/ArrayRef.h>

namespace flashgpt {

inline std::string num(int64_t v) { return std::to_string(v); }

// "(2, 3, 4)" for sizes / strides.
inline std::string dims(c10::IntArrayRef s) {
    std::string out = "(";
    for (size_t i = 0; i < s.size(); ++i) {
        if (i) out += ", ";
        out += std::to_string(s[i]);
    }
    return out + ")";
}

}  // namespace flashgpt
