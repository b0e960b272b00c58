"""Tensors the stages make land on the model's device and in its dtype (issue 24 item 1).

The tests run on the CPU only, so a tensor made without the model's device (a CPU generator's
``randn`` meeting a CUDA model) is invisible here: CPU meets CPU. The guard makes it visible: the
model and its inputs stay on the CPU in float64, while torch's *default* device is ``meta`` for
the duration of the stage helper. A tensor the helper makes without naming a device then lands on
``meta``, and the first operation that meets the model's tensors fails, exactly where the CUDA run
failed (``cp_plan._lists_that_see``: "Expected all tensors to be on the same device").
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ditbook.cp.dryrun import verify_before_launch
from ditbook.cp.plan import derive_cp_plan, perturbation_like, resolve_cp_plan, trace_forward

from test_parallel_cp import _gqa


@contextlib.contextmanager
def foreign_default_device():
    """Every factory call that names no device makes a ``meta`` tensor while this is active."""
    with torch.device("meta"):
        yield


def _float64_models():
    """Two DiTs in float64 with their inputs: the shipped third-party example (conv patch embedding,
    position table, GQA) and diffusers' FLUX transformer at a tiny size (double and single stream
    lists, RoPE from ids, guidance), the shape of the shipped reference model."""
    from ditbook.zoo.flux import FluxSize, make_transformer

    gqa, gkw = _gqa()
    torch.manual_seed(0)
    size = FluxSize()
    flux = make_transformer(size).eval()
    tokens, text = 16, 8
    fkw = dict(hidden_states=torch.randn(1, tokens, flux.config.in_channels),
               encoder_hidden_states=torch.randn(1, text, size.text_dim),
               pooled_projections=torch.randn(1, size.clip_dim), timestep=torch.rand(1),
               img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                                  indexing="ij"), -1).reshape(tokens, 3),
               txt_ids=torch.zeros(text, 3), guidance=torch.full((1,), 3.5), return_dict=False)
    out = []
    for m, kw in ((gqa, gkw), (flux, fkw)):
        kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
        out.append((m.double(), kw))
    return out


def test_guard_catches_a_tensor_made_without_the_models_device():
    """The guard itself can fail: the pattern of the CUDA bug (a CPU generator's randn combined with
    a model tensor) raises under it."""
    m, kw = _float64_models()[0]
    base = next(v for v in kw.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    with foreign_default_device(), pytest.raises((RuntimeError, NotImplementedError)):
        g = torch.Generator().manual_seed(0)
        _ = base + (base.std() * torch.randn(base.shape, generator=g)).to(base)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_perturbation_lands_on_the_inputs_device_and_dtype(dtype):
    base = torch.randn(2, 3, 4).to(dtype)
    with foreign_default_device():
        out = perturbation_like(base, seed=1)
    assert out.device == base.device and out.dtype == base.dtype and out.shape == base.shape
    again = perturbation_like(base, seed=1)
    assert torch.equal(out, again)  # seeded: the same numbers every time


def test_trace_and_cp_plan_make_nothing_off_the_models_device():
    """trace_forward (which perturbs the image input to see which lists it reaches), the plan
    derivation and the pre-launch checks (dry run, every rank simulated in one process), on
    float64 models with a foreign default device: each tensor they make follows the model."""
    for m, kw in _float64_models():
        with foreign_default_device():
            tr = trace_forward(m, (), kw)
            assert tr.lists, "the trace saw no block list"
            cp = derive_cp_plan(m, (), kw, degree=2)
            checked = resolve_cp_plan(m, capture=lambda kw=kw: ((), kw), degree=2, check=verify_before_launch)
        assert cp.plan and checked.facts["prelaunch"]["checked"]


def test_cache_decision_flag_lives_where_the_collective_needs_it(monkeypatch):
    """cache-dit's per-step decision is agreed across ranks with a one-element tensor; on NCCL that
    tensor must be on the current CUDA device whatever the cached call's first argument is."""
    import ditbook.cp.cache_sync as sync

    monkeypatch.setattr(sync.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sync.dist, "get_backend", lambda group=None: "gloo")
    assert sync._collective_device().type == "cpu"
    monkeypatch.setattr(sync.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(sync.torch.cuda, "current_device", lambda: 0)
    assert sync._collective_device() == torch.device("cuda", 0)


def test_noise_floor_compares_with_a_linear_memory_kernel_on_a_gpu():
    """On a GPU the noise floor's other attention backend is the memory-efficient kernel: math
    SDPA holds every head's tokens x tokens scores (26 GB a call at a 480p Wan video); on the CPU
    it stays math SDPA."""
    import types

    import torch

    from ditbook.cache.verify import other_attention_backend

    def pipe_on(device):
        weight = types.SimpleNamespace(device=torch.device(device))
        return types.SimpleNamespace(transformer=types.SimpleNamespace(parameters=lambda: iter([weight])))

    assert other_attention_backend(pipe_on("cuda:0")) == "_native_efficient"
    assert other_attention_backend(pipe_on("cpu")) == "_native_math"


def test_stage_kernel_started_ahead_warms_the_cards_device(monkeypatch):
    """The kernel started ahead of a stage ends its start-up line by starting the card's device
    (``loading.warm_device``); on a machine without CUDA that is a no-op that returns False and
    raises nothing, for 'auto' and for an explicit CUDA device alike."""
    from pathlib import Path

    from ditbook.card import load_card
    from ditbook.kernels import warm_line
    from ditbook.loading import warm_device

    card = load_card(Path(__file__).resolve().parents[1] / "models" / "reference.yaml")
    line = warm_line("cache", card)
    assert line.endswith(f"warm_device({card.runtime.device!r});"), line
    calls = []
    monkeypatch.setattr("ditbook.loading.warm_device", lambda device="auto": calls.append(device))
    exec(compile(line, "<warm line>", "exec"), {})  # the line runs as the kernel's exec_lines does
    assert calls == [card.runtime.device]
    monkeypatch.undo()
    if not torch.cuda.is_available():
        assert warm_device("auto") is False and warm_device("cuda") is False and warm_device("cpu") is False
