"""FlashAttention-4's SM90 kernels compiled on a CPU, for reading their SASS beside ours.

FA4 (flash_attn.cute, CuTe DSL) compiles at its first call. Under torch's FakeTensorMode, with the
target named by FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH, it compiles without a GPU and CUTE_DSL_KEEP
leaves the cubins; nothing runs. This script does that for one shape (the forward, or the backward's
pre-pass, main kernel and post-pass) and, where cuobjdump is on PATH (the CUDA toolkit, or the
nvidia-cuda-cuobjdump wheel), writes each cubin's SASS beside it and prints each kernel's opcode
counts and each loop that issues wgmmas (between a backward branch and its target), the per-step
code to set beside ours (`cuobjdump -sass` of a cubin from `nvcc -cubin -arch=sm_90a`).

Needs Python 3.12 (FA4's compiled wheels), torch, numpy and the wheels that ../shared/tools/fa4-wheels.sh
fetches, in a virtual environment of their own:

    python3.12 -m venv /tmp/fa4cpu && /tmp/fa4cpu/bin/pip install torch numpy .whl-fa4/*.whl
    /tmp/fa4cpu/bin/python dev/fa4_sass.py --pass bwd --hdim 128 --causal --seqlen 8192 --out /tmp/fa4sass
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
from pathlib import Path

INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def compile_fa4(which: str, d: int, causal: bool, seqlen: int) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    b, h = max(1, 16384 // seqlen), 2048 // d  # the kernel sweep's shapes: 16k tokens, d_model 2048
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, out, dout = (torch.empty(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        if which == "fwd":
            _flash_attn_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
        else:
            lse = torch.empty(b, h, seqlen, device="cuda", dtype=torch.float32)
            _flash_attn_bwd(q, k, v, out, dout, lse, d ** -0.5, causal)


def instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def report(cubin: Path, cuobjdump: str) -> None:
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    cubin.with_suffix(".sass").write_text(sass)
    ins = instructions(sass)
    counts = collections.Counter(opcode(t) for _, t in ins)
    print(f"\n{cubin.name[:100]}: {len(ins)} instructions")
    print("  " + ", ".join(f"{k} {n}" for k, n in counts.most_common(24)))
    index = {a: i for i, (a, _) in enumerate(ins)}
    for i, (a, t) in enumerate(ins):
        m = re.search(r"\bBRA\b.*0x([0-9a-f]+)", t)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in index:
            continue
        body = [x for _, x in ins[index[int(m.group(1), 16)]:i + 1]]
        body_counts = collections.Counter(opcode(x) for x in body)
        if body_counts["HGMMA"] and len(body) < 1000:
            print(f"  loop {int(m.group(1), 16):#x}-{a:#x}: {len(body)} instructions; "
                  + ", ".join(f"{k} {n}" for k, n in body_counts.most_common(16)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pass", dest="which", choices=["fwd", "bwd"], default="bwd")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=Path("fa4_sass"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.update({"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132",
                       "CUTE_DSL_KEEP": "cubin", "CUTE_DSL_DUMP_DIR": str(a.out.resolve())})
    before = set(a.out.glob("*.cubin"))
    compile_fa4(a.which, a.hdim, a.causal, a.seqlen)
    cubins = sorted(set(a.out.glob("*.cubin")) - before)
    print(f"{len(cubins)} cubin(s) in {a.out}")
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        print("cuobjdump is not on PATH: cubins only")
        return
    for cubin in cubins:
        report(cubin, cuobjdump)


if __name__ == "__main__":
    main()
