// Launchers for the backward pre-pass and post-pass (both element types). Torch-free.
#include "flash_bwd_preprocess.h"

template <typename T>
void run_bwd_preprocess(Flash_bwd_params &params, cudaStream_t stream) {
    dim3 grid(flash::cdiv(params.seqlen_q, flash::kPreRowsPerBlock), params.h, params.b);
    const int64_t dq_accum_n4 = params.dq_accum_floats / 4;  // d % 32 == 0
    if (flash::pre_row_threads(params.d) == 8) {
        flash::flash_bwd_preprocess_kernel<T, 8><<<grid, flash::kPreThreads, 0, stream>>>(params, dq_accum_n4);
    } else {
        flash::flash_bwd_preprocess_kernel<T, 16><<<grid, flash::kPreThreads, 0, stream>>>(params, dq_accum_n4);
    }
    FLASH_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void run_bwd_convert_dq(Flash_bwd_params &params, cudaStream_t stream) {
    if (params.dq_accum_tiled) {  // one CTA per tile
        const dim3 grid(flash::dq_tiles::cdiv_rows(params.seqlen_q, params.d), params.h, params.b);
        if (params.d == 128) flash::flash_bwd_convert_dq_tiles_kernel<T, 128><<<grid, flash::kConvertTileThreads, 0, stream>>>(params);
        else flash::flash_bwd_convert_dq_tiles_kernel<T, 64><<<grid, flash::kConvertTileThreads, 0, stream>>>(params);
        FLASH_KERNEL_LAUNCH_CHECK();
        return;
    }
    const int64_t n4 = int64_t(params.total_q) * params.h * params.d / 4;  // d % 32 == 0
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((n4 + threads - 1) / threads, 132 * 16);
    flash::flash_bwd_convert_dq_kernel<T><<<int(blocks), threads, 0, stream>>>(
        params.dq_accum_ptr, reinterpret_cast<T *>(params.dq_ptr), n4, params.scale_softmax,
        int64_t(params.h) * params.d / 4, params.dq_out_row_stride / 4);
    FLASH_KERNEL_LAUNCH_CHECK();
}

template void run_bwd_preprocess<__nv_bfloat16>(Flash_bwd_params &, cudaStream_t);
template void run_bwd_preprocess<__half>(Flash_bwd_params &, cudaStream_t);
template void run_bwd_convert_dq<__nv_bfloat16>(Flash_bwd_params &, cudaStream_t);
template void run_bwd_convert_dq<__half>(Flash_bwd_params &, cudaStream_t);
