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
MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--spec-type",
        default=None,
        metavar="TYPE",
        help="none (default) or an n-gram type (" + ", ".join(NGRAM_TYPES) + "): tokens "
        "drafted from each request's own prompt and output, verified in the step's batch; the "
        "output is the same as without",
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
    g.add_argument(
        "-md",
        "--model-draft",
        "--spec-draft-model",
        dest="model_draft",
        default=None,
        metavar="FNAME",
        help="a draft model (not supported yet: refused, rather than run without it)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
        '"prompt_lookup_min": M}',
    )


def spec_config(args: argparse.Namespace) -> SpecConfig | None:
    """The server's speculative decoding from its flags (None: off); ValueError naming the
    flag for a bad one."""
    from graftlm.errors import RequestError
    from graftlm.runtime.speculative import SpecConfig

    kind = args.spec_type
    vllm = args.speculative_config
    if getattr(args, "model_draft", None):
        raise ValueError(
            f"-md {args.model_draft}: speculative decoding with a draft model is not supported "
            "yet; n-gram drafting needs no second model (--spec-type ngram-simple)"
        )
    fields: dict[str, Any] = {}
    if vllm is not None:
        if kind is not None:
            raise ValueError("give --spec-type or --speculative-config, not both")
        fields = _vllm_fields(vllm)
    elif kind is None or kind == "none":
        return None
    else:
        kinds = [k.strip() for k in kind.split(",") if k.strip()]
        bad = [k for k in kinds if k not in NGRAM_TYPES]
        if bad:
            why = (
                "draft-model speculation is not supported yet"
                if any(k in MODEL_TYPES for k in bad)
                else "unknown type"
            )
            raise ValueError(
                f"--spec-type {kind}: {', '.join(bad)}: {why} (supported: none, "
                + ", ".join(NGRAM_TYPES)
                + ")"
            )
    for flag, name, value in (
        ("--spec-draft-n-max", "n_max", args.spec_draft_n_max),
        ("--spec-ngram-simple-size-m", "n_max", args.spec_ngram_simple_size_m),
        ("--spec-draft-n-min", "n_min", args.spec_draft_n_min),
        ("--spec-draft-p-min", "p_min", args.spec_draft_p_min),
        ("--spec-ngram-simple-size-n", "lookup_max", args.spec_ngram_simple_size_n),
    ):
        if value is not None:
            fields[name] = value
            fields.setdefault("_flags", {})[name] = flag
    flags = fields.pop("_flags", {})
    if "lookup_max" in fields and "lookup_min" not in fields:
        fields["lookup_min"] = min(2, fields["lookup_max"])
    try:
        return SpecConfig(**fields)
    except RequestError as exc:
        named = ", ".join(f"{flags.get(k, k)} {v}" for k, v in fields.items())
        raise ValueError(f"speculative decoding ({named}): {exc}") from None


def _vllm_fields(text: str) -> dict[str, Any]:
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
    method = cfg.get("method", "ngram" if "model" not in cfg else None)
    if method != "ngram" or "model" in cfg:
        raise ValueError(
            f"--speculative-config: method {method!r} is not supported (supported: ngram; "
            "draft models are not supported yet)"
        )
    fields: dict[str, Any] = {}
    for key, name in (
        ("num_speculative_tokens", "n_max"),
        ("prompt_lookup_max", "lookup_max"),
        ("prompt_lookup_min", "lookup_min"),
    ):
        if key in cfg:
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"--speculative-config: {key} must be a whole number, got {v!r}")
            fields[name] = v
    if "lookup_max" in fields and "lookup_min" not in fields:
        fields["lookup_min"] = min(2, fields["lookup_max"])
    if "lookup_min" in fields and "lookup_max" not in fields:
        fields["lookup_max"] = max(5, fields["lookup_min"])
    fields["_flags"] = {
        "n_max": "num_speculative_tokens",
        "lookup_max": "prompt_lookup_max",
        "lookup_min": "prompt_lookup_min",
    }
    return fields
