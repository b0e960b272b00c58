"""Issue 27 item 1 and issue 23 item 10: the cache stage runs the model through the adapter module
file it writes (the file it ships), and the folded code resolves its names in the module that
defines each folded function (a reference class in another file, as a third-party wrapper has)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from test_cache import session_for, tiny_run  # noqa: E402,F401  (tiny_run: the fixture)

_SCALE_AT = "    out = self.proj_out(self.norm_out(x))\n"


def _render_from_file(s, path: Path, config: dict) -> dict:
    """The cached render through the stage's loader: the run's adapter file, imported afresh."""
    from ditbook import accel
    from ditbook.cache.verify import render_set

    arch = s.ctx.run.stage_dir("inspect") / "arch.json"
    dbcache = accel.get("dbcache")
    undo = dbcache.apply_with_file(s.pipe, dbcache.settings(**config), adapter_file=path, arch_file=arch,
                                   steps=s.card.generation.steps)
    try:
        gen = s.card.generation
        return render_set(s.pipe, s.card, gen.prompts, gen.seeds)
    finally:
        undo()


def test_stage_cached_images_come_from_the_emitted_module_file(tiny_run):
    from ditbook import accel
    from ditbook.cache.verify import evaluate, max_abs

    card, run, pipe, report = tiny_run
    s = session_for(card, run, pipe, report, only=["dbcache"])
    path = (s.ctx.dir / f"{s.adapter.info.module_name}.py").resolve()
    text = path.read_text()
    assert s.adapter.source == text and Path(s.adapter.module.__file__).resolve() == path
    assert "exec(" not in text and "compile(" not in text
    # the forward the patched transformer runs is a function of that file (not compiled from a string)
    with s.adapter.patched():
        assert pipe.transformer.forward.__func__.__code__.co_filename == str(path)
        assert type(pipe.transformer.blocks[0]).forward.__code__.co_filename == str(path)
    s.noise_floor(other_backend=False)
    strat = accel.get("dbcache")
    gen = s.card.generation
    cfg = strat.grid(s.adapter, gen.steps)[0]
    stage_images: dict = {}
    res = evaluate(pipe, s.card, s.adapter, "dbcache", cfg, s.baseline, s.baseline_counts, s.gates, gen.prompts,
                   gen.seeds, keep_images=stage_images)
    assert res.error is None, res.error
    config = strat.settings_dict(cfg)
    assert max_abs(_render_from_file(s, path, config), stage_images) == 0.0
    assert text.count(_SCALE_AT) == 1
    try:  # the file's folded forward scales its output: the cached images follow the file
        path.write_text(text.replace(_SCALE_AT, _SCALE_AT + "    out = out * 0.5\n"))
        edited = _render_from_file(s, path, config)
    finally:
        path.write_text(text)
    assert max_abs(edited, stage_images) > 0.05
    assert max(float(np.max(np.abs(edited[k] - stage_images[k]))) for k in edited) > 0.05
    assert max_abs(_render_from_file(s, path, config), stage_images) == 0.0  # the file as written again


REF = '''
import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _get(x: Tensor, gate: Tensor) -> Tensor:  # the name the adapter module uses for its own helper
    return x * gate


class RefAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x)))
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class RefBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = RefAttention(dim)
        self.mod = nn.Linear(dim, dim)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        return x + self.attn(self.norm(x) + self.mod(temb)[:, None])


class RefModel(nn.Module):
    def build(self, in_channels: int, dim: int, num_layers: int):
        self.proj_in = nn.Linear(in_channels, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([RefBlock(dim) for _ in range(num_layers)])
        self.gates = nn.Parameter(torch.linspace(0.5, 1.5, num_layers))
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states: Tensor, timestep: Tensor, return_dict: bool = False):
        if not isinstance(hidden_states, Tensor):
            raise TypeError("hidden_states must be a Tensor")
        x, temb = self.proj_in(hidden_states), self.time(timestep[:, None] / 1000.0)
        for i, block in enumerate(self.blocks):
            x = _get(block(x, temb), self.gates[i])
        return (self.proj_out(x),)
'''

CARD_FILE = '''
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from {ref} import RefModel


class MyModel(RefModel, ModelMixin, ConfigMixin):  # (ModelMixin, ConfigMixin, RefModel) hides submodules:
    # ConfigMixin.__getattr__ would come before nn.Module's
    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 3):
        super().__init__()
        self.build(in_channels, dim, num_layers)
'''


def test_inherited_forward_is_folded_with_the_names_of_its_own_module(tmp_path):
    # before: the fold ran RefModel.forward with the globals of the card's file, which never
    # imports Tensor or _get: "NameError: name 'Tensor' is not defined", a crash with caching off
    from ditbook.card import import_class
    from ditbook.coverage.check import check_class

    ref = f"two_file_reference_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{ref}.py").write_text(textwrap.dedent(REF))
    (tmp_path / "my_model.py").write_text(textwrap.dedent(CARD_FILE.format(ref=ref)))
    cls = import_class(str(tmp_path / "my_model.py"), "MyModel")
    assert cls.forward.__module__ == ref and "Tensor" not in vars(sys.modules[cls.__module__])
    row = check_class(cls, cp=False)
    assert row.outcome == "correct" and row.folded, (row.outcome, row.stage, row.reason)
    assert row.off_max_abs <= 1e-5


def test_emitted_module_imports_names_from_the_defining_module_and_aliases_collisions(tmp_path):
    from ditbook.adapter.source import ModelNames, _OWN

    import torch.nn.functional

    scope = {"__name__": "somewhere.ref", "Tensor": object(), "_get": object(), "F": torch.nn.functional}
    names = ModelNames({"_get": _OWN})
    src = names.resolve("def f(x: Tensor):\n    return F.relu(_get(x, len(x), missing))\n", scope, "_folded_f")
    assert src.startswith("def _folded_f(x: Tensor):") and "F.relu(_somewhere_ref__get(x, len(x), missing))" in src
    assert names.lines() == ["import torch.nn.functional as F",
                             "from somewhere.ref import Tensor, _get as _somewhere_ref__get  "
                             "# names the model's code uses, where it is defined",
                             "# not found in somewhere.ref: missing"]
