"""A real uvicorn server on 127.0.0.1 over a tiny random model, plus a reference model in-process.

The server: adapter `a0` pinned through --lora at scale 0 (id 0), `alpha` and `beta` as
--lora-modules (attached on first use), runtime loading on. The reference: the same model file
with the same adapters attached in a known order, driven directly through its engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai"):
    pytest.importorskip(_extra)  # the server's extras: no server tests without them

from server_fixtures import PARALLEL, SPEC, TinyServer  # noqa: E402
from tiny_models import write_tiny_adapter, write_tiny_model  # noqa: E402

import graftlm  # noqa: E402
from graftlm.runtime.service import EngineService  # noqa: E402
from graftlm.server.app import ServerThread, build_state, create_app  # noqa: E402
from graftlm.server.state import ServerConfig  # noqa: E402


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("server")
    files = {"model": write_tiny_model(d / "tiny.gguf", SPEC)}
    for k, name in enumerate(["a0", "alpha", "beta", "gamma", "delta"]):
        files[name] = write_tiny_adapter(d / f"{name}.gguf", SPEC, seed=11 + k)
    broken = d / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00 this is not an adapter")
    files["broken"] = broken
    return files


@pytest.fixture
def svc(tiny_files: dict[str, Path]) -> Iterator[EngineService]:
    """An engine service over the tiny model (3 sequences), for the registry's own tests."""
    model = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=3)
    service = EngineService(model.engine, model.prompter, model.adapters).start()
    yield service
    service.close()


@pytest.fixture(scope="session")
def server(
    tiny_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TinyServer]:
    model = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=PARALLEL + 1)
    config = ServerConfig(
        model_name="tiny",
        allow_runtime_lora=True,
        extra_model_names=("tiny.gguf",),
        lora_dirs=(tmp_path_factory.getbasetemp().resolve(),),  # the tests' own folders
    )
    state = build_state(
        model,
        config,
        parallel=PARALLEL,
        lora=[(str(tiny_files["a0"]), 0.0)],
        lora_modules=[("alpha", str(tiny_files["alpha"])), ("beta", str(tiny_files["beta"]))],
    )
    ref = graftlm.load(tiny_files["model"], ctx_size=SPEC.n_ctx, n_seq=1)
    names = ["a0", "alpha", "beta", "gamma", "delta"]
    ref_ids = {name: ref.add_lora(tiny_files[name], scale=0.0) for name in names}
    srv = ServerThread(create_app(state)).start()
    try:
        yield TinyServer(
            srv.url, state, tiny_files["model"], {k: tiny_files[k] for k in names}, ref, ref_ids
        )
    finally:
        srv.stop()
        state.service.close()
