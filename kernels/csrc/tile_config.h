// Tile configurations per head dim: (rows, cols, warps, min blocks per SM).
//   forward:  (query rows per block, keys per step, warps, min blocks)
//   backward: (query rows per step, keys per block, warps, min blocks)
// FLASH_TUNE selects an alternative set for tuning sweeps, built side by side with
//   FLASHGPT_NVCC_EXTRA=-DFLASH_TUNE=<n> python -m kernels.bench --only-ours ...
// (macros, not -D values with commas: nvcc splits -D arguments at commas).
// The default set (FLASH_TUNE 0) is what kernels/NOTES.md measured as best.
#pragma once

#ifndef FLASH_TUNE
#define FLASH_TUNE 0
#endif

#if FLASH_TUNE == 0
#define FLASH_FWD_HD64 128, 128, 8, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 8, 1
#define FLASH_BWD_HD64 64, 128, 8, 1
#define FLASH_BWD_HD96 64, 128, 8, 1
#define FLASH_BWD_HD128 64, 128, 8, 1
#elif FLASH_TUNE == 1   // forward: 2 slabs of 16 rows per warp (half the K/V shared-memory reads)
#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 32, 4, 1
#define FLASH_BWD_HD64 64, 64, 4, 1
#define FLASH_BWD_HD96 64, 128, 8, 1
#define FLASH_BWD_HD128 64, 64, 4, 1
#elif FLASH_TUNE == 2   // 2 blocks per SM (register cap 128)
#define FLASH_FWD_HD64 128, 128, 8, 2
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 8, 2
#define FLASH_BWD_HD64 64, 64, 4, 3
#define FLASH_BWD_HD96 64, 128, 8, 1
#define FLASH_BWD_HD128 64, 128, 8, 1
#elif FLASH_TUNE == 3   // forward: 2 slabs per warp, 64-key steps for hdim 128
#define FLASH_FWD_HD64 128, 128, 4, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 64, 128, 8, 1
#define FLASH_BWD_HD96 64, 128, 8, 1
#define FLASH_BWD_HD128 64, 128, 8, 1
#endif
