"""Own pipeline at a 24 px image (6x6 latents, 3x3 patches): keyword transformer calls with
``return_dict=False``, separate CFG calls, the diffusers flow scheduler."""
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput


class OddOutput(BaseOutput):
    images: object


class OddShapePipeline(DiffusionPipeline):
    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def ids(self, prompt):
        n, vocab = self.transformer.config.text_len, self.transformer.config.vocab
        vals = [ord(ch) % vocab for ch in (prompt or "")][:n]
        return torch.tensor([vals + [0] * (n - len(vals))], device=self.device)

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt=None, height=24, width=24, num_inference_steps=3,
                 guidance_scale=3.0, generator=None):
        c = self.transformer.config.in_channels
        lat = torch.randn((1, c, height // 4, width // 4), generator=generator).to(self.device)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        cond, uncond = self.ids(prompt), self.ids(negative_prompt)
        for t in self.scheduler.timesteps:
            ts = (t / 1000).expand(1)
            v = self.transformer(hidden_states=lat, encoder_ids=cond, timestep=ts, return_dict=False)[0]
            if guidance_scale > 1:
                vu = self.transformer(hidden_states=lat, encoder_ids=uncond, timestep=ts, return_dict=False)[0]
                v = vu + guidance_scale * (v - vu)
            lat = self.scheduler.step(v, t, lat).prev_sample
        img = torch.nn.functional.interpolate(lat[:, :3], scale_factor=4, mode="nearest")
        return OddOutput(images=(img.tanh() * 0.5 + 0.5).permute(0, 2, 3, 1).cpu().numpy())
