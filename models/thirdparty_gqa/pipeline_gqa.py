"""GQAPipeline — an example of a user's own text-to-image pipeline, not part of diffusers.

Components: ``transformer`` (any model with the GQATransformer2DModel call signature, passed in
by the caller or loaded from ``transformer_gqa.py``), ``vae`` (diffusers AutoencoderKL),
``text_encoder`` / ``tokenizer`` (transformers T5), ``scheduler`` (diffusers
FlowMatchEulerDiscreteScheduler). The denoising loop is written out in ``__call__``: flow
matching (the transformer predicts velocity = noise - image), and classifier-free guidance as two
separate transformer calls per step (conditional, then unconditional) when ``guidance_scale > 1``.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor


class GQAPipeline(DiffusionPipeline):
    model_cpu_offload_seq = "text_encoder->transformer->vae"

    def __init__(self, transformer, vae: AutoencoderKL, text_encoder, tokenizer, scheduler: FlowMatchEulerDiscreteScheduler):
        super().__init__()
        self.register_modules(
            transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
        )
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

    @torch.no_grad()
    def encode_prompt(self, prompt: list[str], max_sequence_length: int, device) -> torch.Tensor:
        tokens = self.tokenizer(
            prompt, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
        )
        return self.text_encoder(tokens.input_ids.to(device))[0]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        height: int = 64,
        width: int = 64,
        num_inference_steps: int = 20,
        guidance_scale: float = 4.0,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        max_sequence_length: int = 32,
        output_type: str = "pil",
        return_dict: bool = True,
    ):
        device = self._execution_device
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch = len(prompts)
        dtype = self.transformer.dtype

        # 1. text
        prompt_embeds = self.encode_prompt(prompts, max_sequence_length, device).to(dtype)
        do_cfg = guidance_scale > 1.0
        if do_cfg:
            negative = negative_prompt if negative_prompt is not None else ""
            negatives = [negative] * batch if isinstance(negative, str) else list(negative)
            negative_embeds = self.encode_prompt(negatives, max_sequence_length, device).to(dtype)

        # 2. noise
        channels = self.vae.config.latent_channels
        shape = (batch, channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)

        # 3. schedule: sigmas from 1 (noise) towards 0 (image); the scheduler applies its shift
        sigmas = np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)
        self.scheduler.set_timesteps(sigmas=sigmas, device=device)

        # 4. denoising loop
        for t in self.progress_bar(self.scheduler.timesteps):
            timestep = (t / 1000.0).expand(batch).to(dtype)
            velocity = self.transformer(
                hidden_states=latents, encoder_hidden_states=prompt_embeds, timestep=timestep
            ).sample
            if do_cfg:
                velocity_uncond = self.transformer(
                    hidden_states=latents, encoder_hidden_states=negative_embeds, timestep=timestep
                ).sample
                velocity = velocity_uncond + guidance_scale * (velocity - velocity_uncond)
            latents = self.scheduler.step(velocity, t, latents).prev_sample

        # 5. decode
        if output_type == "latent":
            image = latents
        else:
            latents = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
            image = self.vae.decode(latents.to(self.vae.dtype)).sample
            image = self.image_processor.postprocess(image, output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)
