"""Step profiling: kernel/operator names are classed as attention, matmul or other; a profiled
step of a real run logs the shares and writes a Chrome trace."""
import json
from types import SimpleNamespace

import pytest
import torch
from train_runner import losses, run

from training.telemetry.profiling import classify, time_shares, top_kernels


@pytest.mark.parametrize("name, cls", [
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", "attention"),
    ("void flashgpt::flash_bwd_kernel<...>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::mm", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ("aten::layer_norm", "other"),
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopA_geluauxbias_TNN", "matmul"),  # the MLP's fused GELU
    ("void flashgpt::(anonymous namespace)::gelu_backward_bias_kernel<__nv_bfloat162>(...)", "other"),
    ("void flashgpt::(anonymous namespace)::add_layer_norm_backward_kernel<__nv_bfloat162, 512>(...)", "other"),
    ("flashgpt::(anonymous namespace)::param_grads_kernel(float const*, float*, float*, int, int)", "other"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "communication"),  # an all-to-all
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("c10d::alltoall_base_", "communication"),
    ("gloo:all_to_all", "communication"),
    ("aten::all", "other"),
])
def test_classify(name, cls):
    assert classify(name) == cls


def _gpu_event(name, us, annotation=False):
    return SimpleNamespace(key=name, count=1, self_device_time_total=us, is_user_annotation=annotation,
                           device_type=torch.autograd.DeviceType.CUDA)


def test_gpu_spans_of_user_annotations_are_not_kernel_time():
    """torch's optimizers wrap step() in record_function; its GPU-side span covers the optimizer's
    kernels, so counting it would count them twice ('other' and 'GPU busy' would be ~1% high)."""
    events = [_gpu_event("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 600.0),
              _gpu_event("void flashgpt::sm90::flash_bwd_kernel<...>", 250.0),
              _gpu_event("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 100.0),
              _gpu_event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 50.0),
              _gpu_event("Optimizer.step#AdamW.step", 149.0, annotation=True),
              SimpleNamespace(key="aten::mm", count=1, self_device_time_total=600.0, is_user_annotation=False,
                              device_type=torch.autograd.DeviceType.CPU)]
    shares = time_shares(events, "cuda")
    assert shares["kernel_time_s"] == pytest.approx(1000e-6)
    assert (shares["time_share_matmul"], shares["time_share_attention"], shares["time_share_communication"],
            shares["time_share_other"]) == pytest.approx((0.6, 0.25, 0.05, 0.1))
    top = top_kernels(events, "cuda").splitlines()
    assert len(top) == 5 and not any("Optimizer.step#" in line or "aten::mm" in line for line in top)
    assert top[1].split()[0] == "60.00%"


def test_profiled_step_logs_shares_and_trace(tmp_path):
    cache = tmp_path / "cache"
    run(tmp_path, cache, "train.max_steps=3", "train.run_name=p", "train.profile_step=2",
        "train.eval_interval=0", "train.save_final=false")
    recs = [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    step2 = next(r for r in recs if r["step"] == 2)
    shares = [step2[f"time_share_{k}"] for k in ("attention", "matmul", "other")]
    assert abs(sum(shares) - 1.0) < 1e-6 and all(s > 0 for s in shares)
    if torch.cuda.is_available():  # the run trains on the GPU: its summed kernel time is logged too
        assert step2["kernel_time_s"] > 0
    else:  # operator shares only on the CPU
        assert "kernel_time_s" not in step2
    assert (tmp_path / "p" / "profile_step_2.json").stat().st_size > 1000
    top = (tmp_path / "p" / "profile_step_2.top.txt").read_text().splitlines()
    assert top[0].startswith("share") and len(top) > 5  # header + the costliest operators
    assert any(" matmul " in line for line in top[1:]) and any(" attention " in line for line in top[1:])
    if torch.cuda.is_available():  # kernels only: not the optimizer's record_function span
        assert not any("Optimizer.step#" in line for line in top[1:])
    assert sorted(losses(tmp_path / "p")) == [1, 2, 3]
