"""A user's own pipeline: character-hashed prompt ids, a flow-matching Euler loop written out, separate
conditional / unconditional calls for CFG, latents shown directly as the image (no VAE)."""
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput


class NovelOutput(BaseOutput):
    images: object


class DepthScaledPipeline(DiffusionPipeline):
    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def text_ids(self, prompt):
        n, vocab = self.transformer.config.text_len, self.transformer.config.vocab
        vals = [ord(ch) % vocab for ch in (prompt or "")][:n]
        return torch.tensor([vals + [0] * (n - len(vals))], device=self.device)

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt=None, height=32, width=32, num_inference_steps=3,
                 guidance_scale=3.0, generator=None, output_type="np"):
        c = self.transformer.config.in_channels
        lat = torch.randn((1, c, height // 4, width // 4), generator=generator).to(self.device)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        cond, uncond = self.text_ids(prompt), self.text_ids(negative_prompt or "")
        for t in self.scheduler.timesteps:
            ts = (t / 1000).expand(1)
            pred = self.transformer(lat, cond, ts, return_dict=False)[0]
            if guidance_scale > 1:
                neg = self.transformer(lat, uncond, ts, return_dict=False)[0]
                pred = neg + guidance_scale * (pred - neg)
            lat = self.scheduler.step(pred, t, lat).prev_sample
        img = torch.nn.functional.interpolate(lat[:, :3], scale_factor=4, mode="nearest")
        img = (img.tanh() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        return NovelOutput(images=img)
