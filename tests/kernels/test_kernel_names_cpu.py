"""tests/gpu_util.py's reading of profiler kernel names (the GPU tests tell kernel families and the
Hopper backward's schedule apart by them): demangled and mangled spellings, FA2's 1-D and 2-D backward."""
import pytest

from gpu_util import KERNEL_PATHS, TABLE_ENTRIES, forward_key_tile, kernel_families

BWD = "void flash_bwd_sm90_ws_kernel<__nv_bfloat16, 128, {c}, false, {p}>(Flash_bwd_params, flash::BwdTmaMaps)"


@pytest.mark.parametrize("causal", ["true", "false"])
def test_demangled_hopper_backward_schedule(causal):
    assert kernel_families([BWD.format(c=causal, p="true")]) == {"hopper_bwd_turns"}
    assert kernel_families([BWD.format(c=causal, p="false")]) == {"hopper_bwd_lockstep"}


@pytest.mark.parametrize("causal", ["true", "false"])
def test_demangled_windowed_hopper_backward_schedule(causal):
    """The Is_local instantiations carry a sixth template argument after Pingpong."""
    local = BWD.replace("{p}>", "{p}, true>")
    assert kernel_families([local.format(c=causal, p="true")]) == {"hopper_bwd_turns"}
    assert kernel_families([local.format(c=causal, p="false")]) == {"hopper_bwd_lockstep"}


@pytest.mark.parametrize("local, skip", [("false", "false"), ("false", "true"), ("true", "false")])
def test_demangled_hopper_backward_schedule_all_arguments(local, skip):
    """The profiler spells the defaulted Is_local and Causal_skip arguments out too: seven in all."""
    full = BWD.replace("{p}>", "{p}, " + local + ", " + skip + ">")
    assert kernel_families([full.format(c="true", p="true")]) == {"hopper_bwd_turns"}
    assert kernel_families([full.format(c="true", p="false")]) == {"hopper_bwd_lockstep"}


def test_mangled_hopper_backward_schedule():
    name = "_ZN5flash24flash_bwd_sm90_ws_kernelI13__nv_bfloat16Li64ELb1ELb0ELb{}EEEv16Flash_bwd_paramsNS_10BwdTmaMapsE"
    assert kernel_families([name.format(1)]) == {"hopper_bwd_turns"}
    assert kernel_families([name.format(0)]) == {"hopper_bwd_lockstep"}
    local = name.replace("Lb{}EEEv", "Lb{}ELb1EEEv")  # Is_local after Pingpong
    assert kernel_families([local.format(1)]) == {"hopper_bwd_turns"}
    assert kernel_families([local.format(0)]) == {"hopper_bwd_lockstep"}
    skip = name.replace("Lb{}EEEv", "Lb{}ELb0ELb1EEEv")  # Is_local, Causal_skip after Pingpong
    assert kernel_families([skip.format(1)]) == {"hopper_bwd_turns"}
    assert kernel_families([skip.format(0)]) == {"hopper_bwd_lockstep"}


def test_families_and_their_neighbours():
    names = ["void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, __half, 1>, true, false>("
             "Flash_fwd_params)",
             "void flash::flash_bwd_kernel_2d<Flash_bwd_2d_kernel_traits<128, 64, 128, 8, 2, __nv_bfloat16, 1>, "
             "false, true>(Flash_bwd_params)",
             "void flash_fwd_sm90_ws_kernel<__nv_bfloat16, 64, 3, true, false, false, false>(Flash_fwd_params, "
             "FwdTmaMaps, int*)",
             "void flash::flash_bwd_preprocess_kernel<__nv_bfloat16>(Flash_bwd_params)",
             "void flash::flash_bwd_convert_dq_kernel<__nv_bfloat16>(float const*, __nv_bfloat16*, int)",
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, ...)"]
    assert kernel_families(names) == {"fa2_fwd", "fa2_bwd", "hopper_fwd"}
    assert kernel_families(names[1:2]) == {"fa2_bwd"}


FWD = "void flash::sm90::flash_fwd_sm90_ws_kernel<__nv_bfloat16, 128, 2, false, {e}, false, false{w}>(" \
      "Flash_fwd_params, flash::sm90::FwdTmaMaps, flash::sm90::FwdTiles)"


@pytest.mark.parametrize("even", ["true", "false"])
def test_demangled_forward_key_tile(even):
    assert forward_key_tile(FWD.format(e=even, w=", true")) == 160
    assert forward_key_tile(FWD.format(e=even, w=", false")) == 128
    assert forward_key_tile(FWD.format(e=even, w="")) == 128  # the defaulted Wide left out


def test_mangled_forward_key_tile():
    name = ("_ZN5flash4sm9024flash_fwd_sm90_ws_kernelI13__nv_bfloat16Li128ELi2ELb0ELb1ELb0ELb0ELb{}EEEv16"
            "Flash_fwd_paramsNS0_10FwdTmaMapsENS0_8FwdTilesE")
    assert forward_key_tile(name.format(1)) == 160
    assert forward_key_tile(name.format(0)) == 128
    with pytest.raises(AssertionError, match="cannot read the key tile"):
        forward_key_tile(name.replace("ELb{}EEEv", "EEEv"))


def test_an_unreadable_schedule_fails_loudly():
    with pytest.raises(AssertionError, match="cannot read the backward schedule"):
        kernel_families(["flash_bwd_sm90_ws_kernel(Flash_bwd_params)"])


def test_paths_cover_the_whole_table():
    assert len(TABLE_ENTRIES) == len(set(TABLE_ENTRIES)) == 2 * 2 * 2 * 4  # pass x head dim x causal x bucket
    assert {"default", "fa2", "fa2_bwd", "lockstep", "turns"} <= set(KERNEL_PATHS)
    for choices in KERNEL_PATHS.values():
        assert set(choices) <= {0, 1} and all(c in ((0, 1) if p == 0 else (0, 1, 2, 3)) for p, c in choices.items())
