"""The user's pipeline around the reference code: fixed text embeddings (a seeded table, no text
encoder), ``prepare`` -> ``denoise`` -> ``unpack``, latents shown as the image (no VAE)."""
import sys
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling import denoise, get_schedule, prepare, unpack  # noqa: E402


class FluxReferenceOutput(BaseOutput):
    images: object


class FluxReferencePipeline(DiffusionPipeline):
    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)

    def embed_prompt(self, prompt: str, length: int = 6):
        cfg = self.transformer.config
        table = torch.randn(128, cfg.context_in_dim, generator=torch.Generator().manual_seed(1234))
        ids = torch.tensor([ord(ch) % 128 for ch in (prompt or " ")][:length] + [0] * max(0, length - len(prompt or " ")))
        txt = table[ids][None].to(self.device)
        return txt, txt.mean(dim=1)[:, : cfg.vec_in_dim]

    @torch.no_grad()
    def __call__(self, prompt, height=16, width=16, num_inference_steps=3, guidance_scale=3.5, generator=None):
        channels = self.transformer.config.in_channels // 4
        noise = torch.randn((1, channels, height // 2, width // 2), generator=generator).to(self.device)
        txt, vec = self.embed_prompt(prompt)
        inp = prepare(txt, vec, noise)
        timesteps = get_schedule(num_inference_steps, inp["img"].shape[1])
        x = denoise(self.transformer, **inp, timesteps=timesteps, guidance=guidance_scale)
        x = unpack(x.float(), height // 2, width // 2)
        img = torch.nn.functional.interpolate(x[:, :3], scale_factor=2, mode="nearest")
        return FluxReferenceOutput(images=(img.clamp(-1, 1) * 0.5 + 0.5).permute(0, 2, 3, 1).cpu().numpy())
