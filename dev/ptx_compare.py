"""Do two source trees build the same device code? Compiles every .cu file under the NEW tree's
kernels/csrc (and the same paths of the OLD tree) to PTX for sm_90a and sm_80 and checks that every
kernel of the NEW tree has a kernel in the same file of the OLD tree with the same PTX body. Names are ignored (a
template parameter may have been removed), as are line info and the numbering of labels. No GPU needed:
nvcc only (CUDA_HOME or /usr/local/cuda).

    python dev/ptx_compare.py OLD_ROOT NEW_ROOT     # each a checkout (or `git archive` of one)
    python dev/ptx_compare.py OLD_ROOT NEW_ROOT --ignore-param-layout
        # a field added to a params struct moves the others: compare with the size of each kernel
        # argument and the offsets of ld.param loads masked (the same loads of other offsets)

Exit code 0 when every new kernel is matched; the unmatched ones are listed otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ARCHES = {"90": ["-arch=compute_90a", "-DFLASHGPT_HAS_SM90A"], "80": ["-arch=compute_80"]}
FLAGS = ["-ptx", "-std=c++17", "-O3", "--use_fast_math", "--expt-relaxed-constexpr"]
ENTRY = re.compile(r"\.visible \.entry (\S+)\(")


def nvcc() -> str:
    return str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")


def compile_ptx(csrc: Path, source: Path, arch: str, out: Path) -> Path:
    target = out / f"{source.stem}.{arch}.ptx"
    cmd = [nvcc(), *FLAGS, *ARCHES[arch], "-I", str(csrc), str(source), "-o", str(target)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed on {source} ({arch}):\n{done.stderr[-2000:]}")
    return target


IGNORE_PARAM_LAYOUT = False


def normalised(body: str, name: str) -> str:
    body = body.replace(name, "NAME")
    if IGNORE_PARAM_LAYOUT:
        body = re.sub(r"(_param_\d+)\[\d+\]", r"\1[SIZE]", body)
        body = re.sub(r"(ld\.param\.\S+\s+[^,]+,\s*\[[^\]+]+)\+-?\d+\]", r"\1+OFF]", body)
    body = re.sub(r"\s*\.loc\s+\d+\s+\d+\s+\d+.*", "", body)
    body = re.sub(r"//.*", "", body)
    body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
    labels: dict[str, str] = {}  # inline-asm labels (WAIT_12, ...), renumbered by first use
    return re.sub(r"\b[A-Z_]+_\d+\b", lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), body)


def kernels_of(ptx: Path) -> dict[str, str]:
    """Kernel name -> hash of its normalised PTX body."""
    text = ptx.read_text()
    out = {}
    for m in ENTRY.finditer(text):
        end = text.index("\n}\n", m.start())
        out[m.group(1)] = hashlib.sha1(normalised(text[m.start():end], m.group(1)).encode()).hexdigest()
    return out


def cu_files(root: Path) -> list[str]:
    csrc = root / "kernels" / "csrc"
    found = sorted(str(p.relative_to(csrc)) for p in csrc.rglob("*.cu"))
    if not found:
        raise SystemExit(f"{root}: no kernels/csrc/**/*.cu; give the root of a checkout")
    return found


def build(root: Path, files: list[str], out: Path, jobs: int) -> dict[tuple[str, str], dict[str, str]]:
    csrc = root / "kernels" / "csrc"
    jobs_list = [(f, a) for f in files if (csrc / f).exists() for a in ARCHES]
    for i, (f, _) in enumerate(jobs_list):
        (out / str(i)).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(jobs) as pool:
        ptx = list(pool.map(lambda ia: compile_ptx(csrc, csrc / ia[1][0], ia[1][1], out / str(ia[0])),
                            enumerate(jobs_list)))
    return {(f, a): kernels_of(p) for (f, a), p in zip(jobs_list, ptx)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--ignore-param-layout", action="store_true",
                    help="mask kernel-argument sizes and ld.param offsets (a params struct gained a field)")
    args = ap.parse_args()
    global IGNORE_PARAM_LAYOUT
    IGNORE_PARAM_LAYOUT = args.ignore_param_layout
    with tempfile.TemporaryDirectory() as tmp:
        files = cu_files(args.new)
        old = build(args.old, files, Path(tmp) / "old", args.jobs)
        new = build(args.new, files, Path(tmp) / "new", args.jobs)
    total, unmatched = 0, []
    for key, kernels in sorted(new.items()):
        known = set(old.get(key, {}).values())
        for name, digest in kernels.items():
            total += 1
            if digest not in known:
                unmatched.append(f"{key[0]} sm_{key[1]}: {name}")
    print(f"{total} kernels in {args.new}; {total - len(unmatched)} with the same PTX as a kernel of {args.old}")
    for line in unmatched:
        print("  no match:", line)
    return 1 if unmatched else 0


if __name__ == "__main__":
    sys.exit(main())
