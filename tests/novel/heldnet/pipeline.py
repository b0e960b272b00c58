"""Own sampling loop, as reference code has it: a module-level ``denoise`` (no diffusers scheduler),
character prompt ids, one call per step (no CFG), latents shown as the image."""
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput


def denoise(model, img, tokens, steps):
    sigmas = torch.linspace(1.0, 0.0, steps + 1, device=img.device)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        img = img + (s_next - s) * model(img=img, tokens=tokens, t=s.expand(img.shape[0]))
    return img


class HeldNetOutput(BaseOutput):
    images: object


class HeldNetPipeline(DiffusionPipeline):
    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)

    @torch.no_grad()
    def __call__(self, prompt, height=16, width=16, num_inference_steps=3, generator=None):
        cfg = self.transformer.config
        ids = [(ord(ch) * 7) % cfg.vocab for ch in prompt][:6]
        tokens = torch.tensor([ids + [0] * (6 - len(ids))], device=self.device)
        h, w = height // 4, width // 4
        img = torch.randn((1, h * w, cfg.in_channels), generator=generator).to(self.device)
        img = denoise(self.transformer, img, tokens, num_inference_steps)
        x = img.view(1, h, w, cfg.in_channels).permute(0, 3, 1, 2)[:, :3]
        x = torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest")
        return HeldNetOutput(images=(x.tanh() * 0.5 + 0.5).permute(0, 2, 3, 1).cpu().numpy())
