"""The user's wrapper: a ModelMixin/ConfigMixin that holds the reference network as an attribute
(``self.net``) and hands its forward every argument; the network's own forward runs the loops."""
import sys
from pathlib import Path

from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from network import TinyMMNet  # noqa: E402


class HeldNetTransformer(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, in_channels=4, dim=32, heads=4, depth=2, depth_joined=2, vocab=64, tokens=16):
        super().__init__()
        self.net = TinyMMNet(in_channels, dim, heads, depth, depth_joined, vocab, tokens)

    def forward(self, **kwargs):
        return self.net(**kwargs)
