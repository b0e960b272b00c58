"""The coverage probe's inputs for two structural features the name rules and the data-flow
repairs did not reach: a forward that takes one packed joint sequence described by its parts
(``coverage.layout``), and a forward that reads named features out of a dict input
(``coverage.repairs._missing_dict_key``). Small models written here; each was refused by the
probe before these mechanisms."""

from __future__ import annotations

from typing import Any

import diffusers
import pytest
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from ditbook import coverage
from ditbook.coverage import layout, repairs
from torch import nn


class PackedJointDiT(ModelMixin, ConfigMixin):
    """Text ids and per-item video latents packed into one sequence without a batch axis: each
    part placed by an index tensor, the latents patchified per item with a companion list of
    token grids, one timestep per latent token, an int total length and an int text length."""

    @register_to_config
    def __init__(self, vocab_size: int = 40, hidden_size: int = 16, latent_channel: int = 3,
                 latent_patch_size: int = 2, num_layers: int = 2):
        super().__init__()
        p = latent_patch_size
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.proj_in = nn.Linear(p * p * latent_channel, hidden_size)
        self.time = nn.Linear(1, hidden_size)
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)])
        self.proj_out = nn.Linear(hidden_size, p * p * latent_channel)

    def forward(self, input_ids: torch.Tensor, text_indexes: torch.Tensor, position_ids: torch.Tensor,
                text_len: int, sequence_length: int, image_latents: list[torch.Tensor],
                image_token_shapes: list[tuple[int, int, int]], image_sequence_indexes: torch.Tensor,
                image_timesteps: torch.Tensor, image_frame_indexes: list[torch.Tensor], return_dict: bool = True):
        """Args:
            input_ids: Text token ids placed at ``text_indexes``.
            position_ids: ``[2, sequence_length]`` positions of the whole sequence.
            text_len: Length of the text prefix.
            image_timesteps: Per-token diffusion timesteps of the image tokens.
        """
        p, c = self.config.latent_patch_size, self.config.latent_channel
        hidden = self.embed_tokens(input_ids).new_zeros(sequence_length, self.config.hidden_size)
        hidden[text_indexes] = self.embed_tokens(input_ids)
        packed = []
        for latent, shape, frames in zip(image_latents, image_token_shapes, image_frame_indexes):
            latent = latent.squeeze(0)
            _, t, h, w = latent.shape
            if (t, h // p, w // p) != tuple(shape) or len(frames) != t:
                raise ValueError(f"latent {tuple(latent.shape)} does not match its token grid {shape}")
            x = latent.reshape(c, t, h // p, p, w // p, p).permute(1, 2, 4, 3, 5, 0).reshape(-1, p * p * c)
            packed.append(x)
        tokens = self.proj_in(torch.cat(packed)) + self.time(image_timesteps[:, None] / 1000)
        hidden[image_sequence_indexes] = tokens
        hidden = hidden + 0.0 * position_ids.float().sum(0)[:, None]
        text, image = hidden[:text_len], hidden[text_len:]
        for layer in self.layers:
            image = image + layer(image + text.mean(0))
        return (self.proj_out(image),)


def test_joint_layout_reads_the_parts_from_the_signature():
    total, parts = layout.joint_layout(PackedJointDiT.forward)
    assert total == "sequence_length"
    text, image = parts
    assert (text.prefix, text.indexes, text.items) == ("text", ["text_indexes"], None)
    assert image.items == "image_latents" and image.shapes == "image_token_shapes"
    assert image.indexes == ["image_sequence_indexes"] and image.frame_lists == ["image_frame_indexes"]
    assert image.times == ["image_timesteps"]
    # an ordinary latent + text signature is no joint sequence
    assert layout.joint_layout(diffusers.FluxTransformer2DModel.forward) is None


def test_probe_finds_inputs_for_a_packed_joint_sequence():
    model = PackedJointDiT().eval()
    kwargs, _ = coverage.find_inputs(model)
    n_text = kwargs["input_ids"].shape[0]
    n_image = sum(t * h * w for t, h, w in kwargs["image_token_shapes"])
    assert kwargs["sequence_length"] == n_text + n_image
    assert kwargs["text_len"] == n_text
    assert kwargs["position_ids"].shape == (2, n_text + n_image)
    assert torch.equal(kwargs["image_sequence_indexes"], torch.arange(n_text, n_text + n_image))
    with torch.no_grad():
        out = model(**kwargs)[0]
    assert out.shape[0] == n_image and torch.isfinite(out).all()


KEYS = {"flag": "cond_flag_1_token"}  # feature name -> the key a preprocessor emits it under


class DictFeaturesDiT(ModelMixin, ConfigMixin):
    """Reads named features out of what it builds from its dict input: one by its key, one through
    a module-level key table, raising its own ``KeyError`` when that one is absent."""

    @register_to_config
    def __init__(self, dim: int = 8, num_layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(num_layers)])

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor, conditioning: dict[str, Any] | None = None,
                return_dict: bool = True):
        features = {**(conditioning or {}), "mask": mask}
        keep = features["mask"].bool() & ~features["is_context"].bool()
        flag = features.get(KEYS["flag"])
        if flag is None:
            raise KeyError("required conditioning annotation for flag is missing")
        x = hidden_states
        for block in self.blocks:
            x = x + block(x)
        return (x * keep[..., None] + flag.float()[..., None],)


def test_probe_fills_keys_of_a_dict_input_the_forward_reads():
    model = DictFeaturesDiT().eval()
    kwargs, _ = coverage.find_inputs(model)
    assert set(kwargs["conditioning"]) == {"is_context", "cond_flag_1_token"}
    assert kwargs["conditioning"]["is_context"].shape == kwargs["mask"].shape
    with torch.no_grad():
        assert torch.isfinite(model(**kwargs)[0]).all()


def test_missing_key_through_a_key_table():
    model = DictFeaturesDiT().eval()
    try:
        model(torch.zeros(1, 4, 8), torch.ones(1, 4), conditioning={"is_context": torch.zeros(1, 4)})
    except KeyError as exc:
        assert repairs.missing_key(exc) == "cond_flag_1_token"
    else:
        raise AssertionError("expected a KeyError")


@pytest.mark.skipif(not hasattr(diffusers, "Cosmos3OmniTransformer"), reason="diffusers without the class")
def test_probe_runs_the_real_packed_joint_sequence_class():
    model, _, kwargs = coverage.tiny_with_inputs(diffusers.Cosmos3OmniTransformer)
    with torch.no_grad():
        out = model(**kwargs)
    assert torch.isfinite(coverage.inputs.first_tensor(out)).all()
    assert "rope_axes_dim" in model.coverage_setup  # the rotary axes a helper indexes: rebuilt with a third
