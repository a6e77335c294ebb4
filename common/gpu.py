"""Speed habits: the GPU switches, a clock that is right on an asynchronous GPU, --compile,
--precision and --channels-last, fused Adam, and host-to-GPU copies in one pinned transfer.

Which device a rank takes: common/dist.py (`pick_device`), whose set-up also turns these
switches on for a GPU.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

_compile = False  # something was compiled (compiled())
_compiled: dict = {}  # fn -> its compiled version


def set_gpu_habits(fast: bool = True) -> None:
    torch.backends.cudnn.benchmark = fast  # fixed input shapes: autotune each convolution once
    torch.backends.cuda.matmul.allow_tf32 = fast  # TF32 matmuls and convolutions (Ampere+)
    torch.backends.cudnn.allow_tf32 = fast


def deterministic() -> None:
    """--torch-deterministic (CleanRL's flag): torch's deterministic algorithms (an op that has
    none warns, naming itself), cuDNN's deterministic convolutions, no autotuning, no TF32."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first call
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    set_gpu_habits(fast=False)


def compiled(fn, on: bool):
    """fn under --compile: the sampling step's network, and the learner's loss (forward and loss
    in one compiled graph, its backward compiled with it; the all-reduce, clip and optimizer step
    stay eager, as the learning rate changes every step). torch.compile(mode="reduce-overhead"):
    CUDA graphs on a GPU, so every call must keep its shapes (one compilation per batch size).
    Off by default: compilation takes 10-60 s on a CPU, and no GPU run has yet shown the gain.
    One compiled function per fn, however often asked for."""
    global _compile
    if not on:
        return fn
    _compile = True
    if fn not in _compiled:
        own_compile_cache()
        share_compile_workers()
        graph = torch.compile(fn, mode="reduce-overhead")

        def step(*args, **kwargs):
            if torch.cuda.is_available():  # the CUDA graphs' previous outputs are consumed
                torch.compiler.cudagraph_mark_step_begin()
            return graph(*args, **kwargs)
        _compiled[fn] = step
    return _compiled[fn]


def own_compile_cache() -> None:
    """Compile into a folder of this process's own, removed at its exit, unless the user names
    one (TORCHINDUCTOR_CACHE_DIR): inductor's shared cache is not safe for processes compiling
    the same graph at once, as torchrun's ranks or a sampler process and its learner do (one
    reads a compiled library another is still writing: "file too short", pytorch/torchdynamo
    #1347). Each process then compiles from scratch (10-60 s on a CPU). Inductor writes its
    shared default folder into TORCHINDUCTOR_CACHE_DIR whenever it finds the variable unset, so
    that folder is never taken for the user's choice."""
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if named and os.path.abspath(named) != _inductor_default_cache() and \
            os.environ.get("ACCELRL_COMPILE_CACHE_OF") in (None, str(os.getpid())):
        return  # the user's, or this process's already
    # A parent's folder (a sampler process's learner): this one goes inside it, so that the
    # parent's exit removes it even when this process was killed.
    owner = os.environ.get("ACCELRL_COMPILE_CACHE_OF")
    parent = named if owner and owner != str(os.getpid()) else None
    folder = tempfile.mkdtemp(prefix="accelrl-compile-",
                              dir=parent if parent and os.path.isdir(parent) else None)
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=folder, ACCELRL_COMPILE_CACHE_OF=str(os.getpid()))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


def share_compile_workers() -> None:
    """Inductor compiles with min(32, cores) worker processes in every process; torchrun's ranks
    on one machine (LOCAL_WORLD_SIZE) share its cores, so each takes its share (at least 1):
    8 ranks would otherwise start about 256. TORCHINDUCTOR_COMPILE_THREADS, when set, decides."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    import torch._inductor.config as inductor
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    inductor.compile_threads = max(1, min(32, os.cpu_count() or 1) // ranks)


def _inductor_default_cache() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return os.path.abspath(default_cache_dir())
    except ImportError:  # torch moved it: no folder is then taken for the default
        return ""


def compile_seconds() -> float:
    """Seconds spent compiling so far in this process (forward and backward graphs)."""
    if not _compile:
        return 0.0
    from torch._dynamo.utils import calculate_time_spent  # torch's own compile-time record
    return float(calculate_time_spent().get("total_wall_time", 0.0))


def channels_last(setting: str, device: torch.device) -> bool:
    """--channels-last: "auto" is on where it measured faster, on a CPU (docs/results.md: every
    script's learner 1.26-1.43x faster in fp32); off on a GPU until measured there."""
    return setting == "on" or (setting == "auto" and device.type == "cpu")


def in_modes(forward):
    """A network's forward (decorated) in its `precision` ("fp32" or "bf16": bfloat16 autocast,
    on a GPU or a CPU with bf16 units; its backward follows) and `channels_last` setting (the
    input, hence every convolution, in channels-last memory format). The forward computes its
    output layers with `float32` below, so in bf16 the torso and hidden layers run in bf16 while
    logits, values and Q-values keep float32's resolution (bf16 would round them to about 0.4%:
    argmax ties, noisy PPO ratios); its tensor outputs are float32, so the losses, targets, the
    C51 projection and the optimizer's state never see bf16. The layout changes no value, only
    the summation order."""
    @functools.wraps(forward)
    def run(self, obs: torch.Tensor, *args, **kwargs):
        if obs.dim() == 4 and channels_last(self.channels_last, obs.device):
            obs = obs.contiguous(memory_format=torch.channels_last)
        with torch.autocast(obs.device.type, dtype=torch.bfloat16,
                            enabled=self.precision == "bf16"):
            out = forward(self, obs, *args, **kwargs)
        return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()
    return run


def float32(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """layer(h) in float32, autocast off: a network's output layer on its (bf16) hidden
    features, under in_modes."""
    with torch.autocast(h.device.type, enabled=False):
        return layer(h.float())


def adam(params, **kwargs) -> torch.optim.Adam:
    """Adam, fused into one kernel per step where torch has one (CPU and GPU): the same update,
    measured 8% off PPO's learner step on a CPU."""
    params = list(params)
    return torch.optim.Adam(params, fused=params[0].device.type in ("cpu", "cuda"), **kwargs)


def switches(device: torch.device | None = None) -> dict:
    """The performance switches in force, for summary.json; those of cuDNN and TF32 only for a
    run on a GPU (None on a CPU, where torch's defaults, such as cuDNN's TF32 on, apply to
    nothing)."""
    on_gpu = device is None or device.type == "cuda"
    return {"deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic if on_gpu else None,
            "cudnn_benchmark": torch.backends.cudnn.benchmark if on_gpu else None,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if on_gpu else None,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32 if on_gpu else None,
            "distribution_validation": torch.distributions.Distribution._validate_args,
            "compile": _compile, "compile_seconds": compile_seconds(),
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
