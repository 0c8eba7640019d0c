"""Speculative decoding's flags: llama-server's (`--spec-type`, `--spec-draft-n-max`, ...) and
vLLM's (`--speculative-config` JSON), read into one `SpecConfig` (runtime/speculative.py)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from graftlm.runtime.speculative import SpecConfig

# llama-server's --spec-type values: its n-gram kinds all map to graftlm's one n-gram drafter
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
MODEL_TYPES = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--spec-type",
        default=None,
        metavar="TYPE",
        help="none (default), an n-gram type (" + ", ".join(NGRAM_TYPES) + "): tokens "
        "drafted from each request's own prompt and output, or draft-simple (with -md): "
        "verified in the step's batch, the output the same as without",
    )
    g.add_argument(
        "--spec-draft-n-max",
        type=int,
        default=None,
        metavar="N",
        help="most tokens drafted for a request in one step (default 16; fewer where its "
        "drafts are often wrong or the batch is full)",
    )
    g.add_argument(
        "--spec-draft-n-min",
        type=int,
        default=None,
        metavar="N",
        help="a shorter draft is not verified (default 0)",
    )
    g.add_argument(
        "--spec-draft-p-min",
        "--draft-p-min",
        type=float,
        default=None,
        metavar="P",
        help="a draft model's confidence floor (accepted for llama-server's command lines; "
        "n-gram drafts have no probability)",
    )
    g.add_argument(
        "--spec-ngram-simple-size-n",
        type=int,
        default=None,
        metavar="N",
        help="the longest n-gram looked up (default 5; shorter ones down to 2 are tried next)",
    )
    g.add_argument(
        "--spec-ngram-simple-size-m",
        type=int,
        default=None,
        metavar="M",
        help="the same as --spec-draft-n-max",
    )
    _add_synthetic_arguments(g)
    g.add_argument(
        "-md",
        "--model-draft",
        "--spec-draft-model",
        dest="model_draft",
        default=None,
        metavar="FNAME",
        help="a small GGUF model of the same vocabulary that drafts (llama-server's "
        "draft-simple; the kind of drafting once it is given)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
        '"prompt_lookup_min": M}, or {"method": "draft_model", "model": "draft.gguf", '
        '"num_speculative_tokens": K}',
    )


def _add_synthetic_arguments(g: argparse._ArgumentGroup) -> None:
    """llama.cpp's benchmarking aid: drafts kept by chance."""
    g.add_argument(
        "--spec-synth-rates",
        default=None,
        metavar="P0,P1,...",
        help="llama.cpp's benchmarking aid: drafted tokens are kept by chance, not by the "
        "model (the output is not the model's): the unconditional chance that the first i + 1 "
        "are kept, one per draft place (--spec-draft-n-max of them, non-increasing)",
    )
    g.add_argument(
        "--spec-synth-len",
        type=float,
        default=None,
        metavar="L",
        help="llama.cpp's benchmarking aid: as --spec-synth-rates, with geometric rates whose "
        "mean accepted length, the model's own token included, is L",
    )


def spec_config(args: argparse.Namespace) -> SpecConfig | None:
    """The server's speculative decoding from its flags (None: off); ValueError naming the
    flag for a bad one."""
    from graftlm.errors import RequestError
    from graftlm.runtime.speculative import SpecConfig

    kind = args.spec_type
    vllm = args.speculative_config
    draft = args.model_draft
    fields: dict[str, Any] = {}
    names: dict[str, str] = {}  # field -> the flag or key that gave it (for the error)
    if vllm is not None:
        if kind is not None:
            raise ValueError("give --spec-type or --speculative-config, not both")
        fields, names = _vllm_fields(vllm)
        if fields.get("method") == "draft":
            if draft is not None:
                raise ValueError("give the draft model by -md or in --speculative-config, not both")
            args.model_draft = fields.pop("model")
    elif kind is None and draft is not None:
        fields["method"] = "draft"  # -md alone: llama-server's draft-simple
    elif kind is None or kind == "none":
        if args.spec_synth_rates is not None or args.spec_synth_len is not None:
            raise ValueError(
                "synthetic acceptance (--spec-synth-rates, --spec-synth-len) needs speculative "
                "decoding (--spec-type, -md)"
            )
        return None
    else:
        kinds = [k.strip() for k in kind.split(",") if k.strip()]
        known = (*NGRAM_TYPES, "draft-simple")
        bad = [k for k in kinds if k not in known]
        if bad:
            why = "not supported" if any(k in MODEL_TYPES for k in bad) else "unknown type"
            raise ValueError(
                f"--spec-type {kind}: {', '.join(bad)}: {why} (supported: none, "
                + ", ".join(known)
                + ")"
            )
        if "draft-simple" in kinds:
            if len(set(kinds)) > 1:
                raise ValueError(f"--spec-type {kind}: one kind of drafting at a time")
            if draft is None:
                raise ValueError("--spec-type draft-simple needs a draft model (-md FILE)")
            fields["method"] = "draft"
        elif draft is not None:
            raise ValueError(
                f"-md {draft} with --spec-type {kind}: n-gram drafting needs no draft model"
            )
    for flag, name, value in (
        ("--spec-draft-n-max", "n_max", args.spec_draft_n_max),
        ("--spec-ngram-simple-size-m", "n_max", args.spec_ngram_simple_size_m),
        ("--spec-draft-n-min", "n_min", args.spec_draft_n_min),
        ("--spec-draft-p-min", "p_min", args.spec_draft_p_min),
        ("--spec-ngram-simple-size-n", "lookup_max", args.spec_ngram_simple_size_n),
    ):
        if value is not None:
            fields[name], names[name] = value, flag
    # one lookup length given: the other's default moves out of its way
    if "lookup_max" in fields and "lookup_min" not in fields:
        fields["lookup_min"] = min(2, fields["lookup_max"])
    if "lookup_min" in fields and "lookup_max" not in fields:
        fields["lookup_max"] = max(5, fields["lookup_min"])
    try:
        synth = _synth_rates(args, fields.get("n_max", SpecConfig.n_max))
        if synth:
            fields["synth_rates"] = synth
            names["synth_rates"] = (
                "--spec-synth-len" if args.spec_synth_len is not None else "--spec-synth-rates"
            )
        return SpecConfig(**fields)
    except RequestError as exc:
        named = ", ".join(f"{names.get(k, k)} {v}" for k, v in fields.items())
        raise ValueError(f"speculative decoding ({named}): {exc}") from None


def _synth_rates(args: argparse.Namespace, n_max: int) -> tuple[float, ...]:
    """--spec-synth-rates or --spec-synth-len as rates (RequestError with llama.cpp's message
    for a bad one)."""
    from graftlm.errors import RequestError
    from graftlm.runtime.speculative import synth_rates_of_length

    rates, length = args.spec_synth_rates, args.spec_synth_len
    if rates is not None and length is not None:
        raise RequestError("synthetic acceptance length and rates are mutually exclusive")
    if length is not None:
        return synth_rates_of_length(length, n_max)
    if rates is None:
        return ()
    try:
        return tuple(float(x) for x in rates.split(","))
    except ValueError:
        raise RequestError(
            f"--spec-synth-rates {rates}: expected numbers separated by commas"
        ) from None


# vLLM's speculative_config keys -> SpecConfig's fields
_VLLM_KEYS = {
    "num_speculative_tokens": "n_max",
    "prompt_lookup_max": "lookup_max",
    "prompt_lookup_min": "lookup_min",
}


def _vllm_fields(text: str) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's JSON as SpecConfig's fields, and the key that gave each."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--speculative-config: expected a JSON object, got {text!r}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(
            f"--speculative-config: unsupported keys {unknown} (known: {sorted(known)})"
        )
    method = cfg.get("method", "ngram" if "model" not in cfg else "draft_model")
    fields: dict[str, Any] = {}
    if method == "draft_model":
        if not isinstance(cfg.get("model"), str):
            raise ValueError("--speculative-config: method draft_model needs model, a GGUF file")
        fields.update(method="draft", model=cfg["model"])
    elif method != "ngram" or "model" in cfg:
        raise ValueError(
            f"--speculative-config: method {method!r} is not supported (supported: ngram, "
            "draft_model with a GGUF model)"
        )
    for key, name in _VLLM_KEYS.items():
        if key in cfg:
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"--speculative-config: {key} must be a whole number, got {v!r}")
            fields[name] = v
    return fields, {name: key for key, name in _VLLM_KEYS.items()}
