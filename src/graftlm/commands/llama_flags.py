"""llama.cpp's flags that graftlm does not implement but that people type from habit.

Each is declared so that it is never read as something else (`-ngl 99` as `-n gl`, `-fa` as
`-f a`), then either mapped, noted as having no effect here (one line on stderr), or refused with
one line that says why (`-hf`: graftlm downloads nothing). `run -ctk/-ctv` choose the KV cache
type (serve declares its own). `--version` prints graftlm's version,
torch's and whether the native kernels are on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from graftlm.errors import GraftError

_SERVER_ONLY = ("cont_batching", "no_cont_batching")


def add_llama_flags(
    p: argparse.ArgumentParser, server: bool = False, cache_types: bool = True
) -> None:
    """The flags on `p`; `cache_types`: -ctk/-ctv too (`cache_type` reads them)."""
    g = p.add_argument_group("llama.cpp flags: noted where they have no effect, or refused")
    _add_placement_flags(g)
    _add_batch_flags(g, server)
    _add_download_flags(g)
    if cache_types:
        _add_cache_type_flags(g)
    if server:
        _add_server_flags(g)


def _add_placement_flags(g: argparse._ArgumentGroup) -> None:
    """Where weights and attention run: graftlm decides (-ngl, -fa, --mlock, --no-mmap)."""
    g.add_argument(
        "-ngl",
        "--n-gpu-layers",
        "--gpu-layers",
        dest="n_gpu_layers",
        default=None,
        metavar="N",
        help="no effect: the whole model runs on --device (cpu, or cuda for a GPU)",
    )
    g.add_argument(
        "-fa",
        "--flash-attn",
        dest="flash_attn",
        nargs="?",
        const="on",
        default=None,
        metavar="on|off|auto",
        help="no effect: attention is always fused (native kernels on the CPU)",
    )
    g.add_argument("--mlock", action="store_true", help="no effect: weights are memory-mapped")
    g.add_argument(
        "--no-mmap",
        dest="no_mmap",
        action="store_true",
        help="no effect: weights are memory-mapped",
    )
    g.add_argument("--mmap", dest="mmap", action="store_true", help=argparse.SUPPRESS)


def _add_batch_flags(g: argparse._ArgumentGroup, server: bool) -> None:
    """-b / -ub (serve maps -b), and --numa."""
    g.add_argument(
        "-b",
        "--batch-size",
        dest="batch_size",
        type=int,
        default=None,
        metavar="N",
        help="the most prompt tokens one step computes (default 512)"
        if server
        else "no effect: graftlm chooses its own prompt chunks",
    )
    g.add_argument(
        "-ub",
        "--ubatch-size",
        dest="ubatch_size",
        type=int,
        default=None,
        metavar="N",
        help="no effect: graftlm chooses its own prompt chunks",
    )
    g.add_argument("--numa", default=None, metavar="TYPE", help="no effect")


def _add_download_flags(g: argparse._ArgumentGroup) -> None:
    """-hf and its kin: refused, graftlm downloads nothing."""
    g.add_argument(
        "-hf",
        "-hfr",
        "--hf-repo",
        dest="hf_repo",
        default=None,
        metavar="REPO",
        help="refused: graftlm downloads nothing; download the GGUF file and pass -m FILE",
    )
    g.add_argument("-hff", "--hf-file", dest="hf_file", default=None, help=argparse.SUPPRESS)
    g.add_argument("-mu", "--model-url", dest="model_url", default=None, help=argparse.SUPPRESS)


def _add_cache_type_flags(g: argparse._ArgumentGroup) -> None:
    """-ctk / -ctv: the KV cache type (`cache_type` reads them)."""
    g.add_argument(
        "-ctk",
        "--cache-type-k",
        dest="cache_type_k",
        default=None,
        metavar="TYPE",
        help="KV cache type, as llama.cpp names it: f16 (default), bf16, f32, q8_0; K and V "
        "share one type",
    )
    g.add_argument(
        "-ctv",
        "--cache-type-v",
        dest="cache_type_v",
        default=None,
        metavar="TYPE",
        help="the same as -ctk (K and V share one type)",
    )


def _add_server_flags(g: argparse._ArgumentGroup) -> None:
    """llama-server's continuous batching switches."""
    g.add_argument(
        "-cb",
        "--cont-batching",
        dest="cont_batching",
        action="store_true",
        help="always on: requests are batched continuously",
    )
    g.add_argument(
        "-nocb",
        "--no-cont-batching",
        dest="no_cont_batching",
        action="store_true",
        help="refused: continuous batching cannot be turned off",
    )


def llama_flag_notes(args: argparse.Namespace, maps_batch: bool = False) -> list[str]:
    """One note per llama.cpp flag given that has no effect; GraftError for one that is refused.
    maps_batch: the command takes -b as the most prompt tokens one step prefills (serve)."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    for name, flag in (("hf_repo", "-hf"), ("hf_file", "-hff"), ("model_url", "-mu")):
        if get(name):
            raise GraftError(
                f"{flag} {get(name)}: graftlm does not download models; download the GGUF file "
                "(e.g. `huggingface-cli download REPO FILE.gguf`) and pass it with -m FILE"
            )
    if get("no_cont_batching"):
        raise GraftError("--no-cont-batching: graftlm always batches requests continuously")
    device = str(get("device") or "cpu")
    notes = []
    if get("n_gpu_layers") is not None:
        where = (
            "runs on the CPU (--device cuda puts every layer on the GPU)"
            if device == "cpu"
            else f"is on {device} whole"
        )
        notes.append(f"-ngl {get('n_gpu_layers')}: no effect; the model {where}")
    if get("flash_attn") is not None:
        notes.append(f"-fa {get('flash_attn')}: no effect; graftlm's attention is always fused")
    if get("mlock") or get("no_mmap") or get("mmap"):
        notes.append("--mlock/--no-mmap: no effect; weights are memory-mapped from the file")
    if maps_batch:
        if get("ubatch_size") is not None:
            notes.append("-ub: no effect; -b sets the prompt tokens one step prefills")
    elif get("batch_size") is not None or get("ubatch_size") is not None:
        notes.append("-b/-ub: no effect; graftlm chooses its own prompt chunks")
    if get("numa") is not None:
        notes.append("--numa: no effect")
    if get("cont_batching"):
        notes.append("--cont-batching: always on")
    return notes


def cache_type(args: argparse.Namespace) -> str | None:
    """The KV cache type -ctk / -ctv ask for (None: the default). graftlm keeps K and V in one
    type, so two different ones are refused."""
    k, v = getattr(args, "cache_type_k", None), getattr(args, "cache_type_v", None)
    if k is not None and v is not None and k.lower() != v.lower():
        raise GraftError(
            f"-ctk {k} -ctv {v}: graftlm keeps K and V in one type; give the same to both"
        )
    chosen = (k or v or "").lower()
    if not chosen:
        return None
    from graftlm.step.kv_cache import KV_TYPES

    if chosen not in KV_TYPES:  # before the model loads
        raise GraftError(
            f"-ctk/-ctv {chosen}: cache type {chosen!r} is not supported; use one of "
            f"{', '.join(KV_TYPES)}"
        )
    return chosen


def check_llama_flags(args: argparse.Namespace, maps_batch: bool = False) -> None:
    """Print the notes (stderr, one line each); raise GraftError for a refused flag."""
    for note in llama_flag_notes(args, maps_batch):
        print(f"note: {note}", file=sys.stderr)


def version_text() -> str:
    """graftlm's version, torch's, and whether the native kernels are on (and why not)."""
    import torch

    import graftlm
    from graftlm.native import build

    reason = build.unavailable_reason()
    feats = build.features()
    if "amx" in feats:  # compiled in; in use only where Linux granted the tiles and rows > 0
        rows = build.amx_rows() if build.amx() else 0
        feats[feats.index("amx")] = f"amx from {rows} rows" if rows else "amx unused"
    extra = ", ".join(feats) or "AVX2 + FMA"
    native = (
        f"on ({extra}; GRAFTLM_NATIVE_ISA={build.isa()})" if reason is None else f"off ({reason})"
    )
    return (
        f"graftlm {graftlm.__version__}\n"
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        f"{', CUDA ' + str(torch.version.cuda) if torch.cuda.is_available() else ''}\n"
        f"native kernels: {native}"
    )


class VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_text())
        parser.exit(0)
