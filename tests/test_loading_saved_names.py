"""A model folder built by the user's own script records the user's module names in model_index.json
(``from my_transformer import ...`` saves ``["my_transformer", "MyNet"]``); ditbook imports the card's
source files under names of its own, and the load must still find them (public reference code, issue 39)."""

import subprocess
import sys
import textwrap

import yaml

from ditbook.card import load_card
from ditbook.loading import load_pipeline, saved_source_names

TRANSFORMER = '''
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config


class Net39(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, dim=4):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin(x)
'''
PIPELINE = '''
import torch
from diffusers import DiffusionPipeline


class Pipe39(DiffusionPipeline):
    def __init__(self, transformer, helper):
        super().__init__()
        self.register_modules(transformer=transformer, helper=helper)

    def __call__(self, prompt="", generator=None):
        return self.helper(self.transformer(torch.ones(1, 4)))
'''


def test_user_built_folder_loads(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "net39_transformer.py").write_text(TRANSFORMER)
    (code / "pipe39_pipeline.py").write_text(PIPELINE)
    build = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(code)!r})
        from net39_transformer import Net39
        from pipe39_pipeline import Pipe39
        Pipe39(transformer=Net39(), helper=Net39()).save_pretrained({str(tmp_path / 'model')!r})
    """)
    subprocess.run([sys.executable, "-c", build], check=True)
    card_file = tmp_path / "card.yaml"
    card_file.write_text(yaml.safe_dump({
        "name": "saved-names", "path": str(tmp_path / "model"),
        "pipeline": {"class": "Pipe39", "source": "code/pipe39_pipeline.py"},
        "transformer": {"class": "Net39", "source": "code/net39_transformer.py"},
        "generation": {"prompts": ["x"]}, "runtime": {"device": "cpu", "dtype": "float32"}}))
    card = load_card(card_file)
    names = saved_source_names(card)
    assert names == {"net39_transformer": str(code / "net39_transformer.py")}, names
    pipe = load_pipeline(card)   # before: ValueError "net39_transformer is not one of the libraries ..."
    assert type(pipe.helper).__name__ == "Net39" and type(pipe.helper) is type(pipe.transformer)
    assert "net39_transformer" not in sys.modules   # the alias stood for the load only
