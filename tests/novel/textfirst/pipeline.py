"""A k-diffusion-style sampler as the SD3.5 reference has it: a CFG denoiser that calls the model's
``apply_model`` once per step on the batched (cond, uncond) pair, Euler steps over its own sigmas."""
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput


class CFGDenoiser:
    def __init__(self, model):
        self.model = model

    def __call__(self, x, sigma, cond, uncond, scale):
        out = self.model.apply_model(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([cond, uncond]))
        pos, neg = out.chunk(2)
        return neg + (pos - neg) * scale


def sample_euler(denoiser, x, sigmas, **extra):
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        denoised = denoiser(x, s * x.new_ones(x.shape[0]), **extra)
        x = x + (x - denoised) / s * (s_next - s)
    return x


class TextFirstOutput(BaseOutput):
    images: object


class TextFirstPipeline(DiffusionPipeline):
    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)

    def embed(self, prompt):
        cfg = self.transformer.config
        table = torch.randn(128, cfg.text_dim, generator=torch.Generator().manual_seed(7))
        ids = ([ord(ch) % 128 for ch in prompt or ""] + [0] * 6)[:6]
        return table[torch.tensor(ids)][None].to(self.device)

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt="", height=16, width=16, num_inference_steps=3, guidance_scale=3.0,
                 generator=None):
        cfg = self.transformer.config
        h, w = height // 4, width // 4
        x = torch.randn((1, h * w, cfg.channels), generator=generator).to(self.device)
        sigmas = torch.linspace(1.0, 0.02, num_inference_steps).tolist() + [0.0]
        x = sample_euler(CFGDenoiser(self.transformer), x, sigmas, cond=self.embed(prompt),
                         uncond=self.embed(negative_prompt), scale=guidance_scale)
        img = x.view(1, h, w, cfg.channels).permute(0, 3, 1, 2)[:, :3]
        img = torch.nn.functional.interpolate(img, scale_factor=4, mode="nearest")
        return TextFirstOutput(images=(img.tanh() * 0.5 + 0.5).permute(0, 2, 3, 1).cpu().numpy())
