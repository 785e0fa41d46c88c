"""Helpers of the GPU tests of our extension's ops (import after the module's CUDA skip)."""
from __future__ import annotations

import contextlib
import itertools
import re
import zlib

import pytest
import torch


def require_extension():
    """Fail (not skip) when the extension did not build: on a GPU machine that is a defect."""
    import kernels

    if not kernels.is_available():
        pytest.fail("extension did not build: " + kernels.unavailable_reason())


@pytest.fixture(scope="module", autouse=True)
def built_and_poisoned():
    """Autouse in the test modules that import it: the extension must have built (fail, not skip), and
    every uninitialised output starts as NaN (poison_uninitialised_memory)."""
    require_extension()
    with poison_uninitialised_memory():
        yield


def max_err(a, ref) -> float:
    """max |a - ref| in fp32."""
    return (a.float() - ref.float()).abs().max().item()


def check_against_torch(name: str, ours, ref, pt, eps: float):
    """ours within 2x PyTorch's own error (pt, the same op in the input dtype) of the fp32 reference, + eps,
    + the error of storing the reference itself in ours' dtype (up to half a unit in the last place of its
    largest elements: a max error over a rounded tensor is that large however exactly it was computed,
    and torch's can land below it by chance; at 512 x 512, bf16, dV's largest elements near 6, half a ulp
    is 1.6e-2); no NaN or inf (an unwritten, poisoned element). Returns (ours' error, torch's)."""
    assert torch.isfinite(ours).all(), f"{name}: NaN or inf in output (unwritten element?)"
    e, e_pt = max_err(ours, ref), max_err(pt, ref)
    rounding = max_err(ref.to(ours.dtype), ref)
    assert e <= 2 * e_pt + eps + rounding, (f"{name}: max err {e:.3e} > 2 x torch's {e_pt:.3e} + {eps}"
                                            f" + {rounding:.3e} (the reference rounded to {ours.dtype})")
    return e, e_pt


def ext():
    from kernels.build import load_extension

    return load_extension()


class InputSeeds:
    """A test module's seeds for its random inputs: next() gives first + k for the test's k-th draw, k
    counted from the start of each test, plus an offset from the test's node id (tests/conftest.py calls
    start_test), so a test draws the same inputs however it was selected (-k, one file, the suite) and a
    failure reproduces on its own."""

    _all: list["InputSeeds"] = []

    def __init__(self, first: int):
        self.first = self.value = first
        InputSeeds._all.append(self)

    def __iter__(self):
        return self

    def __next__(self) -> int:
        self.value += 1
        return self.value - 1

    @classmethod
    def start_test(cls, nodeid: str) -> None:
        offset = 1000 * (zlib.crc32(nodeid.encode()) % 1_000_000)
        for seeds in cls._all:
            seeds.value = seeds.first + offset


def fresh_factory(first_seed: int):
    """fresh(*shape, dtype=bf16, scale=1.0): a new seeded N(0, scale^2) CUDA tensor per call."""
    seeds = InputSeeds(first_seed)

    def fresh(*shape, dtype=torch.bfloat16, scale=1.0):
        torch.manual_seed(next(seeds))
        return (torch.randn(*shape, device="cuda") * scale).to(dtype)

    return fresh


@contextlib.contextmanager
def poison_uninitialised_memory():
    """torch.empty / at::empty (also inside our binding), new_empty and empty_like fill float tensors
    with NaN meanwhile: PyTorch's own mechanism (deterministic algorithms on, warn_only so an op without
    a deterministic version only warns, and torch.utils.deterministic.fill_uninitialized_memory).
    Our kernels take `deterministic` as an argument, so the global mode changes no kernel choice."""
    import torch.utils.deterministic as det

    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        det.fill_uninitialized_memory = was_fill


# The Hopper dispatch table (csrc/hopper/dispatch.cu): one choice per (pass, head dim, causal, seqlen
# bucket); pass 0 forward / 1 backward, head dims 64 and 128, buckets 0-3 (ext.seqlen_bucket(seqlen_k):
# <= 1k, 2k, 4k, longer keys). Choice -1 = the built-in default, 0 = the FA2 kernel, 1 = the Hopper kernel
# (TMA, warp-specialised), backward also 2 / 3 = the Hopper kernel with its two consumer warpgroups in
# lock-step / taking turns. Off Hopper the table is ignored: the FA2 kernels run.
TABLE_ENTRIES = tuple(itertools.product((0, 1), (64, 128), (False, True), range(4)))

# Named kernel paths: name -> {pass: choice} written into every entry of that pass (the others -1). On
# Hopper "default" is the Hopper kernel at head dims 64 / 128 (FA2 where a tensor breaks a TMA rule or a
# small packed batch's dQ tiles would not fit), the backward in lock-step below 1024 queries (head dim 128
# without a causal mask: 512) and in turns from there; head dim 96 is always FA2.
KERNEL_PATHS = {"default": {}, "fa2": {0: 0, 1: 0}, "fa2_bwd": {1: 0}, "hopper": {0: 1, 1: 1},
                "lockstep": {1: 2}, "turns": {1: 3}}
BACKWARD_PATHS = ("default", "fa2", "fa2_bwd", "lockstep", "turns")
ANY_GPU_PATHS = ("default",)  # the others choose between Hopper kernel families


def reset_dispatch() -> None:
    """Every entry of the dispatch table back to -1 (the built-in defaults)."""
    e = ext()
    for entry in TABLE_ENTRIES:
        e.set_sm90_choice(*entry, -1)


@contextlib.contextmanager
def kernel_path(name: str):
    """Within the block our attention runs path `name` of KERNEL_PATHS: the whole table is written
    ("default": every entry -1, so a tuning cache applied at load does not decide), and every entry is
    back to -1 afterwards, also when the block raises."""
    choices = KERNEL_PATHS[name]
    e = ext()
    try:
        for entry in TABLE_ENTRIES:
            e.set_sm90_choice(*entry, choices.get(entry[0], -1))
        yield name
    finally:
        reset_dispatch()


def is_hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


def skip_same_kernel(d: int, path: str) -> None:
    if d == 96 and path not in ("default", "fa2"):
        pytest.skip("head dim 96 runs FA2 on every path")


def every_case(test):
    """Parametrize over both 16-bit dtypes, head dims 64 / 96 / 128, causal or not."""
    test = pytest.mark.parametrize("causal", [False, True])(test)
    test = pytest.mark.parametrize("d", [64, 96, 128])(test)
    return pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])(test)


def cu_seqlens(lengths) -> torch.Tensor:
    """Cumulative offsets [0, l0, l0 + l1, ...] (int32, CUDA) of packed sequences."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def backward_path_fixture(names):
    """A `path` fixture over `names` of KERNEL_PATHS (assign it to `path` in the test module): each test
    runs inside kernel_path(name); off Hopper only the paths of ANY_GPU_PATHS run, the others skip."""
    unknown = [n for n in names if n not in KERNEL_PATHS]
    if unknown:
        raise ValueError(f"unknown kernel paths {unknown}; known: {list(KERNEL_PATHS)}")

    @pytest.fixture(params=list(names))
    def path(request):
        if request.param not in ANY_GPU_PATHS and not is_hopper():
            pytest.skip("one kernel family off Hopper")
        with kernel_path(request.param):
            yield request.param

    return path


# Our attention kernels as the profiler names them (demangled, e.g. "void flash_bwd_sm90_ws_kernel<
# __nv_bfloat16, 128, true, false, true>(Flash_bwd_params, BwdTmaMaps)"; a mangled name holds the same
# identifier). Case matters: the FA2 kernels' traits are Flash_fwd_kernel_traits / Flash_bwd_kernel_traits.
KERNEL_FAMILIES = {"hopper_fwd": "flash_fwd_sm90_ws_kernel", "hopper_bwd": "flash_bwd_sm90_ws_kernel",
                   "fa2_fwd": "flash_fwd_kernel", "fa2_bwd": "flash_bwd_kernel"}  # the last: also ..._kernel_2d


def launched_kernels(fn) -> list:
    """Names of the CUDA kernels that fn() launched (torch.profiler, in launch order)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def kernel_families(names) -> set:
    """The KERNEL_FAMILIES keys among `names`, the Hopper backward split by its Pingpong template
    argument: "hopper_bwd_lockstep" or "hopper_bwd_turns"."""
    found = set()
    for n in names:
        for family, ident in KERNEL_FAMILIES.items():
            if ident in n:
                found.add(family + "_" + _bwd_schedule(n) if family == "hopper_bwd" else family)
    return found


def _template_args(name: str, ident: str) -> list[str] | None:
    """The top-level template arguments of kernel `ident` in a demangled name; None if it is mangled."""
    rest = name[name.index(ident) + len(ident):]
    if not rest.startswith("<"):
        return None
    depth, args, cur = 0, [], ""
    for ch in rest[1:]:
        if ch == "<":
            depth += 1
        elif ch == ">":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    args.append(cur.strip())
    return args


def _mangled_bools(name: str, ident: str) -> list[str]:
    """The bool template arguments ("0" / "1", in order) of kernel `ident` in a mangled (Itanium) name."""
    return re.findall(r"Lb([01])E", name[name.index(ident) + len(ident):])


_TRUE, _FALSE = ("true", "1", "(bool)1"), ("false", "0", "(bool)0")


def _bwd_schedule(name: str) -> str:
    """'turns' or 'lockstep' from a Hopper backward kernel's name: its template arguments are
    <T, D, Is_causal, Is_even, Pingpong[, Is_local[, Causal_skip]]>; AssertionError naming the kernel
    when that cannot be read."""
    ident = KERNEL_FAMILIES["hopper_bwd"]
    args = _template_args(name, ident)
    if args is not None:
        flag = args[4] if len(args) in (5, 6, 7) else ""
        if flag in _TRUE:
            return "turns"
        if flag in _FALSE:
            return "lockstep"
    else:  # mangled: the bools are Lb0E / Lb1E, Pingpong the third
        bools = _mangled_bools(name, ident)
        if len(bools) >= 3:
            return "turns" if bools[2] == "1" else "lockstep"
    raise AssertionError(f"cannot read the backward schedule from the kernel name {name!r}")


def forward_key_tile(name: str) -> int:
    """Keys per K/V tile of a Hopper forward kernel, from its name: its template arguments are
    <T, D, NC, Is_causal, Is_even, Short_first, Is_local, Wide>, Wide meaning 160 keys, else 128;
    AssertionError naming the kernel when that cannot be read."""
    ident = KERNEL_FAMILIES["hopper_fwd"]
    args = _template_args(name, ident)
    if args is not None:  # a defaulted Wide (false) may be left out of a demangled name
        wide = args[7] if len(args) == 8 else "false" if len(args) >= 5 else ""
    else:  # mangled: every argument is there, Wide the fifth bool
        bools = _mangled_bools(name, ident)
        wide = bools[4] if len(bools) == 5 else ""
    if wide in _TRUE:
        return 160
    if wide in _FALSE:
        return 128
    raise AssertionError(f"cannot read the key tile from the kernel name {name!r}")
