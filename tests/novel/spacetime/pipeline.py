"""Own text-to-video pipeline: (B, C, F, H, W) latents, flow Euler via the scheduler, separate CFG
calls; the output's ``frames`` are the latents shown as (B, F, H, W, 3) pictures."""
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput


class VideoOutput(BaseOutput):
    frames: object


class SpaceTimePipeline(DiffusionPipeline):
    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def ids(self, prompt):
        n, vocab = self.transformer.config.text_len, self.transformer.config.vocab
        vals = [ord(ch) % vocab for ch in (prompt or "")][:n]
        return torch.tensor([vals + [0] * (n - len(vals))], device=self.device)

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt=None, height=16, width=16, num_frames=2, num_inference_steps=3,
                 guidance_scale=3.0, generator=None):
        c = self.transformer.config.in_channels
        lat = torch.randn((1, c, num_frames, height // 2, width // 2), generator=generator).to(self.device)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        cond, uncond = self.ids(prompt), self.ids(negative_prompt)
        for t in self.scheduler.timesteps:
            ts = (t / 1000).expand(1)
            v = self.transformer(lat, cond, ts)
            if guidance_scale > 1:
                vu = self.transformer(lat, uncond, ts)
                v = vu + guidance_scale * (v - vu)
            lat = self.scheduler.step(v, t, lat).prev_sample
        frames = torch.nn.functional.interpolate(lat[:, :3].transpose(1, 2).flatten(0, 1), scale_factor=2)
        frames = frames.view(1, num_frames, 3, height, width)
        return VideoOutput(frames=(frames.tanh() * 0.5 + 0.5).permute(0, 1, 3, 4, 2).cpu().numpy())
