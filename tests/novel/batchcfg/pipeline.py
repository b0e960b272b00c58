"""Own pipeline with true classifier-free guidance as one batched call: latents and prompt ids are
concatenated [cond, uncond], the prediction is chunked in two."""
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput


class BatchCFGOutput(BaseOutput):
    images: object


class BatchCFGPipeline(DiffusionPipeline):
    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    def ids(self, prompt):
        n, vocab = self.transformer.config.text_len, self.transformer.config.vocab
        vals = [ord(ch) % vocab for ch in (prompt or "")][:n]
        return torch.tensor([vals + [0] * (n - len(vals))], device=self.device)

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt=None, height=32, width=32, num_inference_steps=3,
                 true_cfg_scale=4.0, generator=None):
        c = self.transformer.config.in_channels
        lat = torch.randn((1, c, height // 4, width // 4), generator=generator).to(self.device)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        ids = torch.cat([self.ids(prompt), self.ids(negative_prompt)])
        for t in self.scheduler.timesteps:
            model_in = torch.cat([lat, lat])
            v = self.transformer(model_in, ids, (t / 1000).expand(2), return_dict=False)[0]
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + true_cfg_scale * (v_cond - v_uncond)
            lat = self.scheduler.step(v, t, lat).prev_sample
        img = torch.nn.functional.interpolate(lat[:, :3], scale_factor=4, mode="nearest")
        return BatchCFGOutput(images=(img.tanh() * 0.5 + 0.5).permute(0, 2, 3, 1).cpu().numpy())
