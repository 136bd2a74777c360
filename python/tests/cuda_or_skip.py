"""The preamble every GPU test of the extension shares: exits 77 (skip) when torch or a CUDA device is
missing, 1 when the extension is not built, and otherwise exports torch and the package modules.
Import it first: `from cuda_or_skip import torch, ect, ev`."""
import os
import sys
import traceback

try:
    import torch
except ImportError as e:
    print(f"SKIP: torch is not importable ({e})")
    sys.exit(77)
if not torch.cuda.is_available():
    print(f"SKIP: torch {torch.__version__} sees no CUDA device")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # python/ (in-place build)
try:
    import expert_cache_torch as ect
    from expert_cache_torch import vllm as ev
except ImportError:
    print("FAIL: expert_cache_torch is not importable (build it: cd python && python setup.py build_ext --inplace)")
    traceback.print_exc()
    sys.exit(1)

__all__ = ["torch", "ect", "ev"]
