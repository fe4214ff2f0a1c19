"""What kiln's Python peers share: their JSON lines and the statistics in them.

A peer runs as `python3 bench/peer_X.py`, so this module is found beside it.
"""
import json
import sys


class Emitter:
    """Writes one JSON object a line: {"bench": ..., "peer": ..., "dtype": ...}
    then the object's own fields (dtype once set, unless the object names it)."""

    def __init__(self, bench, peer, dtype=None):
        self.bench, self.peer, self.dtype = bench, peer, dtype

    def __call__(self, obj):
        base = {"bench": self.bench, "peer": self.peer}
        if self.dtype is not None:
            base["dtype"] = self.dtype
        base.update(obj)
        sys.stdout.write(json.dumps(base) + "\n")
        sys.stdout.flush()


def quantile(sorted_v, q):
    """The q-quantile of an ascending list, interpolated linearly; None when empty."""
    n = len(sorted_v)
    if n == 0:
        return None
    pos = q * (n - 1)
    lo = int(pos)
    if lo + 1 >= n:
        return sorted_v[-1]
    return sorted_v[lo] + (sorted_v[lo + 1] - sorted_v[lo]) * (pos - lo)


def r3(x):
    return None if x is None else round(x, 3)


def cuda_device(emit):
    """torch and its first CUDA device, with a first kernel run on it; None
    after a "skipped" line when there is no driver or no torch."""
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        dev = torch.device("cuda", 0)
        torch.zeros(1, device=dev).sum().item()
        return torch, dev
    except Exception as e:
        emit({"skipped": "no driver or no torch: %s: %s" % (type(e).__name__, str(e)[:500])})
        return None
