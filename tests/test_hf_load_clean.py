"""Every export loads in transformers without a warning (swarm/hf/): a volunteer who loads the model reads a
warning as something wrong. GPT and Llama folders, with the byte vocabulary (no special tokens: the config says
so, or transformers fills in its own ids, 50256 outside a 256-id vocabulary for GPT-2) and with a BPE that has an
end-of-text token; each is loaded, its tokenizer too, and generates with max_new_tokens as the README shows."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.architectures.model import build_full_model
from swarm.dataset.tokenizer import ENDOFTEXT, train_tokenizer
from swarm.hf.folder import write_hf_folder
from swarm.manifests.validation import manifest_from_dict

transformers = pytest.importorskip("transformers")

TEXTS = ["a small text to train a tokenizer on, again and again " * 20, f"two documents {ENDOFTEXT} in one"]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
@pytest.mark.parametrize("vocabulary", ["bytes", "bpe"])
def test_an_export_loads_and_generates_without_a_warning(architecture, vocabulary, tmp_path):
    model = {"depth": 2, "architecture": architecture}
    if architecture == "llama":
        model.update(kv_heads=1, intermediate_size=64)
    tokenizer = train_tokenizer(TEXTS, 300) if vocabulary == "bpe" else None
    if tokenizer is not None:
        model["vocab_size"] = 300
    manifest = manifest_from_dict(tiny_manifest_dict(model=model))
    tensors = {name: t.detach() for name, t in build_full_model(manifest.model).state_dict().items()}
    specials = {"eos_token": ENDOFTEXT if tokenizer else None, "bos_token": None}
    write_hf_folder(tmp_path, manifest, tensors, {}, tokenizer.json_text if tokenizer else None, specials)

    config = json.loads((tmp_path / "config.json").read_text())
    eos = tokenizer.eos_id if tokenizer else None
    assert config["eos_token_id"] == eos and config["bos_token_id"] is None, config
    collected = Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(collected)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
            hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
            prompt = torch.tensor([hf_tokenizer.encode("a small")])
            out = loaded.generate(prompt, max_new_tokens=5, pad_token_id=eos if eos is not None else 0)
    finally:
        logger.removeHandler(collected)
    assert collected.messages == []
    assert out.shape[1] <= prompt.shape[1] + 5
    assert loaded.config.eos_token_id == eos and loaded.config.bos_token_id is None
