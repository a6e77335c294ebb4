"""GPU habits: the speed switches, a clock that is right on an asynchronous GPU, --compile, and
host-to-GPU copies in one pinned transfer. On the CPU each is a no-op or the plain thing.

Which device a rank takes: common/dist.py (`pick_device`), whose set-up also turns these
switches on for a GPU.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

_compile = False  # some network was compiled (compiled())


def set_gpu_habits() -> None:
    torch.backends.cudnn.benchmark = True  # fixed input shapes: autotune each convolution once
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls and convolutions (Ampere+)
    torch.backends.cudnn.allow_tf32 = True


def compiled(fn, on: bool):
    """The sampling step's network under --compile: torch.compile(mode="reduce-overhead"), CUDA
    graphs on a GPU (its batch is fixed: one compilation per group size). Off by default: per-step
    inference at batch 8 to 16 is launch-bound, but no GPU run has yet shown the gain."""
    global _compile
    _compile = _compile or on
    return torch.compile(fn, mode="reduce-overhead") if on else fn


def in_precision(forward):
    """A network's forward (decorated) under bfloat16 autocast when its `precision` attribute is
    "bf16" (--precision; its backward follows), on a GPU or a CPU with bf16 units; "fp32" changes
    nothing. Its tensor outputs come back float32, so the losses, log-probabilities, targets, the
    C51 projection and the optimizer's state downstream never see bf16."""
    @functools.wraps(forward)
    def run(self, obs: torch.Tensor, *args, **kwargs):
        with torch.autocast(obs.device.type, dtype=torch.bfloat16,
                            enabled=self.precision == "bf16"):
            out = forward(self, obs, *args, **kwargs)
        return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()
    return run


def switches() -> dict:
    """The performance switches in force, for summary.json."""
    return {"cudnn_benchmark": torch.backends.cudnn.benchmark,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "distribution_validation": torch.distributions.Distribution._validate_args,
            "compile": _compile,
            "backend": dist.get_backend() if dist.is_available() and dist.is_initialized()
            else None}


def clock(device: torch.device) -> float:
    """perf_counter() once `device` has run its queued work (a GPU's kernels outlast launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Upload:
    """Host tensors to a GPU in one copy (pageable copies wait, one per tensor): packed into a
    reused pinned buffer, sent without waiting, viewed back with their shapes and dtypes; on the
    CPU, the tensors as they are. For `--replay-device cpu`, APPO's rollouts, central pulls."""

    def __init__(self, device: torch.device):
        self.device, self.host, self.sent = device, None, None

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type != "cuda":
            return tensors
        spans, total = [], 0
        for t in tensors.values():
            n = t.numel() * t.element_size()
            spans.append((total, n))
            total += -(-n // 16) * 16  # aligned, so every span can be viewed as any dtype
        if self.host is None or len(self.host) < total:
            self.host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        elif self.sent is not None:
            self.sent.synchronize()  # the previous upload has left the buffer
        for t, (o, n) in zip(tensors.values(), spans):
            self.host[o:o + n].view(t.dtype).view(t.shape).copy_(t)
        dev = self.host[:total].to(self.device, non_blocking=True)
        self.sent = torch.cuda.Event()
        self.sent.record()
        return {k: dev[o:o + n].view(t.dtype).view(t.shape)
                for (k, t), (o, n) in zip(tensors.items(), spans)}
