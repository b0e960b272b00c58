"""The user's wrapper: the reference ``Flux`` made loadable with ``from_pretrained`` by subclassing it
with diffusers' ModelMixin/ConfigMixin; the forward is the reference's, inherited unchanged."""
import sys
from pathlib import Path

from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flux_reference import Flux, FluxParams  # noqa: E402


class FluxReferenceTransformer(Flux, ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=16, vec_in_dim=16, context_in_dim=16, hidden_size=32, mlp_ratio=2.0,
                 num_heads=2, depth=2, depth_single_blocks=2, axes_dim=(4, 6, 6), theta=10000, guidance_embed=True):
        super().__init__(FluxParams(in_channels, vec_in_dim, context_in_dim, hidden_size, mlp_ratio, num_heads,
                                    depth, depth_single_blocks, list(axes_dim), theta, guidance_embed))
