"""Fixtures for the PEFT tests: the real fixture adapters and their bases, and PEFT adapters made
on the tiny Hugging Face checkpoints (../shared/fixtures/tiny) with PEFT itself.

Only fixtures live here (no helpers to import): tests elsewhere import names from "conftest", and a
module under that name in this folder must not be mistaken for theirs.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from shared_data import TINY

import graftlm


@pytest.fixture(scope="session")
def real_base() -> Callable[[str], Path]:
    """family -> path of its real base model (skips when the package is missing)."""

    def get(family: str) -> Path:
        from graftlm.resources import default_model_path, gemma3_path

        try:
            return default_model_path() if family == "smollm2" else gemma3_path()
        except Exception as exc:  # not installed here
            pytest.skip(f"{family} base is not available: {exc}")

    return get


@pytest.fixture(scope="session")
def real_model(real_base: Callable[[str], Path]) -> Callable[[str], graftlm.Model]:
    """family -> the real model loaded once per session (adapters are added and removed)."""
    cache: dict[str, graftlm.Model] = {}

    def get(family: str) -> graftlm.Model:
        if family not in cache:
            # reference: float32 weights, the quickest to build and run on a busy CPU; adapters
            # resolve the same on either path
            cache[family] = graftlm.load(real_base(family), ctx_size=256, reference=True)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def hf_tiny() -> Callable[[str], Any]:
    """family -> a fresh transformers model of the tiny checkpoint (float32, eval)."""
    transformers = pytest.importorskip("transformers")

    def get(family: str) -> Any:
        d = TINY / family / "hf"
        if not d.is_dir():
            pytest.skip(f"{d} is not available")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        return model.eval()

    return get


@pytest.fixture
def make_peft(hf_tiny: Callable[[str], Any], tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    """make_peft(family, name, **LoraConfig kwargs) -> (adapter dir, PEFT model).

    PEFT initializes lora_B to zero, so A and B are re-drawn (seeded) to make every delta count;
    `edit(config_dict)` may then rewrite adapter_config.json (for refusals PEFT would not save)."""
    peft = pytest.importorskip("peft")

    def make(
        family: str,
        name: str = "a",
        seed: int = 0,
        std: float = 0.3,
        edit: Callable[[dict[str, Any]], None] | None = None,
        **kwargs: Any,
    ) -> tuple[Path, Any]:
        model = hf_tiny(family)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = peft.get_peft_model(model, peft.LoraConfig(**kwargs))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in pm.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        out = tmp_path / name
        if out.exists():
            shutil.rmtree(out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm.save_pretrained(out)
        if edit is not None:
            cfg_path = out / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            edit(cfg)
            cfg_path.write_text(json.dumps(cfg))
        return out, pm.eval()

    return make


@pytest.fixture(scope="session")
def tiny_base() -> Callable[[str], Path]:
    """family -> its tiny GGUF base converted by llama.cpp (float32)."""

    def get(family: str) -> Path:
        p = TINY / family / "model-f32.gguf"
        if not p.exists():
            pytest.skip(f"{p} is not available")
        return p

    return get


@pytest.fixture
def one_thread() -> Any:
    """Tiny models: one thread is fastest, and two spin against each other on a shared machine.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", params=["qwen3moe", "mixtral"])
def expert_made(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """The tiny Qwen3-MoE's and Mixtral's expert adapters (expert_made.routed_made), made once a
    session: test_expert_lora.py's and test_prompt_routed_ffn.py's."""
    from expert_made import routed_made

    return routed_made(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def gpt_oss_made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny gpt-oss's expert adapter (expert_made.gpt_oss_made), made once a session:
    test_gpt_oss_expert_lora.py's and test_prompt_routed_ffn.py's."""
    from expert_made import gpt_oss_made as made

    return made(tmp_path_factory)
