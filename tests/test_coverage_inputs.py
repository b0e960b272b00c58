"""The coverage probe's generic reach (issue 13, item 1): inputs from the forward's data flow,
error-directed repair of inputs and of constructor arguments. Small models written here; each
would be refused by the name-rule probe alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from ditbook import coverage
from ditbook.coverage import dataflow as ci
from ditbook.coverage import repairs
from torch import nn


class Attn(nn.Module):
    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape

        def split(t):
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x)))
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attn(dim)
        self.mod = nn.Linear(dim, dim)

    def forward(self, x, temb):
        return x + self.attn(self.norm(x) * (1 + self.mod(temb)[:, None]))


class DataFlowDiT(ModelMixin, ConfigMixin):
    """Nothing in its config or parameter names says the latent has 6 channels, the text 12
    features, or that ``style_ids`` are indices below 50: only what the forward does with them
    (a Conv2d, a Linear, an Embedding)."""

    @register_to_config
    def __init__(self, io_channels: int = 6, dim: int = 16, text_width: int = 12, n_styles: int = 50,
                 num_layers: int = 2):
        super().__init__()
        self.patch = nn.Conv2d(io_channels, dim, 2, stride=2)
        self.context_embedder = nn.Linear(text_width, dim)
        self.style = nn.Embedding(n_styles, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, 4 * io_channels)

    def forward(self, hidden_states, encoder_hidden_states, style_ids, timestep, return_dict: bool = False):
        x = self.patch(hidden_states).flatten(2).transpose(1, 2)
        ctx = self.context_embedder(encoder_hidden_states)
        temb = self.time(timestep[:, None] / 1000.0) + self.style(style_ids).mean(1)
        x = torch.cat([ctx, x], 1)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(self.norm_out(x[:, ctx.shape[1]:])),)


def test_forward_needs_reads_the_first_consumer_of_each_input():
    needs = ci.forward_needs(DataFlowDiT())
    assert needs["hidden_states"].conv_dims == 2 and needs["hidden_states"].channels == 6
    assert needs["hidden_states"].stride == 2
    assert needs["encoder_hidden_states"].last == 12
    assert needs["style_ids"].vocab == 50
    assert needs["timestep"].empty()  # used through arithmetic first: nothing claimed


def test_data_flow_inputs_integrate_a_model_name_rules_cannot_feed(monkeypatch):
    row = coverage.check_class(DataFlowDiT, cp=False)
    assert row.outcome == "correct", (row.stage, row.reason)
    assert row.off_max_abs <= coverage.TOLERANCE
    # without the data flow (the name rules alone; the error repairs, which can now find the conv's
    # channels and the Linear's width from the errors, off too) the probe cannot run it: a named refusal
    monkeypatch.setattr(ci, "forward_needs", lambda model, depth=0: {})
    monkeypatch.setattr(repairs, "repair", lambda exc, kwargs, make, forbid: None)
    row = coverage.check_class(DataFlowDiT, cp=False)
    assert row.outcome == "refused" and row.stage == "build+inputs", row
    assert "no inputs from the forward signature run it" in row.reason


class Rope(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("freqs", torch.linspace(0.1, 1.0, dim))

    def forward(self, position_ids):
        return torch.sin(position_ids.float()[..., None] * self.freqs)


class NeedsOptionalIds(nn.Module):
    """``position_ids`` is optional in the signature yet the code always uses it."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.rope = Rope(dim)

    def forward(self, hidden_states, position_ids=None):
        return self.proj_in(hidden_states) + self.rope(position_ids)


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error is the input of the repair
        return exc
    raise AssertionError("no error")


def test_repair_supplies_a_none_parameter_the_code_reads():
    model = NeedsOptionalIds()
    kwargs = {"hidden_states": torch.randn(1, 5, 8)}
    exc = _error(lambda: model(**kwargs))

    def make(name, kw, rank=None):
        return torch.arange(5)[None]

    make.params = ("hidden_states", "position_ids")
    forbid: set = set()
    new, why = repairs.repair(exc, kwargs, make, forbid)
    assert "position_ids" in why and model(**new).shape == (1, 5, 8)
    # a repair is never repeated: the same error again gives up instead of looping
    assert repairs.repair(exc, kwargs, make, forbid) is None


def test_repair_fixes_the_input_a_matrix_product_rejects_and_nothing_else():
    lin = nn.Linear(10, 4)
    kwargs = {"hidden_states": torch.randn(1, 6, 3), "other": torch.randn(1, 6, 7)}
    exc = _error(lambda: lin(kwargs["hidden_states"]))
    new, why = repairs.repair(exc, kwargs, lambda *a, **k: None, set())
    assert new["hidden_states"].shape == (1, 6, 10) and new["other"] is kwargs["other"], why
    # an error that says nothing about the inputs: no repair (the probe refuses with the error)
    assert repairs.repair(ValueError("unsupported mode"), kwargs, lambda *a, **k: None, set()) is None


class NeedsDerivedCtorArgs(ModelMixin, ConfigMixin):
    """Constructor arguments that default to None but are needed: an int used in arithmetic, a
    pair subscripted by index, rotary axes that must sum to the head dim, layer indices."""

    @register_to_config
    def __init__(self, in_channels: int = 4, out_channels=None, caption_channels=None, num_layers: int = 28,
                 num_attention_heads: int = 4, attention_head_dim: int = 64, axes_dims=None,
                 extra_layers=(0, 7, 14, 21)):
        super().__init__()
        self.proj_out = nn.Linear(8, 2 * out_channels)
        self.caption = nn.Linear(caption_channels[1], 8)
        head = num_attention_heads * attention_head_dim // num_attention_heads
        if sum(axes_dims) != head:
            raise ValueError(f"axes {axes_dims} do not sum to {head}")
        if max(extra_layers) >= num_layers:
            raise ValueError("extra layers out of range")


def test_constructor_repair_derives_none_defaults_from_the_other_arguments():
    model, _ = coverage.build_tiny(NeedsDerivedCtorArgs)
    cfg = model.config
    assert cfg.out_channels == cfg.in_channels  # the most similarly named argument
    assert len(cfg.caption_channels) == 2  # subscripted by an int: a tuple
    assert sum(cfg.axes_dims) == cfg.attention_head_dim and all(a % 2 == 0 for a in cfg.axes_dims)
    assert max(cfg.extra_layers) < cfg.num_layers == 2


class NeedsASettingsDict(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, dim: int = 8, scaling=None):
        super().__init__()
        self.factor = scaling["short_factor"]


class RejectsTheFilledSettings(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, dim: int = 8, scaling=None):
        super().__init__()
        kind = scaling["kind"]
        if kind not in ("linear", "dynamic"):
            raise ValueError(f"unknown scaling kind {kind!r}")


def test_a_settings_dict_read_by_the_constructor_gets_its_keys_at_a_neutral_scale():
    model, _ = coverage.build_tiny(NeedsASettingsDict)
    assert model.config.scaling == {"short_factor": 1.0}


def test_a_settings_dict_whose_filled_values_the_constructor_rejects_is_refused_with_its_error():
    with pytest.raises(coverage.Refused, match="cannot be built small.*unknown scaling kind"):
        coverage.build_tiny(RejectsTheFilledSettings)


def test_structured_annotations_follow_the_token_grid():
    grid = ci.Grid(frames=2, height=8, width=8, patch=2)
    assert ci.structured("list[tuple[int, int, int]]", grid, lambda: None) == [(2, 4, 4)]
    assert ci.structured("tuple[int, int, int] | None", grid, lambda: None) == (2, 4, 4)
    assert ci.structured("torch.Tensor", grid, lambda: None) is None


class SideStreamReadsHidden(ModelMixin, ConfigMixin):
    """The loop carries ``ctrl`` and reads the outer ``hidden_states``: the folded call must not
    pass ``hidden_states=`` twice (the stream role and the outer input)."""

    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 3):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.gates = nn.Parameter(torch.linspace(0.5, 1.5, num_layers))
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        hidden_states = self.proj_in(hidden_states)
        temb = self.time(timestep[:, None] / 1000.0)
        ctrl = hidden_states
        for i, block in enumerate(self.blocks):
            ctrl = block(ctrl, temb) * self.gates[i] + 0.1 * hidden_states
        return (self.proj_out(self.norm_out(ctrl)),)


def test_a_folded_loop_whose_input_is_named_like_a_stream_role():
    row = coverage.check_class(SideStreamReadsHidden, cp=False)
    assert row.outcome == "correct" and row.folded, (row.outcome, row.stage, row.reason)


def test_a_diffusers_class_only_the_data_flow_reaches():
    # packed latents whose width only img_in (a Linear) tells, and img_shapes annotated as
    # list[tuple[int, int, int]]: built from the token grid; the name rules alone refuse it
    import diffusers

    model, _ = coverage.build_tiny(diffusers.QwenImageTransformer2DModel)
    kwargs, _ = coverage.find_inputs(model)
    tokens = kwargs["hidden_states"].shape[1]
    (f, h, w), = kwargs["img_shapes"]
    assert f * h * w == tokens and kwargs["hidden_states"].shape[-1] == model.img_in.in_features


def test_layer_indices_shrink_with_the_layer_count():
    import diffusers

    kw = coverage.shrink_config(diffusers.WanVACETransformer3DModel, 8, 2)
    assert kw["num_layers"] == 2 and list(kw["vace_layers"]) == [0, 1]


class FixedTextTable(nn.Module):
    """A learned positional table for exactly 20 text tokens; nothing in the signature says so."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj_in = nn.Linear(6, dim)
        self.context = nn.Linear(12, dim)
        self.text_pos = nn.Parameter(torch.zeros(1, 20, dim))

    def forward(self, hidden_states, encoder_hidden_states):
        ctx = self.context(encoder_hidden_states) + self.text_pos
        return (self.proj_in(hidden_states) + ctx.mean(1, keepdim=True),)


def test_a_text_length_a_positional_table_fixes_is_found_from_the_size_error():
    kwargs, _ = coverage.find_inputs(FixedTextTable())
    assert kwargs["encoder_hidden_states"].shape == (1, 20, 12)
    assert kwargs["hidden_states"].shape[-1] == 6


class NestedListLoopedByForward(ModelMixin, ConfigMixin):
    """A block list inside a ModuleDict that the transformer's own forward loops over: cache-dit
    (which finds lists by a direct attribute) cannot be handed it."""

    @register_to_config
    def __init__(self, in_channels: int = 8, dim: int = 16, num_layers: int = 2):
        super().__init__()
        self.proj_in = nn.Linear(in_channels, dim)
        self.time = nn.Linear(1, dim)
        self.modes = nn.ModuleDict({"image": nn.ModuleList([Block(dim) for _ in range(num_layers)])})
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, timestep, return_dict: bool = False):
        x = self.proj_in(hidden_states)
        temb = self.time(timestep[:, None] / 1000.0)
        for block in self.modes.image:
            x = block(x, temb)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(self.norm_out(x)),)


def test_a_nested_block_list_looped_by_the_forward_is_left_uncached_not_handed_to_cache_dit():
    row = coverage.check_class(NestedListLoopedByForward, cp=False)
    assert row.outcome == "correct", (row.outcome, row.stage, row.reason)
    assert any(b.startswith("modes.image") for b in row.block_lists)


def test_a_width_tied_to_heads_times_head_dim_follows_a_head_cap():
    class Fake:
        def __init__(self, num_attention_heads=24, attention_head_dim=64, cross_attention_dim=1536,
                     caption_dim=4096, axes_dims_rope=(16, 24, 24)):
            pass

    kw = coverage.shrink_config(Fake, 8, heads=2)
    assert kw["num_attention_heads"] == 2 and kw["attention_head_dim"] == 8
    assert kw["cross_attention_dim"] == 16  # 24 x 64 by default: 2 x 8 now
    assert kw["caption_dim"] == 512  # not tied to the heads: only divided
    assert sum(kw["axes_dims_rope"]) == 8  # summed to the head dim by default: still does


class DocSizedDiT(ModelMixin, ConfigMixin):
    """Text comes as a stack of ``num_text_layers`` encoder layers of ``text_hidden_dim``: only the
    docstring's shape, whose axes are named after config entries, says so; the position ids cover
    text and image tokens (``text_seq_len + image_seq_len``)."""

    @register_to_config
    def __init__(self, in_channels: int = 6, dim: int = 16, num_text_layers: int = 3, text_hidden_dim: int = 10,
                 num_layers: int = 2):
        super().__init__()
        self.fuse = nn.Linear(num_text_layers, 1)
        self.txt_norm = nn.LayerNorm(text_hidden_dim)
        self.txt_in = nn.Linear(text_hidden_dim, dim)
        self.img_in = nn.Linear(in_channels, dim)
        self.time = nn.Linear(1, dim)
        self.pos = nn.Linear(3, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, timestep, position_ids, return_dict: bool = False):
        r"""
        Args:
            hidden_states (`torch.Tensor` of shape `(batch_size, image_seq_len, in_channels)`):
                packed latents.
            encoder_hidden_states (`torch.Tensor` of shape `(batch_size, text_seq_len, num_text_layers, text_hidden_dim)`):
                a stack of text encoder layers.
            position_ids (`torch.Tensor` of shape `(text_seq_len + image_seq_len, 3)`):
                coordinates of every token.
        """
        b, n, layers, d = encoder_hidden_states.shape
        ctx = self.txt_norm(encoder_hidden_states.reshape(b * n, layers, d))
        ctx = self.fuse(ctx.reshape(b, n, layers, d).transpose(2, 3)).squeeze(-1)
        x = torch.cat([self.txt_in(ctx), self.img_in(hidden_states)], 1) + self.pos(position_ids.float())
        temb = self.time(timestep[:, None] / 1000.0)
        for block in self.blocks:
            x = block(x, temb)
        return (self.proj_out(x[:, n:]),)


def test_docstring_sizes_named_after_config_entries_shape_the_inputs(monkeypatch):
    kwargs, _ = coverage.find_inputs(DocSizedDiT())
    assert kwargs["encoder_hidden_states"].shape[2:] == (3, 10)
    text, image = kwargs["encoder_hidden_states"].shape[1], kwargs["hidden_states"].shape[1]
    assert kwargs["position_ids"].shape == (text + image, 3)
    assert coverage.check_class(DocSizedDiT, cp=False).outcome == "correct"
    # without the documented sizes the probe cannot feed it: a named refusal
    monkeypatch.setattr(ci, "doc_sizes", lambda fn, params, cfg: {})
    with pytest.raises(coverage.Refused, match="no inputs"):
        coverage.find_inputs(DocSizedDiT())


class PatchifiedChannelsLast(nn.Module):
    """``(b, f, h, w, c)`` latents patchified 2x2 by a view before the Linear: the Linear's width is
    4 x the channel count, which no input has."""

    def __init__(self, channels: int = 5, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(4 * channels, dim)

    def forward(self, hidden_states):
        b, f, h, w, c = hidden_states.shape
        x = hidden_states.view(b, f, h // 2, 2, w // 2, 2, c).permute(0, 1, 2, 4, 3, 5, 6).flatten(4)
        return (self.proj(x),)


def test_a_linear_that_rejects_a_reshape_of_an_input_resizes_its_last_dim():
    model = PatchifiedChannelsLast()
    x = torch.randn(1, 2, 4, 4, 3)
    exc = _error(lambda: model(hidden_states=x))
    new, why = repairs.repair(exc, {"hidden_states": x}, lambda n, kw, rank=None: None, set())
    assert new["hidden_states"].shape == (1, 2, 4, 4, 5), why
    # the rule only resizes what the failing call holds: an unrelated input of the same size is kept
    other = torch.randn(1, 2, 4, 4, 3)
    assert repairs._reshaped_last_dim(exc, str(exc), {"other": other}, None, set(), set()) is None


class PairsDecoder(nn.Module):
    """Conditioning as a list of ``(encoding, mask)`` pairs, first in the signature; the encodings
    meet a Linear of width 12 inside a block."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj_in = nn.Linear(6, dim)
        self.kv = nn.Linear(12, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])

    def forward(self, encodings_and_masks, decoder_input_tokens, decoder_noise_time):
        """
        Args:
            encodings_and_masks (`list` of `tuple` of `torch.Tensor`):
                A list of `(encoding, mask)` tuples.
        """
        enc = torch.cat([x * m[..., None] for x, m in encodings_and_masks], 1)
        y = self.proj_in(decoder_input_tokens)
        temb = self.time(decoder_noise_time[:, None]) + self.kv(enc).mean(1)
        for block in self.blocks:
            y = block(y, temb)
        return y


def test_an_input_unpacked_into_pairs_becomes_a_list_of_pairs_whose_tensors_get_repaired():
    kwargs, _ = coverage.find_inputs(PairsDecoder())
    (enc, mask), = kwargs["encodings_and_masks"]
    assert enc.shape[-1] == 12 and mask.shape == enc.shape[:2]
    assert kwargs["decoder_input_tokens"].shape[-1] == 6
    # the stages perturb the first float tensor input (the list of pairs cannot be scaled)
    assert coverage.check_class(PairsDecoder, cp=False).outcome == "correct"
    # the rules' own refusal without the pair rule
    saved = list(repairs.REPAIRS)
    try:
        repairs.REPAIRS[:] = [r for r in saved if r is not repairs._iterated_tuples]
        with pytest.raises(coverage.Refused):
            coverage.find_inputs(PairsDecoder())
    finally:
        repairs.REPAIRS[:] = saved


class ScaleNorm(nn.Module):
    """An RMS norm: its weight meets the input by broadcasting (a size error, not a matmul one)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-6)
        return hidden_states * self.weight


class PerSampleListDiT(ModelMixin, ConfigMixin):
    """Latents and captions as lists of per-sample tensors (``(C, F, H, W)`` and ``(L, D)``, no batch
    axis); the captions are padded to a multiple of 16 tokens and normed before their Linear."""

    @register_to_config
    def __init__(self, in_channels: int = 4, dim: int = 16, cap_feat_dim: int = 24, num_layers: int = 2):
        super().__init__()
        self.x_in = nn.Linear(4 * in_channels, dim)
        self.cap_norm = ScaleNorm(cap_feat_dim)
        self.cap_in = nn.Linear(cap_feat_dim, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, 4 * in_channels)

    def forward(self, x: list[torch.Tensor, list[list[torch.Tensor]]], t, cap_feats: list[torch.Tensor],
                return_dict: bool = False):
        outs = []
        for image, cap in zip(x, cap_feats):
            C, F_, H, W = image.size()
            tokens = image.view(C, F_, H // 2, 2, W // 2, 2).permute(1, 2, 4, 3, 5, 0).reshape(-1, 4 * C)
            pad = (-cap.shape[0]) % 16
            cap = torch.cat([cap, cap[-1:].expand(pad, -1)], 0)
            seq = torch.cat([self.cap_in(self.cap_norm(cap)), self.x_in(tokens)], 0)[None]
            temb = self.time(t[:, None])
            for block in self.blocks:
                seq = block(seq, temb)
            outs.append(self.proj_out(seq[0, cap.shape[0]:]))
        return (outs,)


def test_list_annotated_inputs_are_per_sample_tensors_whose_shapes_get_repaired(monkeypatch):
    kwargs, _ = coverage.find_inputs(PerSampleListDiT())
    (image,), (cap,) = kwargs["x"], kwargs["cap_feats"]
    assert image.ndim == 4 and image.shape[0] == 4  # (C, F, H, W): no batch axis
    assert cap.ndim == 2 and cap.shape[-1] == 24  # the norm's width, found from a size error
    row = coverage.check_class(PerSampleListDiT, cp=False)
    assert row.outcome == "correct", (row.stage, row.reason)
    # without the last-axis width rule the size error is taken for a text length: refused
    monkeypatch.setattr(repairs, "last_axis_mismatch", lambda exc: None)
    with pytest.raises(coverage.Refused):
        coverage.find_inputs(PerSampleListDiT())


def test_a_width_mismatch_on_the_last_axis_is_not_a_length():
    norm = ScaleNorm(24)
    exc = _error(lambda: norm(torch.randn(16, 10)))
    assert repairs.last_axis_mismatch(exc) == (10, 24, 1)
    seq = torch.randn(1, 10, 8)
    exc = _error(lambda: seq + torch.randn(1, 12, 8))
    assert repairs.last_axis_mismatch(exc) is None


def test_a_documented_shape_on_the_next_line_and_config_entries_by_attribute():
    class Cfg(dict):
        pass

    class TwoLineDoc(nn.Module):
        config = Cfg(caption_channels=12)

        def forward(self, hidden_states, encoder_hidden_states):
            """
            Args:
                hidden_states (`torch.Tensor`):
                    Packed latents of shape `(batch_size, num_video_tokens, in_channels)`.
                encoder_hidden_states (`torch.Tensor`):
                    Text of shape `(batch_size, text_seq_len, self.config.caption_channels)`.
            """
            return hidden_states

    needs = ci.forward_needs(TwoLineDoc())
    assert needs["hidden_states"].roles == ["batch", "tokens", "channels"]
    assert needs["encoder_hidden_states"].sizes == [None, ["text"], 12]


class AudioVideoTable(nn.Module):
    """An int (``audio_num_frames``) sizes the audio positions; the audio tokens must match it."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.video_in = nn.Linear(4, dim)
        self.audio_in = nn.Linear(4, dim)
        self.freqs = nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states, audio_hidden_states, audio_num_frames: int = 2):
        pos = torch.arange(audio_num_frames, dtype=torch.float32)[None, :, None] * self.freqs
        audio = self.audio_in(audio_hidden_states) + pos
        return (self.video_in(hidden_states) + audio.mean(1, keepdim=True),)


def test_an_int_input_that_sizes_a_table_takes_the_like_named_tensors_size():
    model = AudioVideoTable()
    kwargs = {"hidden_states": torch.randn(1, 16, 4), "audio_hidden_states": torch.randn(1, 8, 4),
              "audio_num_frames": 2}
    exc = _error(lambda: model(**kwargs))
    assert repairs.int_input_size(exc, kwargs) == ("audio_num_frames", 8)
    new, _ = repairs._int_input_size(exc, str(exc), kwargs, None, set(), set())
    assert new["audio_num_frames"] == 8 and new["audio_hidden_states"] is kwargs["audio_hidden_states"]
    model(**new)
    # and the probe does not take the mismatch for a text length to regrid
    maker = type("M", (), {"grid": ci.Grid()})()
    assert coverage.inputs._regrid(exc, kwargs, model, None, {}, maker, set()) is None
    # an int named for nothing the tensors are named for is left to the other rules
    odd = {"hidden_states": kwargs["hidden_states"], "audio_hidden_states": kwargs["audio_hidden_states"],
           "count": 2}
    assert repairs.int_input_size(exc, odd) is None


def test_a_prefixed_attention_keeps_its_width_tied_to_its_heads():
    class Fake:
        def __init__(self, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
                     audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
                     caption_channels=3840):
            pass

    kw = coverage.shrink_config(Fake, 8, heads=2)
    assert kw["cross_attention_dim"] == kw["num_attention_heads"] * kw["attention_head_dim"]
    assert kw["audio_cross_attention_dim"] == kw["audio_num_attention_heads"] * kw["audio_attention_head_dim"]
    assert kw["caption_channels"] == 480


class PoseFaceDiT(nn.Module):
    """Latents with one more frame than the pose video (documented as ``T + 1``); a face video in
    pixels at a fixed resolution (an error message says which) and 3 channels (a Conv2d on the
    frames folded into the batch says so)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.patch = nn.Conv3d(4, dim, (1, 2, 2), stride=(1, 2, 2))
        self.pose = nn.Conv3d(4, dim, (1, 2, 2), stride=(1, 2, 2))
        self.face = nn.Conv2d(3, dim, 4, stride=4)

    def forward(self, hidden_states, pose_hidden_states, face_pixel_values):
        r"""
        Args:
            hidden_states (`torch.Tensor` of shape `(B, C, T + 1, H, W)`):
                latents.
            pose_hidden_states (`torch.Tensor` of shape `(B, C, T, H, W)`):
                pose latents.
        """
        if pose_hidden_states.shape[2] + 1 != hidden_states.shape[2]:
            raise ValueError("pose frames must be one less than the latent frames")
        b, c, s, h, w = face_pixel_values.shape
        if (h, w) != (16, 16):
            raise ValueError(f"Face pixel values has resolution ({h}, {w}) but is expected to have resolution (16, 16)")
        faces = face_pixel_values.permute(0, 2, 1, 3, 4).reshape(b * s, c, h, w)
        x = self.patch(hidden_states)
        x[:, :, 1:] = x[:, :, 1:] + self.pose(pose_hidden_states)
        return (x.flatten(2).mean(-1)[:, :, None] + self.face(faces).mean((0, 2, 3))[None, :, None],)


def test_frame_sums_expected_shapes_and_conv_channels_from_code_and_messages():
    kwargs, _ = coverage.find_inputs(PoseFaceDiT())
    assert kwargs["hidden_states"].shape[2] == kwargs["pose_hidden_states"].shape[2] + 1
    face = kwargs["face_pixel_values"]
    assert face.shape[1] == 3 and face.shape[-2:] == (16, 16)
    # each message rule alone: the old probe has none of them
    model, x = PoseFaceDiT(), torch.randn(1, 4, 2, 8, 8)
    exc = _error(lambda: model.face(x.permute(0, 2, 1, 3, 4).reshape(2, 4, 8, 8)))
    new, _ = repairs._conv_channels(exc, str(exc), {"face_pixel_values": x}, None, set(), set())
    assert new["face_pixel_values"].shape == (1, 3, 2, 8, 8)
    msg = "Face pixel values has resolution (8, 8) but is expected to have resolution (16, 16)"
    new, _ = repairs._expected_tuple(ValueError(msg), msg, {"face_pixel_values": x, "other": x.clone()}, None, set(), set())
    assert new["face_pixel_values"].shape == (1, 4, 2, 16, 16) and new["other"].shape == x.shape


class PerFrameTimestepDiT(nn.Module):
    """Per-frame timesteps ``(B, 1, T)`` and a mask whose name says nothing of the text; only the
    docstring (in the ``name: ``(dims)`` `` style) says so."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.patch = nn.Conv3d(4, dim, (1, 2, 2), stride=(1, 2, 2))
        self.ctx = nn.Linear(6, dim)
        self.time = nn.Linear(1, dim)

    def forward(self, hidden_states, timestep, encoder_hidden_states, mask=None):
        """Run it.

        Args:
            hidden_states: ``(B, C, T, H, W)`` latents.
            timestep: ``(B, 1, T)`` per-frame timesteps.
            mask: Alias for ``encoder_attention_mask``, the text padding mask.
        """
        if mask is None:
            raise ValueError("`mask` is required")
        x = self.patch(hidden_states)  # (B, D, T, h, w)
        t = self.time(timestep.float()[..., None])  # (B, 1, T, D)
        x = x + t[:, 0].permute(0, 2, 1)[..., None, None]
        ctx = (self.ctx(encoder_hidden_states) * mask[..., None]).mean(1)
        return (x + ctx[:, :, None, None, None],)


def test_colon_style_docstring_shapes_and_a_text_mask_by_its_description():
    kwargs, _ = coverage.find_inputs(PerFrameTimestepDiT())
    frames = kwargs["hidden_states"].shape[2]
    assert kwargs["timestep"].shape == (1, 1, frames)
    assert kwargs["mask"].shape == kwargs["encoder_hidden_states"].shape[:2]
    assert [n for n, _ in ci.doc_shapes(PerFrameTimestepDiT.forward)] == ["hidden_states", "timestep"]


class PackedRowsDiT(nn.Module):
    """One packed sequence: per-row tags and timestep indices documented as ``(seq_len,)``, checked
    against the positions with a message that gives ``seq_len=N``; the AdaLN row index is computed
    from the tags (a float there fails as an index)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj_in = nn.Linear(6, dim)
        self.table = nn.Parameter(torch.randn(6, dim))

    def forward(self, hidden_states, timestep_indices, token_tags, position_ids):
        r"""
        Args:
            timestep_indices (`torch.Tensor` of shape `(seq_len,)`):
                per row, its timestep.
            token_tags (`torch.Tensor` of shape `(seq_len,)`):
                per row, its modality.
            position_ids (`torch.Tensor` of shape `(seq_len, 3)`):
                coordinates.
        """
        n = position_ids.shape[0]
        if token_tags.shape != (n,) or timestep_indices.shape != (n,):
            raise ValueError(f"`token_tags` and `timestep_indices` must be `(seq_len,)`, got "
                             f"{list(token_tags.shape)} and {list(timestep_indices.shape)} for seq_len={n}.")
        rows = timestep_indices * 3 + token_tags
        return (self.proj_in(hidden_states)[:, :n] + self.table.index_select(0, rows),)


def test_a_documented_symbol_the_message_sizes_and_an_index_computed_from_an_input():
    model = PackedRowsDiT()
    kwargs = {"hidden_states": torch.randn(1, 8, 6), "timestep_indices": torch.zeros(1, dtype=torch.long),
              "token_tags": torch.randn(8), "position_ids": torch.zeros(8, 3, dtype=torch.long)}
    maker = type("M", (), {"model": model})()
    exc = _error(lambda: model(**kwargs))
    new, _ = repairs._documented_symbol(exc, str(exc), kwargs, maker, set(), set())
    assert new["timestep_indices"].shape == (8,) and new["timestep_indices"].dtype == torch.long
    assert new["token_tags"] is kwargs["token_tags"]  # already (seq_len,)
    exc = _error(lambda: model(**new))
    fixed, _ = repairs._index_dtype(exc, str(exc), new, maker, set(), set())
    assert fixed["token_tags"].dtype == torch.long and fixed["hidden_states"] is new["hidden_states"]
    model(**fixed)


class ScaledRope(nn.Module):
    def __init__(self, dim, rope_scaling=None):
        super().__init__()
        self.dim = dim
        self.short = rope_scaling["short_factor"]
        self.long = rope_scaling["long_factor"]  # read after the line that fails on None

    def forward(self, pos):
        factors = torch.tensor(self.long if pos.max() > 1000 else self.short)
        freqs = pos[..., None].float() / (factors * 100 ** (torch.arange(0, self.dim, 2) / self.dim))
        return freqs.cos(), freqs.sin()


class PassesASettingsDictOn(ModelMixin, ConfigMixin):
    """The settings dict is read by a submodule's constructor, not by the class's own."""

    @register_to_config
    def __init__(self, dim: int = 8, rope_scaling: dict = None):
        super().__init__()
        self.rope = ScaledRope(dim, rope_scaling=rope_scaling)


def test_a_settings_dict_read_in_a_submodule_gets_every_key_that_submodule_reads():
    model, _ = coverage.build_tiny(PassesASettingsDictOn)
    assert model.config.rope_scaling == {"short_factor": 1.0, "long_factor": 1.0}
    cos, sin = model.rope(torch.arange(6)[None])
    assert cos.shape == (1, 6, 4) and torch.isfinite(cos).all() and torch.isfinite(sin).all()


class PrependsATimeToken(nn.Module):
    """A time token joins the image tokens before attention; ``attention_mask`` is ``(B, S)`` over
    the joint sequence and reaches the attention as it is (broadcast right-aligned)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(4, dim)
        self.time = nn.Linear(1, dim)

    def forward(self, hidden_states, timestep, attention_mask):
        x = torch.cat([self.time(timestep[:, None, None]), self.proj(hidden_states)], dim=1)
        q = x.view(x.shape[0], -1, 2, 4).transpose(1, 2)
        return (F.scaled_dot_product_attention(q, q, q, attn_mask=attention_mask),)


def test_a_lower_rank_input_in_a_broadcast_takes_the_size_at_its_right_aligned_dim():
    model = PrependsATimeToken()
    kwargs = {"hidden_states": torch.randn(1, 16, 4), "timestep": torch.ones(1),
              "attention_mask": torch.randn(1, 16)}
    exc = _error(lambda: model(**kwargs))  # scores (1, 2, 17, 17) against the mask's 16 at dim 3
    new, why = repairs._size_mismatch(exc, str(exc), kwargs, None, set(), set())
    assert new["attention_mask"].shape == (1, 17) and new["hidden_states"] is kwargs["hidden_states"], why
    model(**new)


class TableRopeDiT(ModelMixin, ConfigMixin):
    """A required rotary table that only the pipeline builds (``make_table(self.transformer.head_dim,
    16, scale=<running state>)``), and an options dict it spreads with ``**``."""

    @register_to_config
    def __init__(self, in_channels: int = 4, head_dim: int = 8, num_layers: int = 2):
        super().__init__()
        self.head_dim = head_dim
        self.proj_in = nn.Linear(in_channels, head_dim)
        self.time = nn.Linear(1, head_dim)
        self.blocks = nn.ModuleList([Block(head_dim) for _ in range(num_layers)])
        self.proj_out = nn.Linear(head_dim, in_channels)

    def _scale(self, x, **options):
        return x * options.get("scale", 1.0)

    def forward(self, hidden_states, timestep, rotary_table, options=None, return_dict: bool = False):
        if rotary_table.ndim != 2:
            raise ValueError("the rotary table is one row per position")
        x = self.proj_in(hidden_states) + rotary_table[: hidden_states.shape[1]]
        temb = self.time(timestep[:, None] / 1000.0)
        for block in self.blocks:
            x = self._scale(block(x, temb), **options)
        return (self.proj_out(x),)


_FAKE_PIPELINE = '''
from __future__ import annotations

import torch


def make_table(dim, length, scale=1.0):
    return torch.linspace(0, 1, length)[:, None].repeat(1, dim) * scale


class TablePipeline:
    def __init__(self, transformer: TableRopeDiT):
        self.transformer = transformer

    def __call__(self, latents, t, scale_now):
        table = make_table(self.transformer.head_dim, 64, scale=scale_now)
        return self.transformer(hidden_states=latents, timestep=t, rotary_table=table)
'''


def test_an_input_only_the_pipeline_builds_is_built_as_the_pipeline_does(tmp_path, monkeypatch):
    import sys

    pkg = tmp_path / "fakepipes"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pipeline_table.py").write_text(_FAKE_PIPELINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ci, "_FUNCTIONS_BY_CLASS", {})
    # without the pipeline the probe has nothing to build the table from: refused
    monkeypatch.setattr(ci, "_pipeline_roots", lambda: [])
    assert coverage.check_class(TableRopeDiT, cp=False).outcome == "refused"
    monkeypatch.setattr(ci, "_FUNCTIONS_BY_CLASS", {})
    monkeypatch.setattr(ci, "_pipeline_roots", lambda: [("fakepipes", str(pkg))])
    model = TableRopeDiT()
    table = ci.pipeline_value(model, "rotary_table")
    assert table.shape == (64, 8) and float(table.max()) == 1.0  # scale left to its default
    row = coverage.check_class(TableRopeDiT, cp=False)
    assert row.outcome == "correct", (row.stage, row.reason)
    sys.modules.pop("fakepipes.pipeline_table", None)


def test_an_options_dict_spread_with_two_stars_is_supplied_empty():
    model = TableRopeDiT()
    kwargs = {"hidden_states": torch.randn(1, 4, 4), "timestep": torch.ones(1), "rotary_table": torch.zeros(16, 8)}
    exc = _error(lambda: model(**kwargs))

    def make(*a, **k):
        return torch.zeros(1)  # what a name rule would make: never a mapping

    make.params = ["hidden_states", "timestep", "rotary_table", "options"]
    new, _ = repairs.repair(exc, kwargs, make, set())
    assert new["options"] == {}
    model(**new)


def test_a_rotary_width_given_as_an_int_shrinks_with_the_head_dim():
    class Fake:
        def __init__(self, num_attention_heads=48, attention_head_dim=128, hidden_size=6144, rope_freq_dim=16,
                     rope_theta=10000, freq_dim=256):
            pass

    kw = coverage.shrink_config(Fake, 8, heads=2)
    assert kw["attention_head_dim"] == 16
    assert 6 * kw["rope_freq_dim"] <= kw["attention_head_dim"]  # 3 axes x 2 x freqs still fit in a head
    assert kw["freq_dim"] == 32  # not a rotary width: the common divisor only


class NamedFeaturesModel(nn.Module):
    """Reads a named feature from a dict of conditioning features only its pipeline builds."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden_states, conditioning: dict[str, torch.Tensor] | None = None):
        features = {**(conditioning or {}), "x": hidden_states}
        return (self.proj(features["x"]) * features["is_conditioning"],)


def test_a_missing_named_feature_is_refused_with_the_dict_it_comes_from():
    with pytest.raises(coverage.Refused, match=r"reads key 'is_conditioning' .* dict input 'conditioning'"):
        coverage.find_inputs(NamedFeaturesModel())


class SlotExpandedDiT(nn.Module):
    """A prompt sequence with one slot per 2x2 group of image tokens at its end: ``img_mask`` is True
    at those slots, each expanded to 4 positions that take the image tokens (``joint[:, pad] = h``);
    ``img_shapes`` must account for as many image tokens as the mask marks."""

    def __init__(self):
        super().__init__()
        self.img_in, self.txt_in, self.out = nn.Linear(4, 8), nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                img_shapes: list[list[tuple[int, int, int]]], img_mask: torch.Tensor):
        h, e = self.img_in(hidden_states), self.txt_in(encoder_hidden_states)
        repeats = torch.where(img_mask, 4, 1)[0]
        pad = torch.repeat_interleave(img_mask[0], repeats)
        target = img_shapes[0][-1][0] * img_shapes[0][-1][1] * img_shapes[0][-1][2]
        joint = torch.cat([e, e.new_zeros(e.shape[0], target // 4, e.shape[2])], dim=1)
        joint = joint.repeat_interleave(repeats, dim=1)
        joint[:, pad] = h
        if target != int(pad.sum()):
            raise ValueError(f"img_shapes accounts for {target} image tokens but the mask marks {int(pad.sum())}.")
        return (self.out(joint),)


def test_a_slot_mask_its_grid_list_and_its_length_follow_the_errors_of_an_expanded_assignment():
    model = SlotExpandedDiT()
    kwargs = {"hidden_states": torch.randn(1, 16, 4), "encoder_hidden_states": torch.randn(1, 8, 6),
              "img_shapes": [[(2, 4, 4)]], "img_mask": torch.ones(1, 16, dtype=torch.bool)}
    # 16 slots x 4 = 64 positions for 16 image rows: 4 slots, at the mask's end
    exc = _error(lambda: model(**kwargs))
    new, why = repairs._masked_count(exc, str(exc), kwargs, None, set(), set())
    assert new["img_mask"].tolist() == [[False] * 12 + [True] * 4], why
    assert repairs._size_mismatch(exc, str(exc), kwargs, None, set(), set()) is None
    # the grid list counts 32 tokens where the mask marks 16: one frame, not two
    exc = _error(lambda: model(**new))
    new, why = repairs._grid_token_count(exc, str(exc), new, None, set(), set())
    assert new["img_shapes"] == [[(1, 4, 4)]], why
    # 8 prompt + 4 slots = 12 positions, one repeat count each: the mask keeps its last 12
    exc = _error(lambda: model(**new))
    new, why = repairs._repeats_length(exc, str(exc), new, None, set(), set())
    assert new["img_mask"].tolist() == [[False] * 8 + [True] * 4], why
    assert new["hidden_states"] is kwargs["hidden_states"]
    model(**new)


def test_the_slot_repairs_leave_unrelated_errors_alone():
    model = SlotExpandedDiT()
    kwargs = {"hidden_states": torch.randn(1, 16, 4), "encoder_hidden_states": torch.randn(1, 8, 6),
              "img_shapes": [[(1, 4, 4)]], "img_mask": torch.tensor([[False] * 8 + [True] * 4])}
    model(**kwargs)
    exc = _error(lambda: model(**{**kwargs, "hidden_states": torch.randn(1, 16, 5)}))  # a width error
    for rule in (repairs._masked_count, repairs._grid_token_count, repairs._repeats_length):
        assert rule(exc, str(exc), kwargs, None, set(), set()) is None


def test_the_probe_finds_the_slot_layout_from_the_errors_alone():
    kwargs, _ = coverage.find_inputs(SlotExpandedDiT())
    assert kwargs["img_shapes"] == [[(1, 4, 4)]]
    assert kwargs["img_mask"].tolist() == [[False] * 8 + [True] * 4]
