// Tile configurations per head dim:
//   forward:  (query rows per block, keys per step, warps, min blocks per SM)
//   backward: (query rows per step, keys per block, warps, min blocks per SM, head-dim loop unroll,
//              16-row dQ slabs per warp)
//   backward, 2-D warp layout (FLASH_BWD2D_HD<d>, when defined it replaces FLASH_BWD_HD<d> on devices
//              with enough shared memory): (query rows per step, keys per block, warps, key warps,
//              16-row dQ slabs per warp)
// FLASH_TUNE selects an alternative set for tuning sweeps, built side by side with
//   FLASHGPT_NVCC_EXTRA=-DFLASH_TUNE=<n> python bench/kernel_sweep.py --only-ours ...
// (macros, not -D values with commas: nvcc splits -D arguments at commas).
// The default set (FLASH_TUNE 0) is the fastest measured; kernels/NOTES.md has the numbers.
#pragma once

#ifndef FLASH_TUNE
#define FLASH_TUNE 0
#endif

#if FLASH_TUNE == 0 || FLASH_TUNE == 9   // 9: the default set without the 2-D backward (for A/B runs)
#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 32, 4, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 32, 128, 4, 1, 4, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 1, 1
#if FLASH_TUNE == 0
#define FLASH_BWD2D_HD96 64, 128, 8, 4, 1
#define FLASH_BWD2D_HD128 64, 128, 8, 4, 2
#endif
#elif FLASH_TUNE == 1   // forward: 16 query rows per warp
#define FLASH_FWD_HD64 128, 128, 8, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 8, 1
#define FLASH_BWD_HD64 64, 64, 4, 1, 1, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 64, 4, 1, 1, 1
#elif FLASH_TUNE == 2   // 2 blocks per SM (register cap 128)
#define FLASH_FWD_HD64 128, 128, 8, 2
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 8, 2
#define FLASH_BWD_HD64 64, 64, 4, 3, 1, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 1, 1
#elif FLASH_TUNE == 3   // forward: 2 slabs per warp, 128-key steps for hdim 64
#define FLASH_FWD_HD64 128, 128, 4, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 32, 4, 1
#define FLASH_BWD_HD64 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 1, 1
#elif FLASH_TUNE == 4   // backward: unrolled head-dim loop
#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 64, 4, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 64, 128, 8, 1, 4, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 2, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 2, 1
#elif FLASH_TUNE == 5   // backward: 32 query rows per step
#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 32, 4, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 64, 128, 8, 1, 2, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 32, 128, 8, 1, 1, 1
#elif FLASH_TUNE == 6   // backward hdim 64: 2 key slabs (32 keys) per warp, 4 warps
#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 32, 128, 4, 1, 4, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 1, 1
#elif FLASH_TUNE == 7   // backward hdim 64: 2 key slabs per warp, 2 warps, small blocks
#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 32, 64, 2, 1, 1, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 1, 1
#elif FLASH_TUNE == 8   // backward: 2 dQ slabs per warp (K fragment reuse in dQ = dS K)
#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 64, 8, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 32, 128, 4, 1, 4, 2
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 1, 2
#endif
