"""The coverage probe sets up what a forward needs beyond inputs (issue 23, coverage of the last
build+inputs refusals): constructor settings the forward's errors ask for (``coverage.reconfig``),
state objects of a running pipeline made where the code says how (``coverage.state``), and input
repairs for per-sample lists, per-frame values, stacked entries and counts a check states. Small
models written here; each was refused (or not repaired) by the probe before."""

from __future__ import annotations

import importlib.util

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from ditbook import coverage
from ditbook.coverage import reconfig, repairs, state
from test_coverage_inputs import _error  # one helper: the error a call raises
from torch import nn

if importlib.util.find_spec("ditbook_never_installed_dependency") is not None:  # an optional dependency
    from ditbook_never_installed_dependency import resize  # noqa: F401


class Blocks(nn.Module):
    def __init__(self, dim: int, n: int):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n)])


class OptionalResizeDiT(ModelMixin, ConfigMixin):
    """``resize`` comes from an optional dependency, used only under ``if self.config.resize_mask``
    (a documented mode, on by default)."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 16, num_layers: int = 2, resize_mask: bool = True):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, return_dict: bool = False):
        if self.config.resize_mask:
            hidden_states = resize(hidden_states)  # noqa: F821 - only defined when installed
        x = self.proj_in(hidden_states)
        for b in self.blocks:
            x = x + b(x)
        return (self.proj_out(x),)


def test_a_missing_optional_dependency_under_a_config_flag_builds_the_mode_without_it():
    model, _, kwargs = coverage.tiny_with_inputs(OptionalResizeDiT)
    assert model.config.resize_mask is False
    assert "resize_mask=False" in model.coverage_setup and "optional" in model.coverage_setup
    assert coverage.inputs._run(model, kwargs).shape[-1] == 4


class LayerListDiT(ModelMixin, ConfigMixin):
    """``text_layers`` (None by default) picks, per block, one layer of a stack of text-encoder
    states: the forward iterates it and indexes the stacked input with each entry."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 16, num_layers: int = 2, num_single_layers: int = 1,
                 text_layers: list[int] = None):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers + num_single_layers)])
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, text_stack, return_dict: bool = False):
        texts = [text_stack[k] for k in self.config.text_layers]
        x = self.proj_in(hidden_states)
        for b, t in zip(self.blocks, texts):
            x = x + b(x) + t.mean()
        return (self.proj_out(x),)


def test_a_list_setting_left_none_gets_an_entry_per_block_and_the_stack_it_indexes():
    model, _, kwargs = coverage.tiny_with_inputs(LayerListDiT)
    cfg = model.config
    n = cfg.num_layers + cfg.num_single_layers  # one entry per block the constructor builds
    assert cfg.text_layers == list(range(n)) and n == 4
    assert kwargs["text_stack"].shape[0] == n  # a stacked input grown to what the entries index
    assert f"text_layers={list(range(n))}" in model.coverage_setup


class AxesEmbed(nn.Module):
    def __init__(self, axes: tuple):
        super().__init__()
        self.axes_dim = axes

    def forward(self, ids):
        return torch.cat([ids[..., i : i + 1].expand(*ids.shape[:-1], self.axes_dim[i])
                          for i in range(ids.shape[-1])], -1)


class ThreeAxisIds(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, attention_head_dim: int = 8, axes_dims_rope: tuple = (4, 4)):
        super().__init__()
        self.pe = AxesEmbed(axes_dims_rope)

    def forward(self, ids):
        return self.pe(ids)


def test_rotary_axes_indexed_past_their_end_get_one_more_entry_summing_to_the_head_dim():
    model = ThreeAxisIds()
    try:
        model(torch.zeros(1, 5, 3))
    except IndexError as exc:
        changes, note = reconfig.config_repair(exc, model)
    assert changes == {"axes_dims_rope": (4, 2, 2)} and "head dim 8" in note
    assert ThreeAxisIds(**changes)(torch.zeros(1, 5, 3)).shape == (1, 5, 8)


class LayerCache:
    def __init__(self, num_layers: int):
        self.layers = [None] * num_layers


class CachedReferenceDiT(ModelMixin, ConfigMixin):
    """A required cache object and a mode string: ``"fill"`` writes the cache (runs on an empty
    one), ``"read"`` needs a cache filled by an earlier call."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 16, num_layers: int = 2):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, cache: LayerCache, cache_mode: str, return_dict: bool = False):
        if cache_mode not in ("read", "fill"):
            raise ValueError(cache_mode)
        x = self.proj_in(hidden_states)
        for i, b in enumerate(self.blocks):
            if cache_mode == "fill":
                cache.layers[i] = x
            elif cache.layers[i] is None:
                raise RuntimeError("the cache is empty: run the fill pass first")
            x = x + b(x)
        return (self.proj_out(x),)


def test_required_state_inputs_are_made_where_the_code_says_how():
    model = CachedReferenceDiT()
    kwargs, cand = coverage.find_inputs(model)
    assert isinstance(kwargs["cache"], LayerCache) and len(kwargs["cache"].layers) == 2
    assert kwargs["cache_mode"] == "fill"  # "read" came first in the code but does not run on an empty cache
    assert any("cache_mode='fill'" in n for n in cand["setup"])
    # a state object the code does not say how to make is still refused with its names
    assert state.state_options(model, ["cache", "hidden_states"]) is None


def _maker(params, first="hidden_states", frames=2, model=None):
    def make(name, kw, rank=None, roles=None):
        return None

    make.params, make.first, make.gen, make.model, make.annotations = params, first, None, model, {}
    make.grid = type("G", (), {"frames": frames})()
    return make


def test_per_sample_lists_zipped_into_a_concatenation_are_shaped_and_split_like_each_other():
    conv = nn.Conv3d(6, 8, 1)
    out = nn.Linear(8, 4)
    model = nn.ModuleDict({"patch": conv, "head": out})
    model.config = {"out_channels": 4}

    def forward(hidden_states, condition):
        xs = [torch.cat([u, v], dim=0) for u, v in zip(hidden_states, condition)]
        return [conv(u.unsqueeze(0)) for u in xs]

    kwargs = {"hidden_states": torch.randn(1, 6, 2, 4, 4), "condition": [torch.randn(8, 3)]}
    make = _maker({"hidden_states", "condition"}, model=model)
    forbid: set = set()
    new, why = repairs.repair(_error(lambda: forward(**kwargs)), kwargs, make, forbid)
    assert new["condition"][0].shape == (6, 2, 4, 4), why  # like a row of the tensor it is zipped with
    new, why = repairs.repair(_error(lambda: forward(**new)), new, make, forbid)
    assert new["hidden_states"].shape == (1, 4, 2, 4, 4) and new["condition"][0].shape == (2, 2, 4, 4), why
    forward(**new)


def test_a_count_the_forwards_check_states_and_values_per_frame():
    def forward(hidden_states, seq_len: int, timestep):
        if hidden_states.shape[1] != seq_len:
            raise ValueError(f"each sample must hold exactly `seq_len` ({seq_len}) tokens, got [{hidden_states.shape[1]}]")
        return timestep[:, -2:] * hidden_states.mean()

    kwargs = {"hidden_states": torch.randn(1, 12, 4), "seq_len": 8, "timestep": torch.full((1,), 500.0)}
    make = _maker({"hidden_states", "seq_len", "timestep"}, frames=3)
    forbid: set = set()
    new, why = repairs.repair(_error(lambda: forward(**kwargs)), kwargs, make, forbid)
    assert new["seq_len"] == 12, why
    new, why = repairs.repair(_error(lambda: forward(**new)), new, make, forbid)
    assert new["timestep"].shape == (1, 3) and bool((new["timestep"] == 500.0).all()), why
    assert forward(**new).shape == (1, 2)


def test_a_grid_read_through_a_local_row_by_row_grows_to_the_axes_it_is_indexed_with():
    def forward(hidden_states, grid_sizes):
        grid = grid_sizes
        return tuple(int(grid[0][axis]) for axis in range(3))

    kwargs = {"hidden_states": torch.randn(1, 4), "grid_sizes": torch.zeros(1, 2, dtype=torch.long)}
    new, why = repairs.repair(_error(lambda: forward(**kwargs)), kwargs, _maker({"hidden_states", "grid_sizes"}),
                              set())
    assert new["grid_sizes"].shape == (1, 3) and new["grid_sizes"].dtype == torch.long, why
    assert forward(**new) == (0, 0, 0)
