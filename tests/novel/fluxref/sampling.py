"""The reference sampling code: ``prepare`` packs latents and ids, ``denoise`` is the loop (a
module-level function, outside any pipeline class), ``unpack`` undoes the packing."""
import math

import torch
from einops import rearrange, repeat
from torch import Tensor


def get_schedule(num_steps: int, image_seq_len: int, shift: bool = True) -> list[float]:
    timesteps = torch.linspace(1, 0, num_steps + 1)
    if shift:
        mu = 0.5 + (1.15 - 0.5) * (image_seq_len - 256) / (4096 - 256)
        timesteps = math.exp(mu) / (math.exp(mu) + (1 / timesteps - 1) ** 1.0)
        timesteps[-1] = 0.0
    return timesteps.tolist()


def prepare(txt: Tensor, vec: Tensor, img: Tensor) -> dict[str, Tensor]:
    bs, _c, h, w = img.shape
    img = rearrange(img, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)
    img_ids = torch.zeros(h // 2, w // 2, 3)
    img_ids[..., 1] = img_ids[..., 1] + torch.arange(h // 2)[:, None]
    img_ids[..., 2] = img_ids[..., 2] + torch.arange(w // 2)[None, :]
    img_ids = repeat(img_ids, "h w c -> b (h w) c", b=bs)
    txt_ids = torch.zeros(bs, txt.shape[1], 3)
    return {"img": img, "img_ids": img_ids.to(img.device), "txt": txt.to(img.device),
            "txt_ids": txt_ids.to(img.device), "vec": vec.to(img.device)}


def denoise(model, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor, vec: Tensor,
            timesteps: list[float], guidance: float = 4.0):
    guidance_vec = torch.full((img.shape[0],), guidance, device=img.device, dtype=img.dtype)
    for t_curr, t_prev in zip(timesteps[:-1], timesteps[1:]):
        t_vec = torch.full((img.shape[0],), t_curr, dtype=img.dtype, device=img.device)
        pred = model(img=img, img_ids=img_ids, txt=txt, txt_ids=txt_ids, y=vec, timesteps=t_vec, guidance=guidance_vec)
        img = img + (t_prev - t_curr) * pred
    return img


def unpack(x: Tensor, height: int, width: int) -> Tensor:
    return rearrange(x, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=height // 2, w=width // 2, ph=2, pw=2)
