// Tile configurations of the FA2 kernels per head dim (the fastest measured on an H100 and an A100;
// docs/kernels.md):
//   forward:  (query rows per block, keys per step, warps, min blocks per SM)
//   backward: (query rows per step, keys per block, warps, min blocks per SM, head-dim loop unroll,
//              16-row dQ slabs per warp)
//   backward, 2-D warp layout (head dims 96 and 128 on devices with enough shared memory, else the
//              1-D backward above): (query rows per step, keys per block, warps, key warps,
//              16-row dQ slabs per warp)
// Macros, as the launch templates expand them into template argument lists.
#pragma once

#define FLASH_FWD_HD64 128, 64, 4, 1
#define FLASH_FWD_HD96 128, 32, 4, 1
#define FLASH_FWD_HD128 128, 64, 4, 1
#define FLASH_BWD_HD64 32, 128, 4, 1, 4, 1
#define FLASH_BWD_HD96 64, 128, 8, 1, 1, 1
#define FLASH_BWD_HD128 64, 128, 8, 1, 1, 1
#define FLASH_BWD2D_HD96 64, 128, 8, 4, 1
#define FLASH_BWD2D_HD128 64, 128, 8, 4, 2
