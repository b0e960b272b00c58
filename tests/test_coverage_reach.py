"""More generic reach for the coverage probe (issue 13): constructor and input mechanisms read
from the code, each shown on a small model written here that the probe could not run before."""

from __future__ import annotations

import os

import pytest
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from ditbook import coverage
from ditbook.coverage import dataflow as ci
from ditbook.coverage import repairs
from torch import nn

if os.environ.get("DITBOOK_TEST_NEVER_SET"):  # an optional dependency, never "installed" here
    from xml.dom import minidom

IMAGE_TAG = 2  # token role tags a forward compares its input with
TEXT_TAG = 3


def _shape(v):
    return tuple(v.shape) if isinstance(v, torch.Tensor) else v


# --- constructor ---------------------------------------------------------------------------------

def test_rotary_axes_stay_even_and_keep_their_share_of_the_head_dim():
    class Fake:
        def __init__(self, num_attention_heads=24, attention_head_dim=128, rope_dim=(44, 42, 42),
                     axes_dims_rope=(16, 56, 56), mrope_section=(16, 8, 8)):
            pass

    kw = coverage.shrink_config(Fake, 8, heads=2)
    assert kw["attention_head_dim"] == 16
    # was (44, 42, 42) (not divisible by 8: left whole) and (2, 7, 7) (odd halves of a rotary pair)
    for name in ("rope_dim", "axes_dims_rope"):
        assert sum(kw[name]) == 16 and all(x % 2 == 0 for x in kw[name]), (name, kw[name])
    assert sum(kw["mrope_section"]) == 4  # a quarter of the head dim by default: still a quarter

    class AxesMakeTheHead:  # no head dim in the config: the axes define it
        def __init__(self, model_dim=2048, axes_dims=(16, 24, 24)):
            pass

    kw = coverage.shrink_config(AxesMakeTheHead, 8)
    assert sum(kw["axes_dims"]) == 8 and all(x % 2 == 0 for x in kw["axes_dims"]), kw  # was (2, 3, 3)


class CalledButOptional(ModelMixin, ConfigMixin):
    """The forward always calls ``self.history_embedder``, which the defaults leave None."""

    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, has_history_embedder: bool = False):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.history_embedder = None
        if has_history_embedder:
            self.history_embedder = nn.Linear(dim, dim)

    def forward(self, hidden_states):
        x = self.proj_in(hidden_states)
        x = self.history_embedder(x)
        return (x,)


def test_a_constructor_flag_builds_the_submodule_the_forward_always_calls():
    model, _ = coverage.build_tiny(CalledButOptional)
    assert model.config.has_history_embedder is True and model.history_embedder is not None
    kwargs, _ = coverage.find_inputs(model)
    assert kwargs["hidden_states"].shape[-1] == 8


# --- what the forward's code tells about its inputs ---------------------------------------------

class PerFrameLatents(ModelMixin, ConfigMixin):
    """Latents laid out (batch, frames, channels, h, w): the forward permutes them before it
    unpacks the shape; a per-frame timestep (batch, frames) unpacked in a submodule."""

    @register_to_config
    def __init__(self, in_channels: int = 6, dim: int = 16):
        super().__init__()
        self.patch = nn.Conv3d(in_channels, dim, (1, 2, 2), stride=(1, 2, 2))
        self.time = TimePerFrame(dim)
        self.proj_out = nn.Linear(dim, in_channels * 4)

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        """
        Args:
            hidden_states (`torch.Tensor` of shape `(batch_size, num_frames, num_channels, height, width)`):
                latents
        """
        hidden_states = hidden_states.permute(0, 2, 1, 3, 4)
        batch_size, num_channels, num_frames, height, width = hidden_states.shape
        x = self.patch(hidden_states).flatten(2).transpose(1, 2)
        x = x + self.time(timestep, (height // 2) * (width // 2))
        return (self.proj_out(x),)


class TimePerFrame(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(1, dim)

    def forward(self, timestep, tokens_per_frame):
        batch_size, num_frames = timestep.shape
        t = self.lin(timestep.reshape(-1, 1))
        return t.unflatten(0, (batch_size, num_frames)).repeat_interleave(tokens_per_frame, dim=1)


def test_unpacked_axes_read_through_a_permute_and_a_per_frame_timestep():
    needs = ci.forward_needs(PerFrameLatents())
    # the unpack names the permuted axes: the input's own are (batch, frames, channels, h, w)
    assert needs["hidden_states"].roles[:3] == ["batch", "frames", "channels"], needs["hidden_states"]
    kwargs, _ = coverage.find_inputs(PerFrameLatents())
    frames = kwargs["hidden_states"].shape[1]
    assert kwargs["hidden_states"].shape[2] == 6
    assert kwargs["timestep"].shape == (1, frames)  # (batch, num_frames), as the unpack names it


class Rope1D(nn.Module):
    def forward(self, frame_indices, height, width):
        f = frame_indices.float()[:, None, None].expand(-1, height, width)
        return torch.sin(f.reshape(-1, 1))


class GuardedHistory(ModelMixin, ConfigMixin):
    """``rope_hist`` is set only when both history inputs are given, and read unconditionally;
    ``indices`` feed a rope module's ``frame_indices`` (one per frame), after a default for None."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 8):
        super().__init__()
        self.patch = nn.Conv3d(in_channels, dim, (1, 2, 2), stride=(1, 2, 2))
        self.rope = Rope1D()

    def forward(self, hidden_states, indices=None, history=None, history_indices=None, return_dict: bool = False):
        b, c, f, h, w = hidden_states.shape
        if indices is None:
            indices = torch.arange(f)
        x = self.patch(hidden_states).flatten(2).transpose(1, 2)
        rope = self.rope(frame_indices=indices, height=h // 2, width=w // 2)
        if history is not None and history_indices is not None:
            rope_hist = self.rope(frame_indices=history_indices, height=h // 2, width=w // 2)
            x = torch.cat([self.patch(history).flatten(2).transpose(1, 2), x], 1)
        rope = torch.cat([rope_hist, rope], 0)
        return (x * rope[None],)


def test_inputs_that_the_condition_setting_a_local_tests_are_supplied():
    needs = ci.forward_needs(GuardedHistory())
    assert needs["indices"].roles == ["frames"] and needs["history_indices"].roles == ["frames"]
    kwargs, _ = coverage.find_inputs(GuardedHistory())
    assert kwargs["history"].shape == kwargs["hidden_states"].shape
    assert kwargs["history_indices"].shape == (kwargs["hidden_states"].shape[2],)


class DocumentedBundles(ModelMixin, ConfigMixin):
    """The docstring writes the text input's shape with config entries; a list input holds one
    tensor per module of ``self.layer_proj``."""

    @register_to_config
    def __init__(self, in_channels: int = 6, dim: int = 16, feat_dim: int = 12, extra_layer_ids=(0, 1),
                 layer_width: int = 10):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.ctx = nn.Linear(feat_dim, dim)
        self.layer_proj = nn.ModuleList([nn.Linear(layer_width, dim) for _ in range(3)])

    def forward(self, hidden_states, encoder_hidden_states, layer_states: list = None, return_dict: bool = False):
        """
        Args:
            hidden_states (`torch.Tensor` of shape `(batch_size, seq_len, in_channels)`): latents
            encoder_hidden_states (`torch.Tensor` of shape `(batch_size, 1 + len(extra_layer_ids), text_len, feat_dim)`):
                one bundle per extra layer, and a first one
        """
        x = self.proj_in(hidden_states)
        for k in range(1 + len(self.config.extra_layer_ids)):
            x = x + self.ctx(encoder_hidden_states[:, k]).mean(1, keepdim=True)
        for i, layer in enumerate(layer_states):
            x = x + self.layer_proj[i](layer).mean(1, keepdim=True)
        return (x,)


def test_documented_dims_from_the_config_and_a_list_fed_to_a_module_list():
    needs = ci.forward_needs(DocumentedBundles())
    assert needs["encoder_hidden_states"].roles == ["batch", 3, "tokens", 12], needs["encoder_hidden_states"]
    kwargs, _ = coverage.find_inputs(DocumentedBundles())
    assert kwargs["encoder_hidden_states"].shape[1] == 3 and kwargs["encoder_hidden_states"].shape[-1] == 12
    assert [_shape(t)[-1] for t in kwargs["layer_states"]] == [10, 10, 10]


class PositionTables(ModelMixin, ConfigMixin):
    """``pos`` is annotated as a grid of ints but indexes per-axis tables (one position range per
    axis); ``tags`` are compared with module constants (which tokens are image, which text)."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 8):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.table_h = nn.Parameter(torch.randn(16, dim))
        self.table_w = nn.Parameter(torch.randn(16, dim))

    def forward(self, hidden_states, pos: tuple[int, int], tags, return_dict: bool = False):
        b, n, c = hidden_states.shape
        h, w = len(pos[0]), len(pos[1])
        table = self.table_h[pos[0]].view(1, h, 1, -1) + self.table_w[pos[1]].view(1, 1, w, -1)
        image = (tags == IMAGE_TAG).float().unsqueeze(-1)
        text = (tags == TEXT_TAG).float().unsqueeze(-1)
        return ((self.proj_in(hidden_states) + table.mean((1, 2))[:, None]) * image + text,)


def test_an_int_grid_read_as_position_ranges_and_tags_from_compared_constants():
    needs = ci.forward_needs(PositionTables())
    assert needs["tags"].values == [IMAGE_TAG, TEXT_TAG]
    model = PositionTables()
    kwargs, _ = coverage.find_inputs(model)
    assert [len(p) for p in kwargs["pos"]] == [4, 4]  # was (4, 4): two ints
    assert set(kwargs["tags"].unique().tolist()) == {IMAGE_TAG, TEXT_TAG}
    out = coverage.inputs._run(model, kwargs)
    assert (out.abs().sum(-1) > 0).all()  # every token carries a tag the code knows: nothing masked out


class PatchifiedLatents(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 8, patch_size=(1, 2, 2)):
        super().__init__()
        self.img_in = nn.Conv3d(in_channels, dim, patch_size, stride=patch_size)

    def forward(self, hidden_states, return_dict: bool = False):
        batch_size, max_num_patches, channels, pt, ph, pw = hidden_states.shape
        x = self.img_in(hidden_states.reshape(batch_size * max_num_patches, channels, pt, ph, pw))
        return (x.reshape(batch_size, max_num_patches, -1),)


def test_patch_pixel_axes_of_an_unpacked_input():
    kwargs, _ = coverage.find_inputs(PatchifiedLatents())
    _, n, c, pt, ph, pw = kwargs["hidden_states"].shape
    assert (c, pt, ph, pw) == (4, 1, 2, 2) and n > 1


def test_a_missing_optional_dependency_is_a_named_refusal():
    class UsesOptionalDependency(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, in_channels: int = 4):
            super().__init__()
            self.proj = nn.Linear(in_channels, in_channels)

        def forward(self, hidden_states, return_dict: bool = False):
            minidom.parseString("<a/>")
            return (self.proj(hidden_states),)

    row = coverage.check_class(UsesOptionalDependency, cp=False)
    assert row.outcome == "refused" and row.stage == "build+inputs", row
    assert "'minidom'" in row.reason and "'xml.dom'" in row.reason and "optional dependency" in row.reason


class TwoTextEncoders(ModelMixin, ConfigMixin):
    """A second text input told apart by a suffix, sized by config entries with that suffix; a
    size-meta input read as rows of 6 values; a style index per sample."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 8, cross_attention_dim: int = 8, text_len: int = 7,
                 cross_attention_dim_t5: int = 6, text_len_t5: int = 5, n_styles: int = 3):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.t5_proj = nn.Linear(cross_attention_dim_t5, cross_attention_dim)
        self.pos = nn.Parameter(torch.zeros(text_len + text_len_t5, cross_attention_dim))
        self.meta = nn.Linear(6 * 4, dim)
        self.style = nn.Embedding(n_styles, dim)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_t5=None, image_meta_size=None,
                style=None, return_dict: bool = False):
        t5 = self.t5_proj(encoder_hidden_states_t5)
        ctx = torch.cat([encoder_hidden_states, t5], dim=1) + self.pos
        image_meta_size = torch.sin(image_meta_size.reshape(-1, 1).float() * torch.arange(1, 5))
        image_meta_size = image_meta_size.view(-1, 6 * 4)
        cond = torch.cat([self.meta(image_meta_size), self.style(style)], dim=1)
        return (self.proj_in(hidden_states) + ctx.mean(1, keepdim=True) + cond.mean(1)[:, None, None],)


def test_suffixed_text_sizes_meta_rows_concatenated_widths_and_per_sample_indices():
    fit = ci.suffix_sizes_fit("encoder_hidden_states_t5", torch.randn(1, 8, 4), {"text_len_t5": 5,
                                                                                 "cross_attention_dim_t5": 6})
    assert fit.shape == (1, 5, 6)
    assert ci.suffix_sizes_fit("encoder_hidden_states", torch.randn(1, 8, 4), {"text_len_t5": 5}).shape == (1, 8, 4)
    assert ci.tensor_for("style", ci.Need(vocab=3), ci.Grid(), torch.Generator()).shape == (1,)
    assert ci.tensor_for("style_ids", ci.Need(vocab=3), ci.Grid(), torch.Generator()).shape == (1, ci.TEXT_LEN)
    kwargs, _ = coverage.find_inputs(TwoTextEncoders())
    assert kwargs["encoder_hidden_states_t5"].shape[1:] == (5, 6)
    assert kwargs["encoder_hidden_states"].shape[1:] == (7, 8)
    assert kwargs["image_meta_size"].numel() == 6 and kwargs["style"].shape == (1,)


def test_a_concatenated_input_takes_the_width_of_the_computed_operand():
    model = TwoTextEncoders()
    kwargs = {"hidden_states": torch.randn(1, 4, 4), "encoder_hidden_states": torch.randn(1, 7, 3),
              "encoder_hidden_states_t5": torch.randn(1, 5, 6), "image_meta_size": torch.ones(1, 6),
              "style": torch.zeros(1, dtype=torch.long)}
    try:
        model(**kwargs)
    except RuntimeError as exc:
        err = exc
    else:
        pytest.fail("the forward ran with a text input of the wrong width")
    new, why = repairs.repair(err, kwargs, lambda *a, **k: None, set())
    assert new["encoder_hidden_states"].shape == (1, 7, 8), why
    assert model(**new)[0].shape == (1, 4, 8)


class CachedChunks(ModelMixin, ConfigMixin):
    """A frame-autoregressive model: its forward reads a kv cache that earlier calls fill."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(in_channels, dim)

    def forward(self, hidden_states, kv_cache=None, return_dict: bool = False):
        return (self.proj(hidden_states) + kv_cache[0]["k"].mean(),)


_PIPELINE_SRC = '''
class ChunkPipeline:
    def __init__(self, transformer: CachedChunks, scheduler=None):
        pass

    def __call__(self, latents, kv_cache):
        for _ in range(3):
            out = self.transformer(hidden_states=latents, kv_cache=kv_cache, return_dict=False)
        return out
'''


def test_a_model_its_pipelines_always_call_with_a_kv_cache_is_refused_with_that_reason(monkeypatch):
    import ast

    calls = ci.pipeline_calls_in(ast.parse(_PIPELINE_SRC))
    assert calls == {"CachedChunks": [{"hidden_states", "kv_cache", "return_dict"}]}
    monkeypatch.setattr(ci, "_KEYWORDS_BY_CLASS", calls)
    assert ci.pipeline_state_inputs(CachedChunks) == ["kv_cache"]
    with pytest.raises(coverage.Refused, match=r"every call of this transformer in diffusers' pipelines passes "
                                               r"\['kv_cache'\]"):
        coverage.find_inputs(CachedChunks())
    # a class some pipeline calls without the cache: the plain errors, no such claim
    monkeypatch.setattr(ci, "_KEYWORDS_BY_CLASS", {"CachedChunks": calls["CachedChunks"] + [{"hidden_states"}]})
    with pytest.raises(coverage.Refused, match="no inputs from the forward signature run it"):
        coverage.find_inputs(CachedChunks())


class UntiedWidthDefaults(ModelMixin, ConfigMixin):
    """Defaults that disagree: the blocks work on heads x head dim (4 x 16 = 64) features, the
    embedder makes ``hidden_size`` (48) of them; a real checkpoint sets both alike."""

    @register_to_config
    def __init__(self, in_channels: int = 4, hidden_size: int = 48, num_attention_heads: int = 4,
                 attention_head_dim: int = 16):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, hidden_size)
        self.to_q = nn.Linear(num_attention_heads * attention_head_dim, num_attention_heads * attention_head_dim)
        self.proj_out = nn.Linear(num_attention_heads * attention_head_dim, in_channels)

    def forward(self, hidden_states, return_dict: bool = False):
        return (self.proj_out(self.to_q(self.proj_in(hidden_states))),)


def test_a_width_the_defaults_leave_unequal_to_heads_times_head_dim_is_tied_when_nothing_else_runs():
    model, _, kwargs = coverage.tiny_with_inputs(UntiedWidthDefaults)
    cfg = model.config
    assert cfg.hidden_size == cfg.num_attention_heads * cfg.attention_head_dim
    assert coverage.inputs._run(model, kwargs).shape[-1] == 4


class ConcatenatedContext(ModelMixin, ConfigMixin):
    """The patch conv takes 6 channels: the noisy latent (2, what the model returns) concatenated
    with context latents (the other 4); the config names only the sum."""

    @register_to_config
    def __init__(self, in_channels: int = 6, dim: int = 8, out_dim: int = 2):
        super().__init__()
        self.proj_in = nn.Conv1d(in_channels, dim, 2, stride=2)
        self.proj_out = nn.ConvTranspose1d(dim, out_dim, 2, stride=2)

    def forward(self, hidden_states, context_latents, return_dict: bool = False):
        """
        Args:
            hidden_states (`torch.Tensor` of shape `(batch_size, seq_len, channels)`): noisy latents
            context_latents (`torch.Tensor` of shape `(batch_size, seq_len, context_dim)`): context
        """
        x = torch.cat([context_latents, hidden_states], dim=-1)
        x = self.proj_in(x.transpose(1, 2))
        return (self.proj_out(x).transpose(1, 2),)


def test_the_noisy_input_keeps_the_output_width_in_a_concatenation_the_embedder_takes():
    kwargs, _ = coverage.find_inputs(ConcatenatedContext())
    assert kwargs["hidden_states"].shape[-1] == 2 and kwargs["context_latents"].shape[-1] == 4
    assert kwargs["hidden_states"].shape[1] == kwargs["context_latents"].shape[1]


class UnsetSetting(ModelMixin, ConfigMixin):
    """The forward iterates a setting its defaults leave None; ``extra`` is an optional input the
    failing line has nothing to do with."""

    @register_to_config
    def __init__(self, in_channels: int = 4, layer_ids: list = None):
        super().__init__()
        self.proj = nn.Linear(in_channels, in_channels)

    def forward(self, hidden_states, extra=None, return_dict: bool = False):
        picked = [hidden_states[:, k] for k in self.config.layer_ids]
        return (self.proj(torch.stack(picked, 1)) + (0 if extra is None else extra),)


def test_a_none_setting_of_the_model_is_not_blamed_on_an_unrelated_optional_input():
    model = UnsetSetting()
    kwargs = {"hidden_states": torch.randn(1, 6, 4), "return_dict": False}
    try:
        model(**kwargs)
    except TypeError as exc:
        err = exc
    else:
        pytest.fail("the forward ran with its setting unset")

    def make(name, kw, rank=None):
        return torch.zeros(1)

    make.params = ("hidden_states", "extra", "return_dict")
    assert repairs.repair(err, kwargs, make, set()) is None  # before: "supplied extra", a repair of nothing
    assert repairs._own_none(err) == "self.config.layer_ids"
    # the setting is the model's, not an input's: the probe asks for the class built with it set
    # (coverage.reconfig; before, a refusal naming it)
    from ditbook.coverage import reconfig

    with pytest.raises(reconfig.Reconfigure, match=r"self\.config\.layer_ids, which the defaults leave None") as info:
        coverage.find_inputs(UnsetSetting())
    assert info.value.changes == {"layer_ids": [0, 1]}


def test_state_inputs_are_read_from_diffusers_own_pipelines_in_a_fresh_process():
    """Read as a fresh import does (no cache patched in): diffusers' GLM-Image pipeline calls its
    transformer with ``kv_caches`` every time, so the probe must name it. Before the fix the module
    bound one cache name twice, the second binding an empty dict that made the reader return at
    once: every class got ``[]``."""
    import subprocess
    import sys

    code = ("import diffusers, ditbook.coverage.dataflow as ci; "
            "print(ci.pipeline_state_inputs(diffusers.GlmImageTransformer2DModel))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['kv_caches']"
