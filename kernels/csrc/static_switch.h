// Turn runtime flags into compile-time template parameters:
//   BOOL_SWITCH(cond, NAME, [&] { ... uses constexpr bool NAME ... });
//   FP16_SWITCH(is_bf16, [&] { ... uses elem_type ... });
//   HEADDIM_SWITCH(d, [&] { ... uses constexpr int kHeadDim ... });
// The lambda body is compiled once per branch; the branch is picked at run time.
#pragma once
#include <stdexcept>
#include <string>

#define BOOL_SWITCH(COND, CONST_NAME, ...)            \
    [&] {                                             \
        if (COND) {                                   \
            constexpr static bool CONST_NAME = true;  \
            return __VA_ARGS__();                     \
        } else {                                      \
            constexpr static bool CONST_NAME = false; \
            return __VA_ARGS__();                     \
        }                                             \
    }()

#define FP16_SWITCH(IS_BF16, ...)              \
    [&] {                                      \
        if (IS_BF16) {                         \
            using elem_type = __nv_bfloat16;   \
            return __VA_ARGS__();              \
        } else {                               \
            using elem_type = __half;          \
            return __VA_ARGS__();              \
        }                                      \
    }()

#define HEADDIM_SWITCH(HEADDIM, ...)                                                   \
    [&] {                                                                              \
        if (HEADDIM == 64) {                                                           \
            constexpr static int kHeadDim = 64;                                        \
            return __VA_ARGS__();                                                      \
        } else if (HEADDIM == 96) {                                                    \
            constexpr static int kHeadDim = 96;                                        \
            return __VA_ARGS__();                                                      \
        } else if (HEADDIM == 128) {                                                   \
            constexpr static int kHeadDim = 128;                                       \
            return __VA_ARGS__();                                                      \
        } else {                                                                       \
            throw std::invalid_argument("flashgpt kernel: head dim " +                 \
                                        std::to_string(HEADDIM) + " not in {64,96,128}"); \
        }                                                                              \
    }()
