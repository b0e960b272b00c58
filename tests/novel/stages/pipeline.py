"""Own pipeline: a plain Euler flow loop without a diffusers scheduler, character prompt ids,
separate CFG calls, latents shown as the image."""
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput


class StagedOutput(BaseOutput):
    images: object


class StagedPipeline(DiffusionPipeline):
    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)

    def tokens(self, prompt):
        cfg = self.transformer.config
        ids = [(ord(ch) * 7) % cfg.vocab for ch in (prompt or "")][: cfg.text_len]
        return torch.tensor([ids + [0] * (cfg.text_len - len(ids))], device=self.device)

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt=None, height=32, width=32, num_inference_steps=3,
                 guidance_scale=2.5, generator=None):
        c = self.transformer.config.in_channels
        x = torch.randn((1, c, height // 4, width // 4), generator=generator).to(self.device)
        cond, uncond = self.tokens(prompt), self.tokens(negative_prompt)
        sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1, device=self.device)
        for i in range(num_inference_steps):
            t = sigmas[i].expand(1)
            v = self.transformer(x, cond, t)
            if guidance_scale > 1:
                v_u = self.transformer(x, uncond, t)
                v = v_u + guidance_scale * (v - v_u)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        img = torch.nn.functional.interpolate(x[:, :3], scale_factor=4, mode="bilinear")
        return StagedOutput(images=(img.tanh() * 0.5 + 0.5).permute(0, 2, 3, 1).cpu().numpy())
