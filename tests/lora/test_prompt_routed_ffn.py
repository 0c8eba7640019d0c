"""A prompt's routed FFN in one native call a layer (gl_moe_ffn) against its composed twin
(models/moe.py's moe_ffn, models/gpt_oss.py's routed_ffn) with expert adapters: the tiny Qwen3-MoE
and Mixtral (tests/lora/test_expert_lora.py's adapters) and gpt-oss
(tests/lora/test_gpt_oss_expert_lora.py's), on this CPU's build and the AVX2 and ymm-only ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from expert_made import mxfp4_base

import graftlm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("quant", ["q8_0", "f32"])
def test_prompt_routed_ffn_in_one_native_call(expert_made: dict[str, Any], quant: str) -> None:
    """A prompt's routed FFN in one native call a layer (gl_moe_ffn) against the composed one
    (moe_ffn): rows on different adapters and scales, a row without (routed_twins)."""
    from routed_twins import check_twins

    m = graftlm.load(expert_made["base"].parent / f"model-{quant}.gguf", ctx_size=64, n_seq=4)
    a = m.add_lora(expert_made["tmp"] / "params", 0.0)
    b = m.add_lora(expert_made["tmp"] / "lora.gguf", 0.0)
    check_twins(m, [{a: 1.0}, {b: -0.5}, {}, {a: 0.5, b: 0.25}])


TWINS = """
import sys, torch, graftlm
from routed_twins import check_twins
from graftlm.native import isa
torch.set_num_threads(1)
m = graftlm.load(sys.argv[1], ctx_size=64, n_seq=4)
a, b = m.add_lora(sys.argv[2], 0.0), m.add_lora(sys.argv[3], 0.0)
check_twins(m, [{a: 1.0}, {b: -0.5}, {}, {a: 0.5, b: 0.25}])
print(isa())
"""


@pytest.mark.parametrize("isa", ["avx2", "ymm"])
def test_prompt_routed_ffn_of_the_other_builds(expert_made: dict[str, Any], isa: str) -> None:
    """test_prompt_routed_ffn_in_one_native_call on the AVX2 and ymm-only builds, in a
    subprocess each (as tests/native/test_isa.py builds them)."""
    import os

    from graftlm.native import features

    if not features():
        pytest.skip("this CPU's variant is the AVX2 one")
    if isa == "ymm" and "zmm-vnni" not in features():
        pytest.skip("no 512-bit VNNI kernels on this CPU: the ymm variant is this one")
    env = {**os.environ, "GRAFTLM_NATIVE_ISA": isa, "GRAFTLM_AMX_ROWS": "0"}
    here = str(Path(__file__).resolve().parents[1])  # routed_twins, made_families: tests/'s
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    path = expert_made["base"].parent / "model-q8_0.gguf"
    args = [str(path), str(expert_made["tmp"] / "params"), str(expert_made["tmp"] / "lora.gguf")]
    done = subprocess.run([sys.executable, "-c", TWINS, *args], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == isa


@pytest.mark.parametrize("quant", ["q8_0", "f32", "mxfp4"])
def test_gpt_oss_prompt_routed_ffn_in_one_native_call(
    gpt_oss_made: dict[str, Any], quant: str, tmp_path: Path
) -> None:
    """gpt-oss's prompt routed FFN (biases, clamped SwiGLU, the softmax of the chosen) in one
    native call a layer (gl_moe_ffn) against routed_ffn: rows on different adapters and
    scales, a row without (routed_twins)."""
    from routed_twins import check_twins

    path = gpt_oss_made["folder"] / f"model-{quant}.gguf"
    if quant == "mxfp4":
        path = mxfp4_base(gpt_oss_made["base"], tmp_path / "mxfp4.gguf")
    m = graftlm.load(path, ctx_size=64, n_seq=4)
    a = m.add_lora(gpt_oss_made["tmp"] / "params", 0.0)
    b = m.add_lora(gpt_oss_made["tmp"] / "lora.gguf", 0.0)
    check_twins(m, [{a: 1.0}, {b: -0.5}, {}, {a: 0.5, b: 0.25}])
