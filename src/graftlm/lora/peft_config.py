"""adapter_config.json: which modules of a PEFT LoRA carry a delta, and PEFT's factor for each.

Semantics follow PEFT (0.21) exactly: `target_modules` is a list of names (a module matches when
its full name equals one or ends with "." + one) or a regex matched with `re.fullmatch`;
`layers_to_transform` / `layers_pattern` restrict list matches to some layer indices;
`exclude_modules` wins over both. A module's rank and alpha come from the first `rank_pattern` /
`alpha_pattern` key that matches its full name as `(.*\\.)?{key}$`, else from `r` /
`lora_alpha`; the factor is alpha / r, or alpha / sqrt(r) with `use_rslora`.
Fields that select a LoRA variant graftlm does not compute are refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

CONFIG_FILE = "adapter_config.json"

# Config fields that change what the adapter computes and that graftlm does not implement.
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (use_dora): a learned magnitude per output row is not supported",
    "lora_bias": "lora_bias: LoRA B biases are not supported",
    "modules_to_save": "modules_to_save: fully saved layers are not supported (only LoRA deltas)",
    "trainable_token_indices": "trainable_token_indices: trainable token rows are not supported",
    "target_parameters": "target_parameters: LoRA on bare parameters (experts) is not supported",
    "layer_replication": "layer_replication: replicated layers are not supported",
    "use_qalora": "use_qalora: QA-LoRA is not supported",
    "use_bdlora": "use_bdlora: block-diagonal LoRA is not supported",
    "arrow_config": "arrow_config: Arrow routing is not supported",
    "velora_config": "velora_config: VeLoRA is not supported",
    "monteclora_config": "monteclora_config: MonteCLoRA is not supported",
    "kasa_config": "kasa_config: KaSA is not supported",
    "megatron_config": "megatron_config: Megatron-parallel layers are not supported",
}


@dataclass(frozen=True)
class PeftConfig:
    """The fields of adapter_config.json that decide which modules carry a LoRA and its factor."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: tuple[str, ...] | str | None = None
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()
    ensure_weight_tying: bool = False
    invocation_tokens: tuple[int, ...] = ()  # aLoRA

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """(r, alpha) of one module, after rank_pattern / alpha_pattern (PEFT's first match)."""
        r = next((v for k, v in self.rank_pattern.items() if _pattern_match(k, module)), self.r)
        a = next(
            (v for k, v in self.alpha_pattern.items() if _pattern_match(k, module)), self.lora_alpha
        )
        return r, a

    def scaling(self, module: str) -> float:
        r, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str) -> bool:
        """Whether PEFT would put a LoRA on `module` (peft's check_target_module_exists)."""
        ex = self.exclude_modules
        if ex and (re.fullmatch(ex, module) if isinstance(ex, str) else _name_in(module, ex)):
            return False
        tm = self.target_modules
        if tm is None:
            return False
        if isinstance(tm, str):
            if tm == "all-linear":  # PEFT's shorthand: every linear layer but the output head
                return module != "lm_head" and not module.endswith("embed_tokens")
            return re.fullmatch(tm, module) is not None
        if module in tm:
            return True
        if not _name_in(module, tm):
            return False
        if self.layers_to_transform is None:
            return True
        m = None
        if self.layers_pattern:
            for p in self.layers_pattern:
                m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
                if m:
                    break
        else:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        return m is not None and int(m.group("idx")) in self.layers_to_transform


def _pattern_match(key: str, module: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", module) is not None


def _name_in(module: str, names: tuple[str, ...]) -> bool:
    return module in names or any(module.endswith("." + n) for n in names)


def parse_config(raw: Any, where: str, problems: list[str]) -> PeftConfig | None:
    """Check adapter_config.json; append every refusal to `problems`. None when unusable."""
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a JSON object, got {type(raw).__name__}")
        return None
    ptype = raw.get("peft_type")
    if ptype != "LORA":
        problems.append(f"{where}: peft_type is {ptype!r}; only LORA adapters are supported")
        return None
    for key, why in _UNSUPPORTED.items():
        if raw.get(key):
            problems.append(f"{where}: {why} ({key} = {json.dumps(raw[key])})")
    if str(raw.get("init_lora_weights", "")).lower() == "mica":
        problems.append(
            f"{where}: init_lora_weights 'mica' selects the MiCA variant, which is not supported"
        )
    if raw.get("bias", "none") != "none":
        problems.append(f"{where}: bias = {raw['bias']!r}: trained base biases are not supported")

    def num(key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
        v = raw.get(key, default)
        if not _positive(v, kind):
            problems.append(f"{where}: {key} must be a positive number, got {v!r}")
            return None
        return v

    r = num("r", 8, int)
    alpha = num("lora_alpha", 8, (int, float))
    rank_pattern = _pattern_dict(
        raw.get("rank_pattern") or {}, int, "rank_pattern", where, problems
    )
    alpha_pattern = _pattern_dict(
        raw.get("alpha_pattern") or {}, (int, float), "alpha_pattern", where, problems
    )
    tm = raw.get("target_modules")
    ltt = raw.get("layers_to_transform")
    lp = raw.get("layers_pattern")
    if r is None or alpha is None:
        return None
    return PeftConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=rank_pattern,
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        target_modules=tm if isinstance(tm, str) or tm is None else tuple(tm),
        exclude_modules=_str_or_tuple(raw.get("exclude_modules")),
        layers_to_transform=(ltt,) if isinstance(ltt, int) else tuple(ltt) if ltt else None,
        layers_pattern=(lp,) if isinstance(lp, str) and lp else tuple(lp or ()),
        ensure_weight_tying=bool(raw.get("ensure_weight_tying", False)),
        invocation_tokens=tuple(raw.get("alora_invocation_tokens") or ()),
    )


def _str_or_tuple(v: Any) -> tuple[str, ...] | str | None:
    return v if isinstance(v, str) or v is None else tuple(v)


def _positive(v: Any, kind: type | tuple[type, ...]) -> bool:
    ok: bool = not isinstance(v, bool) and isinstance(v, kind)
    return ok and float(v) > 0


def _pattern_dict(
    d: Any, kind: type | tuple[type, ...], key: str, where: str, problems: list[str]
) -> dict[str, Any]:
    if not isinstance(d, dict) or not all(_positive(v, kind) for v in d.values()):
        problems.append(f"{where}: {key} must map module patterns to positive numbers, got {d!r}")
        return {}
    return dict(d)
