"""diffusers FasterCache's tensor layout is picked by the latents' rank, not by the pipeline's
class name (issue 27)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ditbook.accel.diffusers_fastercache import LayoutByRank, tensor_layout


class Identity(torch.nn.Module):
    def forward(self, hidden_states, timestep=None):
        return hidden_states


def test_layout_follows_the_rank():
    assert tensor_layout(5) == "BFCHW"
    assert tensor_layout(4) == "BCHW" and tensor_layout(3) == "BCHW"


def test_the_first_call_sets_the_layout_and_remove_puts_it_back():
    for x, want in ((torch.zeros(1, 4, 2, 8, 8), "BFCHW"), (torch.zeros(1, 4, 8, 8), "BCHW")):
        model, denoiser = Identity(), SimpleNamespace(tensor_format="BCFHW")
        layout = LayoutByRank(model, denoiser)
        model(hidden_states=x)
        assert denoiser.tensor_format == want
        model(torch.zeros(1, 4, 8, 8))  # later calls keep the first call's layout
        assert denoiser.tensor_format == want
        layout.remove()
        assert denoiser.tensor_format == "BCFHW" and not model._forward_pre_hooks
