"""A stand-in for `gpu.compiled` that keeps CUDA graphs' rule for outputs on a CPU.

Under torch.compile(mode="reduce-overhead") on a GPU, a compiled function's outputs, and the
gradients its compiled backward produces, live in the graphs' memory pool. At the next call
(`cudagraph_mark_step_begin`, which gpu.compiled calls each time) that memory is handed to the
next replay: torch then raises on any access to the old tensors ("accessing tensor output of
CUDAGraphs that has been overwritten by a subsequent run"). On a CPU, reduce-overhead uses no
graphs, so a script that keeps an output too long passes every CPU test.

`CudaGraphRule.compiled(fn, on)` runs fn eagerly and gives its tensor outputs, and the parameter
gradients of its backward, in fresh storage. At each call's start every storage handed out
before is poisoned: filled with NaN bytes (a read gives NaN) and made read-only (a write, such
as `grad.zero_()` or `grad += g`, raises, as a replay's reuse would). Values are the eager
function's, bit for bit, so a script that obeys the rule gives the eager run's numbers. It also
records the input shapes of each compiled function: graphs are recorded per shape.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree


class CudaGraphRule:
    def __init__(self):
        self.live: list[torch.UntypedStorage] = []  # the storages the current generation gave
        self.shapes: dict[str, set] = {}  # compiled function's name -> input shapes seen
        self._fns: dict = {}

    def compiled(self, fn, on: bool):
        if not on:
            return fn
        if fn not in self._fns:
            self._fns[fn] = lambda *a, **k: self._call(fn, a, k)
        return self._fns[fn]

    def _step_begin(self) -> None:
        for s in self.live:
            raw = torch.empty(0, dtype=torch.uint8).set_(s)
            raw.fill_(255)  # float32/bf16: NaN
            torch._C._set_throw_on_mutable_data_ptr(raw)  # every tensor on s: writes raise
        self.live = []

    def _fresh(self, t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(t if like is None else like)
        out.copy_(t)
        self.live.append(out.untyped_storage())  # the storage only: autograd may still steal out
        return out

    def _call(self, fn, args, kwargs):
        self._step_begin()
        name = getattr(fn, "__qualname__", type(fn).__name__)
        self.shapes.setdefault(name, set()).add(tuple(
            tuple(t.shape) for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)))
        out = fn(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        modules = [m for m in (fn, getattr(fn, "__self__", None), *args)
                   if isinstance(m, nn.Module)]
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        diff = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if diff:
            fresh = _Boundary.apply(self, tuple(leaves[i] for i in diff), *params)
            for i, t in zip(diff, fresh):
                leaves[i] = t
        leaves = [self._fresh(t) if isinstance(t, torch.Tensor) and not t.requires_grad else t
                  for t in leaves]
        return pytree.tree_unflatten(leaves, spec)


class _Boundary(torch.autograd.Function):
    """Outputs in fresh storage; their backward gives the parameters' gradients in fresh storage
    too (the compiled backward's outputs), which autograd keeps as `.grad` where none exists."""

    @staticmethod
    def forward(ctx, rule, outs, *params):
        # outs, the eager graph's outputs, are no input of this node: its backward runs their
        # graph itself, once, for the parameters alone
        ctx.rule, ctx.outs, ctx.params = rule, outs, params
        return tuple(rule._fresh(t) for t in outs)

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.outs, grads) if g is not None]
        got = torch.autograd.grad([o for o, _ in pairs], ctx.params, [g for _, g in pairs],
                                  allow_unused=True)
        return (None, None, *(None if g is None else ctx.rule._fresh(g, like=p)
                  for g, p in zip(got, ctx.params)))


if __name__ == "__main__":  # python tests/cuda_graphs.py SCRIPT FLAGS: a run under the rule
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import gpu
    from common.trained import load_algo

    rule = CudaGraphRule()
    gpu.compiled = rule.compiled
    script, flags = sys.argv[1], sys.argv[2:]
    sys.argv = [script, *flags]
    load_algo(script).main()
    run_dir = Path(flags[flags.index("--run-dir") + 1])
    (run_dir / "compiled_shapes.json").write_text(json.dumps(
        {k: sorted(map(list, v)) for k, v in rule.shapes.items()}))
